"""KV store lookups and loads run off the step: with a store that takes 200 ms per call, a request decoding beside
one whose blocks come from the store keeps its pace, and both give the tokens they give alone."""
import statistics
import threading
import time

from deepinfer import SamplingParams
from deepinfer.llm import LLM

SLOW = 0.2
SYSTEM = "<|im_start|>system\n" + "You answer questions about the history of lighthouses. " * 12 + "<|im_end|>\n"
STORED = SYSTEM + "<|im_start|>user\nWho built the first one?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_slow_store_does_not_slow_other_requests():
    llm = LLM(kv_store="memory", kv_cache_memory=64 << 20)
    engine = llm.engine
    expected_stored = llm.generate([STORED], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    expected_other = llm.generate(["Count from one to fifty:"], SamplingParams(temperature=0, max_tokens=60,
                                                                             ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].token_ids
    assert engine.kv_store.flush(timeout=30)
    engine.kv.pool.reset_cache()  # the device cache forgets: STORED's blocks now live only in the store
    store = engine.kv_store.store
    calls = {"get": 0, "contains": 0, "on the engine thread": 0}
    get, contains = store.get, store.contains
    engine_thread = threading.get_ident()

    def slow(kind, call):
        def wrapped(arg):
            calls[kind] += 1
            calls["on the engine thread"] += threading.get_ident() == engine_thread
            time.sleep(SLOW)
            return call(arg)
        return wrapped

    slow_get, slow_contains = slow("get", get), slow("contains", contains)

    store.get, store.contains = slow_get, slow_contains
    engine.add_request("other", "Count from one to fifty:", SamplingParams(temperature=0, max_tokens=60,
                                                                           ignore_eos=True))
    for _ in range(4):  # the other request is decoding
        engine.step()
    engine.add_request("stored", STORED, GREEDY)
    gaps, outputs, last = [], {}, time.perf_counter()
    while engine.has_unfinished_requests():
        produced = engine.step()
        for out in produced:
            outputs[out.request_id] = out
        if any(out.request_id == "other" for out in produced):  # one of the decoding request's tokens
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    assert calls["contains"] > 0 and calls["get"] > 0  # the store was used, slowly
    assert calls["on the engine thread"] == 0  # ...and never by the step itself
    assert list(outputs["stored"].outputs[0].token_ids) == list(expected_stored)
    assert list(outputs["other"].outputs[0].token_ids) == list(expected_other)
    assert outputs["stored"].num_cached_tokens >= 64  # its prefix came from the store
    # the store spent 200 ms per call (many calls) while the steps went on at their pace (a median, so that a busy
    # machine's stalls do not count)
    assert statistics.median(gaps) < SLOW / 2, f"steps took {statistics.median(gaps):.3f} s at the median"
