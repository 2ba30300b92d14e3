"""The quantized-weight linear kernel against a reference written from the formats.

Weights: random GGUF blocks, dequantized by gguf's own numpy code (the format's reference). Activations: rounded to
int8 per 32 values as the kernel documents (d = max|x| / 127 in float32, round half to even). Accumulation in
float64. The kernel's float32 epilogue stays within REL of that; a row gives the same bits alone, inside any batch,
on any thread count, and on every instruction-set build.
"""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from deepinfer.models.gguf_blocks import BLOCK_VALUES, SUPPORTED, canonical
from deepinfer.ops import cpu_ops
from deepinfer.ops import quant_linear as ql

REL = 2e-6  # |kernel - reference| / sum_k |w_k x_k| for one output (float32 rounding over K / G groups)
SCALE_FIELDS = {  # byte offsets of fp16 scale fields inside a block
    QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2), QType.Q8_0: (0,),
    QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,), QType.Q2_K: (80, 82), QType.Q3_K: (108,),
    QType.IQ4_NL: (0,), QType.IQ4_XS: (0,),
}
BIT_EXACT = {QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q2_K, QType.Q3_K, QType.IQ4_NL,
             QType.IQ4_XS}  # decoded to the same float32 as gguf's own numpy code (the others within 1e-6)


