"""The compiled paged-decode kernel against the torch path (gather + SDPA) on random paged caches: full attention
and sliding windows, head dims 64/128/256, grouped query heads, ragged lengths, shuffled block tables."""
import re

import pytest
import torch

from deepinfer.layers.attention import Attention

BS = 16


@pytest.fixture(scope="module")
def kernel(kernels):
    return kernels.paged_decode


@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, None), (4, 1, 256, 40), (8, 8, 128, None),
                                                        (6, 2, 64, 17), (8, 1, 256, None), (2, 2, 256, None),
                                                        (16, 2, 128, 17)])  # value sweeps of 2, 8 and 2 pieces
def test_kernel_matches_the_torch_path(kernel, heads, kv_heads, dim, window):
    gen = torch.Generator().manual_seed(heads * dim)
    num_blocks = 128
    k = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen)
    lens = torch.tensor([1, 15, 16, 17, 100, 33, 250], dtype=torch.int64)
    width = int((lens.max() + BS - 1) // BS)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width).contiguous()
    q = torch.randn(len(lens), heads, dim, generator=gen)
    layer = Attention(heads, kv_heads, dim, dim**-0.5, 0, sliding_window=window)
    want = layer._decode(q, k, v, tables, lens, BS)
    got = kernel(q, k, v, tables, lens, BS, dim**-0.5, window or -1)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, None), (4, 1, 256, 40), (6, 2, 128, 17),
                                                     (14, 2, 64, None),  # 7 query heads a KV head (Qwen2 7B)
                                                     (8, 1, 256, 40)])  # accumulators swept in pieces
