"""The one loop: add_request / abort_request / step. Not thread-safe: one thread owns an Engine."""
from __future__ import annotations

import copy
import logging
import secrets
import time
import weakref

import torch

from deepinfer.config import EngineConfig, resolve_compute
from deepinfer.core.kv_layout import layout_from_specs
from deepinfer.core.kv_manager import KVCacheManager
from deepinfer.core.plan import LateMasks, StepPlan, StepResult
from deepinfer.core.request import Request
from deepinfer.core.scheduler import Scheduler
from deepinfer.engine.handoff import EngineHandoff, KVTransferParams
from deepinfer.engine.io import (RequestState, bad_word_sequences, eos_ids, new_sequence, record_step_metrics,
                                 validate_request)
from deepinfer.kvstore.connector import KVStoreConnector, model_identity
from deepinfer.engine.structured import StructuredOutputs
from deepinfer.engine.overlap import StepPipeline, describe_overlap, extra_decode_steps, overlap_blockers
from deepinfer.engine.stats import EngineStats, ReplicaStatus
from deepinfer.engine.sizing import default_kv_cache_memory, max_tokens_fitting, mix_seed
from deepinfer.engine.timing import StepTimes
from deepinfer.models.loader import load_model_files, load_tokenizer
from deepinfer.outputs import RequestMetrics, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.models.registry import model_class
from deepinfer.worker.ep_executor import EPExecutor, make_executor
from deepinfer.worker.executor import Executor
from deepinfer.worker.model_builder import TORCH_DTYPES, architecture_of
from deepinfer.worker.runner import kv_bytes_per_block

