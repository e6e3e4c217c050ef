"""Which session a request belongs to, through the gateway's HTTP path: each identity rule, their order, the
harness from the User-Agent, and what SessionOpened says named the session."""

from __future__ import annotations

import uuid

import httpx
import pytest

from cerevisor_tui.contract import events as ev
from cerevisor_tui.gateway.identity import harness, session_name

from .conftest import chat, post, served
from .upstreams import FakeApi

pytestmark = pytest.mark.anyio


async def _sessions_of(requests: list[tuple[str, dict, dict]], **kwargs) -> list[tuple[str, str]]:
    """Send each (path under the gateway's root, body, headers) in turn; the sessions they opened."""
    async with served(**kwargs) as s, httpx.AsyncClient(timeout=30) as client:
        for path, body, headers in requests:
            answer = await post(client, s.root + path, body, headers=headers)
            assert answer.status == 200, answer.raw
        return s.opened()


@pytest.mark.parametrize("header", ["X-Session-ID", "x-session-affinity", "session_id"])
async def test_a_session_header_names_the_session(header):
    opened = await _sessions_of([("/v1/chat/completions", chat("one"), {header: "alpha"}),
                                 ("/v1/chat/completions", chat("another conversation"), {header: "alpha"})])
    assert opened == [("alpha", header.lower())]


async def test_session_headers_are_believed_in_their_order():
    body = chat(prompt_cache_key="cache-key", user="someone")
    opened = await _sessions_of([
        ("/v1/chat/completions", body, {"session_id": "third", "x-session-affinity": "second",
                                        "X-Session-ID": "first"}),
        ("/v1/chat/completions", body, {"session_id": "third", "x-session-affinity": "second"}),
        ("/v1/chat/completions", body, {"session_id": "third"}),
    ])
    assert opened == [("first", "x-session-id"), ("second", "x-session-affinity"), ("third", "session_id")]


async def test_openai_body_fields_prompt_cache_key_then_user_then_the_fingerprint():
    opened = await _sessions_of([
        ("/v1/chat/completions", chat(prompt_cache_key="pck-1", user="u-1"), {}),
        ("/v1/chat/completions", chat(user="u-2"), {}),
        ("/v1/chat/completions", chat(), {}),
    ])
    assert opened[:2] == [("pck-1", "prompt_cache_key"), ("u-2", "user")] and opened[2][1] == "fingerprint"


