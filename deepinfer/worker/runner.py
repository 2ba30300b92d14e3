"""StepPlan -> input tensors -> forward -> sample -> StepResult."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.core.plan import StepPlan, StepResult
from deepinfer.layers.context import AttentionMetadata, ForwardContext, PrefillSeq, forward_context
from deepinfer.core.kv_layout import KVLayout, layout_from_specs
from deepinfer.core.kv_layout import KVCacheSpec
from deepinfer.sample.logprobs import compute_prompt_logprobs
from deepinfer.sample.sampler import Sampler, SamplingRow
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.worker.kv_transfer import KVBlockTransfer


@dataclass
class _RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[list[int]]  # per layer group
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int]


def kv_bytes_per_block(specs: list[KVCacheSpec], block_size: int, dtype: torch.dtype,
                       layout: KVLayout | None = None) -> int:
    """Bytes of one pool block: block_size tokens of one group's layers (all layers unless the model mixes
    windows)."""
    layout = layout or layout_from_specs(specs)
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(specs[i].num_kv_heads * (specs[i].head_dim + specs[i].v_head_dim) for i in layout.groups[0].layers) \
        * elem * block_size


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


class ModelRunner:
    """Keeps each running request's tokens and block table (updated by plan diffs) and the KV caches."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device: str,
                 batch_invariant: bool = False, layout: KVLayout | None = None,
                 cpu_kernels: ModuleType | None = None) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
        self.cpu_kernels = cpu_kernels  # compiled attention (ops/cpu_attention.py); None: torch ops
        self.block_size = block_size
        self.device = torch.device(device)
        specs = model.kv_cache_specs()
        self.layout = layout or layout_from_specs(specs)
        # one K and one V tensor per slot; the layers in the same slot of different groups share them
        self.slot_caches = [
            (
                torch.zeros(num_blocks * block_size, specs[i].num_kv_heads, specs[i].head_dim, dtype=dtype,
                            device=self.device),
                torch.zeros(num_blocks * block_size, specs[i].num_kv_heads, specs[i].v_head_dim, dtype=dtype,
                            device=self.device),
            )
            for i in self.layout.groups[0].layers
        ]
        self._placement = self.layout.placement(len(specs))
        self.kv_caches = [self.slot_caches[slot] for _, slot in self._placement]  # per attention layer
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
                list(new.token_ids), new.num_prompt_tokens, [list(t) for t in new.block_ids], new.params, new.seed,
                new.eos_token_ids,
            )
        for cached in plan.cached_requests:
            for table, added in zip(self._requests[cached.request_id].block_ids, cached.new_block_ids):
                table.extend(added)
        fresh = {new.request_id for new in plan.new_requests}
        for request_id, tokens in plan.appended_token_ids.items():
            if request_id in self._requests and request_id not in fresh:
                self._requests[request_id].token_ids.extend(tokens)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self._apply_diff(plan)
        result = StepResult()
        if self.kv_transfer is not None and plan.kv_saves_first:  # finished requests' tails, before reuse
            self.kv_transfer.save(plan, first=True)
        if self.kv_transfer is not None and plan.kv_loads:  # KV store: fill loaded blocks before the forward
            result.kv_load_failures = self.kv_transfer.load(plan)
            if result.kv_load_failures:  # a broken chain is recomputed from the next step on
                plan = plan.without(result.kv_load_failures)
        if not plan.num_tokens:
            return result
        computed = {r.request_id: r.num_computed_tokens for r in plan.new_requests}
        computed.update({r.request_id: r.num_computed_tokens for r in plan.cached_requests})
        # Decodes (one token) first, longest context first, so they form a few batched attention calls.
        order = sorted(plan.num_tokens, key=lambda rid: (plan.num_tokens[rid] != 1, -computed[rid]))
        num_decodes = sum(1 for rid in order if plan.num_tokens[rid] == 1)

        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        prompt_lp: list[tuple[str, int, int]] = []  # (request, first row, number of rows)
        tables: list[list[list[int]]] = []  # per request, per group
        spans: list[tuple[int, int, int]] = []  # per request: first row, tokens, context length after the step
        for rid in order:
            state = self._requests[rid]
            start, n = computed[rid], plan.num_tokens[rid]
            row = len(input_ids)
            input_ids.extend(state.token_ids[start : start + n])
            positions.append(np.arange(start, start + n, dtype=np.int64))
            tables.append(state.block_ids)
            spans.append((row, n, start + n))
            if start + n == len(state.token_ids):
                sample_rows.append(row + n - 1)
                sample_ids.append(rid)
            if state.params.prompt_logprobs is not None and start + 1 < state.num_prompt_tokens:
                prompt_lp.append((rid, row, min(n, state.num_prompt_tokens - 1 - start)))

        pos = np.concatenate(positions)
        positions_t = torch.from_numpy(pos).to(self.device)
        # every group's table has the same length per request: one cut into length runs serves them all
        buckets = decode_buckets([len(t[0]) for t in tables[:num_decodes]]) if num_decodes else None
        group_md = [self._metadata([t[g] for t in tables], positions, spans, num_decodes, pos, buckets)
                    for g in range(len(self.layout.groups))]
        layer_attn = [group_md[g] for g, _ in self._placement] if len(group_md) > 1 else None
        ctx = ForwardContext(attn=group_md[0], kv_caches=self.kv_caches, positions=positions_t,
                             batch_invariant=self.batch_invariant, layer_attn=layer_attn,
                             cpu_kernels=self.cpu_kernels)
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

    def _metadata(self, tables: list[list[int]], positions: list[np.ndarray], spans: list[tuple[int, int, int]],
                  num_decodes: int, pos: np.ndarray, buckets: list[tuple[int, int, int]] | None
                  ) -> AttentionMetadata:
        """One layer group's attention metadata: cache slots of this step's tokens, decode tables, prefills."""
        bs = self.block_size
        slots = np.empty_like(pos)
        for table, p, (row, n, _) in zip(tables, positions, spans):
            slots[row : row + n] = np.asarray(table, dtype=np.int64)[p // bs] * bs + p % bs
        decode_tables = decode_lens = None
        if num_decodes:
            width = max(len(t) for t in tables[:num_decodes])
            padded = np.zeros((num_decodes, width), dtype=np.int64)
            for i, t in enumerate(tables[:num_decodes]):
                padded[i, : len(t)] = t
            decode_tables = torch.from_numpy(padded).to(self.device)
            decode_lens = torch.from_numpy(pos[:num_decodes] + 1).to(self.device)
        prefills = [PrefillSeq(row, n, end, torch.tensor(table, dtype=torch.int64))
                    for table, (row, n, end) in zip(tables[num_decodes:], spans[num_decodes:])]
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(self.device),
            num_decodes=num_decodes,
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=prefills,
            block_size=bs,
            decode_buckets=buckets,
        )
