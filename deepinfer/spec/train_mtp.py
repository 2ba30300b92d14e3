"""`deepinfer train-mtp`: a DeepSeek-style MTP draft head for a model that ships without one, by self-distillation.

1. The model writes its own training text: chat answers to seeded prompts (deepinfer, its default compute), a
   quarter greedy (what a greedy request then drafts against) and the rest sampled at temperature 0.7; generated
   in chunks while they fit in 60% of the time budget (on a slow machine, fewer answers than asked, said in the log).
2. The same deepinfer model (the compute that will verify the drafts) gives every position p its final normed
   hidden state h_p; its next-token distribution is the LM head applied to h_p.
3. One MTP layer learns to predict token p + 2 from h_p and token p + 1: row p = W_eh [norm(emb(t_{p+1})) ;
   norm(h_p)] -> a decoder layer (causal over the rows) -> norm -> the model's own (frozen) LM head restricted to
   the draft vocabulary (the corpus's most frequent tokens), trained to match the model's distribution at p + 1
   over that vocabulary. The layer is applied again to its own output for deeper drafts, exactly as drafting does:
   depth d's row p sits at position p + d - 1 and sees the depth-1 keys up to p and its own chain's deeper keys
   (the paged cache's contents at that moment), and is trained against the model at p + d. Initialised from the
   model's last decoder layer and its final norm, with W_eh passing the hidden state through; embedding and head
   stay frozen.
4. The head is written to a cache directory (spec/mtp_head.py) with its held-out agreement per depth measured on
   the generated rows.
"""
from __future__ import annotations

import inspect
import logging
import math
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("deepinfer")

TOPICS = ["the ocean", "volcanoes", "a cat", "bread baking", "the moon", "trains", "chess", "rainforests", "bees",
          "the Roman empire", "electricity", "photosynthesis", "a lighthouse", "coffee", "mountains", "the internet",
          "dinosaurs", "music theory", "gardening", "the solar system", "bicycles", "friendship", "winter",
          "recycling", "a robot", "libraries", "honey", "the desert", "clouds", "a birthday party", "sleep",
          "airplanes", "the human heart", "earthquakes", "a small bakery", "penguins", "the printing press",
          "saving money", "rivers", "an old castle", "vaccines", "the violin", "public transport", "glaciers",
          "a job interview", "owls", "the Olympic games", "solar panels", "a city park", "tea", "the stock market",
          "spiders", "a museum", "rain", "video games", "the alphabet", "a farm", "smartphones", "tigers",
          "a train station", "mathematics", "wind turbines", "a wedding", "the brain"]
TASKS = ["Explain {} to a child.", "Write a short story about {}.", "List five facts about {}.",
         "Write a poem about {}.", "What are the pros and cons of {}?", "Describe {} in detail.",
         "Give me three questions to ask about {}.", "Summarize the history of {}.", "How does {} work?",
         "Tell me something surprising about {}.", "Write a short dialogue about {}.",
         "What would the world be like without {}?", "Teach me the basics of {}.",
         "Write a letter to a friend about {}.", "What mistakes do people make about {}?",
         "Give a step-by-step guide related to {}."]
CODE = ["Write a Python function that reverses a string.", "Write a Python class for a stack with push and pop.",
        "Write a function that checks whether a number is prime.", "Write a SQL query that counts users by country.",
        "Write a Python function to compute the factorial of n.", "Write a bash script that lists large files.",
        "Write a Python function that merges two sorted lists.", "Write a JavaScript function that debounces another."]


CORPUS_CHUNK = 512  # answers generated and scored at a time
# CORPUS_SHARE: the share of the budget the corpus may take. No further chunk starts that would end past it at the
# last chunk's pace; the first chunk always runs.
CORPUS_SHARE = 0.6


@dataclass(frozen=True)
class TrainConfig:
    num_prompts: int = 3072  # answers generated (the prompt list cycled, each answer with its own seed)
    gen_tokens: int = 192
    minutes: float = 28.0  # wall-clock budget for the whole run
    max_steps: int | None = None  # optimizer steps; training stops at whichever comes first, this or the budget
    lr: float = 5e-4
    depths: int = 2  # prediction depths trained (the layer applied recursively, as drafting applies it)
    holdout: float = 0.1
    draft_vocab: int = 4096  # drafts come from the most frequent tokens of the training text (0: all)
    seed: int = 0
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be at least 1 (or None for the time budget alone), got {self.max_steps}")


