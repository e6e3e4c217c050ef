"""A replay file sent closed loop to an OpenAI-compatible server: each session a conversation whose turn goes
out only after the previous answer arrived and its gap passed, so a slow server is never sent more than the
sessions would send it (no coordinated omission).

A turn's prompt is its blocks' text, one user message: block id b is always the same `BLOCK_CHARS` characters
(its id, then fixed words), so two prompts share exactly the prefix their `hash_ids` share and the server's
prefix cache sees the trace's own sharing. 4 characters are a token, as the built-in simulator counts; a real
tokenizer's count of these English words differs somewhat (and so the prompt's length in its tokens). `max_tokens` is the turn's `output_length`;
the trace's blocks, not the server's answer, carry the history into the next turn.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import httpx
from anyio.abc import TaskGroup

from cerevisor_tui.endpoints.client import ChatStream, build_client, list_models
from cerevisor_tui.endpoints.errors import EndpointError
from cerevisor_tui.endpoints.metrics import MetricsSnapshot, prefix_hit_rate, read_server
from cerevisor_tui.endpoints.probe import percentile
from cerevisor_tui.kinds import DELTA
from cerevisor_tui.replay.trace import BLOCK_TOKENS, TraceTurn, whole_prompts

CHARS_PER_TOKEN = 4
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN
_WORDS = ("the agent read the file and ran the tests then the build passed so it wrote the next step of "
          "the plan into the cache while the model kept the context of the repository in view ")
_FILLER = _WORDS * (BLOCK_CHARS // len(_WORDS) + 1)


def block_text(block_id: int | str) -> str:
    """The text of block `block_id`: `BLOCK_CHARS` characters, the same for the same id, different for another."""
    head = f"<block {block_id}> "
    return head + _FILLER[: BLOCK_CHARS - len(head)]


def prompt_text(hash_ids: list[int], tokens: int, session_id: str = "") -> str:
    """A prompt of `tokens` tokens made of the blocks `hash_ids` names (the last one cut to fit). A file that
    names fewer blocks than the prompt needs gets the rest as its session's own, by position, so that its next
    turn still extends it."""
    needed = -(-tokens // BLOCK_TOKENS)
    named = "".join(block_text(block) for block in hash_ids[:needed])
    own = "".join(block_text(f"{session_id}/{index}") for index in range(len(hash_ids), needed))
    return (named + own)[: tokens * CHARS_PER_TOKEN]


@dataclass(frozen=True)
class Slo:
    """What a turn must meet to count in goodput: its own interactivity (output tokens/s after the first) at least
    `min_interactivity_tokens_s`, and, past a session's first turn (whose whole prompt is new), a TTFT of at most
    `max_ttft_s`. AgentX's bar: 50 tokens/s per user; 30 s to the first token of a turn."""

    min_interactivity_tokens_s: float = 50.0
    max_ttft_s: float = 30.0

    def met(self, result: TurnResult) -> bool:
        if result.error or result.first_at is None or result.ended_at is None:
            return False
        if result.turn > 1 and result.first_at - result.sent_at > self.max_ttft_s:
            return False
        rate = _rate(result)
        return rate is None or rate >= self.min_interactivity_tokens_s


@dataclass(frozen=True)
class ReplaySettings:
    """How a replay runs."""

    concurrency: int = 8  # top-level sessions under way at once (a subagent runs in its parent's)
    speed: float = 1.0  # gaps between turns are divided by this
    # what turns are timed on, in the server's seconds: the wall for a real server, a simulator's own clock
    # (BatchEngine.clock_s) for one whose sped-up clock the host may not keep pace with
    clock: Callable[[], float] = time.monotonic
    # `clock` is a simulator's, `speed` times the wall while its host keeps pace: the gaps are slept on it, in its
    # seconds (else they are the wall's, divided by the speed)
    clock_sped_up: bool = False
    slo: Slo = field(default_factory=Slo)
    model: str = ""  # empty: the first of /v1/models
    request_timeout_s: float = 600.0
    extra_headers: dict[str, str] = field(default_factory=dict)
    metrics_url: str = ""  # the server whose /metrics count the prefix hits (…/v1), when it is not the one sent to


