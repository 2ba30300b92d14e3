"""The engine-level contract of a hand-off, with a prefill and a decode engine in this process (tiny model, batch
invariant): the decode engine gives the combined engine's tokens and logprobs bit for bit on both paths; a hand-off
that is corrupt, truncated, never arrives or is for other tokens is computed locally with the same answer; a prefill
engine's held blocks are released once pulled, or after the timeout, never leaked."""
from __future__ import annotations

import time

import pytest
import zmq

from deepinfer.config import EngineConfig
from deepinfer.disagg.params import KVTransferParams
from deepinfer.engine.engine import Engine
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

TIMEOUT_S = 1.0
PROMPT = "The keeper climbed the stairs of the lighthouse every evening to light the lamp. " * 3  # a partial last block
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seq_seed=11, max_tokens=12, logprobs=3)
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def run(engine: Engine, request_id: str, prompt, params: SamplingParams,
        transfer: KVTransferParams | None = None, timeout_s: float = 60) -> RequestOutput:
    engine.add_request(request_id, prompt, params, kv_transfer=transfer)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out
    raise AssertionError(f"{request_id} did not finish in {timeout_s}s")


def prefill(engine: Engine, request_id: str, prompt, params: SamplingParams) -> KVTransferParams:
    out = run(engine, request_id, prompt, params.replace(max_tokens=1), KVTransferParams(do_remote_decode=True))
    return KVTransferParams.from_json(out.kv_transfer_params)


def same(a: RequestOutput, b: RequestOutput) -> bool:
    return a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    store = dict(kv_store="disk", kv_store_path=str(tmp_path_factory.mktemp("kv-store")))
    common = dict(model=tiny_model, kv_cache_memory=16 << 20, max_model_len=1024, num_threads=1, batch_invariant=True,
                  kv_handoff_timeout_s=TIMEOUT_S)
    made = {"both": Engine(EngineConfig.from_kwargs(**common)),
            "direct": Engine(EngineConfig.from_kwargs(role="prefill", kv_handoff="direct", **common)),
            "store": Engine(EngineConfig.from_kwargs(role="prefill", kv_handoff="store", **common, **store)),
            "decode": Engine(EngineConfig.from_kwargs(role="decode", **common, **store))}
    yield made
    for engine in made.values():
        engine.close()


