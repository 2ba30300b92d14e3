"""StepPlan -> input tensors -> forward -> sample (or verify drafts) -> StepResult."""
from __future__ import annotations

import time
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.config import SpecConfig
from deepinfer.core.kv_layout import KVCacheSpec, KVLayout, layout_from_specs
from deepinfer.core.plan import StepPlan, StepResult
from deepinfer.layers.context import ForwardContext, forward_context
from deepinfer.ops.huge_pages import lazy_zeros
from deepinfer.sample.logprobs import compute_prompt_logprobs
from deepinfer.sample.prob_order import ProbOrderOps
from deepinfer.sample.sampler import Sampler
from deepinfer.worker.decode_batch import DecodeBatch
from deepinfer.worker.inputs import RequestRows, StepInputs, build_inputs, prompt_runs
from deepinfer.worker.mtp import mtp_drafts
from deepinfer.worker.multi_step import forward_next
from deepinfer.worker.request_state import Tokens, WorkerRequest
from deepinfer.sample.rejection import verify_greedy
from deepinfer.worker.speculative import (check_shadow, depth_costs, draft_rows, drafts_can_pay, looks_up,
                                          lookup_drafts, matched_drafts, mtp_upkeep, ngram_drafts,
                                          plan_draft_lengths, record_acceptance, row_costs, verify)

if TYPE_CHECKING:
    from deepinfer.disagg.transfer import HandoffPuller
    from deepinfer.worker.kv_transfer import KVBlockTransfer


def kv_bytes_per_block(specs: list[KVCacheSpec], block_size: int, dtype: torch.dtype,
                       layout: KVLayout | None = None) -> int:
    """Bytes of one pool block: block_size tokens of one group's layers (all layers unless the model mixes
    windows)."""
    layout = layout or layout_from_specs(specs)
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(specs[i].num_kv_heads * (specs[i].head_dim + specs[i].v_head_dim) for i in layout.groups[0].layers) \
        * elem * block_size


def _lap(result: StepResult, phase: str, since: float) -> float:
    now = time.perf_counter()
    result.timings[phase] = result.timings.get(phase, 0.0) + now - since
    return now


def _position_masks(masks: torch.Tensor | list | None) -> list:
    """A request's grammar masks, one per row (a single mask: its one row)."""
    if masks is None:
        return []
    return masks if isinstance(masks, list) else [masks]


