"""One governed request of the gateway, from its check to its last byte (`Exchange`): named (gateway/identity.py),
admitted (its session's slot, engine/sessions.py), sent upstream, and its answer relayed: the upstream's SSE bytes
reach the client as they came, cut only at frame ends (gateway/sse.py), while a copy is read (gateway/apis.py) and
told to the attempt owner (engine/attempt.py), which counts, scrubs and meters it as it does a workflow agent's.
While it waits, a streamed request gets an SSE comment every `keepalive_s`. The watchdog's deadline, the operator's
kill and the run's stop end it with an error in the API's own shape; a client that goes away ends its upstream
request at once, in every window.

It talks to the run through `RunPorts` alone (its sessions, the attempt owner, its events, its endpoints and its
clock), and to the gateway that took the request through `Front`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import httpx
import msgspec

from cerevisor_tui.config.models import Config, EndpointConfig, GatewayConfig, ResolvedStall
from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.client import is_refused
from cerevisor_tui.engine.attempt import Answer, Attempts
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.connections import Connections
from cerevisor_tui.engine.endpoint_state import EndpointStates
from cerevisor_tui.engine.placement import Placement
from cerevisor_tui.engine.sessions import (
    BudgetSpent,
    Dropped,
    RunStopping,
    Session,
    Sessions,
    TooManySessions,
)
from cerevisor_tui.engine.status import move
from cerevisor_tui.gateway import apis
from cerevisor_tui.gateway.apis import KEEPALIVE, Api, Reading
from cerevisor_tui.gateway.edge import (
    ERROR_BODY_LIMIT,
    RETRY_AFTER_S,
    WAIT_BACKOFF_S,
    Receive,
    Refusal,
    Scope,
    Send,
    problem_of,
    upstream_headers,
)
from cerevisor_tui.gateway.identity import harness_of, identify, title, topic
from cerevisor_tui.gateway.sse import Frames, FrameTooLong, frame_progress, split_frames, without_usage_chunks

if TYPE_CHECKING:
    from cerevisor_tui.engine.state import Attempt


@dataclass(frozen=True, slots=True)
class RunPorts:
    """What the gateway uses of the run that serves it (made by gateway/serve.py from the run's parts)."""

    sessions: Sessions
    attempts: Attempts
    emit: Callable[[ev.Event], None]
    endpoints: Mapping[str, EndpointConfig]
    policies: Mapping[str, ResolvedStall]
    connections: Connections
    clock: Clock
    states: EndpointStates  # each endpoint's state: a port that never answered and refuses past its grace is down
    scrub: Scrubber  # the run's keys, taken out of every byte to a client and every log line
    config: Config  # its endpoints and pools: where a request may go
    placement: Placement  # which pool members are down or degraded


class Front(Protocol):
    """What an exchange asks of the gateway that took its request (gateway/server.py `Gateway`)."""

    settings: GatewayConfig
    refused: int
    run: RunPorts

    def route(self, asked: str) -> tuple[str, str]: ...


class Exchange:
    """One governed request, from its check to its last byte."""

    def __init__(self, gateway: Front, scope: Scope, receive: Receive, send: Send, api: Api,
                 body: tuple[bytes, dict[str, Any]], *, label: str, key: str) -> None:
        self.gw, self.scope, self.receive, self._send, self.api = gateway, scope, receive, send, api
        self.run_ports = gateway.run
        self.now = gateway.run.clock.now
        self.raw, self.body = body
        self.label, self.key = label, key
        self.headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        self.streamed = self.body.get("stream") is True
        # the prompt's size in characters, read once (a harness's late turn is ~560 KB): the prefill's estimate and
        # the endpoint's tokens per character both take it
        self.prompt_chars = apis.prompt_chars(api, self.body)
        self.started = False  # the response's headers went out
        self.done = False  # its last byte went out
        self.gone = False  # the client went away
        self.last_write = self.now()
        # taken for every frame written: uncontended, it must not yield to the loop as anyio's default does
        self.lock = anyio.Lock(fast_acquire=True)
        self.reading = Reading(api)
        self.status = 0
        self.attempt: Attempt | None = None
        self.conversation = ""  # the fingerprint of the conversation it continues (its transcript's count)
        self.hide_progress = False  # prompt_progress was asked for the watchdog, not by the client: not relayed
        self.hide_usage = False  # chat's usage chunk was asked for the meters, not by the client: not relayed
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
        self.last_write = self.now()
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
        e = self.run_ports
        try:
            asked = self.body.get("model")
            if not isinstance(asked, str) or not asked:
                raise Refusal(400, "the request names no model")
            model, where = gw.route(asked)
        except Refusal as exc:
            gw.refused += 1
            await self.fail(exc.status, exc.message, exc.headers)
            return
        name, source, own = identify(self.api, self.headers, self.body, label=self.label, key=self.key)
        # who it is and what its row shows are read from a session's first request only (a body may be ~560 KB)
        first = e.sessions.own_name(name, self.key) not in e.sessions.by_name
        who = harness_of(self.headers.get("user-agent", ""), self.api, self.body) if first else ""
        try:
            session = e.sessions.open(name, source=source, harness=who, api=self.api, endpoint=where, key=self.key,
                                      title=title(name, source, who) if first else "",
                                      topic=topic(self.api, self.body, who) if first else "", own_id=own)
        except TooManySessions as exc:
            gw.refused += 1
            await self.fail(429, f"cerevisor gateway: {exc}", {"retry-after": str(RETRY_AFTER_S)})
            return
        self.model_asked, self.model_sent = asked, model
        # the request's one task group: its client watcher, and its attempt's watchdog (engine/sessions.py); a client
        # gone cancels the group's scope, which ends the whole exchange
        async with anyio.create_task_group() as group:
            group.start_soon(self._watch_client, group.cancel_scope)
            try:
                await self._governed(session, group)
            finally:
                group.cancel_scope.cancel()

    async def _watch_client(self, whole: anyio.CancelScope) -> None:
        """Until the client goes away (then the whole exchange ends), and for a streamed request, while nothing else
        goes to the client, an SSE comment every keepalive_s (the first only after keepalive_s: a quick error keeps
        its HTTP status). One task for both: each task a request starts costs it ~35 us or more."""
        every = self.gw.settings.keepalive_s if self.streamed else None
        clock = self.run_ports.clock
        while True:
            if every is None:
                message = await self.receive()
            else:
                message = None
                with clock.move_on_after(max(0.0, self.last_write + every - self.now())):
                    message = await self.receive()  # (uvicorn's receive takes nothing when cancelled)
                if message is None:
                    if not await self._keepalive(every):
                        every = None
                    continue
            assert message is not None  # (received in either branch)
            if message["type"] == "http.disconnect":
                if self.streamed and self.reading.finish:
                    # the answer's end went out (Codex hangs up at response.completed, before the upstream's
                    # stream ends): the relay reads its last bytes and counts the answer, as answered
                    return
                if not self.done:
                    self.gone = True
                    if self.attempt is not None:  # its upstream request is closed with it: the server aborts it
                        self.attempt.ends_unanswered("client gone")
                    whole.cancel()
                return

    async def _keepalive(self, every: float) -> bool:
        """An SSE comment, when keepalive_s has passed since the last write; False once the answer is over."""
        async with self.lock:
            if self.done or self.gone:
                return False
            if self.now() - self.last_write < every * 0.999:
                return True
            if not self.started:
                await self.start(200, "text/event-stream; charset=utf-8")
            await self.write(KEEPALIVE)
            return True

    async def _governed(self, session: Session, group: anyio.abc.TaskGroup) -> None:
        e = self.run_ports
        st = session.st
        self._record_inputs(session)
        try:
            async with e.sessions.request(session, group, model_asked=self.model_asked,
                                          model_sent=self.model_sent, prompt_chars=self.prompt_chars) as att:
                self.attempt = att
                self._tell_inputs(session, att)
                with anyio.CancelScope() as att.scope:
                    await self._upstream(session, att, att.request_id)
                if att.kill_reason:
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
        except BudgetSpent as exc:
            await self.fail(402, f"cerevisor gateway: {exc}; nothing was sent upstream")
        finally:
            if self.attempt is None:  # never sent: its messages are still new for its next try
                self._tell_inputs(session, None)
            if st.current is None:
                move(st, "request_gone")

    async def _upstream(self, session: Session, att: Attempt, rid: str) -> None:
        e = self.run_ports
        st = session.st
        endpoint = st.endpoint
        ep = e.endpoints[endpoint]
        client = e.connections.clients[endpoint]
        url = _upstream_url(e.connections.base_urls[endpoint], self.api)
        headers = upstream_headers(self.scope["headers"])
        headers["x-request-id"] = rid
        if ep.session_header:
            headers[ep.session_header.lower()] = session.name
        if self.api == "messages" and "authorization" in client.headers:
            headers["x-api-key"] = client.headers["authorization"].removeprefix("Bearer ")
        changes: dict[str, Any] = {"model": self.model_sent} if self.model_sent != self.model_asked else {}
        if (self.api == "chat" and self.streamed and "return_progress" not in self.body
                and await e.connections.asks_progress(ep)):
            # llama-server's prompt_progress (its chat API streams it), for the watchdog; this client did not ask:
            # it never sees them
            changes["return_progress"] = True
            self.hide_progress = True
        elif ep.kind != "hosted":  # no progress told: the prefill estimated from the endpoint's measured rate
            e.attempts.estimate(st, att, self.prompt_chars)
        if self.api == "chat" and self.streamed and not _asks_usage(self.body):
            # the answer's usage, for the meters and the figures; this client did not ask: it never sees it
            changes["stream_options"] = {**(self.body.get("stream_options") or {}), "include_usage": True}
            self.hide_usage = True
        content = apis.sent_body(self.raw, self.body, changes)
        request = client.build_request("POST", url, content=content, headers=headers)
        response = await self._connect(session, att, client, request)
        if response is None:
            return
        upstream = att.stream = _Upstream(response)
        try:
            if response.status_code >= 300:
                att.ends_unanswered(f"upstream answered {response.status_code}")
                await self._upstream_error(response)
                return
            if not self.streamed:
                await self._whole(session, att, upstream, response)
            else:
                await self._relay(session, att, upstream, response)
        except httpx.HTTPError as exc:
            # the upstream broke off its answer (a dropped connection, a cut chunk): the client is told in its
            # API's shape rather than left with a truncated body; a kill's own abort is told as the kill
            if not att.kill_reason:
                att.ends_unanswered("upstream broke off its answer")
                await self.fail(502, f"cerevisor gateway: upstream {endpoint} broke off its answer after "
                                     f"{att.tokens} tokens: {problem_of(exc)}")
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()

    async def _connect(self, session: Session, att: Attempt, client: httpx.AsyncClient,
                       request: httpx.Request) -> httpx.Response | None:
        """The upstream's response to `request` (its headers); None when the client was told it is not answering. A
        local server still loading refuses its port: the request waits, kept alive, within its first-byte window
        (the watchdog ends it there)."""
        st = session.st
        endpoint = st.endpoint
        wait_s = WAIT_BACKOFF_S[0]
        states = self.run_ports.states
        while True:
            try:
                response = await client.send(request, stream=True)
                states.answered(endpoint)
                return response
            except httpx.HTTPError as exc:
                if self.run_ports.endpoints[endpoint].kind == "hosted" or not is_refused(exc):
                    # (out of descriptors is no server loading)
                    att.ends_unanswered("upstream not answering")
                    await self.fail(503, f"cerevisor gateway: upstream {endpoint} is not answering: {problem_of(exc)}",
                                    {"retry-after": str(RETRY_AFTER_S)})
                    return None
                down = states.refused(endpoint)
                if down is not None:
                    att.ends_unanswered("upstream down")
                    where = self.run_ports.connections.base_urls.get(endpoint, "")
                    await self.fail(503, f"cerevisor gateway: upstream {endpoint} at {where} is down: it has refused "
                                         f"connections for {down:.0f} s and has never answered ({problem_of(exc)}); "
                                         "is it running, and is that its address?", {"retry-after": str(RETRY_AFTER_S)})
                    return None
                self.run_ports.attempts.refused(st, att, endpoint, problem_of(exc), wait_s)
                # asked again when its grace ends, not a backoff later: the client is told within a moment of it
                down_at = states.down_at(endpoint)
                until_down = down_at - self.now() if down_at is not None else wait_s
                await self.run_ports.clock.sleep(max(0.0, min(wait_s, until_down)))
                wait_s = min(wait_s * 2, WAIT_BACKOFF_S[1])

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

    async def _whole(self, session: Session, att: Attempt, upstream: _Upstream, response: httpx.Response) -> None:
        attempts, st = self.run_ports.attempts, session.st
        chunks = []
        async for chunk in response.aiter_raw():
            upstream.last_byte_at = self.now()
            attempts.alive(st, att)
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

    async def _relay(self, session: Session, att: Attempt, upstream: _Upstream, response: httpx.Response) -> None:
        """The hot path: each read's complete frames go to the client as they came; a copy is read."""
        e = self.run_ports
        st = session.st
        reading = self.reading
        attempts = e.attempts
        delta = attempts.feeder(st, att)
        monotonic = self.now
        by_bytes = e.policies[st.endpoint].liveness == "bytes"
        hide_usage = self.hide_usage
        pending = Frames()
        # the headers go out with the first frame, not with the upstream's (which vLLM sends at once): until
        # then a deadline, a kill or a drop is still an HTTP status, and keep-alives start the stream
        head = (response.status_code, response.headers.get("content-type", "text/event-stream"),
                {"x-request-id": att.request_id})
        async for chunk in response.aiter_raw():
            upstream.last_byte_at = monotonic()
            try:
                frames = pending.feed(chunk)
            except FrameTooLong as exc:  # an upstream that never ends its frame is not buffered for ever
                att.ends_unanswered("upstream frame too long")
                await self.fail(502, f"cerevisor gateway: upstream {st.endpoint} {exc}; the request was ended")
                return
            if not frames:
                continue
            if b'"prompt_progress"' in frames and att.first_token_at is None:
                frames = self._progress(st, att, frames)
            text, reasoning, tool, chunks = reading.frames(frames)
            if hide_usage and b'"usage"' in frames:
                frames = without_usage_chunks(frames)
            if frames:
                if self.started:  # the lock only keeps a first write and a keep-alive from both starting the answer
                    await self.write(frames)
                else:
                    async with self.lock:
                        if not self.started:
                            await self.start(*head)
                        await self.write(frames)
            if chunks:
                delta(text, reasoning, tool, chunks)
            elif att.first_token_at is None or by_bytes:
                attempts.keepalive(st, att, by_bytes=by_bytes)
        async with self.lock:
            if not self.started:
                await self.start(*head)
            await self.write(pending.rest(), last=True)
        await self._finished(session, att)

    def _progress(self, st: Any, att: Attempt, frames: bytes) -> bytes:
        """The prefill progress in these frames, taken for the watchdog (engine/attempt.py); the frames as the
        client gets them: whole when it asked for prompt_progress, else without it (in chat, the first one stays,
        as the role-only chunk it also is, with its prompt_progress taken out; in the other APIs a frame that
        carried nothing else goes)."""
        attempts = self.run_ports.attempts
        kept: list[bytes] = []
        for frame in split_frames(frames):
            progress = frame_progress(frame)
            if progress is None:
                kept.append(frame)
                continue
            obj, numbers = progress
            attempts.progress(st, att, *numbers, by_bytes=False)
            if not self.hide_progress:
                kept.append(frame)
                continue
            del obj["prompt_progress"]
            if self.api == "chat" and not self.role_sent:
                self.role_sent = True
                kept.append(b"data: " + msgspec.json.encode(obj) + b"\n\n")
            elif self.api != "chat" and set(obj) - {"type"}:
                event = b"".join(line + b"\n" for line in frame.split(b"\n") if line.startswith(b"event:"))
                kept.append(event + b"data: " + msgspec.json.encode(obj) + b"\n\n")
        return b"".join(kept)

    async def _finished(self, session: Session, att: Attempt) -> None:
        """The answer went out whole: its figures, its message in the transcript, the session's meters (all
        engine/attempt.py's); the transcript's count of the conversation moves past the answer."""
        e = self.run_ports
        st = session.st
        r = self.reading
        e.attempts.flush(st, att)
        completion = r.completion_tokens or r.chunks
        prompt = r.prompt_tokens or r.timings_prompt_tokens
        streamed_text = "".join(att.parts) if self.streamed else r.answer
        thinking = "".join(att.thinking) if self.streamed else "".join(r.reasoning)
        # the client sends the answer back with its next request (one message, or its items), which may come
        # before the meters below are done: counted first
        session.recorded[self.conversation] = session.recorded.get(self.conversation, 0) + (r.items or 1)
        await e.attempts.finished(
            st, att, _answer_of(r, streamed_text, thinking, prompt, completion,
                                 self.prompt_chars, self.streamed),
            turns=0)

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
        e = self.run_ports
        for message in self.new_inputs:
            text, raw = apis.recorded(message)
            e.emit(ev.MessageRecorded(self.now(), session.name, att.number, att.turn, apis.role_of(message), text,
                                      raw=raw))


class _Upstream:
    """What the watchdog sees of an upstream response: when its last byte came, and how to drop it at once."""

    def __init__(self, response: httpx.Response) -> None:
        self.last_byte_at = 0.0
        self._network = response.extensions.get("network_stream")

    def abort(self) -> None:
        abort = getattr(self._network, "abort", None)
        if abort is not None:
            abort()



def _answer_of(r: Reading, answer: str, thinking: str, prompt_tokens: int, completion_tokens: int,
                prompt_chars: int, streamed: bool) -> Answer:
    """What the attempt owner is told of a relayed answer."""
    return Answer(answer, thinking, (prompt_tokens, completion_tokens) if prompt_tokens or completion_tokens else None,
                  r.cached_tokens, r.finish, r.timings, prompt_chars, streamed=streamed)


@functools.lru_cache(maxsize=64)
def _upstream_url(base_url: str, api: Api) -> httpx.URL:
    """Where a request of `api` goes on the endpoint at `base_url`, parsed once (httpx parses a str URL on every
    request: 17 us of each)."""
    return httpx.URL(base_url.rstrip("/") + next(p for p, a in apis.PATHS.items() if a == api))


def _asks_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True
