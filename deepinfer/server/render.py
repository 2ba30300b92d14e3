"""RequestOutput -> OpenAI JSON: whole responses and SSE chunks for completions and chat.

Streamed outputs are deltas (output_kind "delta": each holds only what is new), and a whole response is rendered
from the deltas joined; a renderer remembers per choice whether it has started and finished, the text offset, and
how many tokens it has sent (for usage).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from deepinfer.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer.server.responses import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatLogprobs,
    Completion, CompletionChoice, CompletionChunk, CompletionLogprobs, TokenLogprob, TopLogprob, Usage,
)


class TokenText:
    """Token id -> its text, cached (the tokenizer is only read)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._pieces: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self._tokenizer.decode([token_id])
        return text

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)


@dataclass
class _Sent:
    tokens: int = 0  # the choice's tokens sent so far
    offset: int = 0  # text_offset of the next token (completions)
    finished: bool = False
    started: bool = False


class Renderer:
    """Shared bookkeeping: choice index = prompt index * n + sequence index; usage over all prompts."""

    object_chunk: type

    def __init__(self, request_id: str, model: str, params: SamplingParams, text: TokenText,
                 body: CompletionRequest | ChatCompletionRequest) -> None:
        self.request_id, self.model, self.params, self.text = request_id, model, params, text
        self.include_usage = body.include_usage
        self.created = int(time.time())
        self._sent: dict[int, _Sent] = {}
        self._latest: dict[int, RequestOutput] = {}  # per prompt: its prompt tokens and cached tokens for usage

    # ---- streaming ------------------------------------------------------------------------
    def first_chunks(self) -> list[str]:
        return []

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[str]:
        self._latest[prompt_index] = out
        chunks = []
        for seq in out.outputs:
            index = prompt_index * self.params.n + seq.index
            sent = self._sent.setdefault(index, _Sent())
            if sent.finished:
                continue
            choice = self.delta_choice(index, out, seq, sent)
            if choice is not None:
                chunks.append(self.object_chunk(id=self.request_id, created=self.created, model=self.model,
                                                choices=[choice]).model_dump_json())
        return chunks

    def last_chunks(self) -> list[str]:
        if not self.include_usage:
            return []
        latest = list(self._latest.values())
        usage = Usage.of(prompt_tokens=sum(len(o.prompt_token_ids) for o in latest),
                         completion_tokens=sum(sent.tokens for sent in self._sent.values()),
                         cached_tokens=sum(o.num_cached_tokens for o in latest))
        return [self.object_chunk(id=self.request_id, created=self.created, model=self.model, choices=[],
                                  usage=usage).model_dump_json()]

    def delta_choice(self, index: int, out: RequestOutput, seq: CompletionOutput, sent: _Sent) -> Any:
        raise NotImplementedError

    def full_response(self, finals: list[RequestOutput]) -> str:
        """The whole response as JSON (pydantic writes a non-finite logprob as null; json.dumps would fail)."""
        raise NotImplementedError

    # ---- shared pieces ----------------------------------------------------------------------
    def _new_text(self, seq: CompletionOutput, sent: _Sent) -> str:
        sent.tokens += len(seq.token_ids)
        return seq.text

    @staticmethod
    def _new_logprobs(seq: CompletionOutput) -> list[tuple[int, TokenLogprobs]]:
        return [] if seq.logprobs is None else list(zip(seq.token_ids, seq.logprobs))

    def _finish(self, seq: CompletionOutput, sent: _Sent) -> str | None:
        if seq.finish_reason is not None:
            sent.finished = True
        return seq.finish_reason

    @staticmethod
    def usage(outputs: list[RequestOutput]) -> Usage:
        return Usage.of(
            prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
            completion_tokens=sum(len(s.token_ids) for o in outputs for s in o.outputs),
            cached_tokens=sum(o.num_cached_tokens for o in outputs),
        )


