"""Where a run's control socket is and how its run is found: the socket is a Unix domain socket of mode 0600
in the run directory (or, when that path is too long for one, under a private directory in the temp dir;
`supervisor.json` in the run directory says where); the server refuses peers of another uid. What goes over
it is contract/wire.py.

Times in events are the run host's CLOCK_MONOTONIC (`time.monotonic()`): a client on the same host (every
client of a Unix socket is) compares them with its own clock, so deadlines are absolute times. The replay
is events.jsonl as it stands when the client says hello (token deltas are not journaled: each agent's
answer so far in its current attempt comes as one TokenDelta after it), then every event live. The replay
is sent as the client reads it (a long run's journal is tens of MB); the events of the meantime wait for it,
and a client that lets more of them pile up than its buffer allows is sent a bye.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

SOCKET_NAME = "control.sock"
SUPERVISOR_FILE = "supervisor.json"
LINE_LIMIT = 64 * 1024 * 1024
"""The longest line a client accepts from the run (a replayed answer can be long); the run reads its clients' lines
under supervisor/server.py COMMAND_LINE_LIMIT."""
SUN_PATH_MAX = 107  # bytes in sockaddr_un.sun_path, less the terminating NUL (Linux)


def socket_path_for(run_dir: Path, run_id: str) -> Path:
    """Where a run's socket goes: in its run directory when the path fits in a sockaddr_un, else in a
    directory of this user's (mode 0700) under the temp dir."""
    path = run_dir.resolve() / SOCKET_NAME
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        return path
    private = Path(tempfile.gettempdir()) / f"cerevisor-tui-{os.getuid()}"
    private.mkdir(mode=0o700, exist_ok=True)
    os.chmod(private, 0o700)
    return private / f"{run_id}.sock"


def read_supervisor(run_dir: Path) -> dict[str, Any]:
    """What `supervisor.json` says of the run's process and socket ({} when absent or unreadable)."""
    try:
        data = json.loads((run_dir / SUPERVISOR_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def socket_of(run_dir: Path) -> Path:
    found = read_supervisor(run_dir).get("socket")
    return Path(found) if isinstance(found, str) and found else run_dir / SOCKET_NAME
