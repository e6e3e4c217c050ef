"""Sessions are bounded: a client key opens `max_sessions_per_key` at most (the next one's request gets 429 in its
API's shape, naming the cap), and a session idle for `forget_after_s` is forgotten: its row ends, the run lets go of
it, a later request under its name opens a new one, and the report keeps both."""

from __future__ import annotations

import json

import httpx
import pytest

from cerevisor_tui.contract import events as ev

from ..conftest import until
from .conftest import chat, post, served

pytestmark = pytest.mark.anyio


async def test_a_key_opens_its_cap_of_sessions_and_the_next_is_told_429(monkeypatch):
    monkeypatch.setenv("GW_A", "sk-a")
    monkeypatch.setenv("GW_B", "sk-b")
    async with served(gateway={"keys_env": ["GW_A", "GW_B"], "max_sessions_per_key": 2}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        url = s.url + "/chat/completions"
        a, b = {"authorization": "Bearer sk-a"}, {"authorization": "Bearer sk-b"}
        for name in ("one", "two"):
            assert (await post(client, url, chat(), headers={**a, "x-session-id": name})).status == 200
        third = await post(client, url, chat(), headers={**a, "x-session-id": "three"})
        assert third.status == 429 and third.headers["retry-after"]
        error = third.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and "max_sessions_per_key" in error["message"]
        assert "GW_A" in error["message"] and "2 sessions" in error["message"]
        anthropic = await post(client, s.url + "/messages", {"model": "sim-model", "max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"}]}, headers={"x-api-key": "sk-a", "x-session-id": "four"})
        assert anthropic.status == 429 and anthropic.json()["error"]["type"] == "rate_limit_error"
        # its open sessions go on, and another key has a cap of its own
        assert (await post(client, url, chat(), headers={**a, "x-session-id": "one"})).status == 200
        assert (await post(client, url, chat(), headers={**b, "x-session-id": "three"})).status == 200
        assert [name for name, _ in s.opened()] == ["one", "two", "three"]


async def test_an_idle_session_is_forgotten_and_its_name_opens_a_new_one(tmp_path):
    run_dir = tmp_path / "run"
    async with served(sim={}, run_dir=run_dir, gateway={"forget_after_s": 0.4, "release_after_s": 0,
                                                         "max_sessions_per_key": 1}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        url = s.url + "/chat/completions"
        first = await post(client, url, chat("first question"), headers={"x-session-id": "s"})
        assert first.status == 200
        [finished] = await until(lambda: s.of(ev.AgentFinished, "s"), "the idle session forgotten")
        assert finished.status == "completed" and finished.error.startswith("forgotten after 0.4 s")
        assert "s" not in s.engine.sessions.by_name and "s" not in s.engine.agents
        # its place is free again: the cap of one session lets another open
        assert (await post(client, url, chat(), headers={"x-session-id": "t"})).status == 200
        await until(lambda: s.engine.sessions.forgotten == 2, "the second one forgotten too")
        history = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": first.text}]
        again = await post(client, url, chat("second question", max_tokens=3, history=history),
                           headers={"x-session-id": "s"})
        assert again.status == 200
        assert [name for name, _ in s.opened()] == ["s", "t", "s"]
        # its requests numbered on: no X-Request-Id is sent twice
        ids = [started.request_id for started in s.of(ev.AgentStarted, "s")]
        assert len(ids) == 2 and len(set(ids)) == 2 and ids[1].endswith(".s.r2")
        entries = [e for e in s.engine.report.to_dict()["sessions"] if e["name"] == "s"]
        assert [(e["status"], e["requests"], e["completion_tokens"]) for e in entries] == [("ended", 1, 6),
                                                                                         ("active", 1, 3)]
        assert entries[0]["error"].startswith("forgotten after")
        assert s.engine.report.totals().sessions == 3
    # its transcript goes on after the client's last answer: what it said before is not written again
    said = [(r["role"], r["content"]) for r in
            map(json.loads, (run_dir / "transcripts" / "s.jsonl").read_text().splitlines())]
    assert said == [("user", "first question"), ("assistant", first.text), ("user", "second question"),
                    ("assistant", again.text)]
