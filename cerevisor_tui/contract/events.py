"""The run's event stream: small immutable records that the journal, the report, the printer, the control
socket and every console subscribe to (one stream of truth), defined once for the run and its consoles.

Each event is a msgspec Struct tagged by its class name in the field "event": `msgspec.json.encode(event)`
is its line in `events.jsonl` and on the control socket, and `decode_event` reads one back, its fields
checked against their types. A field this version does not know is an error, never silently dropped; a
field a record lacks takes its default, so journals of earlier versions still read. `t` is
`time.monotonic()` when the event happened.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec

# An agent's statuses and the run's modes are defined in cerevisor_tui/kinds.py; the console reads them here.
from cerevisor_tui.kinds import (  # noqa: F401
    ACTIVE,
    FINAL,
    STATUSES,
    EndpointStateName,
    FinalStatus,
    Mode,
    Status,
    WedgeRule,
)

Severity = Literal["information", "warning", "error"]
Zone = Literal["fits", "cliff", "overflow"]
ChangedBy = Literal["", "operator", "auto"]
"""Who changed a mode or a cap: an operator's command (a console's key, the control socket), auto mode's
controller; "" where it is not a change of the cap (a pause, the budget's, a probe's) or not said (an older
journal)."""
"""fits (all in GPU memory), cliff (evictions are recomputed or reloaded), overflow (a CPU tier full too)."""
Role = Literal["system", "developer", "user", "assistant", "tool"]
StallDeadline = Literal["first_byte", "idle"]  # contract/deadlines.py Phase
ExtendedDeadline = Literal["first_byte", "idle", "tool"]  # "tool": a tool call's own deadline
RecommendedMode = Literal["sequential", "parallel"]  # the run modes a probe recommends (kinds.Mode, but for auto)
KillDeadline = Literal["first_byte", "idle", "operator", "wedge"]  # "wedge": its server is wedged (engine/wedge.py)

EVENT_TYPES: list[type[Event]] = []
"""Every event class, in the order they are defined (each registers itself)."""


# ---- what events carry ----------------------------------------------------------------------------------
class Payload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A typed part of an event: checked as the event is, a field this version does not know an error."""


Seconds = Annotated[float, msgspec.Meta(gt=0, le=sys.float_info.max)]
"""A positive, finite number of seconds (a NaN, infinite or negative deadline would disable the watchdog)."""
Fraction = Annotated[float, msgspec.Meta(gt=0, lt=1)]


class StallPolicy(Payload, frozen=True):
    """An endpoint's stall policy in force ([stall] with its overrides, config/models.py `resolve_stall`): what
    both deadlines and their warnings run by (contract/deadlines.py). Bounded as `[stall]` is, since a console
    may send one whole (`set_stall`); its warnings in order, each once."""

    first_byte_timeout_s: Seconds
    idle_timeout_s: Seconds
    warn_at: tuple[Fraction, ...]
    liveness: Literal["tokens", "bytes"]
    extend_s: Seconds
    max_extensions: Annotated[int, msgspec.Meta(ge=0)]
    extend_when_server_busy: bool

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "warn_at", tuple(sorted(set(self.warn_at))))


class EndpointSummary(Payload, frozen=True):
    """An endpoint of the run as a console and the report show it: never its key, only the variable's name."""

    name: str
    kind: str = ""
    base_url: str | None = ""
    model: str = ""
    max_concurrency: int = 0
    api_key_env: str = ""
    stall: StallPolicy | None = None  # None: not said (an older journal)
    price_in_per_mtok: float = 0.0  # priced endpoints only: what a million tokens cost in and out
    price_out_per_mtok: float = 0.0

    @property
    def priced(self) -> bool:
        return bool(self.price_in_per_mtok or self.price_out_per_mtok)


class AgentPlan(Payload, omit_defaults=True, frozen=True):
    """What a console shows of an agent before it starts: where it runs, its wave, its turns."""

    endpoint: str  # its endpoint, or its pool's name until it is placed
    wave: int
    turns: int = 1
    pool: str = ""


