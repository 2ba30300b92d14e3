"""`deepinfer serve`: the engine thread, the app and uvicorn, with a graceful SIGTERM drain."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from deepinfer.args import engine_config_from_args
from deepinfer.engine.client import AsyncEngineClient
from deepinfer.server.api import DEFAULT_MAX_REQUEST_BYTES, ServerSettings, build_app
from deepinfer.server.auth import Tenants

logger = logging.getLogger("deepinfer.server")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize (tenant 'default')")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="API keys, one 'TENANT KEY' line each ('#' comments); each tenant's prefix cache and KV store "
                        "entries are its own. Keys are never logged")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients pass as 'model'; the first is reported; default: the --model value")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 with Retry-After while this many sequences are waiting for the engine "
                        "(default: the KV cache's block count, at least --max-num-seqs)")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"answer 413 to a request body larger than this (default {DEFAULT_MAX_REQUEST_BYTES})")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish before aborting them")
    g.add_argument("--uvicorn-log-level", default="warning")


def run_server(args: argparse.Namespace) -> int:
    """Blocks until the server stops; 0 after a SIGTERM drain, 1 if the model failed to load."""
    from deepinfer.engine.engine import Engine

    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    config = engine_config_from_args(args, max_waiting_requests=args.max_waiting_requests)
    names = tuple(args.served_model_name or [args.model or _default_model_name()])
    tenants = Tenants.load(args.api_key, args.api_key_file)
    settings = ServerSettings(served_model_names=names, tenants=tenants, max_request_bytes=args.max_request_bytes)
    if tenants.required:
        logger.info("API keys required: %d key(s) for tenant(s) %s", len(tenants), tenants.names)
    client = AsyncEngineClient(lambda: Engine(config))
    app = build_app(client, settings)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                               timeout_graceful_shutdown=5, lifespan="on")
    server = DrainingServer(uv_config, app, client, args.drain_timeout)
    return asyncio.run(server.run_until_stopped(f"http://{_url_host(args.host)}:{args.port}"))


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM / SIGINT first drain: /health and new requests answer 503, running
    requests get up to drain_timeout to finish, the rest are aborted, then the process exits 0.
    A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, client: AsyncEngineClient, drain_timeout: float) -> None:
        super().__init__(config)
        self.app, self.client, self.drain_timeout = app, client, drain_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def run_until_stopped(self, url: str) -> int:
        self._loop = asyncio.get_running_loop()
        self.client.start()
        announce = asyncio.ensure_future(self._announce(url))
        try:
            await self.serve()
        finally:
            announce.cancel()
        return self.exit_code

    async def _announce(self, url: str) -> None:
        try:
            engine = await self.client.wait_ready()
        except Exception as e:  # noqa: BLE001 - the load error is the reason we exit
            logger.error("the model failed to load: %s", e)
            self.exit_code = 1
            self.should_exit = True
            return
        cc = engine.config.cache
        logger.info("serving %s as %s: compute %s, %d KV blocks x %d tokens, max_model_len %d, at most %d waiting "
                    "sequences, at %s/v1 (pid %d)", engine.model_path, list(self.app.state.settings.served_model_names),
                    engine.compute.name, engine.num_blocks, cc.block_size, engine.max_model_len,
                    self.client.max_waiting_requests, url, os.getpid())

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler: hand over to the loop. Not recording the signal keeps uvicorn
        # from re-raising it after shutdown, so a drained server exits 0.
        if self._drain is not None or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, name: str) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit(name))

    async def _drain_then_exit(self, name: str) -> None:
        self.app.state.draining = True
        started = time.monotonic()
        logger.info("%s: draining %d request(s), up to %.1fs", name, self.client.num_in_flight, self.drain_timeout)
        while self.client.num_in_flight and time.monotonic() - started < self.drain_timeout:
            await asyncio.sleep(0.05)
        if self.client.num_in_flight:
            logger.warning("drain timeout: aborting %d request(s)", self.client.num_in_flight)
            self.client.abort_all("aborted: the server is shutting down")
            await asyncio.sleep(0.1)  # let the aborted streams send their last event
        else:
            logger.info("drained in %.2fs", time.monotonic() - started)
        self.should_exit = True


def _default_model_name() -> str:
    from deepinfer.models.loader import DEFAULT_MODEL_FILE

    return os.path.splitext(DEFAULT_MODEL_FILE)[0]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
