"""Shared test fixtures: the anyio backend, each test's own state and temp dirs, waiting on a condition, and a
raw socket HTTP server for faults the simulator can't fake."""

from __future__ import annotations

import asyncio
import gc
import importlib
import os
import resource
import shutil
import socket
import ssl as ssl_module
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

# Every xdist worker imports every test module to collect the suite, and pytest rewrites each one's asserts (~8 s
# of CPU for the suite) unless it may keep the rewritten bytecode: where PYTHONDONTWRITEBYTECODE forbids it, each
# worker of each run did it again. The caches go to __pycache__ (git ignores them); the interpreters the tests
# start are left to the environment's choice.
sys.dont_write_bytecode = False


class LazyModule(ModuleType):
    """A module imported at its first use, not at collection: every worker collects every test module, and the
    SDKs a few tests read the simulator with (openai, anthropic) take ~2.5 s of CPU to import."""

    def __init__(self, name: str) -> None:
        super().__init__(name)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # what collection asks every module-level name (__test__, _pytestfixturefunction)
            raise AttributeError(attr)
        if _running is not None and SDK.mark not in _running.iter_markers("xdist_group"):
            raise RuntimeError(f"{_running.nodeid} reads the {self.__name__} SDK: mark it @SDK (tests/conftest.py)")
        return getattr(importlib.import_module(self.__name__), attr)


SDK = pytest.mark.xdist_group("sdk")
"""On the tests that read through the openai or anthropic SDK (a `LazyModule` above): they all run on one worker
(`--dist loadgroup`, pyproject's addopts), which imports the SDKs once; spread over six workers, each paid the ~2.5 s
of CPU again, and its first such test took it on its own clock. A test that imports one without it fails, saying so."""

_running: pytest.Item | None = None  # the test this process runs now


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    global _running
    _running = item
    try:
        yield
    finally:
        _running = None


SLOW_TEST_S = 5.0
"""A test of the fast suite takes less than this (setup, call and teardown together), unless it is marked
`end_to_end`: those few drive real processes (a detached run, tmux, a SIGKILL and a resume) on purpose. The
others are listed at the end of a run; a machine's load decides wall-clock times, so the list is a report,
never a failure."""


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """List the tests over SLOW_TEST_S that are not marked `end_to_end`, slowest first (with xdist too: the
    workers' reports carry their durations and keywords)."""
    took: dict[str, float] = {}
    named: set[str] = set()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                took[report.nodeid] = took.get(report.nodeid, 0.0) + report.duration
                if "end_to_end" in report.keywords:
                    named.add(report.nodeid)
    if CPU_REPORT:
        _cpu_summary(terminalreporter)
    slow = sorted(((s, node) for node, s in took.items() if s > SLOW_TEST_S and node not in named), reverse=True)
    if slow:
        terminalreporter.write_sep("-", f"{len(slow)} tests over {SLOW_TEST_S:g} s not marked end_to_end")
        for seconds, node in slow:
            terminalreporter.write_line(f"{seconds:6.1f} s  {node}")


CPU_REPORT = os.environ.get("CEREVISOR_TEST_CPU") == "1"
"""`CEREVISOR_TEST_CPU=1 pytest ...`: the end of the run also lists where the CPU went, per test (setup, call and
teardown together: its worker's CPU, and that of the processes it started and waited for, a `python -m
cerevisor_tui` for one) and per file, and the whole, the workers' start and collection included. On 2 cores the
suite's CPU, not its parallelism, is its floor. Report only."""


def _cpu_s() -> tuple[float, float]:
    """This process's CPU, and that of its children it has waited for (those forked for it by its fork server
    included: tests/forkserver.py), in seconds."""
    from tests import forkserver

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime + forkserver.cpu_s()


