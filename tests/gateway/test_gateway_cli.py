"""`cerevisor-tui gateway` through subprocesses: headless in the foreground, detached with `ls`/`stop`, and the
errors it says before anything starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.sim import start_in_thread
from tests.conftest import cli_here, free_port, wait_until
from tests.gateway.conftest import Headless


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cerevisor_tui", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_headless_serves_records_the_session_and_ends_on_sigterm_with_its_report(tmp_path: Path):
    run_dir = tmp_path / "gw"
    report = tmp_path / "gw.json"
    gw = Headless("--listen", "127.0.0.1:0", "--run-dir", str(run_dir), "--report", str(report))
    try:
        url = gw.url()
        body = {"model": "sim-model", "max_tokens": 5, "messages": [{"role": "user", "content": "hello"}]}
        r = httpx.post(url + "/chat/completions", json=body, timeout=30,
                       headers={"X-Session-ID": "nightly-1", "User-Agent": "OpenAI/Python 1.99.0"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        wait_until(lambda: any("nightly-1: request 1 done" in line for line in gw.lines), "the request's line")
    finally:
        code, err = gw.end()
    assert code == 0, err  # SIGTERM is how a service manager ends a gateway: a clean end
    assert any("session opened (openai-python 1.99.0), named by x-session-id" in line for line in gw.lines), gw.lines
    data = json.loads(report.read_text())
    assert data == json.loads((run_dir / "report.json").read_text())
    [session] = data["sessions"]
    assert (session["name"], session["source"], session["harness"], session["requests"]) == \
        ("nightly-1", "x-session-id", "openai-python 1.99.0", 1)
    assert session["completion_tokens"] == 5 and session["status"] == "ended"
    assert data["totals"]["sessions"] == 1 and data["agents"] == []
    lines = [json.loads(x) for x in (run_dir / "transcripts" / "nightly-1.jsonl").read_text().splitlines()]
    assert [(x["role"], x["content"]) for x in lines][0] == ("user", "hello")
    assert lines[-1]["role"] == "assistant" and lines[-1]["content"] == r.json()["choices"][0]["message"]["content"]


def test_detached_gateway_is_listed_and_stop_ends_it(tmp_path: Path):
    runs = tmp_path / "runs"
    config = tmp_path / "box.toml"
    port = free_port()
    with start_in_thread(SimSettings(tokens_per_s=500, ttft_s=0.0), model="served-model") as sim:
        config.write_text(f'[run]\nrun_dir = "{runs}"\n\n[[endpoints]]\nname = "box"\nbase_url = "{sim.base_url}"\n\n'
                          f'[gateway]\nlisten = "127.0.0.1:{port}"\nrelease_after_s = 5\n'
                          '[gateway.model_map]\n"claude-*" = "served-model"\n')
        started = cli("gateway", "--config", str(config), "--detach")
        assert started.returncode == 0, started.stderr
        run_id = started.stdout.split()[2]
        assert f"serving on 127.0.0.1:{port}" in started.stdout and "stop: cerevisor-tui stop " in started.stdout
        run_dir = runs / run_id
        listed = {r["run_id"]: r for r in json.loads(cli("ls", "--json", "--runs-dir", str(runs)).stdout)}
        assert listed[run_id]["state"] == "live"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/messages", timeout=30,
                       json={"model": "claude-haiku-4", "max_tokens": 4, "stream": False,
                             "messages": [{"role": "user", "content": "hi"}], "metadata": {"user_id": "u1"}})
        # the model asked for is mapped to the served one (the simulator may not speak /v1/messages: what matters
        # here is that the request was routed, not refused as an unknown model)
        assert r.status_code != 404 or "not served here" not in r.text, r.text
        table = cli("ls", "--runs-dir", str(runs)).stdout
        assert re.search(rf"{run_id}\s+live\s+1 session\b", table), table
        stopped = cli("stop", run_id, "--runs-dir", str(runs))
        assert stopped.returncode == 0, stopped.stderr
        listed = {r["run_id"]: r for r in json.loads(cli("ls", "--json", "--runs-dir", str(runs)).stdout)}
        assert listed[run_id]["state"] == "finished" and listed[run_id]["sessions"] == 1
        report = json.loads((run_dir / "report.json").read_text())
        assert [s["name"] for s in report["sessions"]] == ["u1"]


def test_gateway_says_what_is_wrong_before_it_starts(tmp_path: Path, capsys, monkeypatch):
    exposed = cli_here(capsys, "gateway", "--headless", "--listen", "0.0.0.0:8100",
                       "--run-dir", str(tmp_path / "a"))
    assert exposed.returncode == 2
    assert "gateway: listen '0.0.0.0:8100' is not loopback: set keys_env" in exposed.stderr
    assert "Traceback" not in exposed.stderr
    bad_url = cli_here(capsys, "gateway", "--headless", "--upstream", "127.0.0.1:8000",
                       "--run-dir", str(tmp_path / "b"))
    assert bad_url.returncode == 2 and "Traceback" not in bad_url.stderr
    assert "--upstream: '127.0.0.1:8000' is neither a URL (http://HOST:PORT/v1) nor an endpoint" in bad_url.stderr
    unknown = tmp_path / "c.toml"
    unknown.write_text('[[endpoints]]\nname = "box"\nbase_url = "http://127.0.0.1:9/v1"\n[gateway]\nupstream = "nope"\n')
    proc = cli_here(capsys, "gateway", "--headless", "--config", str(unknown), "--run-dir", str(tmp_path / "c"))
    assert proc.returncode == 2 and "gateway.upstream" in proc.stderr and "unknown endpoint or pool 'nope'" in proc.stderr
    missing_key = tmp_path / "d.toml"
    missing_key.write_text('[gateway]\nkeys_env = ["CEREVISOR_TEST_NO_SUCH_KEY"]\n')
    monkeypatch.delenv("CEREVISOR_TEST_NO_SUCH_KEY", raising=False)
    proc = cli_here(capsys, "gateway", "--headless", "--config", str(missing_key), "--listen", "127.0.0.1:0",
                "--run-dir", str(tmp_path / "d"))
    assert proc.returncode == 2, proc.stderr
    assert "keys_env: environment variable CEREVISOR_TEST_NO_SUCH_KEY is not set" in proc.stderr
    with socket_taken() as port:
        busy = cli_here(capsys, "gateway", "--headless", "--listen", f"127.0.0.1:{port}",
                        "--run-dir", str(tmp_path / "e"))
    assert busy.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr


def test_a_run_directory_that_holds_a_run_keeps_it(tmp_path: Path):
    from cerevisor_tui.engine.sinks.journal import RunLock

    held = tmp_path / "held"
    lock = RunLock(held).acquire()  # a live run's
    try:
        for how in (("--headless",), ("--detach",)):
            proc = cli("gateway", *how, "--listen", "127.0.0.1:0", "--run-dir", str(held))
            assert proc.returncode == 2 and "is in use by another run" in proc.stderr, proc.stderr
            assert not (held / "gateway.toml").exists() and "Traceback" not in proc.stderr
    finally:
        lock.release()
    ended = tmp_path / "ended"
    ended.mkdir()
    (ended / "events.jsonl").write_text('{"event":"RunStarted"}\n')
    (ended / "gateway.toml").write_text("# the ended run's own\n")
    proc = cli("gateway", "--headless", "--listen", "127.0.0.1:0", "--run-dir", str(ended))
    assert proc.returncode == 2 and f"run directory {ended} already holds a run" in proc.stderr, proc.stderr
    assert (ended / "gateway.toml").read_text() == "# the ended run's own\n"  # not written over


class socket_taken:
    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        return self.sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
