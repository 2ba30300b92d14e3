"""The router's failover against scripted replicas on loopback (a few lines of FastAPI each, in this process):
a replica that answers 503, one that stalls, one that dies mid-stream, none at all; and the relay's timing."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer.router.config import PoolConfig, RouterConfig
from deepinfer.router.proxy import build_router_app
from deepinfer.router.router import Router
from deepinfer.server.auth import Tenants
from deepinfer.server.replica_api import STATE_PATH
from tests.server.conftest import free_port

GAP_S = 0.4  # between two streamed events of a scripted replica


def scripted_replica(name: str, behaviour: str) -> FastAPI:
    """ok: answers; busy: 503; stall: /health and requests never answer; stream: an event every GAP_S;
    die: two events, then the connection breaks; unready: /health answers 503 (out of the rotation), requests ok."""
    app = FastAPI()
    app.state.behaviour = behaviour
    app.state.served = 0

    @app.get("/health")
    async def health() -> JSONResponse:
        if app.state.behaviour == "stall":
            await asyncio.sleep(3600)
        if app.state.behaviour == "unready":
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get(STATE_PATH)
    async def state() -> JSONResponse:
        load = dict.fromkeys(("queued_prefill_tokens", "queued_prefill_pairs", "running_requests",
                              "running_context_tokens", "waiting_requests"), 0)
        return JSONResponse({"epoch": name, "seq": 0, "snapshot": True, "added": "", "evicted": "",
                             "load": {**load, "kv_usage": 0.0}, "prefix_cache": {"queries": 0, "hits": 0},
                             "model_key": "scripted", "block_size": 16, "model_path": None})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        await request.body()
        behaviour = app.state.behaviour
        if behaviour == "stall":
            await asyncio.sleep(3600)
        if behaviour == "busy":
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503, headers={"Retry-After": "1"})
        app.state.served += 1
        if behaviour in ("ok", "unready"):
            return JSONResponse({"replica": name})

        async def events() -> AsyncIterator[str]:
            for i in range(5):
                if behaviour == "die" and i == 2:
                    raise ConnectionResetError("scripted death")
                yield f"data: {json.dumps({'replica': name, 'i': i, 't': time.monotonic()})}\n\n"
                await asyncio.sleep(GAP_S)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextlib.asynccontextmanager
async def serving(app: FastAPI, port: int) -> AsyncIterator[None]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="on"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = server.force_exit = True
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, 5)


@contextlib.asynccontextmanager
async def routed(*behaviours: str, expect_routable: int | None = None) -> AsyncIterator[tuple[str, list[FastAPI]]]:
    """Scripted replicas with these behaviours behind a router (fast probes); yields its URL and the replica apps."""
    apps = [scripted_replica(f"r{i}", b) for i, b in enumerate(behaviours)]
    ports = [free_port() for _ in apps]
    config = RouterConfig(pools=(PoolConfig("both", tuple(f"http://127.0.0.1:{p}" for p in ports)),),
                          poll_interval_s=0.1, probe_timeout_s=0.3, failed_probes=2)
    router = Router(config)
    router_port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        for app, port in zip(apps, ports):
            await stack.enter_async_context(serving(app, port))
        await stack.enter_async_context(serving(build_router_app(router), router_port))
        want = sum(b != "stall" for b in behaviours) if expect_routable is None else expect_routable
        deadline = time.monotonic() + 10
        while sum(r.routable for r in router.replicas) < want:
            assert time.monotonic() < deadline, [r.summary() for r in router.replicas]
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{router_port}", apps


def stream_events(lines: list[str]) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_a_busy_replica_is_skipped_and_the_request_retried():
    async def run() -> None:
        async with routed("busy", "ok") as (url, apps), httpx.AsyncClient(timeout=10) as http:
            for _ in range(3):
                answer = await http.post(f"{url}/v1/completions", json={"prompt": "hi"})
                assert answer.status_code == 200 and answer.json() == {"replica": "r1"}
            metrics = (await http.get(f"{url}/metrics")).text
            assert 'router_retries_total{cause="unavailable",pool="both",replica="http://127.0.0.1:' in metrics

    asyncio.run(run())


def test_when_every_replica_refuses_the_client_gets_their_answer():
    async def run() -> None:
        async with routed("busy", "busy") as (url, _), httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(f"{url}/v1/completions", json={"prompt": "hi"})
            assert answer.status_code == 503 and answer.headers["retry-after"] == "1"

    asyncio.run(run())


def test_a_stalled_replica_leaves_the_rotation_and_its_requests_are_retried():
    async def run() -> None:
        async with routed("ok", "ok") as (url, apps), httpx.AsyncClient(timeout=30) as http:
            apps[0].state.behaviour = "stall"  # requests hang, probes time out: down after 2 x 0.3 s
            started = time.monotonic()
            answers = await asyncio.gather(*(http.post(f"{url}/v1/completions", json={"prompt": "hi"})
                                             for _ in range(4)))
            assert [a.json() for a in answers] == [{"replica": "r1"}] * 4
            assert time.monotonic() - started < 5
            state = (await http.get(f"{url}/router/state")).json()["pools"]["both"]["replicas"]
            assert [r["health"] for r in state] == ["down", "ok"]

    asyncio.run(run())


def test_a_lost_request_waits_for_a_replica_to_come_back_into_the_rotation():
    """r1 is out of the rotation (its /health answers 503) when r0, which holds the request, stalls and is taken out:
    the request waits instead of failing, and r1 serves it once its probes pass again."""
    async def run() -> None:
        async with routed("ok", "ok") as (url, apps), httpx.AsyncClient(timeout=30) as http:
            router_state = f"{url}/router/state"

            async def health() -> list[str]:
                replicas = (await http.get(router_state)).json()["pools"]["both"]["replicas"]
                return [r["health"] for r in replicas]

            apps[1].state.behaviour = "unready"
            while (await health())[1] == "ok":
                await asyncio.sleep(0.05)
            apps[0].state.behaviour = "stall"
            request = asyncio.ensure_future(http.post(f"{url}/v1/completions", json={"prompt": "hi"}))
            while (await health())[0] != "down":  # r0 left the rotation with the request: nothing is routable
                assert not request.done(), request.result().text
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            assert not request.done()
            apps[1].state.behaviour = "ok"
            answer = await request
            assert answer.status_code == 200 and answer.json() == {"replica": "r1"}

    asyncio.run(run())


def test_no_replica_answers_503_and_health_says_so():
    async def run() -> None:
        async with routed("stall", expect_routable=0) as (url, _), httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(f"{url}/v1/completions", json={"prompt": "hi"})
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_replica"
            assert (await http.get(f"{url}/health")).status_code == 503

    asyncio.run(run())


def test_a_stream_whose_replica_dies_ends_with_an_error_event_and_done():
    async def run() -> None:
        async with routed("die") as (url, _), httpx.AsyncClient(timeout=10) as http:
            async with http.stream("POST", f"{url}/v1/completions", json={"prompt": "hi", "stream": True}) as answer:
                events = stream_events([line async for line in answer.aiter_lines()])
            assert [e["i"] for e in events[:2]] == [0, 1]
            assert events[2]["error"]["code"] == "replica_lost" and events[3] == "[DONE]" and len(events) == 4
            metrics = (await http.get(f"{url}/metrics")).text
            assert 'deepinfer:router_failures_total{kind="lost_while_streaming",pool="both"} 1.0' in metrics

    asyncio.run(run())


def test_events_are_relayed_as_they_come_not_buffered():
    async def run() -> None:
        async with routed("stream") as (url, _), httpx.AsyncClient(timeout=10) as http:
            arrivals = []
            async with http.stream("POST", f"{url}/v1/completions", json={"prompt": "hi", "stream": True}) as answer:
                async for line in answer.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append((time.monotonic(), json.loads(line[6:])["t"]))
            assert len(arrivals) == 5
            # each event reaches the client long before the replica writes the next one (GAP_S later)
            assert all(received - sent < GAP_S / 2 for received, sent in arrivals)

    asyncio.run(run())


@pytest.mark.parametrize("spec,match", [("middle=http://127.0.0.1:1", "role must be one of"),
                                        ("http://127.0.0.1:1/v1", "no path"), ("ftp://x:1", "http://HOST:PORT")])
def test_bad_router_configs_are_refused(spec, match):
    from deepinfer.router.config import parse_replica

    role, url = parse_replica(spec)
    with pytest.raises(ValueError, match=match):
        PoolConfig(role, (url,))


def test_the_router_checks_api_keys_and_passes_them_on():
    seen = []

    async def run() -> None:
        apps = [scripted_replica("r0", "ok")]

        @apps[0].middleware("http")
        async def record(request, call_next):
            if request.url.path == "/v1/completions":
                seen.append(request.headers.get("authorization"))
            return await call_next(request)

        port, router_port = free_port(), free_port()
        config = RouterConfig(pools=(PoolConfig("both", (f"http://127.0.0.1:{port}",)),), poll_interval_s=0.1,
                              api_keys=(("acme", "sk-acme"),), replica_api_key="sk-acme")
        router = Router(config)
        app = build_router_app(router, Tenants.from_keys(list(config.api_keys)))
        async with serving(apps[0], port), serving(app, router_port), httpx.AsyncClient(timeout=10) as http:
            while not router.replicas[0].routable:
                await asyncio.sleep(0.05)
            url = f"http://127.0.0.1:{router_port}/v1/completions"
            assert (await http.post(url, json={"prompt": "hi"})).status_code == 401
            wrong = await http.post(url, json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
            right = await http.post(url, json={"prompt": "hi"}, headers={"Authorization": "Bearer sk-acme"})
            assert right.status_code == 200 and seen == ["Bearer sk-acme"]

    asyncio.run(run())