class LoadEstimate(Payload, frozen=True):
    """How many conversations fit in an endpoint's KV memory: from config (the capacity model), or from the
    server's own KV capacity once it reports one (engine/load.py)."""

    conversations_fit: int
    kv_capacity_tokens: int
    context_tokens: int
    cpu_conversations: int = 0  # what a CPU-offload tier holds beyond them
    source: str = "estimate"  # "estimate" (from config) or "server" (the server's own capacity)
    detail: str = ""

    def zone(self, running: int) -> Zone:
        """fits (all in GPU memory), cliff (evictions are recomputed or reloaded), overflow (CPU tier full too)."""
        if running <= self.conversations_fit:
            return "fits"
        if self.cpu_conversations and running > self.conversations_fit + self.cpu_conversations:
            return "overflow"
        return "cliff"


class ProbeLevelSummary(Payload, frozen=True):
    """What one concurrency level of a probe measured (endpoints/knee.py's ProbeLevel, rounded)."""

    concurrency: int
    requests: int
    failed: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    stream_tokens_per_s: float | None  # median decode rate of one stream
    server_running_max: int | None = None
    server_waiting_max: int | None = None
    server_waiting_share: float | None = None  # share of samples with requests waiting
    kv_cache_usage_max: float | None = None
    complete: bool = True  # False: the time budget cut it short
    first_error: str = ""
    prefix_hit_rate: float | None = None  # None: the server does not report its prefix cache
    preemptions: int | None = None
    conversations: int | None = None  # conversation mode: conversations run (requests counts their turns)


class ProbeBounds(Payload, frozen=True):
    """What bounded a probe's sweep."""

    max_concurrency: int
    max_tokens: int
    turn_max_tokens: int | None
    max_requests: int
    max_seconds: float
    request_timeout_s: float


class ProbeSummary(Payload, frozen=True):
    """A whole probe (`probe --json` prints the same): the server, the levels measured, the recommendation."""

    base_url: str
    model: str
    mode: str
    agents: int
    server_kind: str
    max_model_len: int | None
    kv_cache_tokens: int | None
    health: str
    levels: list[ProbeLevelSummary]
    prefix_hits_reported: bool
    recommended_concurrency: int
    recommended_mode: RecommendedMode
    reason: str
    stopped_because: str
    total_requests: int
    elapsed_s: float
    bounds: ProbeBounds


class RunTotals(Payload, omit_defaults=True, frozen=True):
    """A run's figures at its end, as report.json's `totals` has them."""

    agents: int
    completed: int
    failed: int
    killed: int
    skipped: int
    cancelled: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float | None
    max_running: int
    cost_usd: float = 0.0  # priced endpoints only
    sessions: int = 0  # a gateway's sessions (not among `agents`)


class WorkerSample(Payload, frozen=True):
    """One worker behind a router (an endpoint's `metrics_urls`), as its own /health and /metrics said."""

    url: str
    healthy: bool | None
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    prefix_hit_rate: float | None = None
    prefix_queries: float | None = None  # prefix-cache lookups since its last sample, to weigh the rate by
    kv_cache_tokens: float | None = None
    detail: str = ""


class TierReading(Payload, frozen=True):
    """One KV tier of a server (endpoints/tiers.py): prefix `hits` it served since the run's first sample (in
    `unit`: tokens, or chunks for vLLM's tiers under the CPU one), and its fill where the server tells it."""

    tier: str  # "gpu", "cpu", or the server's name of a tier under the CPU one ("1:fs", "storage")
    hits: float | None = None
    unit: str = "tokens"
    used_tokens: float | None = None
    capacity_tokens: float | None = None
    usage: float | None = None


class TierSample(Payload, frozen=True):
    """Where a server keeps KV beyond GPU memory, as its /metrics says (vLLM offload, LMCache, SGLang HiCache):
    each tier, GPU first, and `warning` when a tier stores without ever loading."""

    source: str  # vllm | lmcache | sglang
    tiers: list[TierReading] = msgspec.field(default_factory=list)
    warning: str = ""


