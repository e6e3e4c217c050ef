"""Property test over the command line and the config: whatever a user types (run, estimate, sim, probe, with
any flags and any workflow, against a server that echoes the API key back every way it can), the answer is
exit 0, 1 or 2, never a traceback, and never a secret in any output (stdout, stderr, the run directory, the
report). Calls `cli.main` in this process, so an exception that would be a traceback fails the example."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cerevisor_tui.cli import main as cli_main
from tests.secret_echo import EchoServer, leaks, outputs

KEY_ENV = "CEREVISOR_FUZZ_KEY"
FAST = ("http400", "html401", "reason", "split", "split3", "reasoning", "malformed", "sse_error", "nonstream",
        "cut", "clean")
_runs = itertools.count()


@pytest.fixture(scope="module")
def echo():
    with EchoServer(loading=False, list_models=True) as srv:
        yield srv


def _closed_url() -> str:
    return "http://127.0.0.1:9/v1"  # discard port: refused at once


BAD_URLS = ["http://127.0.0.1:70000/v1", "http:///v1", "ftp://x/v1", "http://a b/v1", "http://u:pw@h/v1", "", "x"]
NAMES = ["a", "b", "c", "résumé", "..", "a/b", "x" * 201, "con", "a\nb", " a", ""]

# ---- strategies: what a user means, with now and then one thing mistyped -------------------------------
hexes = st.binary(min_size=8, max_size=8).map(bytes.hex)
good_keys = hexes.map(lambda h: f"sk-fuzz-{h}")
bad_keys = st.one_of(hexes.map(lambda h: f"sk-fuzz-{h}\r"),  # a key file saved with CRLF
                     hexes.map(lambda h: f"sk-fuzz-{h[:6]}\n{h[6:]}"),
                     hexes.map(lambda h: f"sk-fuzz-{h}é"),
                     hexes.map(lambda h: f" sk-fuzz-{h}"))
key_values = st.integers(0, 3).flatmap(lambda i: bad_keys if i == 3 else good_keys)  # one bad key in four
any_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e300]))
number_text = st.one_of(
    st.integers(-10, 10**12).map(str), any_float.map(repr),
    st.sampled_from(["1e9", "inf", "-inf", "nan", "NaN", "", "abc", "0x10", "1_000", " 3"]),
)


def _endpoint(url: str, name: str):
    return st.fixed_dictionaries(
        {"name": st.just(name), "base_url": st.just(url), "kind": st.sampled_from(["local", "hosted"]),
         "model": st.sampled_from(FAST)},
        optional={"api_key_env": st.just(KEY_ENV), "max_concurrency": st.integers(1, 8),
                  "first_byte_timeout_s": st.sampled_from([0.5, 2.0, 5.0]),
                  "idle_timeout_s": st.sampled_from([0.5, 2.0, 5.0])},
    )


def _agent(name: str, endpoints: list[str]):
    others = [n for n in ("a", "b", "c") if n != name]
    return st.fixed_dictionaries(
        {"name": st.just(name), "prompt": st.text(max_size=20)},
        optional={
            "endpoint": st.sampled_from(endpoints),
            "system": st.text(max_size=10),
            "turns": st.lists(st.text(max_size=8), max_size=2),
            "max_tokens": st.integers(1, 12),
            "retries": st.integers(0, 1),
            "temperature": st.sampled_from([0.0, 0.7, 2.0]),
            "depends_on": st.lists(st.sampled_from(others), max_size=1),
        },
    )


def _document(url: str):
    def agents(endpoints: list[dict]):
        names = [ep["name"] for ep in endpoints]
        # depends_on only on agents listed before: no cycles in the good document
        return st.integers(1, 3).flatmap(lambda n: st.tuples(*(
            _agent(name, names).map(lambda a, i=i: {**a, "depends_on": [d for d in a.get("depends_on", [])
                                                                       if d < a["name"]]})
            for i, name in enumerate("abc"[:n]))).map(list))

    endpoints = st.tuples(_endpoint(url, "e"), st.lists(_endpoint(url, "f"), max_size=1)).map(lambda p: [p[0], *p[1]])
    return endpoints.flatmap(lambda eps: st.fixed_dictionaries(
        {"endpoints": st.just(eps), "agents": agents(eps)},
        optional={"run": st.fixed_dictionaries({}, optional={
                      "mode": st.sampled_from(["parallel", "sequential", "auto"]),
                      "max_concurrency": st.integers(1, 8), "metrics_interval_s": st.just(0.2)}),
                  "stall": st.fixed_dictionaries({}, optional={"idle_timeout_s": st.sampled_from([0.5, 5.0]),
                                                               "warn_at": st.just([0.5])})}))


# one mistake, drawn: (where in the document, what to put there)
MISTAKES = [
    (("endpoints", 0, "base_url"), st.sampled_from([_closed_url(), *BAD_URLS])),
    (("endpoints", 0, "name"), st.sampled_from(["", "g\n"])),
    (("endpoints", 0, "kind"), st.sampled_from(["simulated", "cloud"])),
    (("endpoints", 0, "model"), st.sampled_from(["", "unknown-model", "ünï"])),
    (("endpoints", 0, "api_key_env"), st.sampled_from(["", "CEREVISOR_FUZZ_UNSET"])),
    (("endpoints", 0, "max_concurrency"), st.integers(-1, 0)),
    (("endpoints", 0, "idle_timeout_s"), any_float),
    (("endpoints", 0, "sim"), st.fixed_dictionaries({"speed": st.sampled_from([50.0, 100.0])},
                                                    optional={"tokens_per_s": any_float})),
    (("agents", 0, "name"), st.sampled_from(NAMES)),
    (("agents", 0, "endpoint"), st.sampled_from(["zz", ""])),
    (("agents", 0, "depends_on"), st.lists(st.sampled_from(["a", "b", "c", "ghost"]), max_size=2)),
    (("agents", 0, "prompt"), st.sampled_from(["use {{ b.output }}", "{{ a.output }}", "{{ x.output"])),
    (("agents", 0, "turns"), st.lists(st.sampled_from(["{{ b.output }}", "x" * 50]), max_size=2)),
    (("agents", 0, "max_tokens"), st.integers(-1, 0)),
    (("agents", 0, "temperature"), any_float),
    (("run", "mode"), st.sampled_from(["fast", ""])),
    (("run", "max_concurrency"), st.integers(-1, 10**6)),
    (("run", "metrics_interval_s"), any_float),
    (("run", "stream_process"), st.sampled_from(["auto", "on", "maybe"])),
    (("stall", "first_byte_timeout_s"), any_float),
    (("stall", "warn_at"), st.lists(any_float, max_size=2)),
    (("bogus",), st.just(1)),
]


def _with_mistake(doc: dict, data) -> dict:
    choice = data.draw(st.one_of(st.none(), st.none(), st.integers(0, len(MISTAKES) - 1)), label="mistake")
    if choice is None:
        return doc
    path, values = MISTAKES[choice]
    node = doc
    for part in path[:-1]:
        node = node.setdefault(part, {}) if isinstance(part, str) else node[part]
    node[path[-1]] = data.draw(values, label=".".join(map(str, path)))
    return doc


def _run_flags(url: str):
    return st.lists(st.one_of(
        st.tuples(st.just("--mode"), st.sampled_from(["parallel", "sequential", "auto", "bogus"])),
        st.tuples(st.just("--concurrency"), st.one_of(st.integers(1, 8).map(str), number_text)),
        st.tuples(st.just("--endpoint"), st.one_of(st.just(url), st.sampled_from(BAD_URLS))),
        st.tuples(st.just("--model"), st.sampled_from([*FAST, "", "ünïcode"])),
        st.tuples(st.just("--jsonl")),
        st.tuples(st.just("--bogus-flag")),
    ), max_size=2).map(lambda pairs: [part for pair in pairs for part in pair])


def _bounded(doc: dict) -> dict:
    """Keep every example short: the echo server answers at once, but a refused local port waits out its
    first-byte deadline, and the built-in simulator runs at a speed of 50+."""
    for ep in doc.get("endpoints", []):
        if ep.get("base_url") == _closed_url():
            ep["kind"] = "hosted"
    stall = doc.setdefault("stall", {})
    if isinstance(stall, dict):
        stall.setdefault("first_byte_timeout_s", 3.0)
    return doc


# ---- the invariant ----------------------------------------------------------------------------------
def _call(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = cli_main(argv)
    except SystemExit as exc:  # argparse: --help, or a usage error
        code = exc.code if isinstance(exc.code, int) else 2
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _check(code: int, out: str, err: str, key: str, *paths: Path) -> None:
    assert code in (0, 1, 2), (code, err[-2000:])
    assert "Traceback" not in err and "Traceback" not in out, err[-2000:]
    if code == 2:
        assert err.strip() and err.strip().count("\n") == 0, err  # one line
    core = key.strip().replace("\n", "").removesuffix("é")
    text = outputs(*paths, texts=(out, err))
    assert not leaks(text, core), leaks(text, core)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), key=key_values)
def test_run_answers_0_1_or_2_and_never_shows_a_key(echo, tmp_path, capsys, data, key):
    doc = _bounded(_with_mistake(data.draw(_document(echo.base_url), label="config"), data))
    flags = data.draw(_run_flags(echo.base_url), label="flags")
    n = next(_runs)
    cfg = tmp_path / f"w{n}.toml"
    cfg.write_text(tomli_w.dumps(doc))
    run_dir, report = tmp_path / f"run{n}", tmp_path / f"r{n}.json"
    os.environ[KEY_ENV] = key
    try:
        code, out, err = _call(["run", str(cfg), *flags, "--run-dir", str(run_dir), "--report", str(report)], capsys)
    finally:
        del os.environ[KEY_ENV]
    _check(code, out, err, key, run_dir, report)
    event(f"exit {code}")


ESTIMATE_FLAGS = ["--gpus", "--gpu-memory-utilization", "--kv-memory-gib", "--context", "--cpu-offload-gib",
                  "--runtime-reserve-gib", "--weights-gib", "--block-size", "--reload-gb-per-s",
                  "--prefill-tokens-per-s"]


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(model=st.sampled_from([["--model", "llama-3.1-8b"], ["--model", "qwen3-32b"], ["--model", "nope"],
                              ["--model-config", "/nonexistent.json"], ["--list"], []]),
       gpu=st.sampled_from([["--gpu", "h100"], ["--gpu", "l4"], ["--gpu", "h1000"], []]),
       flags=st.lists(st.tuples(st.sampled_from(ESTIMATE_FLAGS), number_text), max_size=4),
       kv_dtype=st.sampled_from([[], ["--kv-dtype", "fp8"], ["--kv-dtype", "int3"]]),
       as_json=st.booleans())
def test_estimate_answers_0_or_2_whatever_the_numbers(capsys, model, gpu, flags, kv_dtype, as_json):
    argv = ["estimate", *model, *gpu, *kv_dtype, *[part for pair in flags for part in pair]]
    code, out, err = _call([*argv, *(["--json"] if as_json else [])], capsys)
    _check(code, out, err, "no key here at all")
    assert code in (0, 2)
    event(f"exit {code}")
    if code == 0 and "--list" not in argv:
        assert "max_concurrency = 0" not in out and '"max_concurrency": 0' not in out


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(port=st.one_of(st.integers(65536, 10**20), st.integers(-10**6, -1)).map(str),
       extra=st.sampled_from([[], ["--speed", "nan"], ["--tokens-per-s", "inf"], ["--max-num-seqs", "0"]]))
def test_sim_refuses_a_port_or_a_setting_out_of_range(capsys, port, extra):
    code, out, err = _call(["sim", "--port", port, *extra], capsys)
    _check(code, out, err, "no key here at all")
    assert code == 2


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), key=key_values,
       model=st.sampled_from([["--model", "http400"], ["--model", "sse_error"], ["--model", "malformed"],
                              ["--model", "html401"], ["--model", "clean"], ["--model", "nope"], []]),
       extra=st.one_of(st.just([]), st.just([]), st.lists(st.tuples(st.sampled_from(["--max-tokens", "--max-concurrency"]),
                                                                    number_text), max_size=2)))
def test_probe_answers_0_1_or_2_and_never_shows_a_key(echo, capsys, data, key, model, extra):
    url = data.draw(st.one_of(st.just(echo.base_url), st.sampled_from([_closed_url(), *BAD_URLS[:4]])), label="url")
    argv = ["probe", url, "--api-key-env", KEY_ENV, *model, *[part for pair in extra for part in pair],
            "--max-seconds", "1", "--level-seconds", "0.1", "--max-requests", "8"]
    os.environ[KEY_ENV] = key
    try:
        code, out, err = _call(argv, capsys)
    finally:
        del os.environ[KEY_ENV]
    _check(code, out, err, key)
    event(f"exit {code}" + (f": {err.strip()[:70]}" if code == 2 else ""))