if CPU_REPORT:
    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
        item.stash[_cpu_at] = _cpu_s()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, None, None]:
        """Each phase's report carries the CPU since the last one (xdist sends user_properties along)."""
        outcome = yield
        now = _cpu_s()
        was = item.stash.get(_cpu_at, now)
        outcome.get_result().user_properties.append(("cpu_s", (now[0] - was[0], now[1] - was[1])))
        item.stash[_cpu_at] = now

    def pytest_sessionfinish(session: pytest.Session) -> None:
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: its whole CPU, its start and collection included
            workeroutput["cpu_s"] = sum(_cpu_s())

    def pytest_testnodedown(node: object, error: object) -> None:
        _workers_cpu_s.append(getattr(node, "workeroutput", {}).get("cpu_s", 0.0))

_cpu_at = pytest.StashKey[tuple[float, float]]()
_workers_cpu_s: list[float] = []


def _cpu_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The CPU report: the whole, the top 30 tests and every file, each as all (its own, its children's)."""
    per_test: dict[str, tuple[float, float]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                for key, value in report.user_properties:
                    if key == "cpu_s":
                        own, children = per_test.get(report.nodeid, (0.0, 0.0))
                        per_test[report.nodeid] = (own + value[0], children + value[1])
    per_file: dict[str, tuple[float, float]] = {}
    for node, (own, children) in per_test.items():
        path = node.split("::")[0]
        was = per_file.get(path, (0.0, 0.0))
        per_file[path] = (was[0] + own, was[1] + children)
    tests_s = sum(own + children for own, children in per_test.values())
    # the xdist workers are this process's children: each counted once, from what it said of itself
    here_s = time.process_time() if _workers_cpu_s else sum(_cpu_s())
    whole_s = here_s + sum(_workers_cpu_s)
    write = terminalreporter.write_line
    terminalreporter.write_sep("-", f"CPU: {whole_s:.0f} s in all, {tests_s:.0f} s in tests")
    write(f"this process {here_s:.1f} s, {len(_workers_cpu_s)} workers {sum(_workers_cpu_s):.1f} s; "
          f"outside tests (start, collection, this process) {whole_s - tests_s:.1f} s")
    for name, table, top in (("test", per_test, 30), ("file", per_file, None)):
        terminalreporter.write_sep("-", f"CPU by {name}: all (own, children's)")
        for (own, children), key in sorted(((v, k) for k, v in table.items()), key=lambda x: -sum(x[0]))[:top]:
            write(f"{own + children:6.1f} s ({own:5.1f}, {children:5.1f})  {key}")


def pytest_configure(config: pytest.Config) -> None:
    """Before xdist starts its workers, the bytecode they would each make for themselves is made once here: the
    test modules' assert-rewritten code (pytest's own cache files, `__pycache__/*-pytest-*.pyc`) and the package's
    (which the `python -m cerevisor_tui` processes the tests start read, and never write under
    PYTHONDONTWRITEBYTECODE). On a fresh clone every worker rewrote every test module as it collected: measured
    (2026-12-04, this 2-core box) collection took 47 s of CPU and 26.6 s against 22 s and 12.5 s with the cache
    there. A warm tree pays a stat and a header read a file."""
    if getattr(config, "workerinput", None) is not None or not config.getoption("numprocesses", None):
        return  # a worker (the controller did it), or one process: it rewrites each module once anyway
    _make_bytecode(config)


def _make_bytecode(config: pytest.Config) -> None:
    """Half the stale test modules rewritten in a forked child, half here (those the run collects: not
    tests/integration where pytest_ignore_collect skips it); then the package compiled. Anything that fails here is
    left to the workers, as without it."""
    import compileall
    import importlib.util

    from _pytest.assertion import rewrite

    def fresh(source: Path, pyc: Path) -> bool:  # the header checks of pytest's own _read_pyc, without the load
        try:
            with open(pyc, "rb") as fp:
                head = fp.read(16)
            stat = source.stat()
        except OSError:
            return False
        stamp = b"".join((n & 0xFFFFFFFF).to_bytes(4, "little") for n in (int(stat.st_mtime), stat.st_size))
        return head == importlib.util.MAGIC_NUMBER + bytes(4) + stamp

    tests = Path(__file__).resolve().parent
    skipped = tests / "integration"
    stale = []
    for source in sorted(tests.glob("**/*.py")):
        if (source.name.startswith("test_") or source.name == "conftest.py") and not (
                source.is_relative_to(skipped) and pytest_ignore_collect(skipped, config)):
            pyc = source.parent / "__pycache__" / (source.stem + rewrite.PYC_TAIL)
            if not fresh(source, pyc):
                stale.append((source, pyc))

    def write(batch: list[tuple[Path, Path]]) -> None:
        state = config.stash[rewrite.assertstate_key]
        for source, pyc in batch:
            try:
                source_stat, code = rewrite._rewrite_test(source, config)
                pyc.parent.mkdir(exist_ok=True)
                rewrite._write_pyc(state, code, source_stat, pyc)
            except Exception:  # (a syntax error, say: collection reports it)
                pass

    child = os.fork() if len(stale) > 8 else -1
    if child == 0:
        try:
            write(stale[1::2])
        finally:
            os._exit(0)
    write(stale[0::2] if child > 0 else stale)
    compileall.compile_dir(tests.parent / "cerevisor_tui", quiet=2)
    if child > 0:
        os.waitpid(child, 0)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection built (every test module, the package, Textual, the SDKs: ~90,000 objects a worker) is kept
    out of the garbage collector's scans from here on, as the console keeps its start-up's (ui/app.py _tune_gc): a
    worker's full collections scanned it all again, ~150 ms each. Measured (2026-12-03, this 2-core box): three UI
    files alone 12% less CPU (their GC 6.2 s of 27.6 without it, 4.3 s with it); the whole suite 395-399 s of CPU
    against 399-413 s, in two pairs of runs."""
    gc.collect()
    gc.freeze()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Every test in tests/integration is marked `integration`: where the run deselects exactly those (the fast
    suite's `-m 'not integration'`), their modules are not imported only to be deselected, by each worker (~3 s
    of CPU each: the SDKs, the servers' helpers)."""
    if collection_path == Path(__file__).parent / "integration" and config.getoption("markexpr") == "not integration":
        return True
    return None


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
def _forked_cli() -> Iterator[None]:
    """`python -m cerevisor_tui ...` started by a test (through subprocess) is forked from a server that has the
    package imported, not started and imported anew each time (tests/forkserver.py): ~0.5 s of CPU less each."""
    from tests import forkserver

    subprocess.Popen = forkserver.ForkPopen  # type: ignore[misc]  # (subprocess.run starts its processes with it)
    yield
    subprocess.Popen = forkserver.ORIGINAL_POPEN  # type: ignore[misc]
    forkserver.stop()


@pytest.fixture(scope="session", autouse=True)
def _one_default_ssl_context() -> None:
    """httpx (and httpx2, under the openai and anthropic SDKs) builds an SSL context for every client it makes,
    loading certifi's CA bundle: 70-180 ms of CPU each, for clients that speak plain HTTP to loopback. The tests
    make hundreds (249 in tests/gateway and the simulator's tests alone: 13 s of CPU); here each worker builds the
    default one once and every client with default TLS settings shares it, as clients may (SSLContext is made to
    be shared). A client given its own `verify` or `cert` builds its own, as before."""
    for package in ("httpx", "httpx2"):
        try:
            config = importlib.import_module(f"{package}._config")
            transports = importlib.import_module(f"{package}._transports.default")
        except ImportError:
            continue
        made: dict[tuple[Any, ...], ssl_module.SSLContext] = {}

        def shared(verify: Any = True, cert: Any = None, trust_env: bool = True,
                   _make: Callable[..., ssl_module.SSLContext] = config.create_ssl_context,
                   _made: dict[tuple[Any, ...], ssl_module.SSLContext] = made) -> ssl_module.SSLContext:
            if verify is not True or cert is not None:
                return _make(verify=verify, cert=cert, trust_env=trust_env)
            key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
            if key not in _made:
                _made[key] = _make(verify=verify, cert=cert, trust_env=trust_env)
            return _made[key]

        transports.create_ssl_context = shared


@pytest.fixture(autouse=True)
def _no_user_state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep every test (and the commands it starts) out of the real user state and config dirs: saved probe
    recommendations and run directories land in a temp dir, and no config or theme of the machine's user (or
    of a console someone runs meanwhile) is read. A test that sets its own wins."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("xdg-state")))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg-config")))
    monkeypatch.delenv("CEREVISOR_TUI_CONFIG", raising=False)