def random_blocks(qtype: QType, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n * k // per, size), dtype=np.uint8)
    for offset in SCALE_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 2e-2, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def gguf_dequantize(qtype: QType, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw.reshape(gguf.quant_shape_to_byte_shape((n, k), qtype)), qtype)


def reference(x: torch.Tensor, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x_q @ w^T in float64, sum |x_q| |w| per output) with x rounded to int8 per 32 values."""
    xs = x.numpy().reshape(x.shape[0], -1, 32)
    d = (np.abs(xs).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0).astype(np.float32)
    xq = (np.rint(xs * inv) * d).reshape(x.shape[0], -1).astype(np.float64)
    w64 = w.astype(np.float64)
    return xq @ w64.T, np.abs(xq) @ np.abs(w64).T


def check_close(got: torch.Tensor, x: torch.Tensor, w: np.ndarray) -> None:
    want, magnitude = reference(x, w)
    err = np.abs(got.numpy().astype(np.float64) - want) / np.maximum(magnitude, 1e-30)
    assert err.max() < REL, f"relative error {err.max():.3g} over {REL}"


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_blocks_decode_to_the_formats_values(qtype):
    per = BLOCK_VALUES[qtype]
    n, k = 24, 2 * per
    raw = random_blocks(qtype, n, k, seed=1)
    want = gguf_dequantize(qtype, raw, n, k)
    got = canonical(qtype, raw, (n, k)).dequantize()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    if qtype in BIT_EXACT:
        assert np.array_equal(got, want)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [16, 40])  # 40: the last 16-row block is padded
def test_kernel_matches_reference(kernels, qtype, n):
    per = BLOCK_VALUES[qtype]
    k = per * (2 if per == 256 else 3)
    raw = random_blocks(qtype, n, k, seed=n)
    packed = ql.pack(canonical(qtype, raw, (n, k)))
    w = gguf_dequantize(qtype, raw, n, k)
    for m in (1, 3, 8, 13, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
        check_close(ql.linear(kernels, x, packed), x, w)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q5_0, QType.Q4_0], ids=lambda t: t.name)
def test_rows_equal_gguf_dequantization(kernels, qtype):
    raw = random_blocks(qtype, 48, 64, seed=3)
    packed = ql.pack(canonical(qtype, raw, (48, 64)))
    ids = torch.tensor([[0, 17], [47, 5]])
    got = ql.rows(kernels, ids, packed)
    assert got.shape == (2, 2, 64)
    assert np.array_equal(got.numpy(), gguf_dequantize(qtype, raw, 48, 64)[ids.numpy()])
    with pytest.raises(RuntimeError, match="out of range"):
        ql.rows(kernels, torch.tensor([48]), packed)


def test_five_bit_quants_keep_their_size():
    """Q5_0 stays 5 bits a weight plus its fp16 scale, as in the file (22 bytes per 32 values), not widened to 8."""
    raw = random_blocks(QType.Q5_0, 32, 256, seed=4)
    packed = ql.pack(canonical(QType.Q5_0, raw, (32, 256)))
    assert packed.fmt.bits == 5 and packed.nbytes == raw.size


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q5_0, QType.Q8_0, QType.Q6_K, QType.Q2_K, QType.Q3_K,
                                   QType.IQ4_XS], ids=lambda t: t.name)
def test_a_row_alone_equals_the_row_in_any_batch_and_thread_count(kernels, qtype):
    n, k = 48, 512
    packed = ql.pack(canonical(qtype, random_blocks(qtype, n, k, seed=7), (n, k)))
    batch = torch.randn(300, k, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([ql.linear(kernels, batch[i : i + 1], packed) for i in range(batch.shape[0])])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (2, 3, 4, 5, 6, 7, 8, 9, 14, 16, 37, 129, 300):  # every tile shape and remainder; row chunks
                for start in (0, 300 - m):
                    got = ql.linear(kernels, batch[start : start + m], packed)
                    assert torch.equal(got, alone[start : start + m]), (threads, m, start)
    finally:
        torch.set_num_threads(before)


def test_fused_shards_of_different_formats_compute_as_separate_layers(kernels):
    """Gemma 3's q|k|v mixes Q5_0 and Q8_0, its down projections Q4_K and Q6_K: one packed format holds each."""
    k = 256
    parts = [(QType.Q5_0, 32), (QType.Q8_0, 16), (QType.Q4_K, 16), (QType.Q6_K, 32)]
    raws = [random_blocks(t, n, k, seed=i) for i, (t, n) in enumerate(parts)]
    whole = ql.unify([canonical(t, r, (n, k)) for (t, n), r in zip(parts, raws)])
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    w = np.concatenate([gguf_dequantize(t, r, n, k) for (t, n), r in zip(parts, raws)])
    assert whole.fmt == ql.QuantFormat(8, 16, "float32", True)
    np.testing.assert_allclose(whole.dequantize(), w, rtol=1e-6, atol=0)
    check_close(ql.linear(kernels, x, ql.pack(whole)), x, w)


@pytest.mark.parametrize("others", [[QType.IQ4_NL, QType.IQ4_NL], [QType.IQ4_NL, QType.Q8_0, QType.IQ4_XS]],
                         ids=["same-table", "table-and-not"])
def test_fused_shards_with_a_table_format(kernels, others):
    """IQ4 shards alone stay 4-bit indexes into the table; beside other formats they widen to their 8-bit values."""
    k = 256
    raws = [random_blocks(t, 16, k, seed=10 + i) for i, t in enumerate(others)]
    whole = ql.unify([canonical(t, r, (16, k)) for t, r in zip(others, raws)])
    assert (whole.fmt.table is not None) == (set(others) == {QType.IQ4_NL})
    w = np.concatenate([gguf_dequantize(t, r, 16, k) for t, r in zip(others, raws)])
    assert np.array_equal(whole.dequantize(), w)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    check_close(ql.linear(kernels, x, ql.pack(whole)), x, w)
    ids = torch.tensor([0, 5, 17, len(w) - 1])
    assert np.array_equal(ql.rows(kernels, ids, ql.pack(whole)).numpy(), w[ids.numpy()])


@pytest.mark.parametrize("quantize,bound", [(ql.quantize_int8, 0.01), (ql.quantize_int4, 0.12)])
def test_int8_and_int4_quantization_error(kernels, quantize, bound):
    """Float weights quantized at load: the relative error of a layer's output against float32."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)).numpy()
    c = quantize(w)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    exact = x.double().numpy() @ w.astype(np.float64).T
    got = ql.linear(kernels, x, ql.pack(c)).double().numpy()
    assert np.abs(got - exact).max() / np.abs(exact).max() < bound
    check_close(ql.linear(kernels, x, ql.pack(c)), x, c.dequantize())


def test_bad_shapes_are_refused(kernels):
    with pytest.raises(ValueError, match="multiple of 32"):
        ql.quantize_int8(np.zeros((4, 48), dtype=np.float32))
    with pytest.raises(ValueError, match="Q4_K row must hold a multiple of 256"):
        canonical(QType.Q4_K, np.zeros((4, 144 // 2), dtype=np.uint8), (4, 128))
    packed = ql.pack(canonical(QType.Q8_0, random_blocks(QType.Q8_0, 16, 64, seed=0), (16, 64)))
    with pytest.raises(ValueError, match="inputs of 64 features, got 96"):
        ql.linear(kernels, torch.zeros(1, 96), packed)


def _isa_builds() -> list[str]:
    return cpu_ops.lower_builds(cpu_ops.cpu_isa_flags())


@pytest.mark.parametrize("isa", _isa_builds())
def test_every_instruction_set_build_gives_the_native_bits(kernels, isa):
    """The AVX-512, AVX2 (with and without AVX-VNNI) and portable paths share one integer dot product and one float
    epilogue, so they agree to the bit; each lower build is compiled here with the CPU's higher features off."""
    other = cpu_ops.load(isa)
    assert other is not None, f"the {isa} build failed"
    if isa != "generic":
        assert other.isa() == isa
    # K / 32 activation blocks of 3, 2, 8, 12, 18 (16 + 2) and 16: every lane count of the rounding's 16-block steps
    for qtype, k in ((QType.Q4_1, 96), (QType.Q8_0, 64), (QType.Q6_K, 256), (QType.Q4_K, 256), (QType.Q4_1, 384),
                     (QType.Q8_0, 576), (QType.Q4_K, 512), (QType.Q5_0, 96), (QType.Q5_K, 256), (QType.Q2_K, 256),
                     (QType.Q3_K, 512), (QType.IQ4_NL, 96), (QType.IQ4_XS, 256)):
        packed = ql.pack(canonical(qtype, random_blocks(qtype, 40, k, seed=5), (40, k)))
        x = torch.randn(20, k, generator=torch.Generator().manual_seed(6))  # 20: 5-bit blocks widened (AVX-512: 16+ rows, AVX2: 2+)
        x[1, 32:64] = 0.0  # a block whose d is 0
        x[2, 5], x[3, k - 3], x[4, 40] = 3e38, float("inf"), float("nan")  # near float max; d = inf; NaN dropped
        ours, theirs = ql.linear(kernels, x, packed), ql.linear(other, x, packed)
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), qtype.name


