"""How the KV store is configured: LLM/engine keyword options, the CLI, and the server's request fields."""
from __future__ import annotations

import json

import pytest
from deepinfer.args import engine_config_from_args
from deepinfer.cli import build_parser
from deepinfer.config import EngineConfig
from deepinfer.kvstore import KVStoreConfig
from deepinfer.server.auth import Tenants, salted
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


def test_each_tenant_is_a_cache_partition_and_its_keys_share_it() -> None:
    """Two tenants, both with keys the server accepts; a tenant's two keys (rotation) share its partition."""
    tenants = Tenants.from_keys([("acme", "key-acme-1"), ("acme", "key-acme-2"), ("globex", "key-globex")])
    params = CompletionRequest(prompt="hi", cache_salt="s").sampling_params()
    acme, acme_rotated, globex = (tenants.tenant_of(f"Bearer {k}") for k in ("key-acme-1", "key-acme-2", "key-globex"))
    assert (acme, acme_rotated, globex) == ("acme", "acme", "globex")
    assert tenants.tenant_of("Bearer nope") is None and tenants.tenant_of("key-acme-1") is None
    a, a2, g = (salted(params, t).cache_salt for t in (acme, acme_rotated, globex))
    unsalted = salted(params.replace(cache_salt=None), acme).cache_salt
    assert a == a2 and len({a, g, unsalted, "s"}) == 4 and "key" not in a + g
    assert salted(params, None).cache_salt == "s"  # an open server leaves the request's own salt alone
