"""One step's plan -> the model's input tensors and attention metadata.

Rows are the step's tokens. A request in decode (one known token to compute, plus its speculative drafts) gives
decode rows: each row is one query with its own context length and the request's block table, so a request with k
drafts is k + 1 decode rows and every decode goes through one batched attention call. The other requests (prompt
chunks, prefix-cache remainders, tokens appended by jump-forward) are prefill sequences. Decode rows come first,
longest context first.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.core.kv_layout import KVLayout
from deepinfer.core.plan import StepPlan
from deepinfer.layers.context import AttentionMetadata, PrefillSeq


@dataclass
class RequestRows:
    request_id: str
    first_row: int
    num_known: int  # known tokens computed this step (the rows after them are drafts)
    drafts: list[int]
    start: int  # position of the first row
    samples: bool  # the step reaches the request's last known token


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    group_metadata: list[AttentionMetadata]  # per layer group
    requests: list[RequestRows]  # in row order


def decode_buckets(widths: list[int], min_rows: int = 8, keep: float = 0.6) -> list[tuple[int, int, int]]:
    """Cuts decode rows, sorted by table width descending, into runs whose narrowest row keeps at least `keep` of
    the widest one's blocks (runs of at least `min_rows` rows): (start row, end row, width) each."""
    out, i = [], 0
    while i < len(widths):
        j = i + 1
        while j < len(widths) and (j - i < min_rows or widths[j] >= keep * widths[i]):
            j += 1
        out.append((i, j, widths[i]))
        i = j
    return out


def table_slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of decode rows at `positions`, each row's padded block table a row of `tables`."""
    rows = torch.arange(positions.shape[0], device=positions.device)
    return tables[rows, torch.div(positions, block_size, rounding_mode="floor")] * block_size + positions % block_size


def prompt_runs(requests: list[RequestRows], prompt_lens: dict[str, int]) -> tuple[tuple[int, int], ...]:
    """Runs of rows [start, end) at prompt positions (position < the request's prompt length), adjacent runs
    merged: the rows a prompt-only kernel takes (layers/quantized.py), chosen by each row's own position."""
    runs: list[tuple[int, int]] = []
    for r in sorted(requests, key=lambda r: r.first_row):
        n = min(r.num_known, max(0, prompt_lens[r.request_id] - r.start))
        if n == 0:
            continue
        if runs and runs[-1][1] == r.first_row:
            runs[-1] = (runs[-1][0], r.first_row + n)
        else:
            runs.append((r.first_row, r.first_row + n))
    return tuple(runs)


def build_inputs(plan: StepPlan, token_ids: dict[str, list[int]], tables: dict[str, list[list[int]]],
                 layout: KVLayout, block_size: int, device: torch.device) -> StepInputs:
    """token_ids / tables: per request, its known tokens and its block table per layer group."""
    computed = {r.request_id: r.num_computed_tokens for r in plan.new_requests}
    computed.update({r.request_id: r.num_computed_tokens for r in plan.cached_requests})
    rows: list[RequestRows] = []
    for rid, n in plan.num_tokens.items():
        drafts = plan.spec_token_ids.get(rid, [])
        start = computed[rid]
        known = n - len(drafts)
        rows.append(RequestRows(rid, 0, known, drafts, start, start + known == len(token_ids[rid])))
    rows.sort(key=lambda r: (r.num_known != 1, -r.start))  # decodes first, longest context first
    ids: list[int] = []
    positions: list[np.ndarray] = []
    num_decodes = 0
    for r in rows:
        r.first_row = len(ids)
        ids.extend(token_ids[r.request_id][r.start : r.start + r.num_known])
        ids.extend(r.drafts)
        positions.append(np.arange(r.start, r.start + r.num_known + len(r.drafts), dtype=np.int64))
        if r.num_known == 1:
            num_decodes += 1 + len(r.drafts)
    pos = np.concatenate(positions)
    request_tables = [tables[r.request_id] for r in rows]
    decode_widths = [len(t[0]) for r, t in zip(rows, request_tables) if r.num_known == 1 for _ in range(1 + len(r.drafts))]
    buckets = decode_buckets(decode_widths) if num_decodes else None
    metadata = [_metadata([t[g] for t in request_tables], rows, positions, pos, num_decodes, buckets, block_size,
                          device) for g in range(len(layout.groups))]
    return StepInputs(torch.tensor(ids, dtype=torch.int64, device=device), torch.from_numpy(pos).to(device),
                      metadata, rows)


def _metadata(tables: list, rows: list[RequestRows], positions: list[np.ndarray], pos: np.ndarray,
              num_decodes: int, buckets, block_size: int, device: torch.device) -> AttentionMetadata:
    """One layer group's attention metadata: cache slots of this step's tokens, decode tables, prefills. A table is
    the request's block ids (a numpy array in the runner, a list elsewhere)."""
    bs = block_size
    slots = np.empty_like(pos)
    decode_tables = decode_lens = None
    if num_decodes:  # decode rows: one padded table row each, their slots read from it in one go
        decoding = [(t, 1 + len(r.drafts)) for t, r in zip(tables, rows) if r.num_known == 1]
        width = max(len(t) for t, _ in decoding)
        padded = np.zeros((num_decodes, width), dtype=np.int64)
        row = 0
        for t, count in decoding:
            padded[row : row + count, : len(t)] = t
            row += count
        p = pos[:num_decodes]
        slots[:num_decodes] = padded[np.arange(num_decodes), p // bs] * bs + p % bs
        decode_tables = torch.from_numpy(padded).to(device)
        decode_lens = torch.from_numpy(p + 1).to(device)
    for table, p, r in zip(tables, positions, rows):
        if r.num_known != 1:
            slots[r.first_row : r.first_row + len(p)] = np.asarray(table, dtype=np.int64)[p // bs] * bs + p % bs
    prefills = [PrefillSeq(r.first_row, r.num_known, r.start + r.num_known,
                           torch.as_tensor(np.asarray(t, dtype=np.int64), device=device))
                for t, r in zip(tables, rows) if r.num_known != 1]
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        num_decodes=num_decodes,
        decode_block_tables=decode_tables,
        decode_context_lens=decode_lens,
        prefills=prefills,
        block_size=bs,
        decode_buckets=buckets,
    )
