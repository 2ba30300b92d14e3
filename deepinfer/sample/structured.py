"""Grammar-constrained sampling (regex / JSON schema / EBNF) on top of xgrammar.

The engine compiles a request's so_args once (``GrammarCompiler.compile``, safe
to call from any thread), gives each sequence a ``GrammarMatcher``, and before
each sampling step asks ``fill_masks`` which tokens every sequence may take.
xgrammar precomputes most of each mask at compile time, so a per-step fill costs
microseconds for the common states.
"""
from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Sequence

import numpy as np
import torch

from deepinfer.sample.structured_cache import CacheKey, LRUCache, canonical_key

# Any JSON object, for so_args {"schema_type": "json", "schema": None}.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# Below this many constrained rows, filling one matcher after another beats
# xgrammar's thread pool (measured: 8 cached-state rows, 10 us serial vs 100 us pooled).
_POOLED_FILL_MIN_ROWS = 16
# xgrammar errors read "[12:00:00] /project/cpp/file.cc:94: Check failed: (...) is false: <message>".
_LOG_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (?:Check failed: .*? is false: )?")


def _xgrammar() -> ModuleType:
    try:
        return importlib.import_module("xgrammar")
    except ImportError as e:
        raise ImportError(
            "structured output needs xgrammar: pip install --no-deps xgrammar 'apache-tvm-ffi>=0.1.11'"
        ) from e


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar compiled against one tokenizer; immutable, shared by any number of matchers."""

    schema_type: str
    schema_text: str | None  # canonical form, the cache key
    vocab_size: int
    backend: Any = field(repr=False)  # xgrammar.CompiledGrammar


class GrammarCompiler:
    """Compiles so_args into grammars for one tokenizer, with a bounded LRU cache.

    Invalid or unsupported schemas raise ValueError before any request is queued.
    JSON output is compact: separators ", " and ": " with no other whitespace, so
    a model cannot spend its token budget on spaces and newlines. Objects follow
    the declared property order, and an object that lists properties admits no
    others unless additionalProperties says so (OpenAI's strict mode).
    stop_token_ids defaults to the tokenizer's EOS.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        cache_size: int = 128,
        *,
        stop_token_ids: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        if stop_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is None:
                raise ValueError("the tokenizer has no eos_token_id; pass stop_token_ids")
            stop_token_ids = [eos]
        stop_token_ids = list(stop_token_ids)
        if not stop_token_ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must be a non-empty list of ids in [0, {vocab_size}), got {stop_token_ids!r}")
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._cache: LRUCache[CompiledGrammar] = LRUCache(cache_size)
        xgr = _xgrammar()
        text_info, json_info = _tokenizer_infos(xgr, tokenizer, vocab_size, stop_token_ids)
        # Our LRU replaces xgrammar's cache, which is unbounded by default.
        threads = max(1, min(8, os.cpu_count() or 1))
        self._backend = xgr.GrammarCompiler(text_info, max_threads=threads, cache_enabled=False)
        self._json_backend = xgr.GrammarCompiler(json_info, max_threads=threads, cache_enabled=False)

    def compile(self, so_args: dict[str, Any]) -> CompiledGrammar:
        """Compile {"schema_type": "regex"|"json"|"ebnf", "schema": ...}; cached by canonical schema."""
        if not isinstance(so_args, dict):
            raise ValueError(f"so_args must be a dict with 'schema_type' and 'schema', got {so_args!r}")
        key = canonical_key(so_args)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        compiled = CompiledGrammar(key[0], key[1], self.vocab_size, self._compile_backend(key))
        # Two threads may compile the same key at once; both return the first one cached.
        return self._cache.put_if_absent(key, compiled)

    @property
    def cache_len(self) -> int:
        return len(self._cache)

    def _compile_backend(self, key: CacheKey) -> Any:
        kind, text = key
        try:
            if kind == "regex":
                return self._backend.compile_regex(text)
            if kind == "ebnf":
                return self._backend.compile_grammar(text)
            return self._json_backend.compile_json_schema(
                _ANY_OBJECT_SCHEMA if text is None else text, any_whitespace=False)
        except RuntimeError as e:
            shown = text if text is None or len(text) <= 200 else text[:200] + "..."
            name = {"regex": "regex", "ebnf": "EBNF grammar", "json": "JSON schema"}[kind]
            raise ValueError(f"invalid {name} {shown!r}: {_backend_message(e)}") from None


def _backend_message(error: Exception) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[0]) if lines else type(error).__name__


