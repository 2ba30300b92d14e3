"""A request's prompt as the engine will see it: token ids, and from them the block-key chain the router matches.

The tokenizer is the served model's, loaded through models/loader; the ids are the ones Engine.tokenize and
Engine.apply_chat_template produce (tests/router check them against a replica's /tokenize), and the salt is the one
the server gives the request (its cache_salt inside its tenant's, server/auth.salted). A request the router cannot
read (bad JSON, a field the server would refuse) is routed without keys: the replica answers the error.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from deepinfer.router.policy import request_block_keys
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.auth import salted
from deepinfer.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request

logger = logging.getLogger("deepinfer.router")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]  # the first prompt's (a multi-prompt request is routed whole, by its first prompt)
    num_tokens: int  # prompt tokens of the whole request, every prompt times n: the prefill it brings
    cache_salt: str | None

    def block_keys(self, model_key: str, block_size: int) -> list[bytes]:
        return request_block_keys(self.token_ids, model_key, self.cache_salt, block_size)


class PromptReader:
    """Loads the tokenizer once (load() may run in a thread) and reads request bodies into Prompts."""

    def __init__(self) -> None:
        self.tokenizer: Any = None
        self.model_path: str | None = None

    def load(self, model: str | None) -> None:
        from deepinfer.models.loader import load_model_files, load_tokenizer

        files = load_model_files(model)
        self.tokenizer = load_tokenizer(files)
        self.model_path = files.path
        logger.info("router tokenizer: %s", files.path)

    @property
    def ready(self) -> bool:
        return self.tokenizer is not None

    def read(self, path: str, body: bytes, tenant: str | None) -> Prompt | None:
        """The prompt of a completions or chat body; None if the tokenizer is not loaded or the body is invalid."""
        if self.tokenizer is None:
            return None
        try:
            if path == CHAT:
                request = parse_request(ChatCompletionRequest, body)
                prompts = [self.chat_ids([m.as_template_input() for m in request.messages])]
            elif path == COMPLETIONS:
                request = parse_request(CompletionRequest, body)
                prompts = [self.ids(p) for p in request.prompts()]
            else:
                return None
            salt = salted(SamplingParams(cache_salt=request.cache_salt), tenant).cache_salt
        except (APIError, ValueError) as e:
            logger.debug("routing %s without keys: %s", path, e)
            return None
        if not prompts[0]:
            return None
        return Prompt(prompts[0], sum(map(len, prompts)) * (request.n or 1), salt)

    def ids(self, prompt: str | list[int]) -> list[int]:
        """Engine.tokenize."""
        return list(prompt) if isinstance(prompt, list) else list(self.tokenizer(prompt).input_ids)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Engine.apply_chat_template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)
