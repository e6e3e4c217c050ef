"""Admission control: which queued agent may start now, under the live mode, cap and pause.

Agents wait here in FIFO order. An agent is admitted when admissions are not paused, fewer than the
effective cap are running, and its endpoint has room under its own `max_concurrency`. Changing the
mode or cap re-runs admission at once; lowering it never stops a running agent, it only holds new
admissions until the running count is below the new cap.

In auto mode there is no run-wide cap: each endpoint has a live cap of its own (`set_endpoint_cap`, set by
its auto controller), never above the endpoint's `max_concurrency`.

An agent of a pool waits under the pool's name; when it is its turn, `place` (the engine's placement,
engine/placement.py) names the member with room it goes to, and the slot is held there.

An endpoint on `hold` (its warm-up is out, engine/warmup.py) admits no one until `admit`: the agents bound for
it wait, and those behind them bound elsewhere go on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio

from cerevisor_tui.contract.commands import MAX_CAP
from cerevisor_tui.kinds import MODES, Mode


class Scheduler:
    def __init__(self, mode: Mode, max_concurrency: int, endpoint_caps: dict[str, int],
                 on_change: Callable[[], None] | None = None, *, pools: dict[str, list[str]] | None = None,
                 place: Callable[[str, str], str | None] | None = None) -> None:
        self.mode: Mode = mode
        self.max_concurrency = max_concurrency
        self.endpoint_caps = dict(endpoint_caps)
        self.paused = False
        self.running = 0
        self.max_running = 0
        self.running_by_endpoint: dict[str, int] = {name: 0 for name in endpoint_caps}
        self.auto_caps: dict[str, int] = {name: 1 for name in endpoint_caps}
        self._waiters: dict[str, tuple[str, anyio.Event]] = {}
        self._on_change = on_change
        self.pools = pools or {}  # pool -> its members
        self._place = place  # (agent, pool) -> the member it goes to, or None while no member has room
        self.holding: dict[str, str] = {}  # agent -> the endpoint its slot is on
        self.held: set[str] = set()  # endpoints that admit no one yet (their warm-up is out)

    @property
    def effective_cap(self) -> int:
        """How many agents may run at once now: 1 in sequential mode, the cap in parallel mode, and in
        auto mode the sum of the endpoints' live caps."""
        if self.mode == "sequential":
            return 1
        if self.mode == "auto":
            return sum(self.endpoint_cap(name) for name in self.endpoint_caps)
        return self.max_concurrency

    def endpoint_cap(self, endpoint: str) -> int:
        """How many agents may run on `endpoint` now, whatever the other endpoints run."""
        limit = self.endpoint_caps.get(endpoint, self.max_concurrency)
        if self.mode == "auto":
            return min(limit, self.auto_caps.get(endpoint, 1))
        return min(limit, self.effective_cap)

    def queued_for(self, endpoint: str) -> int:
        """Agents waiting for `endpoint`, those of a pool it is a member of included."""
        return sum(1 for ep, _ in self._waiters.values() if ep == endpoint or endpoint in self.pools.get(ep, ()))

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def set_mode(self, mode: Mode) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
        self.mode = mode
        self._pump()

    def set_cap(self, max_concurrency: int) -> None:
        self.max_concurrency = min(MAX_CAP, max(1, int(max_concurrency)))
        self._pump()

    def set_endpoint_cap(self, endpoint: str, cap: int) -> None:
        """Auto mode's live cap of one endpoint; lowering it only holds admissions."""
        self.auto_caps[endpoint] = max(1, int(cap))
        self._pump()

    def hold(self, endpoint: str) -> None:
        """Admit no one to `endpoint` (nor, for a pool's agent, place one on it) until `admit`."""
        self.held.add(endpoint)

    def admit(self, endpoint: str) -> None:
        """`endpoint` takes agents again (its warm-up ended)."""
        if endpoint in self.held:
            self.held.discard(endpoint)
            self._pump()

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self._pump()

    @asynccontextmanager
    async def slot(self, agent: str, endpoint: str, *, on_wait: Callable[[], None] | None = None) \
            -> AsyncIterator[str]:
        """Hold a running slot for `agent` on `endpoint` (or on a member of the pool it names); waits (FIFO)
        until admitted, and yields the endpoint the slot is on. `on_wait` is called when it is not admitted at once,
        as it starts to wait."""
        admitted = anyio.Event()
        self._waiters[agent] = (endpoint, admitted)
        self._pump()
        if on_wait is not None and not admitted.is_set():
            on_wait()
        try:
            await admitted.wait()
        except BaseException:
            if self._waiters.pop(agent, None) is None:  # admitted in the same instant as cancelled
                self._release(agent)
            raise
        try:
            yield self.holding[agent]
        finally:
            self._release(agent)

    def move(self, agent: str, endpoint: str) -> None:
        """Move a running agent's slot to `endpoint` now (its member went down), even past that endpoint's cap:
        it was running already, and holding it behind the queue would punish it for its server's failure."""
        old = self.holding[agent]
        self.running_by_endpoint[old] -= 1
        self.running_by_endpoint[endpoint] = self.running_by_endpoint.get(endpoint, 0) + 1
        self.holding[agent] = endpoint
        self._pump()

    def _release(self, agent: str) -> None:
        endpoint = self.holding.pop(agent)
        self.running -= 1
        self.running_by_endpoint[endpoint] -= 1
        self._pump()

    def _pump(self) -> None:
        if self.paused:
            return
        cap = self.effective_cap
        admitted = []
        for agent, (endpoint, event) in self._waiters.items():
            if self.running >= cap:
                break
            if endpoint in self.pools:
                member = self._place(agent, endpoint) if self._place is not None else None
                if member is None:
                    continue
                endpoint = member
            elif endpoint in self.held or self.running_by_endpoint.get(endpoint, 0) >= self.endpoint_cap(endpoint):
                continue
            self.holding[agent] = endpoint
            self.running += 1
            self.running_by_endpoint[endpoint] = self.running_by_endpoint.get(endpoint, 0) + 1
            admitted.append(agent)
            event.set()
        for agent in admitted:
            del self._waiters[agent]
        if admitted:
            self.max_running = max(self.max_running, self.running)
            if self._on_change:
                self._on_change()
