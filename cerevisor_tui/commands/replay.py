"""`cerevisor-tui replay`: write a file of agentic sessions, generated from a preset or imported from a
published trace, and say what it holds in the studies' own figures; or replay one against a server."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from cerevisor_tui.replay.trace import TraceError, TraceTurn, write_trace

if TYPE_CHECKING:
    from cerevisor_tui.contract.events import Event
    from cerevisor_tui.engine.clock import Clock
    from cerevisor_tui.kinds import Mode
    from cerevisor_tui.replay.agents import ReplaySessions
    from cerevisor_tui.replay.run import ReplayReport, ReplaySettings, TurnResult
    from cerevisor_tui.replay.stats import TraceStats

PROG = "cerevisor-tui replay"


def main(args: argparse.Namespace) -> int:
    if args.replay_command == "run":
        return _replay(args)
    from cerevisor_tui.replay.stats import trace_stats

    try:
        turns = _turns(args)
        write_trace(turns, args.output)
    except (TraceError, ValueError) as exc:
        print(f"{PROG} {args.replay_command}: error: {exc}", file=sys.stderr)
        return 2
    stats = trace_stats(turns)
    if args.replay_command == "generate" and not args.json:
        from cerevisor_tui.replay.generate import PRESETS

        print(f"preset {args.preset}: {PRESETS[args.preset].source}")
    if args.json:
        json.dump({"file": args.output, **stats.to_dict()}, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_stats(stats, args.output, sys.stdout)
    return 0


def _turns(args: argparse.Namespace) -> list[TraceTurn]:
    if args.replay_command == "generate":
        from cerevisor_tui.replay.generate import generate

        return generate(args.preset, args.sessions, args.seed)
    from cerevisor_tui.replay.importers import import_trace

    return import_trace(args.file, args.format)


def _print_stats(stats: TraceStats, path: str, out: TextIO) -> None:
    subagents = f", {stats.subagent_sessions:,} subagent sessions" if stats.subagent_sessions else ""
    out.write(f"wrote {stats.turns:,} turns of {stats.sessions:,} sessions{subagents} to {path}\n")
    out.write(f"{'':22}{'median':>10}{'mean':>10}\n")
    rows = (
        ("turns a session", stats.turns_per_session, lambda v: f"{v:.1f}".removesuffix(".0")),
        ("first context", stats.first_context_tokens, _tokens),
        ("new tokens a turn", stats.new_tokens, _tokens),
        ("output a turn", stats.output_tokens, _tokens),
        ("gap before a turn", stats.gap_s, lambda v: f"{v:.1f} s"),
        ("prompt a turn", stats.prompt_tokens, _tokens),
    )
    for label, spread, shown in rows:
        out.write(f"{label:22}{shown(spread.median):>10}{shown(spread.mean):>10}\n")
    out.write(f"prefix share {stats.prefix_share:.1%} (mean over turns after the first); "
              f"{stats.subagent_spawn_share:.0%} of sessions spawn subagents\n")


def _tokens(value: float) -> str:
    return f"{value / 1000:.1f}K" if value >= 10_000 else f"{value:,.0f}"


def _replay(args: argparse.Namespace) -> int:
    """`replay run`: the file closed loop against --endpoint, or a built-in simulator; exit 1 when turns failed."""
    import asyncio
    import dataclasses
    import os

    from cerevisor_tui.config import ConfigError
    from cerevisor_tui.endpoints.errors import EndpointError
    from cerevisor_tui.engine.sinks.journal import JournalError
    from cerevisor_tui.replay.run import ReplaySettings, Slo, replay
    from cerevisor_tui.replay.trace import read_trace
    from cerevisor_tui.sim import ProfileError

    where = f"{PROG} run"
    as_run = args.as_agents or args.through_gateway
    if args.mode is not None and not as_run:
        print(f"{where}: error: --mode is the run's: add --as-agents (the sessions as the run's own agents) or "
              "--through-gateway", file=sys.stderr)
        return 2
    if args.run_dir is not None and not (args.as_agents or args.through_gateway):
        print(f"{where}: error: --run-dir is the run's directory with --as-agents or --through-gateway",
              file=sys.stderr)
        return 2
    if args.release_after_s is not None and not args.through_gateway:
        print(f"{where}: error: --release-after-s is the gateway's: add --through-gateway", file=sys.stderr)
        return 2
    if args.release_after_s is not None and not 0 <= args.release_after_s <= 86400:
        print(f"{where}: error: --release-after-s must be between 0 and 86400", file=sys.stderr)
        return 2
    mode: Mode = args.mode or "parallel"
    if args.concurrency < 1 or args.speed <= 0:
        print(f"{where}: error: --concurrency must be at least 1 and --speed above 0", file=sys.stderr)
        return 2
    if not (args.slo_interactivity >= 0 and args.slo_ttft_s > 0):  # (not NaN either)
        print(f"{where}: error: --slo-interactivity must be at least 0 and --slo-ttft-s above 0", file=sys.stderr)
        return 2
    try:
        turns = read_trace(args.file)
    except TraceError as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 2
    if args.report and not os.access(os.path.dirname(os.path.abspath(args.report)), os.W_OK):
        print(f"{where}: error: --report: cannot write {args.report} (its directory is not writable)", file=sys.stderr)
        return 2
    headers = {}
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            print(f"{where}: error: --api-key-env: ${args.api_key_env} is not set", file=sys.stderr)
            return 2
        headers["Authorization"] = f"Bearer {key}"
    simulated = args.endpoint is None
    settings = ReplaySettings(concurrency=args.concurrency, speed=args.speed, model=args.model or "",
                              slo=Slo(args.slo_interactivity, args.slo_ttft_s), extra_headers=headers)

    def said(engine: Any) -> None:
        print(f"the run: {engine.run_dir} (`cerevisor-tui attach {engine.run_dir}` follows it)", file=sys.stderr)

    async def to(base_url: str, settings: ReplaySettings = settings) -> ReplayReport:
        run_dir = Path(args.run_dir) if args.run_dir else None
        if args.through_gateway:
            return await through_gateway(turns, base_url, settings, mode, args.concurrency, run_dir=run_dir,
                                         journal=True, api_key_env=args.api_key_env or "", on_run=said,
                                         release_after_s=args.release_after_s)
        if args.as_agents:
            return await as_agents(turns, base_url, settings, mode, args.concurrency, run_dir=run_dir,
                                   api_key_env=args.api_key_env or "", on_run=said)
        return await replay(turns, base_url, settings)

    async def against_sim() -> ReplayReport:
        from cerevisor_tui.config.models import SimSettings
        from cerevisor_tui.sim import SimServer

        async with SimServer(SimSettings(profile=args.sim or "", speed=args.speed)) as sim:
            # timed on the simulator's own clock: on a host that cannot keep pace with --speed, the wall times
            # --speed would overstate every time
            return await to(sim.base_url, dataclasses.replace(settings, clock=sim.state.engine.clock_s,
                                                              clock_sped_up=True))

    try:
        report = asyncio.run(against_sim() if simulated else to(args.endpoint))
    except EndpointError as exc:
        print(f"{where}: error: {exc.problem}", file=sys.stderr)
        return 2
    except ProfileError as exc:
        print(f"{where}: error: --sim: {exc}", file=sys.stderr)
        return 2
    except (ConfigError, JournalError) as exc:  # the run's directory, or a session's name past what a run takes
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 2
    if args.report:
        try:
            with open(args.report, "w", encoding="utf-8") as out:
                json.dump({**report.to_dict(per_session=True), "simulated": simulated}, out, indent=1)
        except OSError as exc:
            print(f"{where}: error: --report: cannot write {args.report} ({exc.strerror or exc})", file=sys.stderr)
            return 2
    if args.json:
        json.dump({**report.to_dict(), "simulated": simulated}, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_report(report, simulated, sys.stdout)
    return 1 if report.turns_failed else 0


async def through_gateway(turns: list[TraceTurn], upstream: str, settings: ReplaySettings, mode: Mode,
                          cap: int, *, run_dir: Path | None = None, journal: bool = False, api_key_env: str = "",
                          sections: Mapping[str, Mapping[str, Any]] = {}, endpoint: Mapping[str, Any] = {},
                          on_run: Callable[[Any], None] | None = None, clock: Clock | None = None,
                          release_after_s: float | None = None) -> ReplayReport:
    """The replay's sessions through a gateway of a run of their own in front of `upstream`, as harness traffic
    arrives: every session is sent when its trace says (the run, not the client, admits them), each a row under the
    run's `mode` and `cap`; the report adds the run's cap changes and kills. `sections` adds to the run's config
    tables ("run", "stall", ...) and `endpoint` to its endpoint's, e.g. deadlines scaled to a sped-up simulator.
    With `journal` (or a `run_dir`) the run is told in its journal in `run_dir` (default: a new one under the runs
    directory) and served on its control socket, so `cerevisor-tui attach` follows it like any run; `on_run(engine)`
    is told the run once it is put together. `clock`: the run's (default the host's), e.g. a benchmark's PacedClock on
    a sped-up simulator's, whose host may lag it."""
    import dataclasses

    import anyio

    from cerevisor_tui.commands.run import serve_control
    from cerevisor_tui.config import validate
    from cerevisor_tui.config.models import GatewayConfig
    from cerevisor_tui.config.paths import default_runs_dir
    from cerevisor_tui.contract import events as ev
    from cerevisor_tui.engine.clock import MONOTONIC
    from cerevisor_tui.engine.engine import Engine, new_run_id
    from cerevisor_tui.engine.run_setup import open_run
    from cerevisor_tui.gateway import serve_gateway
    from cerevisor_tui.replay.run import replay

    config = validate(_run_config(upstream, settings, mode, cap, api_key_env, sections, endpoint, {
        # a session gives its slot back after the gateway's quiet spell, as a harness's does (the gateway cannot
        # know one is done): [gateway] release_after_s (default the gateway's), in the trace's seconds, at the
        # replay's speed. (Twice the trace's longest gap, as this once was, kept each finished session's slot from
        # the sessions queued for one for 290 simulated seconds on the seed's agentx file.)
        "gateway": {"listen": "127.0.0.1:0", "release_after_s": (
            GatewayConfig.model_fields["release_after_s"].default if release_after_s is None else release_after_s)
            / settings.speed},
    }))
    assert config.gateway is not None
    written = None
    if journal or run_dir is not None:
        run_id = new_run_id()
        engine, written = open_run(config, run_id, run_dir or default_runs_dir() / run_id, console=False,
                                   clock=clock or MONOTONIC)
    else:
        engine = Engine(config, clock=clock or MONOTONIC)
    events: list[ev.Event] = []
    engine.subscribe(lambda e: events.append(e) if isinstance(e, ev.ConcurrencyChanged | ev.AgentKilled) else None)
    sessions = len({t.session_id for t in turns if t.parent is None})
    # the client sends every session when its trace says: admission is the run's
    through = dataclasses.replace(settings, concurrency=max(1, sessions), metrics_url=upstream, extra_headers={})
    control = None
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(engine.run)
            server = await serve_gateway(engine, config.gateway)
            if written is not None:
                control = await serve_control(engine, Path(engine.run_dir), engine.run_id, "", required=False)
            if on_run is not None and written is not None:
                on_run(engine)
            try:
                report = await replay(turns, server.url, through)
            finally:
                engine.stop("the replay ended")
                await server.close()
    finally:
        with anyio.CancelScope(shield=True):
            if control is not None:
                await control.close("the replay ended")
        if written is not None:
            written.write_report()
            written.close()
    report.concurrency = cap
    _caps_and_kills(report, events, engine.started_at)
    return report


