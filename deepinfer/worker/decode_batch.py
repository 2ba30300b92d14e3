"""The decode batch kept from step to step: a step that decodes exactly the requests the step before did, in the same
order, each one token further (a batch's steady state), gets its inputs from the last step's arrays moved on: the
positions and context lengths one further, the last sampled tokens as input ids, the block tables rewritten only for
the rows that gained a block, the cache slots computed in one go. Anything else (a request joins, finishes, is
preempted, prefills, drafts or appends tokens) builds the inputs anew (inputs.build_inputs), and an all-decode step
built that way becomes the batch that the next steps move on from.

Equal to build_inputs, field for field, by construction: the rows keep build_inputs' order (it sorts the plan's order
by context, longest first, and every row moves one position on), and the arrays are computed by the same formulas.
tests/worker/test_decode_batch.py checks it step by step. The arrays handed to a step are never changed afterwards (a
changed table is a new array), so nothing a step still holds moves under it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch

from deepinfer.core.plan import StepPlan
from deepinfer.layers.context import AttentionMetadata
from deepinfer.worker.inputs import RequestRows, StepInputs, decode_buckets


class HeldRequest(Protocol):  # the runner's per-request state, as read here
    token_ids: object  # Tokens: len() and .output
    block_ids: list[np.ndarray]  # per layer group


class DecodeBatch:
    def __init__(self, num_groups: int, block_size: int, device: torch.device) -> None:
        self.num_groups, self.block_size, self.device = num_groups, block_size, device
        self._order: list[str] | None = None  # the plan order of the requests held (None: nothing held)
        self._rows: list[RequestRows] = []
        self._pos = np.empty(0, dtype=np.int64)
        self._tables: list[np.ndarray] = []  # per group, [rows, widest table] padded with 0
        self._widths = np.empty(0, dtype=np.int64)  # group 0's table length per row (decode buckets)
        self._buckets: list | None = None

    def keep(self, plan: StepPlan, inputs: StepInputs, requests: Mapping[str, HeldRequest]) -> None:
        """Holds a step that build_inputs made, if every row is a plain decode (one token, no drafts)."""
        rows = inputs.requests
        if not rows or any(r.num_known != 1 or r.drafts for r in rows):
            self._order = None
            return
        self._order, self._rows = list(plan.num_tokens), rows
        self._pos = np.array([r.start for r in rows], dtype=np.int64)
        self._tables = [_padded([requests[r.request_id].block_ids[g] for r in rows]) for g in range(self.num_groups)]
        self._widths = np.array([len(requests[r.request_id].block_ids[0]) for r in rows], dtype=np.int64)
        self._buckets = inputs.group_metadata[0].decode_buckets

    def advance(self, plan: StepPlan, requests: Mapping[str, HeldRequest]) -> StepInputs | None:
        """This step's inputs moved on from the held batch; None where the step is not its next decode step."""
        if self._order is None or plan.new_requests or any(plan.spec_token_ids.values()):
            return None
        if len(plan.num_tokens) != len(self._order) or any(n != 1 for n in plan.num_tokens.values()) \
                or list(plan.num_tokens) != self._order:
            return None
        cached = {c.request_id: c for c in plan.cached_requests}
        grown: list[int] = []  # rows whose tables gained blocks
        ids = np.empty(len(self._rows), dtype=np.int64)
        for i, r in enumerate(self._rows):
            c, tokens = cached.get(r.request_id), requests[r.request_id].token_ids
            if c is None or c.num_computed_tokens != r.start + 1 or len(tokens) != r.start + 2:
                return None
            ids[i] = tokens.output[-1] if tokens.output else tokens[r.start + 1 : r.start + 2][0]
            if any(c.new_block_ids):
                grown.append(i)
        if grown:
            self._grow(grown, requests)
        for r in self._rows:
            r.start += 1
        self._pos = pos = self._pos + 1
        bs, device, every = self.block_size, self.device, np.arange(len(pos))
        lens = torch.from_numpy(pos + 1).to(device)
        metadata = [AttentionMetadata(slot_mapping=torch.from_numpy(t[every, pos // bs] * bs + pos % bs).to(device),
                                      num_decodes=len(pos), decode_block_tables=torch.from_numpy(t).to(device),
                                      decode_context_lens=lens, prefills=[], block_size=bs,
                                      decode_buckets=self._buckets)
                    for t in self._tables]
        return StepInputs(torch.from_numpy(ids).to(device), torch.from_numpy(pos).to(device), metadata, self._rows)

    def moved_on(self, inputs: StepInputs, steps: int) -> None:
        """The held batch's rows ran `steps` more decode steps after this step's (worker/multi_step.py), so that
        the next step still moves on from it."""
        if self._order is None or inputs.requests is not self._rows:
            return
        for r in self._rows:
            r.start += steps
        self._pos = self._pos + steps

    def _grow(self, grown: list[int], requests: Mapping[str, HeldRequest]) -> None:
        """New tables for the rows that gained blocks (new arrays: the last step's stay as they were)."""
        for g in range(self.num_groups):
            added = {i: requests[self._rows[i].request_id].block_ids[g] for i in grown}
            width = max([self._tables[g].shape[1]] + [len(t) for t in added.values()])
            table = np.zeros((len(self._rows), width), dtype=np.int64)
            table[:, : self._tables[g].shape[1]] = self._tables[g]
            for i, t in added.items():
                table[i, : len(t)] = t
            self._tables[g] = table
        widths = self._widths.copy()
        for i in grown:
            widths[i] = len(requests[self._rows[i].request_id].block_ids[0])
        self._widths = widths
        self._buckets = decode_buckets(widths.tolist())


def _padded(tables: list[np.ndarray]) -> np.ndarray:
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out
