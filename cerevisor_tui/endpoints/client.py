"""Streaming chat client: one `POST /chat/completions` with `stream: true`, parsed into deltas.

Why our own SSE line loop rather than httpx-sse's `aiter_sse()`: the stall watchdog needs to see SSE
comments (llama.cpp and proxies send keep-alives as comments, which httpx-sse drops), every byte's
arrival time (`liveness = "bytes"`), and a bound on line length so a server that sends one endless
line cannot exhaust memory. The framing rules are the SSE spec's: `data:` lines joined until a blank
line, `:` comments, an optional `event:` name.

Each event's JSON is decoded by one reused `msgspec.json.Decoder` into a `Chunk` (endpoints/chunks.py), a Struct
that holds only the fields we read; msgspec skips the rest (id, model, logprobs...) without building them. This
runs once a token, so what it builds is what the client costs.
"""

from __future__ import annotations

import email.utils
import http.cookiejar
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.endpoints import chunks
from cerevisor_tui.endpoints.chunks import (
    Chunk,
    answer_choice,
    has_text,
    progress_of,
    signs,
    timings_of,
    tool_pieces,
    usage_of,
)
from cerevisor_tui.endpoints.errors import (
    RETRYABLE_STATUS,
    EndpointError,
    EndpointHTTPError,
    EndpointUnreachable,
    ProtocolError,
    StreamBroken,
    descriptors_exhausted,
    out_of_descriptors,
)
from cerevisor_tui.endpoints.transport import AsyncioTransport, proxy_mounts
from cerevisor_tui.kinds import DELTA, FINISH, KEEPALIVE, PROGRESS, TIMINGS, TOOL_CALLS, USAGE

MAX_LINE_BYTES = 1 << 20  # one SSE line longer than this is a protocol error, not a memory leak
MAX_ERROR_BODY_BYTES = 64 << 10

# What the stream yields: (kind, payload), the kinds as cerevisor_tui/kinds.py defines them (KEEPALIVE, DELTA,
# USAGE, FINISH, PROGRESS); imported from here by the worker, the probe and the engine. What a chunk is, and what
# in it is a sign of life, is endpoints/chunks.py's (the gateway reads relayed chat chunks by the same rules).

_decode_chunk = chunks.decode_chunk
_UNSET = chunks.UNSET


KEEPALIVE_EXPIRY_S = 4.0


class _NoCookies(http.cookiejar.CookieJar):
    """A jar that keeps nothing. One client serves every agent of an endpoint and every gateway session sent to it: a
    cookie an upstream sets (a hosted API's load balancer: Cloudflare's __cf_bm, a sticky session's) would go with
    every later request, whoever's it is."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        pass

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        pass


def build_client(concurrency: int, api_key: str | None = None) -> httpx.AsyncClient:
    """An httpx client sized for the run: no pool cap below the concurrency, no pool or read timeout.

    The stall watchdog owns time; an httpx read timeout would fire on an honest slow cold start and
    would never fire on a wedged model behind keep-alives.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # an idle connection is kept until a little before the servers close theirs (uvicorn's default, vLLM's and
    # SGLang's, and llama-server's: 5 s): one kept longer meets the server's close as a request goes out on it, a
    # "connection reset" the gateway cannot retry (the request may have reached the server)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(concurrency, 10),
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    return httpx.AsyncClient(
        # reads without a loop trip when data is already there (endpoints/transport.py, endpoints/network.py)
        transport=AsyncioTransport(limits),
        mounts=proxy_mounts(limits),  # a client with its own transport reads no proxies from the environment
        timeout=httpx.Timeout(connect=None, read=None, write=None, pool=None),
        headers=headers,
        cookies=_NoCookies(),
        follow_redirects=False,
    )


