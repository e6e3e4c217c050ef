"""Wedged servers, named and caught early: three rules over an endpoint's recent /metrics reads, and the watch
that applies them after each of the monitor's samples (kills, a ServerWedged, a pool member marked down).

Each rule is a pure function of a sequence of `Progress` readings (oldest first) and the time our oldest open
request was sent, so its thresholds are tested on explicit sequences:

- `engine_frozen`: no token counter moved and KV use stood still for `[stall] wedge_timeout_s` while our
  requests were open, behind a /health of 200 (vLLM's engine core dead or stopped: the API process answers
  /health and /metrics, and nothing it reports moves). A working server moves something every engine step:
  vLLM and SGLang count prompt and generated tokens and allocate KV blocks with each prefill chunk; llama.cpp
  counts its decode calls (one per batch, prefill too). 45 s is many metrics intervals and a fortieth of the
  30-minute first-byte window, but not longer than every honest step: an unchunked prefill is one step, and
  1,400 tokens at 20 tok/s take 70 s. So the rule waits while an open request's prefill, projected from the
  endpoint's measured prefill rate and its prompt (`prefill_end`), may still be running.
- `decode_stalled`: requests running, not one token generated server-wide, no prompt tokens counted or
  computed and KV use not climbing (no prefill under way) for the idle deadline: a hung kernel, even while
  other gauges move. It ends our requests still waiting for their first token (a streaming one's idle
  deadline says the same of it).
- `preempt_loop`: while our request waits for its first token the server preempts again and again
  (`vllm:num_preemptions_total` climbing, `[stall] preempt_limit` times) with requests waiting for KV room:
  the prompt does not fit beside the others, and would prefill, be preempted and prefill again forever.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cerevisor_tui.config.models import ResolvedStall, StallConfig
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.metrics import ServerStatus
from cerevisor_tui.engine.attempt import TurnFigures
from cerevisor_tui.engine.caps import Caps
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.endpoint_state import EndpointStates
from cerevisor_tui.engine.monitor import ServerMonitor
from cerevisor_tui.engine.placement import Placement
from cerevisor_tui.engine.roster import Roster
from cerevisor_tui.engine.state import AgentState, Attempt
from cerevisor_tui.engine.status import move, phase_of
from cerevisor_tui.engine.warmup import Warming
from cerevisor_tui.engine.watchdog import fmt_s
from cerevisor_tui.kinds import WedgeRule

HISTORY = 2048  # readings kept per endpoint: over an hour at the default 2 s interval
PREFILL_MARGIN = 2.0
"""A prefill is plausibly still running until this many times its projected time: the measured rate is an average
over shorter prompts (TTFT, queueing included), and a long prompt's attention costs more per token."""
PREEMPT_DOWN_S = (
    120.0  # a pool member in a preemption loop takes no new agent for this long (it is not frozen)
)


@dataclass(frozen=True, slots=True)
class Progress:
    """What one /metrics read says of a server's forward motion; None where the server does not say."""

    t: float  # when the answer came
    healthy: bool
    running: float | None = None
    waiting_capacity: float | None = None  # requests waiting for KV room
    kv_usage: float | None = None
    generated: float | None = None  # tokens generated server-wide (llama.cpp: its decode calls)
    prompt_tokens: float | None = None
    preemptions: float | None = None
    prefill_tokens: float | None = None  # prompt tokens computed chunk by chunk, where the server counts them

    @property
    def motion(self) -> tuple[float | None, ...]:
        """What changes while the server works; equal readings mean nothing moved between them."""
        return self.generated, self.prompt_tokens, self.preemptions, self.kv_usage, self.prefill_tokens

    @property
    def counted(self) -> bool:
        return self.generated is not None or self.prompt_tokens is not None


def progress_of(status: ServerStatus, t: float) -> Progress | None:
    """The reading of one look at a server; None without metrics (nothing to judge by)."""
    m = status.metrics
    if m is None:
        return None
    waiting = m.waiting_capacity if m.waiting_capacity is not None else m.requests_waiting
    return Progress(
        t,
        status.reachable and not status.loading and (status.health_status or 0) < 400,
        _num(m.requests_running),
        _num(waiting),
        m.kv_cache_usage,
        m.generated,
        m.prompt_tokens,
        _num(m.preemptions),
        m.prefill_tokens,
    )


