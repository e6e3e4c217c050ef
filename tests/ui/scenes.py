"""Fixed console states for snapshot tests: the engine's events at fixed monotonic times, emitted through
`engine.emit` (the path the real engine uses) into the console's mirror, and a frozen app clock. The
engine's own state is kept alongside by the engine's rules, where its figures go into an event (the load).

Nothing here reads a clock or a random source: the assistant text comes from the simulator's seeded
word generator, so every picture is the same on every run.
"""

from __future__ import annotations

import tomllib

import msgspec

from cerevisor_tui.commands.console import demo_text, run_handle
from cerevisor_tui.config import validate
from cerevisor_tui.config.models import Config
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine import load
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.state import Attempt
from cerevisor_tui.engine.status import move
from cerevisor_tui.sim.text import words
from cerevisor_tui.ui.app import CerevisorApp
from cerevisor_tui.ui.theme_files import load_themes
from tests.ui.conftest import set_status

T0 = 1000.0
NOW = 1012.0
RUN_ID = "20260101-120000-demo"


KV_TOKENS = 65_536
"""The simulated server's KV capacity in the scenes: 8 conversations of 8,192 tokens fit."""


def scene_config(*, mode: str = "", **stall) -> Config:
    data = tomllib.loads(demo_text())
    data["stall"].update({"idle_timeout_s": 10.0, **stall})
    if mode:
        data["run"]["mode"] = mode
    data["endpoints"][0]["capacity"]["context_tokens"] = 8192
    for agent in data["agents"]:
        if agent["name"] == "skeptic":
            agent["retries"] = 0
    return validate(data, file="scene")