class Quantiles(Payload, omit_defaults=True, frozen=True):
    """One latency figure over a window: its median and 95th percentile in seconds, and how many observations
    (requests, or tokens for inter-token latency) they stand for. A quantile a histogram cannot place closer than
    a bound is that bound, and says which side of it the quantile lies: "below" (in the first bucket: under its
    upper bound) or "above" (in the +Inf bucket: over the highest finite bound); "" when it was interpolated."""

    p50_s: float
    p95_s: float
    count: float
    p50_bound: Literal["", "below", "above"] = ""
    p95_bound: Literal["", "below", "above"] = ""


class GpuReading(Payload, frozen=True):
    """One GPU of the run's box, through NVML (utilization 0..1); None where the GPU does not report a value."""

    index: int
    name: str
    utilization: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None


class Event(msgspec.Struct, frozen=True, tag_field="event", tag=True, forbid_unknown_fields=True):
    kind: ClassVar[str] = "Event"  # the class's name, which is its tag: set for each subclass
    t: float

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind = cls.__name__
        EVENT_TYPES.append(cls)

    def to_dict(self) -> dict[str, Any]:
        """The event's JSON form as plain values (`{"event": kind, "t": ..., ...}`)."""
        return msgspec.to_builtins(self)


class RunStarted(Event, frozen=True):
    run_id: str
    mode: Mode
    max_concurrency: int
    waves: list[list[str]]
    endpoints: list[EndpointSummary]
    run_dir: str = ""
    note: str = ""
    agents: dict[str, AgentPlan] = msgspec.field(default_factory=dict)
    reused: list[str] = msgspec.field(default_factory=list)  # a resumed run's completed agents, not sent again
    auto_ceiling: int = 0  # auto mode's ceiling (what `+`/`-` move there); 0: not said (an older journal)
    paused: bool = False  # admissions held from the start (paused before the run began)
    effective_cap: int = 0  # what may run at once now (auto: the sum of the endpoints' live caps); 0: not said


class RunStopping(Event, frozen=True):
    """The run was told to stop: no more admissions; running and queued agents are being cancelled."""

    reason: str


class RunNotice(Event, frozen=True):
    """Something the operator should read that belongs to no agent (e.g. the stream worker could not start)."""

    message: str
    severity: Severity = "information"
    title: str = ""


class ModelResolved(Event, frozen=True):
    """An endpoint configured without a model: the one its /v1/models listed first, which the run requests."""

    endpoint: str
    model: str


class StallPolicyChanged(Event, frozen=True):
    """An endpoint's stall policy changed live (the settings screen): new and running attempts use it now."""

    endpoint: str
    policy: StallPolicy


class LoadChanged(Event, frozen=True):
    """How close an endpoint is to its KV-cache cliff, as the engine judges it (engine/load.py): sent when
    any part changes (an admission, a server sample, a new estimate, the cap)."""

    endpoint: str
    conversations: int  # in flight on it: ours holding a slot, or what the server carries when it reports more
    cap: int  # how many the cap lets run on it now
    zone: Zone | Literal[""] = ""  # "" without an estimate
    estimate: LoadEstimate | None = None  # None: no estimate
    note: str = ""  # why there is no estimate
    warning: str = ""  # set when the cap is past the conversations that fit: the operator's notice


class ProbeStarted(Event, frozen=True):
    """A probe of one of the run's endpoints began (the console's `probe` command); admissions wait meanwhile."""

    endpoint: str
    max_concurrency: int
    agents: int = 0  # agents on the endpoint whose conversations it replays (0: single requests)


class ProbeProgress(Event, frozen=True):
    """What the probe is doing (`line`), or a level it finished measuring (`level`)."""

    endpoint: str
    line: str = ""
    level: ProbeLevelSummary | None = None


class ProbeFinished(Event, frozen=True):
    """The probe ended: its `result`, or why not (`error`), or cancelled by the operator."""

    endpoint: str
    result: ProbeSummary | None = None
    error: str = ""
    cancelled: bool = False


class WaveStarted(Event, frozen=True):
    wave: int
    agents: list[str]


class WaveFinished(Event, frozen=True):
    wave: int
    statuses: dict[str, Status]


class AgentQueued(Event, frozen=True):
    agent: str
    wave: int


