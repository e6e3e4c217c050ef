"""The gateway as a network service that holds, tried as an attacker would: through a raw socket (so a path goes
out as written, dots and escapes and all) and an upstream of our own that repeats credentials, answers in shapes
no API has and records what reached it (tests/gateway/hostile.py). Each test here fails on the gateway before
issue 29 and passes after: keys scrubbed from everything relayed to a client, an allow-list of client headers
upstream, one path rule before routing, sessions that belong to their key and never take an agent's name,
model names that are data, malformed input answered in the API's shape, and no console without a terminal."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.sinks.printer import Printer

from ..conftest import until
from .conftest import Served, chat, post, served
from .hostile import KEY, KEY_ENV, Hostile, body_of, deep, raw_request, status_of

pytestmark = pytest.mark.anyio

CLIENT_SECRET = "client-secret-7c1e9a5b3d"
ALICE, BOB = "sk-gw-alice-5f1d2c3b4a", "sk-gw-bob-99aa88bb77"
MESSAGES = {"model": "up-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
PWNED = "claude-\x1b]0;PWNED\x07\x1b[2J\x1b[31m"


@asynccontextmanager
async def hostile(monkeypatch: pytest.MonkeyPatch, **kwargs) -> AsyncIterator[tuple[Hostile, Served]]:
    """The hostile upstream as the run's only endpoint (hosted: refused connections are errors, not loading),
    its key the run's."""
    monkeypatch.setenv(KEY_ENV, KEY)
    async with Hostile() as up:
        endpoint = {"name": "up", "kind": "hosted", "base_url": up.base_url, "model": "up-model", "api_key_env": KEY_ENV}
        async with served(endpoints=[endpoint], **kwargs) as s:
            yield up, s


def _api_requests(up: Hostile) -> list:
    """What reached the upstream beyond the run's own monitoring."""
    return [r for r in up.seen if not r.target.endswith(("/metrics", "/health"))]


# ---- 1. secrets, both ways ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "mode", "stream"), [
    ("/chat/completions", "echo-error", True), ("/chat/completions", "echo-error", False),
    ("/chat/completions", "echo-frame", True), ("/chat/completions", "echo-stream", True),
    ("/chat/completions", "echo-whole", False), ("/messages", "echo-error", True),
    ("/messages", "echo-frame", True),
], ids=lambda v: str(v))
async def test_an_upstream_that_repeats_the_runs_key_gets_it_to_no_client(monkeypatch, path, mode, stream):
    async with hostile(monkeypatch) as (up, s), httpx.AsyncClient(timeout=30) as client:
        body = {**MESSAGES, "stream": stream, "messages": [{"role": "user", "content": mode}]}
        answer = await post(client, s.url + path, body)
        assert up.posts() and KEY in up.posts()[-1].headers["authorization"]  # it was sent the key, and said it
        assert KEY not in answer.raw.decode("utf-8", "replace"), answer.raw
        assert b"[redacted]" in answer.raw, answer.raw


async def test_a_pass_through_echo_of_the_runs_key_is_scrubbed_too(monkeypatch):
    async with hostile(monkeypatch) as (up, s), httpx.AsyncClient(timeout=30) as client:
        for method, path in (("GET", "/models"), ("POST", "/embeddings")):
            r = await client.request(method, s.url + path, json={"input": "x"} if method == "POST" else None)
            assert r.status_code == 200 and r.json()["object"] == "echo"
            assert KEY not in r.text and "[redacted]" in r.text