class Driver:
    """Plays the engine's part for one scene, following the engine's own state rules."""

    def __init__(self, engine: Engine, app: CerevisorApp) -> None:
        self.engine = engine
        self.app = app
        self.words = words(7)
        self._sampled_to = T0

    def emit(self, event: ev.Event) -> None:
        self.engine.emit(event)

    def advance(self, t: float) -> None:
        """Take the sparkline samples the redraw timer would have taken up to `t`."""
        while self._sampled_to + 0.5 <= t:
            self._sampled_to += 0.5
            self.app.model.sample(self._sampled_to)

    def run_started(self) -> None:
        e = self.engine
        e.started_at = T0
        e.life.wave = 0
        # without the mode's note: its notification would cover the load pane in the pictures
        self.emit(msgspec.structs.replace(e.started_event(T0), note=""))
        self.emit(msgspec.structs.replace(e.load_teller.event("sim"), t=T0))
        self.emit(ev.WaveStarted(T0, 0, [a.name for a in e.waves[0]]))
        for a in e.waves[0]:
            move(e.agents[a.name], "queued")
            self.emit(ev.AgentQueued(T0, a.name, 0))

    def server(self, t: float, **values) -> None:
        e = self.engine
        e.monitor.last_sample["sim"] = sample = ev.ServerSample(t, "sim", True, "vllm", **values)
        self.emit(sample)
        kv_tokens = values.get("kv_cache_tokens")
        if kv_tokens:  # as the engine does: the server's own capacity replaces the estimate
            e.monitor.load["sim"] = load.from_server(kv_tokens, e.endpoints["sim"].capacity.context_tokens, e.monitor.load["sim"])
        self.emit(msgspec.structs.replace(e.load_teller.event("sim"), t=t))  # the engine's judgement of the load, as it sends it

    def auto_change(self, t: float, cap: int, reason: str) -> None:
        """What the engine does when sim's auto controller moves its cap: the scheduler's live cap, then the event."""
        e = self.engine
        e.scheduler.set_endpoint_cap("sim", cap)
        self.emit(ev.ConcurrencyChanged(t, e.scheduler.max_concurrency, cap, e.scheduler.paused, endpoint="sim",
                                        reason=reason, ceiling=e.caps.ceiling, total_cap=e.scheduler.effective_cap,
                                        by="auto"))

    def start(self, name: str, t: float, turn: int = 1) -> Attempt:
        st = self.engine.agents[name]
        policy = self.engine.policies[st.endpoint]
        st.turn = turn
        st.attempts += 1
        prompt = ([st.config.prompt, *st.config.turns])[turn - 1]
        self.emit(ev.MessageRecorded(t, name, st.attempts, turn, "user", prompt))
        att = Attempt(st.attempts, turn, sent_at=t, last_alive=t, base=t,
                      deadline_at=t + policy.first_byte_timeout_s)
        st.current = att
        set_status(st, "prefill")
        if st.started_at is None:
            st.started_at = t
        self.emit(ev.AgentStarted(t, name, att.number, turn, st.turns, st.endpoint, policy.first_byte_timeout_s,
                                  policy.idle_timeout_s))
        return att

    def tokens(self, name: str, n: int, t_start: float, t_end: float, *, reasoning: int = 0) -> None:
        """`reasoning` of the `n` tokens come first, as thinking text."""
        st = self.engine.agents[name]
        att = st.current
        assert att is not None
        idle = self.engine.policies[st.endpoint].idle_timeout_s
        step = (t_end - t_start) / max(1, n - 1)
        for i in range(n):
            t = t_start + i * step
            self.advance(t)
            if att.first_token_at is None:
                att.first_token_at = t
                if st.ttft_s is None:
                    st.ttft_s = t - att.sent_at
                move(st, "token")
                self.emit(ev.FirstToken(t, name, att.number, att.turn, t - att.sent_at))
            word = next(self.words) + " "
            att.tokens += 1
            st.tokens += 1
            att.last_alive = att.base = t
            att.phase, att.deadline_at = "idle", t + idle
            if i < reasoning:
                self.emit(ev.TokenDelta(t, name, att.number, "", word))
            else:
                self.emit(ev.TokenDelta(t, name, att.number, word))

    def finish_turn(self, name: str, t: float, *, last: bool) -> None:
        st = self.engine.agents[name]
        att = st.current
        assert att is not None and att.first_token_at is not None
        st.completion_tokens += att.tokens
        st.decode_s += t - att.first_token_at
        self.emit(ev.MessageRecorded(t, name, att.number, att.turn, "assistant", "..."))
        self.emit(ev.TurnFinished(t, name, att.number, att.turn, st.turns, 40, att.tokens, "stop",
                                  att.first_token_at - att.sent_at, t - att.sent_at))
        st.current = None
        if last:
            set_status(st, "completed")
            st.finished_at = t
            self.emit(ev.AgentFinished(t, name, "completed"))

    def stall_warnings(self, name: str, now: float) -> None:
        """The warnings the watchdog has raised by `now` for the attempt's current deadline."""
        st = self.engine.agents[name]
        att = st.current
        assert att is not None
        window = att.deadline_at - att.base
        for fraction in self.engine.policies[st.endpoint].warn_at:
            at = att.base + fraction * window
            if at <= now:
                att.warned += 1
                st.stall_warnings += 1
                move(st, "warned")
                self.emit(ev.StallWarning(at, name, att.number, att.phase, fraction, att.deadline_at - at,
                                          att.deadline_at))

    def killed(self, name: str, t: float, reason: str) -> None:
        st = self.engine.agents[name]
        att = st.current
        assert att is not None
        self.emit(ev.AgentKilled(t, name, att.number, att.phase, reason, att.tokens))
        st.current = None
        set_status(st, "killed")
        st.error, st.finished_at = reason, t
        self.emit(ev.AgentFinished(t, name, "killed", reason))


