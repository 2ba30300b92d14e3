"""Weights moved into huge pages keep their values, their tensor objects and what the kernels compute from them."""
import numpy as np
import pytest
import torch

from deepinfer.ops import huge_pages
from deepinfer.ops import quant_linear as ql


def test_moved_tensors_keep_values_and_identity():
    tensors = [torch.arange(1000, dtype=torch.float32), torch.randint(0, 255, (3, 77), dtype=torch.uint8),
               torch.randn(5, 3, dtype=torch.float64), torch.empty(0)]
    before = [t.clone() for t in tensors]
    ids = [id(t) for t in tensors]
    old_ptrs = [t.data_ptr() for t in tensors[:3]]
    report = huge_pages.move_to_huge_pages(tensors)
    assert [id(t) for t in tensors] == ids
    for t, b in zip(tensors, before):
        assert t.dtype == b.dtype and t.shape == b.shape and t.is_contiguous() and torch.equal(t, b)
    assert all(t.data_ptr() != p and t.data_ptr() % 64 == 0 for t, p in zip(tensors[:3], old_ptrs))
    assert report.tensors == 3 and report.nbytes == 4000 + 231 + 120
    assert report.mode in ("always", "madvise", "never", "unknown")
    # one mapping: each tensor lies after the previous one, within a few cache lines
    ptrs = [t.data_ptr() for t in tensors[:3]]
    assert ptrs[0] < ptrs[1] < ptrs[2] < ptrs[0] + 4000 + 231 + 2 * 64
    tensors[0].add_(1)  # still writable memory of its own
    assert torch.equal(tensors[0], before[0] + 1) and torch.equal(tensors[1], before[1])


def test_the_kernels_compute_the_same_bits_from_moved_weights(kernels):
    rng = np.random.default_rng(0)
    u = rng.integers(0, 32, size=(48, 256), dtype=np.uint8)
    s = (rng.random((48, 8), dtype=np.float32) * 0.01).astype(np.float16).astype(np.float32)
    packed = ql.pack(ql.Canonical(ql.QuantFormat(5, 32, "float16", False, -16), u, s, None))
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    want = ql.linear(kernels, x, packed)
    huge_pages.move_to_huge_pages([packed.quants, packed.scales, packed.offsets])
    assert torch.equal(ql.linear(kernels, x, packed), want)


def test_only_contiguous_cpu_tensors_are_taken():
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        huge_pages.move_to_huge_pages([torch.zeros(4, 6).t()])


def test_the_engine_option_and_its_environment_switch():
    from deepinfer.config import EngineConfig

    assert EngineConfig.from_kwargs(env={}).huge_pages is True
    assert EngineConfig.from_kwargs(env={"DEEPINFER_HUGE_PAGES": "0"}).huge_pages is False
    assert EngineConfig.from_kwargs(env={"DEEPINFER_HUGE_PAGES": "0"}, huge_pages=True).huge_pages is True


def test_engines_with_and_without_huge_pages_give_the_same_tokens(caplog):
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    tokens = {}
    for huge in (False, True):
        caplog.clear()
        with caplog.at_level("INFO"):
            llm = LLM(huge_pages=huge, num_threads=2, max_num_seqs=4)
        log = "\n".join(r.getMessage() for r in caplog.records if "packed blocks" in r.getMessage())
        assert ("2 MiB pages" in log) == huge and ("DEEPINFER_HUGE_PAGES=0" in log) == (not huge), log
        tokens[huge] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert tokens[True] == tokens[False]


def test_a_kernel_without_huge_pages_still_gets_the_tensors_moved(monkeypatch):
    """madvise fails with EINVAL where the kernel has no transparent huge pages: the weights stay usable. An advice
    number no kernel knows gets the same EINVAL from the real call."""
    import mmap

    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 12345)
    t = torch.arange(100, dtype=torch.int32)
    report = huge_pages.move_to_huge_pages([t])
    assert report.tensors == 1 and torch.equal(t, torch.arange(100, dtype=torch.int32))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_lazy_zeros_are_zeros_on_cache_lines_and_resident_only_once_touched():
    shapes = [(4096, 8, 1024), (3, 5, 7), (10, 2, 0), (4096, 8, 1024)]  # 2 x 64 MiB of bfloat16, odd and empty ones
    before = _resident_bytes()
    tensors = huge_pages.lazy_zeros(shapes, torch.bfloat16)
    assert _resident_bytes() - before < 16 << 20  # nothing written: 128 MiB of zeros cost no resident memory
    assert [t.shape for t in tensors] == [torch.Size(s) for s in shapes]
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.data_ptr() % 64 == 0 for t in tensors)
    assert all(not t.any() for t in tensors)  # reading zero pages maps the shared zero page: still not resident
    tensors[0][17].fill_(1.5)
    tensors[3].fill_(2.0)  # the last one's pages, all of them, are now resident
    assert _resident_bytes() - before >= 60 << 20
    assert tensors[0].sum().item() == 1.5 * 8 * 1024 and tensors[1].sum().item() == 0
    assert tensors[3].min().item() == 2.0 and not tensors[1].any()


def test_the_engine_kv_cache_is_not_resident_until_used():
    """The KV cache (worker/runner.py) in lazily zeroed pages: a 1 GiB budget does not make the process 1 GiB larger
    at start-up, and the engine serves from it."""
    from deepinfer import LLM, SamplingParams

    before = _resident_bytes()
    llm = LLM(kv_cache_memory=1 << 30)
    assert _resident_bytes() - before < 700 << 20  # the model itself (~0.5 GiB with its tokenizer), not the 1 GiB
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
