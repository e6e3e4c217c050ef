"""API keys: checked before they are sent, and scrubbed from every text a run records or shows.

A key comes only from the environment variable an endpoint names (`api_key_env`). Two things go wrong
with it in the field: a value httpx cannot put in a header (a key file saved with CRLF leaves a trailing
`\\r`; httpx then raises "Illegal header value b'Bearer sk-…'", with the key in the message), and a server
that echoes the Authorization header back in an error body or a stream line. `key_problem` catches the
first before anything is sent; a `Scrubber` built from the run's keys replaces the second wherever text
enters the run (endpoint errors, streamed deltas, event fields), so no key reaches a log, an event, a
transcript, a report or the screen.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

MASK = "[redacted]"
MIN_SECRET_CHARS = 8
"""A key shorter than this is not scrubbed: it cannot be told from ordinary text (every "test" in every
answer would go), and it is no secret worth the name. Longer keys are scrubbed wherever they appear."""

_CONTROL_NAMES = {"\r": "a carriage return (\\r)", "\n": "a line feed (\\n)", "\t": "a tab (\\t)", "\0": "a NUL byte"}


def key_problem(value: str) -> str | None:
    """What makes `value` unusable as an API key in an HTTP header, said without the value; None if usable."""
    for i, ch in enumerate(value):
        code = ord(ch)
        where = f"at character {i + 1} of {len(value)}"
        if code < 0x20 or 0x7F <= code <= 0x9F:
            name = _CONTROL_NAMES.get(ch, f"a control character (U+{code:04X})")
            hint = " (a key file saved with CRLF line ends?)" if ch == "\r" and i == len(value) - 1 else ""
            return f"holds {name} {where}{hint}"
        if code > 0x7E:
            return f"holds a non-ASCII character {where} (an HTTP header carries ASCII only)"
    if value != value.strip(" "):
        return "begins or ends with a space"
    return None


def env_keys(names: Iterable[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of the environment variables named (those set), in order, without repeats."""
    environ = os.environ if environ is None else environ
    seen: dict[str, None] = {}
    for name in names:
        value = environ.get(name) if name else None
        if value:
            seen.setdefault(value, None)
    return list(seen)


def _variants(key: str) -> set[str]:
    """The forms a key takes in text: itself, stripped, and as Python's repr and JSON escape it (httpx's
    "Illegal header value b'...'" is a repr of the header's bytes)."""
    forms = {key, key.strip(), repr(key)[1:-1], json.dumps(key)[1:-1], json.dumps(key, ensure_ascii=False)[1:-1]}
    try:
        forms.add(repr(key.encode("utf-8", "surrogateescape"))[2:-1])
    except UnicodeEncodeError:
        pass
    return {form for form in forms if len(form) >= MIN_SECRET_CHARS}


