"""The gateway's HTTP face: an ASGI app (served by uvicorn inside the run's process) that passes the three APIs
through to the run's endpoints, each request an attempt of its session, governed by the run.

One request's way through (`Exchange`): checked (key, size, JSON, model), named (gateway/identity.py), admitted
(its session's slot, engine/sessions.py), sent upstream, and its answer relayed: the upstream's SSE bytes
reach the client as they came, cut only at frame ends, while a copy is read for signs of life, tokens and
usage (gateway/apis.py). While it waits, a streamed request gets an SSE comment every `keepalive_s`. The
watchdog's deadline, the operator's kill and the run's stop end it with an error in the API's own shape; a
client that goes away ends its upstream request at once, in every window.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hmac
import os
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import msgspec

from cerevisor_tui.config.models import GatewayConfig
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.conversation import CONTEXT_WARN_FILL
from cerevisor_tui.engine.prefill import Prefill
from cerevisor_tui.engine.sessions import Dropped, RunStopping, Session
from cerevisor_tui.gateway import apis
from cerevisor_tui.gateway.apis import KEEPALIVE, Api, Reading
from cerevisor_tui.gateway.identity import harness, identify

if TYPE_CHECKING:
    from cerevisor_tui.engine.engine import Engine
    from cerevisor_tui.engine.state import Attempt

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# the client's headers that never go upstream: its credential, hop-by-hop ones, and what httpx sets itself
_DROPPED = frozenset({b"host", b"content-length", b"authorization", b"x-api-key", b"cookie", b"connection",
                      b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"proxy-authorization",
                      b"proxy-connection", b"accept-encoding", b"x-request-id", b"expect", b"trailer"})
ERROR_BODY_LIMIT = 1 << 20  # what is read of an upstream's error body
WAIT_BACKOFF_S = (0.25, 5.0)  # a local endpoint still loading: reconnect after 0.25 s, doubling to 5 s
RETRY_AFTER_S = 5  # told to a client when the upstream is down
CONTEXT_LIMIT_WAIT_S = 2.0  # the longest a session's meters wait for the endpoint's /v1/models


class GatewayError(Exception):
    """The gateway cannot start: one line says why."""


class Refusal(Exception):
    """A request the gateway answers itself, before anything is sent upstream."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def client_keys(settings: GatewayConfig) -> list[tuple[str, bytes]]:
    """The accepted client keys, each with the name of the variable that holds it. Raises GatewayError for a
    variable that is not set."""
    keys = []
    for name in settings.keys_env:
        value = os.environ.get(name, "")
        if not value.strip():
            raise GatewayError(f"[gateway] keys_env: environment variable {name} is not set")
        keys.append((name, value.strip().encode()))
    return keys