@pytest.fixture(autouse=True)
def _no_auto_warmup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """`[run] warmup = "auto"` sends one more request to every loopback endpoint before wave 1, which the tests
    written before it would count (a server's requests, its first-request faults): in a test's own engine auto
    warms nothing, unless the test is marked `warmup_auto`. `warmup = "on"` warms as ever; commands a test starts
    as processes warm as a user's do."""
    if request.node.get_closest_marker("warmup_auto") is None:
        from cerevisor_tui.engine import warmup

        monkeypatch.setattr(warmup, "is_local", lambda ep: False)


@pytest.fixture(autouse=True)
def _own_tmpdir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temp dir of the test's own, for it and the commands it starts ($TMPDIR): what lands in the shared one
    (a run's control socket, when its run dir is too long for a socket path, goes to
    $TMPDIR/cerevisor-tui-<uid>/<run_id>.sock) must not meet another test's, on another xdist worker or in
    another session on this machine. Short, under the system's temp dir, so that a socket path still fits."""
    tmp_path_factory.getbasetemp()  # pytest's own base dir stays where it is, not in here
    own = Path(tempfile.mkdtemp(prefix="ct-"))
    own.chmod(0o755)  # others may enter, as they may enter /tmp (a test's socket refuses another uid there)
    monkeypatch.setenv("TMPDIR", str(own))
    monkeypatch.setattr(tempfile, "tempdir", str(own))
    yield own
    shutil.rmtree(own, ignore_errors=True)