@dataclass(frozen=True)
class Sample:
    ids: torch.Tensor  # [T] the prompt and the answer
    prompt_len: int
    hidden: torch.Tensor  # [T, H] the model's final normed hidden states
    top1: torch.Tensor  # [T] the model's greedy next token at each position (whole vocabulary)


def prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    texts = [task.format(topic) for topic in TOPICS for task in TASKS] + CODE * 4
    rng.shuffle(texts)
    out = []
    for text in (texts * (count // len(texts) + 1))[:count]:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(list(tokenizer(chat, add_special_tokens=False).input_ids))
    return out


def corpus(model: str | None, cfg: TrainConfig, start: float) -> tuple[list[Sample], str]:
    """Generates the answers, then runs the model over each whole sequence for its hidden states; in chunks of
    CORPUS_CHUNK answers (the greedy and sampled ones mixed as in the whole), no further chunk where it would end past
    CORPUS_SHARE of the budget at the last chunk's pace, so that training gets the rest (a slower machine trains on
    fewer answers)."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, num_threads=cfg.threads)
    seqs = prompts(llm.get_tokenizer(), cfg.num_prompts, cfg.seed)
    greedy = cfg.num_prompts // 4
    params = [SamplingParams(temperature=0.0 if i < greedy else 0.7, top_p=0.95, seq_seed=cfg.seed + i,
                             max_tokens=cfg.gen_tokens) for i in range(len(seqs))]
    order = mixed_order(len(seqs), greedy)
    made: dict[int, Sample] = {}
    for at in range(0, len(order), CORPUS_CHUNK):
        began = time.perf_counter()
        chunk = order[at : at + CORPUS_CHUNK]
        outs = llm.generate([seqs[i] for i in chunk], [params[i] for i in chunk])
        scored = teacher(llm.engine.executor.model, [(seqs[i], seqs[i] + list(o.outputs[0].token_ids))
                                                     for i, o in zip(chunk, outs)])
        made.update(zip(chunk, scored))
        now = time.perf_counter()
        if now - start + (now - began) > CORPUS_SHARE * 60 * cfg.minutes and len(made) < len(order):
            logger.warning("corpus: %d of %d answers in %.0f s; another chunk at this pace would pass %d%% of the "
                           "%g-minute budget: training on those (raise --minutes or lower --num-prompts for all)",
                           len(made), len(order), now - start, round(100 * CORPUS_SHARE), cfg.minutes)
            break
    path = llm.engine.model_path
    del llm
    return [made[i] for i in sorted(made)], path  # in prompt order: the held-out split is the same for a subset


def mixed_order(count: int, greedy: int) -> list[int]:
    """Indices 0..count-1 with the greedy ones (below `greedy`) spread evenly among the sampled ones, so that any
    leading part holds both in their overall proportion."""
    sampled = count - greedy
    return sorted(range(count), key=lambda i: (i / greedy, 0) if i < greedy else ((i - greedy) / sampled, 1))


def teacher(model, seqs: list[tuple[list[int], list[int]]]) -> list[Sample]:
    """The deepinfer model over each sequence in a scratch cache: hidden states and greedy next tokens."""
    from tqdm.auto import tqdm

    from deepinfer.layers.context import forward_context
    from deepinfer.spec.mtp import contiguous_context

    specs = [(s.num_kv_heads, s.head_dim, s.v_head_dim) for s in model.kv_cache_specs()]
    out = []
    with torch.inference_mode():
        for prompt, ids in tqdm(seqs, desc="teacher", leave=False):
            ids_t, positions = torch.tensor(ids), torch.arange(len(ids))
            with forward_context(contiguous_context(positions, specs, torch.float32)):
                hidden = model(ids_t, positions).float()
            top1 = model.compute_logits(hidden).argmax(-1)
            out.append(Sample(ids_t, len(prompt), hidden.clone(), top1.clone()))
    return out


class TrainableMTP(nn.Module):
    """The MTP layer in transformers' modules (autograd), named as the head file stores it."""

    def __init__(self, hf_model, vocab: torch.Tensor | None) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        config = hf_model.config
        h = config.hidden_size
        self.enorm, self.hnorm = LlamaRMSNorm(h, config.rms_norm_eps), LlamaRMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        with torch.no_grad():
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, h:] = torch.eye(h)
        self.block = LlamaDecoderLayer(config, layer_idx=0)
        self.block.load_state_dict(hf_model.model.layers[-1].state_dict())
        self.shared_head = nn.Module()
        self.shared_head.norm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.shared_head.norm.load_state_dict(hf_model.model.norm.state_dict())
        self.rotary = LlamaRotaryEmbedding(config)
        self.embed = hf_model.model.embed_tokens.weight.detach()
        head = hf_model.lm_head.weight.detach()
        self.vocab = vocab
        self.head = (head if vocab is None else head[vocab]).contiguous()  # the draft vocabulary's rows

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, depths: int) -> list[torch.Tensor]:
        """hidden [n, H] (h_0..h_{n-1}), tokens [n + depths - 1] (t_1..) -> per depth d, draft-vocabulary logits
        [n, V'] for t_{d+1}..t_{n+d}."""
        from transformers import DynamicCache

        n = hidden.shape[0]
        cache, states, logits = DynamicCache(), hidden, []
        cache_arg = "cache" if "cache" in inspect.signature(self.block.forward).parameters else "past_key_values"
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        eye = torch.eye(n, dtype=torch.bool)
        for d in range(depths):
            x = self.eh_proj(torch.cat((self.enorm(F.embedding(tokens[d : d + n], self.embed)),
                                        self.hnorm(states)), -1))[None]
            positions = torch.arange(d, d + n)[None]
            allowed = torch.cat([causal] + [eye] * d, dim=1)  # depth-1 keys up to p, then this chain's own
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
            out = self.block(x, attention_mask=mask, position_ids=positions, use_cache=True,
                             position_embeddings=self.rotary(x, positions), **{cache_arg: cache})
            states = self.shared_head.norm((out[0] if isinstance(out, tuple) else out)[0])
            logits.append(F.linear(states, self.head))
        return logits

    def head_tensors(self) -> dict[str, torch.Tensor]:
        skip = ("rotary",)
        return {name: p for name, p in self.named_parameters() if not name.startswith(skip)}


