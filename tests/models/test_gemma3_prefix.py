"""Prefix caching on a sliding-window hybrid (tiny random Gemma 3, window 16, block 4): multi-turn conversations
longer than the window give identical greedy tokens with caching off, `compact` and `full`, cold and warm; the
engine's replay counters stay within keep_tokens; sliding-window blocks stay bounded while decoding 4W tokens."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from deepinfer import SamplingParams
from deepinfer.llm import LLM

from .hf_reference import hf_greedy, save_tiny

WINDOW, BS = 16, 4
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=WINDOW)
TURN_LENS = [(30, 9), (21, 12), (17, 7), (26, 10)]  # (user tokens, output tokens) per turn
GREEDY = SamplingParams(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("gemma3-swa")
    hf = save_tiny(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(**CONFIG), path, seed=3)
    yield hf.eval(), str(path)
    torch.set_num_threads(threads)


def conversation(llm: LLM, seed: int, salt: str | None = None) -> list[list[int]]:
    """Each turn's prompt is every earlier prompt and output plus new user tokens; returns the outputs."""
    rng = torch.Generator().manual_seed(seed)
    history: list[int] = []
    outputs = []
    for user, out in TURN_LENS:
        history += torch.randint(3, 512, (user,), generator=rng).tolist()
        (result,) = llm.generate([history], GREEDY.replace(max_tokens=out, cache_salt=salt), use_tqdm=False)
        outputs.append(list(result.outputs[0].token_ids))
        history += outputs[-1]
    return outputs


def engine(path: str, **options) -> LLM:
    return LLM(path, kv_cache_memory=4 << 20, block_size=BS, max_num_batched_tokens=24, **options)


def test_multi_turn_outputs_equal_with_caching_off_compact_and_full(tiny_gemma):
    hf, path = tiny_gemma
    reference = conversation(engine(path, enable_prefix_caching=False), seed=1)
    assert sum(u + o for u, o in TURN_LENS) > 4 * WINDOW
    rng = torch.Generator().manual_seed(1)  # the first turn against transformers itself
    first_prompt = torch.randint(3, 512, (TURN_LENS[0][0],), generator=rng).tolist()
    assert hf_greedy(hf, first_prompt, TURN_LENS[0][1])[0] == reference[0]
    for options in (dict(swa_prefix_mode="compact"), dict(swa_prefix_mode="full"),
                    dict(swa_prefix_mode="compact", swa_keep_tokens=WINDOW)):
        llm = engine(path, **options)
        assert conversation(llm, seed=1) == reference, options  # cold: each turn hits the previous one
        assert conversation(llm, seed=1) == reference, options  # warm: every turn is cached
        stats = llm.engine.stats()
        assert stats.prefix_cache_hits > 0, options
        replay = stats.prefix_replay
        if "swa_keep_tokens" not in options:  # the derived tail covers every continuation: at most keep_tokens
            assert replay.max_replayed_tokens <= llm.engine.kv.keep_tokens, (options, replay)
        else:  # a tail of just W leaves no room for block alignment: some turns replay, and stay exact
            assert replay.hits > 0, replay