async def test_the_path_label_wins_over_the_harness_own_session_id_which_is_kept_beside_it():
    """The operator's own name for a harness (`/a/NAME/v1`) names its row, whatever id the harness sends; that id
    is kept (SessionOpened.own_id: the row's note), and every request of the label lands in its one row."""
    claude_code = f"user_{'ab' * 32}_account_{uuid.uuid4()}_session_{uuid.uuid4()}"
    messages = {"model": "up-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                "metadata": {"user_id": claude_code}}
    async with FakeApi() as api, served(endpoints=[{"name": "up", "kind": "hosted", "base_url": api.base_url,
                                                    "model": "up-model"}]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        for path, body, headers in (
                ("/a/reviewer/v1/chat/completions", chat(prompt_cache_key="pck-1", model="up-model"), {"X-Session-ID": "sid-1"}),
                ("/a/reviewer/v1/chat/completions", chat("another", model="up-model"), {"X-Session-ID": "sid-2"}),
                ("/a/claude/v1/messages", messages, {})):
            assert (await post(client, s.root + path, body, headers=headers)).status == 200
        assert s.opened() == [("reviewer", "path"), ("claude", "path")]
        reviewer, claude = s.of(ev.SessionOpened)
        assert reviewer.own_id == "sid-1" and reviewer.title == ""  # its name reads as it is
        assert claude.own_id == claude_code.rsplit("_session_", 1)[1]
        assert s.session("reviewer").requests == 2


async def test_a_row_named_by_a_generated_id_shows_its_harness_a_short_id_and_what_it_is_about():
    """Claude Code's session uuid, opencode's `ses_…`: the row is called by the harness and a short id, and the
    conversation's first words (a harness's tagged context left out) and working directory go beside it."""
    session = str(uuid.uuid4())
    claude_body = {"model": "up-model", "max_tokens": 8, "system": "You are Claude Code.\n<env>\nWorking directory: "
                   "/home/me/shop/api\n</env>", "metadata": {"user_id": f"user_x_account_y_session_{session}"},
                   "messages": [{"role": "user", "content": [
                       {"type": "text", "text": "<system-reminder>\nAs you answer, use the context.\n</system-reminder>"},
                       {"type": "text", "text": "Fix the login bug in the auth module, it fails on empty passwords"}]}]}
    async with FakeApi() as api, served(endpoints=[{"name": "up", "kind": "hosted", "base_url": api.base_url,
                                                    "model": "up-model"}]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        await post(client, s.url + "/messages", claude_body, headers={"User-Agent": "claude-cli/2.0.14 (external)"})
        # opencode's first request is its title request: a lead-in, then the user's words quoted
        title_request = chat('"Name three colours."', model="up-model", system="You are a title generator.",
                             history=[{"role": "user", "content": "Generate a title for this conversation:\n"}])
        await post(client, s.url + "/chat/completions", title_request,
                   headers={"User-Agent": "opencode/1.0.2", "X-Session-ID": "ses_dca4bc70bffe1A2b3C4d5E6f7G"})
        claude, opencode = s.of(ev.SessionOpened)
    assert claude.agent == session and claude.title == f"claude-code {session[:8]}"
    assert claude.topic == '"Fix the login bug in the auth module,…" · in …/shop/api'
    assert opencode.title == "opencode dca4bc70" and opencode.topic == '"Name three colours."'


async def test_aider_is_known_by_its_own_words():
    """aider speaks through litellm and the openai SDK, whose User-Agent is all it sends; its files' context, said
    as the user in every request, tells it (as captured from aider 0.86 against a dumping server)."""
    aider = chat("Name three colours.", history=[
        {"role": "user", "content": "I am not sharing any files that you can edit yet."},
        {"role": "assistant", "content": "Ok."}])
    async with served(run={"max_concurrency": 8}) as s, httpx.AsyncClient(timeout=30) as client:
        for body in (aider, chat("plain script")):
            await post(client, s.url + "/chat/completions", body, headers={"User-Agent": "OpenAI/Python 2.20.0"})
        opened = s.of(ev.SessionOpened)
        assert [o.harness for o in opened] == ["aider", "openai-python 2.20.0"]
        assert opened[0].topic == '"Name three colours."'  # its request, not the worked example it opens with


async def test_a_path_label_names_the_session_and_the_request_still_goes_through():
    async with served(sim={}) as s, httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.root + "/a/reviewer/v1/chat/completions", chat(max_tokens=4))
        assert answer.status == 200
        assert len([d for d in answer.data if d["choices"] and d["choices"][0]["delta"].get("content")]) == 4
        assert s.opened() == [("reviewer", "path")]
        assert s.sim.requests_total == 1  # the label is the gateway's: the server got /v1/chat/completions


async def test_a_path_label_with_an_unsafe_name_is_made_a_plain_one():
    opened = await _sessions_of([("/a/team%20one%2F..%2Fx/v1/chat/completions", chat(), {})])
    [(name, source)] = opened
    assert source == "path"
    assert "/" not in name and " " not in name and not name.startswith(".")


async def test_anthropic_metadata_user_id_names_the_session_claude_code_form_too():
    session = str(uuid.uuid4())
    claude_code = f"user_{'ab' * 32}_account_{uuid.uuid4()}_session_{session}"
    body = {"model": "up-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    async with FakeApi() as api, served(endpoints=[{"name": "up", "kind": "hosted", "base_url": api.base_url,
                                                    "model": "up-model"}]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        for metadata in ({"user_id": claude_code}, {"user_id": "plain-user"}):
            assert (await post(client, s.url + "/messages", {**body, "metadata": metadata})).status == 200
        # prompt_cache_key and user are OpenAI's: in a messages request they name nothing
        await post(client, s.url + "/messages", {**body, "user": "not-anthropic", "prompt_cache_key": "no"})
        opened = s.opened()
    assert opened[0] == (session, "metadata.user_id")
    assert opened[1] == ("plain-user", "metadata.user_id")
    assert opened[2][1] == "fingerprint"


async def test_a_named_key_names_the_session(monkeypatch):
    monkeypatch.setenv("GW_KEY_ALICE", "sk-alice-0123456789")
    monkeypatch.setenv("GW_KEY_BOB", "sk-bob-9876543210")
    async with served(gateway={"keys_env": ["GW_KEY_ALICE", "GW_KEY_BOB"]}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        for key in ("sk-bob-9876543210", "sk-alice-0123456789"):
            for text in ("one conversation", "another"):
                answer = await post(client, s.url + "/chat/completions", chat(text),
                                    headers={"Authorization": f"Bearer {key}"})
                assert answer.status == 200
        # a path label is believed before the key
        await post(client, s.root + "/a/labelled/v1/chat/completions", chat(),
                   headers={"Authorization": "Bearer sk-bob-9876543210"})
        assert s.opened() == [("gw_key_bob", "key"), ("gw_key_alice", "key"), ("labelled", "path")]
        assert [o.key for o in s.of(ev.SessionOpened)] == ["GW_KEY_BOB", "GW_KEY_ALICE", "GW_KEY_BOB"]


async def test_fingerprint_puts_every_turn_of_a_conversation_in_one_row():
    first = chat("write a parser", system="You are a coder.")
    second = chat("now test it", system="You are a coder.",
                  history=[{"role": "user", "content": "write a parser"}, {"role": "assistant", "content": "done"}])
    other = chat("write a poem", system="You are a coder.")
    other_system = chat("write a parser", system="You are a poet.")
    other_model = chat("write a parser", system="You are a coder.", model="sim-model-2")
    async with served(gateway={"model_map": {"sim-model-2": "sim-model"}}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        for body in (first, second, other, other_system, other_model):
            assert (await post(client, s.url + "/chat/completions", body)).status == 200
        opened = s.opened()
        assert [source for _, source in opened] == ["fingerprint"] * 4
        assert len({name for name, _ in opened}) == 4
        row = opened[0][0]
        assert s.session(row).requests == 2
        assert len(s.of(ev.SessionOpened)) == 4


async def test_a_long_first_message_is_fingerprinted_by_its_prefix_and_length():
    """A harness that pastes a file into its first message: every turn lands in one row (its first 4 KiB and its
    length are hashed, not the whole file), and two files that share their first 4 KiB are two rows."""
    pasted = "x" * 5000 + " read this file"
    first = chat(pasted, system="You are a coder.")
    second = chat("now test it", system="You are a coder.",
                  history=[{"role": "user", "content": pasted}, {"role": "assistant", "content": "done"}])
    longer = chat(pasted + " and that one", system="You are a coder.")
    async with served() as s, httpx.AsyncClient(timeout=30) as client:
        for body in (first, second, longer):
            assert (await post(client, s.url + "/chat/completions", body)).status == 200
        opened = s.opened()
        assert [source for _, source in opened] == ["fingerprint"] * 2
        assert s.session(opened[0][0]).requests == 2


def test_a_short_first_messages_fingerprint_is_the_one_earlier_runs_named_its_session_by():
    """A resumed run finds a fingerprinted session under the name its journal has (hashed whole, as before)."""
    import hashlib

    from cerevisor_tui.gateway.apis import fingerprint
    assert fingerprint("m", "sys", [{"role": "user", "content": "hi"}]) == \
        hashlib.sha256(b"m\0sys\0hi").hexdigest()[:10]


async def test_harness_is_named_from_the_user_agent():
    async with served(run={"max_concurrency": 8}) as s, httpx.AsyncClient(timeout=30) as client:
        for i, ua in enumerate(("claude-cli/2.0.14 (external, cli)", "codex_cli_rs/0.46.0 (Linux; x86_64)",
                                "OpenAI/Python 1.99.0", "my agent/3")):
            await post(client, s.url + "/chat/completions", chat(), headers={"User-Agent": ua,
                                                                             "X-Session-ID": f"s{i}"})
        await post(client, s.url + "/chat/completions", chat(), headers={"X-Session-ID": "s9"})
        assert [o.harness for o in s.of(ev.SessionOpened)] == [
            "claude-code 2.0.14", "codex 0.46.0", "openai-python 1.99.0", "my", f"httpx {httpx.__version__}"]


def test_session_name_keeps_plain_ids_and_hashes_the_rest():
    assert session_name("alpha") == "alpha"
    assert session_name("  alpha ") == "alpha"
    long_a, long_b = "x" * 60 + "a", "x" * 60 + "b"
    assert session_name(long_a) != session_name(long_b)
    assert len(session_name(long_a)) <= 40
    assert session_name('{"session_id": "abc-123"}') == "abc-123"
    assert session_name("../../etc/passwd") != "../../etc/passwd"
    assert "/" not in session_name("../../etc/passwd")


def test_harness_without_a_user_agent_is_empty():
    assert harness("") == ""
    assert harness("curl/8.5.0") == "curl 8.5.0"


def test_claude_codes_title_request_is_about_the_words_it_wraps():
    """Claude Code 2.1 (without --bare) opens a session with its title request, before its turn: the topic is the
    user's words it wraps, not its instruction to the title model."""
    from cerevisor_tui.gateway.identity import topic

    body = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<session>\nName three colours.\n</session>\n\nWrite a 3-7 word title for this "
                                 "session."}]}]}
    assert topic("messages", body, "claude-code 2.1.197") == '"Name three colours."'
    reminder = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nUse the context.\n</system-reminder>"},
        {"type": "text", "text": "Fix the bug"}]}]}
    assert topic("messages", reminder) == '"Fix the bug"'  # a whole tagged block is still context, left out