class Gateway:
    """The ASGI app. `engine` is the run that governs it; `model` (`--model`) sends every request to one model."""

    def __init__(self, engine: Engine, settings: GatewayConfig, *, model: str = "") -> None:
        self.engine = engine
        self.settings = settings
        self.model = model
        self.keys = client_keys(settings)
        self.max_body = int(settings.max_body_mib * (1 << 20))
        self.upstream = settings.upstream or engine.config.endpoints[0].name
        self.passed = 0  # other /v1/* requests passed through ungoverned
        self.refused = 0  # requests the gateway answered itself (401, 400, 404, 413, 503)

    # ---- ASGI ---------------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return
        if scope["type"] != "http":
            return
        await self.engine.sessions.ready.wait()  # the run's connections are open (a request may come before)
        path = scope["path"]
        label = ""
        if path.startswith("/a/"):  # a path label: /a/NAME/v1/..., cut in the raw path (NAME may hold a %2F)
            raw = scope.get("raw_path") or path.encode()
            head, _, rest = raw[3:].partition(b"/")
            label = urllib.parse.unquote(head.decode("latin-1"))
            path = "/" + urllib.parse.unquote(rest.decode("latin-1"))
        if not path.startswith("/v1/"):
            await _answer(send, 404, apis.error_body(None, 404, f"no such path {path!r}: the gateway serves /v1/*"))
            return
        api = apis.PATHS.get(path[3:]) if scope["method"] == "POST" else None
        try:
            key = self._check_key(scope)
            if api is None:
                await self._pass(scope, receive, send, path)
                return
            body = await self._body(scope, receive, api)
        except Refusal as exc:
            self.refused += 1
            await _answer(send, exc.status, apis.error_body(api, exc.status, exc.message), exc.headers)
            return
        await Exchange(self, scope, receive, send, api, body, label=label, key=key).run()

    def _check_key(self, scope: Scope) -> str:
        """The name of the client key the request carries; "" when none is asked. Refusal 401 otherwise."""
        if not self.keys:
            return ""
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
            elif name == b"x-api-key" and not given:
                given = value.strip()
        found = ""
        for name, key in self.keys:  # each compared in constant time, and every one compared
            if hmac.compare_digest(given, key) and not found:
                found = name
        if not found:
            raise Refusal(401, "missing or wrong API key for this gateway (send Authorization: Bearer KEY or "
                               "x-api-key: KEY, with a key from its keys_env)")
        return found

    async def _body(self, scope: Scope, receive: Receive, api: Api) -> tuple[bytes, dict[str, Any]]:
        limit = self.max_body
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise Refusal(413, f"request body of {int(value):,} bytes is over the gateway's limit of "
                                   f"{limit:,} ([gateway] max_body_mib)")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refusal(499, "the client went away")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise Refusal(413, f"request body over the gateway's limit of {limit:,} bytes "
                                   "([gateway] max_body_mib)")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise Refusal(400, f"the request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise Refusal(400, "the request body must be a JSON object")
        return raw, body

    # ---- models and routes --------------------------------------------------------------------------------
    def served_models(self) -> dict[str, str]:
        """Each model the run's endpoints serve, with the endpoint (or the pool) that serves it."""
        e = self.engine
        served: dict[str, str] = {}
        for pool in e.config.pools:
            for member in pool.endpoints:
                if member in e.models:
                    served.setdefault(e.models[member], pool.name)
        for name, model in e.models.items():
            served.setdefault(model, name)
        return served

    def route(self, asked: str) -> tuple[str, str]:
        """The model sent upstream for `asked` and the endpoint or pool that serves it. Refusal 404 when it is
        neither served nor mapped."""
        model = self.model or next((served for glob, served in self.settings.model_map.items()
                                    if fnmatch.fnmatchcase(asked, glob)), asked)
        served = self.served_models()
        if model in served:
            return model, served[model]
        default_known = any(name in self.engine.models for name in self._members(self.upstream))
        if not default_known:  # its model is not known yet (a server still loading): it goes there as asked
            return model, self.upstream
        listed = ", ".join(sorted(served)) or "none"
        raise Refusal(404, f"model {asked!r} is not served here (served: {listed}); map it with [gateway] model_map "
                           "or start the gateway with --model")

    def _members(self, name: str) -> list[str]:
        pool = self.engine.config.pool(name)
        return list(pool.endpoints) if pool is not None else [name]

    async def resolve_models(self) -> None:
        """Ask each endpoint once which model it serves (those the config does not name), so routes know."""
        e = self.engine
        for ep in e.config.endpoints:
            if ep.name not in e.models:
                with contextlib.suppress(Exception), anyio.move_on_after(5):
                    await e.connections.model(ep)

    # ---- everything else under /v1 -------------------------------------------------------------------------
    async def _pass(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """A /v1/* request the gateway does not govern (GET /v1/models among them): passed to the upstream
        and back as it is, as it comes (a streamed /v1/completions streams), counted; a client that goes away
        ends it."""
        self.passed += 1
        e = self.engine
        endpoint = self._members(self.upstream)[0]
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if sum(map(len, chunks)) > self.max_body:
                raise Refusal(413, "request body over the gateway's limit ([gateway] max_body_mib)")
            if not message.get("more_body"):
                break
        url = e.connections.base_urls[endpoint].rstrip("/") + path[3:]
        query = scope.get("query_string", b"").decode("latin-1")
        headers = _upstream_headers(scope["headers"])
        client = e.connections.clients[endpoint]
        request = client.build_request(scope["method"], url + (f"?{query}" if query else ""),
                                       content=b"".join(chunks), headers=headers)
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise Refusal(503, f"upstream {endpoint} is not answering: {_problem(exc)}",
                          {"retry-after": str(RETRY_AFTER_S)}) from None
        try:
            async with anyio.create_task_group() as group:

                async def watch_client() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(watch_client)
                content_type = response.headers.get("content-type", "application/json")
                await send({"type": "http.response.start", "status": response.status_code,
                            "headers": [(b"content-type", content_type.encode("latin-1"))]})
                with contextlib.suppress(httpx.HTTPError):  # cut short upstream: the client sees it cut short
                    async for chunk in response.aiter_raw():
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()


class Exchange:
    """One governed request, from its check to its last byte."""

    def __init__(self, gateway: Gateway, scope: Scope, receive: Receive, send: Send, api: Api,
                 body: tuple[bytes, dict[str, Any]], *, label: str, key: str) -> None:
        self.gw, self.scope, self.receive, self._send, self.api = gateway, scope, receive, send, api
        self.raw, self.body = body
        self.label, self.key = label, key
        self.headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        self.streamed = self.body.get("stream") is True
        self.started = False  # the response's headers went out
        self.done = False  # its last byte went out
        self.gone = False  # the client went away
        self.last_write = time.monotonic()
        # taken for every frame written: uncontended, it must not yield to the loop as anyio's default does
        self.lock = anyio.Lock(fast_acquire=True)
        self.reading = Reading(api)
        self.status = 0
        self.attempt: Attempt | None = None
        self.conversation = ""  # the fingerprint of the conversation it continues (its transcript's count)
        self.hide_progress = False  # prompt_progress was asked for the watchdog, not by the client: not relayed
        self.role_sent = False  # with hide_progress: the first progress frame went on, as a role-only chunk

    # ---- writing to the client -----------------------------------------------------------------------------
    async def start(self, status: int, content_type: str, extra: dict[str, str] | None = None) -> None:
        headers = [(b"content-type", content_type.encode("latin-1"))]
        if content_type.startswith("text/event-stream"):
            headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (extra or {}).items()]
        self.started = True
        self.status = status
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, data: bytes, *, last: bool = False) -> None:
        if self.done:
            return
        self.last_write = time.monotonic()
        self.done = last
        await self._send({"type": "http.response.body", "body": data, "more_body": not last})

    async def fail(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        """End the request with an error in the API's own shape: a status and body before the headers went out,
        an error event after."""
        async with self.lock:
            if self.done or self.gone:
                return
            if not self.started:
                await self.start(status, "application/json", headers)
                await self.write(apis.error_body(self.api, status, message), last=True)
            else:
                await self.write(apis.error_frame(self.api, status, message), last=True)

    async def finish(self) -> None:
        async with self.lock:
            if not self.done and not self.gone:
                if not self.started:
                    await self.start(200, "application/json")
                await self.write(b"", last=True)

    # ---- the exchange --------------------------------------------------------------------------------------
    async def run(self) -> None:
        gw = self.gw
        e = gw.engine
        try:
            asked = self.body.get("model")
            if not isinstance(asked, str) or not asked:
                raise Refusal(400, "the request names no model")
            model, where = gw.route(asked)
        except Refusal as exc:
            gw.refused += 1
            await self.fail(exc.status, exc.message, exc.headers)
            return
        name, source = identify(self.api, self.headers, self.body, label=self.label, key=self.key)
        session = e.sessions.open(name, source=source, harness=harness(self.headers.get("user-agent", "")),
                                  api=self.api, endpoint=where, key=self.key)
        self.model_asked, self.model_sent = asked, model
        with anyio.CancelScope() as whole:
            async with anyio.create_task_group() as group:
                group.start_soon(self._watch_client, whole)
                if self.streamed:
                    group.start_soon(self._keepalives)
                try:
                    await self._governed(session)
                finally:
                    group.cancel_scope.cancel()
        att = self.attempt
        if self.gone and att is not None:  # its upstream request was closed with it: the server aborts it
            st = session.st
            self._record_answer(session, att, partial=True)
            e.emit(ev.TurnFinished(time.monotonic(), st.name, att.number, att.turn, 0, 0, att.tokens, "client gone",
                                   None, time.monotonic() - att.sent_at))

    async def _watch_client(self, whole: anyio.CancelScope) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                if not self.done:
                    self.gone = True
                    whole.cancel()
                return

    async def _keepalives(self) -> None:
        """While nothing else goes to the client, an SSE comment every keepalive_s (the first only after
        keepalive_s: a quick error keeps its HTTP status)."""
        every = self.gw.settings.keepalive_s
        while True:
            await anyio.sleep(max(0.0, self.last_write + every - time.monotonic()))
            async with self.lock:
                if self.done or self.gone:
                    return
                if time.monotonic() - self.last_write < every * 0.999:
                    continue
                if not self.started:
                    await self.start(200, "text/event-stream; charset=utf-8")
                await self.write(KEEPALIVE)

    async def _governed(self, session: Session) -> None:
        e = self.gw.engine
        st = session.st
        self._record_inputs(session)
        try:
            async with e.sessions.request(session, model_asked=self.model_asked, model_sent=self.model_sent) as att:
                self.attempt = att
                self._tell_inputs(session, att)
                with anyio.CancelScope() as att.scope:
                    await self._upstream(session, att, att.request_id)
                if att.kill_reason:
                    self._record_answer(session, att, partial=True)
                    if att.by_operator:
                        await self.fail(503, f"cerevisor gateway: {att.kill_reason}")
                    elif att.kill_deadline == "wedge":  # its server is wedged (engine/wedge.py): the reason says so
                        await self.fail(504, f"cerevisor gateway: the request was ended: {att.kill_reason}")
                    else:
                        await self.fail(504, f"cerevisor gateway: the request was ended at its {att.kill_deadline} "
                                             f"deadline ({att.kill_reason})")
        except RunStopping as exc:
            await self.fail(503, f"cerevisor gateway: the run is stopping ({exc}); nothing was sent upstream",
                            {"retry-after": str(RETRY_AFTER_S)})
        except Dropped as exc:
            await self.fail(503, f"cerevisor gateway: {exc} while queued; nothing was sent upstream")
        finally:
            if self.attempt is None:  # never sent: its messages are still new for its next try
                self._tell_inputs(session, None)
            if st.status == "waiting" and st.current is None:
                st.status = "idle"

    async def _upstream(self, session: Session, att: Attempt, rid: str) -> None:
        e = self.gw.engine
        st = session.st
        endpoint = st.endpoint
        ep = e.endpoints[endpoint]
        client = e.connections.clients[endpoint]
        url = e.connections.base_urls[endpoint].rstrip("/") + next(p for p, a in apis.PATHS.items() if a == self.api)
        headers = _upstream_headers(self.scope["headers"])
        headers["x-request-id"] = rid
        if ep.session_header:
            headers[ep.session_header.lower()] = session.name
        if self.api == "messages" and "authorization" in client.headers:
            headers["x-api-key"] = client.headers["authorization"].removeprefix("Bearer ")
        content = self.raw if self.model_sent == self.model_asked else \
            msgspec.json.encode(apis.set_model(self.body, self.model_sent))
        if (self.api == "chat" and self.streamed and "return_progress" not in self.body
                and await e.connections.asks_progress(ep)):
            # llama-server's prompt_progress, for the watchdog; this client did not ask: it never sees them
            content = msgspec.json.encode({**msgspec.json.decode(content), "return_progress": True})
            self.hide_progress = True
        wait_s = WAIT_BACKOFF_S[0]
        while True:
            request = client.build_request("POST", url, content=content, headers=headers)
            try:
                response = await client.send(request, stream=True)
                break
            except httpx.HTTPError as exc:
                if ep.kind == "hosted" or not isinstance(exc, httpx.ConnectError):
                    await self.fail(503, f"cerevisor gateway: upstream {endpoint} is not answering: {_problem(exc)}",
                                    {"retry-after": str(RETRY_AFTER_S)})
                    return
                # a local server still loading refuses its port: the request waits, kept alive, within its
                # first-byte window (the watchdog ends it there)
                st.status = "waiting"
                e.emit(ev.EndpointWaiting(time.monotonic(), st.name, att.number, endpoint, _problem(exc), wait_s))
                await anyio.sleep(wait_s)
                wait_s = min(wait_s * 2, WAIT_BACKOFF_S[1])
        try:
            att.stream = _Upstream(response)
            if response.status_code >= 300:
                await self._upstream_error(response)
                return
            if not self.streamed:
                await self._whole(session, att, response)
            else:
                await self._relay(session, att, response)
        except httpx.HTTPError as exc:
            # the upstream broke off its answer (a dropped connection, a cut chunk): the client is told in its
            # API's shape rather than left with a truncated body; a kill's own abort is told as the kill
            if not att.kill_reason:
                self._record_answer(session, att, partial=True)
                await self.fail(502, f"cerevisor gateway: upstream {endpoint} broke off its answer after "
                                     f"{att.tokens} tokens: {_problem(exc)}")
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()

    async def _upstream_error(self, response: httpx.Response) -> None:
        """The upstream's own error: passed as it is before the headers went out, else as the API's error event."""
        body = b""
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > ERROR_BODY_LIMIT:
                break
        async with self.lock:
            if self.done or self.gone:
                return
            if not self.started:
                extra = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
                await self.start(response.status_code, response.headers.get("content-type", "application/json"),
                                 extra)
                await self.write(body[:ERROR_BODY_LIMIT], last=True)
                return
        reading = Reading(self.api)
        reading.whole(body)
        message = reading.error or body[:300].decode("utf-8", "replace")
        await self.fail(response.status_code, f"upstream answered {response.status_code}: {message}")

    async def _whole(self, session: Session, att: Attempt, response: httpx.Response) -> None:
        chunks = []
        async for chunk in response.aiter_raw():
            now = time.monotonic()
            att.stream.last_byte_at = now
            self._alive(session, att, now)
            chunks.append(chunk)
        data = b"".join(chunks)
        self.reading.whole(data)
        async with self.lock:
            if self.gone:
                return
            await self.start(response.status_code, response.headers.get("content-type", "application/json"),
                             {"x-request-id": att.request_id})
            await self.write(data, last=True)
        await self._finished(session, att)

    async def _relay(self, session: Session, att: Attempt, response: httpx.Response) -> None:
        """The hot path: each read's complete frames go to the client as they came; a copy is read."""
        e = self.gw.engine
        st = session.st
        reading = self.reading
        subscribers = e.subscribers
        monotonic = time.monotonic
        upstream = att.stream
        by_bytes = e.policies[st.endpoint].liveness == "bytes"
        pending = b""
        # the headers go out with the first frame, not with the upstream's (which vLLM sends at once): until
        # then a deadline, a kill or a drop is still an HTTP status, and keep-alives start the stream
        head = (response.status_code, response.headers.get("content-type", "text/event-stream"),
                {"x-request-id": att.request_id})
        async for chunk in response.aiter_raw():
            now = monotonic()
            upstream.last_byte_at = now
            pending += chunk
            end = _frames_end(pending)
            if end == 0:
                continue
            frames, pending = pending[:end], pending[end:]
            if b'"prompt_progress"' in frames and att.first_token_at is None:
                frames = self._progress(st, att, frames, now)
            async with self.lock:
                if not self.started:
                    await self.start(*head)
                await self.write(frames)
            text, reasoning, tool, chunks = reading.frames(frames)
            if chunks:
                self._alive(session, att, now)
                att.tokens += chunks
                st.tokens += chunks
                if text:
                    att.parts.append(text)
                if reasoning:
                    att.thinking.append(reasoning)
                if tool:
                    att.tools.append(tool)
                delta = ev.TokenDelta(now, st.name, att.number, text, reasoning, tool, chunks)
                for subscriber in subscribers:
                    try:
                        subscriber(delta)
                    except Exception as exc:  # as in emit(): no subscriber's failure ends the run
                        e.subscriber_failed(subscriber, delta, exc)
            elif att.first_token_at is None or by_bytes:
                e.emit(ev.KeepAlive(now, st.name, att.number))
                if by_bytes:
                    att.last_alive = now
                    att.alive.set()
        async with self.lock:
            if not self.started:
                await self.start(*head)
            await self.write(pending, last=True)
        await self._finished(session, att)

    def _progress(self, st: Any, att: Attempt, frames: bytes, now: float) -> bytes:
        """The prefill progress in these frames, taken for the watchdog (engine/prefill.py); the frames as the
        client gets them: whole when it asked for prompt_progress, else without it (the first one stays, as the
        role-only chunk it also is, with its prompt_progress taken out)."""
        kept: list[bytes] = []
        for frame in _split_frames(frames):
            progress = _frame_progress(frame)
            if progress is None:
                kept.append(frame)
                continue
            obj, (total, cache, processed, time_ms) = progress
            if att.prefill is None:
                att.prefill = Prefill()
            if att.prefill.see(total, cache, processed, time_ms, now):
                self.gw.engine.emit(att.prefill.event(now, st.name, att.number))
            if not self.hide_progress:
                kept.append(frame)
            elif not self.role_sent:
                self.role_sent = True
                del obj["prompt_progress"]
                kept.append(b"data: " + msgspec.json.encode(obj) + b"\n\n")
        return b"".join(kept)

    def _alive(self, session: Session, att: Attempt, now: float) -> None:
        st = session.st
        att.last_alive = now
        if att.first_token_at is None:
            att.first_token_at = now
            ttft = now - att.sent_at
            if st.ttft_s is None:
                st.ttft_s = ttft
            att.alive.set()
            self.gw.engine.emit(ev.FirstToken(now, st.name, att.number, att.turn, ttft))
        if st.status != "streaming":
            st.status = "streaming"

    async def _finished(self, session: Session, att: Attempt) -> None:
        """The answer went out whole: the turn's figures, its message in the transcript, the session's meters."""
        e = self.gw.engine
        st = session.st
        r = self.reading
        end = time.monotonic()
        completion = r.completion_tokens or r.chunks
        st.prompt_tokens += r.prompt_tokens
        st.completion_tokens += completion
        if att.first_token_at is not None:
            st.decode_s += end - att.first_token_at
        ttft = att.first_token_at - att.sent_at if att.first_token_at is not None else None
        self._record_answer(session, att)
        e.emit(ev.TurnFinished(end, st.name, att.number, st.turn, 0, r.prompt_tokens, completion, r.finish, ttft,
                               end - att.sent_at))
        if r.cached_tokens is not None:
            st.cached_tokens += r.cached_tokens
        st.context_tokens = r.prompt_tokens + completion
        st.last_prompt_tokens, st.last_completion_tokens, st.turns_done = r.prompt_tokens, completion, st.turn
        ep = e.endpoints[st.endpoint]
        cost = ep.cost_usd(r.prompt_tokens, completion)
        st.cost_usd += cost
        e.conversations.run_cost_usd += cost
        # asked once per endpoint, 0 when the server does not say; bounded, since the request counts as in flight,
        # watched by its idle deadline, until this returns, and its answer has already gone out
        limit = 0
        with anyio.move_on_after(CONTEXT_LIMIT_WAIT_S):
            limit = await e.connections.context_limit(ep)
        fill = st.context_tokens / limit if limit else 0.0
        warning = f"context {fill:.0%} full ({st.context_tokens:,} of {limit:,} tokens)" if fill >= CONTEXT_WARN_FILL \
            else ""
        e.emit(ev.AgentMeters(time.monotonic(), st.name, st.turn, r.prompt_tokens, r.cached_tokens, st.context_tokens,
                              limit, round(st.cost_usd, 6), round(e.run_cost_usd, 6), warning))

    # ---- transcripts ---------------------------------------------------------------------------------------
    def _record_inputs(self, session: Session) -> None:
        """The request's new messages (those the session's transcript does not have yet), as the client sent
        them; the whole history is never written again. Told once the request has its attempt (`_tell_inputs`)."""
        system, conversation = apis.conversation(self.api, self.body)
        messages = apis.history(self.api, self.body)
        # counted per conversation, so that a side request never makes the main one's history look new; its
        # model left out, as a harness may switch models mid-conversation
        self.conversation = apis.fingerprint("", system, conversation)
        recorded = session.recorded.get(self.conversation)
        if recorded is None:  # its first request here; a resumed run's session has its history before recorded
            recorded = apis.answered(messages) if session.resumed else 0
        if self.api == "responses" and self.body.get("previous_response_id"):
            new = conversation  # the server keeps the history: every item is new
        elif len(messages) >= recorded:
            new = messages[recorded:]
        else:  # the harness rewrote its history (a compaction): its last message is what is new
            new = messages[-1:]
        self.new_inputs = new
        self.recorded_before = recorded
        session.recorded[self.conversation] = len(messages)  # at once: a request beside it does not take them too

    def _tell_inputs(self, session: Session, att: Attempt | None) -> None:
        """The request's new messages into its transcript, numbered as its attempt once it has one; a request that
        was never sent gives them back, so its next try records them."""
        if att is None:
            if session.recorded.get(self.conversation) == self.recorded_before + len(self.new_inputs):
                session.recorded[self.conversation] = self.recorded_before
            return
        e = self.gw.engine
        for message in self.new_inputs:
            e.emit(ev.MessageRecorded(time.monotonic(), session.name, att.number, att.turn, apis.role_of(message),
                                      apis.text_of(message.get("content", message.get("output", ""))), raw=message))

    def _record_answer(self, session: Session, att: Attempt, *, partial: bool = False) -> None:
        e = self.gw.engine
        st = session.st
        r = self.reading
        if partial and not (r.text or r.reasoning or r.tools):
            return
        e.emit(ev.MessageRecorded(time.monotonic(), st.name, att.number, att.turn, "assistant", r.answer,
                                  "".join(r.reasoning), partial=partial))
        if not partial:  # the client sends the answer back with its next request: one message, or its items
            session.recorded[self.conversation] = session.recorded.get(self.conversation, 0) + (r.items or 1)


class _Upstream:
    """What the watchdog sees of an upstream response: when its last byte came, and how to drop it at once."""

    def __init__(self, response: httpx.Response) -> None:
        self.last_byte_at = 0.0
        self._network = response.extensions.get("network_stream")

    def abort(self) -> None:
        abort = getattr(self._network, "abort", None)
        if abort is not None:
            abort()


def _frames_end(data: bytes) -> int:
    """Where the last complete SSE frame in `data` ends (0: none is complete yet)."""
    end = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(end + 2 if end >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _split_frames(data: bytes) -> list[bytes]:
    """Complete SSE frames, each with its blank line."""
    data = data.replace(b"\r\n", b"\n")
    return [part + b"\n\n" for part in data.split(b"\n\n") if part]


def _frame_progress(frame: bytes) -> tuple[dict[str, Any], tuple[int, int, int, int]] | None:
    """A frame that carries llama-server's prompt_progress: its JSON and (total, cache, processed, time_ms)."""
    if b'"prompt_progress"' not in frame:
        return None
    data = b"\n".join(line[5:].lstrip(b" ") for line in frame.split(b"\n") if line.startswith(b"data:"))
    try:
        obj = msgspec.json.decode(data)
        p = obj["prompt_progress"]
        return obj, (int(p["total"]), int(p.get("cache", 0)), int(p["processed"]), int(p.get("time_ms", 0)))
    except (msgspec.DecodeError, KeyError, TypeError, ValueError):
        return None  # not the shape we know: relayed as it came


def _upstream_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in raw
               if name.lower() not in _DROPPED}
    headers["accept-encoding"] = "identity"  # the bytes relayed are the bytes read: no compression between
    return headers


def _problem(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]


async def _answer(send: Send, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
    raw = [(b"content-type", b"application/json")]
    raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items() if k != "content-type"]
    if headers and "content-type" in headers:
        raw[0] = (b"content-type", headers["content-type"].encode("latin-1"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
