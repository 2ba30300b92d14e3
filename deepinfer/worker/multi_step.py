"""Multi-step decoding: after a step of decodes (no drafts, no grammar), more decode steps straight away, each one's
input the token the step before it sampled, without going back to the engine (its scheduling, detokenizing and
outputs) in between. vLLM's --num-scheduler-steps, for the case where that work is a large part of a step: one user
decoding on a CPU, where the engine's Python is ~0.5 ms of a ~3.5 ms step.

The scheduler allocated every extra step's KV slot with the step's own (core/scheduler.py `_more_steps`). Each
extra step is the forward one step at a time would run: the same rows, positions one further, the same block
tables, then the same sampler call (greedy rows' argmax; a seeded row's draw is keyed by its position; penalties and
min_tokens see the tokens before it); so the tokens, logprobs and the cache are the same bits. A request that stops
inside the run (an EOS or stop token) keeps its tokens up to the stop: the scheduler cuts the rest, whose KV lies
beyond its computed tokens, as a rejected draft's does; the run ends where every row has stopped. The runner drives
the run (worker/runner.py `_multi_step`).
"""
from __future__ import annotations

import torch

from deepinfer.layers.context import AttentionMetadata, ForwardContext, forward_context
from deepinfer.worker.inputs import table_slots


def next_position(md: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
    """A decode-only step's metadata for the rows' next positions (`positions`: already one further)."""
    slots = table_slots(md.decode_block_tables, positions, md.block_size)
    return AttentionMetadata(slot_mapping=slots, num_decodes=md.num_decodes, decode_block_tables=md.decode_block_tables,
                             decode_context_lens=positions + 1, prefills=[], block_size=md.block_size,
                             decode_buckets=md.decode_buckets)


def forward_next(model: torch.nn.Module, ctx: ForwardContext, group_metadata: list[AttentionMetadata],
                 positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The forward of one more decode step: `tokens` at `positions` (one further than the step of `ctx`, that
    step's forward context: its caches, kernels and mode, and `group_metadata`, its tables per layer group)."""
    mds = [next_position(md, positions) for md in group_metadata]
    moved = {id(old): new for old, new in zip(group_metadata, mds)}  # each layer keeps its group's tables
    layer_attn = [moved[id(md)] for md in ctx.layer_attn] if ctx.layer_attn is not None else None
    step_ctx = ForwardContext(attn=mds[0], kv_caches=ctx.kv_caches, positions=positions,
                              batch_invariant=ctx.batch_invariant, layer_attn=layer_attn, cpu_kernels=ctx.cpu_kernels)
    with forward_context(step_ctx):
        return model(tokens, positions)