def _num(value: float | None) -> float | None:
    return None if value is None else float(value)


def still_for(samples: Sequence[Progress], since: float) -> float | None:
    """Seconds nothing moved (`Progress.motion`), up to the last reading and from `since` at the earliest; None
    when the readings cannot say (none, or the last counts no tokens)."""
    if not samples or not samples[-1].counted:
        return None
    last = samples[-1]
    first = last
    for s in reversed(samples):
        if s.motion != last.motion:
            break
        first = s
        if s.t <= since:
            break
    return max(0.0, last.t - max(first.t, since))


def prefill_end(sent_at: float, prompt_tokens: int, cached_tokens: int, rate_tok_s: float | None) -> float:
    """Until when a request sent at `sent_at` may honestly be in its prefill: PREFILL_MARGIN times its uncached
    tokens at the endpoint's measured rate; -inf without a rate (nothing measured yet) or a prompt to compute."""
    uncached = prompt_tokens - min(prompt_tokens, max(0, cached_tokens))
    if rate_tok_s is None or not rate_tok_s > 0 or uncached <= 0:
        return -math.inf
    return sent_at + PREFILL_MARGIN * uncached / rate_tok_s


def engine_frozen(samples: Sequence[Progress], since: float, threshold_s: float,
                  step_until: float = -math.inf) -> str | None:
    """The engine is dead behind a /health of 200: nothing moved for `threshold_s` since `since` (when our
    oldest open request was sent), and no open request's prefill may still be running (`step_until`, the latest
    `prefill_end` of them: a long unchunked prefill is one step, and moves nothing until it ends). The kill
    reason, or None."""
    if threshold_s <= 0 or not samples or not samples[-1].healthy or samples[-1].t < step_until:
        return None
    span = still_for(samples, since)
    if span is None or span < threshold_s:
        return None
    return f"server wedged: no progress on any request for {fmt_s(span)}"


def decode_stalled(samples: Sequence[Progress], since: float, idle_s: float) -> str | None:
    """A hung kernel: requests running in every reading, and for `idle_s` since `since` no token generated
    server-wide, no prompt token counted and KV use never climbing. The kill reason, or None."""
    if idle_s <= 0 or not samples:
        return None
    last = samples[-1]
    if not last.healthy or last.generated is None or not last.running:
        return None
    first = later = last
    for s in reversed(samples):
        if (
            not s.running
            or s.generated != last.generated
            or s.prompt_tokens != last.prompt_tokens
            or s.prefill_tokens != last.prefill_tokens
            or (s.kv_usage is not None and later.kv_usage is not None and later.kv_usage > s.kv_usage)
        ):
            break
        first = later = s
        if s.t <= since:
            break
    span = last.t - max(first.t, since)
    if span < idle_s:
        return None
    noun = "request" if last.running == 1 else "requests"
    return (
        f"server wedged: {last.running:.0f} {noun} running, no token generated server-wide for {fmt_s(span)} "
        "(a hung kernel?)"
    )


def preemptions_since(samples: Sequence[Progress], since: float) -> float | None:
    """How many times the server preempted since `since` (from the last reading before it, else the first),
    if the readings say and some reading since then had requests waiting for KV room; None otherwise."""
    if not samples or samples[-1].preemptions is None:
        return None
    base = next((s for s in reversed(samples) if s.t <= since), samples[0])
    if base.preemptions is None or samples[-1].preemptions < base.preemptions:  # unknown, or it restarted
        return None
    if not any(s.waiting_capacity for s in samples if s.t >= base.t):
        return None
    return samples[-1].preemptions - base.preemptions


def preempt_loop(samples: Sequence[Progress], since: float, limit: int, prompt_tokens: int) -> str | None:
    """A request that waits for its first token since `since` was preempted `limit` times or more, with
    requests waiting for KV room. The kill reason, or None."""
    if limit <= 0 or not samples or not samples[-1].healthy:
        return None
    count = preemptions_since(samples, since)
    if count is None or count < limit:
        return None
    size = f" ({prompt_tokens:,} tokens)" if prompt_tokens > 0 else ""
    return f"KV cache too small for this prompt{size}: preempted {count:.0f} times"