def test_bfloat16_cache_matches_float32_attention_over_the_same_values(kernels, heads, kv_heads, dim, window):
    """A bfloat16 cache is read as the float32 values it holds: a float32 cache holding those values gives the same
    result to float rounding (the compiler may order a vectorized dot product differently for the two types), and
    prefill rows give the decode bits (what batch invariance needs)."""
    gen = torch.Generator().manual_seed(dim + heads)
    num_blocks = 80
    k = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen).bfloat16()
    lens = torch.tensor([1, 16, 17, 99, 200], dtype=torch.int64)
    width = int((lens.max() + BS - 1) // BS)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width).contiguous()
    q = torch.randn(len(lens), heads, dim, generator=gen)
    scale, w = dim**-0.5, window or -1
    got = kernels.paged_decode(q, k, v, tables, lens, BS, scale, w)
    torch.testing.assert_close(got, kernels.paged_decode(q, k.float(), v.float(), tables, lens, BS, scale, w),
                               atol=1e-6, rtol=1e-6)
    layer = Attention(heads, kv_heads, dim, scale, 0, sliding_window=window)
    torch.testing.assert_close(got, layer._decode(q, k, v, tables, lens, BS), atol=2e-6, rtol=1e-5)
    last = torch.randn(5, heads, dim, generator=gen)  # the last five positions of the longest row, as one chunk
    chunk = kernels.paged_prefill(last, k, v, tables[-1], int(lens[-1]) - 5, BS, scale, w)
    one_by_one = [kernels.paged_decode(last[i : i + 1], k, v, tables[-1:], lens[-1:] - 4 + i, BS, scale, w)
                  for i in range(5)]
    assert torch.equal(chunk, torch.cat(one_by_one))


def test_float8_cache_is_read_as_the_values_it_holds(kernels):
    """A float8 e4m3fn cache holding every one of its 254 finite values (subnormals, +-0, +-448 included) gives what
    a float32 cache holding the same values gives, in decode and in prefill rows (the widening is exact)."""
    gen = torch.Generator().manual_seed(8)
    heads, kv_heads, dim, num_blocks = 9, 3, 64, 80
    finite = torch.arange(256, dtype=torch.uint8)
    finite = finite[~finite.view(torch.float8_e4m3fn).float().isnan()]
    k = (torch.randn(num_blocks * BS, kv_heads, dim, generator=gen) * 4).to(torch.float8_e4m3fn)
    v = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen).to(torch.float8_e4m3fn)
    k.view(torch.uint8).view(-1)[: finite.numel()] = finite
    v.view(torch.uint8).view(-1)[: finite.numel()] = finite.flip(0)
    lens = torch.tensor([1, 16, 17, 99, 200], dtype=torch.int64)
    width = int((lens.max() + BS - 1) // BS)
    tables = torch.cat([torch.arange(width).view(1, width),  # the blocks holding every value come first
                        torch.randperm(num_blocks, generator=gen)[: 4 * width].view(4, width)]).contiguous()
    q = torch.randn(len(lens), heads, dim, generator=gen)
    got = kernels.paged_decode(q, k, v, tables, lens, BS, dim**-0.5, -1)
    torch.testing.assert_close(got, kernels.paged_decode(q, k.float(), v.float(), tables, lens, BS, dim**-0.5, -1),
                               atol=1e-6, rtol=1e-6)
    chunk = kernels.paged_prefill(q, k, v, tables[-1], int(lens[-1]) - len(lens), BS, dim**-0.5, -1)
    one_by_one = [kernels.paged_decode(q[i : i + 1], k, v, tables[-1:], lens[-1:] - len(lens) + 1 + i, BS,
                                       dim**-0.5, -1) for i in range(len(lens))]
    assert torch.equal(chunk, torch.cat(one_by_one))


def test_kernel_refuses_what_it_does_not_handle(kernel):
    q = torch.randn(1, 2, 64, dtype=torch.bfloat16)
    k = torch.randn(16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32 queries"):  # bfloat16 queries
        kernel(q, k, k, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), BS, 0.1, -1)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float8_e4m3fn cache"):
        kernel(q.float(), k.half(), k.half(), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
               BS, 0.1, -1)
    q, k = q.float(), torch.randn(16, 2, 48)
    with pytest.raises(RuntimeError, match="head dims"):
        kernel(torch.randn(1, 2, 48), k, k, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
               BS, 0.1, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("window", [None, 21])
def test_prefill_queries_give_the_decode_bits_of_their_position(kernels, window, heads, kv_heads, dtype):
    """Batch-invariant mode relies on it: query t of a prefill chunk equals, bit for bit, a decode at its position,
    whatever chunk it came in, from a float32 or a bfloat16 cache, for groups of 3, 8 and 1 query heads."""
    gen = torch.Generator().manual_seed(7)
    dim, num_blocks = 64, 16
    k = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)
    q = torch.randn(70, heads, dim, generator=gen)
    scale, w = dim**-0.5, window or -1
    decodes = torch.stack([kernels.paged_decode(q[t : t + 1], k, v, table[None], torch.tensor([t + 1]), BS, scale, w)[0]
                           for t in range(70)])
    for chunks in ([70], [1, 69], [16, 16, 38], [5, 40, 25], [3, 2, 65]):
        start, got = 0, []
        for n in chunks:
            got.append(kernels.paged_prefill(q[start : start + n], k, v, table, start, BS, scale, w))
            start += n
        assert torch.equal(torch.cat(got), decodes), chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["f32", "bf16", "fp8"])
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, None), (4, 1, 256, 30), (4, 2, 128, None)])
def test_decode_rows_of_one_sequence_read_together_give_each_row_its_bits(kernels, heads, kv_heads, dim, window, dtype):
    """Consecutive positions of one sequence in a decode batch (a token and its drafts, a prompt in the decode stack)
    are read as query tiles of 4: each row keeps the bits it gets alone. Rows that only look consecutive (lengths one
    apart, a different block table) are not read together; runs of 6 and 3 leave rows outside any tile."""
    gen = torch.Generator().manual_seed(dim + heads)
    num_blocks, width = 24, 8
    k = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen).to(dtype)
    seq_a, seq_b = torch.randperm(num_blocks, generator=gen)[:width], torch.randperm(num_blocks, generator=gen)[:width]
    tables = [seq_a] * 6 + [seq_b] + [seq_a] * 3 + [seq_b]
    lens = [40, 41, 42, 43, 44, 45, 46, 96, 97, 98, 99]  # row 6 (len 46, seq_b) follows row 5 (45, seq_a)
    rows = len(lens)
    q = torch.randn(rows, heads, dim, generator=gen)
    scale, w = dim**-0.5, window or -1
    got = kernels.paged_decode(q, k, v, torch.stack(tables), torch.tensor(lens), BS, scale, w)
    for n in range(rows):
        alone = kernels.paged_decode(q[n : n + 1], k, v, tables[n][None], torch.tensor([lens[n]]), BS, scale, w)
        assert torch.equal(got[n], alone[0]), n
    layer = Attention(heads, kv_heads, dim, scale, 0, sliding_window=window)
    want = layer._decode(q, k.float(), v.float(), torch.stack(tables), torch.tensor(lens), BS)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, None), (4, 4, 128, 600), (8, 1, 256, None)])
