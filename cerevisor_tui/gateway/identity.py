"""Which session a request belongs to, from what harnesses already send, and which harness sent it.

In this order: a session header (`X-Session-ID`, `x-session-affinity`, `session_id`); Anthropic's
`metadata.user_id`, OpenAI's `prompt_cache_key` or `user`; a path label (`/a/NAME/v1`); a named client key;
failing all of these, a fingerprint of model, system prompt and first user message, so that every turn of
one conversation lands in one row.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from cerevisor_tui.config.models import agent_name_problem
from cerevisor_tui.gateway.apis import Api, conversation, fingerprint

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


def session_name(value: str) -> str:
    """A session's id as its row's name (and its transcript's file name): kept when short and plain, else a
    readable head and a hash of the whole, so two ids never share a name."""
    value = value.strip()
    # Claude Code's metadata.user_id: "user_<hash>_account_<uuid>_session_<uuid>", or that as JSON
    if value.startswith("{"):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str):
            value = parsed["session_id"]
    if "_session_" in value:
        value = value.rsplit("_session_", 1)[1]
    plain = _UNSAFE.sub("-", value).strip("-.")
    if plain == value and 0 < len(value) <= MAX_NAME and agent_name_problem(value) is None:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()[:8]
    head = plain[:MAX_NAME - 9].strip("-.")
    return f"{head}-{digest}" if head else f"session-{digest}"


def identify(api: Api, headers: Mapping[str, str], body: dict[str, Any], *, label: str = "",
             key: str = "") -> tuple[str, str]:
    """The request's session, as (its name, what named it)."""
    for header in SESSION_HEADERS:
        value = headers.get(header, "").strip()
        if value:
            return session_name(value), header
    if api == "messages":
        metadata = body.get("metadata")
        user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
        if isinstance(user_id, str) and user_id.strip():
            return session_name(user_id), "metadata.user_id"
    else:
        for field in ("prompt_cache_key", "user"):
            given = body.get(field)
            if isinstance(given, str) and given.strip():
                return session_name(given), field
    if label:
        return session_name(label), "path"
    if key:
        return session_name(key.lower()), "key"
    system, messages = conversation(api, body)
    model = body.get("model")
    return f"session-{fingerprint(model if isinstance(model, str) else '', system, messages)}", "fingerprint"