class Scrubber:
    """Replaces every form of the given keys in a text with `[redacted]`. Falsy when it holds no key, so
    callers skip it entirely on the common path: `if scrub: text = scrub(text)`."""

    __slots__ = ("forms", "_firsts", "_pairs", "_prefixes", "longest")

    def __init__(self, keys: Iterable[str] = ()) -> None:
        forms: set[str] = set()
        for key in keys:
            if key:
                forms |= _variants(key)
        # longest first: a form that contains another is replaced whole
        self.forms: tuple[str, ...] = tuple(sorted(forms, key=len, reverse=True))
        self._firsts = frozenset(form[0] for form in self.forms)
        self._pairs = tuple({form[:2] for form in self.forms})
        self._prefixes = frozenset(form[:k] for form in self.forms for k in range(1, len(form)))  # proper ones
        self.longest = len(self.forms[0]) if self.forms else 0

    @classmethod
    def from_env(cls, names: Iterable[str], environ: Mapping[str, str] | None = None) -> Scrubber:
        return cls(env_keys(names, environ))

    def __bool__(self) -> bool:
        return bool(self.forms)

    def found(self, text: str) -> bool:
        return any(form in text for form in self.forms)

    def __call__(self, text: str) -> str:
        """`text` without any key; also without a long start of one at its very end (a text cut short in the
        middle of a key). The same object when there was nothing to take out."""
        for form in self.forms:
            if form in text:
                text = text.replace(form, MASK)
        return self._cut_tail(text) if self.forms else text

    def _cut_tail(self, text: str) -> str:
        cut = self.tail_start(text)
        return text[:cut] + MASK if len(text) - cut >= MIN_SECRET_CHARS else text

    def value(self, value: Any) -> Any:
        """`value` with every string in it scrubbed: strings, and lists, tuples and dicts of them (keys too)."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, list | tuple):
            items = [self.value(v) for v in value]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, dict):
            return {self.value(k): self.value(v) for k, v in value.items()}
        return value

    def _holds(self, value: Any) -> bool:
        if isinstance(value, str):
            return self(value) is not value
        if isinstance(value, list | tuple):
            return any(self._holds(v) for v in value)
        if isinstance(value, dict):
            return any(self._holds(k) or self._holds(v) for k, v in value.items())
        return False

    def record(self, record: Any) -> Any:
        """An event (a msgspec Struct) with its text fields scrubbed; the same object when none
        holds a key, so the usual event costs a scan of its strings and nothing more."""
        names = _text_fields(type(record))
        changes = {}
        for name in names:
            value = getattr(record, name)
            if self._holds(value):
                changes[name] = self.value(value)
        return msgspec.structs.replace(record, **changes) if changes else record

    def tail_start(self, text: str) -> int:
        """Where the longest tail of `text` that could begin a key starts (len(text) when none could): the
        part a stream must hold back until the next delta says whether a key follows.

        Per delta this runs a `find` for each key's first two characters over the last len(key) characters
        (one or two C-level scans), and a set lookup per hit, not a Python loop over the characters."""
        n = len(text)
        start = max(0, n - self.longest + 1)
        prefixes = self._prefixes
        best = n
        for pair in self._pairs:  # tails of two characters or more begin with a key's first two
            i = text.find(pair, start)
            while 0 <= i < best:
                if text[i:] in prefixes:
                    best = i
                    break
                i = text.find(pair, i + 1)
        if best == n and n and text[-1] in self._firsts:  # a tail of one character
            best = n - 1
        return best

    def stream(self) -> StreamScrubber:
        return StreamScrubber(self)


class StreamScrubber:
    """Scrubs a text that arrives in pieces (one field of a streamed answer), where a key may be split
    across two deltas: each piece is scrubbed together with the held-back tail of the one before, and a
    tail that could begin a key is held back until the next piece (or `flush()`) settles it. Concatenated,
    what `feed` and `flush` return is the whole text scrubbed."""

    __slots__ = ("scrub", "carry")

    def __init__(self, scrub: Scrubber) -> None:
        self.scrub = scrub
        self.carry = ""

    def feed(self, text: str) -> str:
        if self.carry:
            text = self.carry + text
        scrub = self.scrub
        for form in scrub.forms:
            if form in text:
                text = text.replace(form, MASK)
        cut = scrub.tail_start(text)
        if cut == len(text):
            self.carry = ""
            return text
        self.carry = text[cut:]
        return text[:cut]

    def flush(self) -> str:
        """The held-back tail at the end of the text: it never completed a key, so it is text, unless it is
        a long start of one (a stream cut off in the middle of an echoed key)."""
        carry, self.carry = self.carry, ""
        return MASK if len(carry) >= MIN_SECRET_CHARS else carry


_FIELDS: dict[type, tuple[str, ...]] = {}


def _text_fields(cls: type) -> tuple[str, ...]:
    """The fields of a Struct that may hold text (not numbers or flags), cached per class."""
    found = _FIELDS.get(cls)
    if found is None:
        found = _FIELDS[cls] = tuple(f.name for f in msgspec.structs.fields(cls) if f.type not in _NOT_TEXT)
    return found


_NOT_TEXT = (int, float, bool, int | None, float | None, bool | None)

