"""The engine's event stream: small immutable records that the UI, the printer, the journal and the
report all subscribe to (one stream of truth).

`t` is `time.monotonic()` when the event happened; `to_dict()` gives the JSON form used by `--jsonl`
and `events.jsonl`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

# An agent's statuses and the run's modes are defined in cerevisor_tui/kinds.py; the console reads them here.
from cerevisor_tui.kinds import ACTIVE, FINAL, STATUSES, FinalStatus, Mode, Status  # noqa: F401


@dataclass(frozen=True, slots=True)
class Event:
    kind: ClassVar[str] = "Event"
    t: float

    def to_dict(self) -> dict[str, Any]:
        data = {"event": self.kind}
        for f in dataclasses.fields(self):
            data[f.name] = getattr(self, f.name)
        return data


@dataclass(frozen=True, slots=True)
class RunStarted(Event):
    kind: ClassVar[str] = "RunStarted"
    run_id: str
    mode: Mode
    max_concurrency: int
    waves: list[list[str]]
    endpoints: list[dict[str, Any]]
    run_dir: str = ""
    note: str = ""
    # name -> {"endpoint", "wave", "turns"}: what a console shows of each agent before it starts
    agents: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    reused: list[str] = dataclasses.field(default_factory=list)  # a resumed run's completed agents, not sent again
    auto_ceiling: int = 0  # auto mode's ceiling (what `+`/`-` move there); 0: not said (an older journal)
    paused: bool = False  # admissions held from the start (paused before the run began)
    effective_cap: int = 0  # what may run at once now (auto: the sum of the endpoints' live caps); 0: not said


@dataclass(frozen=True, slots=True)
class RunStopping(Event):
    """The run was told to stop: no more admissions; running and queued agents are being cancelled."""

    kind: ClassVar[str] = "RunStopping"
    reason: str


@dataclass(frozen=True, slots=True)
class RunNotice(Event):
    """Something the operator should read that belongs to no agent (e.g. the stream worker could not start)."""

    kind: ClassVar[str] = "RunNotice"
    message: str
    severity: str = "information"  # information | warning | error
    title: str = ""


@dataclass(frozen=True, slots=True)
class ModelResolved(Event):
    """An endpoint configured without a model: the one its /v1/models listed first, which the run requests."""

    kind: ClassVar[str] = "ModelResolved"
    endpoint: str
    model: str


@dataclass(frozen=True, slots=True)
class StallPolicyChanged(Event):
    """An endpoint's stall policy changed live (the settings screen): new and running attempts use it now."""

    kind: ClassVar[str] = "StallPolicyChanged"
    endpoint: str
    policy: dict[str, Any]  # ResolvedStall.model_dump(), as RunStarted.endpoints[i]["stall"]


@dataclass(frozen=True, slots=True)
class LoadChanged(Event):
    """How close an endpoint is to its KV-cache cliff, as the engine judges it (engine/load.py): sent when
    any part changes (an admission, a server sample, a new estimate, the cap)."""

    kind: ClassVar[str] = "LoadChanged"
    endpoint: str
    conversations: int  # in flight on it: ours holding a slot, or what the server carries when it reports more
    cap: int  # how many the cap lets run on it now
    zone: str = ""  # fits | cliff | overflow; "" without an estimate
    # conversations_fit, kv_capacity_tokens, context_tokens, cpu_conversations, source, detail; None: no estimate
    estimate: dict[str, Any] | None = None
    note: str = ""  # why there is no estimate
    warning: str = ""  # set when the cap is past the conversations that fit: the operator's notice


@dataclass(frozen=True, slots=True)
class ProbeStarted(Event):
    """A probe of one of the run's endpoints began (the console's `probe` command); admissions wait meanwhile."""

    kind: ClassVar[str] = "ProbeStarted"
    endpoint: str
    max_concurrency: int
    agents: int = 0  # agents on the endpoint whose conversations it replays (0: single requests)


@dataclass(frozen=True, slots=True)
class ProbeProgress(Event):
    """What the probe is doing (`line`), or a level it finished measuring (`level`, ProbeLevel.to_dict())."""

    kind: ClassVar[str] = "ProbeProgress"
    endpoint: str
    line: str = ""
    level: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ProbeFinished(Event):
    """The probe ended: `result` (ProbeResult.to_dict()), or why not (`error`), or cancelled by the operator."""

    kind: ClassVar[str] = "ProbeFinished"
    endpoint: str
    result: dict[str, Any] | None = None
    error: str = ""
    cancelled: bool = False


