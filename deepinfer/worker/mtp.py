"""MTP drafts on the paged KV cache: the MTP layer is one more attention layer, caching at its index after the
main model's layers in the same blocks as the request's other layers.

After a step's forward and sampling, every row whose next token is now known gets the MTP layer's KV: prompt rows
(their next token is the next prompt token), a sampling request's known row and its accepted drafts (their next
tokens are the tokens just emitted). Row p combines the main model's hidden state at p with the embedding of token
p + 1, so its KV lands at position p, exactly where the main model's is, and only for positions that are computed:
rejected drafts never get MTP KV. Only the last such row of a request that drafts this step needs the layer's
output (it predicts the first draft): it runs the whole layer as a decode row (a decoding request's accepted rows
with it, one call for all); every other row computes only the K and V the layer would cache (the projection and the
block's K/V projections, no attention or MLP: about a fifth of the layer's weights), which is all a sequence that
is not drafting pays per step; in a step of 8+ sequences where none drafts (varlen), decode rows skip even that
(`decodes`, worker/speculative.mtp_upkeep) and only prompt rows are cached. Deeper drafts apply the layer again to
its own output and the previous draft, one row per request at the next position (DeepSeek's recursive use of one MTP
layer); that speculative KV is rewritten once the position is computed. Drafts are greedy: deterministic proposals,
verified as one-hot drafts (lossless either way). Each depth runs through the MTP layer's decode stack
(transforms/fused_ops.py) where the model has one. In a step of decode rows only (every request decoding, the common
step), each depth is one compiled call from the tokens and hidden states: the stack's input stage computes the
layer's input, and the rows that only need K and V stop there (`_staged_drafts`); the same bits as the module path's
input projection followed by the stack.
"""
from __future__ import annotations

import numpy as np
import torch

from deepinfer.core.kv_layout import KVLayout
from deepinfer.ops import quant_linear
from deepinfer.layers.context import AttentionMetadata, ForwardContext, forward_context
from deepinfer.worker.inputs import RequestRows, StepInputs, _metadata, table_slots


def mtp_drafts(model, mtp, inputs: StepInputs, hidden: torch.Tensor, token_ids: dict[str, list[int]],
               emitted: dict[str, list[int]], lengths: dict[str, int], tables: dict[str, list[list[int]]],
               kv_caches, layout: KVLayout, block_size: int, device: torch.device, batch_invariant: bool = False,
               cpu_kernels=None, decodes: bool = True) -> dict[str, list[int]]:
    """inputs: the step's rows; emitted: the tokens each sampling request emitted; lengths: how many drafts each
    sampling request wants. Returns the drafts. decodes=False: nothing drafts and only prompt rows get their K/V
    (worker/speculative.mtp_upkeep): a decoding request's MTP cache then has no K/V at these positions, which can cost
    its later drafts acceptance, never correctness."""
    if len(layout.groups) != 1:
        raise ValueError("MTP drafts need a model with one layer group (no sliding-window hybrids)")
    env = (kv_caches, block_size, device, batch_invariant, cpu_kernels)
    if not decodes and all(_decoding(r) for r in inputs.requests):
        return {}
    if decodes and _staged(mtp, inputs, lengths, cpu_kernels):
        drafts = _staged_drafts(model, mtp, inputs, hidden, emitted, lengths, tables, env)
        if drafts is not None:
            return drafts
    upkeep: list[int] = []  # the step's rows that get KV only
    ends: list[tuple[int, int]] = []  # (index in upkeep, next token) of each request's last upkeep row
    heads: list[RequestRows] = []  # a drafting request's rows through the whole layer, as decode rows
    for r in inputs.requests:
        rid = r.request_id
        if not decodes and _decoding(r):
            continue
        count = r.num_known + (len(emitted.get(rid, ())) - 1 if r.samples else 0)
        if not r.samples and r.start + count >= len(token_ids[rid]):
            count -= 1  # a prompt chunk's last row: its next token is not known yet
        if r.samples and count > 0 and lengths.get(rid, 0) > 0:
            if r.num_known == 1:  # decoding: its token and accepted drafts, all decode rows of the whole layer
                heads.append(RequestRows(rid, r.first_row, 1, [0] * (count - 1), r.start, True))
                continue
            heads.append(RequestRows(rid, r.first_row + count - 1, 1, [], r.start + count - 1, True))
            count -= 1
        if count > 0:
            upkeep += range(r.first_row, r.first_row + count)
            ends.append((len(upkeep) - 1, token_ids[rid][r.start + count : r.start + count + 1][0]))
    if upkeep:
        _write_kv(mtp, model.model.embed_tokens, inputs, hidden, upkeep, ends, env)
    if not heads:
        return {}
    drafts: dict[str, list[int]] = {r.request_id: [] for r in heads}
    index = [i for r in heads for i in range(r.first_row, r.first_row + _count(r))]
    state = hidden[torch.tensor(index, device=device)]
    tokens = torch.tensor([t for r in heads for t in token_ids[r.request_id][r.start + 1 : r.start + 1 + _count(r)]],
                          dtype=torch.int64, device=device)
    drafting = heads
    for depth in range(max(lengths[r.request_id] for r in heads)):
        first = 0
        for r in drafting:
            r.first_row, first = first, first + _count(r)
        pos = torch.tensor([p for r in drafting for p in range(r.start, r.start + _count(r))], device=device)
        state = _run(model, mtp, depth, drafting, pos, tokens, state, tables, env)
        if first > len(drafting):  # the requests' last rows
            state = state[torch.tensor([r.first_row + _count(r) - 1 for r in drafting], device=device)]
            drafting = [RequestRows(r.request_id, 0, 1, [], r.start + _count(r) - 1, True) for r in drafting]
        for r, token in zip(drafting, _greedy_drafts(model, mtp, state, batch_invariant)):
            drafts[r.request_id].append(token)
        room = [i for i, r in enumerate(drafting) if len(drafts[r.request_id]) < lengths[r.request_id]
                and r.start + 1 < len(tables[r.request_id][0]) * block_size]
        if not room:
            break
        drafting = [RequestRows(drafting[i].request_id, 0, 1, [], drafting[i].start + 1, True) for i in room]
        tokens = torch.tensor([drafts[r.request_id][-1] for r in drafting], dtype=torch.int64, device=device)
        state = state[room]
    return drafts


