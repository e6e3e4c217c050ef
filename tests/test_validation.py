"""Validation catches at load what would crash later: graphs of any depth and order, agent names that
cannot be file names, ports out of range, URLs that name no server, infinities and absurd sizes. Always
one line on stderr and exit 2; never a traceback."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from cerevisor_tui.cli import main as cli_main
from cerevisor_tui.config import AgentConfig, ConfigError, validate
from cerevisor_tui.config.graph import wave_levels


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cerevisor_tui", *args], capture_output=True, text=True, timeout=timeout)


def one_line_exit_2(proc_or_code, err: str | None = None) -> str:
    if isinstance(proc_or_code, subprocess.CompletedProcess):
        code, err = proc_or_code.returncode, proc_or_code.stderr
    else:
        code = proc_or_code
    assert code == 2, err
    assert err is not None and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def chain_toml(n: int, *, url: str = "http://127.0.0.1:9/v1", extra_ep: str = "", cycle: bool = False) -> str:
    """A chain a0 <- a1 <- ... listed dependents-first (the order that recursed deepest)."""
    lines = [f'[[endpoints]]\nname = "e"\nbase_url = "{url}"\nkind = "hosted"\nmodel = "m"\n{extra_ep}']
    for i in reversed(range(n)):
        deps = [f"a{i - 1}"] if i else ([f"a{n - 1}"] if cycle else [])
        lines.append(f'[[agents]]\nname = "a{i}"\nprompt = "p"\ndepends_on = {json.dumps(deps)}\n')
    return "\n".join(lines)


# ---- graphs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["dependents-first", "shuffled", "in-order"])
def test_a_chain_of_any_depth_and_order_gets_its_waves(order):
    agents = [AgentConfig(name=f"a{i}", prompt="p", depends_on=[f"a{i - 1}"] if i else []) for i in range(20_000)]
    if order == "dependents-first":
        agents.reverse()
    elif order == "shuffled":
        random.Random(1).shuffle(agents)
    levels = wave_levels(agents)
    assert len(levels) == 20_000 and [level[0].name for level in levels[:3]] == ["a0", "a1", "a2"]


def test_a_deep_cycle_is_named_not_a_recursion_error():
    agents = [AgentConfig(name=f"a{i}", prompt="p", depends_on=[f"a{(i - 1) % 5000}"]) for i in range(5000)]
    with pytest.raises(ConfigError, match="depends_on has a cycle: a"):
        wave_levels(agents[::-1])


def test_a_wide_and_deep_graph_keeps_each_agent_at_its_longest_path():
    # d needs b and c; c needs b; b needs a: d is in wave 3 whatever the listing order
    spec = {"a": [], "b": ["a"], "c": ["b"], "d": ["b", "c"]}
    for order in (list(spec), list(reversed(spec))):
        levels = wave_levels([AgentConfig(name=n, prompt="p", depends_on=spec[n]) for n in order])
        assert [[a.name for a in level] for level in levels] == [["a"], ["b"], ["c"], ["d"]]


def test_a_deep_chain_loads_through_the_cli(tmp_path):
    """5,000 agents deep, dependents first: the whole load (graph included) passes; what stops the run is the
    next check, the unset key variable, one line and exit 2."""
    cfg = tmp_path / "chain.toml"
    cfg.write_text(chain_toml(5000, extra_ep='api_key_env = "CEREVISOR_UNSET_FOR_TEST"\n'))
    err = one_line_exit_2(cli("run", str(cfg)))
    assert "CEREVISOR_UNSET_FOR_TEST is not set" in err
    cfg.write_text(chain_toml(5000, cycle=True))
    assert "depends_on has a cycle" in one_line_exit_2(cli("run", str(cfg)))


def test_an_output_reference_in_a_turn_names_the_turn():
    data = {"endpoints": [{"name": "e", "base_url": "http://127.0.0.1:1/v1"}],
            "agents": [{"name": "a", "prompt": "p"},
                       {"name": "b", "prompt": "p", "turns": ["fine", "use {{ a.output }}"]}]}
    with pytest.raises(ConfigError) as info:
        validate(data, file="w.toml")
    assert info.value.key == "agents[1] (b).turns[1]"
    data["agents"][1] = {"name": "b", "prompt": "use {{ a.output }}"}
    with pytest.raises(ConfigError) as info:
        validate(data, file="w.toml")
    assert info.value.key == "agents[1] (b).prompt"


# ---- agent names --------------------------------------------------------------------------------------
BAD_NAMES = {
    "too long": ("x" * 201, "at most 200"),
    "too long in bytes": ("é" * 101, "202 bytes"),
    "escape": ("a\x1b[2Jb", "control character"),
    "newline": ("a\nb", "control character"),
    "tab": ("a\tb", "control character"),
    "slash": ("a/b", "path separators"),
    "backslash": ("a\\b", "path separators"),
    "dot dot": ("..", "dot"),
    "hidden": (".agent", "dot"),
    "reserved": ("con", "reserved"),
    "reserved with extension": ("LPT1.log", "reserved"),
    "blank": ("  ", "empty"),
    "padded": (" a", "space"),
    "bidi override": ("a\u202eb", "control character"),
}


def _agent_toml(name: str) -> str:
    return ('[[endpoints]]\nname = "e"\nbase_url = "http://127.0.0.1:1/v1"\n'
            f"[[agents]]\nname = {json.dumps(name)}\nprompt = \"p\"\n")


@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_an_agent_name_that_cannot_be_a_file_name_is_refused(tmp_path, capsys, case):
    name, words = BAD_NAMES[case]
    cfg = tmp_path / "w.toml"
    cfg.write_text(_agent_toml(name))
    err = one_line_exit_2(cli_main(["run", str(cfg)]), capsys.readouterr().err)
    assert "agents[0]" in err and ".name" in err and words in err


@pytest.mark.parametrize("name", ["résumé", "writer 2", "step:1", "a.b", "x" * 200, "审稿人"])
def test_usual_agent_names_are_fine(name):
    validate({"endpoints": [{"name": "e", "base_url": "http://127.0.0.1:1/v1"}], "agents": [{"name": name, "prompt": "p"}]})


def test_a_bad_agent_name_through_the_cli(tmp_path, capsys):
    cfg = tmp_path / "w.toml"
    cfg.write_text(_agent_toml("../../etc/x"))
    assert "path separators" in one_line_exit_2(cli_main(["run", str(cfg)]), capsys.readouterr().err)


# ---- URLs and ports ----------------------------------------------------------------------------------
BAD_URLS = {
    "port too high": ("http://127.0.0.1:70000/v1", "1 to 65535"),
    "port zero": ("http://127.0.0.1:0/v1", "1 to 65535"),
    "port not a number": ("http://127.0.0.1:80a/v1", "1 to 65535"),
    "no host": ("http:///v1", "names no host"),
    "no host, a port": ("http://:8000/v1", "names no host"),
    "space": ("http://my host:8000/v1", "spaces"),
    "trailing newline": ("http://127.0.0.1:8000/v1\n", "spaces or control"),
    "not http": ("ftp://127.0.0.1/v1", "http:// or https://"),
    "no scheme": ("127.0.0.1:8000/v1", "http:// or https://"),
    "credentials": ("https://user:secret@api.example.com/v1", "credentials"),
    "query": ("http://127.0.0.1:8000/v1?debug=1", "query"),
    "broken ipv6": ("http://[::1/v1", "not a URL"),
    "bad host characters": ("http://exa<mple/v1", "not a host name"),
}


@pytest.mark.parametrize("case", list(BAD_URLS))
def test_a_base_url_that_is_not_a_server_is_refused(tmp_path, capsys, case):
    url, words = BAD_URLS[case]
    cfg = tmp_path / "w.toml"
    cfg.write_text(f'[[endpoints]]\nname = "e"\nbase_url = {json.dumps(url)}\n[[agents]]\nname = "a"\nprompt = "p"\n')
    err = one_line_exit_2(cli_main(["run", str(cfg)]), capsys.readouterr().err)
    assert "endpoints[0] (e).base_url" in err and words in err
    assert "secret" not in err  # a URL with credentials is never echoed


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "https://api.openai.com/v1", "http://[::1]:8000/v1",
                                 "http://localhost:8000", "http://gpu-box.internal:8000/openai/v1/"])
def test_usual_base_urls_are_fine(url):
    validate({"endpoints": [{"name": "e", "base_url": url}]})


def test_endpoint_override_and_sim_port_are_checked_through_the_cli(tmp_path, capsys):
    def said(*argv: str) -> str:  # the command line's own entry, in this process (nothing starts: no process)
        return one_line_exit_2(cli_main(list(argv)), capsys.readouterr().err)

    cfg = tmp_path / "w.toml"
    cfg.write_text(_agent_toml("a"))
    assert "1 to 65535" in said("run", str(cfg), "--endpoint", "http://127.0.0.1:99999/v1")
    for port in ("70000", "-1"):
        assert "--port: must be 0-65535" in said("sim", "--port", port)
    assert "1 to 65535" in said("probe", "http://127.0.0.1:70000/v1")  # was an OverflowError


# ---- infinities and absurd sizes ---------------------------------------------------------------------
@pytest.mark.parametrize("table,key,value", [("stall", "idle_timeout_s", "inf"), ("stall", "extend_s", "nan"),
                                             ("run", "metrics_interval_s", "inf"), ("run.auto", "kv_target", "nan")])
def test_infinities_in_the_config_are_refused(tmp_path, capsys, table, key, value):
    cfg = tmp_path / "w.toml"
    cfg.write_text(f"[{table}]\n{key} = {value}\n" + _agent_toml("a"))
    err = one_line_exit_2(cli_main(["run", str(cfg)]), capsys.readouterr().err)
    assert f"{table}.{key}" in err and "finite" in err


@pytest.mark.parametrize("where,value,words", [
    ("agents[0] (a).extra_body", "{ max_tokens = 5 }", "max_tokens: set by the run itself"),
    ("agents[0] (a).extra_body", "{ stream = false, model = \"x\" }", "model, stream: set by the run itself"),
    ("agents[0] (a).extra_body", "{ since = 2026-12-01 }", "since: datetime.date(2026, 12, 1) has no JSON form"),
    ("endpoints[0] (e).extra_body", "{ top_k = nan }", "top_k: nan has no JSON form"),
    ("endpoints[0] (e).extra_body", "[1, 2]", "valid dictionary"),
])
def test_an_extra_body_that_the_run_cannot_send_is_refused(tmp_path, capsys, where, value, words):
    cfg = tmp_path / "w.toml"
    endpoint_line = f"extra_body = {value}\n" if where.startswith("endpoints") else ""
    agent_line = "" if endpoint_line else f"extra_body = {value}\n"
    cfg.write_text(f'[[endpoints]]\nname = "e"\nbase_url = "http://127.0.0.1:9/v1"\n{endpoint_line}'
                   f'[[agents]]\nname = "a"\nprompt = "p"\n{agent_line}')
    err = one_line_exit_2(cli_main(["run", str(cfg)]), capsys.readouterr().err)
    assert where in err and words in err, err


ESTIMATE_BASE = ["estimate", "--model", "llama-3.1-8b", "--gpu", "h100"]


@pytest.mark.parametrize("flags,words", [
    (["--gpus", "1e9"], "invalid int"),
    (["--gpus", "1000000000"], "--gpus must be at most 1,024"),
    (["--gpus", "-3"], "--gpus must be at least 1"),
    (["--context", "inf"], "invalid int"),
    (["--context", "-5"], "at least 1"),
    (["--context", "99999999999"], "--context must be at most"),
    (["--kv-memory-gib", "inf"], "finite"),
    (["--kv-memory-gib", "nan"], "finite"),
    (["--kv-memory-gib", "1e30"], "at most"),
    (["--cpu-offload-gib", "nan"], "finite"),
    (["--cpu-offload-gib", "-1"], "cannot be negative"),
    (["--runtime-reserve-gib", "inf"], "finite"),
    (["--weights-gib", "nan"], "finite"),
    (["--block-size", "0"], "at least 1"),
    (["--block-size", "1000000"], "at most"),
    (["--reload-gb-per-s", "0"], "positive"),
    (["--prefill-tokens-per-s", "inf"], "finite"),
    (["--gpu-memory-utilization", "nan"], "(0, 1]"),
])
def test_estimate_refuses_infinities_and_absurd_sizes(capsys, flags, words):
    try:
        code = cli_main([*ESTIMATE_BASE, *flags])
    except SystemExit as exc:  # argparse: a value that is not a number at all
        code = exc.code
    captured = capsys.readouterr()
    assert captured.out == ""
    assert words in one_line_exit_2(code, captured.err)


def test_estimate_never_recommends_a_cap_of_zero(capsys):
    args = ["estimate", "--model", "llama-3.1-70b", "--gpu", "h100", "--gpus", "2", "--context", "10000000"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "max_concurrency = 0" not in out and "configure    nothing" in out
    assert cli_main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["conversations_fit"] == 0 and data["max_concurrency"] is None


def test_estimate_absurd_size_through_the_cli():
    proc = cli(*ESTIMATE_BASE, "--kv-memory-gib", "inf")
    assert "finite" in one_line_exit_2(proc) and proc.stdout == ""
