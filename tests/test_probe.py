"""The probe: against the simulator it finds the concurrency the server saturates at; its CLI and bounds."""

from __future__ import annotations

import dataclasses

import json
import subprocess

import anyio
import pytest

from cerevisor_tui.config import SimSettings
from cerevisor_tui.endpoints.client import build_client
from cerevisor_tui.endpoints.probe import (
    EndpointUnusable,
    ProbeLevel,
    ProbeSettings,
    _knee,
    _past_knee,
    percentile,
    probe,
)
from cerevisor_tui.sim import SimServer, start_in_thread
from tests.conftest import cli_here, free_port, until

# Slow enough per stream that the simulator, not this machine's CPU, is what saturates: 100 tokens/s a
# stream, 16-token answers, so a level of 2 x N requests takes about a third of a second.
FAST = {"speed": 2.5, "tokens_per_s": 40.0, "ttft_s": 0.02}
QUICK = ProbeSettings(max_tokens=16, max_concurrency=32, max_seconds=60, level_s=0.4)


async def _probe(settings: SimSettings, probe_settings: ProbeSettings = QUICK, **kw):
    async with SimServer(settings) as srv, build_client(probe_settings.max_concurrency) as client:
        seen: list[ProbeLevel] = []
        progress: list[str] = []
        result = await probe(client, srv.base_url, settings=probe_settings, on_level=seen.append,
                             on_progress=progress.append, **kw)
        return result, seen, progress, srv.state


@pytest.mark.anyio
@pytest.mark.parametrize("k", [2, 8])
async def test_recommends_the_concurrency_the_server_saturates_at(k):
    result, seen, progress, state = await _probe(SimSettings(max_num_seqs=k, **FAST))
    # within one doubling step of K (the simulator's running count makes it exact here)
    assert k // 2 <= result.recommended_concurrency <= 2 * k, result.to_dict()
    assert result.recommended_mode == "parallel"
    assert result.stopped_because in ("queue", "knee", "ttft"), result.reason
    # it stopped one level past the knee, not at the top of the sweep
    assert [lv.concurrency for lv in result.levels] == [2**i for i in range(len(result.levels))]
    assert result.levels[-1].concurrency <= 4 * k
    assert seen == result.levels  # on_level saw every level as it completed
    assert any(line.startswith("level 1:") for line in progress)
    assert result.server_kind == "vllm" and result.model == "sim-model"
    assert result.max_model_len == 32768 and result.kv_cache_tokens == state.spec.kv_cache_tokens
    assert result.total_requests == state.requests_total
    assert result.reason and str(result.recommended_concurrency) in result.reason
    for level in result.levels:
        assert level.failed == 0 and level.output_tokens == 16 * level.requests
        assert level.ttft_p50_s is not None and level.ttft_p50_s <= level.ttft_p95_s


@pytest.mark.anyio
async def test_a_server_that_runs_one_sequence_at_a_time_is_sequential():
    result, *_ = await _probe(SimSettings(max_num_seqs=1, **FAST))
    assert result.recommended_concurrency == 1
    assert result.recommended_mode == "sequential"
    # it stops at 2, where the server queues; where a loaded host's metric looks missed the short queue, at 4
    assert len(result.levels) in (2, 3)


@pytest.mark.anyio
async def test_the_request_budget_bounds_the_sweep():
    settings = ProbeSettings(max_tokens=8, max_concurrency=64, max_requests=20)
    result, *_ = await _probe(SimSettings(max_num_seqs=64, **FAST), settings)
    assert result.total_requests <= 20
    assert result.stopped_because == "max_requests"
    assert result.recommended_concurrency == result.levels[-1].concurrency
    assert "request budget" in result.reason


@pytest.mark.anyio
async def test_the_time_budget_cuts_a_level_short():
    # 10 tokens/s: level 1's four requests take 3.2 s, the budget is 1.5 s
    settings = ProbeSettings(max_tokens=8, max_concurrency=8, max_seconds=1.5, warmup=False)
    slow = SimSettings(max_num_seqs=8, tokens_per_s=10.0, ttft_s=0.0)
    result, *_ = await _probe(slow, settings)
    assert result.elapsed_s < 4
    assert result.stopped_because == "max_seconds"
    assert result.levels and not result.levels[-1].complete and result.levels[-1].requests >= 1
    assert result.recommended_concurrency == 1


