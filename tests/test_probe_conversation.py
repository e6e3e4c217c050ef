"""The conversation-shaped probe: against a simulator with a small KV cache it recommends the cap at which
multi-turn agents keep their prefixes cached, below the single-turn probe's; its pure judges on hand-made
levels; the saved recommendations; and the --workflow command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cerevisor_tui.config import AgentConfig, SimSettings
from cerevisor_tui.config.paths import probe_store_file
from cerevisor_tui.endpoints.client import build_client
from cerevisor_tui.endpoints.probe import (
    ProbeLevel,
    ProbeSettings,
    judge_conversations,
    judge_single_turn,
    probe,
    probe_conversations,
    recommend_conversations,
    shapes_from_agents,
)
from cerevisor_tui.endpoints.probe_store import MAX_ENTRIES, save_recommendation, saved_recommendation
from cerevisor_tui.sim import SimServer, start_in_thread

# The measured real-vLLM case, scaled: a 4,096-token KV cache, 4 sequences at once; agents of three
# ~550-token turns. Two conversations fit in the cache; four do not, so each evicts the others' prefixes.
SMALL_KV = SimSettings(kv_cache_tokens=4096, block_size=16, max_num_seqs=4, speed=20.0, tokens_per_s=40.0,
                       ttft_s=0.02)
QUICK = ProbeSettings(max_tokens=64, max_concurrency=16, max_seconds=60, level_s=0.4)


def _text(tokens: int, tag: str) -> str:
    """About `tokens` tokens as the simulator counts them (4 characters each)."""
    return (f"{tag}: " + "read the file, plan the next step, then check the result. " * 80)[: tokens * 4]


def _agents(n: int = 12, max_tokens: int = 64) -> list[AgentConfig]:
    return [AgentConfig(name=f"a{i}", system=_text(250, f"system {i}"), prompt=_text(300, f"task {i}"),
                        turns=[_text(550, f"follow-up {i}"), _text(550, f"last {i}")], max_tokens=max_tokens)
            for i in range(n)]


@pytest.mark.anyio
async def test_conversations_recommend_a_lower_cap_than_single_requests_where_prefixes_survive():
    started = time.monotonic()
    async with SimServer(SMALL_KV) as srv, build_client(16) as client:
        single = await probe(client, srv.base_url, settings=QUICK, save=False)
    agents = _agents(max_tokens=32)  # short answers: the turns' prompts are what fills the cache
    async with SimServer(SMALL_KV) as srv, build_client(16) as client:
        seen: list[ProbeLevel] = []
        result = await probe_conversations(client, srv.base_url, agents, settings=QUICK, on_level=seen.append)
        bodies = list(srv.state.requests)
    # single requests fit 4 at once (a busy host may keep the server from seeing all 4 at once)
    assert single.mode == "single-turn" and single.recommended_concurrency in (3, 4), single.reason

    assert result.mode == "conversation" and result.agents == 12 and seen == result.levels
    cap = result.recommended_concurrency
    assert cap < single.recommended_concurrency, result.to_dict()
    assert cap == 2 and result.recommended_mode == "parallel"
    by_c = {lv.concurrency: lv for lv in result.levels}
    kept = by_c[cap].prefix_hit_rate
    higher = [lv.prefix_hit_rate for lv in result.levels if lv.concurrency > cap]
    assert kept is not None and kept > 0.4 and higher, result.to_dict()
    assert all(h is not None and h < kept - 0.2 for h in higher), result.to_dict()
    assert f"cap {cap}: prefix hits {kept:.0%}" in result.reason
    for level in result.levels:
        assert level.conversations == max(4, level.concurrency)
        assert level.requests == 3 * level.conversations and level.failed == 0
        assert level.output_tokens == 32 * level.requests and level.preemptions is not None

    # each turn resends the conversation so far, the answers included; every conversation is its own text
    chats = [b["messages"] for b in bodies if b["messages"][0]["role"] == "system"]
    assert len(chats) == sum(lv.requests for lv in result.levels)
    third = [m for m in chats if len(m) == 6]
    assert third and all([x["role"] for x in m] == ["system", "user", "assistant", "user", "assistant", "user"]
                         for m in third)
    assert all(m[2]["content"] and m[4]["content"] for m in third)
    openings = {m[0]["content"] for m in chats if len(m) == 2}
    assert len(openings) == sum(lv.conversations or 0 for lv in result.levels)
    assert all(len(o) == len(agents[0].system) and o.startswith("[cerevisor probe ") for o in openings)

    # remembered for the next run on this server and model
    saved = saved_recommendation(srv.base_url, "sim-model")
    assert saved is not None and saved["cap"] == cap and saved["mode"] == "conversation"
    assert saved["reason"] == result.reason
    assert time.monotonic() - started < 20


@pytest.mark.anyio
async def test_no_agents_is_the_single_turn_probe_and_outputs_stand_in_for_dependencies():
    async with SimServer(SimSettings(max_num_seqs=2, speed=20.0, ttft_s=0.02)) as srv, build_client(4) as client:
        result = await probe_conversations(client, srv.base_url, [], settings=ProbeSettings(
            max_tokens=8, max_concurrency=4, level_s=0.2))
    assert result.mode == "single-turn" and result.levels[0].conversations is None
    saved = saved_recommendation(srv.base_url, None)  # a single-turn probe is remembered too
    assert saved is not None and (saved["cap"], saved["mode"]) == (result.recommended_concurrency, "single-turn")
    shapes = shapes_from_agents([AgentConfig(name="a", prompt="x", max_tokens=50),
                                 AgentConfig(name="b", prompt="Review: {{ a.output }}", depends_on=["a"],
                                             turns=["And {{a.output}}?"])])
    assert "{{" not in shapes[1].prompt and len(shapes[1].prompt) == len("Review: ") + 200
    assert len(shapes[1].turns[0]) == len("And ?") + 200 and shapes[1].requests == 2


# ---- the judges, on hand-made levels ----------------------------------------------------------------

def _level(c: int, tps: float, hits: float | None, *, failed: int = 0, ttft: float = 0.05,
           waiting_share: float | None = 0.0, running: int | None = None, complete: bool = True) -> ProbeLevel:
    return ProbeLevel(concurrency=c, requests=12, failed=failed, output_tokens=int(tps), wall_s=1.0,
                      output_tokens_per_s=tps, ttft_p50_s=ttft, ttft_p95_s=ttft, stream_tokens_per_s=None,
                      server_running_max=c if running is None else running, server_waiting_max=0,
                      server_waiting_share=waiting_share, complete=complete, prefix_hit_rate=hits, preemptions=0,
                      conversations=max(4, c), first_error="HTTP 500 boom" if failed else "")


S = ProbeSettings()


def test_the_cap_is_the_highest_level_whose_prefix_hits_and_throughput_both_hold():
    levels = [_level(1, 100, 0.59), _level(2, 190, 0.59), _level(4, 200, 0.0), _level(8, 205, 0.0)]
    cap, why = recommend_conversations(levels, S)
    assert cap == 2
    assert why.startswith("cap 2: prefix hits 59% (0% at 4, 0% at 8), throughput 93% of the best (205 tokens/s at 8)")
    assert "at 4 each agent's prefix is evicted before its next turn" in why
    # a small slip in hits is no loss: within 15 points of the best level's
    cap, _ = recommend_conversations([_level(1, 100, 0.60), _level(2, 190, 0.50), _level(4, 380, 0.47)], S)
    assert cap == 4


def test_when_throughput_needs_lost_prefixes_prefixes_win_and_the_reason_says_the_cost():
    cap, why = recommend_conversations([_level(1, 100, 0.59), _level(2, 190, 0.59), _level(4, 400, 0.05)], S)
    assert cap == 2
    assert "throughput 48% of the best (400 tokens/s at 4)" in why and "evicted before its next turn" in why


def test_throughput_collapse_failures_and_queueing_are_not_candidates():
    # hits hold everywhere, but throughput collapses past 2 (the server thrashes)
    cap, why = recommend_conversations([_level(1, 100, 0.5), _level(2, 190, 0.5), _level(4, 60, 0.5)], S)
    assert cap == 2 and why.endswith("; 4 at once gave 60 tokens/s")
    # a level with failed requests is measured, not recommended
    cap, why = recommend_conversations([_level(1, 100, 0.5), _level(2, 190, 0.5), _level(4, 300, 0.5, failed=2)], S)
    assert cap == 2 and "at 4 at once 2 of 12 requests failed (HTTP 500 boom)" in why
    # the server ran only 4 of 8 at once and queued the rest
    cap, why = recommend_conversations([_level(4, 300, 0.5), _level(8, 330, 0.5, waiting_share=0.9, running=4)], S)
    assert cap == 4 and "at 8 the server queued requests, running at most 4 at once" in why


def test_without_prefix_metrics_it_judges_throughput_and_ttft_and_says_hits_were_not_reported():
    cap, why = recommend_conversations([_level(1, 100, None), _level(2, 190, None), _level(4, 200, None)], S)
    assert cap == 2 and "reports no prefix-cache hits" in why
    # TTFT p50 blowing up marks a level as past the knee
    levels = [_level(1, 100, None, waiting_share=None), _level(2, 190, None, waiting_share=None),
              _level(4, 400, None, ttft=2.0, waiting_share=None)]
    cap, _ = recommend_conversations(levels, S)
    assert cap == 2
    verdict = judge_conversations(levels, S)
    assert verdict is not None and verdict.stopped_because == "ttft" and verdict.concurrency == 2


def test_conversation_sweep_stops_when_prefixes_are_lost_and_throughput_does_not_pay_for_it():
    one, two = _level(1, 100, 0.59), _level(2, 190, 0.59)
    assert judge_conversations([one], S) is None
    assert judge_conversations([one, two], S) is None
    # hits fall at 4 but throughput jumps: look one level further
    assert judge_conversations([one, two, _level(4, 300, 0.1)], S) is None
    verdict = judge_conversations([one, two, _level(4, 300, 0.1), _level(8, 320, 0.0)], S)
    assert verdict is not None and verdict.stopped_because == "prefix" and verdict.concurrency == 2
    verdict = judge_conversations([one, two, _level(4, 200, 0.1)], S)
    assert verdict is not None and verdict.stopped_because == "prefix" and verdict.mode == "parallel"
    verdict = judge_conversations([one, two, _level(4, 300, 0.6, failed=1)], S)
    assert verdict is not None and verdict.stopped_because == "errors" and verdict.concurrency == 2
    verdict = judge_conversations([one, two, _level(4, 300, 0.6, waiting_share=0.8, running=3)], S)
    assert verdict is not None and verdict.stopped_because == "queue" and verdict.concurrency == 2
    # the budget ends it at a level that still kept everything: the server may carry more
    verdict = judge_conversations([one, two], S, ended="max_seconds")
    assert verdict is not None and verdict.concurrency == 2 and "may carry more" in verdict.reason
    verdict = judge_conversations([], S, ended="max_requests")
    assert verdict is not None and verdict.concurrency == 1 and verdict.mode == "sequential"


def test_single_turn_judge_keeps_its_rules():
    flat = [_level(1, 100, None, waiting_share=None), _level(2, 190, None, waiting_share=None),
            _level(4, 200, None, waiting_share=None)]
    assert judge_single_turn(flat, S) is None  # one flat level is not yet a knee
    verdict = judge_single_turn([*flat, _level(8, 205, None, waiting_share=None)], S)
    assert verdict is not None and verdict.stopped_because == "knee" and verdict.concurrency == 2
    verdict = judge_single_turn([_level(1, 100, None), _level(2, 190, None)], S, ended="max_concurrency")
    assert verdict is not None and verdict.concurrency == 2 and "may carry more" in verdict.reason


# ---- saved recommendations ----------------------------------------------------------------------------

def test_saved_recommendations_by_url_and_model_newest_kept_and_never_raising():
    path = probe_store_file()
    assert str(path).startswith(os.environ["XDG_STATE_HOME"])  # tests/conftest.py: never the real state dir
    assert saved_recommendation("http://box:8000/v1", "m") is None  # no file yet
    save_recommendation("http://box:8000/v1/", "m", 2, "conversation", "cap 2: prefix hits 59%")
    save_recommendation("http://box:8000/v1", "other", 8, "single-turn", "knee")
    got = saved_recommendation("http://box:8000/v1", "m")
    assert got is not None and {k: got[k] for k in ("cap", "mode", "reason")} == {
        "cap": 2, "mode": "conversation", "reason": "cap 2: prefix hits 59%"}
    assert got["saved_at"].endswith("+00:00")
    assert saved_recommendation("http://box:8000/v1", "missing") is None
    any_model = saved_recommendation("http://box:8000/v1/", None)
    assert any_model is not None and any_model["cap"] in (2, 8)
    save_recommendation("http://box:8000/v1", "m", 3, "conversation", "again")  # replaces, not appends
    assert saved_recommendation("http://box:8000/v1", "m")["cap"] == 3  # type: ignore[index]

    for i in range(MAX_ENTRIES + 5):
        save_recommendation(f"http://host{i}:8000/v1", "m", 1, "single-turn", "")
    kept = json.loads(path.read_text())["probes"]
    assert len(kept) == MAX_ENTRIES and "http://host54:8000/v1 m" in kept
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]

    for broken in ("{not json", "[]", '{"probes": [1, 2]}', '{"probes": {"http://box:8000/v1 m": {"cap": "2"}}}'):
        path.write_text(broken)
        assert saved_recommendation("http://box:8000/v1", "m") is None
    path.unlink()
    path.mkdir()  # not even a file
    assert saved_recommendation("http://box:8000/v1", "m") is None


# ---- the command ----------------------------------------------------------------------------------------

def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cerevisor_tui", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def _workflow(path: Path, endpoint: str, agents: int = 2) -> Path:
    lines = [endpoint]
    for i in range(agents):
        lines.append(f'[[agents]]\nname = "a{i}"\nsystem = "{_text(100, f"system {i}")}"\n'
                     f'prompt = "{_text(100, f"task {i}")}"\nturns = ["Go on.", "Finish."]\nmax_tokens = 32\n')
    path.write_text("\n".join(lines))
    return path


def test_workflow_json_has_the_mode_and_prefix_hits(tmp_path):
    state = tmp_path / "state"
    sim = ('[[endpoints]]\nname = "sim"\nkind = "simulated"\n'
           '[endpoints.sim]\nmax_num_seqs = 2\nspeed = 20.0\nttft_s = 0.02\n')
    proc = _cli("probe", "--workflow", str(_workflow(tmp_path / "wf.toml", sim)), "--json", "--max-concurrency", "4",
                env={"XDG_STATE_HOME": str(state)})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["mode"] == "conversation" and data["agents"] == 2 and data["prefix_hits_reported"] is True
    assert all(lv["prefix_hit_rate"] is not None and lv["conversations"] == max(4, lv["concurrency"])
               for lv in data["levels"])
    assert 1 <= data["recommended_concurrency"] <= 2 and "prefix hits" in data["reason"]
    assert "endpoint 'sim', 2 agents of" in proc.stderr and "level 1: 4 conversations" in proc.stderr
    assert not (state / "cerevisor-tui" / "probes.json").exists()  # a simulator started here is not remembered


def test_workflow_table_has_a_prefix_column_and_a_url_probed_is_remembered(tmp_path):
    state = tmp_path / "state"
    with start_in_thread(SimSettings(max_num_seqs=2, speed=20.0, ttft_s=0.02)) as srv:
        other = '[[endpoints]]\nname = "box"\nbase_url = "http://127.0.0.1:9/v1"\n'
        proc = _cli("probe", srv.base_url, "--workflow", str(_workflow(tmp_path / "wf2.toml", other, agents=1)),
                    "--max-concurrency", "2", "--max-tokens", "8", env={"XDG_STATE_HOME": str(state)})
    assert proc.returncode == 0, proc.stderr
    head = proc.stdout.splitlines()[0].split()
    assert head[:2] == ["conc", "requests"] and head[-4:] == ["convs", "prefix", "hits", "preempt"]
    assert "conversations shaped like the workflow's 1 agent" in proc.stdout
    stored = json.loads((state / "cerevisor-tui" / "probes.json").read_text())["probes"]
    assert list(stored) == [f"{srv.base_url} sim-model"] and stored[f"{srv.base_url} sim-model"]["mode"] == "conversation"


def test_bad_workflows_exit_2_with_one_line(tmp_path, monkeypatch, capsys):
    from cerevisor_tui.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.delenv("CEREVISOR_TUI_CONFIG", raising=False)

    def run(*args: str) -> str:
        assert main(["probe", *args]) == 2, args
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        return err

    assert "missing.toml: file not found" in run("--workflow", str(tmp_path / "missing.toml"))
    (tmp_path / "bad.toml").write_text("[[agents]\nname = 'x'\n")
    assert "bad.toml: invalid TOML" in run("--workflow", str(tmp_path / "bad.toml"))
    (tmp_path / "none.toml").write_text('[[endpoints]]\nname = "box"\nbase_url = "http://127.0.0.1:9/v1"\n')
    assert "none.toml: agents: no [[agents]]" in run("--workflow", str(tmp_path / "none.toml"))
    (tmp_path / "typo.toml").write_text('[[endpoints]]\nname = "box"\nbase_url = "http://h/v1"\n'
                                        '[[agents]]\nname = "a"\nprompt = "p"\nturnz = ["x"]\n')
    assert "turnz" in run("--workflow", str(tmp_path / "typo.toml"), "http://127.0.0.1:9/v1")
    wf = _workflow(tmp_path / "ok.toml", '[[endpoints]]\nname = "box"\nbase_url = "http://127.0.0.1:9/v1"\n', 1)
    assert "--max-tokens must be at least 1" in run("--workflow", str(wf), "--max-tokens", "0")


def test_without_url_the_workflow_probes_the_endpoint_most_of_its_agents_use(tmp_path):
    from cerevisor_tui.cli import build_parser
    from cerevisor_tui.commands.probe import _target

    wf = tmp_path / "wf.toml"
    wf.write_text('[[endpoints]]\nname = "a"\nbase_url = "http://127.0.0.1:9/v1"\n'
                  '[[endpoints]]\nname = "b"\nbase_url = "http://127.0.0.1:10/v1"\nmodel = "m"\n'
                  '[[agents]]\nname = "x"\nprompt = "p"\n'  # no endpoint: the first, "a"
                  '[[agents]]\nname = "y"\nendpoint = "b"\nprompt = "p"\n'
                  '[[agents]]\nname = "z"\nendpoint = "b"\nprompt = "p"\n')
    target = _target(build_parser().parse_args(["probe", "--workflow", str(wf)]))
    assert (target.base_url, target.model) == ("http://127.0.0.1:10/v1", "m")
    assert [a.name for a in target.agents] == ["y", "z"] and "endpoint 'b', 2 agents of" in target.label
    assert target.note.startswith("1 agent on other endpoints left out")
    target = _target(build_parser().parse_args(["probe", "http://127.0.0.1:11/v1", "--workflow", str(wf)]))
    assert target.base_url == "http://127.0.0.1:11/v1" and [a.name for a in target.agents] == ["x", "y", "z"]
    assert not target.note