def settle(engine: Engine, timeout_s: float) -> None:
    """Steps a prefill engine until it holds no hand-off (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()


@pytest.mark.parametrize("path", ["direct", "store"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_decode_gives_the_combined_engines_bits(engines, path, params):
    expected = run(engines["both"], f"ref-{path}-{params.temperature}", PROMPT, params)
    decode = engines["decode"]
    before = decode.stats().handoff
    transfer = prefill(engines[path], f"p-{path}-{params.temperature}", PROMPT, params)
    got = run(decode, f"d-{path}-{params.temperature}", PROMPT, params, transfer)
    assert same(got, expected)
    after = decode.stats().handoff
    assert after.received == before.received + 1 and after.fallbacks == before.fallbacks  # the hand-off was used
    settle(engines[path], 5)
    assert engines[path].kv.usage() == 0.0


def test_held_blocks_are_released_when_pulled_and_after_the_timeout(engines):
    server = engines["direct"]
    transfer = prefill(server, "held-pulled", PROMPT, GREEDY)
    assert server.stats().handoff.held_blocks == -(-transfer.num_prompt_tokens // 16)
    run(engines["decode"], "held-pulled-d", PROMPT, GREEDY, transfer)
    settle(server, 5)
    stats = server.stats().handoff
    assert stats.held_blocks == 0 and server.kv.usage() == 0.0 and stats.pulled >= 1

    expired = stats.expired
    prefill(server, "held-never-pulled", PROMPT, GREEDY)  # nobody pulls it
    assert server.has_unfinished_requests() and server.stats().handoff.held_blocks > 0
    started = time.monotonic()
    settle(server, 10)
    assert TIMEOUT_S * 0.9 < time.monotonic() - started < TIMEOUT_S + 2
    stats = server.stats().handoff
    assert stats.held_blocks == 0 and server.kv.usage() == 0.0 and stats.expired == expired + 1


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "other layout"])
def test_a_damaged_handoff_is_computed_locally(engines, monkeypatch, fault):
    server = engines["direct"].handoff.server
    honest = server.reply

    def damaged(block_ids):
        header, frames = honest(block_ids)
        if fault == "corrupt":  # one byte of the second block flipped on the wire
            first = frames[0].copy()
            first[min(1, len(first) - 1), 5] ^= 0xFF
            frames = [first, *frames[1:]]
        elif fault == "truncate":
            header = {**header, "runs": header["runs"], "crc": header["crc"]}
            frames = frames[:-1]
        else:
            header = {**header, "layout": "00" * 20}
        return header, frames

    monkeypatch.setattr(server, "reply", damaged)
    expected = run(engines["both"], f"ref-{fault}", PROMPT, SEEDED)
    decode = engines["decode"]
    fallbacks = decode.stats().handoff.fallbacks
    transfer = prefill(engines["direct"], f"p-{fault}", PROMPT, SEEDED)
    got = run(decode, f"d-{fault}", PROMPT, SEEDED, transfer)
    assert same(got, expected)
    assert decode.stats().handoff.fallbacks == fallbacks + 1


def test_kv_that_never_arrives_is_computed_after_the_timeout(engines):
    context = zmq.Context.instance()
    silent = context.socket(zmq.ROUTER)  # accepts the connection, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        expected = run(engines["both"], "ref-silent", PROMPT, GREEDY)
        transfer = prefill(engines["direct"], "p-silent", PROMPT, GREEDY)
        lost = KVTransferParams.from_json({**transfer.to_json(), "remote_address": f"tcp://127.0.0.1:{port}"})
        started = time.monotonic()
        got = run(engines["decode"], "d-silent", PROMPT, GREEDY, lost)
        assert same(got, expected)
        assert time.monotonic() - started < TIMEOUT_S + 2  # the timeout, then a prefill of a short prompt
        # the first token was streamed at once, before the KV was given up on
        assert got.metrics.first_token_time - got.metrics.arrival_time < TIMEOUT_S / 2
    finally:
        silent.close(linger=0)
    settle(engines["direct"], 5)


def test_a_prompt_with_other_tokens_is_computed_locally(engines):
    transfer = prefill(engines["direct"], "p-other", PROMPT, GREEDY)
    expected = run(engines["both"], "ref-other", PROMPT + " And more.", GREEDY)
    decode = engines["decode"]
    fallbacks = decode.stats().handoff.fallbacks
    got = run(decode, "d-other", PROMPT + " And more.", GREEDY, transfer)
    assert same(got, expected) and decode.stats().handoff.fallbacks == fallbacks + 1
    settle(engines["direct"], 5)  # never pulled: expires


def test_a_first_token_that_ends_the_request_lets_the_handoff_go(engines):
    server = engines["direct"]
    transfer = prefill(server, "p-short", PROMPT, GREEDY)
    got = run(engines["decode"], "d-short", PROMPT, GREEDY.replace(max_tokens=1), transfer)
    assert got.outputs[0].token_ids == [transfer.first_token_id] and got.outputs[0].finish_reason == "length"
    released = server.stats().handoff.released
    started = time.monotonic()
    settle(server, 5)
    assert time.monotonic() - started < TIMEOUT_S / 2  # released by the decode engine, not by the timeout
    assert server.stats().handoff.released == released + 1


def test_handoffs_go_to_the_right_role(engines):
    with pytest.raises(ValueError, match="prefill engine"):
        engines["both"].add_request("wrong-1", PROMPT, GREEDY.replace(max_tokens=1),
                                    kv_transfer=KVTransferParams(do_remote_decode=True))
    with pytest.raises(ValueError, match="max_tokens=1"):
        engines["direct"].add_request("wrong-2", PROMPT, GREEDY, kv_transfer=KVTransferParams(do_remote_decode=True))
    with pytest.raises(ValueError, match="n=1"):
        engines["direct"].add_request("wrong-3", PROMPT, GREEDY.replace(max_tokens=1, n=2),
                                      kv_transfer=KVTransferParams(do_remote_decode=True))
    with pytest.raises(ValueError, match="path"):
        KVTransferParams.from_json({"do_remote_prefill": True, "path": "carrier pigeon"})