def is_refused(exc: BaseException) -> bool:
    """A connection the server side refused (port not open yet): what a loading vLLM looks like; not one this
    process could not open (out of file descriptors)."""
    return isinstance(exc, httpx.ConnectError) and not descriptors_exhausted(exc)


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
    cached_tokens: int | None = None  # of the prompt, from the prefix cache, where the server says
    timings: tuple[float | None, float | None] | None = None  # llama.cpp's (prompt_ms, predicted_per_token_ms)
    _done: bool = field(default=False, repr=False)
    _network: Any = field(default=None, repr=False)  # the connection, once the response has begun

    def abort(self) -> None:
        """Drop the connection now (a kill): the server sees it go at once, whenever this task next runs. The
        cancellation that follows closes the response as usual; this only makes the server's side prompt."""
        abort = getattr(self._network, "abort", None)  # our backend's streams (endpoints/network.py) have one
        if abort is not None:
            abort()

    async def events(self) -> AsyncGenerator[tuple[int, Any]]:
        try:
            try:
                async with self.client.stream("POST", self.url, json=self.body, headers=self.headers) as response:
                    self._network = response.extensions.get("network_stream")  # httpx's documented extension
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
                if descriptors_exhausted(exc):
                    raise out_of_descriptors(self.endpoint, self.url) from exc
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
        lenient = self._lenient_chunk
        decode = _decode_chunk
        decode_error = msgspec.DecodeError
        unset = _UNSET
        data: list[bytes] = []  # the current event's data: lines, whole
        event_name = b""
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
                    payload = data[0][5:]  # and the space after "data:" with it: JSON may start with spaces
                    is_error = False
                else:
                    payload = b"\n".join([_data_value(part) for part in data])
                    is_error = event_name == b"error"
                    event_name = b""
                data.clear()
                # self._read, inlined (this runs once a token), with [DONE] looked for only where msgspec fails
                try:
                    chunk = decode(payload)
                except (decode_error, RecursionError):  # (nested past msgspec's depth: lenient says so)
                    payload = payload.strip()
                    if payload == b"[DONE]":
                        if pend:
                            yield _merged(pend, pend_slot)
                        self._done = True
                        return
                    chunk = None
                # (chunks.says_error, inlined: a call per token is measurable here)
                if chunk is None or is_error or chunk.error is not unset or (
                        not chunk.choices and b'"error"' in payload):
                    try:
                        chunk = lenient(payload, is_error)
                    except EndpointError:
                        if pend:  # what came before a bad chunk is the partial answer
                            yield _merged(pend, pend_slot)
                        raise
                # the common chunk: one piece of content or of reasoning, and nothing else (chunks.signs, inlined
                # for it; any other chunk goes to _items)
                choices = chunk.choices
                if choices and chunk.usage is None:
                    first = choices[0]
                    choice = answer_choice(choices) if first.index else first
                    if (choice is not None and (delta := choice.delta) is not None and choice.finish_reason is None
                            and not delta.tool_calls):
                        text = delta.content
                        reasoning = delta.reasoning_content or delta.reasoning
                        if text and not reasoning:
                            slot = 0
                        elif reasoning and not text:
                            text, slot = reasoning, 1
                        else:
                            text, slot = "", 0
                        if text:
                            self.tokens += 1
                            if pend and pend_slot != slot:
                                yield _merged(pend, pend_slot)
                                pend = []
                            pend_slot = slot
                            pend.append(text)
                            continue
                for kind, value in self._items(chunk):
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
            for item in self._items(self._read(payload, event_name == b"error")):
                yield item
        if not self._done and not self.finish_reason:
            raise StreamBroken(
                endpoint, f"stream ended without [DONE] and without a finish reason after {self.tokens} tokens"
            )

    def _read(self, payload: bytes, is_error: bool) -> Chunk:
        """The chunk in one event's data; raises the EndpointError it stands for (a server error, bad JSON)."""
        try:
            chunk = _decode_chunk(payload)
        except (msgspec.DecodeError, RecursionError):  # not JSON msgspec takes, a field of another type, too deep
            return self._lenient_chunk(payload, is_error)
        if is_error or chunks.says_error(chunk, payload):
            return self._lenient_chunk(payload, is_error)  # raises, with the server's own message
        return chunk

    def _lenient_chunk(self, payload: bytes, is_error: bool) -> Chunk:
        """An event the typed decoder refused, or an error event: the EndpointError it stands for, or the chunk.

        json.loads takes what msgspec refuses and a server may still send: NaN and Infinity (a Python server's
        logprobs), lone surrogates in escapes. Its object becomes a `Chunk` by the same rules, so a field of
        the wrong type is an error that says where, never an exception from deep in the engine.
        """
        try:
            obj = json.loads(payload)
        except UnicodeDecodeError:
            raise ProtocolError(self.endpoint, "stream is not valid UTF-8") from None
        except RecursionError:  # an event no API sends, and no reader should walk
            raise ProtocolError(self.endpoint, f"a stream event nested too deep to read after {self.tokens} tokens") \
                from None
        except ValueError:
            raise ProtocolError(self.endpoint, f"malformed JSON in stream after {self.tokens} tokens: "
                                f"{self._shown(payload)!r}") from None
        if not isinstance(obj, dict):
            raise ProtocolError(self.endpoint, f"stream event is not a JSON object: {self.scrubber()(str(obj))[:80]!r}")
        if is_error or "error" in obj or obj.get("object") == "error":
            raise _stream_error(self.endpoint, obj, self.tokens, self.scrubber())
        try:
            return msgspec.convert(obj, Chunk)
        except msgspec.ValidationError as exc:
            # msgspec names the field: "Expected `str | null`, got `int` - at `$.choices[0].delta.content`"
            raise ProtocolError(self.endpoint, f"unexpected chunk in stream after {self.tokens} tokens ({exc}): "
                                f"{self._shown(payload)!r}") from None

    def _shown(self, payload: bytes) -> str:
        """The start of a bad event, for an error message: scrubbed before it is cut, as a key cut in half
        would pass the scrubber."""
        return self.scrubber()(payload.decode("utf-8", "replace"))[:80]

    def _items(self, chunk: Chunk) -> list[tuple[int, Any]]:
        """What any chunk yields: its delta, its finish reason, its usage, or a keep-alive when it has none."""
        out: list[tuple[int, Any]] = []
        choice = answer_choice(chunk.choices) if chunk.choices else None
        if choice is not None:
            delta = choice.delta
            if choice.message is not None and (delta is None or not has_text(delta)):
                delta = choice.message  # a whole chat.completion (a server that ignored stream: true)
            if delta is not None:
                content, reasoning, tool = signs(delta)
                if content or reasoning or tool:
                    self.tokens += 1
                    out.append((DELTA, (content, reasoning, tool, 1)))
                pieces = tool_pieces(delta.tool_calls) if delta.tool_calls else ()
                if pieces:  # the pieces, for the agent loop to put each call together
                    out.append((TOOL_CALLS, pieces))
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
                out.append((FINISH, choice.finish_reason))
        usage = usage_of(chunk.usage) if chunk.usage is not None else None
        if usage is not None:
            prompt, completion, cached = usage
            self.usage = (prompt, completion)
            if cached is not None:
                self.cached_tokens = cached
                out.append((USAGE, usage))
            else:
                out.append((USAGE, self.usage))
        timings = timings_of(chunk.timings) if chunk.timings is not None else None
        if timings is not None:
            self.timings = timings
            out.append((TIMINGS, timings))
        progress = progress_of(chunk.prompt_progress) if chunk.prompt_progress is not None else None
        if progress is not None:  # a sign of life of the prefill, not a token (when its numbers can be true)
            out.append((PROGRESS, progress))
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
        for item in self._items(self._read(raw, False)):
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


async def _read_bounded(response: httpx.Response, limit: int) -> bytes:
    out = bytearray()
    async for chunk in response.aiter_bytes():
        out += chunk
        if len(out) >= limit:
            break
    return bytes(out[:limit])


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


async def list_models(client: httpx.AsyncClient, endpoint: str, base_url: str,
                      timeout_s: float | None = None) -> list[dict[str, Any]]:
    """GET {base_url}/models: the served models (vLLM adds max_model_len). `timeout_s`: for each of its
    connect, write and read, over the client's (which has none: a chat request's deadlines are the watchdog's)."""
    url = base_url.rstrip("/") + "/models"
    scrub = request_scrubber(client.headers)
    try:
        response = await client.get(url, timeout=httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s)
    except httpx.ConnectError as exc:
        if descriptors_exhausted(exc):
            raise out_of_descriptors(endpoint, scrub(url)) from exc
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