def test_compact_branch_replays_and_stays_exact(tiny_gemma):
    """A request that branches off mid-conversation finds no window KV there in compact mode and replays."""
    _, path = tiny_gemma
    rng = torch.Generator().manual_seed(5)
    base = torch.randint(3, 512, (90,), generator=rng).tolist()
    branch = base[:60] + torch.randint(3, 512, (10,), generator=rng).tolist()
    want = engine(path, enable_prefix_caching=False).generate([branch], GREEDY.replace(max_tokens=8),
                                                              use_tqdm=False)[0].outputs[0].token_ids
    for mode, replays in (("compact", True), ("full", False)):
        llm = engine(path, swa_prefix_mode=mode)
        llm.generate([base], GREEDY.replace(max_tokens=4), use_tqdm=False)
        out = llm.generate([branch], GREEDY.replace(max_tokens=8), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want, mode
        assert (llm.engine.stats().prefix_replay.replayed_tokens > 0) == replays, mode
        assert out.num_cached_tokens == (0 if replays else 60), mode


def test_sliding_blocks_stay_bounded_over_4w_tokens(tiny_gemma):
    _, path = tiny_gemma
    llm = engine(path)
    eng = llm.engine
    eng.add_request("long", list(range(10, 20)), GREEDY.replace(max_tokens=4 * WINDOW))
    sliding = [g for g, w in enumerate(eng.kv.windows) if w is not None]
    assert len(sliding) == 5
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        if "long" in eng.scheduler.requests:
            peak = max(peak, *(eng.kv.held_blocks("long", g) for g in sliding))
            full = eng.kv.held_blocks("long", 0)  # full attention keeps a block for every computed token
            assert full == math.ceil(eng.scheduler.requests["long"].num_computed_tokens / BS)
    assert peak <= math.ceil(WINDOW / BS) + 1


@pytest.mark.parametrize("mode,kind", [("compact", "disk"), ("full", "disk"), ("compact", "redis")])
def test_store_tiers_keep_sliding_tails_across_restarts(tiny_gemma, tmp_path, mode, kind, request):
    """Every turn runs in a fresh engine (cold device cache) over one disk or Redis store: turn k loads turn k-1's
    blocks, sliding tails included, and answers exactly as without any cache."""
    _, path = tiny_gemma
    if kind == "disk":
        options = dict(kv_store="disk", kv_store_path=str(tmp_path / "store"))
    else:
        options = dict(kv_store="redis", kv_store_url=request.getfixturevalue("redis_server").url)
    _turns_over_restarts(path, mode, options)


def _turns_over_restarts(path: str, mode: str, options: dict) -> None:
    reference = conversation(engine(path, enable_prefix_caching=False), seed=2)
    rng = torch.Generator().manual_seed(2)
    history: list[int] = []
    loaded = []
    for k, (user, out) in enumerate(TURN_LENS):
        history += torch.randint(3, 512, (user,), generator=rng).tolist()
        llm = engine(path, swa_prefix_mode=mode, **options)
        (result,) = llm.generate([history], GREEDY.replace(max_tokens=out), use_tqdm=False)
        assert list(result.outputs[0].token_ids) == reference[k], (mode, k)
        loaded.append(result.num_cached_tokens)
        assert llm.engine.stats().prefix_replay.replayed_tokens == 0, (mode, k)
        llm.engine.close()
        history += reference[k]
    assert loaded[0] == 0 and all(n > 0 for n in loaded[1:]), loaded


def test_sliding_tails_in_the_store_are_bounded_in_compact_mode(tiny_gemma, tmp_path):
    _, path = tiny_gemma
    sizes = {}
    for mode in ("compact", "full"):
        llm = engine(path, swa_prefix_mode=mode, kv_store="disk", kv_store_path=str(tmp_path / mode))
        llm.generate([list(range(3, 200))], GREEDY.replace(max_tokens=40), use_tqdm=False)
        llm.engine.close()
        sizes[mode] = sum(f.stat().st_size for f in (tmp_path / mode).rglob("*") if f.is_file())
    # 236 tokens: full mode stores 59 blocks per group in all 6 groups; compact stores the 5 sliding groups' tails
    assert sizes["compact"] < sizes["full"] * 0.45, sizes


def test_corrupt_store_blocks_are_recomputed_exactly(tiny_gemma, tmp_path):
    _, path = tiny_gemma
    prompt = list(range(3, 120))
    want = engine(path, enable_prefix_caching=False).generate([prompt + [7, 8, 9]], GREEDY.replace(max_tokens=6),
                                                              use_tqdm=False)[0].outputs[0].token_ids
    first = engine(path, kv_store="disk", kv_store_path=str(tmp_path))
    first.generate([prompt], GREEDY.replace(max_tokens=2), use_tqdm=False)
    first.engine.close()
    for i, f in enumerate(sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 64)):
        if i % 3 == 1:
            with open(f, "r+b") as fh:  # same length, wrong bytes: the payload check fails at load time
                fh.seek(-16, 2)
                fh.write(b"\xff" * 16)
    again = engine(path, kv_store="disk", kv_store_path=str(tmp_path))
    out = again.generate([prompt + [7, 8, 9]], GREEDY.replace(max_tokens=6), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want
    assert again.engine.stats().kv_store.failed_blocks > 0  # the broken blocks were detected, not used
