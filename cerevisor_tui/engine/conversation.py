"""One agent's conversation: its turns in order, each turn's attempts (retried with backoff), each attempt
streamed under the stall watchdog (what the engine keeps of the agent meanwhile is `state.AgentState`).

`Conversations._stream` is the run's hot path, once per token.
"""

from __future__ import annotations

import random
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from cerevisor_tui.config.models import EndpointConfig, ResolvedStall
from cerevisor_tui.config.secrets import Scrubber, StreamScrubber
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.errors import EndpointError, EndpointUnreachable
from cerevisor_tui.endpoints.latency import Timings
from cerevisor_tui.engine.connections import Connections
from cerevisor_tui.engine.prefill import Prefill, PrefillEstimate
from cerevisor_tui.engine.resume import RecordedTurn, input_changes, turn_inputs
from cerevisor_tui.engine.state import AgentState, Attempt
from cerevisor_tui.engine.toolcalls import ToolCalls
from cerevisor_tui.engine.watchdog import Watchdog
from cerevisor_tui.kinds import DELTA, KEEPALIVE, PROGRESS, TOOL_CALLS, FinalStatus
from cerevisor_tui.tools.manager import ToolSetupError
from cerevisor_tui.tools.schemas import function_name

Subscriber = Callable[[ev.Event], None]

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
RETRY_AFTER_CAP_S = 60.0
WAIT_BACKOFF_CAP_S = 5.0
CONTEXT_WARN_FILL = 0.8  # an agent's context this full is flagged, before the turn that would not fit


def request_id(prefix: str, agent: str, turn: int, attempt: int) -> str:
    """The id an attempt's request carries to the server (X-Request-Id): the run (`Conversations.request_prefix`),
    the agent, turn and attempt."""
    return f"{prefix}.{agent}.t{turn}.a{attempt}"


def header_value(name: str) -> str:
    """An agent's name as a header value, which must be ASCII: a non-ASCII name goes percent-encoded."""
    return name if name.isascii() else urllib.parse.quote(name, safe="")