@pytest.mark.parametrize("tokens", [1, 37, 128, 129, 513])
def test_fresh_prefill_causal_shortcut_gives_the_masked_bits(heads, kv_heads, dim, window, tokens):
    """A prompt's first chunk uses SDPA's is_causal (no mask tensor); the explicit mask gives the same bits."""
    torch.manual_seed(tokens)
    attn = Attention(heads, kv_heads, dim, dim**-0.5, 0, window)
    q, k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    shortcut = attn._prefill(q, k, v, tokens)
    # what the mask path computes for the same rows: the explicit causal mask
    pos_q = torch.arange(tokens)[:, None]
    pos_k = torch.arange(tokens)[None, :]
    mask = pos_k <= pos_q
    masked = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, scale=dim**-0.5, enable_gqa=heads != kv_heads).squeeze(0).transpose(0, 1)
    assert torch.equal(shortcut, masked)


@pytest.mark.parametrize("isa", ["avx2", "generic"])
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, None), (8, 1, 256, 40), (14, 2, 128, 17)])
def test_lower_builds_match_the_torch_path_and_give_a_row_its_bits_in_any_batch(isa, heads, kv_heads, dim, window):
    """The AVX2 (keys 4 at a time) and portable loops, built here with the CPU's higher features off: close to the
    torch path, a prefill row gives its decode bits, and a row alone (one item per query head) equals that row inside
    a batch (one item per KV head once every thread has one). 7 query heads a KV head has no compiled copy."""
    from deepinfer.ops import cpu_ops

    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_ops.cpu_isa_flags():
        pytest.skip("this CPU has no AVX2")
    ops = cpu_ops.load(isa)
    assert ops is not None, f"the {isa} build failed"
    gen = torch.Generator().manual_seed(dim + heads)
    num_blocks = 160
    lens = torch.tensor([1, 16, 17, 99, 250, 3, 64, 130], dtype=torch.int64)
    width = int((lens.max() + BS - 1) // BS)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width).contiguous()
    q = torch.randn(len(lens), heads, dim, generator=gen)
    scale, w = dim**-0.5, window or -1
    layer = Attention(heads, kv_heads, dim, scale, 0, sliding_window=window)
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        k = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen).to(dtype)
        batch = ops.paged_decode(q, k, v, tables, lens, BS, scale, w)
        torch.testing.assert_close(batch, layer._decode(q, k, v, tables, lens, BS), atol=2e-6, rtol=1e-5)
        for r in range(len(lens)):
            alone = ops.paged_decode(q[r : r + 1], k, v, tables[r : r + 1], lens[r : r + 1], BS, scale, w)
            assert torch.equal(alone[0], batch[r]), (dtype, r)
        last = torch.randn(5, heads, dim, generator=gen)
        chunk = ops.paged_prefill(last, k, v, tables[4], int(lens[4]) - 5, BS, scale, w)
        one_by_one = [ops.paged_decode(last[i : i + 1], k, v, tables[4:5], lens[4:5] - 4 + i, BS, scale, w)
                      for i in range(5)]
        assert torch.equal(chunk, torch.cat(one_by_one)), dtype


