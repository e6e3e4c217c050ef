"""One owner for a running attempt: the only code that changes an attempt and its agent while the request runs,
whoever drives it (a workflow agent's conversation, engine/conversation.py, or a gateway session's exchange,
gateway/exchange.py). Begin, each delta (scrubbed with held tails, counted, the first token, the status, the
`TokenDelta` fan-out), keep-alives, prefill progress or its estimate, the answer's figures, meters, cost and the
run's budget, and the end of a killed one: one set of rules, so both kinds of agent keep the same promises.

`Attempts.feeder`'s closure is the run's hot path, once per token (or per relayed read of a gateway's stream).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cerevisor_tui.config.models import EndpointConfig, ResolvedStall
from cerevisor_tui.config.secrets import Scrubber, StreamScrubber
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.latency import Timings
from cerevisor_tui.engine.clock import MONOTONIC, Clock
from cerevisor_tui.engine.prefill import Prefill, PrefillEstimate
from cerevisor_tui.engine.state import AgentState, Attempt
from cerevisor_tui.engine.status import move

Subscriber = Callable[[ev.Event], None]

CONTEXT_WARN_FILL = 0.8  # an agent's context this full is flagged, before the turn that would not fit
BUDGET_WARN_FILL = 0.8  # the run's spending this near its budget is told once, before admissions pause


@dataclass(eq=False)
class TurnFigures:
    """What one endpoint's turns measured, for auto mode and the watchdog's estimates: rejections, recent TTFTs,
    the tokens per character and per answer its conversations project with, and its prefill rate."""

    rejections: int = 0  # 429/503 answers
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=16))
    prompt_tokens: float = 0.0  # tokens per character, as the server counts them: prompt tokens over characters sent
    prompt_chars: float = 0.0
    answer_tokens: float = 0.0  # completion tokens over completed turns
    answers: int = 0
    prefill_tokens: float = 0.0  # the measured prefill rate: prompt tokens not from the cache over their TTFTs
    prefill_s: float = 0.0
    # each recent answer's interactivity, (when it ended, its output tokens a second from its first token): what a
    # user of the endpoint sees, Auto's floor (`[run.auto] min_interactivity_tokens_s`)
    rates: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))

    def tokens_per_char(self) -> float:
        return self.prompt_tokens / self.prompt_chars if self.prompt_chars else 0.25

    def prefill_rate(self) -> float | None:
        """Prompt tokens a second the endpoint's completed requests were prefilled at (TTFT, queueing included)."""
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 and self.prefill_tokens > 0 else None

    def answer_length(self) -> float | None:
        return self.answer_tokens / self.answers if self.answers else None


@dataclass(eq=False)
class Budget:
    """`[run] budget_usd` and what the run has spent against it, agents and sessions alike: `on_near` is told
    once at 80% of it, `on_reached` once when it is reached."""

    limit_usd: float = 0.0  # 0: no budget
    spent_usd: float = 0.0
    on_near: Callable[[float], None] | None = None
    on_reached: Callable[[float], None] | None = None

    def add(self, cost_usd: float) -> None:
        before = self.spent_usd
        self.spent_usd += cost_usd
        limit = self.limit_usd
        if not limit or not cost_usd:
            return
        if before < BUDGET_WARN_FILL * limit <= self.spent_usd < limit and self.on_near is not None:
            self.on_near(self.spent_usd)
        if before < limit <= self.spent_usd and self.on_reached is not None:
            self.on_reached(self.spent_usd)


@dataclass(frozen=True, slots=True)
class Answer:
    """What the server said of a finished request: its usage (None where it said none), and the rest the
    figures need."""

    answer: str
    thinking: str = ""
    usage: tuple[int, int] | None = None  # (prompt_tokens, completion_tokens)
    cached: int | None = None  # prompt tokens from the prefix cache, where the server says
    finish_reason: str = ""
    timings: tuple[float | None, float | None] | None = None  # llama.cpp's (prompt_ms, predicted_per_token_ms)
    prompt_chars: int = 0  # the prompt's characters: tokens per character, and prompt tokens where none are said
    tool_calls: Sequence[dict[str, Any]] = ()
    # False: the answer came in one piece (a gateway client's unstreamed request), its first byte its last: no time
    # to first token nor decode rate can be read from it, and none goes into the endpoint's figures (Auto's TTFT and
    # tokens per second, the prefill rate the watchdog and the wedge rules estimate with)
    streamed: bool = True


