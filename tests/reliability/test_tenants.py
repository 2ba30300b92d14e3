"""API keys from a key file, each mapped to a tenant: both tenants are served, each tenant's prefix cache is its own
(a prompt one tenant cached is computed afresh for the other), a tenant's requests share its cache whatever
cache_salt they add, unknown keys get 401, and no key ever reaches the server's log."""
from __future__ import annotations

import httpx
import pytest

from deepinfer.server.auth import Tenants, read_key_file
from tests.reliability.conftest import auth
from tests.server.conftest import MODEL

pytestmark = pytest.mark.slow

PROMPT = [(i * 104729) % 40000 + 100 for i in range(50)]  # 50 token ids: three full blocks to cache


def cached_tokens(server, key: str, **extra) -> int:
    response = httpx.post(f"{server.url}/v1/completions", headers=auth(key), timeout=60,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, **extra})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_each_tenant_has_its_own_prefix_cache(tiny_server, tenant_keys):
    acme, globex = tenant_keys["acme"], tenant_keys["globex"]
    assert cached_tokens(tiny_server, acme) == 0
    assert cached_tokens(tiny_server, acme) == 48  # acme's own blocks
    assert cached_tokens(tiny_server, globex) == 0  # never acme's
    assert cached_tokens(tiny_server, globex) == 48
    assert cached_tokens(tiny_server, acme, cache_salt="team-a") == 0  # a salt partitions inside the tenant
    assert cached_tokens(tiny_server, acme, cache_salt="team-a") == 48


def test_unknown_keys_are_refused_and_no_key_is_logged(tiny_server, tenant_keys):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, auth("sk-unknown"), {"Authorization": tenant_keys["acme"]}, auth(tenant_keys["acme"] + "x")):
        response = httpx.post(f"{tiny_server.url}/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", response.text
        assert tenant_keys["acme"] not in response.text
    lower = {"Authorization": f"bearer {tenant_keys['globex']}"}  # the scheme is case-insensitive
    assert httpx.post(f"{tiny_server.url}/v1/completions", json=body, headers=lower, timeout=60).status_code == 200
    log = tiny_server.log()
    assert "tenant=acme" in log and "tenant=globex" in log  # requests are attributed by tenant name
    for key in tenant_keys.values():
        assert key not in log and key[-12:] not in log


def test_key_file_errors_name_the_line_never_the_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text("acme sk-secret-1\nglobex sk-secret-2 extra-field\n")
    with pytest.raises(ValueError, match=r"keys:2: expected 'TENANT KEY'") as caught:
        read_key_file(str(path))
    assert "sk-secret" not in str(caught.value)
    path.write_text("acme sk-shared\nglobex sk-shared\n")
    with pytest.raises(ValueError, match="given to two tenants") as caught:
        Tenants.load(key_file=str(path))
    assert "sk-shared" not in str(caught.value)
    path.write_text("# only comments\n\n")
    with pytest.raises(ValueError, match="holds no keys"):
        read_key_file(str(path))
    with pytest.raises(ValueError, match="tenant name"):
        Tenants.from_keys([("bad tenant!", "k")])
    both = Tenants.load(api_key="sk-single", key_file=None)
    assert both.names == ["default"] and both.tenant_of("Bearer sk-single") == "default"