class SessionWaits(Event, frozen=True):
    """A gateway session's request waits for a slot: the run's admission did not give it one at once (told once a
    wait, after its AgentQueued). `why` in the operator's words: who holds the slots and when an idle session gives
    its own back, or the pause, or its endpoint's warm-up."""

    agent: str
    why: str


class GatewayServing(Event, frozen=True):
    """The run serves a gateway (gateway/): where harnesses point their base URL, the models it routes, and its
    model_map (glob -> served model)."""

    url: str  # its base URL, …/v1
    models: list[str] = msgspec.field(default_factory=list)  # the served models it knows of ([] not known yet)
    mapped: dict[str, str] = msgspec.field(default_factory=dict)


class SessionOpened(Event, frozen=True):
    """A gateway session appeared (gateway/): from now on an agent of the run, its requests its attempts."""

    agent: str
    source: str  # what named it: "X-Session-ID", "metadata.user_id", "prompt_cache_key", "path", "key", ...
    harness: str  # from its User-Agent: "claude-cli/2.0.1", "OpenAI/Python 1.99.0"; "" when it sends none
    api: str  # its first request's API: "chat", "responses" or "messages"
    endpoint: str  # the endpoint or pool that serves it
    key: str = ""  # the name of the environment variable whose client key it sent (`[gateway] keys_env`)
    # what its row shows a person: the harness and a short id where its name is a generated id or a fingerprint
    # ("claude-code 226c5305"; "": its name), what it is about ('"fix the login bug…" · in …/shop/api'), and the
    # harness's own session id where a path label named it instead
    title: str = ""
    topic: str = ""
    own_id: str = ""


class AgentStatus(Event, frozen=True):
    """An agent's status changed, as the engine keeps it (kinds.py): what every console shows, inferring none.
    An agent's final status also comes with its AgentFinished."""

    agent: str
    status: Status


class AgentPlaced(Event, frozen=True):
    """A pool's agent was placed on a member (it stays there for every turn), or moved off a member that is down
    (`moved_from`, with `reason`: the conversation's prefix cache there is lost)."""

    agent: str
    endpoint: str
    pool: str
    moved_from: str = ""
    reason: str = ""


class AgentStarted(Event, frozen=True):
    """An attempt was admitted and its request is being sent (the stall clock starts here)."""

    agent: str
    attempt: int
    turn: int
    turns: int
    endpoint: str
    first_byte_deadline_s: float
    idle_deadline_s: float
    request_id: str = ""  # the X-Request-Id the request carries: the server logs its abort under this id
    step: int = 0  # an agent with tools: the step of the turn's tool loop (1, 2, ...); 0: no tool loop
    # a gateway session's request: how long it waited in the gateway for a slot (not model silence), and the
    # model its harness asked for with the one sent upstream (`[gateway] model_map`, `--model`)
    queued_s: float = 0.0
    model_asked: str = ""
    model_sent: str = ""


class EndpointWaiting(Event, frozen=True):
    """A local endpoint refused the connection inside the first-byte window: the attempt keeps reconnecting."""

    agent: str
    attempt: int
    endpoint: str
    reason: str
    retry_in_s: float


class FirstToken(Event, frozen=True):
    """The answer's first token, `ttft_s` after the request went out; `streamed` False: the first bytes of an answer
    that comes whole (a gateway client that did not ask to stream), whose time to first token no one can read."""

    agent: str
    attempt: int
    turn: int
    ttft_s: float
    streamed: bool = True


class TokenDelta(Event, frozen=True):
    """Streamed text: `text` is answer content, `reasoning` thinking text, `tool` tool-call text.

    One event carries the consecutive chunks of one network read (`tokens` of them, one token each as
    servers stream): a stream read in time gives one event per token, a busy one fewer and longer ones.
    """

    agent: str
    attempt: int
    text: str
    reasoning: str = ""
    tool: str = ""
    tokens: int = 1


class KeepAlive(Event, frozen=True):
    """Bytes that carry no token (an SSE comment, an empty delta): shown, counted as life only with liveness=bytes."""

    agent: str
    attempt: int


