"""What a replica tells its router (deepinfer/router): its load and the block keys of its prefix cache.

GET /replica/state[?since=SEQ&epoch=EPOCH] answers, once the model is loaded (503 before):

    {"epoch": str, "seq": int, "snapshot": bool,
     "added": base64, "evicted": base64,        # block keys, 16 bytes each, concatenated
     "load": {"queued_prefill_tokens", "queued_prefill_pairs", "running_requests", "running_context_tokens",
              "waiting_requests", "kv_usage"},
     "prefix_cache": {"queries": tokens looked up, "hits": tokens found},
     "model_key": str, "block_size": int, "model_path": str}

Incremental: the keys added and evicted since event SEQ of the engine's key log EPOCH (the previous answer's
"epoch" and "seq"). A snapshot ("snapshot": true, every key held in "added") when no SEQ is given, when the log no
longer holds the events after it, or when EPOCH names another log (the engine restarted). The keys are the engine's
own chain (core/prefix_cache), so a router that computes a request's chain from "model_key" and "block_size" finds
how much of it this replica holds. The query is answered on the engine thread between two steps.
"""
from __future__ import annotations

import base64
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse

from deepinfer.core.prefix_cache import DIGEST_SIZE
from deepinfer.engine.client import AsyncEngineClient, EngineNotReady

STATE_PATH = "/replica/state"


def encode_keys(keys: tuple[bytes, ...]) -> str:
    return base64.b64encode(b"".join(keys)).decode()


def decode_keys(text: str) -> tuple[bytes, ...]:
    """The inverse of encode_keys; raises ValueError on a length that is not a whole number of keys."""
    raw = base64.b64decode(text, validate=True)
    if len(raw) % DIGEST_SIZE:
        raise ValueError(f"{len(raw)} bytes of block keys is not a multiple of the key size {DIGEST_SIZE}")
    return tuple(raw[i:i + DIGEST_SIZE] for i in range(0, len(raw), DIGEST_SIZE))


def add_replica_routes(app: FastAPI, client: AsyncEngineClient, dependencies: list[Any]) -> None:
    """`dependencies`: the API's auth check, so a keyed server shows its cache keys to key holders only."""

    @app.get(STATE_PATH, dependencies=dependencies, include_in_schema=False)
    async def replica_state(since: int | None = Query(default=None, ge=0),
                            epoch: str | None = Query(default=None, max_length=64)) -> JSONResponse:
        try:
            s = await client.replica_status(since, epoch)
        except EngineNotReady as e:
            return JSONResponse({"status": "loading", "detail": str(e)}, status_code=503)
        load = {name: getattr(s, name) for name in ("queued_prefill_tokens", "queued_prefill_pairs",
                                                    "running_requests", "running_context_tokens",
                                                    "waiting_requests", "kv_usage")}
        return JSONResponse({
            "epoch": s.keys.epoch, "seq": s.keys.seq, "snapshot": s.keys.snapshot,
            "added": encode_keys(s.keys.added), "evicted": encode_keys(s.keys.evicted), "load": load,
            "prefix_cache": {"queries": s.stats.prefix_cache_queries, "hits": s.stats.prefix_cache_hits},
            "model_key": s.model_key, "block_size": s.block_size, "model_path": client.engine.model_path,
        })