def _attempts(condition: Callable[[], T], what: str | Callable[[], str], timeout: float) -> Generator[None, None, T]:
    """Ask `condition` until it answers truthy (returned) or `timeout` seconds pass (AssertionError); yields
    between tries. An AssertionError from `condition` counts as not yet; the last one is chained to the timeout."""
    deadline = time.monotonic() + timeout
    last: AssertionError | None = None
    while True:
        try:
            answer = condition()
        except AssertionError as exc:
            answer, last = None, exc  # type: ignore[assignment]
        if answer:
            return answer
        if time.monotonic() >= deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g} s waiting for {said or 'the condition'}") from last
        yield


async def until(condition: Callable[[], T], what: str | Callable[[], str] = "", timeout: float = 60.0,
                interval: float = 0.01, longest_interval: float = 0.05) -> T:
    """Wait, letting the event loop run, until `condition()` is truthy; return what it answered. The one way
    tests wait for something: on a condition, never for a fixed time. `condition` may be a block of asserts
    that returns True at its end (an AssertionError is "not yet", and the last one is shown if time runs out);
    `what` (or a function that says it, asked at the timeout) names what was awaited. It asks every `interval`
    at first, then less often, up to every `longest_interval`: a condition that draws the screen, asked 100 times
    a second through a wait of seconds, took a tenth of some tests' CPU."""
    tries = _attempts(condition, what, timeout)
    try:
        while True:
            next(tries)
            await asyncio.sleep(interval)  # the one poll of async tests: the event loop runs meanwhile
            interval = min(interval * 1.25, max(interval, longest_interval))
    except StopIteration as done:
        return done.value


