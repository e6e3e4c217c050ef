"""Streaming chat client: one `POST /chat/completions` with `stream: true`, parsed into deltas.

Why our own SSE line loop rather than httpx-sse's `aiter_sse()`: the stall watchdog needs to see SSE
comments (llama.cpp and proxies send keep-alives as comments, which httpx-sse drops), every byte's
arrival time (`liveness = "bytes"`), and a bound on line length so a server that sends one endless
line cannot exhaust memory. The framing rules are the SSE spec's: `data:` lines joined until a blank
line, `:` comments, an optional `event:` name.
"""

from __future__ import annotations

import email.utils
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.endpoints.errors import (
    RETRYABLE_STATUS,
    EndpointError,
    EndpointHTTPError,
    EndpointUnreachable,
    ProtocolError,
    StreamBroken,
)
from cerevisor_tui.endpoints.network import use_asyncio_backend
from cerevisor_tui.kinds import DELTA, FINISH, KEEPALIVE, USAGE

MAX_LINE_BYTES = 1 << 20  # one SSE line longer than this is a protocol error, not a memory leak
MAX_ERROR_BODY_BYTES = 64 << 10
_scan_json = json.JSONDecoder().scan_once  # (text, index) -> (object, end index)
_scan_string = json.decoder.scanstring  # (text, index after the opening quote) -> (string, end index)

# What the stream yields: (kind, payload), the kinds as cerevisor_tui/kinds.py defines them (KEEPALIVE, DELTA,
# USAGE, FINISH); imported from here by the worker, the probe and the engine