class TurnFinished(Event, frozen=True):
    """A request's end with its answer, or a gateway session's request that ended without one (`answered` false:
    the client went away, the upstream refused or broke off; `finish_reason` says which). A kill is AgentKilled."""

    agent: str
    attempt: int
    turn: int
    turns: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    ttft_s: float | None
    duration_s: float
    answered: bool = True  # (a journal of an earlier version has none: each of its ends read as answered)


class AgentMeters(Event, frozen=True):
    """An agent's meters after each request: its prompt served from the server's prefix cache, how full its
    context is, and what it has cost so far (priced endpoints), with the run's cost."""

    agent: str
    turn: int
    prompt_tokens: int  # of this request
    cached_tokens: int | None  # of those, served from the prefix cache; None: the server does not say
    context_tokens: int  # the conversation's length now: the last prompt and its answer
    max_model_len: int = 0  # the model's context length; 0: unknown
    cost_usd: float = 0.0  # the agent's so far
    run_cost_usd: float = 0.0  # the run's so far
    warning: str = ""  # the context is nearly full, or the next turn will not fit


class MessageRecorded(Event, frozen=True):
    """A whole message of an agent's conversation, as sent or as answered (`partial` when its attempt died)."""

    agent: str
    attempt: int
    turn: int
    role: Role
    content: str
    reasoning: str = ""
    partial: bool = False
    # OpenAI's form: an assistant message's calls ({"id", "type": "function", "function": {"name", "arguments"}});
    # a "tool" message answers the call named by tool_call_id
    tool_calls: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tool_call_id: str = ""
    # a gateway session's message as its client sent it (its API's own shape), for its transcript; {}: none
    raw: dict[str, Any] = msgspec.field(default_factory=dict)
    # a turn's user message: what the turn is answered under besides its text (system prompt and settings, texts as
    # digests: engine/resume.py turn_inputs); a resumed run reuses the turn only while they are the same. {}: not said
    inputs: dict[str, str] = msgspec.field(default_factory=dict)


class StallWarning(Event, frozen=True):
    """An attempt has passed `fraction` of a deadline without a sign of life."""

    agent: str
    attempt: int
    deadline: StallDeadline
    fraction: float
    remaining_s: float
    deadline_at: float  # monotonic time the deadline fires


class StallExtended(Event, frozen=True):
    agent: str
    attempt: int
    deadline: ExtendedDeadline
    extend_s: float
    reason: str
    deadline_at: float
    extensions: int
    by_operator: bool = False  # the operator's `e` (the agent is no longer stalling), not the busy server


class PrefillProgress(Event, frozen=True):
    """How far an attempt's prompt is prefilled, before its first token: as its server says (llama-server's
    prompt_progress), or `estimated` from the endpoint's measured prefill rate (a server that says nothing).
    Told at most about once a second per attempt; the stall watchdog extends the first-byte deadline by it."""

    agent: str
    attempt: int
    total: int  # prompt tokens
    cached: int  # of those, from the prefix cache
    processed: int  # of those, done (the cached ones included)
    rate_tok_s: float | None = None  # prompt tokens computed per second; None: not measured yet
    eta_s: float | None = None  # seconds left at that rate, from `t`
    estimated: bool = False


class AgentKilled(Event, frozen=True):
    agent: str
    attempt: int
    deadline: KillDeadline
    reason: str
    tokens: int


class AgentRetrying(Event, frozen=True):
    agent: str
    attempt: int  # the attempt about to start
    cause: str
    delay_s: float


class AgentFinished(Event, frozen=True):
    """The agent is done: status completed | failed | killed | skipped | cancelled."""

    agent: str
    status: FinalStatus
    error: str = ""
    output: str = ""
    # What a completed agent ran with (engine.agent_inputs): a resumed run compares it with its config
    inputs: dict[str, str] = msgspec.field(default_factory=dict)


class AgentRerun(Event, frozen=True):
    """A resumed run sends an agent the journal says completed, because what it would run with changed."""

    agent: str
    reason: str  # e.g. "prompt changed", "max_tokens 30 -> 60", "its dependency a0 runs again"


class ModeChanged(Event, frozen=True):
    mode: Mode
    effective_cap: int
    note: str = ""
    by: ChangedBy = ""


