"""Disaggregated serving end to end, real processes on loopback: prefill and decode replicas behind the router give
the answers of one combined (`both`) engine, streaming and not, through both hand-off paths, 1P1D and 2P1D; killing
a prefill replica mid-run loses no request."""
from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
import pytest

from deepinfer.router.config import PoolConfig, RouterConfig
from tests.disagg.conftest import RouterThread, replicas

TIMEOUT_S = "3"
COMPLETION = {"prompt": "The harbour master kept a log of every ship that entered the bay. " * 3, "max_tokens": 16,
              "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Tell me about the lighthouse on the northern cape."}],
        "max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 7, "logprobs": True, "top_logprobs": 3}


@pytest.fixture(scope="module")
def deployment(tiny_model, tmp_path_factory):
    store = ("--kv-store", "disk", "--kv-store-path", str(tmp_path_factory.mktemp("kv-store")))
    timeout = ("--kv-handoff-timeout", TIMEOUT_S)
    with replicas(tiny_model, ("--role", "both"),
                  ("--role", "prefill", "--kv-handoff", "store", *store, *timeout),
                  ("--role", "prefill", "--kv-handoff", "direct", *timeout),
                  ("--role", "decode", *store, *timeout),
                  ("--role", "prefill", "--kv-handoff", "direct", *timeout)) as started:
        yield dict(zip(("both", "store", "direct", "decode", "doomed"), started))


@pytest.fixture(scope="module")
def routers(deployment, tiny_model):
    d = deployment
    with RouterThread({"prefill": [d["store"].url], "decode": [d["decode"].url]}, model=tiny_model) as store, \
            RouterThread({"prefill": [d["direct"].url], "decode": [d["decode"].url]}, model=tiny_model) as direct, \
            RouterThread({"prefill": [d["store"].url, d["direct"].url], "decode": [d["decode"].url]},
                         model=tiny_model) as two:
        yield {"1P1D store": store, "1P1D direct": direct, "2P1D": two}


