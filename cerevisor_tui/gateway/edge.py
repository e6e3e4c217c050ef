"""What both sides of the gateway's HTTP edge share: a refusal the gateway answers itself, the client headers that
go upstream (an allow-list), a problem in one line, an answer made whole, and the time and size limits."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from cerevisor_tui.gateway.identity import SESSION_HEADERS

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# the client's headers that go upstream, and no other: how to read the request and what it accepts, the APIs'
# version and beta headers, who sent it, and the session headers routers keep affinity by. Never a credential
# (authorization, x-api-key, api-key, x-goog-api-key, cookie ...) nor an account or organisation
# (openai-organization, openai-project, chatgpt-account-id): the upstream sees the run's key and nothing of the client's
_FORWARDED = frozenset({b"content-type", b"accept", b"user-agent", b"anthropic-version", b"anthropic-beta",
                        b"openai-beta", *(name.encode() for name in SESSION_HEADERS)})
ERROR_BODY_LIMIT = 1 << 20  # what is read of an upstream's error body
WAIT_BACKOFF_S = (0.25, 5.0)  # a local endpoint still loading: reconnect after 0.25 s, doubling to 5 s
RETRY_AFTER_S = 5  # told to a client when the upstream is down


class Refusal(Exception):
    """A request the gateway answers itself, before anything is sent upstream."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def upstream_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in raw
               if name.lower() in _FORWARDED}
    headers["accept-encoding"] = "identity"  # the bytes relayed are the bytes read: no compression between
    return headers


def problem_of(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]


async def answer(send: Send, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
    raw = [(b"content-type", b"application/json")]
    raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items() if k != "content-type"]
    if headers and "content-type" in headers:
        raw[0] = (b"content-type", headers["content-type"].encode("latin-1"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