class ConcurrencyChanged(Event, frozen=True):
    max_concurrency: int  # the parallel cap
    effective_cap: int  # what may run now: the run's, or with `endpoint` that endpoint's live cap
    paused: bool = False
    endpoint: str = ""  # set when one endpoint's cap changed (auto mode)
    reason: str = ""  # why, e.g. "auto: 24 -> 32 (throughput +18% at 24, nothing waiting, KV 61%)"
    ceiling: int = 0  # auto mode's ceiling (what `+`/`-` move there); 0 in an event not about auto
    total_cap: int = 0  # what the whole run may run now (auto: the sum of the live caps); 0: not said
    by: ChangedBy = ""


class ServerSample(Event, frozen=True):
    """What an endpoint's /health and /metrics said; None where the server does not report a value."""

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
    # an endpoint that is a router (metrics_urls): each worker, in config order; the fields above are then
    # the workers' together
    workers: list[WorkerSample] = msgspec.field(default_factory=list)
    # the KV tiers the server reports beyond GPU memory; None for a server with none (or an older journal)
    tiers: TierSample | None = None


class ServerWedged(Event, frozen=True):
    """An endpoint's server is wedged (engine/wedge.py): its requests of ours were killed, each with `reason`, and
    a pool member is marked down; or, with `over`, it moves again (its counters or KV use changed)."""

    endpoint: str
    rule: WedgeRule
    reason: str  # "server wedged: no progress on any request for 45 s"
    agents: list[str] = msgspec.field(default_factory=list)  # whose attempts it killed
    over: bool = False


class EndpointState(Event, frozen=True):
    """An endpoint's state changed, as the run's one owner of it judges (engine/endpoint_state.py): "up" (it
    answers and is ready), "loading" (it says so: /health 503, llama.cpp's "Loading model"), "down" (its port
    refuses, or its health check fails, past the rules' grace) or "wedged" (engine/wedge.py). Told only on a
    change; `since` is when this state began (a down endpoint's: its first refusal), `why` says it in words
    ("connection refused at 127.0.0.1:8399")."""

    endpoint: str
    state: EndpointStateName
    why: str = ""
    since: float = 0.0


class GpuSample(Event, frozen=True):
    """The GPUs of the box the run is on, read through NVML with each round of server samples. No GPU readable
    (no NVIDIA driver, no bindings): `gpus` empty and `error` says why, once."""

    gpus: list[GpuReading] = msgspec.field(default_factory=list)
    error: str = ""


class WarmupStarted(Event, frozen=True):
    """Before wave 1, one short request goes to each of these endpoints (`[run] warmup`): the run is `warming up`,
    and no agent is sent before the warm-up ends."""

    endpoints: list[str]


class EndpointWarmed(Event, frozen=True):
    """An endpoint's warm-up request ended: `cold_start_s` is its time to first token, the endpoint's cold start;
    None when it failed, and `error` says why (the agents' own watchdog then judges the endpoint)."""

    endpoint: str
    cold_start_s: float | None = None
    error: str = ""


class LatencySample(Event, frozen=True):
    """The latency panel of one endpoint, with each server sample: p50/p95 over the last `window_s` seconds of
    time to first token, inter-token latency, queue and prefill time (None where the server does not tell or
    nothing was observed). `source`: "histograms" (vLLM's and SGLang's /metrics) or "timings" (llama.cpp's
    per-request timings of our own requests). `decode_stall_s`: seconds the server's generated tokens have been
    flat while it says `running` requests run; None while they move."""

    endpoint: str
    source: str
    window_s: float
    ttft: Quantiles | None = None
    inter_token: Quantiles | None = None
    queue: Quantiles | None = None
    prefill: Quantiles | None = None
    decode_stall_s: float | None = None
    running: float | None = None


class ToolCallStarted(Event, frozen=True):
    """An agent's MCP tool call began executing (after its permission): the idle deadline waits meanwhile,
    and the call has its own deadline (`deadline`, monotonic; None: none) with warnings at `warn_at`."""

    agent: str
    attempt: int
    turn: int
    call_id: str
    server: str
    tool: str
    arguments: str  # JSON text as the model sent it, secrets scrubbed, cut to 2000 characters
    deadline: float | None = None
    warn_at: tuple[float, ...] = ()


