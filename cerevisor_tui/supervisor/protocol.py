"""Where a run's control socket is and how its run is found: the socket is a Unix domain socket of mode 0600
in the run directory (or, when that path is too long for one, under a private directory in the temp dir;
`supervisor.json` in the run directory says where); the server refuses peers of another uid, and a client
trusts a server only when it runs as the same user, is the process supervisor.json names and serves the run
directory asked for (check_server). What goes over it is contract/wire.py.

Times in events are the run host's CLOCK_MONOTONIC (`time.monotonic()`): a client on the same host (every
client of a Unix socket is) compares them with its own clock, so deadlines are absolute times. The replay
is events.jsonl as it stands when the client says hello (token deltas are not journaled: each agent's
answer so far in its current attempt comes as one TokenDelta after it, then the run's totals the journal cannot
give back as one RunTally), then every event live. The replay
is sent as the client reads it (a long run's journal is tens of MB); the events of the meantime wait for it,
and a client that lets more of them pile up than its buffer allows is sent a bye.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import stat
import struct
import tempfile
from pathlib import Path
from typing import Annotated, Any

import msgspec

from cerevisor_tui.contract.commands import plain
from cerevisor_tui.contract.wire import Welcome
from cerevisor_tui.text import printable

SOCKET_NAME = "control.sock"
SUPERVISOR_FILE = "supervisor.json"
LINE_LIMIT = 64 * 1024 * 1024
"""The longest line a client accepts from the run (a replayed answer can be long); the run reads its clients' lines
under supervisor/server.py COMMAND_LINE_LIMIT."""
SUN_PATH_MAX = 107  # bytes in sockaddr_un.sun_path, less the terminating NUL (Linux)
WALL_MAX = 1e11
"""The latest wall-clock time (seconds since the epoch, year 5138) a run file may say: past it, not a time."""


class SocketDirError(OSError):
    """The private socket directory in the temp dir cannot be trusted: one line says why and what to do."""


class SupervisorFile(msgspec.Struct, frozen=True):
    """supervisor.json: the run's process and socket, as the run writes them at its start; checked as it is read."""

    pid: Annotated[int, msgspec.Meta(gt=0, lt=2**31)]
    socket: Annotated[str, msgspec.Meta(min_length=1, max_length=4096, pattern="^[^\x00]*$")]
    run_id: str = ""
    protocol: int = 0
    config: str = ""
    started_at: Annotated[float, msgspec.Meta(ge=0, le=WALL_MAX)] = 0.0
    """The run's first start (a resumed run keeps its original one)."""
    resumed_at: Annotated[float, msgspec.Meta(ge=0, le=WALL_MAX)] = 0.0
    """When this process took the run up again (0: it is the run's first)."""
    by: Annotated[str, msgspec.Meta(max_length=200)] = ""
    """Who started it, as `started_by` says: on a shared account, what tells one person's runs from another's."""


def started_by() -> str:
    """Who starts a run, for `stop` and `attach` to name it by: the user and, over SSH, the address they came from
    (`alice from 10.0.0.5`): on an account several people share, the user alone does not tell them apart."""
    import pwd

    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = f"uid {os.getuid()}"
    came_from = (os.environ.get("SSH_CONNECTION") or os.environ.get("SSH_CLIENT") or "").split()[:1]
    return printable(f"{user} from {came_from[0]}" if came_from else user)[:200]


_supervisor_decoder = msgspec.json.Decoder(SupervisorFile)


