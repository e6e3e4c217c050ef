"""One agent's conversation: its turns in order, each turn's attempts (retried with backoff), each attempt
streamed under the stall watchdog (what the engine keeps of the agent meanwhile is `state.AgentState`).

Each attempt's life (its deltas, figures, meters and budget) is engine/attempt.py's: this module drives it.
`Conversations._stream` reads the stream; `Attempts.feeder`'s closure is the hot path, once per token.
"""

from __future__ import annotations

import random
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import anyio

from cerevisor_tui.config.models import EndpointConfig, ResolvedStall
from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.client import ChatStream
from cerevisor_tui.endpoints.errors import EndpointError, EndpointUnreachable
from cerevisor_tui.endpoints.worker import RemoteStream
from cerevisor_tui.engine.attempt import Answer, Attempts, Subscriber, TurnFigures
from cerevisor_tui.engine.clock import MONOTONIC, Clock
from cerevisor_tui.engine.connections import Connections
from cerevisor_tui.engine.resume import RecordedTurn, input_changes, turn_inputs
from cerevisor_tui.engine.script import TurnScript
from cerevisor_tui.engine.state import AgentState, Attempt
from cerevisor_tui.engine.status import move
from cerevisor_tui.engine.toolcalls import ToolCalls
from cerevisor_tui.engine.watchdog import Watchdog
from cerevisor_tui.kinds import DELTA, KEEPALIVE, PROGRESS, TOOL_CALLS, FinalStatus
from cerevisor_tui.tools.manager import ToolSetupError
from cerevisor_tui.tools.schemas import function_name

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
RETRY_AFTER_CAP_S = 60.0
WAIT_BACKOFF_CAP_S = 5.0


def request_id(prefix: str, agent: str, turn: int, attempt: int) -> str:
    """The id an attempt's request carries to the server (X-Request-Id): the run (`Conversations.request_prefix`),
    the agent, turn and attempt."""
    return f"{prefix}.{agent}.t{turn}.a{attempt}"


def header_value(name: str) -> str:
    """An agent's name as a header value, which must be ASCII: a non-ASCII name goes percent-encoded."""
    return name if name.isascii() else urllib.parse.quote(name, safe="")


class AttemptFailed(Exception):
    """One attempt ended without its answer: `retryable` says whether the turn may be sent again."""

    def __init__(self, status: FinalStatus, reason: str, *, retryable: bool, retry_after_s: float | None = None,
                 restart: bool = False) -> None:
        super().__init__(reason)
        self.status, self.reason, self.retryable = status, reason, retryable
        self.retry_after_s, self.restart = retry_after_s, restart


class Relocated(EndpointUnreachable):
    """A pool's member refused the connection and the agent was moved to another member."""