def _run_config(upstream: str, settings: ReplaySettings, mode: Mode, cap: int, api_key_env: str,
                sections: Mapping[str, Mapping[str, Any]], endpoint: Mapping[str, Any],
                more: Mapping[str, Any]) -> dict[str, Any]:
    """A replay's run, as config data: its mode and cap, one endpoint (`upstream`), and `more` tables."""
    # in auto mode the cap is Auto's ceiling, as `run --mode auto --concurrency N` makes it, and Auto keeps each
    # user at the SLO's interactivity: its floor. The floor is in the run's seconds, which a sped-up simulator's
    # durations (its inter-token histogram, which Auto reads) are given in: `speed` times the SLO's tokens/s there;
    # a real server's are its own
    pace = settings.speed if settings.clock_sped_up else 1.0
    auto: dict[str, Any] = {"max_cap": cap, "min_interactivity_tokens_s": settings.slo.min_interactivity_tokens_s * pace}
    return {
        **sections,
        "run": {"mode": mode, "max_concurrency": cap, "warmup": "off", **({"auto": auto} if mode == "auto" else {}),
                **sections.get("run", {})},
        "endpoints": [{"name": "upstream", "kind": "local", "base_url": upstream,
                       **({"model": settings.model} if settings.model else {}),
                       **({"api_key_env": api_key_env} if api_key_env else {}), **endpoint}],
        **more,
    }