class Attempts:
    """The run's attempts, begun, fed and ended here. Handed what it uses: the run's `emit` (which scrubs) and its
    live list of subscribers (token deltas skip emit's frame), the scrubber, the endpoints' live stall policies and
    measured figures, the budget, how to ask an endpoint's context limit, and a clock."""

    def __init__(self, *, endpoints: Mapping[str, EndpointConfig], policies: Mapping[str, ResolvedStall],
                 figures: Mapping[str, TurnFigures], emit: Subscriber, subscribers: list[Subscriber],
                 subscriber_failed: Callable[[Subscriber, ev.Event, Exception], None], scrub: Scrubber,
                 budget: Budget, context_limit: Callable[[EndpointConfig], Awaitable[int]],
                 clock: Clock = MONOTONIC) -> None:
        self.endpoints = endpoints
        self.policies = policies
        self.figures = figures
        self.emit = emit
        self.subscribers = subscribers
        self.subscriber_failed = subscriber_failed
        self.scrub = scrub
        self.budget = budget
        self.context_limit = context_limit
        self.clock = clock
        self.now = clock.now
        # told each request's llama.cpp `timings` with its TTFT (the monitor's latency panel); None: not told
        self.on_timings: Callable[[str, Timings], None] | None = None
        # told each refused connection's endpoint: its state (engine/endpoint_state.py); None: not told
        self.on_refused: Callable[[str], object] | None = None

    # ---- begin ---------------------------------------------------------------------------------------------
    @staticmethod
    def resumed(st: AgentState, requests: int, cost_usd: float) -> None:
        """An agent goes on from what it had done: a resumed run's from its journal, a forgotten session come back
        from its last row: its requests numbered on (its next is `requests + 1`), its cost counted on from `cost_usd`."""
        st.attempts = st.turn = st.turns_done = requests
        st.cost_usd = cost_usd

    def begin(self, st: AgentState, number: int, request_id: str, *, turns: int, step: int = 0,
              queued_s: float = 0.0, model_asked: str = "", model_sent: str = "", prompt_chars: int = 0) -> Attempt:
        """A request of `st` goes out now: its attempt, under the endpoint's first-byte deadline, told as
        AgentStarted. `prompt_chars`: its prompt's characters, to price it if it ends without the server's usage."""
        policy = self.policies[st.endpoint]
        now = self.now()
        att = Attempt(number, st.turn, sent_at=now, last_alive=now, deadline_at=now + policy.first_byte_timeout_s,
                      request_id=request_id, prompt_chars=prompt_chars)
        if self.scrub:  # an echoed key may be split across deltas: each field's tail is held back (StreamScrubber)
            att.held = (self.scrub.stream(), self.scrub.stream(), self.scrub.stream())
        st.current = att
        if st.started_at is None:
            st.started_at = now
        move(st, "sent")
        self.emit(ev.AgentStarted(now, st.name, number, st.turn, turns, st.endpoint, policy.first_byte_timeout_s,
                                  policy.idle_timeout_s, request_id=request_id, step=step, queued_s=queued_s,
                                  model_asked=model_asked, model_sent=model_sent))
        return att

    def refused(self, st: AgentState, att: Attempt, endpoint: str, problem: str, wait_s: float) -> None:
        """A local endpoint refuses its port (loading its model): the attempt waits within its first-byte window."""
        move(st, "refused")
        if self.on_refused is not None:
            self.on_refused(endpoint)
        self.emit(ev.EndpointWaiting(self.now(), st.name, att.number, endpoint, problem, wait_s))

    # ---- while it streams ----------------------------------------------------------------------------------
    def feeder(self, st: AgentState, att: Attempt) -> Callable[[str, str, str, int], None]:
        """The attempt's delta rule, bound to it: called with each delta that arrives (content, reasoning, tool-call
        text, and how many chunks it stands for), it scrubs it, counts it, keeps it, marks the first token and the
        status, and hands a TokenDelta to every subscriber. One closure per attempt, so the hot path pays one call
        and reads its locals (a method reading `self` and the attempt cost the engine ~10% more CPU per token in
        benchmarks/client_throughput.py)."""
        subscribers, failed, now_of, first = self.subscribers, self.subscriber_failed, self.now, self._first
        held, name, number = att.held, st.name, att.number
        parts, thinking, tools = att.parts, att.thinking, att.tools
        token_delta = ev.TokenDelta

        def delta(content: str, reasoning: str, tool: str, chunks: int) -> None:
            now = now_of()
            att.last_alive = now
            if held is not None:
                content, reasoning, tool = _held_back(held, content, reasoning, tool)
            if att.first_token_at is None:
                first(st, att, now)
            elif st.status != "streaming":
                move(st, "token")
            att.tokens += chunks
            st.tokens += chunks
            if content:
                parts.append(content)
            if reasoning:
                thinking.append(reasoning)
            if tool:
                tools.append(tool)
            event = token_delta(now, name, number, content, reasoning, tool, chunks)
            for subscriber in subscribers:  # as in emit(), without its frame: no subscriber's failure ends the run
                try:
                    subscriber(event)
                except Exception as exc:
                    failed(subscriber, event, exc)

        return delta

    def alive(self, st: AgentState, att: Attempt) -> None:
        """Bytes of an answer arrived that are not read as they come (a whole, unstreamed answer): a sign of life."""
        now = self.now()
        att.last_alive = now
        if att.first_token_at is None:
            self._first(st, att, now, streamed=False)

    def keepalive(self, st: AgentState, att: Attempt, *, by_bytes: bool) -> None:
        """An SSE comment or an empty chunk: shown; a sign of life only where the endpoint's liveness is bytes."""
        now = self.now()
        if by_bytes:
            att.last_alive = now
            att.alive.set()
        self.emit(ev.KeepAlive(now, st.name, att.number))

    def progress(self, st: AgentState, att: Attempt, total: int, cache: int, processed: int, time_ms: int, *,
                 by_bytes: bool) -> None:
        """llama-server's prompt_progress: the prefill's sign of life (engine/prefill.py), never a token."""
        now = self.now()
        if by_bytes:
            att.last_alive = now
            att.alive.set()
        if att.first_token_at is None:
            if att.prefill is None:
                att.prefill = Prefill()
            if att.prefill.see(total, cache, processed, time_ms, now):
                self.emit(att.prefill.event(now, st.name, att.number))

    def estimate(self, st: AgentState, att: Attempt, prompt_chars: int) -> None:
        """A server that tells no progress of its prefill: its expected time to first token from the endpoint's
        measured prefill rate, the prompt's tokens from its characters, the conversation so far from the cache."""
        if att.estimate is not None:
            return
        figures = self.figures[st.endpoint]
        rate = figures.prefill_rate()
        if rate is None:
            return
        total = round(prompt_chars * figures.tokens_per_char())
        cached = min(total, st.context_tokens)
        if total <= cached:
            return
        att.estimate = PrefillEstimate(total, cached, rate, att.sent_at, att.sent_at)
        self.emit(att.estimate.event(self.now(), st.name, att.number))

    @staticmethod
    def tool_pieces(att: Attempt, pieces: Sequence[tuple[int, str | None, str | None, str | None]]) -> None:
        """A chunk's tool-call pieces, joined into each call by its index."""
        for index, call_id, fn_name, piece in pieces:
            parts_of = att.calls.setdefault(index, ["", "", ""])
            parts_of[0] = parts_of[0] or call_id or ""
            if fn_name and fn_name != parts_of[1]:  # some servers repeat the whole name
                parts_of[1] += fn_name
            parts_of[2] += piece or ""

    def flush(self, st: AgentState, att: Attempt) -> None:
        """The stream ended (or broke) on text that could have begun a key and did not: it is text after all."""
        held = att.held
        if held is None or not (held[0].carry or held[1].carry or held[2].carry):
            return
        tail = (held[0].flush(), held[1].flush(), held[2].flush())
        if tail[0]:
            att.parts.append(tail[0])
        if tail[1]:
            att.thinking.append(tail[1])
        if tail[2]:
            att.tools.append(tail[2])
        self._fan_out(ev.TokenDelta(self.now(), st.name, att.number, *tail, 0))

    # ---- the end -------------------------------------------------------------------------------------------
    async def finished(self, st: AgentState, att: Attempt, answer: Answer, *, turns: int, following_chars: int = 0,
                       max_tokens: int = 0) -> None:
        """The answer came whole: the agent's and the endpoint's figures, TurnFinished then the answer's
        MessageRecorded (a crash between them leaves an unanswered turn, never one answered without its figures),
        then the meters, the cost and the budget. `following_chars`: the next user message's length, to warn
        before a turn that will not fit the model's context."""
        end = self.now()
        att.answered = True
        usage = answer.usage
        prompt_tokens = usage[0] if usage else 0
        completion_tokens = usage[1] if usage else att.tokens
        st.prompt_tokens += prompt_tokens
        st.completion_tokens += completion_tokens
        if completion_tokens > att.tokens:
            # tokens the deltas did not count one by one: an answer that came in one piece, several tokens to a chunk
            # (speculative decoding, a hosted API's deltas), reasoning a hosted model keeps to itself. Counted now, as
            # the server counted them, and told as a delta of no text: Auto's throughput windows, the rows and the
            # live rate all count tokens from here
            extra = completion_tokens - att.tokens
            att.tokens = completion_tokens
            st.tokens += extra
            self._fan_out(ev.TokenDelta(end, st.name, att.number, "", "", "", extra))
        first = att.first_token_at if answer.streamed else None
        ttft = first - att.sent_at if first is not None else None
        figures = self.figures[st.endpoint]
        if first is not None:
            st.decode_s += end - first
            if completion_tokens > 1 and end > first:
                figures.rates.append((end, (completion_tokens - 1) / (end - first)))
        if prompt_tokens and answer.prompt_chars:
            figures.prompt_tokens += prompt_tokens
            figures.prompt_chars += answer.prompt_chars
        st.turns_done = st.turn
        st.last_prompt_tokens = prompt_tokens or round(answer.prompt_chars * figures.tokens_per_char())
        st.last_completion_tokens = completion_tokens
        figures.answer_tokens += completion_tokens
        figures.answers += 1
        if ttft is not None:
            figures.ttfts.append(ttft)
            if prompt_tokens:
                figures.prefill_tokens += max(0, prompt_tokens - (answer.cached or 0))
                figures.prefill_s += ttft
        if answer.timings is not None and self.on_timings is not None:
            self.on_timings(st.endpoint, Timings(ttft, *answer.timings))
        self.emit(ev.TurnFinished(end, st.name, att.number, st.turn, turns, prompt_tokens, completion_tokens,
                                  answer.finish_reason, ttft, end - att.sent_at))
        self.emit(ev.MessageRecorded(end, st.name, att.number, st.turn, "assistant", answer.answer, answer.thinking,
                                     tool_calls=list(answer.tool_calls)))
        await self._meter(st, prompt_tokens, completion_tokens, answer.cached, following_chars, max_tokens)

    def ended(self, st: AgentState, att: Attempt, answer: str, thinking: str = "") -> None:
        """The attempt ended without its whole answer (killed, broken off, cancelled, its client gone): what it
        had said is recorded as partial, what it cost is counted, and a kill (not a restart) is told as
        AgentKilled; a session's request that ended otherwise, as a TurnFinished whose finish reason says why
        (`Attempt.unanswered`)."""
        if answer or thinking:
            self.emit(ev.MessageRecorded(self.now(), st.name, att.number, att.turn, "assistant", answer, thinking,
                                         partial=True))
        self._meter_unanswered(st, att)
        now = self.now()
        if att.kill_reason and att.kill_deadline is not None and not att.restart:
            self.emit(ev.AgentKilled(now, st.name, att.number, att.kill_deadline, att.kill_reason, att.tokens))
        elif att.unanswered:  # a session's request that ended unkilled (a workflow's end is its retry or its finish)
            self.emit(ev.TurnFinished(now, st.name, att.number, att.turn, 0, 0, att.tokens, att.unanswered, None,
                                      now - att.sent_at, answered=False))

    async def _meter(self, st: AgentState, prompt_tokens: int, completion_tokens: int, cached: int | None,
                     following_chars: int, max_tokens: int) -> None:
        ep = self.endpoints[st.endpoint]
        if cached is not None:
            st.cached_tokens += cached
        st.context_tokens = prompt_tokens + completion_tokens
        # counted before the context limit is asked (which may take a moment): a request beside it sees the spend
        self._charge(st, prompt_tokens, completion_tokens)
        limit = await self.context_limit(ep)  # (a bounded wait: engine/connections.py)
        warning = ""
        if limit and st.context_tokens:
            fill = st.context_tokens / limit
            need = round(st.context_tokens + following_chars * self.figures[st.endpoint].tokens_per_char()
                         + max_tokens) if following_chars else 0
            if need > limit:
                warning = (f"context {fill:.0%} full: its next turn needs ~{need:,} tokens of the model's "
                           f"{limit:,}, and the server will refuse it")
            elif fill >= CONTEXT_WARN_FILL:
                warning = f"context {fill:.0%} full ({st.context_tokens:,} of {limit:,} tokens)"
        st.max_model_len, st.meter_warning = limit, warning
        self.emit(ev.AgentMeters(self.now(), st.name, st.turn, prompt_tokens, cached, st.context_tokens, limit,
                                 round(st.cost_usd, 6), round(self.budget.spent_usd, 6), warning))

    def _meter_unanswered(self, st: AgentState, att: Attempt) -> None:
        """An attempt that ended without its answer on a priced endpoint, after its first tokens, cost its prompt
        and the tokens it streamed (a hosted API bills a request it had begun to answer, however it ended): counted
        against the agent and the budget, its prompt as the endpoint's measured tokens per character make it (no
        usage came), and told in AgentMeters that keep the agent's other meters as they were."""
        if not att.tokens:
            return
        prompt_tokens = round(att.prompt_chars * self.figures[st.endpoint].tokens_per_char())
        if not self._charge(st, prompt_tokens, att.tokens):
            return
        self.emit(ev.AgentMeters(self.now(), st.name, att.turn, 0, None, st.context_tokens, st.max_model_len,
                                 round(st.cost_usd, 6), round(self.budget.spent_usd, 6), st.meter_warning))

    # ---- helpers -------------------------------------------------------------------------------------------
    def _charge(self, st: AgentState, prompt_tokens: int, completion_tokens: int) -> float:
        """What the tokens cost at the agent's endpoint's prices, counted for the agent and against the budget."""
        cost = self.endpoints[st.endpoint].cost_usd(prompt_tokens, completion_tokens)
        st.cost_usd += cost
        self.budget.add(cost)
        return cost

    def _first(self, st: AgentState, att: Attempt, now: float, *, streamed: bool = True) -> None:
        """The answer began: from here the attempt's deadline is its idle one. Unstreamed, its first bytes are no first
        token: the agent is no longer cold (Auto reads `st.ttft_s`), but no TTFT is shown or printed for it."""
        att.first_token_at = now
        ttft = now - att.sent_at
        if st.ttft_s is None:
            st.ttft_s = ttft
        move(st, "token")
        att.alive.set()
        self.emit(ev.FirstToken(now, st.name, att.number, att.turn, ttft, streamed))

    def _fan_out(self, delta: ev.TokenDelta) -> None:
        for subscriber in self.subscribers:  # as in emit(), without its frame: no subscriber's failure ends the run
            try:
                subscriber(delta)
            except Exception as exc:
                self.subscriber_failed(subscriber, delta, exc)


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
