"""Every cap the operator moves stays within the largest a command may set (`contract/commands.py` MAX_CAP, the
config's own bound): `+` held down, or one nudge of the whole range, in parallel mode and in auto mode alike."""

from __future__ import annotations

import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.engine.engine import Engine


def engine_in(mode: str) -> Engine:
    return Engine(validate({"run": {"mode": mode, "max_concurrency": 4090},
                            "endpoints": [{"name": "box", "kind": "simulated", "max_concurrency": 4096}],
                            "agents": [{"name": "a", "prompt": "p"}]}))


@pytest.mark.parametrize("mode", ["parallel", "auto"])
def test_a_nudge_past_the_largest_cap_stops_there_and_one_below_the_least_stops_at_1(mode):
    engine = engine_in(mode)
    seen: list = []
    engine.subscribe(seen.append)
    assert engine.handle(cmd.NudgeCap(delta=cmd.MAX_CAP)) == cmd.MAX_CAP
    for _ in range(3):  # `+` held down
        assert engine.handle(cmd.NudgeCap(delta=1)) == cmd.MAX_CAP
    told = [e for e in seen if e.kind == "ConcurrencyChanged"]
    assert told and all(e.total_cap <= cmd.MAX_CAP and (e.ceiling or 0) <= cmd.MAX_CAP for e in told)
    if mode == "auto":
        assert engine.caps.ceiling == cmd.MAX_CAP
    else:
        assert engine.scheduler.max_concurrency == cmd.MAX_CAP
    assert engine.handle(cmd.NudgeCap(delta=-cmd.MAX_CAP)) == 1
