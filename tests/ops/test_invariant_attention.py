"""Batch-invariant paged attention: a sequence's outputs are bit-identical whether it is computed as one prefill,
as prompt chunks of any sizes, token by token as decodes, or in steps shared with other sequences at any stage
(decodes and prefill chunks), and whichever cache blocks it occupies."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.layers.attention import Attention

from .attention_harness import Cache, Sequence, random_sequence, step

SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NUM_BLOCKS = 400
# (heads, kv heads, head dim, sliding window, block size, dtype): SmolLM2's GQA, one kv head (Gemma 3 270M),
# plain multi-head with a sliding window, a block larger than the key chunk, bfloat16 caches
LAYERS = {
    "gqa-9-3": (9, 3, 64, None, 16, torch.float32),
    "mqa-4-1-block128": (4, 1, 32, None, 128, torch.float32),
    "mha-window-24": (4, 4, 16, 24, 16, torch.float32),
    "gqa-bf16": (6, 2, 32, None, 16, torch.bfloat16),
}


def _config(name):
    heads, kv_heads, head_dim, window, block_size, dtype = LAYERS[name]
    return Attention(heads, kv_heads, head_dim, head_dim**-0.5, 0, sliding_window=window), block_size, dtype


class Run:
    """A fresh cache; the target and a pool of other sequences, each with its own random blocks."""

    def __init__(self, layer, block_size, dtype, target_len, seed):
        self.layer, self.block_size, self.dtype = layer, block_size, dtype
        self.cache = Cache(layer, NUM_BLOCKS, block_size, dtype)
        self.rng = random.Random(seed)
        self.free = list(range(NUM_BLOCKS))
        self.rng.shuffle(self.free)
        self.target = self._sequence(target_len, seed=7)  # same values in every run: only the seed of others varies
        self.others: list[tuple[Sequence, int]] = []  # (sequence, tokens already computed)

    def _sequence(self, length, seed):
        blocks = [self.free.pop() for _ in range(-(-length // self.block_size))]
        return random_sequence(length, self.layer, blocks, seed=seed, dtype=self.dtype)

    def _neighbours(self, busy: bool) -> list[tuple[Sequence, int, int]]:
        """Some other sequences' next pieces: new ones start with a prefill chunk, older ones continue."""
        if not busy:
            return []
        if len(self.others) < 6 and len(self.free) > 40:
            self.others.append((self._sequence(self.rng.randint(2, 90), seed=self.rng.randrange(10**6)), 0))
        work = []
        for i, (seq, done) in enumerate(self.others):
            if done < seq.length and self.rng.random() < 0.7:
                n = 1 if done and self.rng.random() < 0.6 else self.rng.randint(1, seq.length - done)
                work.append((seq, done, n))
                self.others[i] = (seq, done + n)
        return work

    def run(self, pieces: list[int], busy: bool) -> torch.Tensor:
        """The target computed in pieces of these sizes (1 = a decode step); its output rows in order."""
        outs, done = [], 0
        for n in pieces:
            work = self._neighbours(busy)
            where = self.rng.randint(0, len(work))
            work.insert(where, (self.target, done, n))
            outs.append(step(self.layer, self.cache, work, invariant=True)[where])
            done += n
        return torch.cat(outs)


def _split(length: int, cuts: list[int]) -> list[int]:
    points = sorted({c % length for c in cuts if c % length}) + [length]
    return [b - a for a, b in zip([0] + points, points)]


@pytest.mark.parametrize("name", list(LAYERS))
@SETTINGS
@given(length=st.integers(1, 150), cuts=st.lists(st.integers(1, 10**6), max_size=6),
       decode_from=st.integers(1, 150), seed=st.integers(0, 10**6))
def test_output_does_not_depend_on_chunking_decoding_or_neighbours(name, length, cuts, decode_from, seed):
    layer, block_size, dtype = _config(name)
    reference = Run(layer, block_size, dtype, length, seed).run([length], busy=False)
    chunked = Run(layer, block_size, dtype, length, seed).run(_split(length, cuts), busy=False)
    assert torch.equal(chunked, reference)
    start = min(decode_from, length)
    decoded = Run(layer, block_size, dtype, length, seed + 1).run([start] + [1] * (length - start), busy=True)
    assert torch.equal(decoded, reference)
    crowded = Run(layer, block_size, dtype, length, seed + 2).run(_split(length, cuts), busy=True)
    assert torch.equal(crowded, reference)


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("threads", [1, 2])
def test_output_does_not_depend_on_thread_count(name, threads):
    layer, block_size, dtype = _config(name)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = Run(layer, block_size, dtype, 150, 0).run([70, 1, 1, 78], busy=True)
        torch.set_num_threads(threads)
        again = Run(layer, block_size, dtype, 150, 5).run([3, 147], busy=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(again, reference)


@pytest.mark.parametrize("name", list(LAYERS))
def test_matches_the_default_attention(name):
    layer, block_size, dtype = _config(name)
    run = Run(layer, block_size, dtype, 180, 0)
    work = [(run.target, 0, 100)]
    fast = step(layer, run.cache, work, invariant=False)[0].float()
    invariant = step(layer, run.cache, work, invariant=True)[0].float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(invariant, fast, rtol=tol, atol=tol)
    decode = [(run.target, 100, 1)]
    step(layer, run.cache, decode, invariant=True)
    torch.testing.assert_close(step(layer, run.cache, decode, invariant=True)[0].float(),
                               step(layer, run.cache, decode, invariant=False)[0].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["gqa-9-3", "mha-window-24"])
def test_fixed_size_gemm_calls_used_off_the_cpu_are_invariant_too(name, monkeypatch):
    """Off the CPU every attention GEMM call gets the same item count; run that path here."""
    from deepinfer.ops import batch_invariant

    monkeypatch.setattr(batch_invariant, "_items_per_call", lambda device: 8)
    layer, block_size, dtype = _config(name)
    reference = Run(layer, block_size, dtype, 90, 0).run([90], busy=False)
    assert torch.equal(Run(layer, block_size, dtype, 90, 1).run([50, 1, 1, 38], busy=True), reference)
    assert torch.equal(Run(layer, block_size, dtype, 90, 2).run([60] + [1] * 30, busy=True), reference)
