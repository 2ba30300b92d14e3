"""Batch-invariant kernels: a token's result depends only on its own data, never on the other tokens in the step.

Float addition is not associative, so a reduction gives the same bits only if it adds the same numbers in the same
order. Library kernels pick their order from the problem shape (a GEMM's blocking and threading change with the row
count M; a reduction splits rows across threads or blocks by the row count), so every reduction here gets an order
fixed by construction:

- ``linear``: rows go through the GEMM in tiles of exactly ``ROW_TILE`` rows (the last tile zero-padded), one call
  per tile, every tile starting 64-byte aligned. Every call has the same shape, strides and alignment whatever M is,
  so the library runs the same code with the same K order, and a GEMM row reads only its own input row. On a CPU
  with MKL the weight is packed once for that tile shape (``cblas_sgemm_pack``), which makes tiles as fast as one
  large call at batch 32; elsewhere each tile is one F.linear call. The rows past the last full tile may go through
  a shorter tile (``SHORT_TILES``, an F.linear call) only where a probe at load found that tile's rows bitwise equal
  to the full packed tile's at several thread counts (``short_tiles``): a decode of a few rows then costs a 4- or
  8-row GEMM, not a 32-row one. Whether it holds is MKL's choice per shape and CPU, so it is measured, never assumed.
  Where deepinfer's compiled CPU ops exist, float32 layers use neither: ``dense_linear`` (csrc/dense_linear.cpp)
  computes each output as one fma chain in k order, invariant by construction at any row count (``pack_panels``).
- ``fold_sum`` (RMSNorm, softmax, log_softmax, attention's sums): a pairwise tree over the last dimension made of
  elementwise adds, whose pairs depend only on the row length. An elementwise add is one IEEE addition whatever
  kernel, thread or device runs it. max needs no order (it is exact), so ``amax`` is used as is.
- ``paged_attention``: keys are split into chunks of ``KV_CHUNK`` positions aligned at absolute position 0. Per
  (token, kv head, chunk) the scores are a [group, head_dim] x [head_dim, chunk] GEMM item and the chunk's p V a
  [group, chunk] x [chunk, v_dim] item, identical for decodes, prefill chunks and prefix hits; the row max is
  exact; chunk sums are ``fold_sum``s; chunk results are added left to right from position 0. A chunk with no
  visible key adds exact zeros, so padding with or skipping such chunks changes nothing.

What this relies on: that a GEMM call computes each output row (each item, for a batched call) in an order set by
the call's shape, layout and alignment, not by the values of other rows or the batch count. On a CPU that is MKL's
behaviour, checked by tests/ops over batch sizes and thread counts. Off the CPU every attention GEMM call is made
identical too (``_items_per_call``), as every linear tile already is, so the reliance there is only on cuBLAS giving
the same bits for the same call on the same GPU, which it documents. Elementwise kernels must apply the same
function to every element: true on CUDA; on a CPU torch's silu and sigmoid compute the tail of a thread's slice with
a scalar formula that can differ in the last bit from the vector one (exp, rsqrt and log do not), which only matters
when a row's width is not a multiple of 32 floats (SmolLM2's are; see the README).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


ROW_TILE = 32  # rows per GEMM call: batch-32 decode is one full tile (measured fastest at batch 32-64 on MKL)
SHORT_TILES = (4, 8, 16)  # candidate heights for the last tile (MKL on Zen 4: rows of 1-3 rows differ, 4k agree)
_PROBE_THREADS = (1, 2, 4)  # thread counts a short tile must agree at, besides the current one
KV_CHUNK = 64  # key positions per attention reduction chunk (at least one KV block)
_ALIGN = 64  # bytes: every tile of a GEMM starts on this boundary (ROW_TILE * K * 4 bytes keeps it from tile to tile)
_GPU_ITEMS_PER_CALL = 256  # attention GEMM items per batched call off the CPU
_PREFILL_ROWS = 256  # query tokens of one sequence scored at once, to bound the [tokens, chunks, ...] scores tensor


# ---- reductions over the last dimension ---------------------------------------------------------------------------


def fold_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension (kept, size 1) in a pairwise order fixed by its length alone: element i adds
    element i + half until one is left; an odd width first sets its last element aside, added at the end in the
    reverse order it was set aside."""
    aside = []
    while x.shape[-1] > 1:
        width = x.shape[-1]
        if width % 2:
            aside.append(x[..., width - 1 :])
            width -= 1
        half = width // 2
        x = x[..., :half] + x[..., half:width]
    for tail in reversed(aside):
        x = x + tail
    return x


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, float32, in a fixed order per row."""
    x = x.float()
    p = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return p / fold_sum(p)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dimension, float32, in a fixed order per row."""
    x = x.float()
    shifted = x - x.amax(dim=-1, keepdim=True)
    return shifted - torch.log(fold_sum(torch.exp(shifted)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm as layers.norm.RMSNorm computes it (float32, weight or 1 + weight), with a fold for the mean square."""
    dtype = x.dtype
    x = x.float()
    mean_square = fold_sum(x * x) / x.shape[-1]
    x = x * torch.rsqrt(mean_square + eps)
    return (x * (weight.float() + offset if offset else weight.float())).to(dtype)  # w + 0.0 is w: one op less


# ---- matmul -------------------------------------------------------------------------------------------------------


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight packed by MKL for ROW_TILE-row GEMMs, or None where that path does not exist (not float32 on a CPU
    with MKL); ``linear`` then calls F.linear per tile, which is invariant by the same argument, only slower."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkl.is_available():
        return None
    try:
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), ROW_TILE)
    except (AttributeError, RuntimeError):  # a torch build without the MKL packed-GEMM ops
        return None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] float32 weight as the compiled ``dense_linear`` reads it: [ceil(N / 16), K, 16], zero rows past N.
    That kernel computes each output as one chain of fused multiply-adds in k order, invariant by construction;
    it replaces the tiles below wherever the compiled CPU ops exist (transforms/batch_invariant.py)."""
    n, k = weight.shape
    panels = -(-n // 16)
    return F.pad(weight.detach().float(), (0, 0, 0, 16 * panels - n)).view(panels, 16, k).transpose(1, 2).contiguous()


def short_tiles(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> tuple[int, ...]:
    """The heights in SHORT_TILES whose F.linear rows equal the packed ROW_TILE GEMM's rows, bit for bit, on random
    rows at 1, 2, 4 and the current number of threads; () without a packed weight (off MKL the fixed tile stands)."""
    if packed is None:
        return ()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROW_TILE, weight.shape[1], generator=gen, dtype=weight.dtype)
    before = torch.get_num_threads()
    allowed = set(SHORT_TILES)
    try:
        for threads in sorted({*_PROBE_THREADS, before}):
            torch.set_num_threads(threads)
            want = torch.ops.mkl._mkl_linear(x, packed, weight, bias, ROW_TILE)
            allowed = {h for h in allowed if torch.equal(F.linear(x[:h].clone(), weight, bias), want[:h])}
    finally:
        torch.set_num_threads(before)
    return tuple(sorted(allowed))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, short: tuple[int, ...] = ()) -> torch.Tensor:
    """x W^T + b with every row computed by a GEMM call of the same shape: tiles of ROW_TILE rows, the last one
    zero-padded to ROW_TILE or to the smallest height in ``short`` (from ``short_tiles``) that holds it."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if not (rows.is_contiguous() and rows.data_ptr() % _ALIGN == 0):
        rows = rows.new_empty(rows.shape).copy_(rows)  # a fresh buffer: the allocator aligns to 64 bytes
    m = rows.shape[0]
    full = m // ROW_TILE * ROW_TILE
    tiles = [rows[start : start + ROW_TILE] for start in range(0, full, ROW_TILE)]
    if full < m or m == 0:
        height = next((h for h in short if h >= m - full), ROW_TILE)
        rest = rows.new_zeros(height, k)
        rest[: m - full] = rows[full:]
        tiles.append(rest)
    outs = [torch.ops.mkl._mkl_linear(tile, packed, weight, bias, ROW_TILE) if packed is not None and len(tile) ==
            ROW_TILE else F.linear(tile, weight, bias) for tile in tiles]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:m].reshape(*lead, weight.shape[0])


# ---- attention ----------------------------------------------------------------------------------------------------


def paged_attention(layer, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md) -> torch.Tensor:
    """q [T, H, D] against the cached K/V (this step's already written) -> [T, H, Dv] in q's dtype.

    `layer` gives num_heads, num_kv_heads, v_head_dim, scale and sliding_window; `md` is the step's attention
    metadata (layers.context.AttentionMetadata: decode tables and lengths, prefill sequences, block size).

    Per query and kv head (G query heads share it): scores against each key chunk by a [G, D] x [D, chunk] GEMM
    item; the row max over all visible keys (exact in any order); p = exp(score - max); per chunk its fold_sum and
    a [G, chunk] x [chunk, Dv] GEMM item; chunk sums and chunk outputs added left to right from position 0;
    out = sum_pv / sum_p. Decodes (rows 0..num_decodes-1) run as one batched GEMM per kv head over the (row, chunk)
    pairs that hold keys; each prefill sequence as one batched GEMM per chunk and kv head over its tokens (the
    chunk's keys shared, batch stride 0). Items, masks and the order of additions are the same on both paths, so a
    token's result depends neither on which path ran it, nor on the other rows, nor on how its prompt was chunked
    or which of its blocks came from the prefix cache. A chunk with nothing visible for a row adds exact zeros.
    """
    chunk = max(KV_CHUNK, md.block_size)
    qs = q.float() * layer.scale  # a fresh contiguous [T, H, D]; scaling q, not the scores, saves a pass
    out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
    nd = md.num_decodes
    if nd:
        out[:nd] = _decode(layer, qs[:nd], k_cache, v_cache, md.decode_block_tables, md.decode_context_lens,
                           chunk, md.block_size).to(out.dtype)
    for seq in md.prefills:
        num_chunks = -(-seq.context_len // chunk)
        blocks = _chunk_blocks(seq.block_table[None], num_chunks, chunk // md.block_size)[0]
        keys, values = _gather(k_cache, blocks, md.block_size), _gather(v_cache, blocks, md.block_size)
        first = seq.context_len - seq.num_tokens
        for start in range(0, seq.num_tokens, _PREFILL_ROWS):
            n = min(_PREFILL_ROWS, seq.num_tokens - start)
            rows = slice(seq.start + start, seq.start + start + n)
            out[rows] = _prefill(layer, qs[rows], keys.flatten(0, 1), values.flatten(0, 1), first + start,
                                 chunk).to(out.dtype)
    return out


def _chunk_blocks(tables: torch.Tensor, num_chunks: int, per_chunk: int) -> torch.Tensor:
    """Block ids [rows, num_chunks, per_chunk] of each table row's first num_chunks key chunks. Tables shorter than
    that are padded with block 0: finite values at masked positions, which contribute exact zeros."""
    width = num_chunks * per_chunk
    if tables.shape[1] < width:
        tables = F.pad(tables, (0, width - tables.shape[1]))
    return tables[:, :width].reshape(tables.shape[0], num_chunks, per_chunk)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache rows of whole blocks [*, per_chunk] -> [*, per_chunk * block_size, heads, dim], float32. Keys keep
    the cache's layout: the score GEMMs read them as transposed views, the same on both paths."""
    rows = cache.view(cache.shape[0] // block_size, -1).index_select(0, blocks.flatten())
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, *cache.shape[1:]).float()


def _items_per_call(device: torch.device) -> int | None:
    """None on a CPU: MKL's strided batch GEMM computes each item as a GEMM of the item's own shape and layout,
    whatever the batch count or batch stride (tests/ops check it across batch sizes and thread counts). Elsewhere
    (cuBLAS chooses kernels from the batch count and strides) every call gets the same number of contiguous items."""
    return None if device.type == "cpu" else _GPU_ITEMS_PER_CALL


def _bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Batched GEMM of items a [U, M, K] x b [U, K, N] whose per-item result does not depend on U."""
    group = _items_per_call(a.device)
    if group is None:
        return torch.bmm(a, b, out=out)
    results = []
    for start in range(0, a.shape[0], group):
        a_g, b_g = a[start : start + group].contiguous(), b[start : start + group].contiguous()
        if a_g.shape[0] < group:  # zero items pad the last call to the same count
            a_g = torch.cat((a_g, a_g.new_zeros(group - a_g.shape[0], *a_g.shape[1:])))
            b_g = torch.cat((b_g, b_g.new_zeros(group - b_g.shape[0], *b_g.shape[1:])))
        results.append(torch.bmm(a_g, b_g))
    result = torch.cat(results)[: a.shape[0]]
    return result if out is None else out.copy_(result)


def _mask(layer, positions: torch.Tensor, key_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(bias, keep) as float tensors of the broadcast shape of query positions and key positions: bias 0 / -inf
    and keep 1 / 0 for visible / masked keys; None if every key is visible."""
    visible = key_positions <= positions
    if layer.sliding_window is not None:
        visible &= key_positions > positions - layer.sliding_window
    if bool(visible.all()):
        return None
    keep = visible.float()
    return torch.zeros_like(keep).masked_fill_(~visible, float("-inf")), keep


def _masked_max(scores: torch.Tensor, mask) -> torch.Tensor:
    """Max over the last dimension of the visible scores (max is exact in any order); -inf if none is visible."""
    return (scores if mask is None else scores + mask[0]).amax(dim=-1, keepdim=True)


def _exp(scores: torch.Tensor, row_max: torch.Tensor, mask) -> torch.Tensor:
    """exp(score - max), exactly 0 where masked. Masked entries reach exp as exp(0), never as exp(-inf), which is
    several times slower on CPUs (scores are finite: keys in the cache are). For visible entries the masked and
    the plain form give the same bits (x * 1 and x + 0 are exact), so callers mask only where something is masked."""
    if mask is None:
        return torch.exp(scores - row_max)
    keep = mask[1]
    return torch.exp((scores - row_max) * keep).mul_(keep)


def _decode(layer, q, k_cache, v_cache, tables, lens, chunk, block_size):
    """One query per row, row u at position lens[u] - 1 -> [U, H, Dv]. Items are the (row, chunk) pairs a row has
    keys in, gathered straight from the cache; the chunks a row has no keys in add exact zeros."""
    u, hkv = q.shape[0], layer.num_kv_heads
    group = layer.num_heads // hkv
    counts = -(-lens // chunk)
    num_chunks = int(counts.max())
    rows = torch.repeat_interleave(torch.arange(u, device=q.device), counts)  # pair -> row
    chunk_of = torch.arange(rows.shape[0], device=q.device) - (torch.cumsum(counts, 0) - counts)[rows]
    slot = rows * num_chunks + chunk_of  # pair -> (row, chunk) in a [U * C] grid
    blocks = _chunk_blocks(tables, num_chunks, chunk // block_size)[rows, chunk_of]
    keys, values = _gather(k_cache, blocks, block_size), _gather(v_cache, blocks, block_size)  # [P, chunk, Hkv, D]
    scores = q.new_empty(hkv, rows.shape[0], group, chunk)
    for h in range(hkv):  # items [G, D] x [D, chunk], as on the prefill path
        _bmm(q[rows, h * group : (h + 1) * group], keys[:, :, h].transpose(1, 2), out=scores[h])
    key_pos = chunk_of.view(-1, 1, 1) * chunk + torch.arange(chunk, device=q.device)
    mask = _mask(layer, (lens - 1)[rows].view(-1, 1, 1), key_pos)  # [P, 1, chunk]
    pair_max = q.new_full((hkv, u * num_chunks, group, 1), float("-inf"))
    pair_max[:, slot] = _masked_max(scores, mask)
    row_max = pair_max.view(hkv, u, num_chunks, group, 1).amax(dim=2)
    p = _exp(scores, row_max[:, rows], mask)
    sums = q.new_zeros(hkv, u * num_chunks, group, 1)
    sums[:, slot] = fold_sum(p)
    outs = q.new_zeros(hkv, u * num_chunks, group, layer.v_head_dim)
    for h in range(hkv):
        outs[h, slot] = _bmm(p[h], values[:, :, h])
    sums, outs = sums.view(hkv, u, num_chunks, group, 1), outs.view(hkv, u, num_chunks, group, -1)
    total = torch.zeros_like(sums[:, :, 0])
    acc = torch.zeros_like(outs[:, :, 0])
    for c in range(num_chunks):  # left to right, as _prefill adds them
        total += sums[:, :, c]
        acc += outs[:, :, c]
    return (acc / total).transpose(0, 1).reshape(u, layer.num_heads, -1)


def _prefill(layer, q, keys, values, first_position, chunk):
    """Consecutive queries of one sequence sharing keys [L, Hkv, D] and values [L, Hkv, Dv] -> [U, H, Dv].

    Chunk c is multiplied only for the rows at or after its first position; the earlier rows keep zero scores,
    fully masked, so they add the exact zeros a chunk without keys adds on the decode path.
    """
    u, hkv = q.shape[0], layer.num_kv_heads
    group = layer.num_heads // hkv
    firsts = [max(0, c * chunk - first_position) for c in range(keys.shape[0] // chunk)]
    firsts = [f for f in firsts if f < u]  # later chunks hold only positions after every row
    num_chunks = len(firsts)
    scores = q.new_zeros(hkv, num_chunks, u, group, chunk)
    for c, first in enumerate(firsts):
        for h in range(hkv):  # items [G, D] x [D, chunk], the chunk's keys shared by the tokens (batch stride 0)
            b = keys[c * chunk : (c + 1) * chunk, h].t()
            _bmm(q[first:, h * group : (h + 1) * group], b.expand(u - first, *b.shape), out=scores[h, c, first:])
    positions = torch.arange(first_position, first_position + u, device=q.device).view(1, u, 1, 1)
    key_pos = torch.arange(num_chunks * chunk, device=q.device).view(num_chunks, 1, 1, chunk)
    mask = _mask(layer, positions, key_pos)  # [C, U, 1, chunk]
    row_max = _masked_max(scores, mask).amax(dim=1, keepdim=True)
    p = _exp(scores, row_max, mask)
    sums = fold_sum(p)
    outs = q.new_zeros(hkv, num_chunks, u, group, layer.v_head_dim)
    for c, first in enumerate(firsts):
        for h in range(hkv):
            v = values[c * chunk : (c + 1) * chunk, h]
            _bmm(p[h, c, first:], v.expand(u - first, *v.shape), out=outs[h, c, first:])
    total = torch.zeros_like(sums[:, 0])
    acc = torch.zeros_like(outs[:, 0])
    for c in range(num_chunks):  # left to right, as _decode adds them
        total += sums[:, c]
        acc += outs[:, c]
    return (acc / total).transpose(0, 1).reshape(u, layer.num_heads, -1)
