"""How the KV store is configured: LLM/engine keyword options, the CLI, and the server's request fields."""
from __future__ import annotations

import json

import pytest
from starlette.requests import Request

from deepinfer.args import engine_config_from_args
from deepinfer.cli import build_parser
from deepinfer.config import EngineConfig
from deepinfer.kvstore import KVStoreConfig
from deepinfer.server.api import ServerSettings, _tenant_salted
from deepinfer.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request


def test_flat_options_build_a_kv_store_config_with_memory_in_front() -> None:
    config = EngineConfig.from_kwargs(kv_store="disk,memory", kv_store_path="/kv", kv_store_memory=1 << 20,
                                      kv_ttl={"agent": 60}, kv_ttl_class="agent").kv_store
    assert config.kinds == ("memory", "disk") and config.disk_path == "/kv" and config.memory_bytes == 1 << 20
    assert config.ttl_for("agent") == 60 and config.ttl_for("chatbot") == 7 * 86400 and config.ttl_for(None) == 60
    assert EngineConfig.from_kwargs(kv_store=["redis"], kv_store_url="redis://h:1/0").kv_store.kinds == ("redis",)
    assert not EngineConfig.from_kwargs().kv_store.enabled
    whole = KVStoreConfig(kinds=("memory",))
    assert EngineConfig.from_kwargs(kv_store=whole).kv_store is whole


@pytest.mark.parametrize("options, message", [
    (dict(kv_store="tape"), "among"),
    (dict(kv_store_path="/kv"), "'disk' tier is not enabled"),
    (dict(kv_store="memory", kv_store_url="redis://h"), "'redis' tier is not enabled"),
    (dict(kv_store="disk"), "disk_path"),
    (dict(kv_store="memory", kv_ttl={"batch": 1}), "kv_ttl"),
    (dict(kv_store=KVStoreConfig(), kv_store_memory=1), "not both"),
])
def test_bad_options_are_rejected_by_name(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**options)


def test_cli_options() -> None:
    args = build_parser().parse_args([
        "generate", "--prompt", "x", "--kv-store", "memory,disk", "--kv-store", "redis", "--kv-store-path", "/kv",
        "--kv-store-url", "redis://127.0.0.1:7/0", "--kv-store-memory", "2GiB", "--kv-store-disk-capacity", "100GiB",
        "--kv-ttl", "agent=3600", "--kv-ttl-class", "agent",
    ])
    config = engine_config_from_args(args).kv_store
    assert config.kinds == ("memory", "disk", "redis") and config.memory_bytes == 2 << 30
    assert config.disk_bytes == 100 << 30 and config.ttl_for(None) == 3600
    assert not engine_config_from_args(build_parser().parse_args(["generate", "--prompt", "x"])).kv_store.enabled
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--kv-ttl", "agent"])


def test_request_fields_reach_sampling_params() -> None:
    body = {"prompt": "hi", "cache_salt": "tenant-7", "kv_ttl_class": "agent"}
    params = parse_request(CompletionRequest, json.dumps(body).encode()).sampling_params()
    assert params.cache_salt == "tenant-7" and params.kv_ttl_class == "agent"
    chat = {"messages": [{"role": "user", "content": "hi"}], "kv_ttl_class": "chatbot"}
    assert parse_request(ChatCompletionRequest, json.dumps(chat).encode()).sampling_params().kv_ttl_class == "chatbot"
    with pytest.raises(APIError, match="kv_ttl_class"):
        parse_request(CompletionRequest, json.dumps({"prompt": "hi", "kv_ttl_class": "forever"}).encode())


def _http(authorization: str | None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers})


def test_each_api_key_is_a_cache_tenant() -> None:
    params = CompletionRequest(prompt="hi", cache_salt="s").sampling_params()
    keyed = ServerSettings(served_model_names=("m",), api_key="k1")
    a = _tenant_salted(params, _http("Bearer k1"), keyed).cache_salt
    b = _tenant_salted(params, _http("Bearer k2"), keyed).cache_salt
    unsalted = _tenant_salted(params.replace(cache_salt=None), _http("Bearer k1"), keyed).cache_salt
    assert len({a, b, unsalted, "s"}) == 4 and "k1" not in a
    open_server = ServerSettings(served_model_names=("m",))
    assert _tenant_salted(params, _http("Bearer k1"), open_server).cache_salt == "s"
