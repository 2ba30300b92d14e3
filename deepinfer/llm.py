"""Offline API in vLLM's shape: LLM(model=...).generate(prompts, params) -> list[RequestOutput].

A prompt is a string, a list of token ids, or vLLM's dict forms: TextPrompt {"prompt": str} and TokensPrompt
{"prompt_token_ids": [...]}.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence, TypedDict

from tqdm.auto import tqdm

from deepinfer.config import EngineConfig
from deepinfer.engine.engine import Engine
from deepinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer.sampling_params import SamplingParams

class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


Prompt = str | list[int] | TextPrompt | TokensPrompt
Message = dict[str, Any]


class LLM:
    """LLM() loads the bundled default model (SmolLM2-135M-Instruct); keyword arguments are engine options
    (dtype, max_model_len, block_size, kv_cache_memory, enable_prefix_caching, max_num_batched_tokens,
    max_num_seqs, enable_chunked_prefill, batch_invariant, num_threads, ...).

    raise_on_error=True gives vLLM's behaviour: generate() raises ValueError for the first invalid prompt or
    parameter and runs nothing. By default a bad request fails alone (its output has `error` set and finish_reason
    "error") and the others complete.

    skip_tokenizer_init=True (vLLM's option) is for token-id-only use: prompts must be token ids, outputs carry
    token ids and empty text (no detokenization, so no stop strings), and chat() is refused.
    """

    def __init__(self, model: str | None = None, *, raise_on_error: bool = False, skip_tokenizer_init: bool = False,
                 **engine_options: Any) -> None:
        self.engine = Engine(EngineConfig.from_kwargs(model=model, **engine_options))
        self.raise_on_error = raise_on_error
        self.skip_tokenizer_init = skip_tokenizer_init
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs come back in input order. A request with bad input fails alone: its output has
        `error` set and finish_reason "error"; the others complete (raise_on_error=True: ValueError instead)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompts, params):
            request_id = str(next(self._ids))
            ids.append(request_id)
            try:
                prompt = self._unwrap(prompt)
                self.engine.add_request(request_id, prompt, self._engine_params(p))
            except ValueError as e:
                if self.raise_on_error:
                    for added in ids:
                        self.engine.abort_request(added)
                    raise
                results[request_id] = _error_output(request_id, prompt, p, str(e))
        return self._run(ids, results, use_tqdm)

    def _unwrap(self, prompt: Any) -> str | list[int]:
        """A plain prompt from any accepted form; raises ValueError naming what is wrong."""
        if isinstance(prompt, dict):
            keys = set(prompt)
            if keys == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
            elif keys == {"prompt"}:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a dict prompt must be {{'prompt': str}} or {{'prompt_token_ids': [...]}}, got keys "
                                 f"{sorted(keys)} (multi-modal data and other fields are not supported)")
        if isinstance(prompt, tuple):
            prompt = list(prompt)
        if not isinstance(prompt, (str, list)):
            raise ValueError(f"prompt must be a string, a list of token ids, a TextPrompt or a TokensPrompt, "
                             f"got {type(prompt).__name__}")
        if isinstance(prompt, str) and self.skip_tokenizer_init:
            raise ValueError("skip_tokenizer_init=True: give prompts as token ids (a list or {'prompt_token_ids': "
                             "[...]}), not text")
        return prompt

    def _engine_params(self, params: SamplingParams) -> SamplingParams:
        """generate() returns finished outputs only, so the engine makes none before (as vLLM's LLM does)."""
        if isinstance(params, SamplingParams) and params.output_kind != "final_only":
            params = params.replace(output_kind="final_only")
        return self._without_text(params) if self.skip_tokenizer_init else params

    @staticmethod
    def _without_text(params: SamplingParams) -> SamplingParams:
        if not isinstance(params, SamplingParams) or not params.detokenize:
            return params
        if params.stop:
            raise ValueError(f"skip_tokenizer_init=True: stop strings need a tokenizer, got stop={params.stop!r}")
        return params.replace(detokenize=False)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation: with the generation prompt (a new assistant
        turn), or, with continue_final_message (vLLM's option), leaving the last assistant message open to go on."""
        if self.skip_tokenizer_init:
            raise ValueError("skip_tokenizer_init=True: chat() needs the tokenizer's chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.apply_chat_template(c, add_generation_prompt, continue_final_message)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], results: dict[str, RequestOutput], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids) - set(results)
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm or len(ids) < 2)
        bar.update(len(results))
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    @staticmethod
    def _params_list(params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params


def _error_output(request_id: str, prompt: Any, params: SamplingParams, message: str) -> RequestOutput:
    outputs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error") for i in range(getattr(params, "n", 1))]
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=list(prompt) if isinstance(prompt, list) else [],
        outputs=outputs,
        finished=True,
        metrics=RequestMetrics(arrival_time=time.time()),
        error=message,
    )