def build_client(concurrency: int, api_key: str | None = None) -> httpx.AsyncClient:
    """An httpx client sized for the run: no pool cap below the concurrency, no pool or read timeout.

    The stall watchdog owns time; an httpx read timeout would fire on an honest slow cold start and
    would never fire on a wedged model behind keep-alives.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(connect=None, read=None, write=None, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=max(concurrency, 10)),
        headers=headers,
        follow_redirects=False,
    )
    use_asyncio_backend(client)  # reads without a loop trip when data is already there (endpoints/network.py)
    return client


def is_refused(exc: BaseException) -> bool:
    """A connection the server side refused (port not open yet): what a loading vLLM looks like."""
    return isinstance(exc, httpx.ConnectError)


@dataclass
class ChatStream:
    """One streamed chat completion. Iterate `events()`; `last_byte_at` tracks raw arrivals."""

    client: httpx.AsyncClient
    endpoint: str
    url: str
    body: dict[str, Any]
    headers: dict[str, str] | None = None
    last_byte_at: float = 0.0
    tokens: int = 0
    finish_reason: str = ""
    usage: tuple[int, int] | None = None
    _done: bool = field(default=False, repr=False)

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        try:
            try:
                async with self.client.stream("POST", self.url, json=self.body, headers=self.headers) as response:
                    if response.status_code >= 300:
                        raise await _http_error(self.endpoint, response)
                    ctype = response.headers.get("content-type", "")
                    if "text/event-stream" not in ctype:
                        async for item in self._non_stream(response, ctype):
                            yield item
                        return
                    async for item in self._sse(response):
                        yield item
            except EndpointError:
                raise
            except httpx.ConnectError as exc:
                raise EndpointUnreachable(self.endpoint, f"cannot connect to {self.url}: {_reason(exc)}") from exc
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                raise StreamBroken(self.endpoint, f"connection lost after {self.tokens} tokens: {_reason(exc)}") from exc
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                raise StreamBroken(self.endpoint, f"{type(exc).__name__}: {_reason(exc)}") from exc
            except UnicodeEncodeError as exc:  # a header value that is not ASCII: sending it again cannot help
                raise ProtocolError(self.endpoint, f"a request header is not ASCII: {_reason(exc)}", retryable=False) from exc
        except EndpointError as exc:
            # whatever the server sent back (an echoed Authorization header) or the library said, without the key
            raise exc.scrub(self.scrubber()) from exc.__cause__

    def scrubber(self) -> Scrubber:
        """The keys this request carries (its Authorization header): what a server could echo back."""
        return request_scrubber(self.client.headers, self.headers)

    async def _sse(self, response: httpx.Response) -> AsyncIterator[tuple[int, Any]]:
        endpoint = self.endpoint
        chunk_items = self._chunk
        scan_string = _scan_string
        data: list[bytes] = []  # the current event's data: lines, whole
        event_name = b""
        # The delta template (see _delta_template): the bytes around the one string that changes from chunk
        # to chunk, "data: " included. A line that matches it is parsed by reading that string alone.
        prefix = suffix = b""
        around = 0
        slot = 0
        learn = _TEMPLATE_TRIES
        # Consecutive content (or reasoning) deltas of one read go out as one DELTA: a server that packs
        # many chunks into a read (a busy vLLM, for a client that fell behind) costs one event, not many.
        pend: list[str] = []
        pend_slot = 0
        # _lines hands over all the lines of one read at once: one async hand-off per read, not per line
        async for lines in _lines(response, self, endpoint):
            for line in lines:
                if line:
                    if line.startswith(b"data:"):
                        data.append(line)
                    elif line[:1] == b":":
                        if pend:
                            yield _merged(pend, pend_slot)
                            pend = []
                        yield (KEEPALIVE, None)
                    elif line.startswith(b"event:"):
                        event_name = line[6:].strip()
                    # id: and retry: fields do not matter for a completion stream
                    continue
                if not data:
                    continue
                # a blank line: dispatch the event
                if len(data) == 1 and not event_name:
                    line = data[0]
                    data.clear()
                    if around and len(line) > around and line.startswith(prefix) and line.endswith(suffix):
                        try:
                            text = line[len(prefix):len(line) - len(suffix)].decode()
                            value, end = scan_string(text, 1) if text[0] == '"' else (None, 0)
                        except ValueError:
                            value = None
                        if value is not None and end == len(text):
                            if value:
                                self.tokens += 1
                                if pend and pend_slot != slot:
                                    yield _merged(pend, pend_slot)
                                    pend = []
                                pend_slot = slot
                                pend.append(value)
                            else:
                                if pend:
                                    yield _merged(pend, pend_slot)
                                    pend = []
                                yield (KEEPALIVE, None)
                            continue
                    payload = _data_value(line)
                    is_error = False
                else:
                    payload = b"\n".join([_data_value(part) for part in data])
                    line = b""
                    data.clear()
                    is_error = event_name == b"error"
                    event_name = b""
                if payload == b"[DONE]":
                    if pend:
                        yield _merged(pend, pend_slot)
                    self._done = True
                    return
                try:
                    items = chunk_items(payload, is_error)
                except EndpointError:
                    if pend:  # what came before a bad chunk is the partial answer
                        yield _merged(pend, pend_slot)
                    raise
                if learn and line and len(items) == 1 and items[0][0] == DELTA:
                    learn -= 1
                    template = _delta_template(payload, items[0][1])
                    if template is not None:
                        head = line[:len(line) - len(payload)]  # "data: " or "data:"
                        prefix, suffix, slot = head + template[0], template[1], template[2]
                        around = len(prefix) + len(suffix)
                        learn = _TEMPLATE_TRIES
                for kind, value in items:
                    if kind == DELTA and not value[2] and bool(value[0]) != bool(value[1]):
                        one = 0 if value[0] else 1
                        if pend and pend_slot != one:
                            yield _merged(pend, pend_slot)
                            pend = []
                        pend_slot = one
                        pend.append(value[one])
                        continue
                    if pend:
                        yield _merged(pend, pend_slot)
                        pend = []
                    yield (kind, value)
            if pend:  # the end of a read
                yield _merged(pend, pend_slot)
                pend = []
        if data:  # the stream ended without the blank line after its last event
            payload = b"\n".join([_data_value(part) for part in data])
            if payload == b"[DONE]":
                self._done = True
                return
            for item in chunk_items(payload, event_name == b"error"):
                yield item
        if not self._done and not self.finish_reason:
            raise StreamBroken(
                endpoint, f"stream ended without [DONE] and without a finish reason after {self.tokens} tokens"
            )

    def _chunk(self, payload: bytes, is_error: bool) -> list[tuple[int, Any]]:
        try:
            # the C scanner that json.loads ends in, without its encoding sniffing and whitespace regexes;
            # anything unusual (not UTF-8, surrounding whitespace, extra data, an error) goes to json.loads
            text = payload.decode()
            obj, end = _scan_json(text, 0)
            if end != len(text):
                raise ValueError
        except (StopIteration, ValueError):
            try:
                obj = json.loads(payload)
            except UnicodeDecodeError:
                raise ProtocolError(self.endpoint, "stream is not valid UTF-8") from None
            except ValueError:
                # scrubbed before it is cut: a key cut in half would pass the scrubber
                shown = self.scrubber()(payload.decode("utf-8", "replace"))[:80]
                raise ProtocolError(self.endpoint, f"malformed JSON in stream after {self.tokens} tokens: {shown!r}") from None
        if not isinstance(obj, dict):
            raise ProtocolError(self.endpoint, f"stream event is not a JSON object: {self.scrubber()(str(obj))[:80]!r}")
        if is_error or "error" in obj or obj.get("object") == "error":
            raise _stream_error(self.endpoint, obj, self.tokens, self.scrubber())
        choices = obj.get("choices")
        usage = obj.get("usage")
        if choices:
            choice = choices[0]
            delta = choice.get("delta") or choice.get("message") or {}
            content = delta.get("content") or ""
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            tool = _tool_text(delta.get("tool_calls")) if delta.get("tool_calls") else ""
            finish = choice.get("finish_reason")
            if (content or reasoning or tool) and not finish and not usage:  # the common chunk: one delta
                self.tokens += 1
                return [(DELTA, (content, reasoning, tool, 1))]
            out: list[tuple[int, Any]] = []
            if content or reasoning or tool:
                self.tokens += 1
                out.append((DELTA, (content, reasoning, tool, 1)))
            if finish:
                self.finish_reason = finish
                out.append((FINISH, finish))
        else:
            out = []
        if usage:
            self.usage = (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
            out.append((USAGE, self.usage))
        if not out:
            out.append((KEEPALIVE, None))
        return out

    async def _non_stream(self, response: httpx.Response, ctype: str) -> AsyncIterator[tuple[int, Any]]:
        """A 2xx that is not an event stream: a whole chat.completion is accepted, anything else is an error."""
        raw = await _read_bounded(response, MAX_ERROR_BODY_BYTES * 16)
        try:
            obj = json.loads(raw) if "json" in ctype else None
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or "choices" not in obj:
            raise ProtocolError(
                self.endpoint,
                f"answered HTTP {response.status_code} with {ctype or 'no content type'} instead of an event stream"
                + (f": {_summary(raw, ctype, self.scrubber())}" if raw else ""),
            )
        for item in self._chunk(raw, False):
            yield item
        self._done = True


async def _lines(response: httpx.Response, stream: ChatStream, endpoint: str) -> AsyncIterator[list[bytes]]:
    """Split the body into lines (\\n or \\r\\n), each at most MAX_LINE_BYTES, noting every arrival.

    Yields the complete lines of each read as one list: a fast server packs many events into a read, and
    one async hand-off per line would cost more than parsing the line.
    """
    buf = b""
    monotonic = time.monotonic
    async for chunk in response.aiter_bytes():
        stream.last_byte_at = monotonic()
        if buf:
            chunk = buf + chunk
        lines = chunk.split(b"\n")
        buf = lines.pop()
        if len(buf) > MAX_LINE_BYTES:
            raise ProtocolError(endpoint, f"a stream line exceeds {MAX_LINE_BYTES >> 20} MiB without a newline")
        if lines:
            if b"\r" in chunk:  # \r\n line ends (a raw \r cannot appear inside a JSON payload)
                lines = [line[:-1] if line[-1:] == b"\r" else line for line in lines]
            yield lines
    if buf:
        yield [buf.rstrip(b"\r"), b""]


def _merged(texts: list[str], slot: int) -> tuple[int, tuple[str, str, str, int]]:
    """One DELTA for consecutive delta texts of one field (0 content, 1 reasoning)."""
    text = texts[0] if len(texts) == 1 else "".join(texts)
    return (DELTA, (text, "", "", len(texts)) if slot == 0 else ("", text, "", len(texts)))


def _data_value(line: bytes) -> bytes:
    """The value of a `data:` line: after the colon, less one leading space."""
    return line[6:] if line[5:6] == b" " else line[5:]


_DELTA_KEYS = ("content", "reasoning_content", "reasoning")
_TEMPLATE_TRIES = 16  # chunks parsed in full without a template to show for it before a stream stops trying
_WHITESPACE = frozenset(" \t\r\n")


def _delta_template(payload: bytes, delta: tuple[str, str, str, int]) -> tuple[bytes, bytes, int] | None:
    """The bytes before and after the one delta string of a chunk, and which field it is (0 content, 1 reasoning).

    A server streams chunks that differ only in that string: vLLM's and llama.cpp's id, created and model
    stay the same for the whole stream. A later chunk made of the same prefix, one valid JSON string and
    the same suffix is exactly this chunk with another string, so reading the string alone gives what
    json.loads would, at a tenth of the cost. Only a field that occurs once, with neither other delta text
    field beside it, makes a template; anything else keeps the full parse.
    """
    content, reasoning, tool, _ = delta
    if tool or (content and reasoning):
        return None
    value = content or reasoning
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        return None
    found = [key for key in _DELTA_KEYS if f'"{key}":' in text]
    if len(found) != 1:
        return None
    key = found[0]
    marker = f'"{key}":'
    at = text.find(marker)
    if text.find(marker, at + 1) >= 0:
        return None
    start = at + len(marker)
    while start < len(text) and text[start] in _WHITESPACE:
        start += 1
    if text[start:start + 1] != '"':
        return None
    try:
        parsed, end = _scan_string(text, start + 1)
    except ValueError:
        return None
    if parsed != value:
        return None
    return text[:start].encode(), text[end:].encode(), 0 if key == "content" else 1


async def _read_bounded(response: httpx.Response, limit: int) -> bytes:
    out = bytearray()
    async for chunk in response.aiter_bytes():
        out += chunk
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def _tool_text(tool_calls: Any) -> str:
    parts = []
    for call in tool_calls or ():
        fn = (call or {}).get("function") or {}
        parts.append((fn.get("name") or "") + (fn.get("arguments") or ""))
    return "".join(parts) or " "


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    if not text and exc.__cause__ is not None:
        text = str(exc.__cause__).strip()
    return text or type(exc).__name__


_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.I | re.S)
_TAGS = re.compile(r"<[^>]+>")


def _summary(raw: bytes, ctype: str, scrub: Scrubber | None = None) -> str:
    """A short, printable summary of an error body: the server's message, an HTML page's title, or its start,
    with the request's keys taken out before it is cut short."""
    if "html" in ctype or raw.lstrip()[:1] == b"<":
        title = _TITLE.search(raw)
        text = title.group(1).decode("utf-8", "replace") if title else _TAGS.sub(" ", raw.decode("utf-8", "replace"))
        text = "HTML page: " + " ".join(text.split())
    else:
        text = raw.decode("utf-8", "replace")
        try:
            text = error_message(json.loads(raw)) or text
        except ValueError:
            pass
        text = " ".join(text.split())
    if scrub:
        text = scrub(text)
    return text[:200] + ("…" if len(text) > 200 else "")


