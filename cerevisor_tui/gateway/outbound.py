"""What goes back to a client, at the one place it goes: every body the gateway sends passes here, the run's keys
taken out (an upstream that repeats the request's credential in an error body, an error event or an answer gets
it to no client), and what went out is kept, so that an error nobody foresaw still ends the request in its API's
shape rather than as a bare 500.

Bodies are scrubbed as a stream (config/secrets.py StreamScrubber): the relay cuts SSE at frame ends, so a key
never straddles two of its writes; a pass-through's raw reads may split one, and the tail that could begin a key
is held back until the next read settles it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from cerevisor_tui.config.secrets import Scrubber, StreamScrubber
from cerevisor_tui.gateway import apis
from cerevisor_tui.gateway.apis import Api
from cerevisor_tui.text import printable

Send = Callable[[dict[str, Any]], Awaitable[None]]
LOG_LINE_CHARS = 300


class ClientSend:
    """An ASGI `send` that scrubs each body and remembers whether the response started and ended."""

    __slots__ = ("_send", "_stream", "_forms", "started", "ended", "event_stream")

    def __init__(self, send: Send, scrub: Scrubber) -> None:
        self._send = send
        self._stream: StreamScrubber | None = scrub.stream() if scrub else None
        forms = [form.encode("utf-8", "surrogateescape") for form in scrub.forms]
        # a body that ends a line can end no key mid-way (unless a key holds a line feed: then none is let by);
        # one pattern of every form finds any in one pass (a `bytes in` per form costs several times more)
        self._forms = re.compile(b"|".join(map(re.escape, forms))) \
            if forms and not any(b"\n" in form for form in forms) else None
        self.started = False  # the status and headers went out
        self.ended = False  # the last byte went out
        self.event_stream = False  # its content type is text/event-stream

    async def __call__(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.started = True
            for name, value in message.get("headers", ()):
                if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                    self.event_stream = True
        elif kind == "http.response.body":
            last = not message.get("more_body", False)
            body = message.get("body", b"")
            # the relay's usual write, whole frames that hold no key, goes as it is (the gateway's hot path: about
            # 1 us a 160-byte frame more than no scrubbing, a third of the text path's cost, on a loaded 2-core
            # box); anything else is scrubbed as a stream
            stream, forms = self._stream, self._forms
            if stream is not None and (forms is None or stream.carry or not body.endswith(b"\n")
                                       or forms.search(body) is not None):
                text = stream.feed(body.decode("utf-8", "surrogateescape"))
                if last:
                    text += stream.flush()
                message = {**message, "body": text.encode("utf-8", "surrogateescape")}
            self.ended = last
        await self._send(message)

    async def error(self, api: Api | None, status: int, message: str) -> None:
        """End the response with an error in the API's shape, wherever it stands: a status and body before the
        headers went out, an error event in a stream after, a plain end otherwise."""
        if self.ended:
            return
        if not self.started:
            await self({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await self({"type": "http.response.body", "body": apis.error_body(api, status, message)})
        elif self.event_stream and api is not None:
            await self({"type": "http.response.body", "body": apis.error_frame(api, status, message)})
        else:
            await self({"type": "http.response.body", "body": b""})


def log_line(scrub: Scrubber, line: str) -> None:
    """One line on the gateway's stderr (a detached run's run.log): printable, without a key, bounded."""
    line = printable(scrub(line) if scrub else line)[:LOG_LINE_CHARS]
    try:
        print(f"cerevisor-tui gateway: {line}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr may be gone with the terminal
        pass