@dataclass(frozen=True, slots=True)
class WaveStarted(Event):
    kind: ClassVar[str] = "WaveStarted"
    wave: int
    agents: list[str]


@dataclass(frozen=True, slots=True)
class WaveFinished(Event):
    kind: ClassVar[str] = "WaveFinished"
    wave: int
    statuses: dict[str, Status]


@dataclass(frozen=True, slots=True)
class AgentQueued(Event):
    kind: ClassVar[str] = "AgentQueued"
    agent: str
    wave: int


@dataclass(frozen=True, slots=True)
class AgentPlaced(Event):
    """A pool's agent was placed on a member (it stays there for every turn), or moved off a member that is down
    (`moved_from`, with `reason`: the conversation's prefix cache there is lost)."""

    kind: ClassVar[str] = "AgentPlaced"
    agent: str
    endpoint: str
    pool: str
    moved_from: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AgentStarted(Event):
    """An attempt was admitted and its request is being sent (the stall clock starts here)."""

    kind: ClassVar[str] = "AgentStarted"
    agent: str
    attempt: int
    turn: int
    turns: int
    endpoint: str
    first_byte_deadline_s: float
    idle_deadline_s: float
    request_id: str = ""  # the X-Request-Id the request carries: the server logs its abort under this id
    step: int = 0  # an agent with tools: the step of the turn's tool loop (1, 2, ...); 0: no tool loop


@dataclass(frozen=True, slots=True)
class EndpointWaiting(Event):
    """A local endpoint refused the connection inside the first-byte window: the attempt keeps reconnecting."""

    kind: ClassVar[str] = "EndpointWaiting"
    agent: str
    attempt: int
    endpoint: str
    reason: str
    retry_in_s: float


@dataclass(frozen=True, slots=True)
class FirstToken(Event):
    kind: ClassVar[str] = "FirstToken"
    agent: str
    attempt: int
    turn: int
    ttft_s: float


@dataclass(frozen=True, slots=True)
class TokenDelta(Event):
    """Streamed text: `text` is answer content, `reasoning` thinking text, `tool` tool-call text.

    One event carries the consecutive chunks of one network read (`tokens` of them, one token each as
    servers stream): a stream read in time gives one event per token, a busy one fewer and longer ones.
    """

    kind: ClassVar[str] = "TokenDelta"
    agent: str
    attempt: int
    text: str
    reasoning: str = ""
    tool: str = ""
    tokens: int = 1


@dataclass(frozen=True, slots=True)
class KeepAlive(Event):
    """Bytes that carry no token (an SSE comment, an empty delta): shown, counted as life only with liveness=bytes."""

    kind: ClassVar[str] = "KeepAlive"
    agent: str
    attempt: int


@dataclass(frozen=True, slots=True)
class TurnFinished(Event):
    kind: ClassVar[str] = "TurnFinished"
    agent: str
    attempt: int
    turn: int
    turns: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    ttft_s: float | None
    duration_s: float


@dataclass(frozen=True, slots=True)
class AgentMeters(Event):
    """An agent's meters after each request: its prompt served from the server's prefix cache, how full its
    context is, and what it has cost so far (priced endpoints), with the run's cost."""

    kind: ClassVar[str] = "AgentMeters"
    agent: str
    turn: int
    prompt_tokens: int  # of this request
    cached_tokens: int | None  # of those, served from the prefix cache; None: the server does not say
    context_tokens: int  # the conversation's length now: the last prompt and its answer
    max_model_len: int = 0  # the model's context length; 0: unknown
    cost_usd: float = 0.0  # the agent's so far
    run_cost_usd: float = 0.0  # the run's so far
    warning: str = ""  # the context is nearly full, or the next turn will not fit


@dataclass(frozen=True, slots=True)
class MessageRecorded(Event):
    """A whole message of an agent's conversation, as sent or as answered (`partial` when its attempt died)."""

    kind: ClassVar[str] = "MessageRecorded"
    agent: str
    attempt: int
    turn: int
    role: str
    content: str
    reasoning: str = ""
    partial: bool = False
    # OpenAI's form: an assistant message's calls ({"id", "type": "function", "function": {"name", "arguments"}});
    # a "tool" message answers the call named by tool_call_id
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tool_call_id: str = ""


