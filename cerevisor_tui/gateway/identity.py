"""Which session a request belongs to, from what harnesses already send, which harness sent it, and what its row
shows a person.

In this order: a path label (`/a/NAME/v1`: the operator's own name wins, and the harness's own session id is kept
beside it); a session header (`X-Session-ID`, `x-session-affinity`, `session_id`); Anthropic's `metadata.user_id`,
OpenAI's `prompt_cache_key` or `user`; a named client key; failing all of these, a fingerprint of model, system
prompt and first user message, so that every turn of one conversation lands in one row.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from cerevisor_tui.config.models import agent_name_problem
from cerevisor_tui.gateway.apis import Api, conversation, fingerprint, role_of, text_of

SESSION_HEADERS = ("x-session-id", "x-session-affinity", "session_id", "session-id", "x-claude-code-session-id")
"""Session headers, in the order they are believed (lower case, as ASGI gives them)."""
MAX_NAME = 40
_UNSAFE = re.compile(r"[^A-Za-z0-9._:@+=-]+")
_HARNESSES = (  # User-Agent prefix (lower case) -> the harness's name in the row
    ("claude-cli", "claude-code"), ("claude-code", "claude-code"), ("codex_cli_rs", "codex"), ("codex", "codex"),
    ("opencode", "opencode"), ("aider", "aider"), ("litellm", "litellm"), ("mini-swe-agent", "mini-swe-agent"),
    ("openai/python", "openai-python"), ("asyncopenai/python", "openai-python"), ("anthropic/python", "anthropic-python"),
    ("asyncanthropic/python", "anthropic-python"), ("openai/js", "openai-js"), ("anthropic/js", "anthropic-js"),
    ("ai-sdk", "ai-sdk"), ("python-httpx", "httpx"), ("curl", "curl"),
)


def harness(user_agent: str) -> str:
    """The harness a User-Agent names, with its version when it gives one: "claude-code 2.0.14"."""
    ua = user_agent.strip()
    if not ua:
        return ""
    lower = ua.lower()
    for prefix, name in _HARNESSES:
        if lower.startswith(prefix):
            version = re.search(r"[/ ]v?([0-9]+(?:\.[0-9A-Za-z+-]+)*)", ua)
            return f"{name} {version.group(1)}" if version else name
    return _UNSAFE.sub("-", ua.split()[0])[:MAX_NAME]


_AIDER_SAYS = ("I am not sharing any files that you can edit yet.", "I have *added these files to the chat*",
               "Here are summaries of some files present in my git repository.",
               "Don't try and edit any existing code without asking me to add the files to the chat!",
               "I switched to a new code base.")
"""What aider says as the user in each of its requests (its files' context): aider sends no header of its own (it
speaks through litellm and the openai SDK: `OpenAI/Python 2.20.0`), so its words tell it."""


def harness_of(user_agent: str, api: Api, body: dict[str, Any]) -> str:
    """The harness a request comes from: its User-Agent's (`harness`), or aider, known by its own words."""
    named = harness(user_agent)
    if named.startswith("openai-python") and api == "chat":
        _, messages = conversation(api, body)
        if any(role_of(m) == "user" and text_of(m.get("content")).startswith(_AIDER_SAYS) for m in messages):
            return "aider"
    return named


def bare_id(value: str) -> str:
    """A harness's session id without its wrapping: Claude Code's metadata.user_id is
    "user_<hash>_account_<uuid>_session_<uuid>", or that as JSON; the session is its last uuid."""
    value = value.strip()
    if value.startswith("{"):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str):
            value = parsed["session_id"].strip()
    if "_session_" in value:
        value = value.rsplit("_session_", 1)[1]
    return value


def session_name(value: str) -> str:
    """A session's id as its row's name (and its transcript's file name): kept when short and plain, else a
    readable head and a hash of the whole, so two ids never share a name."""
    value = bare_id(value)
    plain = _UNSAFE.sub("-", value).strip("-.")
    if plain == value and 0 < len(value) <= MAX_NAME and agent_name_problem(value) is None:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()[:8]
    head = plain[:MAX_NAME - 9].strip("-.")
    return f"{head}-{digest}" if head else f"session-{digest}"


def own_id(api: Api, headers: Mapping[str, str], body: dict[str, Any]) -> tuple[str, str]:
    """The harness's own session id, as (the id, where it was found); ("", "") when it sends none."""
    for header in SESSION_HEADERS:
        value = headers.get(header, "").strip()
        if value:
            return value, header
    if api == "messages":
        metadata = body.get("metadata")
        user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
        if isinstance(user_id, str) and user_id.strip():
            return user_id, "metadata.user_id"
    else:
        for field in ("prompt_cache_key", "user"):
            given = body.get(field)
            if isinstance(given, str) and given.strip():
                return given, field
    return "", ""