def test_which_prefill_chunks_take_the_kernel():
    from deepinfer.layers.attention import PAGED_PREFILL_MAX, paged_prefill_takes
    assert paged_prefill_takes(PAGED_PREFILL_MAX, PAGED_PREFILL_MAX)
    assert not paged_prefill_takes(PAGED_PREFILL_MAX + 1, PAGED_PREFILL_MAX + 1)  # fresh and long: SDPA
    assert paged_prefill_takes(PAGED_PREFILL_MAX + 1, 16)  # cached context: the kernel at any length
    assert paged_prefill_takes(PAGED_PREFILL_MAX + 1, PAGED_PREFILL_MAX + 1, window=512)  # past the window
    assert not paged_prefill_takes(PAGED_PREFILL_MAX + 1, PAGED_PREFILL_MAX + 1, window=PAGED_PREFILL_MAX + 1)


def test_windowed_prefill_chunk_matches_the_masked_torch_path(kernels):
    """A fresh chunk past a sliding window (Gemma 3's shapes), which now takes the kernel at any length: the same
    values as SDPA over the masked square, to float rounding."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, window, t = 4, 1, 256, 40, 300
    width = -(-t // BS)
    k = torch.randn(width * BS, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(width * BS, kv_heads, dim, generator=gen).bfloat16()
    table = torch.randperm(width, generator=gen)
    slots = (table[:, None] * BS + torch.arange(BS)).reshape(-1)[:t]
    q = torch.randn(t, heads, dim, generator=gen)
    layer = Attention(heads, kv_heads, dim, dim**-0.5, 0, sliding_window=window)
    want = layer._prefill(q, k[slots], v[slots], t, 0)
    got = kernels.paged_prefill(q, k, v, table, 0, BS, dim**-0.5, window)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["f32", "bf16", "fp8"])
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, None), (4, 1, 256, 30)])
def test_the_prefetch_level_changes_no_bit(kernels, heads, kv_heads, dim, window, dtype):
    """Prefetching into L1 or L2 (the machine's choice, or either asked for) gives the same bits: decode rows alone
    and as query tiles, and a prefill chunk. A level the kernel does not have is refused."""
    gen = torch.Generator().manual_seed(7 * dim + heads)
    num_blocks, width = 40, 10
    k = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks * BS, kv_heads, dim, generator=gen).to(dtype)
    seq = torch.randperm(num_blocks, generator=gen)[:width]
    tables = torch.stack([seq] * 5 + [torch.randperm(num_blocks, generator=gen)[:width]])
    lens = torch.tensor([100, 101, 102, 103, 104, 150])  # four rows of one sequence become a tile
    q = torch.randn(len(lens), heads, dim, generator=gen)
    scale, w = dim**-0.5, window or -1
    decodes = [kernels.paged_decode(q, k, v, tables, lens, BS, scale, w, prefetch=level) for level in (0, 2, 3)]
    chunks = [kernels.paged_prefill(q[:5], k, v, seq, 95, BS, scale, w, prefetch=level) for level in (0, 2, 3)]
    assert all(torch.equal(decodes[0], d) for d in decodes[1:])
    assert all(torch.equal(chunks[0], c) for c in chunks[1:])
    with pytest.raises(RuntimeError, match=r"prefetch is 0 \(the machine's choice\), 2 \(L2\) or 3 \(L1\), got 1"):
        kernels.paged_decode(q, k, v, tables, lens, BS, scale, w, prefetch=1)


def test_the_machine_prefetch_level_is_named_and_can_be_overridden(kernels):
    """attention_prefetch() names the level this machine's rule picks and why (the start-up log prints it);
    DEEPINFER_ATTN_PREFETCH=l1|l2 overrides the rule, anything else is refused with the values it takes."""
    import os
    import subprocess
    import sys

    assert re.fullmatch(r"L[12] \(.+\)", kernels.attention_prefetch())
    code = "from deepinfer.ops import cpu_ops; print(cpu_ops.load().attention_prefetch())"
    for value, want in (("l1", "L1 (DEEPINFER_ATTN_PREFETCH)"), ("l2", "L2 (DEEPINFER_ATTN_PREFETCH)")):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "DEEPINFER_ATTN_PREFETCH": value})
        assert run.returncode == 0 and run.stdout.strip() == want, run.stderr[-2000:]
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DEEPINFER_ATTN_PREFETCH": "l3"})
    assert run.returncode != 0 and "DEEPINFER_ATTN_PREFETCH must be 'l1' or 'l2'" in run.stderr and "'l3'" in run.stderr