@pytest.mark.anyio
async def test_no_answer_within_the_time_budget_is_unusable():
    settings = ProbeSettings(max_tokens=8, max_concurrency=8, max_seconds=0.5, warmup=False)
    with pytest.raises(EndpointUnusable, match="no chat request completed within 0.5 s"):
        await _probe(SimSettings(tokens_per_s=1.0, ttft_s=0.0), settings)


@pytest.mark.anyio
async def test_a_model_the_server_does_not_serve_is_unusable():
    with pytest.raises(EndpointUnusable, match="not served here"):
        await _probe(SimSettings(**FAST), model="no-such-model")


@pytest.mark.anyio
async def test_a_server_that_refuses_chat_is_unusable():
    with pytest.raises(EndpointUnusable, match="chat request failed: HTTP 500"):
        await _probe(SimSettings(fail_first=100, **FAST))


@pytest.mark.anyio
async def test_an_unreachable_server_is_unusable():
    # a port on this machine is asked again for port_wait_s (a server still starting), then given up on
    settings = dataclasses.replace(QUICK, port_wait_s=0.3)
    progress: list[str] = []
    async with build_client(4) as client:
        with pytest.raises(EndpointUnusable, match=r"unreachable for \d+ s: health: .*is the server running"):
            await probe(client, f"http://127.0.0.1:{free_port()}/v1", settings=settings, on_progress=progress.append)
    assert progress and "waiting for the server to open its port" in progress[0]


@pytest.mark.anyio
async def test_a_server_on_this_machine_that_opens_its_port_late_is_waited_for():
    """`cerevisor-tui sim &` then `probe` at once (docs/servers.md), or a vLLM that opens its port once its model is
    loaded: the probe asks again each second rather than calling it unreachable."""
    port = free_port()
    progress: list[str] = []
    async with build_client(QUICK.max_concurrency) as client, anyio.create_task_group() as group:
        results = []

        async def probing() -> None:
            results.append(await probe(client, f"http://127.0.0.1:{port}/v1", settings=QUICK,
                                       on_progress=progress.append, save=False))
        group.start_soon(probing)
        await until(lambda: any("waiting for the server to open its port" in line for line in progress),
                    "the probe waiting for the port")
        async with SimServer(SimSettings(max_num_seqs=2, **FAST), port=port):
            await until(lambda: results, "the probe's result")
    assert results[0].recommended_concurrency >= 1 and results[0].levels


def _level(c: int, tps: float, *, ttft: float = 0.05, failed: int = 0, waiting_share: float | None = None,
           running: int | None = None) -> ProbeLevel:
    return ProbeLevel(concurrency=c, requests=2 * c, failed=failed, output_tokens=int(tps), wall_s=1.0,
                      output_tokens_per_s=tps, ttft_p50_s=ttft, ttft_p95_s=ttft, stream_tokens_per_s=None,
                      server_running_max=running, server_waiting_max=3 if waiting_share else 0,
                      server_waiting_share=waiting_share, first_error="HTTP 429 rate limited" if failed else "")


def test_knee_rules():
    s = ProbeSettings()
    one = _level(1, 100)
    assert _past_knee(one, None, one, s) is None
    assert _past_knee(_level(2, 190), one, one, s) is None
    # the server queues and runs fewer than were sent: its running count is the cap
    why = _past_knee(_level(8, 380, waiting_share=0.9, running=5), _level(4, 360), one, s)
    assert why is not None and why[:2] == ("queue", 5)
    # waiting on arrival while it runs everything sent is not queueing
    assert _past_knee(_level(8, 700, waiting_share=0.9, running=8), _level(4, 360), one, s) is None
    # TTFT p50 blows up, on a server without a queue gauge
    why = _past_knee(_level(4, 400, ttft=0.9), _level(2, 190), one, s)
    assert why is not None and why[0] == "ttft"
    # a server with one says when it queues: slow first tokens alone are load on the host
    assert _past_knee(_level(4, 400, ttft=0.9, waiting_share=0.0, running=4), _level(2, 190), one, s) is None
    # failures stop the sweep at the level before
    why = _past_knee(_level(4, 400, failed=2), _level(2, 190), one, s)
    assert why is not None and why[:2] == ("errors", 2) and "429" in why[2]
    # past a flat stretch, the cap is the smallest level within 15 % of the best
    cap, why = _knee([one, _level(2, 190), _level(4, 200), _level(8, 210)], s)
    assert cap == 2 and "210" in why and "4, 8" in why