logger = logging.getLogger("deepinfer")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        started = time.perf_counter()
        files = load_model_files(config.model.model)
        self.model_path = files.path
        self.hf_config = files.hf_config
        model_class(architecture_of(files.hf_config))  # unknown architectures fail before the slow parts
        self.tokenizer = load_tokenizer(files)
        self._backend_tokenizer = getattr(self.tokenizer, "backend_tokenizer", None) or self.tokenizer._tokenizer
        mc, cc = config.model, config.cache
        native_len = int(files.hf_config.get("max_position_embeddings") or 2048)
        max_len = mc.max_model_len or native_len
        self.compute = resolve_compute(mc, files.fmt, torch.cuda.is_available(), cc.kv_cache_dtype)
        if self.compute.cache_dtype == "fp8_e4m3" and files.hf_config.get("kv_lora_rank"):
            raise ValueError("kv_cache_dtype='fp8' needs per-head K and V caches; this model's latent attention (MLA) "
                             "computes in its cache's dtype: use 'auto' or 'bfloat16'")
        blockers = overlap_blockers(config, self.compute.device)  # overlap scheduling: the model lives on the pipeline's compute thread
        self._pipeline = None if blockers else StepPipeline(torch.get_num_threads())
        self.overlapped_steps = 0  # steps planned while the one before computed
        self._drafts_proposed = False  # the last result applied proposed drafts: the next step verifies them
        on_compute_thread = self._pipeline.call if self._pipeline is not None else (lambda fn, *args: fn(*args))
        self.executor: Executor = on_compute_thread(make_executor, config, files, max_len, self.compute)
        specs = self.executor.kv_cache_specs()
        layout = layout_from_specs(specs)
        per_block = kv_bytes_per_block(specs, cc.block_size, TORCH_DTYPES[self.compute.cache_dtype], layout)
        budget = cc.kv_cache_memory or default_kv_cache_memory(self.compute.device)
        num_blocks = budget // per_block
        chunk = config.scheduler.max_num_batched_tokens
        capacity = max_tokens_fitting(layout, num_blocks, cc.block_size, chunk)
        if capacity < max_len:
            if mc.max_model_len is not None or capacity < cc.block_size:
                raise ValueError(
                    f"KV cache of {budget} bytes holds {capacity} tokens of one sequence, fewer than "
                    f"max_model_len={max_len}; raise kv_cache_memory or lower max_model_len"
                )
            logger.warning("max_model_len lowered from %d to the KV capacity %d", max_len, capacity)
            max_len = capacity
        self.max_model_len = max_len
        self.num_blocks = num_blocks
        # prompt KV from AMX tiles (linear layers and, since stop 62, attention): other bits, other keys
        amx = "|amx-prefill+attn" if self.executor.amx_prefill else ""
        model_key = model_identity(files.path, files.hf_config, f"{self.compute.name}|kv:{self.compute.cache_dtype}{amx}",
                                   config.batch_invariant)
        spec = config.spec
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, model_key, layout,
                                 cc.swa_prefix_mode, cc.swa_keep_tokens,
                                 rollback_margin=spec.num_speculative_tokens if spec.enabled else 0)

        # ---- KV store (issue 5): the scheduler half asks it, the worker half loads and saves blocks
        self.kv_store = KVStoreConnector.open(config.kv_store, cc.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv, max_len, self.kv_store,
                                   draft_lookahead=spec.num_speculative_tokens - 1 if spec.speculative_method == "mtp"
                                   else 0, async_loads=config.scheduler.async_kv_loads,
                                   remote_kv=config.disagg.role == "decode",
                                   multi_steps=extra_decode_steps(config, self._pipeline is not None))
        on_compute_thread(self.executor.initialize_cache, num_blocks, layout, self.kv_store)
        self.handoff = EngineHandoff(config.disagg, self.scheduler, self.kv, self.kv_store, self.executor, num_blocks,
                                     per_block, int(files.hf_config["vocab_size"]))  # prefill and decode roles
        if self.kv_store is not None:
            self._close_kv_store = weakref.finalize(self, self.kv_store.close)  # queued saves land even at exit
        # ---- end KV store
        self.vocab_size = int(files.hf_config["vocab_size"])
        self.eos_token_ids = eos_ids(self.hf_config, self.tokenizer)
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self._appended: dict[str, list[int]] = {}  # jump-forward tokens the worker has not seen yet
        self.late_mask_steps = 0  # overlap scheduling: steps whose grammar masks waited for the step before's tokens
        self.late_mask_voided = 0  # ... and their rows left unsampled (finished, jump-forward, dead end)
        self._states: dict[str, RequestState] = {}
        self._children: dict[str, tuple[str, int]] = {}
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self.step_times = StepTimes()  # cumulative; see engine/timing.py
        self._spec_counts: dict[str, dict[int, tuple[int, int]]] = {}  # request -> sequence -> (drafted, accepted)
        logger.info("overlap scheduling: %s", describe_overlap(blockers))
        logger.info(
            "loaded %s (%s, %s) in %.1fs; KV cache (%s): %d blocks x %d tokens x %d layers (%.1f MiB); one sequence "
            "fits %d tokens; max_model_len %d",
            files.path, files.hf_config["architectures"][0], self.compute.name, time.perf_counter() - started,
            self.compute.cache_dtype, num_blocks, cc.block_size, layout.layers_per_group, num_blocks * per_block / 2**20,
            capacity, max_len,
        )
        if layout.is_hybrid:
            swa = [g for g in layout.groups if g.sliding_window is not None]
            window = max(g.sliding_window for g in swa)
            logger.info(
                "layer groups: %d full-attention + %d sliding-window (window %d): a running sequence holds "
                "ceil(L/%d) blocks per full group and at most %d per sliding group; %d sequences of max_model_len "
                "fit at once; prefix cache for sliding layers: %s, keep %d tokens",
                len(layout.groups) - len(swa), len(swa), window, cc.block_size, -(-window // cc.block_size) + 1,
                num_blocks // layout.blocks_for(max_len, cc.block_size, 1), cc.swa_prefix_mode, self.kv.keep_tokens,
            )

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        """vLLM's options: continue_final_message leaves the last (assistant) message open for the model to go on
        with (assistant prefill), instead of opening a new turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        if continue_final_message and (add_generation_prompt or not messages or messages[-1]["role"] != "assistant"):
            raise ValueError("continue_final_message needs add_generation_prompt=False and an assistant message last")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, kv_transfer: KVTransferParams | None = None) -> None:
        """Validates and queues a request (kv_transfer: a prefill/decode hand-off); ValueError names what is wrong."""
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        full = self.tokenize(prompt)
        kept = params.truncate_prompt_tokens  # vLLM's left truncation: the prompt's last N tokens
        token_ids = full[-kept:] if kept else full
        validate_request(token_ids, params, self.vocab_size, self.max_model_len, self.eos_token_ids,
                         self.config.scheduler)
        self.handoff.check(kv_transfer, params)
        grammar = self.structured.compile(params.so_args) if params.so_args is not None else None
        arrival = time.time() if arrival_time is None else arrival_time
        state = RequestState(
            request_id=request_id,
            prompt=(prompt if len(token_ids) == len(full) else self.tokenizer.decode(token_ids))
            if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            sequences=[new_sequence(params) for _ in range(params.n)],
            metrics=RequestMetrics(arrival_time=arrival),
        )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
        child_params = params.replace(n=1, max_tokens=max_tokens)
        if params.bad_words:  # their token sequences, once
            child_params = child_params.replace(bad_words_token_ids=[*(params.bad_words_token_ids or ()),
                                                                     *bad_word_sequences(self.tokenizer, params.bad_words)])
        self._states[request_id] = state
        self._prompt_tokens += len(token_ids) * params.n
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            if params.seq_seed is None:
                seed = secrets.randbits(63)
            else:
                seed = params.seq_seed if i == 0 else mix_seed(params.seq_seed, i)
            self._children[child_id] = (request_id, i)
            if grammar is not None:
                self.structured.add(child_id, grammar)
            request = Request(child_id, token_ids, child_params, seed, arrival, self.eos_token_ids)
            self.handoff.prepare(request, kv_transfer)
            self.scheduler.add(request)

    def abort_request(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        self._spec_counts.pop(request_id, None)
        if state is None:
            return
        for i, seq in enumerate(state.sequences):
            child_id = request_id if len(state.sequences) == 1 else f"{request_id}#{i}"
            self._children.pop(child_id, None)
            self.structured.remove(child_id)
            self._appended.pop(child_id, None)
            self.handoff.aborted(self.scheduler.finish(child_id, "abort"))

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or KV hand-offs held for decode engines (released by later steps)."""
        return bool(self._states) or self.handoff.busy

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step and returns its outputs. With overlap scheduling the step after it is planned and submitted
        first, so it computes while this one's outputs are made (engine/overlap.py)."""
        pipeline = self._pipeline
        if pipeline is None:
            plan, failed = self._plan()
            return self._finish(plan, self.executor.execute(plan), failed)
        if not pipeline.in_flight:
            pipeline.submit(self.executor.execute, *self._plan())
        if self._can_overlap():
            pipeline.submit(self.executor.execute, *self._plan())
            self.overlapped_steps += 1
        done, result = pipeline.take()
        try:
            outputs = self._finish(done.plan, result, done.failed)
        except BaseException:
            pipeline.cancel_late_masks("the step before it could not be applied")
            raise
        return outputs + self._fill_late_masks()

    @property
    def overlap_scheduling(self) -> bool:
        """Whether steps are planned while the previous one computes (engine/overlap.py)."""
        return self._pipeline is not None

    def _can_overlap(self) -> bool:
        """Whether the next step can be planned before the one in flight returns its tokens (tokens a grammar
        appended go with it; the row in flight of their request samples nothing: `_fill_late_masks`), unless the
        step in flight verifies drafts or the last result proposed some (engine/overlap.py)."""
        in_flight = self._pipeline.in_flight[-1].plan
        return not self.handoff.busy and not self._drafts_proposed and not in_flight.spec_token_ids

    def _plan(self) -> tuple[StepPlan, list[RequestOutput]]:
        """The next step's plan, and the outputs of requests that fail before it (a grammar that allows no token)."""
        clock = time.perf_counter()
        self.handoff.before_step(idle=not self._states)
        plan = self.scheduler.schedule()
        failed: list[RequestOutput] = []
        if self.structured:  # a request whose token is still in flight gets its mask once it is known
            late = [rid for rid in plan.sample_ids
                    if self.structured.has(rid) and self.scheduler.requests[rid].num_placeholders]
            plan.grammar_masks = self.structured.masks(plan, skip=late)
            dead = self.structured.dead_ends(plan.grammar_masks)
            if dead:  # those sequences end with an error now (no later plan, ahead or not, holds them); everyone
                # else's step goes on
                plan = plan.without(dead)
                failed = [self._fail(rid) for rid in dead if rid in self._children]
            if late:
                plan.late_masks = LateMasks(late)
                self.late_mask_steps += 1
        plan.appended_token_ids, self._appended = self._appended, {}
        self._lap("schedule", clock)
        return plan, failed

    def _finish(self, plan: StepPlan, result: StepResult, failed: list[RequestOutput]) -> list[RequestOutput]:
        """Applies a step's result: scheduler, grammars, outputs."""
        for phase, seconds in result.timings.items():
            self.step_times.add(phase, seconds)
        clock = time.perf_counter()
        advanced = self.handoff.after_update(self.scheduler.update(plan, result), result)
        self._drafts_proposed = bool(result.draft_token_ids)
        if self.structured:
            self._appended.update(self.structured.advance(advanced, result.sampled, self.scheduler))
        clock = self._lap("update", clock)
        self.step_times.steps += 1
        outputs = self._outputs(advanced, result) + failed
        self.handoff.finish_outputs(outputs)
        self._lap("output", clock)
        if self.scheduler.has_pending_saves() and not self.scheduler.has_unfinished():
            self.executor.execute(self.scheduler.schedule())  # idle now: hand finished tails to the KV store
        return outputs

    def _fill_late_masks(self) -> list[RequestOutput]:
        """Overlap scheduling: fills the late masks of the step in flight (StructuredOutputs.late_masks); a request
        whose grammar allows no token fails now (its output is returned), so that no later plan holds it."""
        step = self._pipeline.in_flight[0] if self._pipeline.in_flight else None
        if step is None or step.plan.late_masks is None:
            return []
        masks, voided, dead = self.structured.late_masks(step.plan.late_masks.request_ids, self.scheduler,
                                                         self._appended)
        failed = [self._fail(rid) for rid in dead if rid in self._children]
        for rid in voided:
            self.scheduler.void_sample(step.plan.step, rid)
        self.late_mask_voided += len(voided)
        step.plan.late_masks.fill(masks, voided)
        return failed

    def _fail(self, child_id: str) -> RequestOutput:
        """Ends the whole request of a sequence that cannot continue: its output carries the error."""
        parent_id, _ = self._children[child_id]
        state = self._states[parent_id]
        message = "the output grammar allows no token of this model's vocabulary at this point"
        for seq in state.sequences:
            seq.finish_reason = seq.finish_reason or "error"
        self.abort_request(parent_id)
        out = state.to_output()
        out.error = message
        return out

    def _lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.step_times.add(phase, now - since)
        return now

    def _outputs(self, advanced: list[Request], result) -> list[RequestOutput]:
        """Detokenizes and applies stop strings for the requests that advanced; their outputs."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        for request in advanced:
            parent_id, index = self._children[request.request_id]
            state = self._states[parent_id]
            seq = state.sequences[index]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
            if index == 0:
                state.num_cached_tokens = request.num_cached_tokens
                if request.request_id in result.prompt_logprobs:
                    state.prompt_logprobs = (state.prompt_logprobs or [None]) + result.prompt_logprobs[request.request_id]
            new_tokens = request.output_token_ids[seq.num_tokens :]
            self._generation_tokens += len(new_tokens)
            seq.logprobs.extend(result.logprobs.get(request.request_id, ())[: len(new_tokens)])
            stop = seq.add_tokens(self._backend_tokenizer, new_tokens)
            if stop is not None and not request.is_finished:
                self.scheduler.finish(request.request_id, "stop", stop)
            if request.is_finished:
                seq.finish_reason, seq.stop_reason = request.finish_reason, request.stop_reason
            record_step_metrics(state, request, now)
            if request.num_draft_tokens:
                self._spec_counts.setdefault(parent_id, {})[index] = (request.num_draft_tokens,
                                                                      request.num_accepted_tokens)
                counts = self._spec_counts[parent_id].values()
                state.metrics.num_draft_tokens = sum(d for d, _ in counts)
                state.metrics.num_accepted_tokens = sum(a for _, a in counts)
            touched[parent_id] = state
        outputs = []
        for parent_id, state in touched.items():
            if state.finished:
                state.metrics.finished_time = now
                del self._states[parent_id]
                self._spec_counts.pop(parent_id, None)
                for i in range(len(state.sequences)):
                    child_id = parent_id if len(state.sequences) == 1 else f"{parent_id}#{i}"
                    self._children.pop(child_id, None)
                    self.structured.remove(child_id)
            elif state.output_kind == "final_only":
                continue  # nothing to hand out until it finishes
            outputs.append(state.to_output())
        return outputs

    def close(self) -> None:
        """Lets queued KV store saves finish (a few seconds at most) and closes the store (that also runs at exit);
        shuts the executor down."""
        if self.kv_store is not None:
            self._close_kv_store()
        self.handoff.close()
        if self._pipeline is not None:
            self._pipeline.cancel_late_masks("the engine closed")
            self._pipeline.call(self.executor.shutdown)  # queued behind any step still in flight
            self._pipeline.close()
        else:
            self.executor.shutdown()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.kv.usage(),
            num_blocks=self.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            kv_store=None if self.kv_store is None else self.kv_store.stats(),
            prefix_replay=self.kv.replay_stats() if self.kv.layout.is_hybrid else None,
            peak_kv_blocks=self.kv.pool.peak_in_use,
            moe_load=self.executor.load_stats() if isinstance(self.executor, EPExecutor) else None,
            spec_decode=copy.deepcopy(self.scheduler.spec_stats) if self.config.spec.enabled else None,
            handoff=self.handoff.stats(),
        )

    def replica_status(self, since: int | None = None, epoch: str | None = None) -> ReplicaStatus:
        """Load figures and the cached-key changes since event `since` of log `epoch` (a snapshot without them)."""
        running = self.scheduler.running
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens <= 1]
        prefilling = [*self.scheduler.waiting, *(r for r in running if r.num_tokens - r.num_computed_tokens > 1)]
        queued = sum(r.num_tokens - r.num_computed_tokens for r in prefilling)
        # causal (query, key) pairs of positions start..end-1, as router.policy.attention_pairs counts them
        pairs = sum((r.num_tokens * (r.num_tokens + 1) - r.num_computed_tokens * (r.num_computed_tokens + 1)) // 2
                    for r in prefilling)
        context = sum(r.num_tokens for r in decoding)
        return ReplicaStatus(queued, pairs, len(decoding), context, len(self.scheduler.waiting), self.kv.usage(),
                             self.stats(), self.kv.key_events(since, epoch), self.kv.model_key, self.kv.block_size)
