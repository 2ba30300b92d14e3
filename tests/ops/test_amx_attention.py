"""Prompt rows' attention on AMX tiles (csrc/amx_attention.cpp) against a float64 reference on the same bfloat16
operands; a query's bits whatever chunk computes it; the routing of prompt rows to it on the module path and in the
decode stack (both must give a row the same bits).

The kernel needs a CPU with AMX-BF16 (Intel Sapphire Rapids and later) and runs only there.
"""
import pytest
import torch

from deepinfer.layers.attention import Attention
from deepinfer.layers.context import AttentionMetadata, ForwardContext, PrefillSeq, forward_context
from deepinfer.ops import wide_linear as wl


@pytest.fixture(scope="module")
def amx(kernels):
    if not wl.available(kernels):
        pytest.skip("no AMX-BF16 on this CPU (or the OS refused AMX tile state): the kernel cannot run here")
    return kernels


def paged(total: int, kv_heads: int, dim: int, block_size: int = 16, seed: int = 0):
    """A shuffled block table over a bfloat16 cache holding `total` positions (plus spare blocks of garbage)."""
    g = torch.Generator().manual_seed(seed)
    blocks = (total + block_size - 1) // block_size
    table = torch.randperm(blocks + 3, generator=g)[:blocks]
    k = (torch.randn((blocks + 3) * block_size, kv_heads, dim, generator=g) * 2).bfloat16()
    v = torch.randn((blocks + 3) * block_size, kv_heads, dim, generator=g).bfloat16()
    return k, v, table


def reference(q, k_cache, v_cache, table, first, block_size, scale, window):
    """float64 softmax attention of each query (bfloat16-rounded) at position first + t over its visible keys."""
    T, H, D = q.shape
    G = H // k_cache.shape[1]
    pos = torch.arange(first + T)
    slots = table[pos // block_size] * block_size + pos % block_size
    keys, values = k_cache[slots].double(), v_cache[slots].double()
    out = torch.empty(T, H, D, dtype=torch.float64)
    for t in range(T):
        p = first + t
        lo = max(0, p - window + 1) if window > 0 else 0
        for h in range(H):
            s = keys[lo:p + 1, h // G] @ q[t, h].bfloat16().double() * scale
            out[t, h] = torch.softmax(s, 0) @ values[lo:p + 1, h // G]
    return out


# (heads, kv heads, dim, window): SmolLM2's attention, Gemma 3's sliding and full layers, a plain one
SHAPES = [(9, 3, 64, -1), (4, 1, 256, 40), (4, 1, 256, -1), (2, 2, 128, -1)]


@pytest.mark.parametrize("heads,kv_heads,dim,window", SHAPES)
@pytest.mark.parametrize("first,count", [(0, 77), (45, 21), (0, 1)])
def test_kernel_matches_reference(amx, heads, kv_heads, dim, window, first, count):
    """Within what bfloat16 probabilities allow (2^-9 relative each), whatever the shape, window, cached prefix
    (first > 0) and chunk length (not a multiple of 16 or 32)."""
    k, v, table = paged(first + count, kv_heads, dim, seed=count)
    q = torch.randn(count, heads, dim, generator=torch.Generator().manual_seed(first))
    scale = dim ** -0.5
    got = amx.amx_attention(q, k, v, table, first, 16, scale, window)
    ref = reference(q, k, v, table, first, 16, scale, window)
    err = (got.double() - ref).abs().max().item()
    assert err < 1e-2 * v.float().abs().max().item(), err


@pytest.mark.parametrize("heads,kv_heads,dim,window", SHAPES)
def test_a_query_has_the_same_bits_in_any_chunk(amx, heads, kv_heads, dim, window):
    """The whole prompt at once against the same positions in chunks of 1, 7, 16 and 33 queries: each chunk sees
    only the keys up to its own end (later slots hold other data), and its queries' bits must not change."""
    total = 100
    k, v, table = paged(total, kv_heads, dim, seed=3)
    q = torch.randn(total, heads, dim, generator=torch.Generator().manual_seed(4))
    scale = dim ** -0.5
    whole = amx.amx_attention(q, k, v, table, 0, 16, scale, window)
    for size in (1, 7, 16, 33):
        parts = [amx.amx_attention(q[s:s + size].contiguous(), k, v, table, s, 16, scale, window)
                 for s in range(0, total, size)]
        assert torch.equal(torch.cat(parts), whole), size


def test_bad_inputs_are_refused(amx):
    k, v, table = paged(40, 1, 64)
    q = torch.randn(8, 2, 64)
    with pytest.raises(RuntimeError, match="bfloat16 K and V"):
        amx.amx_attention(q, k.float(), v.float(), table, 0, 16, 0.125, -1)
    with pytest.raises(RuntimeError, match="does not cover"):
        amx.amx_attention(q, k, v, table[:1], 10, 16, 0.125, -1)
    with pytest.raises(RuntimeError, match="head dims"):
        amx.amx_attention(torch.randn(8, 2, 32), k[..., :32].contiguous(), v[..., :32].contiguous(), table, 0, 16,
                          0.125, -1)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_the_layer_sends_a_chunks_prompt_rows_to_the_tiles_and_the_rest_to_the_per_query_kernel(amx,
                                                                                               batch_invariant):
    """A chunk of 20 rows at positions 10..29 whose first 12 are prompt positions (ForwardContext.prompt_runs): those
    take amx_attention, the recomputed generated rows after them paged_prefill, bit for bit; without prompt runs, or
    over a float32 cache, every row takes paged_prefill."""
    heads, kv_heads, dim, first, count = 9, 3, 64, 10, 20
    layer = Attention(heads, kv_heads, dim, dim ** -0.5, cache_index=0)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(count, n, dim, generator=g) for n in (heads, kv_heads, kv_heads))
    table = torch.tensor([3, 0, 5])
    pos = torch.arange(first, first + count)
    slots = table[pos // 16] * 16 + pos % 16

    def run(runs, dtype=torch.bfloat16):
        k_cache = torch.randn(6 * 16, kv_heads, dim, generator=torch.Generator().manual_seed(8)).to(dtype)
        v_cache = torch.randn(6 * 16, kv_heads, dim, generator=torch.Generator().manual_seed(9)).to(dtype)
        md = AttentionMetadata(slots, 0, None, None, [PrefillSeq(0, count, first + count, table)])
        ctx = ForwardContext(md, [(k_cache, v_cache)], pos, batch_invariant=batch_invariant, cpu_kernels=amx,
                             prompt_runs=runs)
        with forward_context(ctx):
            out = layer(q, k, v).view(count, heads, dim)
        return out, k_cache, v_cache

    out, k_cache, v_cache = run(((0, 12),))
    scale = dim ** -0.5
    assert torch.equal(out[:12], amx.amx_attention(q[:12].contiguous(), k_cache, v_cache, table, first, 16, scale, -1))
    assert torch.equal(out[12:], amx.paged_prefill(q[12:].contiguous(), k_cache, v_cache, table, first + 12, 16,
                                                   scale, -1, 0))
    for runs, dtype in [((), torch.bfloat16), (((0, 12),), torch.float32)]:
        out, k_cache, v_cache = run(runs, dtype)
        assert torch.equal(out, amx.paged_prefill(q, k_cache, v_cache, table, first, 16, scale, -1, 0))