def _write_kv(mtp, embed, inputs: StepInputs, hidden: torch.Tensor, upkeep: list[int],
              ends: list[tuple[int, int]], env) -> None:
    """The MTP layer's K and V at the step's rows `upkeep` (the same KV the whole layer would write; later drafts
    attend to it). Row i's next token is row i + 1's input, except at a request's last upkeep row (`ends`)."""
    kv_caches, block_size, device, batch_invariant, cpu_kernels = env
    rows = np.asarray(upkeep, dtype=np.int64)  # index math on the host: a handful of small torch ops cost more
    ids = _host(inputs.input_ids)
    tokens = ids[np.minimum(rows + 1, len(ids) - 1)]
    at, nxt = zip(*ends)
    tokens[list(at)] = nxt
    slots = _host(inputs.group_metadata[0].slot_mapping)[rows]
    positions, tokens = (torch.from_numpy(a).to(device) for a in (_host(inputs.positions)[rows], tokens))
    md = AttentionMetadata(slot_mapping=torch.from_numpy(slots).to(device), num_decodes=0, decode_block_tables=None,
                           decode_context_lens=None, prefills=[], block_size=block_size)
    ctx = ForwardContext(attn=md, kv_caches=kv_caches, positions=positions, batch_invariant=batch_invariant,
                         cpu_kernels=cpu_kernels)
    with forward_context(ctx):
        mtp.layer(0).write_kv(positions, embed(tokens), hidden[torch.from_numpy(rows).to(device)])


def _decoding(r: RequestRows) -> bool:
    """A request that decodes this step: it samples from one known row (its drafts, if any, follow it)."""
    return r.samples and r.num_known == 1


def _count(r: RequestRows) -> int:
    """A request's decode rows: its known row and the ones after it (here: a decoding request's accepted ones)."""
    return r.num_known + len(r.drafts)


