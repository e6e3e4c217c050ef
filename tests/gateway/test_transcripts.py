"""A gateway run's directory: each session's transcript holds each request's new messages only (never the
history again) and the answers, in the client's own format; the report names the sessions; and no credential
of either side reaches events.jsonl, the transcripts or report.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from cerevisor_tui.contract import events as ev
from tests.conftest import until

from .conftest import chat, post, served
from .upstreams import REASONING, WORDS, FakeApi

pytestmark = pytest.mark.anyio

ANSWER = "".join(WORDS)


def _transcript(run_dir: Path, session: str) -> list[dict[str, Any]]:
    lines = (run_dir / "transcripts" / f"{session}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _said(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each record as (role or item type, its text)."""
    out = []
    for r in records:
        content = r.get("content", r.get("output", ""))
        if isinstance(content, list):
            content = "".join(block.get("text", "") for block in content if isinstance(block, dict))
        out.append((r.get("role") or r.get("type"), content))
    return out


async def test_chat_transcript_records_each_requests_new_messages_and_the_answers(tmp_path):
    run_dir = tmp_path / "run"
    async with served(sim={}, run_dir=run_dir) as s, httpx.AsyncClient(timeout=30) as client:
        history: list[dict[str, Any]] = []
        answers = []
        for text, stream in (("first question", True), ("second question", False), ("third question", True)):
            body = chat(text, system="You are terse.", history=history, stream=stream, max_tokens=5)
            answer = await post(client, s.url + "/chat/completions", body, headers={"X-Session-ID": "conv"})
            assert answer.status == 200
            said = answer.text if stream else answer.json()["choices"][0]["message"]["content"]
            answers.append(said)
            history = body["messages"][1:] + [{"role": "assistant", "content": said}]
    records = _transcript(run_dir, "conv")
    assert _said(records) == [("system", "You are terse."), ("user", "first question"), ("assistant", answers[0]),
                              ("user", "second question"), ("assistant", answers[1]),
                              ("user", "third question"), ("assistant", answers[2])]
    assert [r["turn"] for r in records] == [1, 1, 1, 2, 2, 3, 3]
    assert records[1] == {"turn": 1, "attempt": 1, "role": "user", "content": "first question"}  # as sent


async def test_a_side_request_of_the_same_session_does_not_make_the_history_recorded_again(tmp_path):
    # Claude Code sends one session id on its main conversation and on its small side requests (a title, a
    # summary): each conversation's new messages are recorded, never one's history because of the other
    run_dir = tmp_path / "run"
    async with served(sim={}, run_dir=run_dir) as s, httpx.AsyncClient(timeout=30) as client:
        headers = {"X-Session-ID": "cc"}

        async def ask(body: dict[str, Any]) -> str:
            answer = await post(client, s.url + "/chat/completions", {**body, "stream": False}, headers=headers)
            assert answer.status == 200
            return answer.json()["choices"][0]["message"]["content"]

        main: list[dict[str, Any]] = []
        for text in ("fix the bug", "now add a test"):
            body = chat(text, system="You are a coding agent.", history=main)
            main = body["messages"][1:] + [{"role": "assistant", "content": await ask(body)}]
        await ask(chat("Write a five-word title for: fix the bug", system="You write titles."))
        body = chat("and run it", system="You are a coding agent.", history=main)
        await ask(body)
    said = _said(_transcript(run_dir, "cc"))
    assert [text for role, text in said if role == "user"] == [
        "fix the bug", "now add a test", "Write a five-word title for: fix the bug", "and run it"]
    assert [text for role, text in said if role == "system"] == ["You are a coding agent.", "You write titles."]
    assert len(said) == 10


async def test_messages_transcript_in_anthropics_format(tmp_path):
    run_dir = tmp_path / "run"
    async with FakeApi() as api, served(endpoints=[{"name": "up", "kind": "hosted", "base_url": api.base_url,
                                                    "model": "up-model"}], run_dir=run_dir) as s, \
            httpx.AsyncClient(timeout=30) as client:
        first = {"role": "user", "content": [{"type": "text", "text": "hello"},
                                             {"type": "text", "text": " there", "cache_control": {"type": "ephemeral"}}]}
        body = {"model": "up-model", "max_tokens": 16, "system": [{"type": "text", "text": "Be brief."}],
                "messages": [first], "stream": True, "metadata": {"user_id": "anthropic-user"}}
        assert (await post(client, s.url + "/messages", body)).status == 200
        answer = {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}
        follow = {"role": "user", "content": "and then?"}
        assert (await post(client, s.url + "/messages", {**body, "stream": False,
                                                         "messages": [first, answer, follow]})).status == 200
    records = _transcript(run_dir, "anthropic-user")
    # Anthropic's system field first, as a message; then the messages with their content blocks, as sent
    assert records[0] == {"turn": 1, "attempt": 1, "role": "system", "content": body["system"]}
    assert records[1] == {"turn": 1, "attempt": 1, **first}
    assert _said(records) == [("system", "Be brief."), ("user", "hello there"), ("assistant", ANSWER),
                              ("user", "and then?"), ("assistant", ANSWER)]


