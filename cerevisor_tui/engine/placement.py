"""Where a pool's agents run: each agent is placed on one member when it is admitted and every turn of it
stays there (the member's prefix cache holds its conversation), chosen by live load; a member that is down
takes no new agent, and an agent on it moves to another member at its next attempt. A member that is up but
fails requests (500s, 429s while its health check says 200) is degraded for a while: it takes new agents only
when no other member has room, and an agent it fails moves to a member that has.

Why stay: an agent resends its whole growing conversation every turn and the server reuses almost all of it
from its prefix cache; a turn sent to another replica recomputes everything (round-robin per request over N
replicas drives prefix hits toward 1/N). benchmarks/fleet.py measures the difference on the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cerevisor_tui.config.models import PoolConfig

HOSTED_DOWN_S = 30.0  # a hosted member (no health check to say it is back) that refused is tried again after this
DEGRADED_S = 30.0  # a member that failed a request counts as degraded this long after its last failure


@dataclass(frozen=True, slots=True)
class MemberLoad:
    """What placement weighs of one member now."""

    name: str
    running: int  # our agents holding a slot on it
    cap: int  # how many of ours may run on it now (its max_concurrency, auto's live cap)
    waiting: float | None = None  # requests in the server's queue, by its last sample
    kv_usage: float | None = None  # fraction of its KV cache in use, by its last sample

    @property
    def room(self) -> bool:
        return self.running < self.cap

    @property
    def score(self) -> float:
        """Lower is emptier: our share of its cap, its queue against that cap, and its KV use."""
        cap = max(1, self.cap)
        return self.running / cap + (self.waiting or 0.0) / cap + (self.kv_usage or 0.0)


class Placement:
    """The run's pools: which members are down (and why), and the choice of a member for an agent."""

    def __init__(self, pools: Sequence[PoolConfig]) -> None:
        self.pools = {p.name: p for p in pools}
        self.down: dict[str, str] = {}  # member -> why it is down
        self._down_until: dict[str, float] = {}  # member -> when a refusal stops counting (hosted members)
        self._next: dict[str, int] = {p.name: 0 for p in pools}  # round-robin position per pool
        self.placed: dict[str, int] = {}  # member -> agents placed on it so far (ties go to the fewer)
        self.degraded: dict[str, str] = {}  # member -> why it is degraded (a failed request)
        self._degraded_until: dict[str, float] = {}

    def members(self, pool: str) -> list[str]:
        return list(self.pools[pool].endpoints)

    def pools_of(self, member: str) -> list[str]:
        return [p.name for p in self.pools.values() if member in p.endpoints]

    def is_down(self, member: str, now: float) -> bool:
        if member not in self.down:
            return False
        if now >= self._down_until.get(member, math.inf):
            self.mark_up(member)
            return False
        return True

    def mark_down(self, member: str, why: str, *, until: float = math.inf) -> bool:
        """`member` refused a connection or failed its health check; returns whether it was up until now."""
        was_up = member not in self.down
        self.down[member] = why
        self._down_until[member] = until
        return was_up

    def mark_up(self, member: str) -> bool:
        """A healthy sample (or a hosted member's wait) says `member` serves again; returns whether it was down."""
        self._down_until.pop(member, None)
        return self.down.pop(member, None) is not None

    def is_degraded(self, member: str, now: float) -> bool:
        if member not in self.degraded:
            return False
        if now >= self._degraded_until[member]:
            del self.degraded[member], self._degraded_until[member]
            return False
        return True

    def mark_degraded(self, member: str, why: str, now: float) -> bool:
        """`member` failed a request (it is up: it answered); returns whether it was not degraded until now."""
        was_fine = not self.is_degraded(member, now)
        self.degraded[member] = why
        self._degraded_until[member] = now + DEGRADED_S
        return was_fine

    def choose(self, pool: str, loads: Sequence[MemberLoad], now: float) -> MemberLoad | None:
        """The member of `pool` a newly admitted agent goes to, among `loads` (the members, in pool order), or None
        when every member that is up is full. Members that are down are passed over while any member is up; when
        all are down (a fleet still loading its model) the agent is placed anyway, and its attempt waits for its
        member's port as a lone local endpoint's does."""
        up = [m for m in loads if not self.is_down(m.name, now)] or list(loads)
        open_ = [m for m in up if m.room and not self.is_degraded(m.name, now)] or [m for m in up if m.room]
        if not open_:
            return None
        if self.pools[pool].policy == "round-robin":
            names = [m.name for m in loads]
            start = self._next[pool]
            chosen = min(open_, key=lambda m: (names.index(m.name) - start) % len(names))
            self._next[pool] = (names.index(chosen.name) + 1) % len(names)
        else:
            chosen = min(open_, key=lambda m: (m.score, m.running, self.placed.get(m.name, 0)))
        self.placed[chosen.name] = self.placed.get(chosen.name, 0) + 1
        return chosen

    def move_target(self, pool: str, loads: Sequence[MemberLoad], current: str, now: float) -> MemberLoad | None:
        """Where an agent on a member that is down goes: the emptiest other member that is up (full or not: it
        held a slot already, and waiting behind newcomers would punish it for its server's failure), one that is
        not degraded first; None when no other member is up."""
        others = [m for m in loads if m.name != current and not self.is_down(m.name, now)]
        if not others:
            return None
        chosen = min(others, key=lambda m: (self.is_degraded(m.name, now), not m.room, m.score, m.running))
        self.placed[chosen.name] = self.placed.get(chosen.name, 0) + 1
        return chosen

    def escape_target(self, pool: str, loads: Sequence[MemberLoad], current: str, now: float) -> MemberLoad | None:
        """Where an agent whose request `current` failed goes: the emptiest other member that is up, not
        degraded, and has room; None when there is none (it retries where it is)."""
        others = [m for m in loads if m.name != current and m.room and not self.is_down(m.name, now)
                  and not self.is_degraded(m.name, now)]
        if not others:
            return None
        chosen = min(others, key=lambda m: (m.score, m.running))
        self.placed[chosen.name] = self.placed.get(chosen.name, 0) + 1
        return chosen
