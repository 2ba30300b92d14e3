"""`deepinfer train-mtp`: a DeepSeek-style MTP draft head for a model that ships without one, by self-distillation.

1. The model writes its own training text: chat answers to seeded prompts (deepinfer, its default compute).
2. The model, dense float32 in transformers, gives for every position p its final normed hidden state h_p and its
   next-token distribution (top 32 kept).
3. One MTP layer learns to predict token p + 2 from h_p and token p + 1: row p = W_eh [norm(emb(t_{p+1})) ;
   norm(h_p)] -> a decoder layer (causal over the rows) -> norm -> the model's own (frozen) LM head, trained to
   match the model's distribution at p + 1 (KL over the teacher's top tokens). Initialised from the model's last
   decoder layer and its final norm, with W_eh passing the hidden state through, so it starts as a plausible
   guesser; the embedding and head stay frozen.
4. The head is written to a cache directory (spec/mtp_head.py) with the held-out top-1 agreement measured.
"""
from __future__ import annotations

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
          "airplanes"]
TASKS = ["Explain {} to a child.", "Write a short story about {}.", "List five facts about {}.",
         "Write a poem about {}.", "What are the pros and cons of {}?", "Describe {} in detail.",
         "Give me three questions to ask about {}.", "Summarize the history of {}."]
CODE = ["Write a Python function that reverses a string.", "Write a Python class for a stack with push and pop.",
        "Write a function that checks whether a number is prime.", "Write a SQL query that counts users by country.",
        "Write a Python function to compute the factorial of n.", "Write a bash script that lists large files.",
        "Write a Python function that merges two sorted lists.", "Write a JavaScript function that debounces another."]


@dataclass(frozen=True)
class TrainConfig:
    num_prompts: int = 192
    gen_tokens: int = 192
    minutes: float = 25.0  # wall-clock budget for the whole run
    lr: float = 5e-4
    top_k: int = 32  # teacher tokens kept per position
    holdout: float = 0.1
    draft_vocab: int = 4096  # drafts come from the most frequent tokens of the training text (0: all)
    seed: int = 0
    threads: int | None = None


def prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    texts = [task.format(topic) for topic in TOPICS for task in TASKS] + CODE * 4
    rng.shuffle(texts)
    out = []
    for text in texts[:count]:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(list(tokenizer(chat, add_special_tokens=False).input_ids))
    return out


def generate_corpus(model: str | None, cfg: TrainConfig) -> tuple[list[list[int]], str]:
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, num_threads=cfg.threads)
    seqs = prompts(llm.get_tokenizer(), cfg.num_prompts, cfg.seed)
    params = [SamplingParams(temperature=0.7, top_p=0.95, seq_seed=cfg.seed + i, max_tokens=cfg.gen_tokens)
              for i in range(len(seqs))]
    outs = llm.generate(seqs, params)
    path = llm.engine.model_path
    del llm
    return [p + list(o.outputs[0].token_ids) for p, o in zip(seqs, outs)], path


class TrainableMTP(nn.Module):
    """The MTP layer in transformers' modules (autograd), named as the head file stores it."""

    def __init__(self, hf_model) -> None:
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
        self.head = hf_model.lm_head.weight.detach()

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (h_0..h_{T-1}), next_tokens [T] (t_1..t_T) -> logits [T, V] for t_2..t_{T+1}."""
        t = hidden.shape[0]
        x = self.eh_proj(torch.cat((self.enorm(F.embedding(next_tokens, self.embed)), self.hnorm(hidden)), -1))[None]
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rotary(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        return F.linear(self.shared_head.norm(out[0]), self.head)

    def head_tensors(self) -> dict[str, torch.Tensor]:
        skip = ("rotary",)
        return {name: p for name, p in self.named_parameters() if not name.startswith(skip)}


def teacher(hf_model, seqs: list[list[int]], top_k: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per sequence: hidden [T, H] after the final norm, and the top-k (ids, probabilities) of the next token."""
    from tqdm.auto import tqdm

    out = []
    with torch.no_grad():  # not inference_mode: these tensors feed the training graph
        for ids in tqdm(seqs, desc="teacher (float32)", leave=False):
            result = hf_model(torch.tensor([ids]), output_hidden_states=True)
            probs = torch.softmax(result.logits[0].float(), -1)
            top = probs.topk(top_k, dim=-1)
            out.append((result.hidden_states[-1][0].float().clone(), top.indices.clone(), top.values.clone()))
    return out


