"""Speculative decoding, the worker half: verify a request's drafts against the target's logits at its k + 1 rows,
and propose the next step's drafts.

Each of the k + 1 rows is sampled as if the drafts before it had been generated: its SamplingRow sees them as
output tokens (penalties, min_tokens), its output position, and its own grammar mask. Greedy rows accept while the
target's argmax equals the draft; sampled rows use the rejection rule (sample/rejection.py).

Draft lengths: with `varlen`, the step's drafts are planned together, each sequence's by its recent acceptance
(n-gram drafts: its acceptance after matches of the current match's length), as many as raise the expected tokens
per unit of step time (down to none, probing again now and then); without it, every sequence drafts exactly k (as
many as the proposer finds).
"""
from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.config import SpecConfig
from deepinfer.sample.distribution import target_probabilities
from deepinfer.sample.logprobs import logprob_dicts
from deepinfer.sample.rejection import verify_greedy, verify_sampled
from deepinfer.sample.sampler import Sampler, SamplingRow
from deepinfer.spec.ngram import match_ngram, propose_ngram

EMA = 0.7  # weight of the past in a sequence's acceptance estimate
RELAX = 0.05  # per step, how far a position not drafted drifts back to the prior
PROBE_EVERY = 8  # steps between one-token probes of a sequence that stopped drafting, alone (more in a batch)
# A decode step of R rows costs fixed + max(weight_rows, linear_share * R) + (1 - linear_share) * R
# + pass_rows * (ceil(R / tile_rows) - 1), in units of one row's compute (RowCosts): the layers' weights stream in
# weight_rows rows' time however few rows use them (a small batch is memory-bound, its extra rows nearly free), the
# quantized linear layers are linear_share of a row's compute (attention, LM head and sampling the rest), and each
# further tile of tile_rows rows is one more pass over every weight block. Fit per instruction set of the compiled
# kernels on SmolLM2 Q4_1, 2 cores, ~150-token contexts (benchmarks/decode_stack.py; doc/inference_deployment_qa.md):
# - AVX-512 VNNI (the Zen 4 machine): 2.6 / 4.8 / 9.0 / 17.8 / 35 ms at 1 / 8 / 16 / 32 / 64 rows, a row ~0.53 ms,
#   a 9th row 0.7 ms. Extra rows are nearly free up to 3-4: one more row costs ~8% of a batch-1 step.
# - AVX2 without VNNI (the Zen 3 machine, stop 59, with the 16-lane tiles): 5.1 / 5.6 / 6.3 / 7.1 / 8.7 / 12.1 /
#   15.7 / 26.4 / 27.6 / 50.1 / 107 ms at 1 / 2 / 3 / 4 / 5 / 8 / 9 / 16 / 17 / 32 / 64 rows: a row ~1.38 ms, the first
#   ~3 rows partly memory-bound, a step at each 5th row (fit: 2.7% rms); a second row costs ~13% of a batch-1 step
#   (stop 58's tiles: 28%).
# - Not fit: AVX2 with AVX-VNNI and the portable build take AVX2's (with VNNI it overstates a row, so drafts there
#   are planned conservatively); no compiled kernels (torch's float32 matmuls, CUDA) AVX-512's (memory-bound rows).
# MTP's own cost per draft depth, in the same units: depth 1 is the draft head over the draft vocabulary and the MTP
# layer's whole run on the drafting rows, in place of the K/V-only upkeep every other row gets; each deeper depth the
# layer's decode stack and the head again. Depth 1 is charged nothing: since each depth is one compiled call with the
# upkeep (stop 52), its extra is the head's argmax (~0.06 ms) and one row through the whole layer, against a row's
# ~0.53 ms, and charging it 0.3 (the stop-48 figure) measured 0.93-0.96x on chat with the n-gram lookup in front
# (fewer MTP drafts: 292 steps for 512 tokens against 269), the same without it (stop 56,
# doc/inference_deployment_qa.md).
MTP_DEPTH_COSTS = (0.0, 1.3)  # depth 1; every deeper depth
# The lookup in front of MTP takes a match of 2+ tokens: replaying greedy SmolLM2 answers (stop 48), its first draft
# after a 2-4 token match was right 0.58-0.89 of the time against MTP's 0.26-0.65; after a 1-token match 0.12 against
# MTP's 0.23.
LOOKUP_MIN = 2
# n-gram drafts (varlen): each match length's prior acceptance per position, before a sequence's own verifications
# (matched_drafts); key 0: longer matches than listed. SmolLM2's greedy answers to spec_decode.py's prompts replayed
# (benchmarks/ngram_rows.py, ngram_max 4; the first draft's acceptance, repetitive / chat): after a 1-token match
# 0.18 / 0.09, 2 tokens 0.67 / 0.53, 3 tokens 0.70 / 0.33, 4 tokens 0.96 / 0.92, with 0.94-0.98 for each draft after
# an accepted one. A 1-token match starts below the bar of a row alone on AVX2's cost model (0.13, first_draft_bar)
# and just above AVX-512's (0.08, where such rows are nearly free); its verifications and shadow probes move it on.
MATCH_PRIORS = {0: 0.9, 1: 0.1, 2: 0.6, 3: 0.6}