def wait_until(condition: Callable[[], T], what: str | Callable[[], str] = "", timeout: float = 60.0,
               interval: float = 0.05) -> T:
    """`until` for tests without an event loop (a subprocess, a server in a thread): blocks between tries."""
    tries = _attempts(condition, what, timeout)
    try:
        while True:
            next(tries)
            time.sleep(interval)  # the one poll of sync tests: what it waits for runs in another thread or process
    except StopIteration as done:
        return done.value


@pytest.fixture(autouse=True)
def _quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test's own engines retry after a fiftieth of the engine's backoff (0.01 s, 0.02 s, 0.04 s ... instead of
    0.5 s, 1 s, 2 s ..., each times 0.5 to 1.5): the tests ask whether, how often and why an agent is retried, not
    how long it waits in between (agents retry twice by default, so every failure in a test waited ~1.5 s). A
    server's retry-after is still honoured in full; commands a test starts as processes back off as a user's do."""
    from cerevisor_tui.engine import conversation

    monkeypatch.setattr(conversation, "BACKOFF_BASE_S", conversation.BACKOFF_BASE_S / 50)


@pytest.fixture(params=[False, True], ids=["in-process", "stream-process"])
def stream_process(request: pytest.FixtureRequest) -> bool:
    """Run the test both ways: the engine reading its streams itself, and through its stream worker process."""
    return request.param


def cli_here(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """The command line's own entry (`cerevisor_tui.cli.main`) run in this process, answered as `subprocess.run`
    would, without an interpreter's start and imports (~0.5 s on a quiet machine, several seconds on a loaded
    one): for a refusal, `--help`, a command that reads and answers (`ls`, `stop`, `probe`), or a run nothing
    kills, signals, limits or attaches a terminal to (a resume after a SIGKILL, a rerun). A test whose point is
    the process (a signal, a pipe, a detach, a limit of its own, a lock held against another) starts one."""
    from cerevisor_tui.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exit:  # argparse's refusal of the command line itself
        code = int(exit.code or 0)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), code, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A loopback TCP server whose handler writes whatever bytes a test wants, HTTP or not."""

    def __init__(self, handler: Handler, port: int = 0, ssl: ssl_module.SSLContext | None = None) -> None:
        self.handler = handler
        self.port = port
        self.ssl = ssl
        self.requests = 0
        self.open_connections = 0
        self._server: asyncio.base_events.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_connections += 1
        try:
            request = await read_request(reader)
            if not request.startswith(b"POST"):
                # /health, /metrics, /v1/models: not what these tests script; the engine's monitor may ask
                writer.write(http_head(404, "text/plain", length=0))
                await writer.drain()
                return
            self.requests += 1
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self.open_connections -= 1
            writer.close()

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, ssl=self.ssl)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def base_url(self) -> str:
        return f"{'https' if self.ssl else 'http'}://127.0.0.1:{self.port}/v1"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    return head + await read_body(reader, head)


async def read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    """The body of the request whose head is `head` (its Content-Length's bytes)."""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return await reader.readexactly(length) if length else b""


def http_head(status: int, ctype: str, extra: str = "", length: int | None = None) -> bytes:
    """A response head: with a content-length, or chunked (as streaming servers send) when length is None."""
    head = f"HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\n{extra}"
    head += f"content-length: {length}\r\n" if length is not None else "transfer-encoding: chunked\r\n"
    return (head + "\r\n").encode()


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk; `chunk(b"")` ends the body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def sse_chunk(content: str = "", finish: str | None = None, usage: dict | None = None) -> bytes:
    import json

    obj: dict = {"id": "x", "object": "chat.completion.chunk", "model": "m",
                 "choices": [] if usage else [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}
    if usage:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `end_to_end` tests first: they are the longest, and mostly wait (on real processes, tmux, a resume), so
    begun first they overlap the rest's CPU instead of running alone at the end (longest first, as a scheduler
    packs jobs). Otherwise collection order."""
    items.sort(key=lambda item: item.get_closest_marker("end_to_end") is None)
