"""Who may speak on a run's control socket, on real sockets and a second uid (`nobody`, the tests run as root):
the private socket directory in the temp dir is refused when another user could have made it, and a client
trusts a server only when it runs as the same user, is the process supervisor.json names and serves the run
directory asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cerevisor_tui.supervisor.client import AttachError, ControlClient
from cerevisor_tui.supervisor.protocol import SocketDirError
from cerevisor_tui.supervisor.server import ControlServer
from tests.test_detach import cli, workflow

pytestmark = [pytest.mark.anyio,
              pytest.mark.skipif(os.getuid() != 0, reason="needs root, to act as a second uid (nobody)")]

NOBODY = 65534

IMPOSTOR = r"""
import json, os, socket, sys
path, run_dir = sys.argv[1], sys.argv[2]
os.setgid(65534)
os.setuid(65534)
server = socket.socket(socket.AF_UNIX)
server.bind(path)
os.chmod(path, 0o777)
server.listen()
print("ready", os.getpid(), flush=True)
while True:
    conn, _ = server.accept()
    fh = conn.makefile("rwb")
    print("got", fh.readline().decode().strip(), flush=True)
    fh.write(json.dumps({"type": "hello", "protocol": 2, "run_id": "r1", "run_dir": run_dir,
                         "pid": os.getpid()}).encode() + b"\n{\"type\":\"live\"}\n")
    fh.flush()
    for line in fh:
        print("got", line.decode().strip(), flush=True)
    conn.close()
"""
"""A server of uid nobody that poses as the run in RUN_DIR: it answers a hello as the run would, and prints every
line a client sends it."""


def private_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"cerevisor-tui-{os.getuid()}"


def deep_dir(tmp_path: Path) -> Path:
    """A run directory whose socket path would not fit in a sockaddr_un: its socket goes to the private dir."""
    return tmp_path / ("d" * 60) / ("e" * 60)


@pytest.mark.parametrize("made", ["by nobody", "a symlink", "open to others", "a file"])
async def test_a_socket_dir_another_user_could_have_made_is_refused(tmp_path: Path, made: str):
    private = private_dir()
    if made == "by nobody":
        private.mkdir(mode=0o777)
        os.chown(private, NOBODY, NOBODY)
        private.chmod(0o777)
        problem = f"belongs to uid {NOBODY}, not to this user"
    elif made == "a symlink":
        target = Path(tempfile.mkdtemp(prefix="elsewhere-"))
        target.chmod(0o700)
        private.symlink_to(target)
        problem = "is a symlink"
    elif made == "open to others":
        private.mkdir()
        private.chmod(0o755)
        problem = "has mode 0755, not 0700"
    else:
        private.write_text("")
        problem = "is not a directory"
    server = ControlServer(deep_dir(tmp_path), "r1", lambda command: None)
    with pytest.raises(SocketDirError, match=problem) as refused:
        await server.start()
    assert "another user could pose as the run there; remove it, or set TMPDIR" in str(refused.value)
    assert not private.is_dir() or list(private.iterdir()) == []  # no socket was made there
    assert not (deep_dir(tmp_path) / "supervisor.json").exists()


async def test_a_run_that_cannot_trust_its_socket_dir_says_so_and_does_not_detach(tmp_path: Path):
    private = private_dir()
    private.mkdir(mode=0o777)
    os.chown(private, NOBODY, NOBODY)
    wf = workflow(tmp_path)
    runs = deep_dir(tmp_path)
    wf.write_text(wf.read_text().replace(f'run_dir = "{tmp_path / "runs"}"', f'run_dir = "{runs}"'))
    proc = cli("run", str(wf), "--detach")
    assert proc.returncode == 1, proc
    log = next(runs.glob("*/run.log")).read_text()
    assert f"cannot run detached: no control socket (the socket directory {private} belongs to uid {NOBODY}" in log
    assert "Traceback" not in log and "Traceback" not in proc.stderr
    assert list(private.iterdir()) == []


def _pose_as_the_run(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """A run directory whose supervisor.json names a socket served by nobody, who answers as the run would."""
    where = Path(tempfile.mkdtemp(prefix="nobody-"))
    where.chmod(0o755)
    os.chown(where, NOBODY, NOBODY)
    path = where / "control.sock"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(json.dumps({
        "event": "RunStarted", "t": 1.0, "run_id": "r1", "mode": "parallel", "max_concurrency": 2,
        "waves": [["a0"]], "endpoints": []}) + "\n")
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, str(path), str(run_dir)], stdout=subprocess.PIPE,
                                text=True)
    ready = impostor.stdout.readline().split()
    assert ready[0] == "ready", ready
    (run_dir / "supervisor.json").write_text(json.dumps({"pid": int(ready[1]), "socket": str(path), "run_id": "r1",
                                                         "protocol": 2, "started_at": time.time()}))
    return impostor, run_dir, path


async def test_a_client_does_not_trust_a_socket_served_by_another_user(tmp_path: Path):
    impostor, run_dir, path = _pose_as_the_run(tmp_path)
    try:
        with pytest.raises(AttachError, match=f"its socket is served by a process of uid {NOBODY}, not of this user"):
            await ControlClient.connect(run_dir)
        stopped = cli("stop", str(run_dir))
        assert stopped.returncode == 1 and f"uid {NOBODY}" in stopped.stderr, stopped
        listed = cli("ls", "--json", "--runs-dir", str(tmp_path))
        assert listed.returncode == 0, listed.stderr
        (info,) = json.loads(listed.stdout)
        assert info["state"] == "crashed" and f"uid {NOBODY}" in info["problem"], info
    finally:
        impostor.kill()
        out, _ = impostor.communicate(timeout=30)
    said = [line.removeprefix("got ") for line in out.splitlines() if line.startswith("got ")]
    assert said == [], said  # not even a hello: nothing is said to another user's process
