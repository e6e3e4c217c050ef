"""The attention inbox: every agent that needs the operator now (a tool call waiting for approval, killed,
failed, its endpoint down or wedged, a stall past its last warning), one item per agent, newest first.

The mirror opens and clears items as the run's events tell it; the console reads `newest_first()` and
takes `take_new()` to ring the terminal. An item rings once when it opens, and again only when the agent
moves to another kind of trouble (at most once per agent per state change)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

AttentionKind = Literal["approval", "killed", "failed", "endpoint", "stall", "wedged"]

KIND_LABELS: dict[str, str] = {
    "approval": "needs approval", "killed": "killed", "failed": "failed", "endpoint": "endpoint down",
    "stall": "stalling", "wedged": "server wedged",
}
"""How the inbox and the notifications name each kind."""

RANK: dict[str, int] = {"endpoint": 0, "stall": 1, "wedged": 2, "approval": 2, "killed": 3, "failed": 3}
"""A newer item replaces an agent's open one of the same or a lower rank only: an approval waiting is not
hidden by its endpoint's health, a wedged server not by its retried attempt's stall warnings, and the end of
an agent replaces everything before it."""

HINTS: dict[str, str] = {
    "approval": "y to answer", "killed": "r runs it again", "failed": "r runs it again",
    "endpoint": "k kills it, or wait for the endpoint", "stall": "e extends its deadline, k kills it",
    "wedged": "restart its server; it is retried meanwhile, k kills it",
}
"""What the operator can do about each kind, as the console says when it jumps to one."""


@dataclass(frozen=True, slots=True)
class AttentionItem:
    agent: str
    kind: AttentionKind
    text: str  # what it is about, one line: "time.get_current_time {...}", "no output for 600 s"
    t: float  # monotonic time it opened
    seq: int  # its place in the order items opened (newest is highest)

    @property
    def label(self) -> str:
        return KIND_LABELS[self.kind]


class Inbox:
    """The open items, one per agent; `version` changes whenever the list does."""

    def __init__(self) -> None:
        self.items: dict[str, AttentionItem] = {}
        self.version = 0
        self._seq = 0
        self._new: list[AttentionItem] = []

    def open(self, agent: str, kind: AttentionKind, text: str, t: float) -> None:
        """The agent needs the operator for `kind`; an item of the same kind stays as it was (no new ring)."""
        current = self.items.get(agent)
        if current is not None and (current.kind == kind or RANK[kind] < RANK[current.kind]):
            return
        self._seq += 1
        item = self.items[agent] = AttentionItem(agent, kind, text, t, self._seq)
        self._new.append(item)
        self.version += 1

    def clear(self, agent: str, *kinds: AttentionKind) -> None:
        """The agent no longer needs the operator for any of `kinds` (for anything, without them)."""
        current = self.items.get(agent)
        if current is not None and (not kinds or current.kind in kinds):
            del self.items[agent]
            self.version += 1

    def reset(self) -> None:
        """A (resumed) run starts: its items come with its events."""
        self.items.clear()
        self._new.clear()
        self.version += 1

    def newest_first(self) -> list[AttentionItem]:
        return sorted(self.items.values(), key=lambda item: item.seq, reverse=True)

    def take_new(self) -> list[AttentionItem]:
        """Items opened since the last call that are still open, oldest first: what to ring for."""
        new, self._new = self._new, []
        return [item for item in new if self.items.get(item.agent) is item]

    def __len__(self) -> int:
        return len(self.items)


_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f]+")
ALERT_TEXT_MAX = 200


def terminal_alert(title: str, body: str) -> str:
    """What rings the terminal for a new item: the bell (BEL), then a desktop notification as OSC 9 (iTerm2,
    WezTerm, Windows Terminal and others) and OSC 777 (urxvt, foot, Ghostty and others). Terminals ignore
    the OSCs they do not know. Control characters are taken out (they would end or break the
    sequence), and the title loses its `;`, OSC 777's field separator."""
    title = _UNSAFE.sub(" ", title).replace(";", ",")[:ALERT_TEXT_MAX]
    body = _UNSAFE.sub(" ", body)[:ALERT_TEXT_MAX]
    return f"\x07\x1b]9;{title}: {body}\x07\x1b]777;notify;{title};{body}\x07"
