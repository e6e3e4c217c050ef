"""Deterministic text for the simulator: prompt rendering, token counts, block hashes and output words.

A simulated "token" is 4 characters of the rendered prompt, and one word of the output. The rendered
prompt is a plain concatenation of the messages, so a conversation's next turn starts with exactly the
text of the previous one and its block hashes match: that is what prefix caching needs.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Iterator
from typing import Any

CHARS_PER_TOKEN = 4

WORDS = (
    "the", "model", "agent", "token", "cache", "block", "queue", "batch", "server", "stream",
    "answer", "plan", "step", "check", "result", "value", "because", "then", "so", "we",
    "should", "can", "will", "next", "first", "data", "file", "test", "run", "code",
    "and", "of", "to", "in", "is", "it", "that", "for", "on", "with",
    "this", "as", "are", "be", "by", "from", "or", "an", "at", "not",
    "memory", "latency", "request", "prompt", "output", "retry", "limit", "wave", "graph", "node",
)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def render_prompt(messages: list[dict[str, Any]]) -> str:
    """The prompt as one string: `role: content` lines, so a longer conversation extends a shorter one."""
    parts = []
    for m in messages:
        text = _content_text(m.get("content"))
        if m.get("tool_calls"):
            text += json.dumps(m["tool_calls"], sort_keys=True)
        parts.append(f"{m.get('role', 'user')}: {text}\n")
    return "".join(parts)


def count_tokens(text: str) -> int:
    """Stable token count of a rendered prompt (at least 1)."""
    return max(1, len(text) // CHARS_PER_TOKEN)


def block_hashes(text: str, block_size: int) -> list[int]:
    """Hash chain of the prompt's full blocks: block i's hash covers blocks 0..i, as vLLM's does."""
    step = block_size * CHARS_PER_TOKEN
    out: list[int] = []
    h = 0
    for start in range(0, len(text) - step + 1, step):
        h = hash((h, text[start:start + step]))
        out.append(h)
    return out


def text_seed(seed: int, rendered_prompt: str) -> int:
    """Seed of one request's output: the server seed and the prompt, so equal requests get equal text."""
    return (seed * 1_000_003) ^ zlib.crc32(rendered_prompt.encode("utf-8", "surrogatepass"))


def words(seed: int) -> Iterator[str]:
    """Endless deterministic output words; every word after the first carries its leading space."""
    rng = random.Random(seed)
    batch = rng.choices(_SPACED, k=64)
    yield batch[0][1:].capitalize()
    yield from batch[1:]
    while True:
        yield from rng.choices(_SPACED, k=64)


_SPACED = tuple(" " + w for w in WORDS)