def private_socket_dir() -> Path:
    """This user's directory for sockets in the temp dir (`cerevisor-tui-<uid>`), made mode 0700. One that is
    there already is used only when it is a directory, not a symlink, owned by this user and of mode 0700:
    another user who made it first could replace the run's socket with one of theirs. Raises SocketDirError."""
    private = Path(tempfile.gettempdir()) / f"cerevisor-tui-{os.getuid()}"
    try:
        os.mkdir(private, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise SocketDirError(f"cannot make the socket directory {private}: {exc.strerror or exc}") from None
    else:
        os.chmod(private, 0o700)  # whatever the umask left
    try:
        found = os.lstat(private)
    except OSError as exc:
        raise SocketDirError(f"cannot check the socket directory {private}: {exc.strerror or exc}") from None
    problem = ""
    if stat.S_ISLNK(found.st_mode):
        problem = "is a symlink"
    elif not stat.S_ISDIR(found.st_mode):
        problem = "is not a directory"
    elif found.st_uid != os.getuid():
        problem = f"belongs to uid {found.st_uid}, not to this user (uid {os.getuid()})"
    elif stat.S_IMODE(found.st_mode) & 0o077:
        problem = f"has mode {stat.S_IMODE(found.st_mode):04o}, not 0700"
    if problem:
        raise SocketDirError(
            f"the socket directory {private} {problem}: another user could pose as the run there; "
            "remove it, or set TMPDIR to a directory of your own"
        )
    return private


def socket_path_for(run_dir: Path, run_id: str) -> Path:
    """Where a run's socket goes: in its run directory when the path fits in a sockaddr_un, else in this user's
    private directory in the temp dir (private_socket_dir), named by the run and its directory (a copy of a run
    directory, resumed, has the run's id too). Raises SocketDirError."""
    path = run_dir.resolve() / SOCKET_NAME
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        return path
    where = hashlib.sha256(os.fsencode(run_dir.resolve())).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id[:40])  # a --run-id is the user's: no "/" into the path
    return private_socket_dir() / f"{name}-{where}.sock"


def read_supervisor(run_dir: Path) -> dict[str, Any]:
    """What `supervisor.json` says, as it is ({} when absent or unreadable); `supervisor_file` checks it."""
    try:
        data = json.loads((run_dir / SUPERVISOR_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def supervisor_file(run_dir: Path) -> SupervisorFile | None:
    """`supervisor.json`, checked; None when there is none. Raises ValueError saying why one does not check."""
    try:
        raw = (run_dir / SUPERVISOR_FILE).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"{SUPERVISOR_FILE}: {exc.strerror or exc}") from None
    try:
        return _supervisor_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{SUPERVISOR_FILE}: {plain(str(exc))}") from None


def socket_of(run_dir: Path) -> Path:
    """The socket supervisor.json names, else the run directory's own (also when supervisor.json does not check)."""
    try:
        found = supervisor_file(run_dir)
    except ValueError:
        found = None
    return Path(found.socket) if found is not None else run_dir / SOCKET_NAME


def peer_credentials(sock: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end of a Unix socket (SO_PEERCRED), None where not known."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def check_user(sock: socket.socket | None) -> str:
    """Why the process serving `sock` is not to be spoken to ("" when it runs as this user)."""
    creds = peer_credentials(sock) if sock is not None else None
    if creds is None:
        return "cannot tell which process serves its socket"
    if creds[1] != os.getuid():
        return f"its socket is served by a process of uid {creds[1]}, not of this user (uid {os.getuid()})"
    return ""


def check_server(run_dir: Path, sock: socket.socket | None, hello: Welcome) -> str:
    """Why the server that said `hello` on `sock` is not the run in `run_dir` ("" when it is): it must run as
    this user (check_user, also asked before the hello is sent), be the process supervisor.json names, and
    serve this very directory (a copy of a live run directory names the original's socket)."""
    problem = check_user(sock)
    if problem or sock is None:
        return problem
    pid = peer_credentials(sock)[0]  # type: ignore[index]
    try:
        named = supervisor_file(run_dir)
    except ValueError as exc:
        return str(exc)
    if named is None or named.pid != pid or hello.pid != pid:
        return (
            f"its socket is served by process {pid}, not by the run's process "
            f"({named.pid if named is not None else 'none named in ' + SUPERVISOR_FILE})"
        )
    try:
        same = os.path.samefile(hello.run_dir, run_dir)
    except (OSError, ValueError):
        same = False
    if not same:
        return f"its socket is the socket of the run in {hello.run_dir} (is this directory a copy of it?)"
    return ""
