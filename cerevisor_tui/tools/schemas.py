"""The shapes of tools between MCP and the model: an MCP tool as an OpenAI `tools` entry (named
`server__tool`), a call's result as the text the model gets (capped, the cut said), and the short forms the
events carry (arguments cut to 2000 characters, a result's one-line preview)."""

from __future__ import annotations

import json
import re
from typing import Any

ARGUMENTS_SHOWN_CHARS = 2000
PREVIEW_CHARS = 200
_NOT_NAME = re.compile(r"[^A-Za-z0-9_-]")


def function_name(server: str, tool: str) -> str:
    """The name the model calls a server's tool by: `server__tool`, in the characters OpenAI allows, at most
    64 of them (server names are at most 32)."""
    return _NOT_NAME.sub("_", f"{server}__{tool}")[:64]


def openai_tool(name: str, description: str | None, input_schema: dict[str, Any] | None) -> dict[str, Any]:
    """An OpenAI chat `tools` entry for an MCP tool's name, description and input schema."""
    schema = dict(input_schema or {})
    if schema.get("type") != "object":
        schema = {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": schema}}


def result_text(result: Any) -> str:
    """An MCP CallToolResult as the text a model reads: its text content joined; other content named; its
    structured content when there is no text."""
    parts: list[str] = []
    for item in getattr(result, "content", None) or ():
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} content, {getattr(item, 'mime_type', '') or 'unknown type'}, not shown]")
        elif kind == "resource":
            resource = getattr(item, "resource", None)
            text = getattr(resource, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource {getattr(resource, 'uri', '')}]")
        else:
            parts.append(f"[{kind or 'unknown'} content]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False))
    return "\n".join(parts)


def capped(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` with the cut said at its end, so the model knows it read only part."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[result cut: {len(text):,} characters, the first {max_chars:,} kept]"


def preview(text: str) -> str:
    """A result folded to one line of at most 200 characters."""
    line = " ".join(text.split())
    return line if len(line) <= PREVIEW_CHARS else line[:PREVIEW_CHARS - 1] + "…"


def shown_arguments(arguments: str) -> str:
    """A call's arguments as the events show them: at most 2000 characters."""
    if len(arguments) <= ARGUMENTS_SHOWN_CHARS:
        return arguments
    return arguments[:ARGUMENTS_SHOWN_CHARS - 1] + "…"


def parse_arguments(arguments: str) -> dict[str, Any]:
    """The model's arguments text as an object; raises ValueError with the reason the model is then told."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError as exc:
        raise ValueError(f"the arguments are not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("the arguments must be a JSON object")
    return value
