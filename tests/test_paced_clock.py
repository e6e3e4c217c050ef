"""PacedClock (engine/clock.py): a run's timers on another clock's time (a sped-up simulator's), which may stand still
while the wall goes on: a sleep and a deadline scope end only once that clock has advanced by their seconds."""

from __future__ import annotations

import anyio
import pytest

from cerevisor_tui.engine.clock import PacedClock

pytestmark = pytest.mark.anyio

PACE = 50.0  # the simulator's speed: its reading moves 50 s for each of the clock's seconds


class Reading:
    """A simulator's clock moved by hand, telling when it has been read `looks` times."""

    def __init__(self, looks: int) -> None:
        self.value = 1000.0
        self.reads = 0
        self.looks = looks
        self.looked = anyio.Event()

    def __call__(self) -> float:
        self.reads += 1
        if self.reads >= self.looks:
            self.looked.set()
        return self.value


async def test_a_sleep_lasts_until_the_reading_has_moved_by_its_seconds() -> None:
    reading = Reading(looks=4)  # its start, a look before the wall's sleep, and two after it: the wall's time is up
    clock = PacedClock(reading, PACE)
    slept = anyio.Event()

    async def sleeper() -> None:
        await clock.sleep(0.01)
        slept.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(sleeper)
            await reading.looked.wait()
            assert not slept.is_set()  # the wall's 0.01 s went by, the simulator's 0.5 s did not
            reading.value += 0.02 * PACE
            await slept.wait()


async def test_a_deadline_scope_ends_its_block_only_once_the_reading_passes_it() -> None:
    reading = Reading(looks=3)  # its due time, then two looks at the wall's due time and after
    clock = PacedClock(reading, PACE)
    ended = anyio.Event()
    cancelled: list[bool] = []

    async def waiter() -> None:
        with clock.move_on_after(0.01) as scope:
            await anyio.sleep_forever()
        cancelled.append(scope.cancelled_caught)
        ended.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(waiter)
            await reading.looked.wait()
            assert not ended.is_set()
            reading.value += 0.02 * PACE
            await ended.wait()
    assert cancelled == [True]


async def test_a_scope_of_no_seconds_is_due_at_once() -> None:
    clock = PacedClock(Reading(looks=1), PACE)
    with anyio.fail_after(10):
        with clock.move_on_after(0.0) as scope:
            await anyio.sleep_forever()
    assert scope.cancelled_caught
