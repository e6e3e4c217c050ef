"""Time as a parameter: the run's clock, handed to what decides by deadlines (the attempt owner, the watchdog and
a tool call's deadline, the warm-up, the sessions' release, the gateway's keep-alives) and to what tells the time
of what it saw (the monitor, the GPU samples, the report) from the composition root: every event of a run is on
one clock. `MONOTONIC` is the host's CLOCK_MONOTONIC under anyio's own timers; `VirtualClock` is moved by hand,
so a deadline rule's test runs in microseconds and never depends on how busy the machine is. `PacedClock` reads another clock (a sped-up simulator's),
so that a benchmark's run keeps the simulated server's time where the host cannot keep pace with it."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol

import anyio


class Clock(Protocol):
    """What deadline code asks of time: now, and a scope that ends its block once `seconds` have passed."""

    def now(self) -> float: ...

    def move_on_after(self, seconds: float) -> anyio.CancelScope: ...

    async def sleep(self, seconds: float) -> None: ...


class _Monotonic:
    """The host's monotonic clock and anyio's timers (the same clock: anyio's is the loop's, CLOCK_MONOTONIC)."""

    now = staticmethod(time.monotonic)
    move_on_after = staticmethod(anyio.move_on_after)
    sleep = staticmethod(anyio.sleep)


MONOTONIC: Clock = _Monotonic()


class VirtualClock:
    """A clock that moves only when told (`advance`): each scope made by `move_on_after` is cancelled once the
    clock passes its deadline, in deadline order. For tests of rules that wait on deadlines."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, anyio.CancelScope]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    def move_on_after(self, seconds: float) -> anyio.CancelScope:
        scope = anyio.CancelScope()
        deadline = self._now + max(0.0, seconds)
        if deadline <= self._now:
            scope.cancel()
        else:
            heapq.heappush(self._timers, (deadline, next(self._order), scope))
        return scope

    async def sleep(self, seconds: float) -> None:
        with self.move_on_after(seconds):
            await anyio.sleep_forever()

    async def advance(self, seconds: float) -> None:
        """Move time on by `seconds`, stopping at each timer due on the way (its waiter runs, at that time, before
        time moves further), then let every task run until all wait again."""
        end = self._now + seconds
        await anyio.wait_all_tasks_blocked()
        while self._timers and self._timers[0][0] <= end:
            deadline, _, scope = heapq.heappop(self._timers)
            self._now = max(self._now, deadline)
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
        self._now = end
        await anyio.wait_all_tasks_blocked()


class PacedClock:
    """Time read from `reading` (e.g. a sped-up simulator's clock, BatchEngine.clock_s) divided by `pace` (its
    speed): the wall's seconds while the simulator's host keeps pace, and slower while it falls behind, so that a
    run's timers (a session's release, Auto's windows, the monitor's interval) last as long in the simulated
    server's time however busy the host is. `reading` must never run backwards, nor faster than `pace` times the
    wall: a timer then sleeps the wall's seconds still to go and looks again, never past its due time."""

    def __init__(self, reading: Callable[[], float], pace: float = 1.0) -> None:
        self._reading = reading
        self._pace = pace

    def now(self) -> float:
        return self._reading() / self._pace

    def move_on_after(self, seconds: float) -> anyio.CancelScope:
        scope = anyio.CancelScope()
        due = self.now() + max(0.0, seconds)
        loop = asyncio.get_running_loop()

        def look() -> None:
            left = due - self.now()
            if left <= 0:
                scope.cancel()
            else:
                loop.call_later(left, look)

        if seconds <= 0:
            scope.cancel()
        else:
            loop.call_later(seconds, look)
        return scope

    async def sleep(self, seconds: float) -> None:
        due = self.now() + seconds
        while (left := due - self.now()) > 0:
            await anyio.sleep(left)