def _tokenizer_infos(xgr: ModuleType, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> tuple[Any, Any]:
    """xgrammar TokenizerInfos: one for regex/EBNF, one for JSON.

    xgrammar never allows a token whose text is empty, so we blank what must
    never be sampled. Both blank every special token but the stop tokens
    (otherwise "<|im_start|>" would be allowed as literal text in a JSON string).
    The JSON one also blanks tokens holding a byte below 0x20: compact JSON
    never contains a raw control character, yet xgrammar 0.2.9 lets them into
    strings with minLength/maxLength.
    """
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    vocab = [""] * vocab_size
    for text, idx in tokenizer.get_vocab().items():
        if idx < vocab_size:
            vocab[idx] = text
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= {idx for idx, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(tok, "special", False)}
    for idx in special - set(stop_token_ids):
        if 0 <= idx < vocab_size:
            vocab[idx] = ""

    def info(encoded: list[str]) -> Any:
        return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size,
                                 stop_token_ids=stop_token_ids, add_prefix_space=detected.add_prefix_space)

    text_info = info(vocab)
    stops = set(stop_token_ids)
    json_vocab = [
        "" if idx not in stops and any(byte < 0x20 for byte in piece) else encoded
        for idx, (encoded, piece) in enumerate(zip(vocab, text_info.decoded_vocab))
    ]
    return text_info, info(json_vocab)


class GrammarMatcher:
    """One sequence's position in a grammar.

    Once the grammar has accepted a stop token it is terminated and constrains
    nothing more (allowed_mask is all True), like vLLM: a finished sequence
    samples nothing, and masks for draft positions after a drafted stop token
    are discarded by the verifier.
    """

    def __init__(self, compiled: CompiledGrammar) -> None:
        xgr = _xgrammar()
        self.compiled = compiled
        self.vocab_size = compiled.vocab_size
        self._backend = xgr.GrammarMatcher(compiled.backend)
        self._bitmask = xgr.allocate_token_bitmask(1, compiled.vocab_size)
        self._num_accepted = 0

    def allowed_mask(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens the grammar allows next; stop tokens only where it can end."""
        if self._backend.is_terminated():
            return torch.from_numpy(np.ones(self.vocab_size, dtype=np.bool_))  # numpy: no parallel fill (allows_any)
        self._backend.fill_next_token_bitmask(self._bitmask)
        return unpack_bitmask(self._bitmask, self.vocab_size)[0]

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar rejects it."""
        if not 0 <= token_id < self.vocab_size:
            return False
        accepted = bool(self._backend.accept_token(int(token_id)))
        self._num_accepted += accepted
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (a rolled-back stop token un-terminates)."""
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"num_tokens must be an integer in [0, {self._num_accepted}] (tokens accepted so far), got {num_tokens!r}")
        if num_tokens:
            self._backend.rollback(num_tokens)
            self._num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        return bool(self._backend.is_terminated())

    def jump_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces next (possibly none); not accepted yet.

        They tokenize the forced text greedily, which may differ from how the
        model's tokenizer would split it.
        """
        return [int(t) for t in self._backend.find_jump_forward_tokens()]


def fill_masks(matchers: Sequence[GrammarMatcher | None], vocab_size: int) -> torch.Tensor | None:
    """bool [len(matchers), vocab_size] of allowed next tokens; None rows (and terminated
    matchers) are all True. Returns None when no row is constrained."""
    rows = [(i, m) for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return None
    for i, matcher in rows:
        if matcher.vocab_size != vocab_size:
            raise ValueError(f"matcher {i} was compiled for vocab_size {matcher.vocab_size}, not {vocab_size}")
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)  # all ones: unconstrained
    if len(rows) >= _POOLED_FILL_MIN_ROWS:
        backends = [matcher._backend for _, matcher in rows]
        xgr.BatchGrammarMatcher().batch_fill_next_token_bitmask(backends, bitmask, [i for i, _ in rows])
    else:
        for i, matcher in rows:
            matcher._backend.fill_next_token_bitmask(bitmask, i)
    return unpack_bitmask(bitmask, vocab_size)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [N, ceil(V/32)], bit j of word k for token 32k+j -> bool [N, V].

    As little-endian bytes the words list tokens in order, least significant bit
    first, which is numpy's unpackbits (tens of times faster than torch bit ops).
    """
    as_bytes = bitmask.numpy().astype("<i4", copy=False).view(np.uint8)
    bits = np.unpackbits(as_bytes, axis=-1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)