def _caps_and_kills(report: ReplayReport, events: list[Event], started: float) -> None:
    """The run's cap changes and kills, into the report."""
    from cerevisor_tui.contract import events as ev

    report.caps = [{"t_s": round(e.t - started, 3), "cap": e.total_cap or e.effective_cap, "endpoint": e.endpoint,
                    "reason": e.reason} for e in events if isinstance(e, ev.ConcurrencyChanged)]
    report.kills = [{"session": e.agent, "deadline": e.deadline, "reason": e.reason}
                    for e in events if isinstance(e, ev.AgentKilled)]


async def as_agents(turns: list[TraceTurn], upstream: str, settings: ReplaySettings, mode: Mode, cap: int, *,
                    run_dir: Path | None = None, api_key_env: str = "", sections: Mapping[str, Mapping[str, Any]] = {},
                    endpoint: Mapping[str, Any] = {}, on_run: Callable[[Any], None] | None = None) -> ReplayReport:
    """The replay's sessions as the run's own agents against `upstream`: each session an agent of a run of their own
    (its turns its script's, replay/agents.py), admitted under the run's `mode` and `cap`, its attempts under the
    watchdog and retried as any agent's, told in the run's journal in `run_dir` (default: a new one under the runs
    directory) and served on its control socket, so `cerevisor-tui attach` follows it like any run; the report adds
    the run's cap changes and kills. `sections` and `endpoint` add to the run's config as in `through_gateway`;
    `on_run(engine)` is told the run once it is put together."""
    import dataclasses

    import anyio

    from cerevisor_tui.commands.run import serve_control
    from cerevisor_tui.config import validate
    from cerevisor_tui.config.paths import default_runs_dir
    from cerevisor_tui.engine.engine import new_run_id
    from cerevisor_tui.engine.run_setup import open_run
    from cerevisor_tui.replay.agents import ReplaySessions
    from cerevisor_tui.replay.run import Plan, replay

    events: list[Event] = []
    started: list[float] = []

    async def send(plan: Plan, model: str) -> tuple[list[TurnResult], float]:
        sessions = ReplaySessions(plan, settings.speed)
        config = validate(_run_config(upstream, dataclasses.replace(settings, model=model), mode, cap, api_key_env,
                                      sections, endpoint, {"agents": sessions.agent_configs()}))
        run_id = new_run_id()
        engine, journal = open_run(config, run_id, run_dir or default_runs_dir() / run_id, console=False)
        for name, script in sessions.scripts.items():
            engine.agents[name].script = script
        log = _TurnLog(sessions, settings.clock, events)
        engine.subscribe(log)
        server = await serve_control(engine, Path(engine.run_dir), run_id, "", required=False)
        if on_run is not None:
            on_run(engine)
        clock_started = settings.clock()
        try:
            await engine.run()
        finally:
            with anyio.CancelScope(shield=True):
                if server is not None:
                    await server.close("the replay ended")
            journal.write_report()
            journal.close()
        started.append(engine.started_at)
        return log.results, settings.clock() - clock_started

    report = await replay(turns, upstream, settings, send=send)
    report.concurrency = cap
    _caps_and_kills(report, events, started[0] if started else 0.0)
    return report