class ToolCallFinished(Event, frozen=True):
    """A tool call ended: ok, error (the server's or ours), denied (by a rule, the operator or headless),
    timeout (its tool deadline) or killed (by the operator); `result` is a one-line preview of what the model got."""

    agent: str
    call_id: str
    server: str
    tool: str
    outcome: Literal["ok", "error", "denied", "timeout", "killed"]
    result: str  # one line, at most 200 characters, scrubbed
    elapsed_s: float


class ApprovalRequested(Event, frozen=True):
    """A tool call the server's rules `ask` about waits for the operator (the agent's status is "approval")."""

    agent: str
    call_id: str
    server: str
    tool: str
    arguments: str  # as in ToolCallStarted


class ApprovalDecided(Event, frozen=True):
    """What was decided about a tool call: once, for the rest of the run, or denied; by whom."""

    agent: str
    call_id: str
    server: str
    tool: str
    decision: Literal["once", "run", "deny"]
    by: Literal["operator", "rule", "headless"]


class ToolCallWarning(Event, frozen=True):
    """A running tool call has passed `fraction` of its tool deadline."""

    agent: str
    call_id: str
    fraction: float
    remaining_s: float


class RunTally(Event, frozen=True):
    """The run's totals that its journal cannot give back (token deltas are not journaled), as the run counted
    them: sent by the control socket to a console after its replay, so one that attaches late shows what the run
    has done, not what it saw since. Never journaled."""

    output_tokens: Annotated[int, msgspec.Meta(ge=0)]  # streamed so far by this run's process, every agent and session


class RunFinished(Event, frozen=True):
    run_id: str
    exit_code: int
    totals: RunTotals
    report_path: str = ""


def _union() -> Any:
    return Union[tuple(EVENT_TYPES)]  # noqa: UP007 (a union built at run time)


AnyEvent = _union()
"""Any event: what a journal line or a socket message decodes to."""
_decoder = msgspec.json.Decoder(AnyEvent)
_KINDS: dict[str, type[Event]] = {cls.kind: cls for cls in EVENT_TYPES}
_encoder = msgspec.json.Encoder()


class EventError(ValueError):
    """A record that is not an event of this version: one line says why."""


def encode_event(event: Event) -> bytes:
    """The event's JSON line (without its newline), as `events.jsonl` and `--jsonl` have it."""
    return _encoder.encode(event)


def decode_event(line: bytes | str) -> Event:
    """The event a JSON line holds, its fields checked; raises EventError, saying why, for anything else (not
    JSON, a kind this version does not know, a field unknown or of the wrong type, a required one missing)."""
    try:
        return _decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise EventError(str(exc)) from None


def event_of(data: Any) -> Event:
    """The event a parsed JSON record holds (a dict), checked as `decode_event` checks a line. Converted to its
    kind's own type where the record names one: msgspec keeps what it learns of a Struct type, not of a union
    (converting to AnyEvent took ~140 us a record, to its type ~10); anything else to the union, for its message."""
    tag = data.get("event") if isinstance(data, dict) else None
    kind = _KINDS.get(tag) if isinstance(tag, str) else None
    try:
        return msgspec.convert(data, AnyEvent if kind is None else kind)
    except msgspec.ValidationError as exc:
        raise EventError(str(exc)) from None


def handlers(obj: object, *prefixes: str) -> dict[str, Callable[[Any], Any]]:
    """How a subscriber dispatches: its methods named a prefix + an event kind (`_on_RunStarted`), by kind,
    looked up once. With several prefixes a kind's methods run in their order (a subclass's after its base's)."""
    table: dict[str, Callable[[Any], Any]] = {}
    for cls in EVENT_TYPES:
        found = [m for prefix in prefixes if (m := getattr(obj, prefix + cls.kind, None)) is not None]
        if len(found) == 1:
            table[cls.kind] = found[0]
        elif found:
            table[cls.kind] = _each(found)
    return table


def _each(methods: list[Callable[[Any], Any]]) -> Callable[[Any], None]:
    def each(event: Any) -> None:
        for method in methods:
            method(event)
    return each
