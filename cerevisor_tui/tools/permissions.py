"""Who may call what: a server's `allow`, `ask` and `deny` tool-name globs, deny over ask over allow, and a
tool in none of them asks; "for the run" approvals given on the way."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Literal

from cerevisor_tui.config.models import McpServerConfig

Rule = Literal["allow", "ask", "deny"]


def rule_for(server: McpServerConfig, tool: str) -> Rule:
    """What the server's rules say of `tool`: deny wins over ask, ask over allow; unlisted asks."""
    if any(fnmatchcase(tool, glob) for glob in server.deny):
        return "deny"
    if any(fnmatchcase(tool, glob) for glob in server.ask):
        return "ask"
    if any(fnmatchcase(tool, glob) for glob in server.allow):
        return "allow"
    return "ask"


class Approvals:
    """The tools the operator approved for the rest of the run (kept by --resume, from the journal)."""

    def __init__(self, approved: set[tuple[str, str]] | None = None) -> None:
        self.for_run: set[tuple[str, str]] = set(approved or ())

    def approved(self, server: str, tool: str) -> bool:
        return (server, tool) in self.for_run

    def approve_for_run(self, server: str, tool: str) -> None:
        self.for_run.add((server, tool))