class CompletionRenderer(Renderer):
    object_chunk = CompletionChunk

    def __init__(self, request_id: str, model: str, params: SamplingParams, text: TokenText,
                 body: CompletionRequest) -> None:
        super().__init__(request_id, model, params, text, body)
        self.echo = bool(body.echo)

    def _echo(self, out: RequestOutput, sent: _Sent, logprobs: CompletionLogprobs | None) -> str:
        """The prompt's text (and its logprobs, when asked) before a choice's first token."""
        prompt_text = out.prompt if out.prompt is not None else self.text.decode(out.prompt_token_ids)
        if logprobs is not None:
            dicts = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            self._add_logprobs(logprobs, zip(out.prompt_token_ids, dicts), sent)
        sent.offset = len(prompt_text)
        return prompt_text

    def _add_logprobs(self, target: CompletionLogprobs, entries, sent: _Sent) -> None:
        for token_id, lps in entries:
            piece = self.text.piece(token_id)
            target.tokens.append(piece)
            target.token_logprobs.append(None if lps is None else lps.get(token_id))
            target.top_logprobs.append(None if lps is None else {self.text.piece(t): v for t, v in lps.items()})
            target.text_offset.append(sent.offset)
            sent.offset += len(piece)

    def _choice(self, index: int, out: RequestOutput, seq: CompletionOutput, sent: _Sent) -> CompletionChoice:
        logprobs = CompletionLogprobs() if self.params.logprobs is not None else None
        prefix = ""
        if not sent.started:
            sent.started = True
            prefix = self._echo(out, sent, logprobs) if self.echo else ""
        text = prefix + self._new_text(seq, sent)
        if logprobs is not None:
            self._add_logprobs(logprobs, self._new_logprobs(seq), sent)
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=self._finish(seq, sent),
                                stop_reason=seq.stop_reason)

    def delta_choice(self, index: int, out: RequestOutput, seq: CompletionOutput, sent: _Sent) -> Any:
        choice = self._choice(index, out, seq, sent)
        has_logprobs = choice.logprobs is not None and choice.logprobs.tokens
        return choice if choice.text or has_logprobs or choice.finish_reason else None

    def full_response(self, finals: list[RequestOutput]) -> str:
        choices = []
        for prompt_index, out in enumerate(finals):
            for seq in out.outputs:
                index = prompt_index * self.params.n + seq.index
                choices.append(self._choice(index, out, seq, _Sent()))
        return Completion(id=self.request_id, created=self.created, model=self.model, choices=choices,
                          usage=self.usage(finals)).model_dump_json()


class ChatRenderer(Renderer):
    object_chunk = ChatCompletionChunk

    def __init__(self, request_id: str, model: str, params: SamplingParams, text: TokenText,
                 body: ChatCompletionRequest) -> None:
        super().__init__(request_id, model, params, text, body)
        self.top = body.top_logprobs or 0

    def _logprobs(self, entries: list[tuple[int, TokenLogprobs]]) -> ChatLogprobs | None:
        if self.params.logprobs is None:
            return None
        content = []
        for token_id, lps in entries:
            top = [self._top(t, v) for t, v in list(lps.items())[: self.top]]  # top-N come first, best first
            piece = self.text.piece(token_id)
            content.append(TokenLogprob(token=piece, logprob=lps[token_id], bytes=list(piece.encode()),
                                        top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        piece = self.text.piece(token_id)
        return TopLogprob(token=piece, logprob=logprob, bytes=list(piece.encode()))

    def first_chunks(self) -> list[str]:
        # OpenAI opens every choice with the assistant role and empty content.
        count = self.params.n
        return [ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                    choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]
                                    ).model_dump_json() for i in range(count)]

    def delta_choice(self, index: int, out: RequestOutput, seq: CompletionOutput, sent: _Sent) -> Any:
        text = self._new_text(seq, sent)
        logprobs = self._logprobs(self._new_logprobs(seq))
        finish = self._finish(seq, sent)
        if not text and not finish and not (logprobs and logprobs.content):
            return None
        return ChatChunkChoice(index=index, delta=ChatDelta(content=text or None), logprobs=logprobs,
                               finish_reason=finish, stop_reason=seq.stop_reason)

    def full_response(self, finals: list[RequestOutput]) -> str:
        (out,) = finals
        choices = [
            ChatChoice(index=seq.index, message=AssistantMessage(content=seq.text),
                       logprobs=self._logprobs(list(zip(seq.token_ids, seq.logprobs or []))),
                       finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
            for seq in out.outputs
        ]
        return ChatCompletion(id=self.request_id, created=self.created, model=self.model, choices=choices,
                              usage=self.usage(finals)).model_dump_json()