async def test_responses_transcript_records_new_input_items_only(tmp_path):
    # Codex sends the whole input every time (store false), the answer's reasoning item among it
    run_dir = tmp_path / "run"
    async with FakeApi(reasoning=True) as api, served(endpoints=[{"name": "up", "kind": "hosted",
                                                                   "base_url": api.base_url, "model": "up-model"}],
                                                       run_dir=run_dir) as s, \
            httpx.AsyncClient(timeout=30) as client:
        first = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}
        body = {"model": "up-model", "instructions": "You are Codex.", "input": [first], "stream": True,
                "store": False, "prompt_cache_key": "codex-conv"}
        assert (await post(client, s.url + "/responses", body)).status == 200
        output = [REASONING, {"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": ANSWER}]}]
        follow = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and the dirs"}]}
        assert (await post(client, s.url + "/responses", {**body, "input": [first, *output, follow]})).status == 200
        # with previous_response_id the server keeps the history: every item sent is new
        again = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"}]}
        assert (await post(client, s.url + "/responses", {**body, "stream": False, "input": [again],
                                                          "previous_response_id": "resp_01"})).status == 200
    said = _said(_transcript(run_dir, "codex-conv"))
    assert [text for role, text in said if role == "user"] == ["list the files", "and the dirs", "thanks"]
    assert [role for role, _ in said] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert said[0] == ("system", "You are Codex.")


