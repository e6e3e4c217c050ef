"""External sessions (the gateway's harnesses) as agents of the run: each a row, its requests its attempts, under
the run's mode, cap, Auto and watchdog.

A session holds a running slot, as a workflow agent does, while it is active: the sessions holding slots are
the KV-resident set. Its first request waits for a slot; while it holds one its requests go straight through;
it gives the slot back after `release_after_s` without a request. A session may have several requests in
flight at once (a harness's sub-agents, its small-model side requests): each is an attempt of its own, under
its own deadlines. Sessions are bounded: one idle for `forget_after_s` is forgotten (its row ends, and the run
keeps nothing of it but what the journal and the report say), and a client key opens `max_per_key` at most.

The HTTP side (what is asked, what is relayed) is the gateway's (gateway/); this module keeps the run's side:
admission, the attempt records and their watchdog, and the events that tell them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from cerevisor_tui.config.models import AgentConfig, Config, ResolvedStall
from cerevisor_tui.contract import events as ev
from cerevisor_tui.contract.deadlines import fmt_s
from cerevisor_tui.engine.attempt import Attempts
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.pools import Pools
from cerevisor_tui.engine.roster import Roster, RunLife
from cerevisor_tui.engine.state import AgentState, Attempt
from cerevisor_tui.engine.status import move
from cerevisor_tui.engine.watchdog import Watchdog
from cerevisor_tui.kinds import FINAL, FORGOTTEN

if TYPE_CHECKING:
    from cerevisor_tui.engine.resume import SessionBefore


class RunStopping(Exception):
    """The run is stopping: a request not yet admitted is not sent; `str()` says why."""


class Dropped(Exception):
    """The operator's kill dropped a request from the queue: it is not sent; `str()` says why."""


class BudgetSpent(Exception):
    """The run's budget is spent ([run] budget_usd): a session's request is not sent; `str()` says why."""


class TooManySessions(Exception):
    """A client key has as many sessions open as it may ([gateway] max_sessions_per_key); `str()` says so."""


@dataclass(eq=False)
class Session:
    """One external session: the agent record the run keeps, and its slot and requests."""

    st: AgentState
    source: str
    harness: str
    api: str
    key: str = ""
    holding: bool = False  # it holds its slot now
    changed: anyio.Event = field(default_factory=anyio.Event)  # set (and replaced) when `holding` changes
    holder: anyio.CancelScope | None = None  # the task holding its slot, while it runs
    placed: bool = False  # a pool's session: placed on a member, where it stays (affinity)
    wake: anyio.Event = field(default_factory=anyio.Event)  # a request began or ended: the holder looks again
    in_flight: dict[int, Attempt] = field(default_factory=dict)  # attempt number -> its record
    queued: int = 0  # requests waiting for the slot
    waiting: dict[anyio.CancelScope, str] = field(default_factory=dict)  # each one's wait, and why it was dropped
    last_end: float = 0.0  # when its last request ended
    requests: int = 0
    kills: list[str] = field(default_factory=list)  # each killed request's reason
    last_kill: str = ""  # its last request's kill reason ("" : it was not killed), with the deadline
    last_by_stop: bool = False  # that kill was the run's stop
    # how many of each conversation's messages the transcript has, by the conversation's fingerprint: a harness
    # may carry several in one session (Claude Code's side requests for a title or a summary)
    recorded: dict[str, int] = field(default_factory=dict)
    resumed: bool = False  # an earlier run of the directory had it: its transcript holds what it said then

    @property
    def name(self) -> str:
        return self.st.name

    def poke(self) -> None:
        self.wake.set()

    def hold(self, holding: bool) -> None:
        self.holding = holding
        changed, self.changed = self.changed, anyio.Event()
        changed.set()


