"""A fork server for the tests' `python -m cerevisor_tui ...` processes.

The suite starts about 240 of them, and each spent ~0.5 s of CPU on its interpreter's start and the imports of
the run, the simulator and the gateway before it did anything: a third of the suite's CPU on these 2 cores. A
process started here is forked from a server that did those imports once (one per xdist worker), then runs the
command line as `python -m cerevisor_tui` would: its own pid, argv, environment, working directory, stdio and
session, its exit code or signal told back; everything after the imports is the product's own code, run for real.

`ForkPopen` is `subprocess.Popen` with one difference: an argv that is exactly `[sys.executable, "-m",
"cerevisor_tui", ...]`, with none of what a fork cannot give as an exec does (a preexec_fn other than `Limits`, a
shell, other users or groups, a umask, a process group), is started by the server; anything else as ever. Its stdio
and pass_fds go to the process at their numbers; its wait, poll and returncode come from the server, which is the
process's parent; signals go to its pid as ever. The server's processes start theirs through it too (`run --detach`'s run).

What an interpreter imports at its start is tested with `python -c` (tests/test_startup.py), which is never
forked; CEREVISOR_TEST_FORKSERVER=0 in the environment starts every process with an exec, for a run or a test.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

PRELOAD = (
    "cerevisor_tui.cli",
    "cerevisor_tui.config.models",
    "cerevisor_tui.commands.run",
    "cerevisor_tui.commands.sim",
    "cerevisor_tui.commands.gateway",
    "cerevisor_tui.commands.stop",
    "cerevisor_tui.commands.ls",
    "cerevisor_tui.engine.engine",
    "cerevisor_tui.engine.parts",
    "cerevisor_tui.engine.resume",
    "cerevisor_tui.sim",
    "cerevisor_tui.gateway.server",
    "cerevisor_tui.supervisor.server",
    "cerevisor_tui.supervisor.client",
    "cerevisor_tui.engine.run_setup",
    "cerevisor_tui.engine.sinks.printer",
    "anyio._backends._asyncio",
    "anyio.streams.memory",
    "anyio.streams.stapled",
    "anyio.streams.tls",
    "pynvml",
    "runpy",
)
"""What the server imports before it forks: what `run`, `sim`, `gateway`, `stop` and `ls` import. Nothing of the
console (Textual reads its environment as it is imported, and each test sets its own)."""

MAIN = [sys.executable, "-m", "cerevisor_tui"]
MAX_PASS_FDS = 8


@dataclass(frozen=True)
class Limits:
    """A preexec_fn that sets resource limits (`ulimit`), `(resource.RLIMIT_*, soft, hard)` each: an exec's child
    calls it as any preexec_fn; the fork server, which cannot call a function of the requester, is sent its figures
    and sets them in the process it forks, at the same point (after the fork, before the command runs)."""

    limits: tuple[tuple[int, int, int], ...]

    def __call__(self) -> None:
        for which, soft, hard in self.limits:
            resource.setrlimit(which, (soft, hard))


# ---- the server (a process of its own) ------------------------------------------------------------------------
def serve(listener: socket.socket) -> list[str]:
    """Fork a process for each request on `listener` and tell its requester its pid, then its wait status. Returns
    only in a forked process, with its argv (the caller runs it); exits when stdin (the test worker) closes."""
    selector = selectors.DefaultSelector()
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (the wakeup fd is what tells)
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    requesters: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    os._exit(0)  # the test worker is gone: its processes outlive it as they would have
            elif key.data == "child":
                try:
                    while wake_r.recv(4096):
                        pass
                except BlockingIOError:
                    pass
                _reap(requesters)
            else:
                conn, _ = listener.accept()
                job = _fork(conn, requesters, [listener, wake_r, wake_w], selector)
                if job is not None:
                    return job


def _reap(requesters: dict[int, socket.socket]) -> None:
    while requesters:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = requesters.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{status}\n".encode())
            except OSError:
                pass  # its requester is gone
            conn.close()


def _fork(conn: socket.socket, requesters: dict[int, socket.socket], own: list[socket.socket],
          selector: selectors.BaseSelector) -> list[str] | None:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3 + MAX_PASS_FDS)
    while not message.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            break
        message += more
    request = json.loads(message)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        requesters[pid] = conn
        conn.sendall(f"{pid}\n".encode())
        return None
    # the process: what an exec of `python -m cerevisor_tui` would have had
    try:
        selector.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sock in (*own, conn, *requesters.values()):  # (the others' connections are theirs)
            sock.close()
        if request["setsid"]:
            os.setsid()
        # stdio, then pass_fds at the numbers they had in the requester (moved out of their way first)
        targets = [0, 1, 2, *request["pass_fds"]]
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, max(targets) + 1) for fd in fds]
        for fd in fds:
            os.close(fd)
        for target, fd in zip(targets, moved, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        Limits(tuple(tuple(limit) for limit in request["limits"]))()  # where an exec's child calls its preexec_fn
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import tempfile

        tempfile.tempdir = None  # $TMPDIR is read again
        sys.path[0] = os.getcwd()  # as `-m` puts it
        _stdio()
        return list(request["argv"])
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(121)


def _stdio() -> None:
    """stdin, stdout and stderr for the fds the process got, as an interpreter's start makes them: stdout
    line-buffered on a terminal, else in blocks; stderr line-buffered; both unbuffered with PYTHONUNBUFFERED."""
    import io

    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    encoding = os.environ.get("PYTHONIOENCODING", "").split(":")[0] or "utf-8"
    sys.stdin = io.TextIOWrapper(io.open(0, "rb", closefd=False), encoding=encoding)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        tty = os.isatty(fd)
        raw = io.open(fd, "wb", buffering=0, closefd=False)
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=encoding,
                                  errors="backslashreplace" if fd == 2 else "strict",
                                  line_buffering=tty or fd == 2, write_through=unbuffered)
        setattr(sys, name, stream)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr


def main(listener_fd: int, path: str) -> None:
    """The server's process, its listener at `listener_fd`; a forked process returns from `serve` and runs its command
    line from here, at the top of the stack, as `python -m` does (runpy's own entry for it), so that it ends as an
    interpreter does: SystemExit's code, atexit, its threads joined, its streams flushed."""
    for name in PRELOAD:
        __import__(name)
    import gc

    gc.collect()
    gc.freeze()  # what the imports made is never collected: no process's collection touches (and copies) its pages
    # a forked process's own `python -m cerevisor_tui` (a detached run's, from `run --detach`) is forked here too
    _Server.path, _Server.inside = path, True
    subprocess.Popen = ForkPopen  # type: ignore[misc]
    job = serve(socket.socket(fileno=listener_fd))
    import runpy

    sys.argv = ["-m", *job[len(MAIN):]]
    runpy._run_module_as_main("cerevisor_tui")  # type: ignore[attr-defined]


# ---- the test worker's side ----------------------------------------------------------------------------------
TOLD_AFTER_START = {"PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE"}
"""The interpreter's variables a forked process takes from its own environment (`_stdio`; bytecode is never
written by these processes). Any other PYTHON* variable is read at an interpreter's start only: a process whose
environment has another value than the server's is started with an exec."""


def _interpreter_env(env: Any) -> dict[str, str]:
    return {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()
            if os.fsdecode(k).startswith("PYTHON") and os.fsdecode(k) not in TOLD_AFTER_START}


class _Server:
    """This worker's fork server, started at its first use."""

    lock = threading.Lock()
    process: subprocess.Popen[bytes] | None = None
    path = ""
    inside = False  # in the server, or a process it forked: the server is there
    broken = False  # it did not answer: processes start with an exec
    interpreter_env = _interpreter_env(os.environ)  # the server's: this worker's, as it started

    @classmethod
    def connect(cls) -> socket.socket:
        with cls.lock:
            if not cls.inside and (cls.process is None or cls.process.poll() is not None):
                cls._start()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(cls.path)
        return conn

    @classmethod
    def stop(cls) -> None:
        """The server ends when its stdin does (the processes it forked go on, as they would have), and is waited
        for: its CPU, and that of the processes it waited for, count as this worker's children's. Its socket's
        directory goes."""
        import shutil

        if cls.process is not None and cls.process.stdin is not None:
            cls.process.stdin.close()
            try:
                cls.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if cls.path:
            shutil.rmtree(os.path.dirname(cls.path), ignore_errors=True)
        cls.process, cls.path = None, ""

    @classmethod
    def _start(cls) -> None:
        import tempfile

        where = tempfile.mkdtemp(prefix="forks-", dir="/tmp")
        cls.path = os.path.join(where, "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(cls.path)
        listener.listen(64)
        fd = listener.fileno()
        cls.process = ORIGINAL_POPEN(
            [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import forkserver; "
             "forkserver.main(int(sys.argv[2]), sys.argv[3])", os.path.dirname(os.path.abspath(__file__)), str(fd),
             cls.path],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(fd,),
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        listener.close()


ORIGINAL_POPEN = subprocess.Popen
stop = _Server.stop


def cpu_s() -> float:
    """The CPU of this worker's server and of the processes it forked that have ended (it waits for each), in
    seconds: theirs is no longer this worker's children's (resource.RUSAGE_CHILDREN)."""
    process = _Server.process
    if process is None:
        return 0.0
    try:
        fields = open(f"/proc/{process.pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def _routed(args: Any, executable: Any, preexec_fn: Any, pass_fds: Any, shell: bool, gid: Any, gids: Any,
            uid: Any, umask: int, process_group: Any, env: Any) -> bool:
    return (isinstance(args, (list, tuple)) and list(args[:3]) == MAIN and all(isinstance(a, str) for a in args)
            and executable is None and (preexec_fn is None or isinstance(preexec_fn, Limits))
            and len(pass_fds) <= MAX_PASS_FDS and not shell
            and gid is None and gids is None and uid is None and umask < 0 and process_group in (None, -1)
            and os.environ.get("CEREVISOR_TEST_FORKSERVER", "1") != "0"
            and _interpreter_env(os.environ if env is None else env) == _Server.interpreter_env)


class ForkPopen(subprocess.Popen):  # type: ignore[type-arg]
    """subprocess.Popen, with `python -m cerevisor_tui ...` forked by the worker's server (see the module)."""

    _server_conn: socket.socket | None = None

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any, cwd: Any,
                       env: Any, startupinfo: Any, creationflags: Any, shell: Any, p2cread: int, p2cwrite: int,
                       c2pread: int, c2pwrite: int, errread: int, errwrite: int, restore_signals: Any, gid: Any,
                       gids: Any, uid: Any, umask: int, start_new_session: bool, process_group: Any) -> None:
        pid = None
        if _routed(args, executable, preexec_fn, pass_fds, shell, gid, gids, uid, umask, process_group, env):
            pid = self._fork(args, cwd, env, start_new_session, pass_fds, p2cread, c2pwrite, errwrite,
                             preexec_fn.limits if isinstance(preexec_fn, Limits) else ())
        elif os.environ.get("CEREVISOR_TEST_FORKSERVER_LOG") and list(args[:3]) == MAIN:  # what is still an exec
            with open(os.environ["CEREVISOR_TEST_FORKSERVER_LOG"], "a") as log:
                log.write(json.dumps({"argv": list(map(str, args)), "pass_fds": list(pass_fds),
                                      "preexec": preexec_fn is not None}) + "\n")
        if pid is None:
            return super()._execute_child(  # type: ignore[misc]
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
                p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                start_new_session, process_group)
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]
        self.pid = pid
        self._child_created = True

    def _fork(self, args: Any, cwd: Any, env: Any, start_new_session: bool, pass_fds: Any, p2cread: int,
              c2pwrite: int, errwrite: int, limits: tuple[tuple[int, int, int], ...]) -> int | None:
        """The pid of the process the server forked; None, its reason said once on stderr, where the server could
        not (it ended: it could not import what it preloads), and the process is started with an exec, which
        then fails on its own, with its traceback."""
        if _Server.broken:
            return None
        environment = os.environ if env is None else env
        request = {"argv": list(args), "cwd": os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd(),
                   "env": {os.fsdecode(k): os.fsdecode(v) for k, v in environment.items()},
                   "setsid": bool(start_new_session), "pass_fds": list(pass_fds), "limits": list(limits)}
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2,
               *pass_fds]
        conn: socket.socket | None = None
        try:
            conn = _Server.connect()
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
            answer = _line(conn)
        except OSError as exc:
            answer = f"{type(exc).__name__}: {exc}"
        if conn is None or not answer.isdigit():
            if conn is not None:
                conn.close()
            _Server.broken = True
            sys.stderr.write(f"tests/forkserver.py: the fork server did not answer ({answer or 'it ended'}); "
                             "processes start with an exec from here\n")
            return None
        self._server_conn = conn
        return int(answer)

    def _server_waitpid(self, pid: int, flags: int) -> tuple[int, int]:
        conn = self._server_conn
        assert conn is not None
        if flags & os.WNOHANG:
            ready, _, _ = select.select([conn], [], [], 0)
            if not ready:
                return 0, 0
        status = _line(conn)
        conn.close()
        if not status:  # the server is gone: no status to tell
            return pid, 255 << 8
        return pid, int(status)

    def _internal_poll(self, _deadstate: Any = None, **kwargs: Any) -> int | None:
        if self._server_conn is None:
            return super()._internal_poll(_deadstate, **kwargs)  # type: ignore[misc]
        return super()._internal_poll(_deadstate, _waitpid=self._server_waitpid)  # type: ignore[misc]

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if self._server_conn is None:
            return super()._try_wait(wait_flags)  # type: ignore[misc]
        return self._server_waitpid(self.pid, wait_flags)


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        more = conn.recv(64)
        if not more:
            break
        data += more
    return data.decode().strip()