async def test_a_clients_credentials_never_go_upstream_only_the_allowed_headers_do(monkeypatch):
    sent = {"api-key": CLIENT_SECRET, "x-goog-api-key": CLIENT_SECRET, "openai-organization": CLIENT_SECRET,
            "openai-project": CLIENT_SECRET, "chatgpt-account-id": CLIENT_SECRET, "x-custom-token": CLIENT_SECRET,
            "authorization": f"Bearer {CLIENT_SECRET}", "cookie": f"s={CLIENT_SECRET}",
            "proxy-authorization": CLIENT_SECRET, "anthropic-version": "2023-06-01",
            "anthropic-beta": "prompt-caching-2024-07-31", "openai-beta": "assistants=v2",
            "user-agent": "claude-cli/2.0.14", "x-session-id": "who"}
    async with hostile(monkeypatch) as (up, s), httpx.AsyncClient(timeout=30) as client:
        assert (await post(client, s.url + "/chat/completions", chat(model="up-model"), headers=sent)).status == 200
        assert (await post(client, s.url + "/messages", MESSAGES, headers=sent)).status == 200
        assert (await client.get(s.url + "/models", headers=sent)).status_code == 200
        assert (await client.post(s.url + "/embeddings", json={"input": "x"}, headers=sent)).status_code == 200
    requests = _api_requests(up)
    assert len(requests) == 4
    for seen in requests:
        assert CLIENT_SECRET not in json.dumps(seen.headers), (seen.target, seen.headers)
        assert seen.headers["authorization"] == f"Bearer {KEY}"  # the run's key, and only it
        for name in ("anthropic-version", "anthropic-beta", "openai-beta", "user-agent", "x-session-id"):
            assert seen.headers[name] == sent[name], name


# ---- 2. one path rule ---------------------------------------------------------------------------------------
BYPASS = ["/v1/./chat/completions", "/v1//chat/completions", "/v1/%2e/chat/completions", "/v1/chat/./completions",
          "/v1/chat/completions/", "/v1/chat%2fcompletions", "/v1/%2E/messages", "/a/x/v1/./chat/completions",
          "/a//v1/chat/completions"]
ESCAPE = ["/v1/../admin", "/v1/%2e%2e/admin", "/v1/%2E%2E/admin", "/a/x/v1/..%2f..%2fslots%3faction%3derase",
          "/v1/models%3faction=erase", "/v1/%252e%252e/admin", "/v1/models%23x", "/v1/models%5c..%5cadmin",
          "/v1/..", "/a/x/v1/../../slots"]
CONTROL = ["/v1/%00", "/v1/models%0d%0aX-Injected:%20yes", "/v1/%1b]0;PWNED%07", "/v1/chat/completions%00"]


async def test_paths_that_bypass_the_governor_or_escape_the_base_path_are_refused_before_the_upstream(
        monkeypatch, capfd):
    body = json.dumps(chat(model="up-model")).encode()
    async with hostile(monkeypatch) as (up, s):
        for path in BYPASS + ESCAPE + CONTROL:
            method = b"POST" if "completions" in path or "messages" in path else b"GET"
            request = (method + b" " + path.encode() + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                       b"content-type: application/json\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
                       + body)
            answer = await raw_request(s.server.host, s.server.port, request)
            assert status_of(answer) == 400, (path, answer)
            error = json.loads(body_of(answer))
            message = error["error"]["message"] if "error" in error and isinstance(error["error"], dict) else ""
            assert message.startswith("cerevisor gateway: the path"), (path, error)
        assert _api_requests(up) == []  # not one reached the upstream, governed or not
        assert not s.of(ev.SessionOpened)
        # what is plain still goes: a labelled pass-through, and a governed request, each once
        for path, method in (("/a/x/v1/models", b"GET"), ("/v1/chat/completions", b"POST")):
            request = (method + b" " + path.encode() + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                       b"content-type: application/json\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
                       + body)
            assert status_of(await raw_request(s.server.host, s.server.port, request)) == 200, path
        assert [r.target for r in _api_requests(up)] == ["/v1/models", "/v1/chat/completions"]
        assert s.server.gateway.failed == 0
    assert "Traceback" not in capfd.readouterr().err


async def test_a_governed_path_takes_post_only(monkeypatch):
    async with hostile(monkeypatch) as (up, s), httpx.AsyncClient(timeout=30) as client:
        for method in ("GET", "PUT", "DELETE"):
            r = await client.request(method, s.url + "/chat/completions")
            assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]
        assert _api_requests(up) == []