class AgentEnded(Exception):
    """The agent's conversation ended without its answer: `status` and `reason` are its AgentFinished's."""

    def __init__(self, status: FinalStatus, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def _raise(subscriber: Subscriber, event: ev.Event, exc: Exception) -> None:
    raise exc


class Conversations:
    """Runs agents' conversations for one run: `await run(st)` for each agent. It holds what they share and
    is handed each piece of the engine it needs; the ones that change live are the engine's own objects
    (`policies`, `subscribers`) or asked for when needed (`stopping`)."""

    def __init__(self, *, run_id: str, endpoints: Mapping[str, EndpointConfig], policies: Mapping[str, ResolvedStall],
                 connections: Connections, watchdog: Watchdog, figures: Mapping[str, TurnFigures],
                 attempts: Attempts, emit: Subscriber, scrub: Scrubber, render: Callable[[str], str],
                 stopping: Callable[[], str], relocate: Callable[[AgentState, str], bool] | None = None,
                 tools: ToolCalls | None = None, escape: Callable[[AgentState, str], bool] | None = None,
                 clock: Clock = MONOTONIC) -> None:
        self.run_id = run_id
        self.clock = clock  # the run's: what its events are stamped with, and what a retry's backoff waits on
        # what each attempt's X-Request-Id starts with: the run id, and in a resumed run a mark of its own
        # (engine/resume.py: request_prefix), so that no id an earlier run of the directory sent is sent again
        self.request_prefix = run_id
        self.endpoints = endpoints
        self.policies = policies
        self.connections = connections
        self.watchdog = watchdog
        self.figures = figures
        self.attempts = attempts  # the one owner of a running attempt (engine/attempt.py)
        self.emit = emit  # the engine's: scrubs, then tells every subscriber
        self.scrub = scrub
        self.render = render  # inserts dependencies' answers for {{ name.output }}
        self.stopping = stopping  # why the run is stopping; "" while it is not
        self.tools = tools  # the run's MCP tool calls (engine/toolcalls.py); None: no [[mcp_servers]]
        # moves a pool's agent off a member that is down (Engine.relocate); None: no pools
        self.relocate = relocate
        # a resumed run's agents that had not completed: the turns they had answered (engine/resume.py), taken
        # once, when the agent starts again; an operator's rerun later in the run starts from turn 1
        self.recorded_turns: dict[str, list[RecordedTurn]] = {}
        self.replay: Callable[[list[ev.Event]], None] | None = None  # their figures, into the report
        # moves a pool's agent off a member that failed its request (Pools.failed); None: no pools
        self.escape = escape
        self._rng = random.Random()

    async def run(self, st: AgentState) -> None:
        """The agent's turns in order, each user message after the answer before; its last answer is its output."""
        if st.script is not None:
            await self._scripted(st, st.script)
            return
        cfg = st.config
        messages: list[dict[str, Any]] = []
        st.messages = messages  # the conversation so far, as it grows (the wedge watch sizes its prompt by it)
        if cfg.tools and self.tools is not None:
            try:
                st.toolset = await self.tools.toolset(cfg)  # its servers may still be starting
            except ToolSetupError as exc:
                raise AgentEnded("failed", str(exc)) from None
        if cfg.system:
            messages.append({"role": "system", "content": cfg.system})
        user_turns = [cfg.prompt, *cfg.turns]
        answer = ""
        inputs = turn_inputs(self.endpoints[st.endpoint], cfg)  # what its turns are answered under
        done = self._reuse_turns(st, messages, user_turns, inputs)
        if done:
            answer = messages[-1]["content"] or ""
        for turn, text in enumerate(user_turns):
            if turn < done:
                continue
            st.turn = turn + 1
            messages.append({"role": "user", "content": self.render(text)})
            self.emit(ev.MessageRecorded(self.clock.now(), st.name, st.turn_attempts.get(st.turn, 0) + 1, st.turn, "user",
                                         messages[-1]["content"], inputs=inputs))
            if st.toolset is not None:
                answer = await self._tool_turn(st, messages)
                continue
            answer = await self._turn(st, messages)
            messages.append({"role": "assistant", "content": answer})
        st.messages = messages
        st.output = answer

    async def _scripted(self, st: AgentState, script: TurnScript) -> None:
        """A scripted agent's turns (engine/script.py): each sent after its gap, its whole request built then and
        let go after its answer; the journal records the script's reference for the prompt, not its text. Its
        turns are not taken from an earlier run's journal: a script is a measurement, sent again whole."""
        inputs = turn_inputs(self.endpoints[st.endpoint], st.config)
        answer = ""
        for turn in range(1, script.turns + 1):
            if turn > 1:
                move(st, "idle")  # it keeps its slot over the gap, as a session between requests does
            await script.before(turn)
            st.turn = turn
            st.messages = script.messages(turn)
            self.emit(ev.MessageRecorded(self.clock.now(), st.name, st.turn_attempts.get(turn, 0) + 1, turn, "user",
                                         script.reference(turn), inputs=inputs))
            answer = await self._turn(st, st.messages)
            st.messages = []
        st.output = answer

    def _reuse_turns(self, st: AgentState, messages: list[dict[str, Any]], user_turns: list[str],
                     inputs: dict[str, str]) -> int:
        """The turns an earlier run of this directory answered, put back into `messages` as they were, while
        each user message is what the config says now and each was answered under what the agent runs with now
        (`inputs`: system prompt, model, sampling, tools); how many. The agent goes on after them."""
        recorded = self.recorded_turns.pop(st.name, [])
        done = 0
        changes: list[str] = []
        for text, turn in zip(user_turns, recorded, strict=False):
            changes = input_changes(turn.inputs, inputs)
            if changes or turn.user != self.render(text):
                break
            done += 1
        if changes:  # answered under other settings: those answers are not what this agent would say now
            which = f"turn {done + 1}" if done + 1 == len(recorded) else f"turns {done + 1}-{len(recorded)}"
            self.emit(ev.RunNotice(self.clock.now(), f"{st.name}: {which} answered before not reused "
                                                     f"({', '.join(changes)}); it runs again from turn {done + 1}"))
        if not done:
            return 0
        for turn in recorded[:done]:
            messages.append({"role": "user", "content": turn.user})
            messages.extend(dict(m) for m in turn.messages)
        st.turn = st.turns_done = done
        if self.replay is not None:
            self.replay([e for turn in recorded[:done] for e in turn.figures])
        which = "turn 1" if done == 1 else f"turns 1-{done}"
        goes_on = f"it goes on at turn {done + 1}" if done < len(user_turns) else "none is left to send"
        self.emit(ev.RunNotice(self.clock.now(), f"{st.name}: {which} answered before, taken from the journal; "
                                                 f"{goes_on}"))
        return done

    async def _tool_turn(self, st: AgentState, messages: list[dict[str, Any]]) -> str:
        """A turn of an agent with tools: each answer that calls tools has them run (through MCP) and their
        results appended, and the model is asked again, until it answers without a call or max_steps is spent."""
        assert self.tools is not None
        limit = st.config.max_steps
        for step in range(1, limit + 1):
            st.step = step
            answer = await self._turn(st, messages)
            calls = st.calls
            if not calls:
                messages.append({"role": "assistant", "content": answer})
                return answer
            messages.append({"role": "assistant", "content": answer or None, "tool_calls": calls})
            if step == limit:
                names = ", ".join(sorted({c["function"]["name"] for c in calls}))
                raise AgentEnded("failed", f"max_steps ({limit}) reached: the model still called tools ({names}) "
                                           "at its last step")
            for call in calls:
                content = await self.tools.run(st, st.turn_attempts.get(st.turn, 0), st.toolset, call)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
                self.emit(ev.MessageRecorded(self.clock.now(), st.name, st.turn_attempts.get(st.turn, 0), st.turn,
                                             "tool", content, tool_call_id=call["id"]))
        raise AssertionError("unreachable")

    async def _turn(self, st: AgentState, messages: list[dict[str, Any]]) -> str:
        """One turn: its attempts are numbered within it (2 is its first retry or restart), and an operator's
        rerun of the agent goes on counting, so 'attempt 2' always means the turn was sent before."""
        while True:
            if st.pool and self.relocate is not None:
                self.relocate(st, "")  # its member failed a health check since: it moves before sending
            st.attempts += 1
            number = st.turn_attempts[st.turn] = st.turn_attempts.get(st.turn, 0) + 1
            try:
                return await self._attempt(st, messages, number)
            except AttemptFailed as failure:
                if failure.restart:
                    continue
                stopping = self.stopping()
                if stopping:
                    raise AgentEnded("cancelled", stopping) from None
                if not failure.retryable or st.retries_used >= st.config.retries:
                    raise AgentEnded(failure.status, failure.reason) from None
                st.retries_used += 1
                delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (st.retries_used - 1)) * (0.5 + self._rng.random())
                if failure.retry_after_s is not None:
                    delay = max(delay, min(failure.retry_after_s, RETRY_AFTER_CAP_S))
                move(st, "retrying")
                self.emit(ev.AgentRetrying(self.clock.now(), st.name, number + 1, failure.reason, delay))
                await self.clock.sleep(delay)

    async def _attempt(self, st: AgentState, messages: list[dict[str, Any]], number: int) -> str:
        policy = self.policies[st.endpoint]
        att = self.attempts.begin(st, number, request_id(self.request_prefix, header_value(st.name), st.turn, number),
                                  turns=st.turns, step=st.step if st.toolset is not None else 0,
                                  prompt_chars=_chars(messages))
        error: EndpointError | None = None
        stream: ChatStream | RemoteStream | None = None
        with anyio.CancelScope() as scope:
            att.scope = scope
            async with anyio.create_task_group() as group:
                group.start_soon(self.watchdog.watch, st, att, policy)
                try:
                    stream = await self._stream(st, att, messages, policy)
                except EndpointError as exc:
                    error = exc
                finally:
                    self.attempts.flush(st, att)
                group.cancel_scope.cancel()
        st.current = None
        answer = "".join(att.parts)
        if att.kill_reason or error is not None or scope.cancelled_caught:
            self.attempts.ended(st, att, answer, "".join(att.thinking))
            if att.kill_reason:
                status: FinalStatus = "cancelled" if self.stopping() else "killed"
                raise AttemptFailed(status, att.why_killed, retryable=not att.by_operator, restart=att.restart)
            if error is not None:
                if isinstance(error, Relocated):  # the next attempt goes to another member at once
                    raise AttemptFailed("failed", str(error), retryable=True, restart=True)
                if error.status in (429, 503):
                    self.figures[st.endpoint].rejections += 1
                # A pool's member that fails a request while others have room: the agent moves, and its next
                # attempt is not a retry spent (the member is degraded, so it does not come back at once).
                if error.retryable and st.pool and self.escape is not None and not self.stopping() \
                        and self.escape(st, error.problem):
                    raise AttemptFailed("failed", str(error), retryable=True, restart=True)
                raise AttemptFailed("failed", str(error), retryable=error.retryable, retry_after_s=error.retry_after_s)
            raise AttemptFailed("cancelled", "cancelled", retryable=False)
        st.calls = assembled_calls(att.calls, f"{request_id(self.request_prefix, st.name, st.turn, att.number)}.") \
            if att.calls else []
        texts = st.config.turns
        following = self.render(texts[st.turn - 1]) if st.turn <= len(texts) else ""
        await self.attempts.finished(
            st, att,
            Answer(answer, "".join(att.thinking), stream.usage if stream else None,
                   stream.cached_tokens if stream else None, stream.finish_reason if stream else "",
                   stream.timings if stream else None, _chars(messages), st.calls),
            turns=st.turns, following_chars=len(following), max_tokens=_max_tokens(st))
        return answer

    async def _stream(self, st: AgentState, att: Attempt, messages: list[dict[str, Any]],
                      policy: ResolvedStall) -> ChatStream | RemoteStream:
        """Stream the attempt's request, each item to the attempt owner; returns the stream, read to its end."""
        ep = self.endpoints[st.endpoint]
        connections = self.connections
        attempts = self.attempts
        by_bytes = policy.liveness == "bytes"
        agent_header = header_value(st.name)
        # a router keeps every request of one session on one worker (vllm-router's consistent_hash, llm-d, ...)
        session = {ep.session_header: f"{self.run_id}/{agent_header}"} if ep.session_header else {}
        wait_s = 0.25
        while True:
            try:
                model = await connections.model(ep)
                body = {
                    **ep.extra_body,  # a server's own parameters ([[endpoints]] and [[agents]] extra_body)
                    **st.config.extra_body,
                    "model": model,
                    "messages": messages,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "max_tokens": _max_tokens(st),
                    "temperature": st.config.temperature,
                }
                if "return_progress" not in body and await connections.asks_progress(ep):
                    body["return_progress"] = True  # llama-server's prompt_progress: the prefill's sign of life
                elif ep.kind != "hosted":
                    attempts.estimate(st, att, _chars(messages, text_only=True))
                if st.toolset is not None:
                    body["tools"] = st.toolset.tools
                    choice = tool_choice(st.config.tool_choice, st.step)
                    if choice is not None:
                        body["tool_choice"] = choice
                url = connections.chat_url(ep.name)
                # X-Request-Id names the attempt in the server's own logs (vLLM takes it as its request id:
                # "Aborted request(s) chatcmpl-<id>"); unique per run (resumes included), agent, turn and attempt
                headers = {"X-Cerevisor-Agent": agent_header, "X-Request-Id": att.request_id, **session}
                stream = connections.stream(ep.name, url, body, headers)
                att.stream = stream
                delta = attempts.feeder(st, att)
                async for kind, payload in stream.events():
                    if kind == DELTA:
                        delta(*payload)
                    elif kind == KEEPALIVE:
                        attempts.keepalive(st, att, by_bytes=by_bytes)
                    elif kind == PROGRESS:
                        attempts.progress(st, att, *payload, by_bytes=by_bytes)
                    elif kind == TOOL_CALLS:
                        attempts.tool_pieces(att, payload)
                return stream
            except EndpointUnreachable as exc:
                exc.scrub(self.scrub)
                # A pool's member that refuses is down for the pool: the agent moves to another member at once.
                if st.pool and self.relocate is not None and self.relocate(st, exc.problem):
                    raise Relocated(ep.name, exc.problem) from None
                # A local server that is still loading refuses its port: wait inside the first-byte window.
                if ep.kind == "hosted" or att.first_token_at is not None:
                    raise
                attempts.refused(st, att, ep.name, exc.problem, wait_s)
                await self.clock.sleep(wait_s)
                wait_s = min(wait_s * 2, WAIT_BACKOFF_CAP_S)
            except EndpointError as exc:  # the server's words, or the worker's: never with a key in them
                raise exc.scrub(self.scrub) from None  # (the unscrubbed original must not ride along as context)


