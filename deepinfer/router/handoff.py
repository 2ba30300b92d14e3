"""Disaggregated serving in the router: a request is prefilled on a replica of the `prefill` pool, which computes the
prompt's KV and the first token and hands the KV over, then decoded on a replica of the `decode` pool, which streams
the whole answer (first token included) to the client as one ordinary OpenAI response.

    1. to a prefill replica: the request with max_tokens 1, not streamed, kv_transfer_params {"do_remote_decode": true}
       (its pool's policy picks the replica: cache-aware over the prompt's block keys)
    2. to a decode replica: the original request plus the kv_transfer_params of the prefill's answer (picked by load)

Nothing is lost on the way: a request the hand-off does not cover (n > 1, several prompts, echo, a grammar) and a
request no prefill replica could take (none in the rotation, all failed) go whole to a decode replica, which computes
the prompt itself; a hand-off whose KV never arrives is computed by the decode replica after its timeout. Each step
retries on other replicas of its pool as proxy.forward does.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.pool import Pool
from deepinfer.router.prompt import COMPLETIONS, Prompt
from deepinfer.router.router import Router
from deepinfer.server.protocol import APIError

logger = logging.getLogger("deepinfer.router")

Forward = Callable[[Request, Pool | None, str, str, bytes, Prompt | None, list[bytes]], Awaitable[Response]]


async def forward_disaggregated(forward: Forward, request: Request, router: Router, metrics: RouterMetrics,
                                path: str, body: bytes, prompt: Prompt | None, keys: list[bytes]) -> Response:
    decode = router.pools["decode"]
    data = _object(body)
    reason = unsupported(data, path)
    if reason is not None:
        metrics.handoff("whole_unsupported")
        return await forward(request, decode, "POST", path, body, prompt, [])
    try:
        answer = await forward(request, router.pools["prefill"], "POST", path, _encode(prefill_request(data)),
                               prompt, keys)
    except APIError as e:  # no prefill replica in the rotation, or every one failed
        logger.warning("no prefill replica took the request (%s); a decode replica computes the prompt", e)
        answer = None
    transfer = None
    if answer is not None and answer.status_code == 200:
        transfer = (_object(answer.body) or {}).get("kv_transfer_params")
    elif answer is not None and 400 <= answer.status_code < 500 and not _about_transfer(answer):
        return answer  # the request itself is wrong: a decode replica would refuse it the same way
    if transfer is None:
        if answer is not None:
            logger.warning("the prefill replica answered %d without a hand-off; a decode replica computes the prompt",
                           answer.status_code)
        metrics.handoff("whole_no_prefill")
        return await forward(request, decode, "POST", path, body, prompt, [])
    metrics.handoff("handed_off")
    return await forward(request, decode, "POST", path, _encode({**data, "kv_transfer_params": transfer}), None, [])


def unsupported(data: Any, path: str) -> str | None:
    """Why a request is not handed off (it goes whole to a decode replica); None: it is."""
    if not isinstance(data, dict):
        return "the body is not a JSON object"  # the replica answers the error
    if data.get("kv_transfer_params") is not None:
        return "it carries kv_transfer_params already"
    if data.get("n") not in (None, 1):
        return "n > 1"
    if any(data.get(name) is not None for name in ("so_args", "structured_outputs")) or \
            (isinstance(data.get("response_format"), dict) and data["response_format"].get("type") != "text"):
        return "structured output"
    if path == COMPLETIONS:
        p = data.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int) and len(p) != 1:
            return "several prompts"
        if data.get("echo"):
            return "echo"
    return None


def prefill_request(data: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill replica gets: the prompt and the first token only, answered whole with the hand-off."""
    out = {k: v for k, v in data.items() if k not in ("max_completion_tokens", "stream_options")}
    return out | {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}


def _about_transfer(answer: Response) -> bool:
    """A 4xx about kv_transfer_params: the replica is not a prefill engine (a deployment error, logged), not the
    client's mistake."""
    error = (_object(answer.body) or {}).get("error")
    return isinstance(error, dict) and error.get("param") == "kv_transfer_params"


def _object(raw: bytes) -> dict[str, Any] | None:
    """The JSON object in `raw`; None if it holds none."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _encode(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()
