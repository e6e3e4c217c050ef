"""Snapshot tests (pytest-textual-snapshot): fixed scenes, a frozen clock, seeded text.

Regenerate with `pytest tests/ui/test_snapshots.py --snapshot-update`, then look at the SVGs in
tests/ui/__snapshots__/ before committing them.
"""

from __future__ import annotations

import pytest

from tests.ui.scenes import build, build_gateway, select


def test_main_screen_mid_run_80x24(snap_compare):
    assert snap_compare(build("mid_run"), terminal_size=(80, 24))


def test_main_screen_mid_run_160x48(snap_compare):
    assert snap_compare(build("mid_run"), terminal_size=(160, 48))


def test_amber_stall(snap_compare):
    """skeptic has used 85% of its idle deadline: amber row with a live countdown."""
    assert snap_compare(build("amber_stall"), terminal_size=(100, 30), run_before=select("skeptic"))


def test_killed_agent(snap_compare):
    """skeptic was killed by the watchdog: the row, the stream and a notification say why."""
    assert snap_compare(build("killed"), terminal_size=(120, 30), run_before=select("skeptic"))


def test_settings_screen(snap_compare):
    assert snap_compare(build("mid_run"), terminal_size=(80, 24), press=["s"])


def test_help_screen(snap_compare):
    assert snap_compare(build("mid_run"), terminal_size=(100, 40), press=["question_mark"])


def test_auto_mode_80x24(snap_compare):
    """Auto mode twelve seconds in: AUTO 3 with its ceiling, and the load pane's trend in place of the
    throughput line (cap doubling then stepping back when requests wait)."""
    assert snap_compare(build("auto"), terminal_size=(80, 24))


def test_cap_history_screen(snap_compare):
    """`a`: every cap change with its run time, endpoint, cap and reason, newest first."""
    assert snap_compare(build("auto"), terminal_size=(100, 30), press=["a"])


def test_gateway_sessions(snap_compare):
    """A gateway's four sessions twelve seconds in: one streaming its second request (the model mapping in its
    note), one idle after its request was killed, one that gave its slot back, one waiting for a slot; the header
    says where the gateway serves and counts them."""
    assert snap_compare(build_gateway(), terminal_size=(120, 30))


def test_gateway_whose_upstream_is_down(snap_compare):
    """A gateway whose upstream's port never opened: the header and the load pane say it is down, for how long and
    why, in the error colour."""
    assert snap_compare(build_gateway(sessions=False, down=True), terminal_size=(120, 30))


def test_gateway_waiting_for_sessions_80x24(snap_compare):
    """A gateway run before its first session: where to point a harness, in the agents pane and the stream."""
    assert snap_compare(build_gateway(sessions=False), terminal_size=(80, 24))


@pytest.mark.parametrize("theme", ["cerevisor-dark", "cerevisor-light"])
@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_sessions_with_long_names_and_notes(snap_compare, theme, size):
    """Sessions named as harnesses name them (UUIDs, an opencode id) and a long kill reason: the names cut in their
    middle, no wave column (every row is a session), the note in what the other columns leave; every cell on the
    theme's own background."""
    assert snap_compare(build_gateway(long_names=True, theme=theme), terminal_size=size)