def draft_vocabulary(seqs: list[list[int]], vocab_size: int, size: int) -> list[int]:
    """The `size` most frequent token ids of the corpus (ties: lower id), sorted; empty when that is everything."""
    if size <= 0 or size >= vocab_size:
        return []
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))
    return sorted(order[:size])


def split_by_prompt(prompts: list[list[int]], fraction: float) -> tuple[list[int], list[int]]:
    """Held-out and training answer indices: whole prompts are held out (no answer to a held prompt trains), taken in
    order of first appearance (the first answers are greedy, as a greedy request drafts) until at least `fraction`
    of the answers are held; every answer to any other prompt trains."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    want, held = max(1, math.ceil(len(prompts) * fraction)), []
    for members in groups.values():
        if len(held) >= want:
            break
        held.extend(members)
    held_set = set(held)
    return sorted(held), [i for i in range(len(prompts)) if i not in held_set]


def _loss(mtp: TrainableMTP, s: Sample, depths: int) -> tuple[torch.Tensor, list[float]]:
    """Cross-entropy against the model's distribution over the draft vocabulary, depth d weighted 1 / d, and each
    depth's top-1 agreement with the model's greedy token on the generated rows (in order: given the chain so far
    agreed, as drafting is accepted)."""
    n = s.ids.shape[0] - depths
    logits = mtp(s.hidden[:n], s.ids[1:], depths)
    loss, hits = torch.zeros(()), []
    agreed = torch.ones(n, dtype=torch.bool)
    generated = torch.arange(n) >= s.prompt_len - 1
    for d, lg in enumerate(logits, start=1):
        with torch.no_grad():
            target = torch.softmax(F.linear(s.hidden[d : d + n], mtp.head), -1)
        loss = loss + -(target * torch.log_softmax(lg, -1)).sum(-1).mean() / d
        good = agreed & generated
        vocab_ids = lg.argmax(-1) if mtp.vocab is None else mtp.vocab[lg.argmax(-1)]
        agreed = good & (vocab_ids == s.top1[d : d + n])
        hits.append((int(agreed.sum()), int(good.sum())))
    return loss, hits


def train(model: str | None, out_dir: str | None, cfg: TrainConfig) -> str:
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from deepinfer.models.gguf_views import plain_gguf_views
    from deepinfer.spec.mtp_head import MTPHeadMeta, default_head_dir, save_head

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    samples, path = corpus(model, cfg, start)
    logger.info("corpus: %d sequences, %d tokens (%.0f s)", len(samples), sum(len(s.ids) for s in samples),
                time.perf_counter() - start)
    directory, name = os.path.split(path) if path.endswith(".gguf") else (path, None)
    with plain_gguf_views():
        hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    hf.config._attn_implementation = "sdpa"
    config = hf.config
    vocab = draft_vocabulary([s.ids.tolist() for s in samples], config.vocab_size, cfg.draft_vocab)
    mtp = TrainableMTP(hf, torch.tensor(vocab) if vocab else None)
    del hf
    held, train_idx = split_by_prompt([s.ids[: s.prompt_len].tolist() for s in samples], cfg.holdout)
    params = [p for _, p in mtp.named_parameters()]
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    deadline = start + 60 * cfg.minutes - 60  # leave a minute to evaluate and save
    steps, epoch, rng = 0, 0, random.Random(cfg.seed)
    estimate = None
    bar = tqdm(desc="train MTP", unit="seq", leave=False)
    limit = cfg.max_steps if cfg.max_steps is not None else 10**12
    while time.perf_counter() < deadline and steps < limit:
        rng.shuffle(train_idx)
        for i in train_idx:
            now = time.perf_counter()
            if now >= deadline or steps >= limit:
                break
            if steps == 20:  # cosine decay over the steps the remaining time allows at the measured pace
                estimate = min(limit, 20 + int((deadline - now) / ((now - first) / 19)))
            for group in optim.param_groups:
                group["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, steps / (estimate or 10**9))))
            loss, _ = _loss(mtp, samples[i], cfg.depths)
            optim.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            if steps == 0:
                first = time.perf_counter()
            steps += 1
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}", epoch=epoch)
        epoch += 1
    bar.close()
    if steps == 0:
        raise RuntimeError(f"the {cfg.minutes}-minute budget ran out before training began (generating and scoring "
                           f"{len(samples)} answers took {time.perf_counter() - start:.0f} s): raise --minutes or "
                           f"lower --num-prompts / --gen-tokens")
    totals = [[0, 0] for _ in range(cfg.depths)]
    with torch.no_grad():
        for i in held:
            for d, (hit, seen) in enumerate(_loss(mtp, samples[i], cfg.depths)[1]):
                totals[d][0] += hit
                totals[d][1] += seen
    agreement = [round(hit / max(seen, 1), 4) for hit, seen in totals]
    train_info = {"sequences": len(samples), "heldout_sequences": len(held),
                  "tokens": sum(len(s.ids) for s in samples), "steps": steps,
                  "epochs": epoch, "depths": cfg.depths, "seconds": round(time.perf_counter() - start, 1),
                  "heldout_top1_agreement": agreement[0], "heldout_agreement_per_depth": agreement}
    meta = MTPHeadMeta(os.path.basename(path), config.hidden_size, config.vocab_size, config.num_hidden_layers,
                       train_info, vocab)
    directory = save_head(out_dir or default_head_dir(path), mtp.head_tensors(), meta)
    logger.info("MTP head: %s (held-out agreement with the model's greedy tokens per depth %s, given the earlier "
                "depths agreed; %d steps, %.0f s)", directory, agreement, steps, train_info["seconds"])
    return directory