class _TurnLog:
    """The run's events as the replay's turn log: a turn is sent at its first attempt, answered at its TurnFinished
    (timed on the replay's clock), failed when its agent ends before that; and each answer or end told to the
    sessions, which start the subagents it spawns (or skip those it never will)."""

    def __init__(self, sessions: ReplaySessions, clock: Callable[[], float], events: list[Event]) -> None:
        self.sessions = sessions
        self.clock = clock
        self.events = events  # the run's cap changes and kills
        self.results: list[TurnResult] = []
        self._open: dict[str, TurnResult] = {}  # agent -> its turn under way

    def __call__(self, event: Event) -> None:
        from cerevisor_tui.contract import events as ev
        from cerevisor_tui.replay.run import TurnResult

        match event:
            case ev.AgentStarted(agent=agent, turn=turn) if agent in self.sessions.sessions:
                result = self._open.get(agent)
                if result is None or result.turn != turn:
                    self._open[agent] = TurnResult(self.sessions.sessions[agent], turn, sent_at=self.clock())
                else:  # a retry: its first token is the new attempt's
                    result.first_at = None
            case ev.FirstToken(agent=agent) if agent in self._open:
                result = self._open[agent]
                if result.first_at is None:
                    result.first_at = self.clock()
            case ev.TurnFinished(agent=agent, turn=turn) if agent in self._open:
                result = self._open.pop(agent)
                result.ended_at = self.clock()
                result.prompt_tokens, result.output_tokens = event.prompt_tokens, event.completion_tokens
                self.results.append(result)
                self.sessions.turn_done(agent, turn)
            case ev.AgentFinished(agent=agent, status=status) if agent in self.sessions.sessions:
                result = self._open.pop(agent, None)
                if result is not None:
                    result.error = event.error or status
                    result.ended_at = self.clock()
                    self.results.append(result)
                self.sessions.ended(agent, status)
            case ev.ConcurrencyChanged() | ev.AgentKilled():
                self.events.append(event)