@dataclass
class TurnResult:
    """One turn as the server answered it."""

    session_id: str
    turn: int
    sent_at: float
    first_at: float | None = None
    ended_at: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


@dataclass
class ReplayReport:
    """What a replay measured (times in the server's own seconds: a simulator's clock at its speed)."""

    base_url: str
    model: str
    sessions: int
    turns: int
    turns_completed: int
    turns_failed: int
    sessions_completed: int
    prompt_tokens: int
    output_tokens: int
    ttft: dict[str, float | None]
    interactivity: dict[str, float | None]
    prefix_hit_rate: float | None  # of the GPU's prefix cache
    # turns that met the SLO: how many, their share of the file's turns, and per minute of the makespan
    goodput: dict[str, Any]
    makespan_s: float
    concurrency: int
    speed: float
    first_error: str = ""
    # prompt tokens served from the CPU tier over those asked of the GPU's cache; None: the server has no CPU tier
    cpu_hit_rate: float | None = None
    # through a gateway: the run's cap changes ({t_s, cap, endpoint, reason}) and kills ({session, deadline, reason})
    caps: list[dict[str, Any]] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    turn_log: list[TurnResult] = field(default_factory=list, repr=False)  # every turn, in the order it ended

    def to_dict(self, *, per_session: bool = False) -> dict[str, Any]:
        """The report without its turn log; `per_session`: with each session's own figures under "per_session"."""
        figures = asdict(self)
        del figures["turn_log"]
        if per_session:
            figures["per_session"] = self.per_session()
        return figures

    def per_session(self) -> list[dict[str, Any]]:
        """Each session's turns answered and failed, and its TTFT and interactivity p50/p90, in the order each
        began (a subagent is its own session here)."""
        by_session: dict[str, list[TurnResult]] = {}
        for result in sorted(self.turn_log, key=lambda r: r.sent_at):
            by_session.setdefault(result.session_id, []).append(result)
        rows = []
        for session_id, results in by_session.items():
            ttfts, rates = _timings([r for r in results if not r.error])
            rows.append({"session_id": session_id, "turns_completed": sum(1 for r in results if not r.error),
                         "turns_failed": sum(1 for r in results if r.error),
                         "ttft": {"p50_s": percentile(ttfts, 50), "p90_s": percentile(ttfts, 90)},
                         "interactivity": {"p50_tokens_per_s": percentile(rates, 50),
                                           "p90_tokens_per_s": percentile(rates, 90)}})
        return rows