class Sessions:
    """The run's external sessions (`engine.sessions`): opened by the gateway as they arrive. Handed its ports:
    the roster and the run's life, admission (the pools' scheduler, placement and load), the attempt owner and
    the watchdog, the budget's refusal, the config's pools, emit and the clock."""

    def __init__(self, config: Config, roster: Roster, life: RunLife, pools: Pools, attempts: Attempts,
                 watchdog: Watchdog, policies: Mapping[str, ResolvedStall], budget_refusal: Callable[[], str],
                 request_prefix: str, emit: Callable[[ev.Event], None], clock: Clock) -> None:
        self.config = config
        self.roster = roster
        self.life = life
        self.pools = pools
        self.attempts = attempts
        self.watchdog = watchdog
        self.policies = policies
        self.budget_refusal = budget_refusal
        self.request_prefix = request_prefix
        self.emit = emit
        self.clock = clock
        self.by_name: dict[str, Session] = {}
        self.release_after_s = 60.0
        self.forget_after_s = 3600.0  # 0: never
        self.max_per_key = 1024
        self.forgotten = 0
        # each forgotten session's name, with the requests it had made: one that comes back numbers its requests on
        # (never an X-Request-Id sent again) and its transcript goes on after the client's last answer
        self._gone: dict[str, int] = {}
        self.group: anyio.abc.TaskGroup | None = None  # the run's background group, once the run has begun
        self._ready: anyio.Event | None = None  # made in the run's loop: the run has begun, slots can be held
        # a resumed run: what each session had done before (engine/resume.py), which it goes on from
        self.before: Mapping[str, SessionBefore] = {}

    @property
    def ready(self) -> anyio.Event:
        if self._ready is None:
            self._ready = anyio.Event()
        return self._ready

    def open(self, name: str, *, source: str, harness: str, api: str, endpoint: str, key: str = "", title: str = "",
             topic: str = "", own_id: str = "") -> Session:
        """The session named `name` of the client key named `key`, opened (and told as SessionOpened) the first
        time it is seen. A session belongs to the key that opened it, and its name is never a workflow agent's:
        a request under another key, or named like an agent, gets a session of its own (`own_name`), never
        another's row, slot, meters and transcript. Not a refusal: two harnesses may share a name in good faith
        (an OpenAI `user`, a path label), and each still gets its answer."""
        name = self.own_name(name, key)
        found = self.by_name.get(name)
        if found is not None:
            return found
        if sum(1 for s in self.by_name.values() if s.key == key) >= self.max_per_key:
            raise TooManySessions(f"{'client key ' + key if key else 'the gateway'} has {self.max_per_key} sessions "
                                  "open, its most ([gateway] max_sessions_per_key); an idle one is forgotten after "
                                  f"{self.forget_after_s:g} s ([gateway] forget_after_s)")
        pool = self.config.pool(endpoint)
        where = pool.endpoints[0] if pool is not None else endpoint
        st = self.roster.add(AgentState(AgentConfig(name=name, endpoint=endpoint, prompt="", retries=0), where, 0,
                                        pool=pool.name if pool is not None else ""))
        session = self.by_name[name] = Session(st, source, harness, api, key, last_end=self.clock.now())
        before = self.before.get(name)
        if before is not None:  # its requests numbered on, its cost counted on (the report keeps its figures)
            self.attempts.resumed(st, before.requests, before.cost_usd)
            session.requests = before.requests
            session.resumed = True
        done = self._gone.get(name)
        if done is not None:  # forgotten, and back: a new row, its figures its own, its numbering and transcript on
            self.attempts.resumed(st, done, 0.0)
            session.requests = done
            session.resumed = True
        self.emit(ev.SessionOpened(self.clock.now(), name, source, harness, api, endpoint, key, title, topic, own_id))
        return session

    def own_name(self, name: str, key: str) -> str:
        """`name` when it is free or already `key`'s session; else the first of `name@KEY`, `name@KEY-2`, ... that
        is (`name@session` without a key), so a key's requests under one name always land in one session."""
        owner = key.lower() or "session"
        candidate, n = name, 1
        while True:
            found = self.by_name.get(candidate)
            if found is not None and found.key == key:
                return candidate
            if found is None and candidate not in self.roster.agents:
                return candidate
            n += 1
            candidate = f"{name}@{owner}" if n == 2 else f"{name}@{owner}-{n - 1}"

    def started(self, group: anyio.abc.TaskGroup) -> None:
        self.group = group
        if self.forget_after_s:
            group.start_soon(self._forget_idle)
        self.ready.set()

    async def _forget_idle(self) -> None:
        """Forget each session idle (no request, no slot) for `forget_after_s`, looking a few times in that span."""
        clock = self.clock
        while True:
            await clock.sleep(self.forget_after_s / 4)
            now = clock.now()
            for session in [s for s in self.by_name.values() if not (s.in_flight or s.queued or s.holding or
                            s.holder is not None) and now - s.last_end >= self.forget_after_s]:
                self._forget(session)

    def _forget(self, session: Session) -> None:
        """`session`'s row ends (completed, or killed as its last request was) and the run lets go of it: a later
        request under its name opens a new session, and the report keeps both."""
        st = session.st
        if st.status not in FINAL:
            why = f"{FORGOTTEN}{self.forget_after_s:g} s without a request"
            if session.last_kill:
                self.roster.finish(st, "killed", f"{why} (its last request: {session.last_kill})")
            else:
                self.roster.finish(st, "completed", why)
        del self.by_name[st.name]
        self._gone[st.name] = session.requests
        self.roster.remove(st)
        self.forgotten += 1

    @asynccontextmanager
    async def request(self, session: Session, group: anyio.abc.TaskGroup, *, model_asked: str = "",
                      model_sent: str = "", prompt_chars: int = 0) -> AsyncIterator[Attempt]:
        """One request of `session`: waits for the session's slot (queued), then yields its attempt, watched
        by the run's watchdog from now on (the first-byte deadline runs from here: time queued is not
        silence), a task in the caller's `group` until the attempt ends (one task group a request, not two). The
        attempt's `scope` is the caller's to set: a deadline or the operator cancels it."""
        st = session.st
        clock, life = self.clock, self.life
        queued_at = clock.now()
        session.queued += 1
        session.poke()
        wait = anyio.CancelScope()  # the operator's kill cancels it: the request leaves the queue
        session.waiting[wait] = ""
        try:
            with wait:
                await self.ready.wait()
                refusal = self.budget_refusal()
                if refusal:
                    raise BudgetSpent(refusal)
                if not session.holding:
                    if not session.in_flight:
                        move(st, "queued")
                    self.emit(ev.AgentQueued(clock.now(), st.name, st.wave))
                while not session.holding:
                    if life.stopping or life.ended:
                        raise RunStopping(life.stopping or "the run has ended")
                    if session.holder is None:
                        assert self.group is not None
                        self.group.start_soon(self._hold, session)
                    await session.changed.wait()
            if wait.cancel_called:
                raise Dropped(session.waiting[wait])
        finally:
            del session.waiting[wait]
            session.queued -= 1
            if not session.queued and not session.in_flight and not session.holding and session.holder is not None:
                session.holder.cancel()  # its only request went away while queued: its place in the queue goes too
        session.requests += 1
        st.attempts += 1
        st.turn += 1
        number = st.attempts
        policy = self.policies[st.endpoint]
        att = self.attempts.begin(st, number, f"{self.request_prefix}.{st.name}.r{number}", turns=0,
                               queued_s=clock.now() - queued_at, model_asked=model_asked, model_sent=model_sent,
                               prompt_chars=prompt_chars)
        if session.in_flight:  # the row goes on describing its oldest request (a harness's main turn), not a side one
            main = st.current = next(iter(session.in_flight.values()))
            move(st, "token" if main.first_token_at is not None else "sent")
        session.in_flight[number] = att
        watched = anyio.CancelScope()
        group.start_soon(self._watch, watched, st, att, policy)
        try:
            yield att
        finally:
            watched.cancel()
            if not att.answered:  # killed, broken off, its client gone: what it said is kept, its end told
                att.ends_unanswered("ended without its answer")  # (where the exchange gave no reason)
                self.attempts.ended(st, att, "".join(att.parts), "".join(att.thinking))
            del session.in_flight[number]
            session.last_end = clock.now()
            session.poke()
            session.last_kill = ""
            if att.kill_reason and not att.answered:  # a stop while its answered request did its meters: no kill
                session.kills.append(att.kill_reason)
                session.last_kill = att.why_killed
                session.last_by_stop = bool(life.stopping)
            st.current = next(iter(session.in_flight.values()), None)
            if st.current is None:
                move(st, "idle" if session.holding else "released")
            else:
                move(st, "token" if st.current.first_token_at is not None else "sent")

    def _wait_reason(self, session: Session, where: str) -> str:
        """Why `session`'s request waits for a slot on `where` (an endpoint or a pool), as the admission has just
        left it waiting: a harness held for a minute by another session's idle slot is the gateway's doing, and the
        operator is told so."""
        scheduler = self.pools.scheduler
        members = scheduler.pools.get(where, [where])
        if scheduler.paused:
            return "admissions are paused (p resumes them)"
        if all(member in scheduler.held for member in members):
            return f"{where} is warming up"
        full = scheduler.running >= scheduler.effective_cap
        holders = [name for name, at in scheduler.holding.items() if full or at in members]
        now = self.clock.now()
        shown = []
        for name in holders[:3]:
            other = self.by_name.get(name)
            if other is None:
                shown.append(name)  # a workflow agent
            elif other.in_flight or other.queued:
                shown.append(f"{name} asking")
            else:
                shown.append(f"{name} idle {now - other.last_end:.0f} s")
        more = f" and {len(holders) - 3} more" if len(holders) > 3 else ""
        scope = "of the run" if full else f"on {where}"
        taken = (f"the one slot {scope} is taken" if len(holders) == 1 else f"all {len(holders)} slots {scope} are taken") \
            + f" ({', '.join(shown)}{more})"
        ahead = scheduler.queued_for(where) - 1  # (itself among them)
        said = "; ".join(part for part in (taken if holders else "", f"{ahead} waiting before it" if ahead > 0 else "")
                         if part) or "waiting for a slot"
        if self.release_after_s <= 0:
            return f"{said}; each slot is given back as its request ends ([gateway] release_after_s = 0)"
        return (f"{said}; an idle session gives its slot back {fmt_s(self.release_after_s)} after its last request "
                "([gateway] release_after_s; l on its row gives it back now)")

    async def _watch(self, watched: anyio.CancelScope, st: AgentState, att: Attempt, policy: ResolvedStall) -> None:
        """The watchdog of `att` until `watched` is cancelled (the attempt ended, maybe before this task began)."""
        with watched:
            if not watched.cancel_called:
                await self.watchdog.watch(st, att, policy)

    async def _hold(self, session: Session) -> None:
        """Hold `session`'s slot while it has requests, and `release_after_s` past its last one."""
        st, pools, clock = session.st, self.pools, self.clock
        with anyio.CancelScope() as scope:
            session.holder = scope
            try:
                # a pool's session is placed once, and comes back to that member (its prefix cache) each time
                asked = st.endpoint if session.placed or not st.pool else st.pool

                def waits() -> None:
                    self.emit(ev.SessionWaits(clock.now(), st.name, self._wait_reason(session, asked)))

                async with pools.scheduler.slot(st.name, asked, on_wait=waits) as where:
                    if st.pool and not session.placed:
                        session.placed = True
                        pools.placed(st, where)
                    session.hold(True)
                    pools.refresh_load(st.endpoint)
                    while True:
                        session.wake = anyio.Event()
                        if session.in_flight or session.queued:
                            await session.wake.wait()
                            continue
                        left = session.last_end + self.release_after_s - clock.now()
                        if left <= 0:
                            break
                        with clock.move_on_after(left):
                            await session.wake.wait()
            finally:
                session.holder = None
                session.hold(False)  # requests waiting for it start another holder
                if not session.in_flight:
                    move(st, "released")
                pools.refresh_load(st.endpoint)

    def open_attempts(self, st: AgentState) -> list[Attempt]:
        """The agent's attempts open now: a session's every request in flight, else its current attempt."""
        session = self.by_name.get(st.name)
        if session is not None:
            return list(session.in_flight.values())
        return [st.current] if st.current is not None else []

    def kill(self, name: str, reason: str) -> bool:
        """The operator's kill of a session: each of its requests in flight is ended, and each one queued is
        dropped (the harness decides what follows); False when it has none."""
        session = self.by_name[name]
        for att in list(session.in_flight.values()):
            att.kill("operator", reason, by_operator=True)
        for wait in session.waiting:  # and each request still waiting for the slot leaves the queue
            session.waiting[wait] = reason
            wait.cancel()
        return bool(session.in_flight or session.waiting)

    def release(self, name: str) -> bool:
        """The operator gives an idle session's slot back now (its holder ends as `release_after_s` would end it):
        the next one waiting is admitted. False when it holds none; ValueError (one line, for the client) for a
        workflow agent, or a session with a request in flight or queued (its slot is its work's)."""
        session = self.by_name.get(name)
        if session is None:
            raise ValueError(f"{name} is not a gateway session: only a session holds a slot between its requests")
        busy = len(session.in_flight) + session.queued
        if busy:
            raise ValueError(f"{name} has {busy} request{'s' if busy > 1 else ''} in flight or queued: it gives its "
                             "slot back once it is idle")
        if session.holder is None:
            return False
        session.holder.cancel()
        return True

    def extend(self, name: str, seconds: float | None) -> bool:
        session = self.by_name[name]
        for att in list(session.in_flight.values()):
            self.watchdog.extend(session.st, att, seconds)
        return bool(session.in_flight)

    def stop(self, reason: str) -> None:
        """The run stops: each request in flight is ended with `reason`, and no slot is held any more."""
        for session in self.by_name.values():
            for att in list(session.in_flight.values()):
                att.kill("operator", reason, by_operator=True)
            if session.holder is not None:
                session.holder.cancel()
            session.hold(False)  # requests waiting for a slot look again, and see the run stopping

    def finish(self) -> None:
        """The run ended: every session ends as its last request did: killed (with the kill's reason), cancelled
        by the run's stop, else completed (a session has no answer to fail); earlier kills stay in its `kills`."""
        for session in self.by_name.values():
            st = session.st
            if st.status in FINAL:
                continue
            if session.last_kill and not session.last_by_stop:
                self.roster.finish(st, "killed", session.last_kill)
            elif session.last_kill:
                self.roster.finish(st, "cancelled", session.last_kill)
            else:
                self.roster.finish(st, "completed", "")