def test_8bit_records_of_small_quants_go_as_bits_6_and_give_the_8bit_bits(kernels):
    """Q6_K's 8-bit records hold quants below 64: the kernel gets bits 6 (AVX2 without VNNI multiplies them unsigned)
    and computes what the same records read as any 8-bit records give; a record with a quant of 64 or more stays 8."""
    k = 256
    packed = ql.pack(canonical(QType.Q6_K, random_blocks(QType.Q6_K, 40, k, seed=7), (40, k)))
    assert packed.fmt.bits == 8 and packed.op_args[3] == 6
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(8))
    as_8bit = kernels.quant_linear(x, *packed.op_args[:3], 8, *packed.op_args[4:], None)
    assert torch.equal(ql.linear(kernels, x, packed).view(torch.int32), as_8bit.view(torch.int32))
    int8 = ql.pack(ql.quantize_int8(np.random.default_rng(9).standard_normal((40, k)).astype(np.float32)))
    assert int8.op_args[3] == 8


def test_a_lower_build_with_the_native_flags_is_the_native_build():
    """load(isa) reuses the native build where isa only switches off what the CPU lacks (one ~50 s build less);
    everywhere else it is a build of its own."""
    avx2 = {"avx2", "fma", "f16c"}
    assert cpu_ops.native_equals("avx2", avx2) and not cpu_ops.native_equals("avx2-vnni", avx2)
    vnni = avx2 | {"avx_vnni"}
    assert cpu_ops.native_equals("avx2-vnni", vnni) and not cpu_ops.native_equals("avx2", vnni)
    assert not any(cpu_ops.native_equals(isa, avx2 | {"avx512f", "avx_vnni"}) for isa in ("avx2", "avx2-vnni"))
    assert not any(cpu_ops.native_equals(isa, flags) for isa in ("generic", "avx2") for flags in (set(), {"avx2"}))
    if cpu_ops.native_equals("avx2", cpu_ops.cpu_isa_flags()):
        assert cpu_ops.load("avx2") is cpu_ops.load()