def error_message(obj: Any) -> str:
    """The human message of an OpenAI/vLLM/llama.cpp error body, whichever shape it has."""
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, str):
            return err
        if isinstance(err, dict):
            for key in ("message", "detail", "msg"):
                if isinstance(err.get(key), str):
                    return err[key]
        if isinstance(obj.get("detail"), str):
            return obj["detail"]
    return ""


def _stream_error(endpoint: str, obj: dict[str, Any], tokens: int, scrub: Scrubber) -> EndpointError:
    message = scrub(error_message(obj) or json.dumps(obj))[:200]
    err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
    code = err.get("code") if isinstance(err, dict) else None
    status = code if isinstance(code, int) else None
    return EndpointHTTPError(
        endpoint,
        f"server error in stream after {tokens} tokens: {message}",
        status=status,
        retryable=status is None or status in RETRYABLE_STATUS,
    )


def request_scrubber(*headers: Any) -> Scrubber:
    """A scrubber of the keys in these headers' Authorization values (httpx.Headers or a dict), both the
    key and its `Bearer` form. Built only when an error is phrased, never per chunk."""
    keys: list[str] = []
    for group in headers:
        for name, value in (group or {}).items():
            if name.lower() == "authorization" and value:
                keys.append(value)
                scheme, _, key = value.partition(" ")
                if key and scheme.lower() == "bearer":
                    keys.append(key)
    return Scrubber(keys)