def _print_report(report: ReplayReport, simulated: bool, out: TextIO) -> None:
    kind = "SIMULATED " if simulated else ""
    clock = " (the simulator's clock)" if simulated and report.speed != 1 else ""
    out.write(f"replayed {report.turns_completed:,} of {report.turns:,} turns ({report.sessions_completed:,} of "
              f"{report.sessions:,} sessions complete) against {kind}{report.model} at {report.base_url}, "
              f"{report.concurrency} at a time: {report.makespan_s:.1f} s{clock}\n")
    ttft, rate = report.ttft, report.interactivity

    def shown(value: float | None, unit: str) -> str:
        return "-" if value is None else f"{value:.2f}{unit}"

    out.write(f"TTFT p50 {shown(ttft['p50_s'], ' s')}, p90 {shown(ttft['p90_s'], ' s')}; interactivity p50 "
              f"{shown(rate['p50_tokens_per_s'], '')}, p90 {shown(rate['p90_tokens_per_s'], '')} tokens/s per user\n")
    good = report.goodput
    share = "-" if good["share"] is None else f"{good['share']:.0%}"
    per_min = "-" if good["turns_per_min"] is None else f"{good['turns_per_min']:.1f}"
    out.write(f"goodput {good['turns']:,} turns ({share}, {per_min} a minute) met the SLO: interactivity at least "
              f"{good['min_interactivity_tokens_s']:g} tokens/s and TTFT at most {good['max_ttft_s']:g} s past "
              "a session's first turn\n")
    hits = "-" if report.prefix_hit_rate is None else f"{report.prefix_hit_rate:.1%}"
    if report.cpu_hit_rate is not None:
        hits += f" in GPU memory, {report.cpu_hit_rate:.1%} more from the CPU tier"
    out.write(f"prefix-cache hits {hits} (the server's own counters over the replay); "
              f"{report.prompt_tokens:,} prompt and {report.output_tokens:,} output tokens\n")
    if report.caps:
        caps = " -> ".join(str(change["cap"]) for change in report.caps[-8:])
        out.write(f"the run's cap: {'... -> ' if len(report.caps) > 8 else ''}{caps}\n")
    for kill in report.kills:
        out.write(f"killed: {kill['session']} ({kill['deadline']}): {kill['reason']}\n")
    if report.first_error:
        out.write(f"{report.turns_failed:,} turns failed; the first: {report.first_error}\n")