def build(scene: str) -> CerevisorApp:
    """`mid_run`, `amber_stall`, `killed` or `auto`: the demo workflow twelve seconds in."""
    if scene == "auto":
        return build_auto()
    config = scene_config()
    engine = Engine(config, run_id=RUN_ID, run_dir=f"/runs/{RUN_ID}")
    engine.connections.models["sim"] = "sim-model"
    handle = run_handle(engine)
    app = CerevisorApp(handle.control, handle.mirror, config, clock=lambda: NOW,
                       themes=load_themes(None))
    d = Driver(engine, app)
    d.run_started()

    d.start("planner", T0)
    d.tokens("planner", 48, T0 + 0.8, T0 + 2.6)
    d.finish_turn("planner", T0 + 2.6, last=True)

    d.start("researcher", T0)
    d.tokens("researcher", 48, T0 + 0.7, T0 + 5.0, reasoning=12)
    d.finish_turn("researcher", T0 + 5.0, last=False)
    d.start("researcher", T0 + 5.0, turn=2)
    d.tokens("researcher", 60, T0 + 5.4, NOW - 0.1)

    d.start("skeptic", T0)
    if scene == "mid_run":
        d.tokens("skeptic", 70, T0 + 0.9, NOW - 0.2)
    else:
        if scene == "amber_stall":
            d.tokens("skeptic", 12, T0 + 0.9, T0 + 3.5)
            d.stall_warnings("skeptic", NOW)  # 8.5 s of its 10 s idle window used: past 0.8, amber
        else:
            d.tokens("skeptic", 12, T0 + 0.9, T0 + 2.0)
            d.stall_warnings("skeptic", T0 + 12.0)
            d.killed("skeptic", T0 + 12.0, "no output for 10.0 s after 12 tokens")
    # after the tokens it follows, so its trend point counts them (the engine's events come in time order)
    d.server(T0 + 10, running=2.0, waiting=0.0, kv_cache_usage=0.31, prefix_hit_rate=0.56, kv_cache_tokens=KV_TOKENS)
    d.advance(NOW)
    return app


AUTO_CHANGES = (
    (T0 + 0.0, 1, "auto: start at 1 (slow start: doubles while throughput grows and nothing queues)"),
    (T0 + 2.1, 2, "auto: 1 -> 2 (slow start: 27 tok/s at 1, nothing waiting, KV 4%)"),
    (T0 + 4.1, 4, "auto: 2 -> 4 (slow start: throughput +85% at 2, nothing waiting, KV 12%; "
                  "6 conversations of 8,192 tokens fit)"),
    (T0 + 8.1, 3, "auto: 4 -> 3 (2 requests waiting in the server's queue, KV 97%)"),
)
"""sim's auto controller in the `auto` scene: slow start, then a back-off when requests wait."""
AUTO_SAMPLES = (  # t, running, waiting, KV use
    (T0 + 2, 1.0, 0.0, 0.04), (T0 + 4, 2.0, 0.0, 0.12), (T0 + 6, 4.0, 0.0, 0.55), (T0 + 8, 4.0, 2.0, 0.97),
    (T0 + 10, 3.0, 1.0, 0.88),
)
AUTO_AGENTS = (("planner", T0, 120), ("researcher", T0 + 2.2, 90), ("skeptic", T0 + 4.2, 70))
"""Who starts when (as the cap lets them), and the tokens each streams by NOW."""


def build_auto() -> CerevisorApp:
    """Auto mode twelve seconds in, the events in time order: the cap doubled while throughput grew, then
    stepped back when requests waited in the server's queue."""
    config = scene_config(mode="auto")
    engine = Engine(config, run_id=RUN_ID, run_dir=f"/runs/{RUN_ID}")
    engine.connections.models["sim"] = "sim-model"
    handle = run_handle(engine)
    app = CerevisorApp(handle.control, handle.mirror, config, clock=lambda: NOW,
                       themes=load_themes(None))
    d = Driver(engine, app)
    d.run_started()
    timeline: list[tuple[float, int, object]] = []  # (t, order at the same t, action)
    for t, cap, reason in AUTO_CHANGES:
        timeline.append((t, 0, lambda t=t, cap=cap, reason=reason: d.auto_change(t, cap, reason)))
    for t, running, waiting, kv in AUTO_SAMPLES:
        timeline.append((t, 2, lambda t=t, r=running, w=waiting, kv=kv: d.server(
            t, running=r, waiting=w, kv_cache_usage=kv, prefix_hit_rate=0.61, kv_cache_tokens=KV_TOKENS)))
    for name, start, tokens in AUTO_AGENTS:
        timeline.append((start, 1, lambda name=name, start=start: d.start(name, start)))
        first = start + 0.4
        step = (NOW - 0.1 - first) / max(1, tokens - 1)
        for i in range(tokens):
            t = first + i * step
            timeline.append((t, 1, lambda name=name, t=t: d.tokens(name, 1, t, t)))
    for _, _, action in sorted(timeline, key=lambda item: item[:2]):
        action()  # type: ignore[operator]
    d.advance(NOW)
    return app


def select(agent: str):
    """A snapshot `run_before` that moves the agents cursor to `agent`."""

    async def run_before(pilot) -> None:
        await pilot.pause()
        table = pilot.app.screen.table
        names = list(pilot.app.mirror.agents)
        table.move_cursor(names.index(agent))
        await pilot.pause()

    return run_before



