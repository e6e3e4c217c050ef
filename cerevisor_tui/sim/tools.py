"""The simulator's tool calls: when a request offers tools, which one it calls and with what arguments,
deterministic for a seed and a conversation (so an agent loop can be tested, and resumed, without a model)."""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from cerevisor_tui.config.models import SimSettings

PIECE_CHARS = 8  # the arguments stream in pieces this long, as a model's tokens would


def choose_call(body: dict[str, Any], messages: list[dict[str, Any]], settings: SimSettings,
                rendered: str) -> tuple[str, str, str] | None:
    """(call id, function name, arguments JSON) when this request is answered with a tool call, else None.

    `tool_choice` is honoured: "none" answers in text, a named function is called, "required" calls one;
    otherwise the answer calls a tool while the current turn (since its last user message) holds fewer
    tool-calling answers than `tool_steps`."""
    offered: dict[str, dict[str, Any]] = {}
    for tool in body.get("tools") or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            offered[fn["name"]] = params if isinstance(params := fn.get("parameters"), dict) else {}
    if not offered:
        return None
    choice = body.get("tool_choice")
    names = sorted(offered)
    if choice == "none":
        return None
    if isinstance(choice, dict):
        forced = (choice.get("function") or {}).get("name")
        if forced not in offered:
            return None
        names = [forced]
    elif choice != "required":
        if _calls_this_turn(messages) >= settings.tool_steps:
            return None
        if settings.tool_args:
            names = [n for n in names if _args_for(n, settings) is not None]
            if not names:
                return None
    rng = random.Random(f"{settings.seed}:{rendered}")
    name = names[rng.randrange(len(names))]
    args = _args_for(name, settings)
    if args is None:
        args = arguments_from_schema(offered[name])
    digest = hashlib.sha256(f"{settings.seed}:{rendered}".encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"call_{digest}", name, json.dumps(args, ensure_ascii=False)


def pieces(arguments: str) -> list[str]:
    """The arguments text in the pieces it streams in (at least one)."""
    return [arguments[i:i + PIECE_CHARS] for i in range(0, len(arguments), PIECE_CHARS)] or [""]


def arguments_from_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Valid arguments for a JSON schema: each required property with its default, first enum value, or a
    plain value of its type."""
    props = found if isinstance(found := schema.get("properties"), dict) else {}
    out: dict[str, Any] = {}
    for name in schema.get("required") or ():
        prop = found if isinstance(found := props.get(name), dict) else {}
        out[name] = _value(prop)
    return out


def _value(prop: dict[str, Any]) -> Any:
    if "default" in prop:
        return prop["default"]
    if isinstance(prop.get("enum"), list) and prop["enum"]:
        return prop["enum"][0]
    kind = prop.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if not isinstance(kind, str):  # a schema's "type" may be anything: an unhashable one must not raise
        return "sim"
    return {"integer": 1, "number": 1.0, "boolean": True, "array": [], "object": {}}.get(kind, "sim")


def _args_for(name: str, settings: SimSettings) -> dict[str, Any] | None:
    """The configured arguments of a function, by its full name or its tool name (after `server__`)."""
    if name in settings.tool_args:
        return settings.tool_args[name]
    return settings.tool_args.get(name.split("__", 1)[-1])


def _calls_this_turn(messages: list[dict[str, Any]]) -> int:
    count = 0
    for m in reversed(messages):
        if m.get("role") == "user":
            break
        if m.get("role") == "assistant" and m.get("tool_calls"):
            count += 1
    return count