def retry_after_seconds(value: str | None) -> float | None:
    """Retry-After as seconds: either a number or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


_HINTS = {
    401: "unauthorized: check the API key (api_key_env)",
    403: "forbidden: the key may lack access to this model",
    404: "not found: check base_url (it should end in /v1) and the model id",
    413: "request too large",
    429: "rate limited",
}


async def _http_error(endpoint: str, response: httpx.Response) -> EndpointHTTPError:
    raw = await _read_bounded(response, MAX_ERROR_BODY_BYTES)
    status = response.status_code
    scrub = request_scrubber(response.request.headers)
    detail = _summary(raw, response.headers.get("content-type", ""), scrub) if raw else ""
    label = _HINTS.get(status, response.reason_phrase or "error")
    retry_after = retry_after_seconds(response.headers.get("retry-after"))
    problem = f"HTTP {status} {label}" + (f": {detail}" if detail else "")
    if retry_after is not None:
        problem += f" (Retry-After {retry_after:g} s)"
    if scrub:  # the reason phrase is the server's text too
        problem = scrub(problem)
    return EndpointHTTPError(endpoint, problem, status=status, retry_after_s=retry_after,
                             retryable=status in RETRYABLE_STATUS)


async def list_models(client: httpx.AsyncClient, endpoint: str, base_url: str) -> list[dict[str, Any]]:
    """GET {base_url}/models: the served models (vLLM adds max_model_len)."""
    url = base_url.rstrip("/") + "/models"
    scrub = request_scrubber(client.headers)
    try:
        response = await client.get(url)
    except httpx.ConnectError as exc:
        raise EndpointUnreachable(endpoint, scrub(f"cannot connect to {url}: {_reason(exc)}")) from exc
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise StreamBroken(endpoint, scrub(f"GET {url} failed: {_reason(exc)}")) from exc
    except UnicodeEncodeError as exc:
        raise ProtocolError(endpoint, f"GET {url}: a request header is not ASCII: {_reason(exc)}", retryable=False) from exc
    if response.status_code >= 300:
        raise await _http_error(endpoint, response)
    try:
        data = response.json().get("data")
    except (ValueError, AttributeError):
        data = None
    if not isinstance(data, list):
        raise ProtocolError(endpoint, f"GET {url} did not return a model list")
    return [m for m in data if isinstance(m, dict) and m.get("id")]