def ask(url: str, path: str, body: dict, stream: bool) -> dict:
    """The answer's text (and logprobs) whether streamed or not."""
    if not stream:
        answer = httpx.post(f"{url}{path}", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        logprobs = choice["logprobs"]["content"] if "message" in choice and choice["logprobs"] else choice["logprobs"]
        return {"text": text, "logprobs": logprobs}
    text, logprobs = "", []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text += (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
                if choice.get("logprobs"):
                    logprobs.extend(choice["logprobs"]["content"] if "delta" in choice else [choice["logprobs"]])
    return {"text": text, "logprobs": logprobs or None}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("name", ["1P1D store", "1P1D direct", "2P1D"])
def test_disaggregated_answers_are_the_combined_engines(deployment, routers, name, stream):
    decode = deployment["decode"]
    received, fallbacks = decode.handoffs("received"), decode.handoffs("fallback")
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        expected = ask(deployment["both"].url, path, body, stream=False)
        got = ask(routers[name].url, path, body, stream)
        assert got["text"] == expected["text"]
        if path.endswith("chat/completions"):  # seeded sampling, batch invariant: the same bits
            assert got["logprobs"] == expected["logprobs"]
    assert decode.handoffs("received") == received + 2 and decode.handoffs("fallback") == fallbacks
    assert routers[name].metric("deepinfer:router_handoffs_total", outcome="handed_off") >= 2


def test_2p1d_uses_both_prefill_replicas(deployment, routers):
    for _ in range(2):
        ask(routers["2P1D"].url, "/v1/completions", COMPLETION, stream=False)
    assert deployment["store"].handoffs("offered") > 0 and deployment["direct"].handoffs("offered") > 0


def test_requests_the_handoff_does_not_cover_are_served_whole(deployment, routers):
    body = {**COMPLETION, "n": 2}
    expected = httpx.post(f"{deployment['both'].url}/v1/completions", json=body, timeout=120).json()
    got = httpx.post(f"{routers['1P1D direct'].url}/v1/completions", json=body, timeout=120).json()
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in expected["choices"]]
    assert routers["1P1D direct"].metric("deepinfer:router_handoffs_total", outcome="whole_unsupported") == 1


def test_no_handoff_blocks_are_left_held(deployment, routers):
    direct = deployment["direct"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and direct.handoffs("pulled") + direct.handoffs("expired") \
            + direct.handoffs("released") < direct.handoffs("offered"):
        time.sleep(0.2)
    held = [v for (name, _), v in direct.metrics().items() if name == "deepinfer:kv_handoff_held_blocks"]
    assert held == [0.0]
    assert direct.handoffs("offered") > 0 and direct.handoffs("expired") == 0


def test_killing_a_prefill_replica_loses_no_request(deployment, tiny_model):
    """Requests in flight at the prefill replica when it dies are retried on the other one; a hand-off it held and
    never served is computed by the decode replica after the timeout."""
    d = deployment
    prompts = [f"Ship number {i} sailed past the lighthouse at dawn carrying timber and salt. " * 2 for i in range(8)]
    bodies = [{**COMPLETION, "prompt": p} for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(lambda b: ask(d["both"].url, "/v1/completions", b, stream=False), bodies))
    unseen = {**COMPLETION, "prompt": "A prompt no decode replica has seen, about fog horns and their keepers. " * 2}
    expected_unseen = ask(d["both"].url, "/v1/completions", unseen, stream=False)
    held = httpx.post(f"{d['doomed'].url}/v1/completions", timeout=60, json={
        **unseen, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    fallbacks = d["decode"].handoffs("fallback")
    with RouterThread({"prefill": [d["doomed"].url, d["direct"].url], "decode": [d["decode"].url]},
                      model=tiny_model) as router, concurrent.futures.ThreadPoolExecutor(8) as pool:
        replicas = router.router.pools["prefill"].replicas
        deadline = time.monotonic() + 10  # the router is up once one replica of a pool is: wait for both
        while not all(r.routable for r in replicas) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(r.routable for r in replicas), [r.health for r in replicas]
        d["doomed"].process.send_signal(signal.SIGSTOP)  # requests routed to it now wait there
        futures = [pool.submit(ask, router.url, "/v1/completions", b, i % 2 == 0) for i, b in enumerate(bodies)]
        orphan = pool.submit(ask, d["decode"].url, "/v1/completions", {**unseen, "kv_transfer_params": held}, True)
        doomed = router.router.pools["prefill"].replicas[0]
        deadline = time.monotonic() + 10
        while doomed.in_flight < 1 and time.monotonic() < deadline:  # kill it with a request inside, not before
            time.sleep(0.02)
        assert doomed.in_flight >= 1, "the router sent no request to the stopped replica"
        time.sleep(0.2)
        d["doomed"].kill()
        got = [f.result(timeout=120) for f in futures]
        assert [g["text"] for g in got] == [e["text"] for e in expected]
        assert orphan.result(timeout=60)["text"] == expected_unseen["text"]
        assert router.metric("deepinfer:router_retries_total") >= 1  # some were in flight at the dead replica
        assert router.router.pools["prefill"].replicas[0].health == "down"  # out of the rotation
        assert ask(router.url, "/v1/completions", bodies[1], stream=True)["text"] == expected[1]["text"]
    assert d["decode"].handoffs("fallback") >= fallbacks + 1


def test_router_pools_must_form_a_deployment():
    with pytest.raises(ValueError, match="disaggregated"):
        RouterConfig(pools=(PoolConfig("prefill", ("http://127.0.0.1:1",)),))
    with pytest.raises(ValueError, match="disaggregated"):
        RouterConfig(pools=(PoolConfig("both", ("http://127.0.0.1:1",)), PoolConfig("decode", ("http://127.0.0.1:2",))))


def test_router_command_line_builds_the_pools():
    from deepinfer.cli import build_parser
    from deepinfer.router.serve import router_config

    args = build_parser().parse_args(["router", "--prefill", "http://127.0.0.1:1", "http://127.0.0.1:2",
                                      "--decode", "http://127.0.0.1:3"])
    pools = {p.role: p.urls for p in router_config(args).pools}
    assert pools == {"prefill": ("http://127.0.0.1:1", "http://127.0.0.1:2"), "decode": ("http://127.0.0.1:3",)}
    with pytest.raises(ValueError, match="give the replicas"):
        router_config(build_parser().parse_args(["router"]))