class ModelRunner:
    """Keeps each running request's tokens and block table (updated by plan diffs) and the KV caches."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device: str,
                 batch_invariant: bool = False, layout: KVLayout | None = None,
                 cpu_kernels: ModuleType | None = None, spec: SpecConfig | None = None,
                 varlen: bool = True) -> None:
        self.model = model
        self.spec = spec if spec is not None and spec.enabled else None
        self.varlen = varlen
        self._depth_costs = depth_costs(self.spec) if self.spec is not None else ()  # the proposer's, per draft depth
        self._row_costs = row_costs(cpu_kernels.isa() if cpu_kernels is not None else None)  # a step's, per row
        self.batch_invariant = batch_invariant
        self.cpu_kernels = cpu_kernels  # compiled attention (ops/cpu_attention.py); None: torch ops
        self.block_size = block_size
        self.device = torch.device(device)
        specs = model.kv_cache_specs()
        self.layout = layout or layout_from_specs(specs)
        # one K and one V tensor per slot; the layers in the same slot of different groups share them
        shapes = [shape for i in self.layout.groups[0].layers
                  for shape in ((num_blocks * block_size, specs[i].num_kv_heads, specs[i].head_dim),
                                (num_blocks * block_size, specs[i].num_kv_heads, specs[i].v_head_dim))]
        if self.device.type == "cpu":  # zero pages as they are first touched (ops/huge_pages.py)
            flat = lazy_zeros(shapes, dtype)
        else:
            flat = [torch.zeros(shape, dtype=dtype, device=self.device) for shape in shapes]
        self.slot_caches = [(flat[j], flat[j + 1]) for j in range(0, len(flat), 2)]
        self._placement = self.layout.placement(len(specs))
        self.kv_caches = [self.slot_caches[slot] for _, slot in self._placement]  # per attention layer
        on_cpu = cpu_kernels is not None and self.device.type == "cpu"
        # greedy rows' argmax, seeded rows' inverse CDF, top-k / top-p rows' sort and decision compiled, rows in
        # parallel
        self.sampler = Sampler(cpu_kernels.argmax_rows if on_cpu else None,
                               cpu_kernels.sample_id_order if on_cpu else None,
                               ProbOrderOps.of(cpu_kernels) if on_cpu else None)
        self.kv_transfer: KVBlockTransfer | None = None  # set by the engine when a KV store is configured
        self.async_loads = False  # with a KV store: load blocks in the background (core/kv_loading.py)
        self.kv_puller: HandoffPuller | None = None  # disaggregation, decode role: pulls prompt KV from prefill engines
        self._requests: dict[str, WorkerRequest] = {}
        # the decode batch moved on from step to step (worker/decode_batch.py); None: inputs built anew every step
        self.decode_batch: DecodeBatch | None = DecodeBatch(len(self.layout.groups), block_size, self.device)
        # the model's quantized layers compute prompt rows on AMX tiles (ops/wide_linear.py): the forward context
        # names the step's prompt rows
        self.prompt_rows_tiles = False

    def _apply_diff(self, plan: StepPlan) -> None:
        for request_id in plan.finished_ids:
            self._requests.pop(request_id, None)
        for request_id in plan.preempted_ids:
            self._requests.pop(request_id, None)
        for new in plan.new_requests:
            self._requests[new.request_id] = WorkerRequest(
                Tokens(new.token_ids, new.num_prompt_tokens), [np.asarray(t, dtype=np.int64) for t in new.block_ids],
                new.params, new.seed,
                new.eos_token_ids,
            )
        for cached in plan.cached_requests:
            tables = self._requests[cached.request_id].block_ids
            for g, added in enumerate(cached.new_block_ids):
                if added:
                    tables[g] = np.concatenate([tables[g], np.asarray(added, dtype=np.int64)])
        fresh = {new.request_id for new in plan.new_requests}
        for request_id, tokens in plan.appended_token_ids.items():
            if request_id in self._requests and request_id not in fresh:
                self._requests[request_id].extend(tokens)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self._apply_diff(plan)
        result = StepResult()
        if self.kv_transfer is not None and plan.kv_saves_first:  # finished requests' tails, before reuse
            self.kv_transfer.save(plan, first=True)
        if self.kv_transfer is not None and self.async_loads:  # KV store loads in the background
            self.kv_transfer.start_loads(plan)
            result.kv_loads_done = self.kv_transfer.poll(wait=0.0 if plan.num_tokens else 0.01)
        elif self.kv_transfer is not None and plan.kv_loads:  # KV store: fill loaded blocks before the forward
            result.kv_load_failures = self.kv_transfer.load(plan)
            if result.kv_load_failures:  # a broken chain is recomputed from the next step on
                plan = plan.without(result.kv_load_failures)
        if self.kv_puller is not None and (plan.kv_pulls or self.kv_puller.loading):  # from prefill engines
            self.kv_puller.start(plan.kv_pulls)
            result.kv_loads_done.update(self.kv_puller.poll(wait=0.0 if plan.num_tokens else 0.01))
        if not plan.num_tokens:
            return result
        clock = time.perf_counter()
        inputs = self.decode_batch.advance(plan, self._requests) if self.decode_batch is not None else None
        if inputs is None:
            inputs = build_inputs(plan, {rid: self._requests[rid].token_ids for rid in plan.num_tokens},
                                  {rid: self._requests[rid].block_ids for rid in plan.num_tokens}, self.layout,
                                  self.block_size, self.device)
            if self.decode_batch is not None:
                self.decode_batch.keep(plan, inputs, self._requests)
        md = inputs.group_metadata
        ctx = ForwardContext(attn=md[0], kv_caches=self.kv_caches, positions=inputs.positions,
                             batch_invariant=self.batch_invariant,
                             layer_attn=[md[g] for g, _ in self._placement] if len(md) > 1 else None,
                             cpu_kernels=self.cpu_kernels)
        if self.prompt_rows_tiles:
            ctx.prompt_runs = prompt_runs(inputs.requests, {r.request_id: self._requests[r.request_id].num_prompt_tokens
                                                            for r in inputs.requests})
        clock = _lap(result, "prepare", clock)
        with forward_context(ctx):
            hidden = self.model(inputs.input_ids, inputs.positions)
        self._prompt_logprobs(inputs.requests, hidden, result)
        sampling = [r for r in inputs.requests if r.samples]
        masks = plan.grammar_masks
        if plan.late_masks is not None:  # overlap scheduling: masks filled once the step before's tokens are known
            late, voided = plan.late_masks.wait()
            masks = {**masks, **late}
            sampling = [r for r in sampling if r.request_id not in voided]
        if sampling:
            rows = torch.tensor([r.first_row + r.num_known - 1 + i for r in sampling for i in range(1 + len(r.drafts))],
                                device=self.device)
            # plain greedy rows only: the head's argmax straight from its weights where the model can (no logits)
            plain = self._argmax_only(sampling, masks)
            tokens = self.model.greedy_tokens(hidden[rows]) if plain else None
            if tokens is not None:
                clock = _lap(result, "forward", clock)  # the head and its argmax in one op
                self._emit_argmax(sampling, tokens, result)
            else:
                logits = self.model.compute_logits(hidden[rows])
                clock = _lap(result, "forward", clock)
                self._sample(sampling, logits, masks, result, plain)
            clock = _lap(result, "sample", clock)
            if plan.multi_steps and self._multi_step(plan, inputs, ctx, result):
                clock = _lap(result, "forward", clock)
        else:
            clock = _lap(result, "forward", clock)
        if self.spec is not None:
            self._propose(inputs, hidden, result)
            _lap(result, "propose", clock)
        if self.kv_transfer is not None:  # KV store: save the blocks this forward filled
            self.kv_transfer.save(plan)
        return result

    def _prompt_logprobs(self, requests: list[RequestRows], hidden: torch.Tensor, result: StepResult) -> None:
        for r in requests:
            state = self._requests[r.request_id]
            if state.params.prompt_logprobs is None or r.start + 1 >= state.num_prompt_tokens:
                continue
            count = min(r.num_known, state.num_prompt_tokens - 1 - r.start)
            logits = self.model.compute_logits(hidden[r.first_row : r.first_row + count])
            next_ids = state.token_ids[r.start + 1 : r.start + 1 + count]
            result.prompt_logprobs[r.request_id] = compute_prompt_logprobs(logits, next_ids,
                                                                           state.params.prompt_logprobs)

    def _sample(self, sampling: list[RequestRows], logits: torch.Tensor, masks: dict, result: StepResult,
                plain: bool) -> None:
        """Plain rows and greedy requests' draft rows through the sampler in one call (a greedy request accepts its
        drafts while they equal the argmax); other requests with drafts through verification. A step of plain greedy
        rows only (the common case) takes the argmax straight away: what the sampler computes for them."""
        if plain:  # every row plain greedy (_argmax_only)
            self._emit_argmax(sampling, self.sampler.argmax(logits), result)
            return
        offsets = np.cumsum([0] + [1 + len(r.drafts) for r in sampling])
        batched, rows = [], []
        for i, r in enumerate(sampling):
            state = self._requests[r.request_id]
            if not r.drafts:
                rows.append(state.sampling_row(masks.get(r.request_id)))
            elif state.params.greedy and state.params.logprobs is None:
                rows += draft_rows(state.sampling_row(None), r.drafts, _position_masks(masks.get(r.request_id)))
            else:
                continue
            batched.append(i)
        if batched:
            if len(rows) == logits.shape[0]:  # every row, in order: no copy of the logits
                out = self.sampler(logits, rows)
            else:
                index = [int(offsets[i]) + j for i in batched for j in range(1 + len(sampling[i].drafts))]
                out = self.sampler(logits[torch.tensor(index, device=logits.device)], rows)
            at = 0
            for i in batched:
                r, n = sampling[i], 1 + len(sampling[i].drafts)
                judged = self._requests[r.request_id].judged
                if r.drafts:
                    tokens = verify_greedy(out.token_ids[at : at + n], r.drafts)
                    record_acceptance(judged, len(r.drafts), len(tokens) - 1)
                    self._emit(r.request_id, tokens, [None] * len(tokens), result)
                else:
                    if self.spec is not None:
                        check_shadow(judged, out.token_ids[at])
                    self._emit(r.request_id, [out.token_ids[at]], [out.logprobs[at]], result)
                at += n
        done = set(batched)
        for i, r in enumerate(sampling):
            if i in done:
                continue
            state = self._requests[r.request_id]
            tokens, lps = verify(self.sampler, logits[int(offsets[i]) : int(offsets[i + 1])],
                                 state.sampling_row(None), r.drafts, _position_masks(masks.get(r.request_id)))
            record_acceptance(self._requests[r.request_id].judged, len(r.drafts), len(tokens) - 1)
            self._emit(r.request_id, tokens, lps, result)

    def _multi_step(self, plan: StepPlan, inputs: StepInputs, ctx: ForwardContext, result: StepResult) -> bool:
        """The extra decode steps the plan allows (worker/multi_step.py), where every row is a decode allowed some
        and no row follows a grammar (its next mask needs this token); False otherwise (its one token stands)."""
        rows = inputs.requests
        if plan.grammar_masks or any(r.num_known != 1 or r.drafts or not r.samples
                                     or r.request_id not in plan.multi_steps for r in rows):
            return False
        states = [self._requests[r.request_id] for r in rows]
        steps = min(plan.multi_steps[r.request_id] for r in rows)
        positions = inputs.positions
        first = [result.sampled[r.request_id][0] for r in rows]
        tokens = torch.tensor(first, device=self.device)
        stopped = [s.stops(t) for s, t in zip(states, first)]
        ran = 0
        while ran < steps and not all(stopped):  # no step more once every row has sampled its last token
            positions = positions + 1
            hidden = forward_next(self.model, ctx, inputs.group_metadata, positions, tokens)
            ids = self.model.greedy_tokens(hidden) if all(s.argmax_only for s in states) else None
            if ids is not None:  # as a step of plain greedy rows takes them: the head's argmax, no logits
                ids, logprobs = ids.tolist(), [None] * len(rows)
            else:  # the step's one sampler call over every row
                out = self.sampler(self.model.compute_logits(hidden), [s.sampling_row(None) for s in states])
                ids, logprobs = out.token_ids, out.logprobs
            ran += 1
            for i, (r, token, lp) in enumerate(zip(rows, ids, logprobs)):
                states[i].extend([token])
                result.sampled[r.request_id].append(token)
                if lp is not None:
                    result.logprobs[r.request_id].append(lp)
                stopped[i] = stopped[i] or states[i].stops(token)
            tokens = torch.tensor(ids, device=self.device)
        if self.decode_batch is not None and ran:
            self.decode_batch.moved_on(inputs, ran)
        return True

    def _argmax_only(self, sampling: list[RequestRows], masks: dict) -> bool:
        """Every row plain greedy: no grammar mask, no logprobs or penalties, min_tokens met (then also at a draft's
        later positions): each row's token is its argmax, and a greedy request's drafts are verified against those."""
        return not masks and all(self._requests[r.request_id].argmax_only for r in sampling)

    def _emit_argmax(self, sampling: list[RequestRows], tokens: torch.Tensor, result: StepResult) -> None:
        """tokens: the argmax of every sampled row, a request's 1 + len(drafts) rows in order."""
        ids, at = tokens.tolist(), 0
        for r in sampling:
            judged = self._requests[r.request_id].judged
            if r.drafts:
                emitted = verify_greedy(ids[at : at + 1 + len(r.drafts)], r.drafts)
                record_acceptance(judged, len(r.drafts), len(emitted) - 1)
                self._emit(r.request_id, emitted, [None] * len(emitted), result)
            else:
                if self.spec is not None:
                    check_shadow(judged, ids[at])
                self._emit(r.request_id, [ids[at]], [None], result)
            at += 1 + len(r.drafts)

    def _propose(self, inputs: StepInputs, hidden: torch.Tensor, result: StepResult) -> None:
        """The next step's drafts for every request that sampled (MTP also caches its KV for the computed rows: all
        of them, except decode rows in a batch of 8+ where nothing drafts, speculative.mtp_upkeep); with the n-gram
        lookup in front of MTP, a request the lookup matches takes its drafts instead."""
        requests = inputs.requests
        sampling = [r for r in requests if r.samples]
        mtp = self.spec.speculative_method == "mtp"
        if not drafts_can_pay(self.varlen, len(sampling), self._row_costs):  # no draft can pay its row here
            if mtp:  # prompt rows still get MTP's K/V (later drafts see the prompt); decode rows go without
                self._mtp_drafts(inputs, hidden, result, {}, decodes=False)
            return
        if self.spec.speculative_method == "ngram" and self.varlen:  # planned on the estimates of each sequence's match length
            states = [self._requests[r.request_id] for r in sampling]
            judged, drafts = matched_drafts(self.spec, [s.token_ids.as_array() for s in states],
                                            [s.matched for s in states], self._row_costs)
            for state, by in zip(states, judged):
                state.drafted_by = by
            result.draft_token_ids.update({r.request_id: d for r, d in zip(sampling, drafts) if d})
            return
        lookups = {r.request_id: lookup_drafts(self.spec, self._requests[r.request_id].token_ids.as_array())
                   for r in sampling} if looks_up(self.spec, self.varlen, len(sampling), self._row_costs) else {}
        found = [bool(lookups.get(r.request_id)) for r in sampling]  # these draft from the lookup this step
        states = [self._requests[r.request_id] for r in sampling]
        for state, looked in zip(states, found):
            state.drafted_by = state.lookup if looked else state.drafting
        planned = plan_draft_lengths(self.spec, self.varlen, [state.drafted_by for state in states],
                                     depth_costs=self._depth_costs, free=found, costs=self._row_costs)
        lengths = {r.request_id: 0 if looked else n for r, n, looked in zip(sampling, planned, found)}
        if mtp:
            drafts = self._mtp_drafts(inputs, hidden, result, lengths,
                                      mtp_upkeep(self.varlen, len(sampling), any(lengths.values())))
            drafts.update({r.request_id: lookups[r.request_id][:n] for r, n, looked in zip(sampling, planned, found)
                           if n and looked})
        else:
            drafts = ngram_drafts(self.spec, lengths, {rid: self._requests[rid].token_ids for rid in lengths})
        result.draft_token_ids.update({rid: d for rid, d in drafts.items() if d})

    def _mtp_drafts(self, inputs: StepInputs, hidden: torch.Tensor, result: StepResult, lengths: dict[str, int],
                    decodes: bool = True) -> dict[str, list[int]]:
        requests = inputs.requests
        return mtp_drafts(self.model, self.model.mtp, inputs, hidden,
                          {r.request_id: self._requests[r.request_id].token_ids for r in requests}, result.sampled,
                          lengths, {r.request_id: self._requests[r.request_id].block_ids for r in requests},
                          self.kv_caches, self.layout, self.block_size, self.device, self.batch_invariant,
                          self.cpu_kernels, decodes)

    def _emit(self, request_id: str, tokens: list[int], logprobs: list, result: StepResult) -> None:
        self._requests[request_id].extend(tokens)
        result.sampled[request_id] = tokens
        if logprobs and logprobs[0] is not None:
            result.logprobs[request_id] = logprobs