async def test_no_credential_reaches_the_run_directory(tmp_path, monkeypatch):
    client_key, upstream_key = "sk-client-7c1e9b2a44", "sk-upstream-3d5f7a9b11"
    monkeypatch.setenv("GW_TEAM", client_key)
    monkeypatch.setenv("UP_KEY", upstream_key)
    run_dir = tmp_path / "run"
    async with FakeApi() as api:
        endpoints = [{"name": "up", "kind": "hosted", "base_url": api.base_url, "model": "up-model",
                      "api_key_env": "UP_KEY"}]
        async with served(endpoints=endpoints, gateway={"keys_env": ["GW_TEAM"]}, run_dir=run_dir) as s, \
                httpx.AsyncClient(timeout=30) as client:
            body = {"model": "up-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            for headers in ({"Authorization": f"Bearer {client_key}"}, {"x-api-key": client_key}):
                for stream in (True, False):
                    assert (await post(client, s.url + "/messages", {**body, "stream": stream},
                                       headers=headers)).status == 200
                    assert (await post(client, s.url + "/responses", {"model": "up-model", "input": "hi",
                                                                      "stream": stream},
                                       headers=headers)).status == 200
            assert (await post(client, s.url + "/messages", body,
                               headers={"x-api-key": "sk-wrong-guess-123"})).status == 401
        assert api.seen and all(seen.headers["authorization"] == f"Bearer {upstream_key}" for seen in api.seen)
    report = json.loads((run_dir / "report.json").read_text())
    assert [(e["name"], e["source"], e["key"], e["requests"]) for e in report["sessions"]] == \
        [("gw_team", "key", "GW_TEAM", 8)]
    files = [run_dir / "events.jsonl", run_dir / "report.json", *(run_dir / "transcripts").iterdir()]
    assert len(files) == 3
    for path in files:
        text = path.read_text()
        for secret in (client_key, upstream_key, "sk-wrong-guess-123"):
            assert secret not in text, f"{secret} in {path.name}"


async def test_the_report_names_each_session(tmp_path):
    run_dir = tmp_path / "run"
    async with served(sim={}, run_dir=run_dir, gateway={"release_after_s": 0.2}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        for name in ("alpha", "beta", "alpha"):
            await post(client, s.url + "/chat/completions", chat(max_tokens=4), headers={
                "X-Session-ID": name, "User-Agent": "claude-cli/2.0.14 (external, cli)"})
    assert s.exit_code == 0  # a gateway alone ends by being stopped: that is not a failure
    report = json.loads((run_dir / "report.json").read_text())
    by_name = {e["name"]: e for e in report["sessions"]}
    assert set(by_name) == {"alpha", "beta"}
    assert by_name["alpha"]["requests"] == 2 and by_name["beta"]["requests"] == 1
    assert by_name["alpha"]["harness"] == "claude-code 2.0.14" and by_name["alpha"]["source"] == "x-session-id"
    assert by_name["alpha"]["completion_tokens"] == 8 and by_name["alpha"]["kills"] == []
    assert by_name["alpha"]["status"] == "ended"
    assert report["totals"]["sessions"] == 2 and report["agents"] == []
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["agent"] for e in events if e["event"] == "SessionOpened"] == ["alpha", "beta"]


async def test_a_resumed_gateway_run_keeps_each_sessions_figures_and_appends_to_its_transcript(tmp_path):
    """`--resume` of a gateway's run: a session that comes back goes on where it was. Its transcript gets the new
    request's messages only (not its whole history again), its requests are numbered on, and the report keeps
    what it did before."""
    run_dir = tmp_path / "run"
    history: list[dict[str, Any]] = []
    answers = []

    async def ask(s: Any, client: httpx.AsyncClient, text: str) -> None:
        nonlocal history
        body = chat(text, system="You are terse.", history=history, stream=False, max_tokens=5)
        answer = await post(client, s.url + "/chat/completions", body, headers={"X-Session-ID": "conv"})
        assert answer.status == 200
        answers.append(answer.json()["choices"][0]["message"]["content"])
        history = body["messages"][1:] + [{"role": "assistant", "content": answers[-1]}]

    async with served(sim={}, run_dir=run_dir) as s, httpx.AsyncClient(timeout=30) as client:
        for text in ("first question", "second question"):
            await ask(s, client, text)
        once = await post(client, s.url + "/chat/completions", chat("only once", stream=False),
                          headers={"X-Session-ID": "once"})
        assert once.status == 200
        await until(lambda: len(s.of(ev.AgentMeters, "conv")) == 2 and s.of(ev.AgentMeters, "once"),
                    "the requests' end")
    before, once_before = json.loads((run_dir / "report.json").read_text())["sessions"]
    assert (before["requests"], before["turns"]) == (2, 2) and before["completion_tokens"] > 0
    async with served(sim={}, run_dir=run_dir, resume=True) as s, httpx.AsyncClient(timeout=30) as client:
        await ask(s, client, "third question")
        await until(lambda: s.of(ev.AgentMeters, "conv"), "the request's end")  # noqa: B023
        [started] = s.of(ev.AgentStarted, "conv")
    assert (started.attempt, started.turn) == (3, 3)  # numbered on from the run before
    records = _transcript(run_dir, "conv")
    assert _said(records) == [("system", "You are terse."), ("user", "first question"), ("assistant", answers[0]),
                              ("user", "second question"), ("assistant", answers[1]),
                              ("user", "third question"), ("assistant", answers[2])]
    assert [r["turn"] for r in records] == [1, 1, 1, 2, 2, 3, 3]
    after, once = json.loads((run_dir / "report.json").read_text())["sessions"]
    assert (after["name"], after["requests"], after["turns"]) == ("conv", 3, 3)
    assert once == once_before and once["status"] == "ended"  # one that did not come back: as it was
    assert after["completion_tokens"] > before["completion_tokens"]
    assert after["prompt_tokens"] > before["prompt_tokens"]


async def test_a_requests_text_is_journalled_once_and_cut_at_the_cap(tmp_path):
    from cerevisor_tui.gateway.apis import MAX_RECORDED_CHARS

    run_dir = tmp_path / "run"
    big = "x" * (3 * MAX_RECORDED_CHARS)  # 192 Ki characters in one message
    async with FakeApi() as api, served(endpoints=[{"name": "up", "kind": "hosted", "base_url": api.base_url,
                                                    "model": "up-model"}], run_dir=run_dir) as s, \
            httpx.AsyncClient(timeout=60) as client:
        small = await post(client, s.url + "/chat/completions", chat("a short one", max_tokens=2, model="up-model"),
                           headers={"X-Session-ID": "conv"})
        assert small.status == 200
        answer = await post(client, s.url + "/chat/completions",
                            chat(big, max_tokens=2, model="up-model", history=[{"role": "user", "content": "a short one"},
                                                             {"role": "assistant", "content": small.text}]),
                            headers={"X-Session-ID": "conv"})
        assert answer.status == 200
        # cut where it is told: the run's subscribers (a console's socket among them) get what is written
        note = f"[cerevisor: {2 * MAX_RECORDED_CHARS:,} more characters not recorded]"
        [told] = [m for m in s.of(ev.MessageRecorded, "conv") if m.role == "user" and m.turn == 2]
        assert told.content == "x" * MAX_RECORDED_CHARS + "\n" + note
        assert told.raw == {"role": "user", "content": told.content, "cut": True}
    events = (run_dir / "events.jsonl").read_text()
    assert events.count("x" * 1000) == MAX_RECORDED_CHARS // 1000  # once, and cut: not again as its raw form
    [line] = [json.loads(x) for x in events.splitlines() if '"MessageRecorded"' in x and "x" * 100 in x]
    assert line["content"] == "x" * MAX_RECORDED_CHARS + "\n" + note and line["raw"] == {"role": "user"}
    records = _transcript(run_dir, "conv")
    assert records[0] == {"turn": 1, "attempt": 1, "role": "user", "content": "a short one"}  # as sent, whole
    cut = records[2]
    assert cut["cut"] is True and cut["content"].endswith(note) and len(cut["content"]) < MAX_RECORDED_CHARS + 100
    written = sum(f.stat().st_size for f in run_dir.rglob("*.jsonl"))
    assert written < 3 * MAX_RECORDED_CHARS  # two cut copies (the journal's and the transcript's), not 3 whole ones
