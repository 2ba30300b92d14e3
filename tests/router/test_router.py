"""The router in front of two real replicas (`deepinfer serve --data-parallel-size 2`, tests/router/conftest.py):
prefix affinity measured by the replicas' own hit counters, load spreading, streaming passed through, the server's
other routes, and a replica killed mid-run. The kill comes last: the module's cluster is not usable after it."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time

import httpx
import psutil

from deepinfer.router.prompt import Prompt, PromptReader
from deepinfer.server.replica_api import decode_keys
from tests.router.conftest import running_cluster

SYSTEM = ("You are the support assistant of a bicycle shop. Answer briefly and politely, name the part, its price "
          "and whether it is in stock. Opening hours are nine to six, Monday to Saturday. ") * 6


def chat(question: str, **extra) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0, **extra}


def decisions(cluster) -> dict[str, float]:
    """Requests routed per replica so far."""
    out: dict[str, float] = {}
    for (name, labels), value in cluster.metrics().items():
        if name == "deepinfer:router_decisions_total":
            replica = dict(labels)["replica"]
            out[replica] = out.get(replica, 0) + value
    return out


def replica_pids(cluster) -> dict[str, int]:
    """The launcher's replica processes by their URL (found by their listening port)."""
    out = {}
    for child in psutil.Process(cluster.process.pid).children():
        for conn in child.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN:
                out[f"http://127.0.0.1:{conn.laddr.port}"] = child.pid
    return out


def test_replicas_are_pinned_to_their_own_cores(cluster):
    cores = sorted(os.sched_getaffinity(0))
    pids = replica_pids(cluster)
    assert len(pids) == 2, pids
    affinities = sorted(sorted(psutil.Process(pid).cpu_affinity()) for pid in pids.values())
    if len(cores) < 2:
        assert affinities == [cores, cores]  # fewer cores than replicas: not pinned
    else:
        assert not set(affinities[0]) & set(affinities[1]) and all(affinities)


def test_prompt_ids_and_block_keys_are_the_engines(cluster, tiny_model):
    reader = PromptReader()
    reader.load(tiny_model)
    messages = chat("Do you sell tubes?")["messages"]
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        assert reader.chat_ids(messages) == http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        text = "The quick brown fox jumps over the lazy dog. " * 12
        assert reader.ids(text) == http.post("/tokenize", json={"prompt": text}).json()["tokens"]

        body = json.dumps({"prompt": text, "max_tokens": 2, "temperature": 0}).encode()
        prompt = reader.read("/v1/completions", body, None)
        assert isinstance(prompt, Prompt) and prompt.token_ids == reader.ids(text)
        sent = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert sent.status_code == 200
        pool = cluster.state()["pools"]["both"]
        chain = prompt.block_keys(pool["model_key"], pool["block_size"])
        assert len(chain) == len(prompt.token_ids) // 16 >= 4
        held = [set(decode_keys(httpx.get(f"{r['url']}/replica/state", timeout=30).json()["added"]))
                for r in pool["replicas"]]
        assert any(set(chain) <= keys for keys in held)  # the replica that served it holds exactly these keys


def test_requests_sharing_a_prefix_land_on_the_replica_holding_it(cluster):
    questions = ("Do you sell tubes?", "What does a chain cost?", "Are brake pads in stock?", "When do you open?")
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        ids = [http.post("/tokenize", json={"messages": chat(q)["messages"]}).json()["tokens"] for q in questions]
        shared = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1])) if a != b) // 16  # full blocks in common
        assert shared >= 10

        def holder_state() -> dict:
            return next(r for r in cluster.replicas() if r["url"] == holder)

        before = decisions(cluster)
        assert http.post("/v1/chat/completions", json=chat(questions[0])).status_code == 200
        first = decisions(cluster)
        (holder,) = [r for r in first if first[r] > before.get(r, 0)]
        cluster.wait_until(lambda: holder_state()["cached_blocks"] >= len(ids[0]) // 16, 10, "reported")
        hits = {r["url"]: r["prefix_cache_hits"] for r in cluster.replicas()}
        for question in questions[1:]:
            assert http.post("/v1/chat/completions", json=chat(question)).status_code == 200
        after = decisions(cluster)
        assert after[holder] - first[holder] == 3 and sum(after.values()) - sum(first.values()) == 3
        # the replica's own counter, as it reports it: each follow-up found the shared blocks
        cluster.wait_until(lambda: holder_state()["prefix_cache_hits"] >= hits[holder] + 3 * shared * 16, 10,
                           "hit counters moved")
        other = [r for r in cluster.replicas() if r["url"] != holder][0]
        assert other["prefix_cache_hits"] == hits[other["url"]]
        metrics = cluster.metrics()
        assert metrics[("deepinfer:router_decisions_total",
                        (("pool", "both"), ("reason", "cache_hit"), ("replica", holder)))] >= 3
        assert metrics[("deepinfer:router_replica_prefix_cache_hit_rate", (("pool", "both"), ("replica", holder)))] > 0


def test_unrelated_requests_spread_over_the_replicas(cluster):
    rng = random.Random(7)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(64, 200))] for _ in range(8)]

    async def send_all() -> list[int]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
            answers = await asyncio.gather(*(http.post("/v1/completions", json={"prompt": p, "max_tokens": 16})
                                             for p in prompts))
        return [a.status_code for a in answers]

    before = decisions(cluster)
    assert asyncio.run(send_all()) == [200] * 8
    after = decisions(cluster)
    routed = {r: after[r] - before.get(r, 0) for r in after}
    assert sum(routed.values()) == 8 and min(routed.values()) >= 2, routed