@dataclass
class Plan:
    """The file as sessions: each one's turns and whole prompts, and which turn's answer starts which subagent
    (`spawns[(parent, turn)]`, in file order)."""

    turns: dict[str, list[tuple[TraceTurn, int]]] = field(default_factory=lambda: defaultdict(list))
    top_level: list[str] = field(default_factory=list)
    spawns: dict[tuple[str, int], list[str]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def of(cls, turns: list[TraceTurn]) -> Plan:
        plan = cls()
        for turn, whole in whole_prompts(turns):
            if turn.turn == 1:
                if turn.parent is None:
                    plan.top_level.append(turn.session_id)
                else:  # spawned by the answer to its parent's last turn before this line
                    plan.spawns[(turn.parent, len(plan.turns[turn.parent]))].append(turn.session_id)
            plan.turns[turn.session_id].append((turn, whole))
        return plan


Sender = Callable[[Plan, str], Awaitable[tuple[list[TurnResult], float]]]
"""What sends a replay's sessions (its plan, the model) and says how each turn went and the makespan: this module's
closed-loop client, or the run's own agents (commands/replay.py)."""


async def replay(turns: list[TraceTurn], base_url: str, settings: ReplaySettings | None = None,
                 client: httpx.AsyncClient | None = None, send: Sender | None = None) -> ReplayReport:
    """Send `turns` (a replay file's) to `base_url` (…/v1) closed loop and measure what came back; `send`: who sends
    them (default: this module's client, `settings.concurrency` sessions at a time)."""
    settings = settings or ReplaySettings()
    plan = Plan.of(turns)
    own_client = client is None
    client = client or build_client(settings.concurrency)
    try:
        model = settings.model or await _first_model(client, base_url)
        metrics_url = settings.metrics_url or base_url
        before = (await read_server(client, metrics_url)).metrics
        if send is None:
            results, makespan_s = await _run(plan, client, base_url, model, settings)
        else:
            results, makespan_s = await send(plan, model)
        after = (await read_server(client, metrics_url)).metrics
    finally:
        if own_client:
            await client.aclose()
    return _report(plan, results, base_url, model, settings, before, after, makespan_s)


async def _first_model(client: httpx.AsyncClient, base_url: str) -> str:
    listed = await list_models(client, base_url, base_url)
    if not listed:
        raise EndpointError(base_url, "/v1/models lists no model; pass --model")
    return str(listed[0]["id"])


async def _run(plan: Plan, client: httpx.AsyncClient, base_url: str, model: str,
               settings: ReplaySettings) -> tuple[list[TurnResult], float]:
    url = base_url.rstrip("/") + "/chat/completions"
    results: list[TurnResult] = []
    slots = anyio.Semaphore(settings.concurrency)
    clock_started = settings.clock()

    async def conversation(session_id: str, spawned: TaskGroup) -> None:
        for turn, whole in plan.turns[session_id]:
            if turn.turn > 1 or turn.parent is not None:
                await _sleep_until(settings, settings.clock() + _gap(settings, turn.delay_ms))
            result = await _send(client, url, model, turn, whole, settings)
            results.append(result)
            if result.error:
                return
            for child in plan.spawns.get((session_id, turn.turn), ()):
                spawned.start_soon(conversation, child, spawned)

    async def session(session_id: str) -> None:
        first, _ = plan.turns[session_id][0]
        await _sleep_until(settings, clock_started + _gap(settings, first.delay_ms))
        async with slots, anyio.create_task_group() as spawned:  # the slot is held until its subagents end
            await conversation(session_id, spawned)

    async with anyio.create_task_group() as group:
        for session_id in plan.top_level:
            group.start_soon(session, session_id)
    return results, settings.clock() - clock_started


def _gap(settings: ReplaySettings, delay_ms: float) -> float:
    """A trace's gap in the settings' clock's seconds."""
    return delay_ms / 1000 if settings.clock_sped_up else delay_ms / 1000 / settings.speed


async def _sleep_until(settings: ReplaySettings, at: float) -> None:
    """Until the settings' clock reads `at`. A sped-up simulator's clock slows while its host cannot keep pace: gaps
    slept on the wall would then shrink against it, and the more a cap loaded the host, the sooner its sessions
    would come back (its makespan shorter, its goodput higher, than the simulated box's)."""
    pace = settings.speed if settings.clock_sped_up else 1.0
    while (left := at - settings.clock()) > 0:
        await anyio.sleep(left / pace)


async def _send(client: httpx.AsyncClient, url: str, model: str, turn: TraceTurn, whole: int,
                settings: ReplaySettings) -> TurnResult:
    """One turn, streamed and timed; its failure is in `error`, never raised."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt_text(turn.hash_ids, whole, turn.session_id)}],
            "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max(1, turn.output_length)}
    headers = {**settings.extra_headers, "X-Session-ID": turn.session_id,
               "X-Request-ID": f"{turn.session_id}-{turn.turn}"}
    clock = settings.clock
    result = TurnResult(turn.session_id, turn.turn, sent_at=clock())
    stream = ChatStream(client, url, url, body, headers)
    with anyio.move_on_after(settings.request_timeout_s) as scope:
        try:
            async for kind, _ in stream.events():
                if kind == DELTA and result.first_at is None:
                    result.first_at = clock()
        except EndpointError as exc:
            result.error = exc.problem
    if scope.cancelled_caught:
        result.error = f"no complete answer within {settings.request_timeout_s:g} s"
    result.ended_at = clock()
    result.prompt_tokens, result.output_tokens = stream.usage or (0, stream.tokens)
    return result


def _report(plan: Plan, results: list[TurnResult], base_url: str, model: str, settings: ReplaySettings,
            before: MetricsSnapshot | None, after: MetricsSnapshot | None, makespan_s: float) -> ReplayReport:
    done = [r for r in results if not r.error]
    failed = [r for r in results if r.error]
    ttfts, rates = _timings(done)
    good = sum(1 for r in done if settings.slo.met(r))
    turns = sum(len(turns) for turns in plan.turns.values())
    completed_turns: dict[str, int] = defaultdict(int)
    for r in done:
        completed_turns[r.session_id] += 1
    return ReplayReport(
        base_url=base_url, model=model,
        sessions=len(plan.top_level),
        turns=turns,
        turns_completed=len(done), turns_failed=len(failed),
        sessions_completed=sum(1 for name in plan.top_level
                               if completed_turns[name] == len(plan.turns[name])),
        prompt_tokens=sum(r.prompt_tokens for r in done), output_tokens=sum(r.output_tokens for r in done),
        ttft={"p50_s": percentile(ttfts, 50), "p90_s": percentile(ttfts, 90)},
        interactivity={"p50_tokens_per_s": percentile(rates, 50), "p90_tokens_per_s": percentile(rates, 90)},
        prefix_hit_rate=prefix_hit_rate(before, after) if after is not None else None,
        cpu_hit_rate=_cpu_hit_rate(before, after),
        goodput={"turns": good, "share": good / turns if turns else None,
                 "turns_per_min": good / makespan_s * 60 if makespan_s > 0 else None,
                 "min_interactivity_tokens_s": settings.slo.min_interactivity_tokens_s,
                 "max_ttft_s": settings.slo.max_ttft_s},
        makespan_s=makespan_s, concurrency=settings.concurrency, speed=settings.speed,
        first_error=failed[0].error if failed else "", turn_log=results,
    )


def _cpu_hit_rate(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> float | None:
    """Prompt tokens the CPU tier served between two scrapes, over the tokens asked of the GPU's prefix cache: what a
    GPU-only hit rate leaves out on a server with a CPU tier (endpoints/tiers.py reads it)."""
    cpu = after.tiers.tier("cpu") if after is not None and after.tiers is not None else None
    gpu = after.tiers.tier("gpu") if after is not None and after.tiers is not None else None
    if cpu is None or gpu is None or cpu.hits is None or gpu.queries is None:
        return None
    earlier = before.tiers if before is not None else None
    was_cpu, was_gpu = (earlier.tier("cpu"), earlier.tier("gpu")) if earlier is not None else (None, None)
    hits = cpu.hits - ((was_cpu.hits or 0.0) if was_cpu is not None else 0.0)
    queries = gpu.queries - ((was_gpu.queries or 0.0) if was_gpu is not None else 0.0)
    return min(1.0, max(0.0, hits / queries)) if queries > 0 else None


def _rate(result: TurnResult) -> float | None:
    """A turn's interactivity: output tokens per second after its first; None with one token or none."""
    if result.first_at is None or result.ended_at is None or result.output_tokens < 2:
        return None
    if result.ended_at <= result.first_at:
        return None
    return (result.output_tokens - 1) / (result.ended_at - result.first_at)


def _timings(done: list[TurnResult]) -> tuple[list[float], list[float]]:
    """Answered turns' TTFTs (s) and interactivity (output tokens/s after the first), on the settings' clock."""
    ttfts = [r.first_at - r.sent_at for r in done if r.first_at is not None]
    rates = [rate for r in done if (rate := _rate(r)) is not None]
    return ttfts, rates