def _max_tokens(st: AgentState) -> int:
    """The turn's completion limit: its script's, or the agent's config's."""
    return st.script.max_tokens(st.turn) if st.script is not None else st.config.max_tokens


def _chars(messages: list[dict[str, Any]], *, text_only: bool = False) -> int:
    """The conversation's characters (its text contents only, with `text_only`)."""
    if text_only:
        return sum(len(m.get("content") or "") for m in messages if isinstance(m.get("content"), str))
    return sum(len(m.get("content") or "") for m in messages)


def tool_choice(setting: str, step: int) -> Any:
    """The request's `tool_choice` for an agent's setting at a step of its tool loop: "" sends none (the
    server's default), "auto" | "required" | "none" as they are, and "server.tool" forces that tool at the
    first step of each turn and sends "none" after it, so the model answers from the tool's result."""
    if not setting:
        return None
    if setting in ("auto", "required", "none"):
        return setting
    if step > 1:
        return "none"
    server, _, tool = setting.partition(".")
    return {"type": "function", "function": {"name": function_name(server, tool)}}


def assembled_calls(pieces: dict[int, list[str]], id_prefix: str) -> list[dict[str, Any]]:
    """A streamed answer's tool calls, put together from their pieces (OpenAI message form), in index order;
    a call the server sent without an id gets one of ours."""
    return [{"id": parts[0] or f"{id_prefix}{index}", "type": "function",
             "function": {"name": parts[1], "arguments": parts[2]}}
            for index, parts in sorted(pieces.items())]