@dataclass(frozen=True)
class RowCosts:
    """The decode step's cost model (above) for one instruction set."""

    fixed: float = 1.1
    weight_rows: float = 3.4
    linear_share: float = 0.62
    pass_rows: float = 0.6
    tile_rows: int = 8

    def step(self, rows: int) -> float:
        """A decode step of `rows` rows in units of one row's compute."""
        passes = -(-rows // self.tile_rows)
        return self.fixed + max(self.weight_rows, self.linear_share * rows) + (1 - self.linear_share) * rows \
            + self.pass_rows * (passes - 1)


AVX512_COSTS = RowCosts()
AVX2_COSTS = RowCosts(fixed=0.1, weight_rows=3.1, linear_share=0.54, pass_rows=0.85, tile_rows=4)
TILE_ROWS = AVX512_COSTS.tile_rows  # MTP's upkeep rule (mtp_upkeep) keeps AVX-512's tile


def row_costs(isa: str | None) -> RowCosts:
    """The cost model for the compiled kernels' instruction set (cpu_ops `isa()`; None: no compiled kernels)."""
    return AVX2_COSTS if isa in ("avx2", "avx2-vnni", "generic") else AVX512_COSTS


@dataclass
class DraftState:
    """Per sequence: its acceptance estimates and how long it has gone without drafting; a shadow probe's guess at
    its next token (checked against the token it then samples, no row spent).

    Acceptance is kept per draft position, conditional on the drafts before it being accepted (what verification
    observes): an MTP head's second draft is accepted far less often than its first, an n-gram's later drafts more
    often once the first matched. A position not yet observed starts at `acceptance`; one that is no longer drafted
    drifts back towards it, so it is tried again."""

    acceptance: float = 0.6  # the prior of every position
    per_position: list[float] = field(default_factory=list)
    idle_steps: int = 0
    probe: bool = False  # a probe is due after this step
    shadow: int | None = None

    def rate(self, position: int) -> float:
        """Probability that the draft at `position` (0-based) is accepted, given the ones before it were."""
        return self.per_position[position] if position < len(self.per_position) else self.acceptance


def draft_rows(base: SamplingRow, drafts: Sequence[int], masks: Sequence[torch.Tensor | None]) -> list[SamplingRow]:
    """The k + 1 rows of a request with drafts, each sampled as if the drafts before it had been generated."""
    return [SamplingRow(base.params, base.seed, base.position + i, base.prompt_token_ids,
                        list(base.output_token_ids) + list(drafts[:i]), base.eos_token_ids,
                        masks[i] if i < len(masks) else None)
            for i in range(len(drafts) + 1)]


def verify(sampler: Sampler, logits: torch.Tensor, base: SamplingRow, drafts: Sequence[int],
           masks: Sequence[torch.Tensor | None]) -> tuple[list[int], list[dict[int, float] | None]]:
    """logits [k + 1, V] at the request's rows; base: the row as plain sampling would build it. Returns the tokens
    to emit and, if the request asks, their logprobs."""
    rows = draft_rows(base, drafts, masks)
    if base.params.greedy:
        emitted = verify_greedy(sampler(logits, rows).token_ids, drafts)
    else:
        emitted = verify_sampled(target_probabilities(logits, rows), drafts, None, base.seed, base.position)
    if base.params.logprobs is None:
        return emitted, [None] * len(emitted)
    raw = torch.log_softmax(logits[: len(emitted)].float(), dim=-1)
    return emitted, list(logprob_dicts(raw, emitted, [base.params.logprobs] * len(emitted)))


def plan_draft_lengths(spec: SpecConfig, varlen: bool, states: Sequence[DraftState],
                       shadow_probes: bool = False, depth_costs: Sequence[float] = (),
                       free: Sequence[bool] = (), costs: RowCosts = AVX512_COSTS) -> list[int]:
    """How many tokens each of a step's sampling sequences drafts next: k each without varlen; with it, the drafts
    that raise the step's expected tokens per unit of time. The j-th draft of a sequence is accepted with the
    product of its conditional rates up to j (a^j where every position has rate a); candidates are taken best
    first while that beats the step's current tokens per unit of cost, E * (cost' - cost) / cost with E the
    expected tokens. cost = costs.step(R) for R rows on `costs`, the instruction set's model (AVX-512's: the bar is
    ~0.08 alone while the rows are memory-bound, ~0.88 inside a tile of 8-16 sequences, above 1 where a draft would
    start a new tile, ~0.97 at 32; AVX2's: ~0.13 alone, above 1 at 4, 8, ... sequences), plus
    depth_costs[j - 1] once for each draft depth j any sequence reaches (a proposer that runs once per depth, MTP:
    MTP_DEPTH_COSTS; every sequence drafting at a depth shares its cost, so the plan is made for each deepest depth
    and the best kept). A sequence left at none probes with one token now and then, less often in a bigger batch (a
    probe is a row too) and only where a success could lift it over the first draft's bar; with `shadow_probes`
    (proposers that cost nothing, n-gram) the probe is only marked (`state.probe`): the runner guesses the next
    token and checks it, spending no row. free[i]: sequence i's drafts come from elsewhere this step (the n-gram
    lookup in front of MTP), so they pay their rows but no depth cost."""
    k = spec.num_speculative_tokens
    if not varlen:
        return [k] * len(states)
    batch = len(states)
    row_cost = functools.cache(costs.step)  # the plans below ask for the same few row counts many times
    best = (0.0, [0] * batch)
    # the best candidate is some sequence's first draft; where it cannot clear the lowest bar any plan below sets
    # (the one paying every depth), nothing is drafted: skip building and sorting the candidates (a big batch's case)
    paid_all = sum(depth_costs[:k])
    cost, more = row_cost(batch) + paid_all, row_cost(batch + 1) + paid_all
    hopeless = max((st.rate(0) for st in states), default=0.0) <= batch * (more - cost) / cost
    candidates = [] if hopeless else \
        sorted((-p, j, i) for i, st in enumerate(states) for j, p in enumerate(_chain(st, k), start=1))
    for deepest in range(0 if depth_costs else k, k + 1):  # with depth costs: each deepest depth, the best plan
        paid = sum(depth_costs[:deepest])
        lengths, rows, expected = [0] * batch, batch, float(batch)
        for neg_p, j, i in candidates:
            if j > deepest and not (free and free[i]):
                continue
            cost, more = row_cost(rows) + paid, row_cost(rows + 1) + paid
            if -neg_p <= expected * (more - cost) / cost:
                break
            lengths[i] += 1
            rows, expected = rows + 1, expected - neg_p
        score = expected / (row_cost(rows) + paid)
        if score > best[0]:
            best = (score, lengths)
    lengths = best[1]
    for i, st in enumerate(states):
        if lengths[i]:
            st.idle_steps = 0
            continue
        st.idle_steps += 1
        if st.idle_steps >= PROBE_EVERY * max(1, batch // 4):
            st.idle_steps = 0
            if shadow_probes:
                st.probe = True
            elif EMA * st.rate(0) + (1 - EMA) > first_draft_bar(batch, () if free and free[i] else depth_costs,
                                                                      costs):
                lengths[i] = 1  # a probe that succeeds could make this sequence's first draft pay
    return lengths


def first_draft_bar(batch: int, depth_costs: Sequence[float] = (), costs: RowCosts = AVX512_COSTS) -> float:
    """The acceptance one sequence's single draft needs to raise tokens per unit of cost in a step of `batch`
    sequences, paying its row and the proposer's first depth: on AVX-512's model above 1 from a batch of 8 on (the
    9th row starts a tile), where probing with a real row is pure cost; on AVX2's 0.13 alone, above 1 at 4, 8, ..."""
    return batch * (costs.step(batch + 1) + (depth_costs[0] if depth_costs else 0.0)) / costs.step(batch) - batch


def _chain(state: DraftState, k: int) -> list[float]:
    """Probability that each of k drafts is accepted: the product of the conditional rates up to it."""
    return list(itertools.accumulate((state.rate(j) for j in range(k)), operator.mul))


def depth_costs(spec: SpecConfig) -> tuple[float, ...]:
    """The proposer's own cost per draft depth, 1..k (plan_draft_lengths): MTP_DEPTH_COSTS for MTP, none for n-gram."""
    if spec.speculative_method != "mtp":
        return ()
    return MTP_DEPTH_COSTS[:1] + MTP_DEPTH_COSTS[1:] * (spec.num_speculative_tokens - 1)


def record_acceptance(state: DraftState, drafted: int, accepted: int) -> None:
    """A verification's outcome: drafts before the first rejection were accepted, the rejected one observed as a
    miss, later ones not observed at all."""
    if not drafted:
        return
    rates = state.per_position
    for j in range(len(rates), drafted):
        rates.append(state.acceptance)
    for j in range(min(drafted, accepted + 1)):
        rates[j] = EMA * rates[j] + (1 - EMA) * float(j < accepted)
    for j in range(drafted, len(rates)):  # not drafted this time: back towards the prior, to be tried again
        rates[j] += RELAX * (state.acceptance - rates[j])


def check_shadow(state: DraftState, token: int) -> None:
    """A shadow probe's guess against the token the sequence sampled: one draft, accepted or not."""
    if state.shadow is not None:
        record_acceptance(state, 1, int(token == state.shadow))
        state.shadow = None


def drafts_can_pay(varlen: bool, batch: int, costs: RowCosts = AVX512_COSTS) -> bool:
    """Whether a step of `batch` sampling sequences proposes drafts at all: with fixed draft lengths (the reproducible
    mode) always, every sequence drafting k whatever its neighbours; with varlen only where a draft can pay its row
    (first_draft_bar < 1: on AVX-512's cost model every batch below 8 sequences, and from there on the ones inside
    a tile of TILE_ROWS; on AVX2's every batch but multiples of 4). Where even a draft sure to be accepted would
    cost more than it brings, the plan could only answer none: nothing is planned, looked up or probed, and MTP
    caches no K/V for decode rows (mtp_upkeep)."""
    return not varlen or first_draft_bar(batch, (), costs) < 1


def mtp_upkeep(varlen: bool, batch: int, drafting: bool) -> bool:
    """Whether MTP caches K/V for a step's decode rows (`drafting`: some sequence drafts with MTP this step). Always
    with fixed draft lengths; with varlen below a tile of sequences (TILE_ROWS), or where some sequence drafts. From a
    tile on, a draft must be accepted 0.84+ of the time to pay its row (first_draft_bar), so steps where nothing is
    drafted are the rule, and their upkeep (about a fifth of a layer's weights for every row, plus the Python around
    it) would be spent for drafts that do not come. A sequence that later drafts, the batch small again, sees no MTP
    K/V at those positions: acceptance may suffer, correctness cannot (verification is lossless)."""
    return not varlen or batch < TILE_ROWS or drafting


def looks_up(spec: SpecConfig, varlen: bool, batch: int, costs: RowCosts = AVX512_COSTS) -> bool:
    """Whether a step of `batch` sampling sequences runs the n-gram lookup in front of MTP: wherever drafts are
    proposed (drafts_can_pay; the scan of each sequence's tokens is not free in a big batch)."""
    return spec.ngram_lookup and drafts_can_pay(varlen, batch, costs)


def lookup_drafts(spec: SpecConfig, tokens: np.ndarray) -> list[int]:
    """The n-gram lookup in front of MTP (spec.ngram_lookup): up to k drafts where the sequence's last LOOKUP_MIN or
    more tokens occurred before, else none (MTP drafts then)."""
    return propose_ngram(tokens, spec.num_speculative_tokens, max(LOOKUP_MIN, spec.ngram_min), spec.ngram_max)


def ngram_drafts(spec: SpecConfig, lengths: dict[str, int], tokens: dict) -> dict[str, list[int]]:
    """n-gram drafts of the given lengths (tokens: each sequence's runner.Tokens): fixed draft lengths; with varlen
    matched_drafts plans them, shadow probes included."""
    return {rid: propose(spec, tokens[rid].as_array(), n) for rid, n in lengths.items() if n > 0}


def matched_drafts(spec: SpecConfig, tokens: Sequence[np.ndarray], matched: Sequence[dict[int, DraftState]],
                   costs: RowCosts = AVX512_COSTS) -> tuple[list[DraftState], list[list[int]]]:
    """n-gram drafts with varlen, for a step's sampling sequences (tokens: each one's known tokens; matched: its
    estimates by match length, filled here). Each sequence is planned on the estimates of the length n of its
    current match (spec/ngram.match_ngram): a draft after a 1-token match is accepted far less often than after a
    4-token one (MATCH_PRIORS), and one rate per sequence drafted rows after short matches that did not pay and too
    few after long ones. A sequence with a match that drafts nothing this step guesses its match's first draft, checked
    against the token it then samples (a shadow probe: no row spent), so a length's estimate keeps learning while it
    does not pay. Returns the estimates each sequence was planned on (the ones its verification updates) and the
    drafts."""
    found = [match_ngram(t, spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max) for t in tokens]
    states = [by.setdefault(n, DraftState(acceptance=MATCH_PRIORS.get(n, MATCH_PRIORS[0]))) if n
              else DraftState(acceptance=0.0) for (n, _), by in zip(found, matched)]  # no match: nothing to draft
    planned = plan_draft_lengths(spec, True, states, shadow_probes=True, costs=costs)
    drafts = []
    for (_, guess), state, length in zip(found, states, planned):
        state.probe = False  # every undrafted match probes (below), not only the periodic ones
        drafts.append(guess[:length])
        if not length and guess:
            state.shadow = guess[0]
    return states, drafts


def propose(spec: SpecConfig, tokens: np.ndarray, length: int) -> list[int]:
    """Drafts for a sequence whose known tokens are `tokens`."""
    if length <= 0:
        return []
    if spec.speculative_method == "ngram":
        return propose_ngram(tokens, length, spec.ngram_min, spec.ngram_max)
    raise ValueError(f"no proposer for speculative_method={spec.speculative_method!r} in the worker")
