"""MTP drafts on the paged KV cache: the MTP layer is one more attention layer, caching at its index after the
main model's layers in the same blocks as the request's other layers.

After a step's forward and sampling, the MTP layer runs over every row whose next token is now known: prompt rows
(their next token is the next prompt token), a sampling request's known row and its accepted drafts (their next
tokens are the tokens just emitted). Row p combines the main model's hidden state at p with the embedding of token
p + 1, so its KV lands at position p, exactly where the main model's is, and only for positions that are computed:
rejected drafts never get MTP KV. The last such row of a sampling request predicts the first draft; deeper drafts
apply the layer again to its own output and the previous draft, one row per request at the next position
(DeepSeek's recursive use of one MTP layer); that speculative KV is rewritten once the position is computed.
Drafts are greedy: deterministic proposals, verified as one-hot drafts (lossless either way). A decoding request's
rows are decode rows (one query each, as verification's are), so a step without prompt chunks runs each depth
through the MTP layer's decode stack (transforms/fused_ops.py) where the model has one.
"""
from __future__ import annotations

import torch

from deepinfer.core.kv_layout import KVLayout
from deepinfer.ops import quant_linear
from deepinfer.layers.context import ForwardContext, forward_context
from deepinfer.worker.inputs import RequestRows, _metadata


def mtp_drafts(model, mtp, requests: list[RequestRows], hidden: torch.Tensor, token_ids: dict[str, list[int]],
               emitted: dict[str, list[int]], lengths: dict[str, int], tables: dict[str, list[list[int]]],
               kv_caches, layout: KVLayout, block_size: int, device: torch.device, batch_invariant: bool = False,
               cpu_kernels=None) -> dict[str, list[int]]:
    """requests: the step's rows (inputs.requests); emitted: the tokens each sampling request emitted; lengths:
    how many drafts each sampling request wants. Returns the drafts."""
    if len(layout.groups) != 1:
        raise ValueError("MTP drafts need a model with one layer group (no sliding-window hybrids)")
    rows: list[RequestRows] = []
    hidden_rows: list[int] = []
    next_tokens: list[int] = []
    for r in requests:
        count = r.num_known + (len(emitted.get(r.request_id, ())) - 1 if r.samples else 0)
        if not r.samples and r.start + count >= len(token_ids[r.request_id]):
            count -= 1  # a prompt chunk's last row: its next token is not known yet
        if count <= 0:
            continue
        if r.samples and r.num_known == 1:  # a decoding request's token and accepted drafts: decode rows
            rows.append(RequestRows(r.request_id, len(hidden_rows), 1, [0] * (count - 1), r.start, True))
        else:
            rows.append(RequestRows(r.request_id, len(hidden_rows), count, [], r.start, r.samples))
        hidden_rows += range(r.first_row, r.first_row + count)
        next_tokens += token_ids[r.request_id][r.start + 1 : r.start + 1 + count]
    if not rows:
        return {}
    rows.sort(key=lambda r: (r.num_known != 1, -r.start))  # the metadata's order: decode rows first
    order = [i for r in rows for i in range(r.first_row, r.first_row + _count(r))]
    first = 0
    for r in rows:
        r.first_row, first = first, first + _count(r)
    index = torch.tensor(order, device=device)
    h_index = torch.tensor(hidden_rows, device=device)[index]
    tokens = torch.tensor(next_tokens, dtype=torch.int64, device=device)[index]
    positions = torch.cat([torch.arange(r.start, r.start + _count(r)) for r in rows]).to(device)
    env = (kv_caches, block_size, device, batch_invariant, cpu_kernels)
    out = _run(model, mtp, 0, rows, positions, tokens, hidden[h_index], tables, env)

    drafting = [r for r in rows if r.samples and lengths.get(r.request_id, 0) > 0]
    if not drafting:
        return {}
    drafts: dict[str, list[int]] = {r.request_id: [] for r in drafting}
    last = torch.tensor([r.first_row + _count(r) - 1 for r in drafting], device=device)
    state, pos = out[last], torch.tensor([r.start + _count(r) - 1 for r in drafting], device=device)
    for depth in range(max((lengths[r.request_id] for r in drafting), default=0)):
        picks = _greedy_drafts(model, mtp, state, batch_invariant)
        for r, token in zip(drafting, picks):
            drafts[r.request_id].append(token)
        room = [i for i, r in enumerate(drafting) if len(drafts[r.request_id]) < lengths[r.request_id]
                and int(pos[i]) + 1 < len(tables[r.request_id][0]) * block_size]
        if not room:
            break
        drafting = [drafting[i] for i in room]
        pos = pos[room] + 1
        step_rows = [RequestRows(r.request_id, i, 1, [], int(p), True) for i, (r, p) in enumerate(zip(drafting, pos))]
        tokens = torch.tensor([drafts[r.request_id][-1] for r in drafting], dtype=torch.int64, device=device)
        state = _run(model, mtp, depth + 1, step_rows, pos, tokens, state[room], tables, env)
    return drafts


def _count(r: RequestRows) -> int:
    """The rows of a request: its known tokens and the rows after them (here: a decoding request's accepted ones)."""
    return r.num_known + len(r.drafts)


def _run(model, mtp, depth: int, rows: list[RequestRows], positions: torch.Tensor, tokens: torch.Tensor,
         hidden: torch.Tensor, tables, env) -> torch.Tensor:
    """One MTP depth over `rows` (decode rows first), its KV written at their positions."""
    kv_caches, block_size, device, batch_invariant, cpu_kernels = env
    pos = positions.cpu().numpy()
    spans = [pos[r.first_row : r.first_row + _count(r)] for r in rows]
    num_decodes = sum(_count(r) for r in rows if r.num_known == 1)
    md = _metadata([tables[r.request_id][0] for r in rows], rows, spans, pos, num_decodes, None, block_size, device)
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
    kernels, packed = head  # every row computed by the same code: batch-invariant as it is
    return vocab[quant_linear.linear(kernels, state.float().contiguous(), packed).argmax(dim=-1)].tolist()


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
