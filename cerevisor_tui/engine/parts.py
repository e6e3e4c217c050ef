"""The composition root: a run's parts, each made once and handed the ports it uses (emit, the clock, the
roster, the run's life, admission, the load's refresh, ...), never the engine. `Engine` (engine/engine.py)
adds the waves, the run loop and the commands on top of them.

The ports, each a small object or a callable: `EventBus.emit` (engine/bus.py), the `Clock` (engine/clock.py),
the `Roster` of agents and the `RunLife` flags (engine/roster.py), the `Scheduler` and `Caps` for admission and
the cap (engine/scheduler.py, engine/caps.py), `LoadTeller.refresh` (engine/load_teller.py), the attempt owner
(engine/attempt.py), the budget's refusal (engine/spending.py)."""

from __future__ import annotations

import functools

from cerevisor_tui.config.graph import OUTPUT_REF, wave_levels
from cerevisor_tui.config.models import Config, GatewayConfig, ResolvedStall, resolve_stall
from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.engine import resume
from cerevisor_tui.engine.attempt import Attempts, Budget, TurnFigures
from cerevisor_tui.engine.auto_feed import AutoFeed, projected_context
from cerevisor_tui.engine.bus import EventBus
from cerevisor_tui.engine.caps import Caps
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.connections import Connections
from cerevisor_tui.engine.console_probe import ConsoleProbes
from cerevisor_tui.engine.conversation import Conversations
from cerevisor_tui.engine.endpoint_state import EndpointStates
from cerevisor_tui.engine.load_teller import LoadTeller
from cerevisor_tui.engine.monitor import ServerMonitor
from cerevisor_tui.engine.placement import Placement
from cerevisor_tui.engine.pools import Pools
from cerevisor_tui.engine.roster import Roster, RunLife
from cerevisor_tui.engine.scheduler import Scheduler
from cerevisor_tui.engine.sessions import Sessions
from cerevisor_tui.engine.sinks.report import Report
from cerevisor_tui.engine.spending import BudgetPolicy
from cerevisor_tui.engine.state import AgentState
from cerevisor_tui.engine.toolcalls import AskPolicy, ToolCalls
from cerevisor_tui.engine.watchdog import Watchdog
from cerevisor_tui.engine.wedge import WedgeWatch
from cerevisor_tui.kinds import FinalStatus
from cerevisor_tui.tools.manager import McpServers