@pytest.mark.anyio
async def test_without_a_queue_gauge_two_flat_levels_end_the_sweep(monkeypatch):
    """A server without /metrics (a hosted API, Ollama) is judged on throughput alone."""
    from cerevisor_tui.endpoints import probe as probe_module
    from cerevisor_tui.endpoints.metrics import ServerStatus

    async def no_metrics(client, base_url, **kw):
        return ServerStatus(base_url=base_url, reachable=True, health_status=404)

    monkeypatch.setattr(probe_module, "read_server", no_metrics)
    result, *_ = await _probe(SimSettings(max_num_seqs=2, **FAST))
    assert result.server_kind == "unknown" and result.health == "no /health (HTTP 404)"
    # two flat levels, or TTFT blowing up as requests queue unseen: either ends it
    assert result.stopped_because in ("knee", "ttft"), result.reason
    assert 1 <= result.recommended_concurrency <= 4, result.reason
    assert len(result.levels) <= 5  # two flat levels past the knee at 2, not the whole sweep
    assert all(lv.server_waiting_share is None for lv in result.levels)


def test_levels_and_percentiles():
    assert ProbeSettings(max_concurrency=64).levels() == [1, 2, 4, 8, 16, 32, 64]
    assert ProbeSettings(max_concurrency=12).levels() == [1, 2, 4, 8, 12]
    assert ProbeSettings(max_concurrency=1).levels() == [1]
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    with pytest.raises(ValueError):
        ProbeSettings(max_concurrency=0)


# ---- the command ----------------------------------------------------------------------------------