def identify(api: Api, headers: Mapping[str, str], body: dict[str, Any], *, label: str = "",
             key: str = "") -> tuple[str, str, str]:
    """The request's session, as (its name, what named it, the harness's own session id when a path label won
    over it: kept beside the row, "" otherwise)."""
    given, where = own_id(api, headers, body)
    if label:
        return session_name(label), "path", _UNSAFE.sub("-", bare_id(given))[:MAX_ID] if given else ""
    if given:
        return session_name(given), where, ""
    if key:
        return session_name(key.lower()), "key", ""
    system, messages = conversation(api, body)
    model = body.get("model")
    return f"session-{fingerprint(model if isinstance(model, str) else '', system, messages)}", "fingerprint", ""


SHORT_ID = 8
"""The cells of a harness's generated session id a row shows: enough to tell a person's few sessions apart."""
MAX_ID = 64
TOPIC_WORDS, TOPIC_CHARS, TOPIC_MESSAGES = 8, 48, 4
_TAGGED = re.compile(r"<([A-Za-z_][\w-]*)[^>]*>")  # a harness's context (<system-reminder>, <environment_context>)
_CWD = (re.compile(r"<cwd>\s*([^<\n]+?)\s*</cwd>"), re.compile(r"Working directory: *([^\n<]+)"))


def title(name: str, source: str, harness_name: str) -> str:
    """What a session's row is called when its name is a harness's generated id (a uuid, `ses_dca4bc70bffe…`) or a
    fingerprint: the harness and a short id (`claude-code 226c5305`); "" when the name reads well as it is (a path
    label, a key, a short id someone chose)."""
    if source in ("path", "key") or (source != "fingerprint" and len(name) <= 2 * SHORT_ID):
        return ""
    short = name.removeprefix("session-") if source == "fingerprint" else name
    head, sep, tail = short.partition("_")
    if sep and len(head) <= 4 and tail:  # opencode's "ses_…", a prefix shared by every session
        short = tail
    return f"{harness_name.split(' ')[0] if harness_name else 'session'} {short[:SHORT_ID]}"


def topic(api: Api, body: dict[str, Any], harness_name: str = "") -> str:
    """What the conversation is about, in a few words: its first user message's (a harness's tagged context left
    out), and the working directory where the harness sends it (`"fix the login bug…" · in …/shop/api`). aider's
    is its last: it opens every conversation with the same worked example."""
    system, messages = conversation(api, body)
    users = [m.get("content") for m in messages if role_of(m) == "user"]
    users = users[-1:] if harness_name == "aider" else users[:TOPIC_MESSAGES]
    words = ""
    parts = [part for content in users for part in _parts(content) if part]
    # a lead-in ("Generate a title for this conversation:", opencode's title request) says what follows is the topic
    plain = next((part for part in parts if not part.endswith(":")), parts[0] if parts else "").strip('"“”').split()
    if plain:
        words = " ".join(plain[:TOPIC_WORDS])
        cut = len(plain) > TOPIC_WORDS or len(words) > TOPIC_CHARS
        words = f"\"{words[:TOPIC_CHARS].rstrip()}{'…' if cut else ''}\""
    where = ""
    texts = [system, *map(text_of, users)]
    for rule in _CWD:
        found = next((m for m in map(rule.search, texts) if m), None)
        if found:
            path = found.group(1).strip()
            parts = [p for p in path.split("/") if p]
            where = "in " + ("…/" + "/".join(parts[-2:]) if len(parts) > 2 else path)
            break
    return " · ".join(p for p in (words, where) if p)


def _parts(content: Any) -> list[str]:
    """A user message's texts, each of its blocks apart, without those that are a harness's tagged context
    (a whole block `<tag>…</tag>`): Claude Code's reminders, Codex's environment. A block that opens with a tag and
    goes on after its close is about the tag's content (Claude Code's title request: `<session>WORDS</session>
    Write a title…`)."""
    texts = [content] if isinstance(content, str) else [text_of([part]) for part in content] \
        if isinstance(content, list) else []
    kept = []
    for text in texts:
        text = text.strip()
        opening = _TAGGED.match(text)
        if opening is not None:
            close = f"</{opening.group(1)}>"
            end = text.find(close)
            if end + len(close) == len(text):
                continue  # the whole block is context
            if end > 0:
                text = text[opening.end():end].strip()
        kept.append(text)
    return kept
