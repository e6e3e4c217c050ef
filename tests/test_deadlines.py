"""The deadline rules (contract/deadlines.py) on explicit times: no clock, no sleep. The watchdog and the
console's mirror both decide by these, so each rule is pinned here just inside and just outside its edge."""

from __future__ import annotations

import pytest

from cerevisor_tui.contract.deadlines import Window, next_look, stream_window, warnings_due

WINDOWS = {"first_byte_s": 60.0, "idle_s": 10.0}


def test_an_attempt_is_in_its_first_byte_window_until_its_first_token() -> None:
    assert stream_window(sent_at=100.0, last_alive=100.0, first_token_at=None, by_bytes=False, **WINDOWS) == \
        Window("first_byte", 100.0, 60.0)
    # a keep-alive is no sign of life by tokens...
    assert stream_window(sent_at=100.0, last_alive=130.0, first_token_at=None, by_bytes=False, **WINDOWS).phase == \
        "first_byte"
    # ...and from the first token on, the idle window runs from the last sign of life
    assert stream_window(sent_at=100.0, last_alive=131.0, first_token_at=120.0, by_bytes=False, **WINDOWS) == \
        Window("idle", 131.0, 10.0)


def test_with_liveness_bytes_any_byte_after_the_sending_starts_the_idle_window() -> None:
    assert stream_window(sent_at=100.0, last_alive=100.0, first_token_at=None, by_bytes=True, **WINDOWS).phase == \
        "first_byte"  # nothing since the sending
    assert stream_window(sent_at=100.0, last_alive=100.001, first_token_at=None, by_bytes=True, **WINDOWS) == \
        Window("idle", 100.001, 10.0)


@pytest.mark.parametrize(("now", "due"), [(104.999, 0), (105.0, 1), (107.999, 1), (108.0, 2), (109.5, 3), (200.0, 3)])
def test_a_warning_is_due_from_its_fraction_of_the_window_on(now: float, due: int) -> None:
    assert warnings_due((0.5, 0.8, 0.95), 100.0, 10.0, now) == due


def test_an_extension_re_arms_only_the_warnings_still_ahead_of_the_new_deadline() -> None:
    # at 109 s of a 10 s window two warnings were given; extended by 10 s the window is 20 s, whose first
    # warning (0.5 of it, at 110 s) is ahead again: none is due at 109 s, and each is given again in its turn
    assert warnings_due((0.5, 0.8, 0.95), 100.0, 20.0, 109.0) == 0
    assert warnings_due((0.5, 0.8, 0.95), 100.0, 20.0, 110.0) == 1


def test_the_watcher_looks_next_at_its_next_warning_then_at_the_deadline() -> None:
    assert next_look((0.5, 0.8), 0, 100.0, 10.0) == 105.0
    assert next_look((0.5, 0.8), 1, 100.0, 10.0) == 108.0
    assert next_look((0.5, 0.8), 2, 100.0, 10.0) == 110.0
    assert next_look((), 0, 100.0, 10.0) == 110.0