GATEWAY_URL = "http://127.0.0.1:8100/v1"
GATEWAY_NOTICE = (f"Gateway serving on {GATEWAY_URL} (models: sim-model; mapped: claude-* -> sim-model). Point a "
                  "harness's base URL at it; a path label names its session: http://127.0.0.1:8100/a/NAME/v1")
"""The gateway's RunNotice, as `commands/run.py` words it."""


def gateway_config() -> Config:
    return validate({"stall": {"idle_timeout_s": 10.0},
                     "endpoints": [{"name": "sim", "kind": "simulated", "model": "sim-model"}],
                     "gateway": {"listen": "127.0.0.1:8100", "model_map": {"claude-*": "sim-model"}}},
                    file="gateway scene")


class GatewayDriver(Driver):
    """Plays the engine's and the gateway's part for a gateway's sessions (engine/sessions.py's events)."""

    def open(self, name: str, t: float, harness: str, *, source: str = "X-Session-ID", api: str = "chat",
             **shown: str) -> None:
        """The engine opens the session (its record, so commands find it) and tells it: SessionOpened carries the
        engine's clock, which nothing on screen shows. `shown`: its title, topic and own id, as the gateway reads
        them from its first request."""
        self.advance(t)
        self.engine.sessions.open(name, source=source, harness=harness, api=api, endpoint="sim", **shown)

    def ask(self, name: str, t: float, *messages: tuple[str, str]) -> None:
        """The request's new messages, as its client sent them (before it is admitted)."""
        st = self.engine.agents[name]
        for role, content in messages:
            self.emit(ev.MessageRecorded(t, name, st.attempts + 1, st.turn + 1, role, content,
                                         raw={"role": role, "content": content}))

    def queued(self, name: str, t: float) -> None:
        st = self.engine.agents[name]
        move(st, "queued")
        self.emit(ev.AgentQueued(t, name, st.wave))

    def send(self, name: str, t: float, *, queued_s: float = 0.0, asked: str = "claude-sonnet-4",
             sent: str = "sim-model") -> Attempt:
        """The request is admitted and sent upstream at `t` (its stall clock starts here), after `queued_s`."""
        st = self.engine.agents[name]
        policy = self.engine.policies[st.endpoint]
        st.attempts += 1
        st.turn += 1
        att = Attempt(st.attempts, st.turn, sent_at=t, last_alive=t, base=t,
                      deadline_at=t + policy.first_byte_timeout_s)
        st.current = att
        set_status(st, "prefill")
        if st.started_at is None:
            st.started_at = t
        self.emit(ev.AgentStarted(t, name, att.number, att.turn, 0, st.endpoint, policy.first_byte_timeout_s,
                                  policy.idle_timeout_s, request_id=f"{RUN_ID}.{name}.r{att.number}",
                                  queued_s=queued_s, model_asked=asked, model_sent=sent))
        return att

    def answered(self, name: str, t: float, *, status: str = "idle") -> None:
        """The request's answer went out whole; the session holds its slot (idle) or gave it back (released)."""
        st = self.engine.agents[name]
        att = st.current
        assert att is not None and att.first_token_at is not None
        st.completion_tokens += att.tokens
        st.decode_s += t - att.first_token_at
        self.emit(ev.MessageRecorded(t, name, att.number, att.turn, "assistant", "..."))
        self.emit(ev.TurnFinished(t, name, att.number, att.turn, 0, 40, att.tokens, "stop",
                                  att.first_token_at - att.sent_at, t - att.sent_at))
        st.current = None
        set_status(st, status)

    def request_killed(self, name: str, t: float, reason: str, deadline: str = "operator") -> None:
        """A request killed (by the operator or a deadline): the session goes on, idle."""
        st = self.engine.agents[name]
        att = st.current
        assert att is not None
        self.emit(ev.AgentKilled(t, name, att.number, deadline, reason, att.tokens))
        st.current = None
        move(st, "idle")


LONG_NAMES = {"claude-main": "226c5305-4664-4f2a-9b1e-5d0c3a7bc9e1", "codex-7f3a": "0199a6f2-3c41-7d2e-b6a8-1f04e7c2d5aa",
              "aider": "aider", "ses-9c1e": "ses_dca4bc70bff2e1c9a3d6f0b8e4"}