def draft_vocabulary(seqs: list[list[int]], vocab_size: int, size: int) -> list[int]:
    """The `size` most frequent token ids of the corpus (ties: lower id), sorted; empty when that is everything."""
    if size <= 0 or size >= vocab_size:
        return []
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))
    return sorted(order[:size])


def _loss(mtp: TrainableMTP, seq: list[int], hidden, top_ids, top_p) -> tuple[torch.Tensor, float]:
    """KL(teacher || MTP) over the teacher's top tokens at rows 0..T-3, and the top-1 agreement."""
    ids = torch.tensor(seq)
    logits = mtp(hidden[:-2], ids[1:-1])
    target_ids, target_p = top_ids[1:-1], top_p[1:-1]
    target_p = target_p / target_p.sum(-1, keepdim=True)
    logp = torch.log_softmax(logits, -1).gather(1, target_ids)
    loss = -(target_p * logp).sum(-1).mean()
    agree = float((logits.argmax(-1) == target_ids[:, 0]).float().mean())
    return loss, agree


def train(model: str | None, out_dir: str | None, cfg: TrainConfig) -> str:
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from deepinfer.spec.mtp_head import MTPHeadMeta, default_head_dir, save_head

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    seqs, path = generate_corpus(model, cfg)
    logger.info("corpus: %d sequences, %d tokens (%.0f s)", len(seqs), sum(map(len, seqs)), time.perf_counter() - start)
    directory, name = os.path.split(path) if path.endswith(".gguf") else (path, None)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    hf.config._attn_implementation = "sdpa"
    data = teacher(hf, seqs, cfg.top_k)
    cut = max(1, int(len(seqs) * cfg.holdout))
    train_idx, held = list(range(cut, len(seqs))), list(range(cut))
    mtp = TrainableMTP(hf)
    params = [p for n, p in mtp.named_parameters()]
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    deadline = start + 60 * cfg.minutes - 60  # leave a minute to evaluate and save
    steps, epoch, rng = 0, 0, random.Random(cfg.seed)
    estimate = max(1, len(train_idx) * 3)
    bar = tqdm(desc="train MTP", unit="seq", leave=False)
    while time.perf_counter() < deadline:
        rng.shuffle(train_idx)
        for i in train_idx:
            if time.perf_counter() >= deadline:
                break
            for group in optim.param_groups:  # cosine decay over the estimated run
                group["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, steps / estimate)))
            loss, _ = _loss(mtp, seqs[i], *data[i])
            optim.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            steps += 1
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}", epoch=epoch)
        epoch += 1
    bar.close()
    if steps == 0:
        raise RuntimeError(f"the {cfg.minutes}-minute budget ran out before training began (generating and scoring "
                           f"{len(seqs)} answers took {time.perf_counter() - start:.0f} s): raise --minutes or lower "
                           f"--num-prompts / --gen-tokens")
    with torch.no_grad():
        agreement = sum(_loss(mtp, seqs[i], *data[i])[1] for i in held) / len(held)
    train_info = {"sequences": len(seqs), "tokens": sum(map(len, seqs)), "steps": steps, "epochs": epoch,
                  "seconds": round(time.perf_counter() - start, 1), "heldout_top1_agreement": round(agreement, 4)}
    config = hf.config
    meta = MTPHeadMeta(os.path.basename(path), config.hidden_size, config.vocab_size, config.num_hidden_layers,
                       train_info, draft_vocabulary(seqs, config.vocab_size, cfg.draft_vocab))
    directory = save_head(out_dir or default_head_dir(path), mtp.head_tensors(), meta)
    logger.info("MTP head: %s (held-out top-1 agreement with the model %.3f, %d steps, %.0f s)", directory,
                agreement, steps, train_info["seconds"])
    return directory
