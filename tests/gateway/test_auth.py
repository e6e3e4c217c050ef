"""Client keys (`[gateway] keys_env`): a missing or wrong key gets 401 in the API's own shape, Bearer and x-api-key
both work, the variable's name labels the session, the client's key never goes upstream (the endpoint's own
does), and a non-loopback listen without keys is a config error."""

from __future__ import annotations

import httpx
import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.config.errors import ConfigError
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.gateway import GatewayError, serve_gateway

from .conftest import chat, gateway_config, post, served
from .upstreams import FakeApi

pytestmark = pytest.mark.anyio

KEY = "sk-gw-alice-5f1d2c3b4a"
OTHER = "sk-gw-bob-99aa88bb77"


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    monkeypatch.setenv("GW_ALICE", KEY)
    monkeypatch.setenv("GW_BOB", OTHER)
    return {"keys_env": ["GW_ALICE", "GW_BOB"]}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-wrong"},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                                     {"Authorization": "Bearer"}],
                         ids=["none", "wrong-bearer", "wrong-x-api-key", "not-bearer", "longer", "empty"])
async def test_a_missing_or_wrong_key_is_a_401_in_the_apis_shape(keys, headers):
    async with served(sim={}, gateway=keys) as s, httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(), headers=headers)
        assert answer.status == 401
        error = answer.json()["error"]
        assert error["type"] == "invalid_api_key" and "keys_env" in error["message"]
        anthropic = await post(client, s.url + "/messages", {"model": "sim-model", "max_tokens": 4,
                                                             "messages": [{"role": "user", "content": "hi"}]},
                               headers=headers)
        assert anthropic.status == 401
        assert anthropic.json() == {"type": "error", "error": {"type": "authentication_error",
                                                               "message": error["message"]}}
        models = await client.get(s.url + "/models", headers=headers)
        assert models.status_code == 401  # the paths passed through are behind the key too
        assert s.sim.requests_total == 0 and not s.of(ev.SessionOpened)
        assert s.server.gateway.refused == 3


@pytest.mark.parametrize("header", ["Authorization", "x-api-key"])
async def test_bearer_and_x_api_key_are_both_accepted(keys, header):
    value = f"Bearer {KEY}" if header == "Authorization" else KEY
    async with served(sim={}, gateway=keys) as s, httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(), headers={header: value})
        assert answer.status == 200 and answer.frames[-1] == b"data: [DONE]"
        models = await client.get(s.url + "/models", headers={header: value})
        assert models.status_code == 200
        [opened] = s.of(ev.SessionOpened)
        assert (opened.agent, opened.source, opened.key) == ("gw_alice", "key", "GW_ALICE")


async def test_the_key_names_a_session_only_when_nothing_else_does(keys):
    async with served(gateway=keys) as s, httpx.AsyncClient(timeout=30) as client:
        await post(client, s.url + "/chat/completions", chat(), headers={"x-api-key": OTHER, "X-Session-ID": "mine"})
        await post(client, s.url + "/chat/completions", chat(), headers={"x-api-key": OTHER})
        assert s.opened() == [("mine", "x-session-id"), ("gw_bob", "key")]
        assert [o.key for o in s.of(ev.SessionOpened)] == ["GW_BOB", "GW_BOB"]  # the key's name is kept either way
        sessions = s.engine.report.to_dict()["sessions"]
        assert [e.get("key") for e in sessions] == ["GW_BOB", "GW_BOB"]


async def test_the_clients_key_never_goes_upstream_the_endpoints_own_does(keys, monkeypatch):
    monkeypatch.setenv("UPSTREAM_KEY", "sk-upstream-0a1b2c3d")
    async with FakeApi() as api:
        endpoints = [{"name": "up", "kind": "hosted", "base_url": api.base_url, "model": "up-model",
                      "api_key_env": "UPSTREAM_KEY"}]
        async with served(gateway=keys, endpoints=endpoints) as s, httpx.AsyncClient(timeout=30) as client:
            body = {"model": "up-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY, "Cookie": "session=secret"}):
                assert (await post(client, s.url + "/messages", body, headers=headers)).status == 200
                assert (await post(client, s.url + "/responses", {"model": "up-model", "input": "hi"},
                                   headers=headers)).status == 200
        assert len(api.seen) == 4
        for seen in api.seen:
            sent = " ".join(seen.headers.values())
            assert KEY not in sent and "secret" not in sent
            assert seen.headers["authorization"] == "Bearer sk-upstream-0a1b2c3d"
            if seen.path.endswith("/messages"):
                assert seen.headers["x-api-key"] == "sk-upstream-0a1b2c3d"  # Anthropic's header, the upstream's key
            else:
                assert "x-api-key" not in seen.headers


async def test_the_clients_key_is_not_forwarded_to_the_simulator_either(keys):
    async with served(sim={}, gateway=keys) as s, httpx.AsyncClient(timeout=30) as client:
        await post(client, s.url + "/chat/completions", chat(), headers={"x-api-key": KEY})
        [seen] = s.sim.requests
        assert seen["authorization"] is None and "x-api-key" not in seen["headers"]
        assert KEY not in repr(seen)


def test_a_non_loopback_listen_without_keys_is_a_config_error():
    base = {"endpoints": [{"name": "sim", "kind": "simulated"}]}
    for listen in ("0.0.0.0:8100", "192.168.1.20:8100", "[::]:8100"):
        with pytest.raises(ConfigError) as caught:
            validate({**base, "gateway": {"listen": listen}})
        assert caught.value.key == "gateway.listen" or "gateway" in (caught.value.key or "")
        assert "keys_env" in caught.value.problem
    for listen in ("127.0.0.1:8100", "localhost:8100", "[::1]:8100"):
        validate({**base, "gateway": {"listen": listen}})
    validate({**base, "gateway": {"listen": "0.0.0.0:8100", "keys_env": ["GW_ALICE"]}})


def test_a_key_in_keys_env_must_be_a_variables_name():
    with pytest.raises(ConfigError) as caught:
        validate({"endpoints": [{"name": "sim", "kind": "simulated"}],
                  "gateway": {"keys_env": ["sk-the-key-itself"]}})
    assert "keys_env" in (caught.value.key or "")


async def test_a_key_variable_that_is_not_set_stops_the_gateway_from_starting(monkeypatch):
    monkeypatch.delenv("GW_NOT_SET", raising=False)
    config = gateway_config(gateway={"keys_env": ["GW_NOT_SET"]})
    with pytest.raises(GatewayError, match="GW_NOT_SET is not set"):
        await serve_gateway(Engine(config), config.gateway)
