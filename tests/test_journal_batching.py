"""The journal gathers the lines told in one turn of the event loop and writes them at its end, one `os.write`
per file: what a crash may lose is that turn's lines, never a line already written; an fsync, the close and a
console's replay write what was gathered first."""

from __future__ import annotations

import asyncio
import os

import pytest

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.sinks.journal import Journal, iter_events
from cerevisor_tui.engine.sinks.report import Report

pytestmark = pytest.mark.anyio


def _request(agent: str, attempt: int) -> list[ev.Event]:
    """What one gateway request tells in its first turn: its status, its start, its new message."""
    return [ev.AgentStatus(1.0, agent, "prefill"),
            ev.AgentStatus(1.0, agent, "streaming"),
            ev.MessageRecorded(1.0, agent, attempt, attempt, "user", f"question {attempt}", raw={"role": "user",
                                                                                                "content": "q"})]


def _lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def journal(tmp_path):
    journal = Journal(tmp_path / "run", Report())
    journal.open()
    yield journal
    journal.close()


@pytest.fixture
def writes(monkeypatch):
    """Each os.write made, by the file it went to."""
    made: list[str] = []
    real = os.write

    def counted(fd: int, data) -> int:
        made.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd, data)

    monkeypatch.setattr(os, "write", counted)
    return made


async def test_one_turns_lines_go_in_one_write_per_file_at_its_end(journal, writes):
    events = journal.dir / "events.jsonl"
    transcript = journal.dir / "transcripts" / "s1.jsonl"
    for event in _request("s1", 1) + _request("s1", 2):
        journal(event)
    assert _lines(events) == [] and _lines(transcript) == []  # gathered while the turn goes on
    await asyncio.sleep(0)  # the turn ends: written
    assert [e.kind for _, e, _ in iter_events(journal.dir)] == ["AgentStatus", "AgentStatus", "MessageRecorded"] * 2
    assert len(_lines(transcript)) == 2
    assert sorted(writes) == sorted([str(events), str(transcript)])


async def test_an_agents_end_is_written_and_fsynced_at_once_with_what_came_before(journal, tmp_path):
    journal(ev.AgentQueued(1.0, "a", 0))
    for event in _request("a", 1):
        journal(event)
    journal(ev.AgentFinished(2.0, "a", "completed", output="done"))
    # no turn of the loop has ended: the end is on disk, after everything told before it
    kinds = [e.kind for _, e, _ in iter_events(journal.dir)]
    assert kinds == ["AgentQueued", "AgentStatus", "AgentStatus", "MessageRecorded", "AgentFinished"]
    assert len(_lines(journal.dir / "transcripts" / "a.jsonl")) == 1


async def test_what_was_gathered_is_written_by_flush_and_by_close(tmp_path):
    journal = Journal(tmp_path / "run", Report())
    journal.open()
    for event in _request("s1", 1):
        journal(event)
    journal.flush()  # (a console's replay asks for this before it reads the file)
    assert len(_lines(journal.dir / "events.jsonl")) == 3
    for event in _request("s1", 2):
        journal(event)
    journal.close()
    assert len(_lines(journal.dir / "events.jsonl")) == 6
    assert len(_lines(journal.dir / "transcripts" / "s1.jsonl")) == 2


def test_outside_an_event_loop_each_line_is_written_as_it_is_told(journal):
    journal(ev.AgentStatus(1.0, "a", "prefill"))
    assert len(_lines(journal.dir / "events.jsonl")) == 1