def _events(lines: list[str]) -> list[dict | str]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_streaming_passes_through_event_by_event(cluster):
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stream": True}

    def stream(url: str) -> list[dict | str]:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as answer:
            assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
            return _events(list(answer.iter_lines()))

    routed = stream(cluster.url)
    direct = stream(cluster.replicas()[0]["url"])
    assert routed[-1] == direct[-1] == "[DONE]"
    text = [[e["choices"][0]["text"] for e in events[:-1] if e["choices"]] for events in (routed, direct)]
    # the same text in several events (a replica merges the tokens of a reader that fell behind, so the split into
    # events may differ; tests/router/test_failover.py times the relay itself)
    assert "".join(text[0]) == "".join(text[1]) and len(text[0]) >= 4, text


def test_other_routes_pass_through(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 1024
        tokens = http.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"].strip() == "hello world"
        bad = http.post("/v1/completions", json={"prompt": "x", "bogus": 1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "bogus"  # the replica's own error
        families = {name for name, _ in cluster.metrics()}
        for name in ("deepinfer:router_replica_queued_prefill_tokens", "deepinfer:router_replica_kv_usage",
                     "deepinfer:router_replica_running_requests", "deepinfer:router_replica_routable"):
            assert name in families


def test_a_replica_killed_mid_run_loses_no_request_that_had_not_started_streaming(tiny_model):
    """Replica A is frozen (SIGSTOP), so requests routed to it wait without an answer; once several do, it is
    killed. Every request, streamed or not, has received nothing yet, so each is retried on B and completes.
    Round-robin on a cluster of its own, so that half of the requests surely go to A (the cache-aware policy may send
    them all to B, depending on the loads A reported before it froze)."""
    with running_cluster("--model", tiny_model, "--data-parallel-size", "2", "--policy", "round_robin") as cluster:
        _kill_one_mid_run(cluster)


def _kill_one_mid_run(cluster) -> None:
    victim = cluster.replicas()[0]["url"]
    pid = replica_pids(cluster)[victim]
    os.kill(pid, signal.SIGSTOP)

    async def run() -> list:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
            async def plain(i: int):
                answer = await http.post("/v1/completions", json={"prompt": f"Story {i}:", "max_tokens": 12})
                return answer.status_code, answer.json()

            async def streamed(i: int):
                async with http.stream("POST", "/v1/completions",
                                       json={"prompt": f"Tale {i}:", "max_tokens": 12, "stream": True}) as answer:
                    return answer.status_code, _events([line async for line in answer.aiter_lines()])

            tasks = [asyncio.ensure_future(plain(i)) for i in range(6)]
            tasks += [asyncio.ensure_future(streamed(i)) for i in range(4)]
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # until several requests wait on the frozen replica
                if next(r for r in cluster.replicas() if r["url"] == victim)["in_flight"] >= 3:
                    break
                await asyncio.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(run())
    finally:
        with contextlib.suppress(ProcessLookupError):  # never leave a frozen process behind
            os.kill(pid, signal.SIGKILL)
    for status, body in results[:6]:
        assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
    for status, events in results[6:]:
        assert status == 200 and events[-1] == "[DONE]" and not any("error" in e for e in events if e != "[DONE]")
    metrics = cluster.metrics()
    retries = sum(v for (name, labels), v in metrics.items()
                  if name == "deepinfer:router_retries_total" and dict(labels)["replica"] == victim)
    assert retries >= 3
    assert not any(name == "deepinfer:router_failures_total" and v for (name, _), v in metrics.items())
    # out of the rotation within seconds, then restarted by the launcher and back in it
    assert next(r for r in cluster.replicas() if r["url"] == victim)["health"] != "ok"
    cluster.wait_until(lambda: all(r["health"] == "ok" for r in cluster.replicas()), 90, "restarted")
    assert replica_pids(cluster)[victim] != pid