@dataclass(frozen=True, slots=True)
class StallWarning(Event):
    """An attempt has passed `fraction` of a deadline without a sign of life."""

    kind: ClassVar[str] = "StallWarning"
    agent: str
    attempt: int
    deadline: str  # "first_byte" | "idle"
    fraction: float
    remaining_s: float
    deadline_at: float  # monotonic time the deadline fires


@dataclass(frozen=True, slots=True)
class StallExtended(Event):
    kind: ClassVar[str] = "StallExtended"
    agent: str
    attempt: int
    deadline: str
    extend_s: float
    reason: str
    deadline_at: float
    extensions: int
    by_operator: bool = False  # the operator's `e` (the agent is no longer stalling), not the busy server


@dataclass(frozen=True, slots=True)
class AgentKilled(Event):
    kind: ClassVar[str] = "AgentKilled"
    agent: str
    attempt: int
    deadline: str  # "first_byte" | "idle" | "operator"
    reason: str
    tokens: int


@dataclass(frozen=True, slots=True)
class AgentRetrying(Event):
    kind: ClassVar[str] = "AgentRetrying"
    agent: str
    attempt: int  # the attempt about to start
    cause: str
    delay_s: float


@dataclass(frozen=True, slots=True)
class AgentFinished(Event):
    """The agent is done: status completed | failed | killed | skipped | cancelled."""

    kind: ClassVar[str] = "AgentFinished"
    agent: str
    status: FinalStatus
    error: str = ""
    output: str = ""
    # What a completed agent ran with (engine.agent_inputs): a resumed run compares it with its config
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AgentRerun(Event):
    """A resumed run sends an agent the journal says completed, because what it would run with changed."""

    kind: ClassVar[str] = "AgentRerun"
    agent: str
    reason: str  # e.g. "prompt changed", "max_tokens 30 -> 60", "its dependency a0 runs again"


@dataclass(frozen=True, slots=True)
class ModeChanged(Event):
    kind: ClassVar[str] = "ModeChanged"
    mode: Mode
    effective_cap: int
    note: str = ""


@dataclass(frozen=True, slots=True)
class ConcurrencyChanged(Event):
    kind: ClassVar[str] = "ConcurrencyChanged"
    max_concurrency: int  # the parallel cap
    effective_cap: int  # what may run now: the run's, or with `endpoint` that endpoint's live cap
    paused: bool = False
    endpoint: str = ""  # set when one endpoint's cap changed (auto mode)
    reason: str = ""  # why, e.g. "auto: 24 -> 32 (throughput +18% at 24, nothing waiting, KV 61%)"
    ceiling: int = 0  # auto mode's ceiling (what `+`/`-` move there); 0 in an event not about auto
    total_cap: int = 0  # what the whole run may run now (auto: the sum of the live caps); 0: not said


@dataclass(frozen=True, slots=True)
class ServerSample(Event):
    """What an endpoint's /health and /metrics said; None where the server does not report a value."""

    kind: ClassVar[str] = "ServerSample"
    endpoint: str
    healthy: bool | None
    server_kind: str = ""
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    prefix_hit_rate: float | None = None
    preemptions: float | None = None
    kv_cache_tokens: float | None = None
    detail: str = ""
    slots_busy: int | None = None  # llama.cpp /slots: slots generating
    slots_total: int | None = None
    # prefix-cache lookups the hit rate stands for (tokens, since the last sample), to weigh it in a total
    prefix_queries: float | None = None
    # an endpoint that is a router (metrics_urls): each worker as {"url", "healthy", "running", "waiting",
    # "kv_cache_usage", "prefix_hit_rate", "prefix_queries", "kv_cache_tokens", "detail"}, in config order;
    # the fields above are then the workers' together
    workers: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class GpuSample(Event):
    """The GPUs of the box the run is on, read through NVML with each round of server samples.

    Each GPU as {"index", "name", "utilization", "memory_used_bytes", "memory_total_bytes", "power_w",
    "power_limit_w", "temperature_c"} (utilization 0..1; a value the GPU does not report is None). No GPU
    readable (no NVIDIA driver, no bindings): `gpus` empty and `error` says why, once.
    """

    kind: ClassVar[str] = "GpuSample"
    gpus: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    error: str = ""