def _host(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def _run(model, mtp, depth: int, rows: list[RequestRows], positions: torch.Tensor, tokens: torch.Tensor,
         hidden: torch.Tensor, tables, env) -> torch.Tensor:
    """One MTP depth over decode rows (a request's row and the rows after it, `_count`), its KV written at their
    positions."""
    kv_caches, block_size, device, batch_invariant, cpu_kernels = env
    pos = positions.cpu().numpy()
    spans = [pos[r.first_row : r.first_row + _count(r)] for r in rows]
    md = _metadata([tables[r.request_id][0] for r in rows], rows, spans, pos, len(pos), None, block_size, device)
    ctx = ForwardContext(attn=md, kv_caches=kv_caches, positions=positions, batch_invariant=batch_invariant,
                         cpu_kernels=cpu_kernels)
    with forward_context(ctx):
        return mtp.layer(depth)(positions, model.model.embed_tokens(tokens), hidden)


def _greedy_drafts(model, mtp, state: torch.Tensor, batch_invariant: bool) -> list[int]:
    """argmax of the LM head over the draft vocabulary (a subset of rows of the head's weight, when the head names
    one: drafts are only proposals, so a narrower choice costs acceptance, never correctness)."""
    vocab = mtp.draft_vocab
    if vocab is None:
        return model.compute_logits(state).argmax(dim=-1).tolist()
    head = getattr(mtp, "_draft_head", None)
    if head is None:
        head = mtp._draft_head = _draft_head(model, vocab)
    if isinstance(head, torch.Tensor):
        if batch_invariant:  # one row per product: the same bits whatever else drafts this step
            return [int(vocab[(row.float() @ head.T).argmax()]) for row in state[:, None]]
        return vocab[(state.float() @ head.T).argmax(dim=-1)].tolist()
    kernels, packed = head  # every row computed by the same code: batch-invariant as it is; the argmax taken in the
    # kernel, without writing the draft vocabulary's logits (what torch.argmax of them gives)
    return vocab[quant_linear.argmax(kernels, state.float().contiguous(), packed)].tolist()


def _draft_head(model, vocab: torch.Tensor):
    """The LM head's rows for `vocab`: float32, or, when the head is quantized, requantized to int8 for the
    quantized kernel (a draft reads a quarter of the bytes; the rounding can cost acceptance, never correctness)."""
    weight = model.lm_head.weight
    if isinstance(weight, torch.Tensor):
        return weight.detach()[vocab].float().contiguous()
    if weight.packed is None:
        return weight.dense[vocab].float().contiguous()
    rows = quant_linear.rows(weight.kernels, vocab, weight.packed)
    return weight.kernels, quant_linear.pack(quant_linear.quantize_int8(rows.numpy()))


def _staged(mtp, inputs: StepInputs, lengths: dict[str, int], cpu_kernels) -> bool:
    """Whether this step's MTP work goes through the layers' stacks with their input stage, one call per depth: a
    step of decode rows only (every request decoding), where every depth's layer has such a stack."""
    md = inputs.group_metadata[0]
    if cpu_kernels is None or md.prefills or not all(_decoding(r) for r in inputs.requests):
        return False
    depths = max(lengths.values(), default=0)
    return all(getattr(mtp.layer(d).decode_stack, "input_stage", None) is not None for d in range(max(depths, 1)))


def _staged_drafts(model, mtp, inputs: StepInputs, hidden: torch.Tensor, emitted: dict[str, list[int]],
                   lengths: dict[str, int], tables: dict[str, list[list[int]]], env) -> dict[str, list[int]] | None:
    """mtp_drafts for a step of decode rows, each depth one compiled call (None: the stack declined). A request's
    known row and accepted drafts are its rows; their next tokens are the tokens it emitted. A drafting request's
    rows run the whole layer (its last row's output predicts the first draft); every other request's rows cache
    their K and V only (full_rows)."""
    kv_caches, block_size, device, batch_invariant, _ = env
    md = inputs.group_metadata[0]
    full, kv_only, full_next, kv_next, drafting = [], [], [], [], []
    for r in inputs.requests:
        tokens = emitted.get(r.request_id, ())
        rows = range(r.first_row, r.first_row + len(tokens))
        if lengths.get(r.request_id, 0) > 0 and tokens:
            full += rows
            full_next += tokens
            drafting.append((r.request_id, len(full) - 1))
        else:
            kv_only += rows
            kv_next += tokens
    if not full and not kv_only:
        return {}
    order = full + kv_only
    # rows in place (one request, or every row in step order): views instead of gathers
    index = slice(0, len(order)) if order == list(range(len(order))) else torch.tensor(order, dtype=torch.int64)
    positions = inputs.positions[index]
    tokens = torch.tensor(full_next + kv_next, dtype=torch.int64, device=device)
    block_tables = md.decode_block_tables[index]
    state = mtp.layer(0).decode_stack.staged_rows(kv_caches, model.model.embed_tokens(tokens), hidden[index],
                                                  positions, md.slot_mapping[index], block_tables, positions + 1,
                                                  block_size, len(full))
    if state is None:
        return None
    drafts: dict[str, list[int]] = {rid: [] for rid, _ in drafting}
    if not drafting:
        return drafts
    last = torch.tensor([row for _, row in drafting], dtype=torch.int64)
    state, positions, block_tables = state[last], positions[last], block_tables[last]
    rids = [rid for rid, _ in drafting]
    for depth in range(max(lengths[rid] for rid in rids)):
        for rid, token in zip(rids, _greedy_drafts(model, mtp, state, batch_invariant)):
            drafts[rid].append(token)
        positions = positions + 1
        next_pos = positions.tolist()
        room = [i for i, rid in enumerate(rids) if len(drafts[rid]) < lengths[rid]
                and next_pos[i] < len(tables[rid][0]) * block_size]
        if not room:
            break
        keep = torch.tensor(room, dtype=torch.int64)
        rids = [rids[i] for i in room]
        state, positions, block_tables = state[keep], positions[keep], block_tables[keep]
        tokens = torch.tensor([drafts[rid][-1] for rid in rids], dtype=torch.int64, device=device)
        state = mtp.layer(depth + 1).decode_stack.staged_rows(kv_caches, model.model.embed_tokens(tokens), state,
                                                              positions, table_slots(block_tables, positions,
                                                                                     block_size),
                                                              block_tables, positions + 1, block_size, len(rids))
        if state is None:  # a deeper layer's stack declined: the drafts so far
            break
    return drafts