class RunParts:
    """A run's parts over `config`, put together. `resumed`: what the run directory's journal says
    (engine/resume.py `read_journal`, one pass over it)."""

    def __init__(self, config: Config, *, run_id: str, run_dir: str, resumed: resume.JournalState | None,
                 stream_process: bool, ask: AskPolicy, clock: Clock) -> None:
        self.config = config
        self.clock = clock  # what the deadlines are measured on: the host's monotonic clock, or a test's
        self.run_id = run_id
        self.run_dir = run_dir
        self.waves = wave_levels(config.agents)
        self.endpoints = {ep.name: ep for ep in config.endpoints}
        self.policies: dict[str, ResolvedStall] = {ep.name: resolve_stall(config.stall, ep) for ep in config.endpoints}
        self.life = RunLife()
        # every form of the run's API keys, taken out of whatever text enters the run (config/secrets.py)
        # (and the variables the MCP servers are given: a server's own token must not reach the screen either)
        self.scrub = Scrubber.from_env([*(ep.api_key_env for ep in config.endpoints),
                                        *(name for server in config.mcp_servers for name in server.env),
                                        *(config.gateway.keys_env if config.gateway is not None else ())])
        self.bus = EventBus(self.scrub, clock)
        self.emit = emit = self.bus.emit
        self.subscribe = self.bus.subscribe
        self.report = Report(clock.now)
        self.subscribe(self.report)
        self.roster = roster = Roster(emit, clock)
        self.agents = roster.agents
        for wave, level in enumerate(self.waves):
            for agent in level:
                pool = config.agent_pool(agent)
                roster.add(AgentState(agent, config.agent_endpoint(agent).name, wave, pool=pool.name if pool else ""))
        # pools: each agent of one is placed on a member when admitted and stays there (engine/placement.py)
        self.placement = Placement(config.pools)
        self.scheduler = Scheduler(
            config.run.mode, config.run.max_concurrency, {ep.name: ep.max_concurrency for ep in config.endpoints},
            pools={p.name: list(p.endpoints) for p in config.pools}, place=lambda agent, pool: self.pools.place(agent, pool))
        self.connections = Connections(config, emit, stream_process=stream_process, clock=clock)
        # what each endpoint's turns measured (rejections, TTFTs, tokens per character and per answer): auto's figures
        self.figures: dict[str, TurnFigures] = {ep.name: TurnFigures() for ep in config.endpoints}
        # each endpoint's state (up, loading, down, wedged), one owner fed by the monitor, requests and the wedge rules
        self.endpoint_states = EndpointStates(emit, clock, self.connections.base_urls,
                                              (config.gateway or GatewayConfig()).down_after_s)
        self.monitor = ServerMonitor(config, self.connections, emit,
                                     functools.partial(projected_context, roster, self.figures, self.life),
                                     states=self.endpoint_states, clock=clock)
        self.load_teller = LoadTeller(self.endpoints, self.scheduler, self.monitor, emit, clock)
        self.refresh_load = self.load_teller.refresh
        self.caps = Caps(config, self.scheduler, emit, self.refresh_load, clock)
        self.pools = Pools(self.placement, self.scheduler, roster, self.endpoints, self.monitor.last_sample,
                           self.refresh_load, emit, clock)
        self.auto_feed = AutoFeed(self.caps, roster, self.life, self.figures, self.monitor, self.endpoints,
                                  config.run.metrics_interval_s / 2, clock)
        self.probes = ConsoleProbes(self.connections, self.endpoints, roster, self.life, self.caps, emit, clock)
        self.watchdog = Watchdog(self.policies, emit, clock)
        # the one owner of a running attempt, a workflow agent's or a gateway session's (engine/attempt.py); a
        # resumed run's spending counts on from the journal's
        resumed = resumed or resume.JournalState(run_id)
        self.budget = Budget(config.run.budget_usd, resumed.spent_usd)
        self.spending = BudgetPolicy(self.budget, run_id, self.caps, self.life, emit, self.stop, clock)
        roster.after_finish = self.spending.end_if_spent
        self.attempts = Attempts(endpoints=self.endpoints, policies=self.policies, figures=self.figures, emit=emit,
                                 subscribers=self.bus.subscribers, subscriber_failed=self.bus.failed, scrub=self.scrub,
                                 budget=self.budget, context_limit=self.connections.context_limit, clock=clock)
        self.attempts.on_timings = self.monitor.add_timings  # llama.cpp's timings: its latency panel
        self.attempts.on_refused = self.endpoint_states.refused
        # MCP tool servers, those an agent lists: started when the run opens, ended with it (tools/manager.py).
        # `ask`: what a tool call its server's rules `ask` about gets: the operator's answer, or headless, deny
        # or approve. A resumed run takes its earlier calls' results and "for the run" approvals from the journal.
        used = {tool.split(".", 1)[0] for agent in config.agents for tool in agent.tools}
        self.tool_servers = McpServers(config.mcp_servers, used, log_dir=run_dir, scrub=self.scrub)
        self.tools = ToolCalls(self.tool_servers, emit=emit, scrub=self.scrub, ask=ask, memory=resumed.tools,
                               clock=clock)
        self.conversations = Conversations(
            run_id=run_id, endpoints=self.endpoints, policies=self.policies, connections=self.connections,
            watchdog=self.watchdog, figures=self.figures, attempts=self.attempts, emit=emit, scrub=self.scrub,
            render=self.render, stopping=lambda: self.life.stopping, relocate=self.pools.relocate, tools=self.tools,
            escape=self.pools.failed, clock=clock)
        self.conversations.request_prefix = resume.request_prefix(run_id, run_dir)
        # external sessions, the gateway's (engine/sessions.py): a run that serves a gateway goes on after its
        # waves, until it is stopped
        self.sessions = Sessions(config, roster, self.life, self.pools, self.attempts, self.watchdog, self.policies,
                                 self.spending.refusal, self.conversations.request_prefix, emit, clock)
        if config.gateway is not None:
            self.sessions.release_after_s = config.gateway.release_after_s
            self.sessions.forget_after_s = config.gateway.forget_after_s
            self.sessions.max_per_key = config.gateway.max_sessions_per_key
        self.wedges = WedgeWatch(config.stall, self.policies, self.monitor, roster, self.figures, self.placement,
                                 self.pools.tell_down, self.caps, self.endpoint_states, emit, clock)  # wedged servers, after each sample
        self.wedges.open_attempts = self.sessions.open_attempts
        self.pools.keeps_down = self.wedges.keeps_down
        # Agents a resumed run already completed: their answers are reused, they are never sent again, unless
        # what they would run with now (prompt, endpoint, ...) is not what they ran with: then they and every
        # agent downstream of them run again, each with its reason (an AgentRerun at the start of the run).
        self.completed_before = dict(resumed.completed)
        self.recorded_inputs = resumed.inputs
        self.rerun = resume.plan_resume(config, self.waves, self.completed_before, self.recorded_inputs)
        for name in self.rerun:
            del self.completed_before[name]
        # the reused agents' recorded events: their figures carry into the report
        self.history = [e for e in resumed.history if getattr(e, "agent", None) not in self.rerun]
        # an agent that had not completed goes on after the turns it had answered (a completed one's are not kept)
        self.conversations.recorded_turns = resumed.turns
        self.sessions.before = resumed.sessions  # a gateway's sessions go on from what they had done
        self.conversations.replay = self.report.replay

    def render(self, text: str) -> str:
        """Insert dependencies' final answers for {{ name.output }}."""
        return OUTPUT_REF.sub(lambda m: self.agents[m.group(1)].output, text)

    def stop(self, reason: str = "run stopped", status: FinalStatus = "cancelled") -> None:
        raise NotImplementedError  # the engine's: the run's stop
