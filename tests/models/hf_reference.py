"""Shared helpers: tiny random transformers models and our engine on the same weights."""
from __future__ import annotations

import torch

from deepinfer import SamplingParams
from deepinfer.llm import LLM


def save_tiny_tokenizer(path, vocab_size: int) -> None:
    """A word-level tokenizer over tokens w0..w{V-1} ("w2" is EOS), enough to drive the engine."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)


def save_tiny(model_cls, config, path, seed: int = 0, shard: str | None = None):
    save_tiny_tokenizer(path, config.vocab_size)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # random init is small; widen it so logits are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    return model


def record_logits(llm: LLM) -> list[torch.Tensor]:
    """Wraps compute_logits so every sampled row's logits are kept, in call order."""
    seen: list[torch.Tensor] = []
    model = llm.engine.executor.runner.model
    original = model.compute_logits

    def wrapped(hidden):
        out = original(hidden)
        seen.append(out.detach().to("cpu", copy=True))  # the reference runs on the CPU
        return out

    model.compute_logits = wrapped
    return seen


def hf_greedy(model, prompt_ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits at each generated position (teacher-forced, float32)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        full = model(torch.tensor([ids[:-1]])).logits[0, len(prompt_ids) - 1 :]
    return ids[len(prompt_ids) :], full.float()


def ours_greedy(llm: LLM, prompts: list[list[int]], steps: int):
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def mtp_caches(layer, rows: int = 7, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An MTP layer's KV cache after its whole forward, then after `write_kv`, on the same random rows (each in a
    fresh scratch cache): the two must be equal."""
    from deepinfer.layers.context import forward_context
    from deepinfer.spec.mtp import contiguous_context

    torch.manual_seed(seed)
    hidden_size = layer.enorm.weight.shape[0]
    positions, embeds, hidden = torch.arange(rows) + 3, torch.randn(rows, hidden_size), torch.randn(rows, hidden_size)
    caches = []
    for run in (layer, layer.write_kv):
        ctx = contiguous_context(positions, {layer.cache_index: layer.cache_shape}, torch.float32)
        with torch.inference_mode(), forward_context(ctx):
            run(positions, embeds, hidden)
        caches.append(ctx.kv_caches[layer.cache_index])
    return caches
