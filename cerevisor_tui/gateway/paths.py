"""The one rule for a request's path, applied before any routing: a path that names anything but plain segments is
refused, so that what the gateway routes on is exactly what the upstream is sent.

Read from the raw path (as the client wrote it, percent-escapes and all), each segment decoded once: a dot segment
(`.`, `..`, `%2e`), an empty one (`//`, a trailing `/`), or one that decodes to anything outside a plain set of
characters (an encoded `/`, `?`, `#`, `%`, a backslash, a space, a control character, non-ASCII) is refused. So
`/v1/./chat/completions` cannot reach the chat API past its governor, and `/v1/..%2fslots%3faction%3derase`
cannot leave the upstream's base path. A path label (`/a/NAME/v1/...`) is a name, not a path: its one segment is
decoded and made a plain session name later (gateway/identity.py), only never empty.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import NamedTuple

_PLAIN = re.compile(rb"[A-Za-z0-9._~:@+=,-]+")
"""What a decoded segment may hold: RFC 3986's unreserved characters and a few sub-delimiters no server reads as
a separator."""
MAX_PATH_BYTES = 2048


class PathProblem(ValueError):
    """A path the gateway refuses; `str()` says why, for the client (400)."""


class Path(NamedTuple):
    """A request's path as the gateway routes it: `path` (/v1/..., decoded, every segment plain) and the path
    label's name, "" without one."""

    path: str
    label: str


def check_path(raw: bytes) -> Path:
    """The path of a request whose raw path is `raw`. Raises PathProblem for one the gateway refuses."""
    if len(raw) > MAX_PATH_BYTES:
        raise PathProblem(f"the path is {len(raw):,} bytes long; the gateway takes at most {MAX_PATH_BYTES:,}")
    if not raw.startswith(b"/"):
        raise PathProblem("the path must begin with /")
    segments = raw[1:].split(b"/")
    label = ""
    if segments[0] == b"a" and len(segments) > 2:  # /a/NAME/v1/...: NAME is a name, made plain by identity.py
        name = urllib.parse.unquote_to_bytes(segments[1])
        if not name.strip():
            raise PathProblem("the path label (/a/NAME/v1) is empty")
        label = name.decode("utf-8", "replace")
        segments = segments[2:]
    plain = []
    for segment in segments:
        decoded = urllib.parse.unquote_to_bytes(segment)
        if not decoded:
            raise PathProblem("the path has an empty segment (// or a trailing /)")
        if decoded in (b".", b".."):
            raise PathProblem("the path has a dot segment (. or ..)")
        if not _PLAIN.fullmatch(decoded):
            raise PathProblem(f"the path segment {_shown(segment)} holds a character the gateway does not pass "
                              "(an encoded / ? # or %, a backslash, a space, a control character or non-ASCII)")
        plain.append(decoded.decode("ascii"))
    return Path("/" + "/".join(plain), label)


def _shown(segment: bytes) -> str:
    """A raw segment as a client is told it: printable ASCII (it came percent-escaped or plain), cut short."""
    text = segment[:60].decode("ascii", "replace")
    return repr("".join(ch if ch.isprintable() else "?" for ch in text))