@dataclass(eq=False)
class TurnFigures:
    """What one endpoint's turns measured, for auto mode: rejections, recent TTFTs, and the tokens per
    character and per answer its conversations project with."""

    rejections: int = 0  # 429/503 answers
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=16))
    prompt_tokens: float = 0.0  # tokens per character, as the server counts them: prompt tokens over characters sent
    prompt_chars: float = 0.0
    answer_tokens: float = 0.0  # completion tokens over completed turns
    answers: int = 0
    prefill_tokens: float = 0.0  # the measured prefill rate: prompt tokens not from the cache over their TTFTs
    prefill_s: float = 0.0

    def tokens_per_char(self) -> float:
        return self.prompt_tokens / self.prompt_chars if self.prompt_chars else 0.25

    def prefill_rate(self) -> float | None:
        """Prompt tokens a second the endpoint's completed requests were prefilled at (TTFT, queueing included)."""
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 and self.prefill_tokens > 0 else None

    def answer_length(self) -> float | None:
        return self.answer_tokens / self.answers if self.answers else None


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
                 emit: Subscriber, subscribers: list[Subscriber], scrub: Scrubber,
                 render: Callable[[str], str], stopping: Callable[[], str],
                 relocate: Callable[[AgentState, str], bool] | None = None, tools: ToolCalls | None = None,
                 escape: Callable[[AgentState, str], bool] | None = None,
                 subscriber_failed: Callable[[Subscriber, ev.Event, Exception], None] | None = None) -> None:
        self.run_id = run_id
        # what each attempt's X-Request-Id starts with: the run id, and in a resumed run a mark of its own
        # (engine/resume.py: request_prefix), so that no id an earlier run of the directory sent is sent again
        self.request_prefix = run_id
        self.endpoints = endpoints
        self.policies = policies
        self.connections = connections
        self.watchdog = watchdog
        self.figures = figures
        self.emit = emit  # the engine's: scrubs, then tells every subscriber
        self.subscribers = subscribers  # the engine's live list, which token deltas are handed to directly
        self.subscriber_failed = subscriber_failed or _raise  # what a subscriber's failure on a delta comes to
        self.scrub = scrub
        self.render = render  # inserts dependencies' answers for {{ name.output }}
        self.stopping = stopping  # why the run is stopping; "" while it is not
        self.run_cost_usd = 0.0  # what every agent's requests cost on priced endpoints
        self.budget_usd = 0.0  # [run] budget_usd: `on_budget` is told once when run_cost_usd reaches it
        self.on_budget: Callable[[float], None] | None = None
        self.tools = tools  # the run's MCP tool calls (engine/toolcalls.py); None: no [[mcp_servers]]
        # moves a pool's agent off a member that is down (Engine.relocate); None: no pools
        self.relocate = relocate
        # a resumed run's agents that had not completed: the turns they had answered (engine/resume.py), taken
        # once, when the agent starts again; an operator's rerun later in the run starts from turn 1
        self.recorded_turns: dict[str, list[RecordedTurn]] = {}
        self.replay: Callable[[list[ev.Event]], None] | None = None  # their figures, into the report
        # told each request's llama.cpp `timings` with its TTFT (the monitor's latency panel); None: not told
        self.on_timings: Callable[[str, Timings], None] | None = None
        # moves a pool's agent off a member that failed its request (Pools.failed); None: no pools
        self.escape = escape
        self._rng = random.Random()

    async def run(self, st: AgentState) -> None:
        """The agent's turns in order, each user message after the answer before; its last answer is its output."""
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
            self.emit(ev.MessageRecorded(time.monotonic(), st.name, st.turn_attempts.get(st.turn, 0) + 1, st.turn, "user",
                                         messages[-1]["content"], inputs=inputs))
            if st.toolset is not None:
                answer = await self._tool_turn(st, messages)
                continue
            answer = await self._turn(st, messages)
            messages.append({"role": "assistant", "content": answer})
        st.messages = messages
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
            self.emit(ev.RunNotice(time.monotonic(), f"{st.name}: {which} answered before not reused "
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
        self.emit(ev.RunNotice(time.monotonic(), f"{st.name}: {which} answered before, taken from the journal; "
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
                self.emit(ev.MessageRecorded(time.monotonic(), st.name, st.turn_attempts.get(st.turn, 0), st.turn,
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
                st.status = "retrying"
                self.emit(ev.AgentRetrying(time.monotonic(), st.name, number + 1, failure.reason, delay))
                await anyio.sleep(delay)

    async def _attempt(self, st: AgentState, messages: list[dict[str, Any]], number: int) -> str:
        policy = self.policies[st.endpoint]
        now = time.monotonic()
        att = Attempt(number, st.turn, sent_at=now, last_alive=now,
                      deadline_at=now + policy.first_byte_timeout_s)
        st.current = att
        st.status = "prefill"
        self.emit(ev.AgentStarted(now, st.name, att.number, st.turn, st.turns, st.endpoint,
                                  policy.first_byte_timeout_s, policy.idle_timeout_s,
                                  request_id=request_id(self.request_prefix, header_value(st.name), st.turn, number),
                                  step=st.step if st.toolset is not None else 0))
        parts, thinking = att.parts, att.thinking
        error: EndpointError | None = None
        with anyio.CancelScope() as scope:
            att.scope = scope
            async with anyio.create_task_group() as group:
                group.start_soon(self.watchdog.watch, st, att, policy)
                try:
                    await self._stream(st, att, messages, policy, parts, thinking)
                except EndpointError as exc:
                    error = exc
                group.cancel_scope.cancel()
        st.current = None
        answer = "".join(parts)
        if att.kill_reason or error is not None or scope.cancelled_caught:
            if parts or thinking:
                self.emit(ev.MessageRecorded(time.monotonic(), st.name, att.number, st.turn, "assistant", answer,
                                             "".join(thinking), partial=True))
            if att.kill_reason:
                if not att.restart:
                    self.emit(ev.AgentKilled(time.monotonic(), st.name, att.number, att.kill_deadline,
                                             att.kill_reason, att.tokens))
                status = "cancelled" if self.stopping() else "killed"
                # a wedged server's kill names the wedge, not a deadline (engine/wedge.py)
                reason = (att.kill_reason if att.by_operator or att.kill_deadline == "wedge"
                          else f"{att.kill_deadline} deadline: {att.kill_reason}")
                raise AttemptFailed(status, reason, retryable=not att.by_operator, restart=att.restart)
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
        stream = att.stream
        usage = stream.usage if stream and stream.usage else None
        prompt_tokens = usage[0] if usage else 0
        completion_tokens = usage[1] if usage else att.tokens
        end = time.monotonic()
        st.prompt_tokens += prompt_tokens
        st.completion_tokens += completion_tokens
        ttft = att.first_token_at - att.sent_at if att.first_token_at is not None else None
        if att.first_token_at is not None:
            st.decode_s += end - att.first_token_at
        self._count_turn(st, messages, prompt_tokens, completion_tokens, ttft)
        if ttft and prompt_tokens:
            figures = self.figures[st.endpoint]
            figures.prefill_tokens += max(0, prompt_tokens - (getattr(stream, "cached_tokens", None) or 0))
            figures.prefill_s += ttft
        timings = getattr(stream, "timings", None)
        if timings is not None and self.on_timings is not None:
            self.on_timings(st.endpoint, Timings(ttft, *timings))
        st.calls = assembled_calls(att.calls, f"{request_id(self.request_prefix, st.name, st.turn, att.number)}.") \
            if att.calls else []
        # its figures, then its answer: a resumed run takes a turn whose answer is in the journal as answered
        # (resume.recorded_turns), and a crash between the two then leaves an unanswered turn, never one
        # answered without its figures
        self.emit(ev.TurnFinished(end, st.name, att.number, st.turn, st.turns, prompt_tokens, completion_tokens,
                                  stream.finish_reason if stream else "", ttft, end - att.sent_at))
        self.emit(ev.MessageRecorded(end, st.name, att.number, st.turn, "assistant", answer, "".join(thinking),
                                     tool_calls=st.calls))
        await self._meter(st, prompt_tokens, completion_tokens, getattr(stream, "cached_tokens", None))
        return answer

    async def _stream(self, st: AgentState, att: Attempt, messages: list[dict[str, Any]], policy: ResolvedStall,
                      parts: list[str], thinking: list[str]) -> None:
        ep = self.endpoints[st.endpoint]
        connections = self.connections
        name, number = st.name, att.number
        emit = self.emit
        # token deltas skip emit()'s frame: the same loop over the same (live) list of subscribers
        subscribers = self.subscribers
        TokenDelta = ev.TokenDelta
        monotonic = time.monotonic
        by_bytes = policy.liveness == "bytes"
        # With a key configured, each delta field is scrubbed with the tail of the one before held back, as an
        # echoed key may be split across deltas (config/secrets.py: StreamScrubber). Without one: one test.
        held = (self.scrub.stream(), self.scrub.stream(), self.scrub.stream()) if self.scrub else None
        agent_header = header_value(name)
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
                    "max_tokens": st.config.max_tokens,
                    "temperature": st.config.temperature,
                }
                if "return_progress" not in body and await connections.asks_progress(ep):
                    body["return_progress"] = True  # llama-server's prompt_progress: the prefill's sign of life
                elif ep.kind != "hosted" and att.estimate is None:
                    self._estimate(st, att, messages)
                if st.toolset is not None:
                    body["tools"] = st.toolset.tools
                    choice = tool_choice(st.config.tool_choice, st.step)
                    if choice is not None:
                        body["tool_choice"] = choice
                url = connections.chat_url(ep.name)
                # X-Request-Id names the attempt in the server's own logs (vLLM takes it as its request id:
                # "Aborted request(s) chatcmpl-<id>"); unique per run (resumes included), agent, turn and attempt
                headers = {"X-Cerevisor-Agent": agent_header,
                           "X-Request-Id": request_id(self.request_prefix, agent_header, att.turn, number), **session}
                stream = connections.stream(ep.name, url, body, headers)
                att.stream = stream
                async for kind, payload in stream.events():
                    if kind == DELTA:
                        now = monotonic()
                        att.last_alive = now
                        content, reasoning, tool, chunks = payload
                        if held is not None:
                            content, reasoning, tool = _held_back(held, content, reasoning, tool)
                        if att.first_token_at is None:
                            att.first_token_at = now
                            ttft = now - att.sent_at
                            if st.ttft_s is None:
                                st.ttft_s = ttft
                            st.status = "streaming"
                            att.alive.set()
                            emit(ev.FirstToken(now, name, number, st.turn, ttft))
                        elif st.status != "streaming":
                            st.status = "streaming"
                        att.tokens += chunks
                        st.tokens += chunks
                        if content:
                            parts.append(content)
                        if reasoning:
                            thinking.append(reasoning)
                        if tool:
                            att.tools.append(tool)
                        delta = TokenDelta(now, name, number, content, reasoning, tool, chunks)
                        for subscriber in subscribers:
                            try:
                                subscriber(delta)
                            except Exception as exc:  # as in emit(): no subscriber's failure ends the run
                                self.subscriber_failed(subscriber, delta, exc)
                    elif kind == KEEPALIVE:
                        if by_bytes:
                            att.last_alive = monotonic()
                            att.alive.set()
                        emit(ev.KeepAlive(monotonic(), name, number))
                    elif kind == PROGRESS:
                        now = monotonic()
                        if by_bytes:
                            att.last_alive = now
                            att.alive.set()
                        if att.first_token_at is None:
                            if att.prefill is None:
                                att.prefill = Prefill()
                            if att.prefill.see(*payload, now):
                                emit(att.prefill.event(now, name, number))
                    elif kind == TOOL_CALLS:
                        for index, call_id, fn_name, piece in payload:
                            parts_of = att.calls.setdefault(index, ["", "", ""])
                            parts_of[0] = parts_of[0] or call_id or ""
                            if fn_name and fn_name != parts_of[1]:  # some servers repeat the whole name
                                parts_of[1] += fn_name
                            parts_of[2] += piece or ""
                return
            except EndpointUnreachable as exc:
                exc.scrub(self.scrub)
                # A pool's member that refuses is down for the pool: the agent moves to another member at once.
                if st.pool and self.relocate is not None and self.relocate(st, exc.problem):
                    raise Relocated(ep.name, exc.problem) from None
                # A local server that is still loading refuses its port: wait inside the first-byte window.
                if ep.kind == "hosted" or att.first_token_at is not None:
                    raise
                st.status = "waiting"
                emit(ev.EndpointWaiting(monotonic(), name, number, ep.name, exc.problem, wait_s))
                await anyio.sleep(wait_s)
                wait_s = min(wait_s * 2, WAIT_BACKOFF_CAP_S)
            except EndpointError as exc:  # the server's words, or the worker's: never with a key in them
                raise exc.scrub(self.scrub) from None  # (the unscrubbed original must not ride along as context)
            finally:
                if held is not None and (held[0].carry or held[1].carry or held[2].carry):
                    # the stream ended (or broke) on text that could have begun a key and did not: it is text
                    tail = (held[0].flush(), held[1].flush(), held[2].flush())
                    if tail[0]:
                        parts.append(tail[0])
                    if tail[1]:
                        thinking.append(tail[1])
                    delta = TokenDelta(monotonic(), name, number, *tail, 0)
                    for subscriber in subscribers:
                        try:
                            subscriber(delta)
                        except Exception as exc:
                            self.subscriber_failed(subscriber, delta, exc)


    def _estimate(self, st: AgentState, att: Attempt, messages: list[dict[str, Any]]) -> None:
        """A server that tells no progress of its prefill: its expected time to first token from the endpoint's
        measured prefill rate, the prompt's tokens from its characters, the conversation so far from the cache."""
        figures = self.figures[st.endpoint]
        rate = figures.prefill_rate()
        if rate is None:
            return
        chars = sum(len(m.get("content") or "") for m in messages if isinstance(m.get("content"), str))
        total = round(chars * figures.tokens_per_char())
        cached = min(total, st.context_tokens)
        if total <= cached:
            return
        att.estimate = PrefillEstimate(total, cached, rate, att.sent_at, att.sent_at)
        self.emit(att.estimate.event(time.monotonic(), st.name, att.number))

    async def _meter(self, st: AgentState, prompt_tokens: int, completion_tokens: int, cached: int | None) -> None:
        """After a request: the agent's meters (AgentMeters), its context flagged when the next turn will not fit
        the model's context, and the run's budget checked."""
        ep = self.endpoints[st.endpoint]
        if cached is not None:
            st.cached_tokens += cached
        st.context_tokens = prompt_tokens + completion_tokens
        cost = ep.cost_usd(prompt_tokens, completion_tokens)
        st.cost_usd += cost
        before, self.run_cost_usd = self.run_cost_usd, self.run_cost_usd + cost
        limit = await self.connections.context_limit(ep)
        warning = ""
        if limit and st.context_tokens:
            fill = st.context_tokens / limit
            texts = st.config.turns
            following = self.render(texts[st.turn - 1]) if st.turn <= len(texts) else ""
            need = round(st.context_tokens + len(following) * self.figures[st.endpoint].tokens_per_char()
                         + st.config.max_tokens) if following else 0
            if need > limit:
                warning = (f"context {fill:.0%} full: its next turn needs ~{need:,} tokens of the model's "
                           f"{limit:,}, and the server will refuse it")
            elif fill >= CONTEXT_WARN_FILL:
                warning = f"context {fill:.0%} full ({st.context_tokens:,} of {limit:,} tokens)"
        self.emit(ev.AgentMeters(time.monotonic(), st.name, st.turn, prompt_tokens, cached, st.context_tokens, limit,
                                 round(st.cost_usd, 6), round(self.run_cost_usd, 6), warning))
        if self.budget_usd and before < self.budget_usd <= self.run_cost_usd and self.on_budget is not None:
            self.on_budget(self.run_cost_usd)

    def _count_turn(self, st: AgentState, messages: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int,
                    ttft: float | None) -> None:
        """A completed turn's figures, for auto mode's projection of conversation lengths and its TTFT."""
        chars = sum(len(m.get("content") or "") for m in messages)
        figures = self.figures[st.endpoint]
        if prompt_tokens:
            figures.prompt_tokens += prompt_tokens
            figures.prompt_chars += chars
        st.turns_done = st.turn
        st.last_prompt_tokens = prompt_tokens or round(chars * figures.tokens_per_char())
        st.last_completion_tokens = completion_tokens
        figures.answer_tokens += completion_tokens
        figures.answers += 1
        if ttft is not None:
            figures.ttfts.append(ttft)


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


def _held_back(held: tuple[StreamScrubber, StreamScrubber, StreamScrubber], content: str, reasoning: str,
               tool: str) -> tuple[str, str, str]:
    """One delta's fields, scrubbed, less any tail that could begin a key (see StreamScrubber)."""
    if content or held[0].carry:
        content = held[0].feed(content)
    if reasoning or held[1].carry:
        reasoning = held[1].feed(reasoning)
    if tool or held[2].carry:
        tool = held[2].feed(tool)
    return content, reasoning, tool