def cli(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """`cerevisor-tui ARGS` in this process (the command's own entry, its output read as a process's): a probe
    sends its requests and ends, without an interpreter's start and imports."""
    return cli_here(capsys, *args)


def isolate(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """This test's working directory and environment: where no config file is found but the test's own."""
    monkeypatch.chdir(tmp_path)
    for name, value in _isolated(tmp_path).items():
        monkeypatch.setenv(name, value)


def _isolated(tmp_path) -> dict[str, str]:
    """An environment where no config file is found."""
    return {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "CEREVISOR_TUI_CONFIG": ""}


def test_json_has_the_documented_keys(tmp_path, capsys):
    with start_in_thread(SimSettings(max_num_seqs=2, **FAST)) as srv:
        proc = cli(capsys, "probe", srv.base_url, "--json", "--max-tokens", "16", "--max-concurrency", "8",
                   "--level-seconds", "0.4")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    for key in ("server_kind", "model", "max_model_len", "kv_cache_tokens", "levels", "recommended_concurrency",
                "recommended_mode", "reason"):
        assert key in data, key
    assert data["server_kind"] == "vllm" and data["model"] == "sim-model" and data["max_model_len"] == 32768
    assert data["kv_cache_tokens"] > 0
    assert data["recommended_mode"] in ("sequential", "parallel")
    assert 1 <= data["recommended_concurrency"] <= 4
    for level in data["levels"]:
        for key in ("concurrency", "output_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "requests", "failed"):
            assert key in level, key
    assert data["bounds"]["max_requests"] == 1000 and data["bounds"]["max_seconds"] == 180
    assert "level 1:" in proc.stderr  # progress on stderr, only JSON on stdout


def test_table_and_recommendation_on_stdout(tmp_path, capsys):
    with start_in_thread(SimSettings(max_num_seqs=1, **FAST)) as srv:
        proc = cli(capsys, "probe", srv.base_url.removesuffix("/v1"), "--max-tokens", "8", "--max-concurrency", "4",
                   "--level-seconds", "0.4")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["conc", "requests"]
    assert "recommended: sequential, max_concurrency = 1" in proc.stdout
    assert "why: " in proc.stdout
    assert "probing " in proc.stderr and "/v1" in proc.stderr  # a URL without a path gets /v1


def test_default_url_is_the_first_configured_endpoint(tmp_path, capsys, monkeypatch):
    isolate(monkeypatch, tmp_path)
    with start_in_thread(SimSettings(max_num_seqs=2, **FAST)) as srv:
        (tmp_path / "cerevisor.toml").write_text(
            f'[[endpoints]]\nname = "box"\nbase_url = "{srv.base_url}"\n'
            '[[endpoints]]\nname = "other"\nbase_url = "http://127.0.0.1:1/v1"\n')
        proc = cli(capsys, "probe", "--json", "--max-tokens", "8", "--max-concurrency", "4", "--level-seconds", "0.4")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["base_url"] == srv.base_url
    assert "endpoint 'box'" in proc.stderr


def test_a_simulated_endpoint_in_the_config_is_started_and_probed(tmp_path, capsys, monkeypatch):
    isolate(monkeypatch, tmp_path)
    cfg = tmp_path / "team.toml"
    cfg.write_text('[[endpoints]]\nname = "sim"\nkind = "simulated"\n'
                   '[endpoints.sim]\nmax_num_seqs = 2\nspeed = 2.5\nttft_s = 0.02\n')
    proc = cli(capsys, "--config", str(cfg), "probe", "--json", "--max-tokens", "8", "--max-concurrency", "8",
               "--level-seconds", "0.4")
    assert proc.returncode == 0, proc.stderr
    assert 1 <= json.loads(proc.stdout)["recommended_concurrency"] <= 4


def test_usage_errors_exit_2_with_one_line(tmp_path, monkeypatch, capsys):
    from cerevisor_tui.cli import main

    isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("CEREVISOR_TEST_KEY", "sk-test")
    monkeypatch.delenv("CEREVISOR_TEST_UNSET_KEY", raising=False)

    def run(*args: str) -> str:
        assert main(["probe", *args]) == 2, args
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        return err

    assert "no URL given and no config file found" in run()
    assert "--max-concurrency must be at least 1" in run("http://127.0.0.1:9/v1", "--max-concurrency", "0")
    assert "http://" in run("127.0.0.1:8000")
    assert "CEREVISOR_TEST_UNSET_KEY" in run("http://127.0.0.1:9/v1", "--api-key-env", "CEREVISOR_TEST_UNSET_KEY")
    err = run("http://10.1.2.3:8000/v1", "--api-key-env", "CEREVISOR_TEST_KEY")
    assert "clear text" in err and "sk-test" not in err
    (tmp_path / "cerevisor.toml").write_text("[run]\nmode = 'parallel'\n")
    assert "no [[endpoints]]" in run()
    (tmp_path / "cerevisor.toml").write_text("[[endpoints]]\nname = 'x'\nbase_url = 'http://h/v1'\nbogus = 1\n")
    assert "bogus" in run()


def test_an_unusable_endpoint_exits_1_with_one_line(capsys):
    proc = cli(capsys, "probe", f"http://127.0.0.1:{free_port()}/v1", "--port-wait-seconds", "0")
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1 and "unreachable" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    waited = cli(capsys, "probe", f"http://127.0.0.1:{free_port()}/v1", "--port-wait-seconds", "0.2")
    assert waited.returncode == 1 and waited.stderr.strip().splitlines()[-1].endswith("(is the server running?)")
    assert "waiting for the server to open its port" in waited.stderr
    bad = cli(capsys, "probe", "http://127.0.0.1:9/v1", "--port-wait-seconds", "-1")
    assert bad.returncode == 2 and "--port-wait-seconds must be between 0 and 86400" in bad.stderr


@pytest.mark.anyio
async def test_the_endpoints_extra_body_goes_with_every_probe_request():
    """A probe measures what the run will send: a Qwen3 endpoint with thinking turned off is probed that way."""
    from cerevisor_tui.config import AgentConfig
    from cerevisor_tui.endpoints.probe import probe_conversations

    extra = {"top_k": 3, "chat_template_kwargs": {"enable_thinking": False}}
    settings = ProbeSettings(max_tokens=8, max_concurrency=4, max_requests=12, extra_body=extra)
    *_, state = await _probe(SimSettings(max_num_seqs=4, **FAST), settings)
    bodies = [r["body"] for r in state.requests]
    async with SimServer(SimSettings(**FAST)) as srv, build_client(4) as client:
        agents = [AgentConfig(name=f"a{i}", prompt=f"task {i}", turns=["go on"], max_tokens=8) for i in range(4)]
        await probe_conversations(client, srv.base_url, agents, settings=settings, save=False)
        bodies += [r["body"] for r in srv.state.requests]
    assert len(bodies) > 12 and all(b["top_k"] == 3 and b["chat_template_kwargs"] == {"enable_thinking": False}
                                    and b["stream"] is True for b in bodies)