class WedgeWatch:
    """The run's wedge rules, applied after each server sample; `wedged` holds the endpoints judged frozen or
    hung until their counters move again. Handed its ports: the stall settings, the server monitor (its
    statuses), the roster and each agent's open attempts (a gateway session may have several), the measured
    figures, the placement and a pool member's notice, the endpoints' states, the caps (auto's answer to a preemption loop), emit and
    the clock."""

    def __init__(self, stall: StallConfig, policies: Mapping[str, ResolvedStall], monitor: ServerMonitor,
                 roster: Roster, figures: Mapping[str, TurnFigures], placement: Placement,
                 tell_down: Callable[[str], None], caps: Caps, states: EndpointStates,
                 emit: Callable[[ev.Event], None], clock: Clock) -> None:
        self.stall = stall
        self.policies = policies
        self.monitor = monitor
        self.roster = roster
        self.figures = figures
        self.placement = placement
        self.tell_down = tell_down
        self.caps = caps
        self.states = states  # each endpoint's state: a wedged one is said so there too
        self.emit = emit
        self.clock = clock
        # an agent's attempts open now: its current one; a gateway session's, each in flight (engine/sessions.py)
        self.open_attempts: Callable[[AgentState], list[Attempt]] = \
            lambda st: [st.current] if st.current is not None else []
        self.samples: dict[str, deque[Progress]] = {}
        self.wedged: dict[str, tuple[WedgeRule, tuple[float | None, ...]]] = {}  # rule, motion at the wedge
        self._preempt_kill: dict[str, float] = {}  # when a preemption loop was last ended there
        self.warmups: dict[str, Warming] = {}  # each endpoint's warm-up request while it is out (engine/warmup.py)
        # when an endpoint's warm-up that never answered was sent: the agents sent as it gave up wait on the same
        # still server, and its stillness counts from then, until a sample finds nothing of ours open there
        self._unanswered: dict[str, float] = {}

    def warming(self, request: Warming) -> None:
        """A warm-up request went out: judged as any request of ours while it is out."""
        self.warmups[request.endpoint] = request

    def warmed(self, request: Warming) -> None:
        if self.warmups.get(request.endpoint) is request:
            del self.warmups[request.endpoint]
        if not request.answered:
            self._unanswered[request.endpoint] = request.sent_at

    def keeps_down(self, endpoint: str) -> bool:
        """Whether a healthy /health does not bring the endpoint back for placement: it is wedged still, or its
        preemption loop ended a moment ago."""
        return (
            endpoint in self.wedged
            or self.clock.now() < self._preempt_kill.get(endpoint, -math.inf) + PREEMPT_DOWN_S
        )

    def on_sample(self, endpoint: str) -> None:
        """After each of the monitor's samples of `endpoint`: judge it, and act."""
        status = self.monitor.status.get(endpoint)
        if status is None:
            return
        reading = progress_of(status, self.monitor.status_at.get(endpoint, self.clock.now()))
        if reading is None:
            return
        history = self.samples.setdefault(endpoint, deque(maxlen=HISTORY))
        history.append(reading)
        stall = self.stall
        opened = self._open(endpoint)
        warmup = self.warmups.get(endpoint)
        if warmup is not None and warmup.kill_reason:
            warmup = None
        ours = [att.sent_at for _, att in opened] + ([warmup.sent_at] if warmup is not None else [])
        if not ours:
            self._unanswered.pop(endpoint, None)  # nothing of ours open: a still server is an idle one
        if endpoint in self.wedged:
            rule, motion = self.wedged[endpoint]
            if reading.motion != motion:
                self._over(endpoint, rule)
            else:
                for st, att in opened:  # what waits on it now waits on a wedged server
                    if att.first_token_at is None:
                        move(st, "wedged")
        if not ours:
            return
        unanswered = [self._unanswered[endpoint]] if endpoint in self._unanswered else []
        since = min(ours + unanswered)
        step_until = max((self._prefill_end(st, att) for st, att in opened if att.first_token_at is None),
                         default=-math.inf)
        reason = engine_frozen(history, since, stall.wedge_timeout_s, step_until)
        if reason is not None:
            self._wedge(endpoint, "frozen", reason, opened, reading, warmup)
            return
        # The rules below are about requests still waiting for their first token: a streaming one has its idle
        # deadline, which says the same of it as the hung-kernel rule, on its own clock.
        waiting = [(st, att) for st, att in opened if att.first_token_at is None]
        if not waiting and (warmup is None or warmup.answered):
            return
        if stall.wedge_timeout_s > 0:
            since = min([att.sent_at for _, att in waiting] + ([warmup.sent_at] if warmup else []) + unanswered)
            reason = decode_stalled(history, since, self.policies[endpoint].idle_timeout_s)
            if reason is not None:
                self._wedge(endpoint, "hung", reason, waiting, reading, warmup)
                return
        if stall.preempt_limit and waiting:
            # the longest prompt is the one that does not fit; a loop ended before counts no more
            st, att = max(waiting, key=lambda pair: self._prompt_tokens(pair[0]))
            after = max(att.sent_at, self._preempt_kill.get(endpoint, -math.inf))
            reason = preempt_loop(history, after, stall.preempt_limit, self._prompt_tokens(st))
            if reason is not None:
                self._preempt_kill[endpoint] = reading.t
                self._wedge(endpoint, "preempt_loop", reason, [(st, att)], reading)

    def _open(self, endpoint: str) -> list[tuple[AgentState, Attempt]]:
        """Our attempts open on `endpoint` now, not already being killed (a gateway session's every request)."""
        opened = []
        for st in self.roster.on.get(endpoint, ()):
            opened += [(st, att) for att in self.open_attempts(st) if not att.kill_reason]
        return opened

    def _prefill_end(self, st: AgentState, att: Attempt) -> float:
        """Until when the attempt's prefill may honestly run (`prefill_end`): as its estimate projected it when it
        was sent, else at the rate its endpoint has measured since."""
        est = att.estimate
        if est is not None:
            return prefill_end(est.sent_at, est.total, est.cached, est.rate_tok_s)
        total = self._prompt_tokens(st)
        rate = self.figures[st.endpoint].prefill_rate()
        return prefill_end(att.sent_at, total, min(total, st.context_tokens), rate)

    def _prompt_tokens(self, st: AgentState) -> int:
        """The agent's prompt as the server will count it: its conversation's characters at the endpoint's
        measured tokens per character."""
        chars = sum(len(m.get("content") or "") for m in st.messages if isinstance(m.get("content"), str))
        return round(chars * self.figures[st.endpoint].tokens_per_char())

    def _wedge(
        self,
        endpoint: str,
        rule: WedgeRule,
        reason: str,
        opened: list[tuple[AgentState, Attempt]],
        reading: Progress,
        warmup: Warming | None = None,
    ) -> None:
        now = self.clock.now()
        if rule != "preempt_loop":
            self.wedged[endpoint] = (rule, reading.motion)
            self.states.wedged(endpoint, reason)
        self.emit(ev.ServerWedged(now, endpoint, rule, reason, list(dict.fromkeys(st.name for st, _ in opened))))
        if warmup is not None:  # its failure is told as a warm-up's, with this reason
            warmup.kill(reason)
        for st, att in opened:
            move(st, "wedged")
            att.kill("wedge", reason)
        if self.placement.pools_of(endpoint):
            until = now + PREEMPT_DOWN_S if rule == "preempt_loop" else math.inf
            if self.placement.mark_down(endpoint, f"is wedged ({reason})", until=until):
                self.tell_down(endpoint)
        if rule == "preempt_loop" and self.caps.scheduler.mode == "auto":
            change = self.caps.auto[endpoint].preempt_loop(reason)
            if change is not None:
                self.caps.apply(endpoint, change)

    def _over(self, endpoint: str, rule: WedgeRule) -> None:
        del self.wedged[endpoint]
        self.states.moves_again(endpoint)
        self.emit(ev.ServerWedged(self.clock.now(), endpoint, rule, f"{endpoint} moves again", over=True))
        for st, att in self._open(endpoint):
            move(st, phase_of(att.first_token_at, wedge=True))
        # a pool member marked down for it is up again at its next healthy sample (Pools.on_sample)
