"""kv_transfer_params: what travels with a request between the proxy, a prefill engine and a decode engine.

    proxy -> prefill:  the request with max_tokens 1, not streamed, and {"do_remote_decode": true}
    prefill -> proxy:  its answer carries {"do_remote_prefill": true, "path", "num_prompt_tokens", "first_token_id",
                       "first_token_logprobs", "prompt_key", and for the direct path "remote_address", "handoff_id"}
    proxy -> decode:   the original request with that object, unchanged

The decode engine checks that its own tokens of the prompt have the same prompt_key (a digest of the model, the
cache salt and the token ids); if not, it ignores the hand-off and computes the prompt itself.
"""
from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

from deepinfer.core.prefix_cache import root_key
from deepinfer.sampling_params import SamplingParams

PATHS = ("direct", "store")
_PREFILL_FIELDS = {"do_remote_prefill", "path", "num_prompt_tokens", "first_token_id", "first_token_logprobs",
                   "prompt_key", "remote_address", "handoff_id"}


@dataclass(frozen=True)
class KVTransferParams:
    do_remote_decode: bool = False  # to a prefill engine: compute the prompt, hand its KV over
    do_remote_prefill: bool = False  # to a decode engine: the prompt was computed elsewhere
    path: str | None = None  # "direct" (pull from remote_address) or "store" (the shared KV store)
    num_prompt_tokens: int | None = None
    first_token_id: int | None = None
    first_token_logprobs: tuple[tuple[int, float], ...] | None = None  # when the request asked for logprobs
    prompt_key: str | None = None
    remote_address: str | None = None  # direct: the prefill engine's hand-off socket, tcp://HOST:PORT
    handoff_id: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> KVTransferParams:
        """Validates a request's kv_transfer_params object; raises ValueError naming the bad field."""
        if not isinstance(data, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {data!r}"[:200])
        if data.get("do_remote_decode") is True:
            if set(data) != {"do_remote_decode"}:
                raise ValueError(f"kv_transfer_params with do_remote_decode takes no other field, got {sorted(data)}")
            return cls(do_remote_decode=True)
        if data.get("do_remote_prefill") is not True:
            raise ValueError("kv_transfer_params needs do_remote_decode: true (to a prefill engine) or "
                             "do_remote_prefill: true (to a decode engine)")
        unknown = set(data) - _PREFILL_FIELDS
        if unknown:
            raise ValueError(f"kv_transfer_params has unknown field(s) {sorted(unknown)}")
        path = data.get("path")
        if path not in PATHS:
            raise ValueError(f"kv_transfer_params.path must be one of {PATHS}, got {path!r}")
        for name, least in (("num_prompt_tokens", 1), ("first_token_id", 0)):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"kv_transfer_params.{name} must be an integer >= {least}, got {value!r}")
        if not isinstance(data.get("prompt_key"), str):
            raise ValueError(f"kv_transfer_params.prompt_key must be a string, got {data.get('prompt_key')!r}")
        if path == "direct":
            address, handoff = data.get("remote_address"), data.get("handoff_id")
            if not isinstance(address, str) or not address.startswith("tcp://"):
                raise ValueError(f"kv_transfer_params.remote_address must be tcp://HOST:PORT, got {address!r}")
            if not isinstance(handoff, str) or not handoff:
                raise ValueError(f"kv_transfer_params.handoff_id must be a non-empty string, got {handoff!r}")
        return cls(do_remote_prefill=True, path=path, num_prompt_tokens=data["num_prompt_tokens"],
                   first_token_id=data["first_token_id"],
                   first_token_logprobs=_logprobs(data.get("first_token_logprobs")),
                   prompt_key=data["prompt_key"], remote_address=data.get("remote_address"),
                   handoff_id=data.get("handoff_id"))

    def to_json(self) -> dict[str, Any]:
        if self.do_remote_decode:
            return {"do_remote_decode": True}
        out = {"do_remote_prefill": True, "path": self.path, "num_prompt_tokens": self.num_prompt_tokens,
               "first_token_id": self.first_token_id, "prompt_key": self.prompt_key,
               # JSON has no infinities: a masked alternative (-inf) is left out
               "first_token_logprobs": None if self.first_token_logprobs is None
               else [[t, lp] for t, lp in self.first_token_logprobs if math.isfinite(lp)]}
        if self.path == "direct":
            out |= {"remote_address": self.remote_address, "handoff_id": self.handoff_id}
        return out


def check_request(transfer: KVTransferParams, num_prompts: int, params: SamplingParams, stream: bool) -> None:
    """What a hand-off covers: one prompt, one sequence, no prompt logprobs, no grammar (the proxy sends other requests
    whole to a decode engine). Raises ValueError naming what does not fit."""
    if num_prompts != 1:
        raise ValueError(f"kv_transfer_params needs exactly one prompt, got {num_prompts}")
    if params.n != 1:
        raise ValueError(f"kv_transfer_params needs n=1, got n={params.n}")
    if params.prompt_logprobs is not None:
        raise ValueError("kv_transfer_params cannot be combined with prompt logprobs (echo with logprobs)")
    if params.so_args is not None:
        raise ValueError("kv_transfer_params cannot be combined with structured output")
    if transfer.do_remote_decode and stream:
        raise ValueError("kv_transfer_params with do_remote_decode needs stream: false (the answer carries the "
                         "hand-off)")
    if transfer.do_remote_decode and params.max_tokens != 1:
        raise ValueError(f"kv_transfer_params with do_remote_decode needs max_tokens=1, got {params.max_tokens}")


def prompt_key(model_key: str, cache_salt: str | None, token_ids: list[int]) -> str:
    """A digest of the model, the cache salt and the prompt's token ids: equal keys, interchangeable KV."""
    h = blake2b(root_key(model_key, cache_salt), digest_size=16, person=b"deepinfer-pd")
    h.update(array("q", token_ids).tobytes())
    return h.hexdigest()


def _logprobs(value: Any) -> tuple[tuple[int, float], ...] | None:
    if value is None:
        return None
    ok = isinstance(value, list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and isinstance(p[1], (int, float)) for p in value)
    if not ok:
        raise ValueError(f"kv_transfer_params.first_token_logprobs must be [[token id, logprob], ...], "
                         f"got {value!r}"[:200])
    return tuple((int(t), float(lp)) for t, lp in value)


def request_transfer(value: dict[str, Any] | None, num_prompts: int, params: SamplingParams,
                     stream: bool) -> KVTransferParams | None:
    """A request body's kv_transfer_params, validated (None when absent); raises ValueError naming the bad field."""
    if value is None:
        return None
    transfer = KVTransferParams.from_json(value)
    check_request(transfer, num_prompts, params, stream)
    return transfer


def with_transfer_params(response_json: str, outputs: list) -> str:
    """A whole (non-streamed) response with the prefill engine's kv_transfer_params added, when it has them."""
    params = next((o.kv_transfer_params for o in outputs if getattr(o, "kv_transfer_params", None)), None)
    if params is None:
        return response_json
    return response_json[:-1] + ', "kv_transfer_params": ' + json.dumps(params) + "}"
