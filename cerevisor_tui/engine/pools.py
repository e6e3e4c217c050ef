"""Pools in a run: each pool agent placed on one member when admitted (by live load, engine/placement.py),
moved only when its member is down (a refused connection, a failed health check) or fails its request (a
retryable error: the member is degraded, and the agent goes to a member with room), and every placement and
move told as AgentPlaced, every member down, degraded or up again as a RunNotice."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace

from cerevisor_tui.config.models import EndpointConfig
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.placement import HOSTED_DOWN_S, MemberLoad, Placement
from cerevisor_tui.engine.roster import Roster
from cerevisor_tui.engine.scheduler import Scheduler
from cerevisor_tui.engine.state import AgentState


class Pools:
    """Handed its ports: the placement and the scheduler (admission), the roster, the servers' last samples, the
    load's refresh, emit and the clock; `keeps_down` is the wedge rules' (engine/wedge.py), set when they exist."""

    def __init__(self, placement: Placement, scheduler: Scheduler, roster: Roster,
                 endpoints: Mapping[str, EndpointConfig], last_sample: Mapping[str, ev.ServerSample],
                 refresh_load: Callable[[str | None], None], emit: Callable[[ev.Event], None], clock: Clock) -> None:
        self.placement = placement
        self.scheduler = scheduler
        self.roster = roster
        self.endpoints = endpoints
        self.last_sample = last_sample
        self.refresh_load = refresh_load
        self.emit = emit
        self.clock = clock
        self.keeps_down: Callable[[str], bool] = lambda endpoint: False

    def member_loads(self, pool: str) -> list[MemberLoad]:
        """What placement weighs of each member of `pool` now: our agents there, its cap, its last sample."""
        loads = []
        for name in self.placement.members(pool):
            sample = self.last_sample.get(name)
            loads.append(MemberLoad(name, self.scheduler.running_by_endpoint.get(name, 0),
                                    self.scheduler.endpoint_cap(name), sample.waiting if sample else None,
                                    sample.kv_cache_usage if sample else None))
        return loads

    def place(self, agent: str, pool: str) -> str | None:
        """The scheduler asks: the member of `pool` that `agent`, admitted now, goes to (None: none has room; a
        member whose warm-up is out has none yet)."""
        held = self.scheduler.held
        loads = [replace(m, cap=0) if m.name in held else m for m in self.member_loads(pool)]
        chosen = self.placement.choose(pool, loads, self.clock.now())
        return chosen.name if chosen is not None else None

    def placed(self, st: AgentState, member: str, moved_from: str = "", reason: str = "") -> None:
        self.roster.place(st, member)
        self.emit(ev.AgentPlaced(self.clock.now(), st.name, member, st.pool, moved_from, reason))

    def relocate(self, st: AgentState, refused: str = "") -> bool:
        """Move a pool's agent off its member when that member is down: `refused` is why its connection was just
        refused (the member is marked down by it), else the agent moves only if its member is already marked
        down (a failed health check). Returns whether it moved; it stays where it is when no other member is up."""
        member, now = st.endpoint, self.clock.now()
        if not st.pool:
            return False
        if refused:
            until = now + HOSTED_DOWN_S if self.endpoints[member].kind == "hosted" else math.inf
            if self.placement.mark_down(member, f"refused a connection: {refused}", until=until):
                self.tell_down(member)
        elif not self.placement.is_down(member, now):
            return False
        target = self.placement.move_target(st.pool, self.member_loads(st.pool), member, now)
        if target is None:
            return False
        self.scheduler.move(st.name, target.name)
        why = self.placement.down.get(member, "down")
        self.placed(st, target.name, member, f"moved from {member}, which {why}; its prefix cache there is lost "
                                             f"and {target.name} computes the conversation afresh")
        self.refresh_load(member)
        self.refresh_load(target.name)
        return True

    def failed(self, st: AgentState, why: str) -> bool:
        """A pool agent's request failed on its member with a retryable error (an HTTP 500 or 429, a broken
        stream) although the member is up: the member is degraded for placement, and the agent moves to another
        member with room. Returns whether it moved; it retries where it is when no other member has room."""
        member, now = st.endpoint, self.clock.now()
        if not st.pool:
            return False
        why = why if len(why) <= 160 else why[:159] + "…"  # a server's whole error page is not a notice
        if self.placement.mark_degraded(member, why, now):
            self.emit(ev.RunNotice(now, f"{member} failed a request ({why}): it is degraded, new agents go to other "
                                "members while they have room, and agents it fails move to them", "warning",
                                "Pool member degraded"))
        target = self.placement.escape_target(st.pool, self.member_loads(st.pool), member, now)
        if target is None:
            return False
        self.scheduler.move(st.name, target.name)
        self.placed(st, target.name, member, f"moved from {member}, which failed its request ({why}); its prefix "
                                             f"cache there is lost and {target.name} computes the conversation afresh")
        self.refresh_load(member)
        self.refresh_load(target.name)
        return True

    def on_sample(self, endpoint: str) -> None:
        """After each server sample: a pool member's health decides whether placement counts it as down."""
        sample = self.last_sample.get(endpoint)
        if sample is not None and self.placement.pools_of(endpoint):
            if sample.healthy:
                # a wedged server answers /health with 200: it stays down until it moves again (engine/wedge.py)
                if not self.keeps_down(endpoint) and self.placement.mark_up(endpoint):
                    self.emit(ev.RunNotice(self.clock.now(), f"{endpoint} is healthy again: pool agents may be "
                                        "placed on it", "information", "Pool member up"))
            elif self.placement.mark_down(endpoint, f"failed its health check ({sample.detail or 'unhealthy'})"):
                self.tell_down(endpoint)
        self.refresh_load(endpoint)

    def tell_down(self, member: str) -> None:
        self.emit(ev.RunNotice(self.clock.now(), f"{member} {self.placement.down[member]}: no new agent "
                                      "goes there, and its agents move at their next attempt", "warning",
                                      "Pool member down"))
