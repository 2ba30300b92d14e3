"""StepPlan -> input tensors -> forward -> sample -> StepResult."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.core.plan import StepPlan, StepResult
from deepinfer.layers.context import AttentionMetadata, ForwardContext, PrefillSeq, forward_context
from deepinfer.models.base import KVCacheSpec
from deepinfer.sample.logprobs import compute_prompt_logprobs
from deepinfer.sample.sampler import Sampler, SamplingRow
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.kvstore.block_transfer import KVBlockTransfer


@dataclass
class _RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int]


def kv_bytes_per_block(specs: list[KVCacheSpec], block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(s.num_kv_heads * (s.head_dim + s.v_head_dim) for s in specs) * elem * block_size


class ModelRunner:
    """Keeps each running request's tokens and block table (updated by plan diffs) and the KV caches."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device: str,
                 batch_invariant: bool = False) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_caches = [
            (
                torch.zeros(num_blocks * block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=self.device),
                torch.zeros(num_blocks * block_size, s.num_kv_heads, s.v_head_dim, dtype=dtype, device=self.device),
            )
            for s in model.kv_cache_specs()
        ]
        self.sampler = Sampler()
        self.kv_transfer: KVBlockTransfer | None = None  # set by the engine when a KV store is configured
        self._requests: dict[str, _RequestState] = {}

    def _apply_diff(self, plan: StepPlan) -> None:
        for request_id in plan.finished_ids:
            self._requests.pop(request_id, None)
        for request_id in plan.preempted_ids:
            self._requests.pop(request_id, None)
        for new in plan.new_requests:
            self._requests[new.request_id] = _RequestState(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), new.params, new.seed, new.eos_token_ids
            )
        for cached in plan.cached_requests:
            self._requests[cached.request_id].block_ids.extend(cached.new_block_ids)
        fresh = {new.request_id for new in plan.new_requests}
        for request_id, tokens in plan.appended_token_ids.items():
            if request_id in self._requests and request_id not in fresh:
                self._requests[request_id].token_ids.extend(tokens)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self._apply_diff(plan)
        result = StepResult()
        if self.kv_transfer is not None and plan.kv_loads:  # KV store: fill loaded blocks before the forward
            result.kv_load_failures = self.kv_transfer.load(plan)
            if result.kv_load_failures:  # a broken chain is recomputed from the next step on
                plan = plan.without(result.kv_load_failures)
        if not plan.num_tokens:
            return result
        computed = {r.request_id: r.num_computed_tokens for r in plan.new_requests}
        computed.update({r.request_id: r.num_computed_tokens for r in plan.cached_requests})
        # Decodes (one token) first so they form one batched attention call.
        order = sorted(plan.num_tokens, key=lambda rid: plan.num_tokens[rid] != 1)
        num_decodes = sum(1 for rid in order if plan.num_tokens[rid] == 1)
        bs = self.block_size

        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        prefills: list[PrefillSeq] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        prompt_lp: list[tuple[str, int, int]] = []  # (request, first row, number of rows)
        tables: list[list[int]] = []
        for rid in order:
            state = self._requests[rid]
            start, n = computed[rid], plan.num_tokens[rid]
            row = len(input_ids)
            input_ids.extend(state.token_ids[start : start + n])
            positions.append(np.arange(start, start + n, dtype=np.int64))
            tables.append(state.block_ids)
            if n > 1:
                prefills.append(PrefillSeq(row, n, start + n, torch.tensor(state.block_ids, dtype=torch.int64)))
            if start + n == len(state.token_ids):
                sample_rows.append(row + n - 1)
                sample_ids.append(rid)
            if state.params.prompt_logprobs is not None and start + 1 < state.num_prompt_tokens:
                prompt_lp.append((rid, row, min(n, state.num_prompt_tokens - 1 - start)))

        pos = np.concatenate(positions)
        slots = np.empty_like(pos)
        offset = 0
        for table, p in zip(tables, positions):
            t = np.asarray(table, dtype=np.int64)
            slots[offset : offset + len(p)] = t[p // bs] * bs + p % bs
            offset += len(p)
        decode_tables = decode_lens = None
        if num_decodes:
            width = max(len(t) for t in tables[:num_decodes])
            padded = np.zeros((num_decodes, width), dtype=np.int64)
            for i, t in enumerate(tables[:num_decodes]):
                padded[i, : len(t)] = t
            decode_tables = torch.from_numpy(padded).to(self.device)
            decode_lens = torch.from_numpy(pos[:num_decodes] + 1).to(self.device)
        positions_t = torch.from_numpy(pos).to(self.device)
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(self.device),
            num_decodes=num_decodes,
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=prefills,
            block_size=bs,
        )
        ctx = ForwardContext(attn=md, kv_caches=self.kv_caches, positions=positions_t, batch_invariant=self.batch_invariant)
        with forward_context(ctx):
            hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=self.device), positions_t)
        pop_counts = getattr(self.model, "pop_expert_counts", None)
        if pop_counts is not None:
            result.expert_counts = pop_counts()

        for rid, row, count in prompt_lp:
            state = self._requests[rid]
            start = computed[rid]
            logits = self.model.compute_logits(hidden[row : row + count])
            next_ids = state.token_ids[start + 1 : start + 1 + count]
            result.prompt_logprobs[rid] = compute_prompt_logprobs(logits, next_ids, state.params.prompt_logprobs)

        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
            rows = []
            for rid in sample_ids:
                s = self._requests[rid]
                rows.append(
                    SamplingRow(
                        params=s.params,
                        seed=s.seed,
                        position=len(s.token_ids) - s.num_prompt_tokens,
                        prompt_token_ids=s.token_ids[: s.num_prompt_tokens],
                        output_token_ids=s.token_ids[s.num_prompt_tokens :],
                        eos_token_ids=s.eos_token_ids,
                        allowed_token_mask=plan.grammar_masks.get(rid),
                    )
                )
            out = self.sampler(logits, rows)
            for rid, token, lp in zip(sample_ids, out.token_ids, out.logprobs):
                self._requests[rid].token_ids.append(token)
                result.sampled[rid] = [token]
                if lp is not None:
                    result.logprobs[rid] = [lp]
        if self.kv_transfer is not None:  # KV store: save the blocks this forward filled
            self.kv_transfer.save(plan)
        return result