@dataclass(frozen=True, slots=True)
class ToolCallStarted(Event):
    """An agent's MCP tool call began executing (after its permission): the idle deadline waits meanwhile,
    and the call has its own deadline (`deadline`, monotonic; None: none) with warnings at `warn_at`."""

    kind: ClassVar[str] = "ToolCallStarted"
    agent: str
    attempt: int
    turn: int
    call_id: str
    server: str
    tool: str
    arguments: str  # JSON text as the model sent it, secrets scrubbed, cut to 2000 characters
    deadline: float | None = None
    warn_at: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCallFinished(Event):
    """A tool call ended: ok, error (the server's or ours), denied (by a rule, the operator or headless),
    timeout (its tool deadline) or killed (by the operator); `result` is a one-line preview of what the model got."""

    kind: ClassVar[str] = "ToolCallFinished"
    agent: str
    call_id: str
    server: str
    tool: str
    outcome: Literal["ok", "error", "denied", "timeout", "killed"]
    result: str  # one line, at most 200 characters, scrubbed
    elapsed_s: float


@dataclass(frozen=True, slots=True)
class ApprovalRequested(Event):
    """A tool call the server's rules `ask` about waits for the operator (the agent's status is "approval")."""

    kind: ClassVar[str] = "ApprovalRequested"
    agent: str
    call_id: str
    server: str
    tool: str
    arguments: str  # as in ToolCallStarted


@dataclass(frozen=True, slots=True)
class ApprovalDecided(Event):
    """What was decided about a tool call: once, for the rest of the run, or denied; by whom."""

    kind: ClassVar[str] = "ApprovalDecided"
    agent: str
    call_id: str
    server: str
    tool: str
    decision: Literal["once", "run", "deny"]
    by: Literal["operator", "rule", "headless"]


@dataclass(frozen=True, slots=True)
class ToolCallWarning(Event):
    """A running tool call has passed `fraction` of its tool deadline."""

    kind: ClassVar[str] = "ToolCallWarning"
    agent: str
    call_id: str
    fraction: float
    remaining_s: float


@dataclass(frozen=True, slots=True)
class RunFinished(Event):
    kind: ClassVar[str] = "RunFinished"
    run_id: str
    exit_code: int
    totals: dict[str, Any]
    report_path: str = ""


ALL_EVENTS: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        RunStarted, WaveStarted, WaveFinished, AgentQueued, AgentPlaced, AgentStarted, EndpointWaiting, FirstToken,
        TokenDelta, KeepAlive, MessageRecorded, TurnFinished, AgentMeters, StallWarning, StallExtended, AgentKilled, AgentRetrying,
        AgentFinished, AgentRerun, ModeChanged, ConcurrencyChanged, ServerSample, RunFinished, GpuSample,
        RunStopping, RunNotice, ModelResolved, StallPolicyChanged, LoadChanged, ProbeStarted, ProbeProgress,
        ProbeFinished, ToolCallStarted, ToolCallFinished, ApprovalRequested, ApprovalDecided, ToolCallWarning,
    )
}



def handlers(obj: object, *prefixes: str) -> dict[str, Callable[[Any], Any]]:
    """How a subscriber dispatches: its methods named a prefix + an event kind (`_on_RunStarted`), by kind,
    looked up once. With several prefixes a kind's methods run in their order (a subclass's after its base's)."""
    table: dict[str, Callable[[Any], Any]] = {}
    for kind in ALL_EVENTS:
        found = [m for prefix in prefixes if (m := getattr(obj, prefix + kind, None)) is not None]
        if len(found) == 1:
            table[kind] = found[0]
        elif found:
            table[kind] = _each(found)
    return table


def _each(methods: list[Callable[[Any], Any]]) -> Callable[[Any], None]:
    def each(event: Any) -> None:
        for method in methods:
            method(event)
    return each

def from_dict(data: dict[str, Any]) -> Event | None:
    """An event from its `to_dict()` form (a journal line, a socket message); None for a kind this version
    does not know or a record of the wrong shape. Fields it does not know are left out, and fields a record
    lacks take their defaults, so journals of older and newer versions both load."""
    cls = ALL_EVENTS.get(data.get("event", ""))  # type: ignore[arg-type]
    if cls is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError:
        return None
