"""What the engine keeps of each agent, attempt and tool call while the run goes on: plain records, read by the
engine's parts (conversation, watchdog, tool calls, the run loop), written by the engine alone. Kept apart from
the behaviour so that those parts import the records, not each other."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from cerevisor_tui.config.models import AgentConfig
from cerevisor_tui.contract.deadlines import Phase
from cerevisor_tui.contract.events import KillDeadline
from cerevisor_tui.kinds import FinalStatus, Status

if TYPE_CHECKING:
    from cerevisor_tui.config.secrets import StreamScrubber
    from cerevisor_tui.engine.prefill import Prefill, PrefillEstimate
    from cerevisor_tui.engine.script import TurnScript


class Reader(Protocol):
    """What the watchdog and a kill use of an attempt's response as it is read (a workflow agent's ChatStream or
    RemoteStream, a gateway session's upstream response): when its last byte came. A kill drops it at once through
    its `abort`, where it has one."""

    last_byte_at: float


@dataclass(eq=False)
class AgentState:
    """What the engine knows of one agent now; read by the console, written only by the engine."""

    config: AgentConfig
    endpoint: str  # where it runs: for a pool's agent, the member it is placed on (the pool's first until then)
    wave: int
    pool: str = ""  # the pool its config names, if any
    _status: Status = field(default="pending", repr=False)
    on_status: Callable[[AgentState], None] | None = field(default=None, repr=False)  # told each change
    turn: int = 0
    attempts: int = 0  # requests sent, over all turns
    turn_attempts: dict[int, int] = field(default_factory=dict)  # turn -> its attempts so far (1: no retry yet)
    retries_used: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    decode_s: float = 0.0
    stall_warnings: int = 0
    error: str = ""
    output: str = ""
    current: Attempt | None = None
    scope: anyio.CancelScope | None = None
    end_status: FinalStatus | None = None  # what a stop or the operator's kill ends it as, before it ends
    end_reason: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns_done: int = 0
    last_prompt_tokens: int = 0  # what the server counted for the last completed turn
    last_completion_tokens: int = 0
    # meters: prompt tokens the server served from its prefix cache, the conversation's length now,
    # and what the agent cost on priced endpoints
    cached_tokens: int = 0
    context_tokens: int = 0
    cost_usd: float = 0.0
    max_model_len: int = 0  # as its last meters told it (0: unknown), with their warning: a later meter keeps them
    meter_warning: str = ""
    # with tools: what it is offered (a Toolset), the step of the turn's tool loop, the last answer's tool calls
    toolset: Any = None
    step: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)
    script: TurnScript | None = None  # its turns come from a script, not its config's text (engine/script.py)

    @property
    def status(self) -> Status:
        """Read here; set only by engine/status.py `move`, through its transition table."""
        return self._status

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def turns(self) -> int:
        return self.script.turns if self.script is not None else 1 + len(self.config.turns)

    @property
    def output_tokens_per_s(self) -> float | None:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else None


@dataclass(eq=False)
class Attempt:
    """One streamed request of one turn, with its stall clock."""

    number: int
    turn: int
    sent_at: float
    last_alive: float = 0.0
    first_token_at: float | None = None
    tokens: int = 0
    phase: Phase = "first_byte"
    deadline_at: float = math.inf
    base: float = 0.0
    extra_s: float = 0.0
    extensions: int = 0
    warned: int = 0
    kill_reason: str = ""
    kill_deadline: KillDeadline | None = None
    by_operator: bool = False
    restart: bool = False
    answered: bool = False  # its whole answer came and was recorded (engine/attempt.py `finished`)
    # a gateway session's request that ended without its answer and unkilled: why ("client gone", "upstream answered
    # 500"), told as its TurnFinished's finish reason (engine/attempt.py `ended`)
    unanswered: str = ""
    request_id: str = ""  # the X-Request-Id its request carries (a gateway session's; a workflow's is computed)
    prompt_chars: int = 0  # its prompt's characters: what an attempt ended without its usage is priced from
    stream: Reader | None = None  # its response as it is read: when its last byte came (and how to drop it)
    prefill: Prefill | None = None  # its prompt's prefill as the server tells it (prompt_progress), before a token
    estimate: PrefillEstimate | None = None  # or, where the server tells nothing, as its measured rate projects it
    # its answer so far, as streamed (content, reasoning, tool calls): the turn's result, and what a console
    # that attaches mid-answer is given (Engine.in_flight)
    parts: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    calls: dict[int, list[str]] = field(default_factory=dict)  # tool calls by index: [id, name, arguments] so far
    scope: anyio.CancelScope | None = None
    nap: anyio.CancelScope | None = None  # the watchdog's sleep: cancelled to make it look again at once
    # with a key configured, the scrubbers of its content, reasoning and tool text, each holding back a tail that
    # could begin a key (engine/attempt.py)
    held: tuple[StreamScrubber, StreamScrubber, StreamScrubber] | None = None
    # set at the first sign of life: the watchdog, asleep on the long first-byte deadline, moves to idle
    alive: anyio.Event = field(default_factory=anyio.Event)

    @property
    def why_killed(self) -> str:
        """Its kill as an agent's end or a client's error says it: the operator's or a wedge's reason as given, a
        deadline's named ("idle deadline: no output for 600 s after 412 tokens"); "" when it was not killed."""
        if not self.kill_reason or self.by_operator or self.kill_deadline == "wedge":
            return self.kill_reason
        return f"{self.kill_deadline} deadline: {self.kill_reason}"

    def kill(self, deadline: KillDeadline, reason: str, *, by_operator: bool = False, restart: bool = False) -> None:
        if self.kill_reason:
            return
        self.kill_deadline, self.kill_reason = deadline, reason
        self.by_operator, self.restart = by_operator, restart
        if self.scope is not None:
            self.scope.cancel()
        # The cancellation reaches the reading task only when it next waits, and with data already buffered it
        # may not wait for a while (vLLM then generated a killed answer to its end): drop the connection now.
        abort = getattr(self.stream, "abort", None)
        if abort is not None:
            abort()

    def ends_unanswered(self, why: str) -> None:
        """It ends without its answer, for `why` (the first reason given stands; a kill is told as the kill)."""
        if not self.unanswered:
            self.unanswered = why

    def look_again(self) -> None:
        """Wake the watchdog now (a policy changed): it measures the deadline afresh."""
        if self.nap is not None:
            self.nap.cancel()


@dataclass(eq=False)
class ToolCall:
    """One MCP tool call while it executes, with its own deadline (tool_timeout_s): time in a tool is not
    model silence, so no stream deadline runs meanwhile."""

    call_id: str
    server: str
    tool: str
    started_at: float
    deadline_at: float
    warn_at: tuple[float, ...] = ()
    warned: int = 0
    outcome: str = ""  # "timeout" | "killed" once it was ended so
    reason: str = ""
    scope: anyio.CancelScope | None = None
    nap: anyio.CancelScope | None = None

    def kill(self, outcome: str, reason: str) -> None:
        if self.outcome:
            return
        self.outcome, self.reason = outcome, reason
        if self.scope is not None:
            self.scope.cancel()

    def look_again(self) -> None:
        if self.nap is not None:
            self.nap.cancel()