# ---- 3. sessions belong to their key, and never take an agent's name ------------------------------------------
async def test_a_session_opened_under_one_key_is_never_joined_under_another(monkeypatch):
    monkeypatch.setenv("GW_ALICE", ALICE)
    monkeypatch.setenv("GW_BOB", BOB)
    async with served(sim={}, gateway={"keys_env": ["GW_ALICE", "GW_BOB"]}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        for key in (ALICE, BOB, ALICE):
            answer = await post(client, s.url + "/chat/completions", chat(),
                                headers={"x-api-key": key, "X-Session-ID": "alices-session"})
            assert answer.status == 200
        alices = s.session("alices-session")
        assert alices.key == "GW_ALICE" and alices.requests == 2
        [bobs] = [o for o in s.of(ev.SessionOpened) if o.key == "GW_BOB"]
        assert bobs.agent != "alices-session" and s.session(bobs.agent).requests == 1
        assert len(s.of(ev.AgentStarted, "alices-session")) == 2


async def test_a_session_named_like_a_workflow_agent_is_a_session_of_its_own_and_the_run_ends_cleanly():
    agents = [{"name": "a1", "prompt": "hello", "max_tokens": 4, "retries": 0}]
    async with served(agents=agents) as s, httpx.AsyncClient(timeout=30) as client:
        await until(lambda: s.of(ev.AgentFinished, "a1"), "the workflow agent a1 finished")
        answer = await post(client, s.url + "/chat/completions", chat(), headers={"X-Session-ID": "a1"})
        assert answer.status == 200
        [opened] = s.of(ev.SessionOpened)
        assert opened.agent != "a1" and opened.agent.startswith("a1")
        assert s.engine.agents["a1"].config.prompt == "hello"  # the workflow's agent is still itself
    assert s.of(ev.RunFinished), "the run ended without RunFinished"
    assert [f.status for f in s.of(ev.AgentFinished, "a1")] == ["completed"]


# ---- 4. what a client says is data ----------------------------------------------------------------------------
async def test_a_model_name_with_control_characters_is_refused_and_reaches_no_line(monkeypatch):
    out = io.StringIO()
    async with served(sim={}, gateway={"model_map": {"claude-*": "sim-model"}}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        s.engine.subscribe(Printer(out))
        chat_answer = await post(client, s.url + "/chat/completions", chat(model=PWNED))
        assert chat_answer.status == 400 and "control character" in chat_answer.json()["error"]["message"]
        messages = await post(client, s.url + "/messages", {**MESSAGES, "model": PWNED})
        assert messages.status == 400 and messages.json()["error"]["type"] == "invalid_request_error"
        assert "\x1b" not in chat_answer.raw.decode() + messages.raw.decode()
        assert (await post(client, s.url + "/chat/completions", chat(model="claude-plain"))).status == 200
        await until(lambda: s.of(ev.TurnFinished), "the plain request's turn")
    assert s.sim.requests_total == 1
    assert "\x1b" not in out.getvalue() and "\x07" not in out.getvalue()


def test_a_headless_line_escapes_whatever_a_client_or_server_says():
    out = io.StringIO()
    printer = Printer(out)
    printer(ev.SessionOpened(1.0, "s1", "x-session-id", "evil\x1b]0;PWNED\x07", "chat", "up\x1b[2J", ""))
    printer(ev.RunNotice(2.0, "server said \x1b[31mred\x1b[0m\r\nforged line", "warning"))
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text and "\r" not in text
    assert text.count("\n") == 2 and "\\x1b]0;PWNED\\x07" in text


# ---- 7. malformed input: an answer in the API's shape, never a bare 500 -----------------------------------------
async def test_malformed_requests_are_400s_in_the_apis_shape(monkeypatch, capfd):
    nested = b'{"model": "up-model", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    half_deep = json.dumps({**MESSAGES, "metadata": deep(200)}).encode()
    async with hostile(monkeypatch) as (up, s), httpx.AsyncClient(timeout=30) as client:
        for path in ("/chat/completions", "/messages", "/responses"):
            for content in (nested, half_deep):
                answer = await post(client, s.url + path, content=content)
                assert answer.status == 400, (path, answer.raw[:200])
                assert "deeper than" in json.dumps(answer.json())
        for body in ({**MESSAGES, "messages": [1, 2]}, {**MESSAGES, "messages": "hi"},
                     {**MESSAGES, "messages": [{"role": "user", "content": "hi"}, None]}):
            answer = await post(client, s.url + "/messages", body)
            assert answer.status == 400 and answer.json()["type"] == "error", answer.raw
        answer = await post(client, s.url + "/responses", {"model": "up-model", "input": [1]})
        assert answer.status == 400 and "input[0]" in answer.json()["error"]["message"]
        assert _api_requests(up) == []
        assert s.server.gateway.failed == 0
    assert "Traceback" not in capfd.readouterr().err


async def test_an_upstreams_answer_of_no_apis_shape_is_relayed_never_a_500(monkeypatch, capfd):
    async with hostile(monkeypatch) as (up, s), httpx.AsyncClient(timeout=30) as client:
        whole = await post(client, s.url + "/chat/completions", chat("string-message", stream=False, model="up-model"))
        assert whole.status == 200 and whole.json()["choices"][0]["message"] == "not an object"
        for path in ("/chat/completions", "/messages"):
            for mode in ("deep-frame", "deep-frame-5000"):  # within msgspec's depth, and past it
                body = {**MESSAGES, "stream": True, "messages": [{"role": "user", "content": mode}]}
                streamed = await post(client, s.url + path, body)
                assert streamed.status == 200 and b"hello" in streamed.raw, streamed.raw[:300]
                assert b"bottom" in streamed.raw  # the deep frame went on to the client as it came
        await until(lambda: len(s.of(ev.TurnFinished)) == 5, "five turns finished")
        assert s.server.gateway.failed == 0
    assert "Traceback" not in capfd.readouterr().err


async def test_a_workflow_agents_stream_event_nested_past_any_reader_fails_that_agent_not_the_run(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    async with Hostile() as up:
        config = validate({"endpoints": [{"name": "up", "kind": "hosted", "base_url": up.base_url, "model": "up-model",
                                          "api_key_env": KEY_ENV}],
                           "agents": [{"name": "deep", "prompt": "deep-frame-5000", "retries": 0},
                                      {"name": "plain", "prompt": "hi", "retries": 0}]})
        engine = Engine(config)
        seen: list[ev.Event] = []
        engine.subscribe(seen.append)
        with anyio.fail_after(60):
            assert await engine.run() == 1
    finished = {e.agent: e for e in seen if isinstance(e, ev.AgentFinished)}
    assert finished["plain"].status == "completed"
    assert finished["deep"].status == "failed" and "nested too deep" in finished["deep"].error
    assert any(isinstance(e, ev.RunFinished) for e in seen)


# ---- 10. no console without a terminal --------------------------------------------------------------------------
def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cerevisor_tui", *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def test_without_a_terminal_attach_and_the_console_say_so_in_one_line_and_exit_2(tmp_path):
    workflow = tmp_path / "w.toml"
    workflow.write_text('[[endpoints]]\nname = "sim"\nkind = "simulated"\n[endpoints.sim]\nspeed = 50.0\n'
                        '[[agents]]\nname = "a0"\nprompt = "hi"\nmax_tokens = 3\n')
    run_dir = tmp_path / "run"
    done = _cli("run", str(workflow), "--run-dir", str(run_dir), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for args in (("attach", str(run_dir)), ("--config", str(workflow))):
        proc = _cli(*args, cwd=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stdout == "" and "\x1b" not in proc.stderr
        assert proc.stderr.count("\n") == 1 and "needs a terminal" in proc.stderr and "--jsonl" in proc.stderr