"""The scene's sessions as harnesses name them when no path label does (Claude Code, Codex, opencode)."""


def build_gateway(*, sessions: bool = True, long_names: bool = False, theme: str | None = None,
                  down: bool = False) -> CerevisorApp:
    """A gateway run twelve seconds in (no workflow of its own): with `sessions`, four of them, one streaming its
    second request, one whose request was killed (it goes on, idle), one that gave its slot back, one waiting for a
    slot; without, none has come yet. `long_names`: the sessions named as harnesses name them (session UUIDs, an
    opencode id), with the kill's reason at length: what the console has to fit in 80 columns. `down`: its
    upstream's port never opened, and it is down past its grace."""
    config = gateway_config()
    engine = Engine(config, run_id=RUN_ID, run_dir=f"/runs/{RUN_ID}")
    engine.connections.models["sim"] = "sim-model"
    handle = run_handle(engine)
    app = CerevisorApp(handle.control, handle.mirror, config, clock=lambda: NOW, themes=load_themes(None),
                       theme=theme)
    d = GatewayDriver(engine, app)
    engine.started_at = T0
    d.emit(msgspec.structs.replace(engine.started_event(T0), note=""))
    d.emit(ev.GatewayServing(T0 + 0.1, GATEWAY_URL, ["sim-model"], {"claude-*": "sim-model"}))
    d.emit(ev.RunNotice(T0 + 0.1, GATEWAY_NOTICE, "information", "Gateway"))
    n = LONG_NAMES if long_names else {name: name for name in LONG_NAMES}
    killed = ("killed by operator: the request ran past the budget the operator set for this harness"
              if long_names else "killed by operator")
    if sessions:
        d.open(n["claude-main"], T0 + 1, "claude-code 2.0.14")
        d.ask(n["claude-main"], T0 + 1, ("user", "Read README.md and list the commands."))
        d.send(n["claude-main"], T0 + 1)
        d.tokens(n["claude-main"], 30, T0 + 1.4, T0 + 3.0)
        d.answered(n["claude-main"], T0 + 3.0)

        d.open(n["codex-7f3a"], T0 + 2, "codex_exec 0.46.0", source="prompt_cache_key", api="responses")
        d.ask(n["codex-7f3a"], T0 + 2, ("user", "Fix the failing test in tests/test_cli.py."))
        d.queued(n["codex-7f3a"], T0 + 2)
        d.send(n["codex-7f3a"], T0 + 4.3, queued_s=2.3, asked="gpt-5-codex", sent="sim-model")
        d.tokens(n["codex-7f3a"], 8, T0 + 5.0, T0 + 6.0)
        d.request_killed(n["codex-7f3a"], T0 + 9.0, killed)

        d.open(n["aider"], T0 + 3, "aider", source="path")
        d.ask(n["aider"], T0 + 3, ("user", "Add type hints to utils.py"))
        d.send(n["aider"], T0 + 3, asked="sim-model")
        d.tokens(n["aider"], 20, T0 + 3.3, T0 + 4.0)
        d.answered(n["aider"], T0 + 4.0, status="released")

        d.ask(n["claude-main"], T0 + 6, ("tool", "README.md: run, attach, ls, stop, sim, probe, estimate, gateway"),
              ("user", "Now sort them by how often they are used."))
        d.send(n["claude-main"], T0 + 6)
        d.tokens(n["claude-main"], 50, T0 + 6.5, NOW - 0.1)

        d.open(n["ses-9c1e"], T0 + 9.5, "openai-python 1.99.0", source="fingerprint", title="openai-python 9c1e",
               topic='"Summarise the diff." · in …/work/shop')
        d.ask(n["ses-9c1e"], T0 + 9.5, ("user", "Summarise the diff."))
        d.queued(n["ses-9c1e"], T0 + 9.5)
    if down:
        d.emit(ev.EndpointState(T0 + 10.1, "sim", "down", "connection refused at 127.0.0.1:8399; it has never "
                                "answered", T0 + 0.1))
    handle.mirror.notices.clear()  # the pictures show the rows, not the toasts (tests read the notices)
    d.advance(NOW)
    return app
