"""Property tests: whatever TOML a user writes, the loader raises nothing but our ConfigError."""

from __future__ import annotations

import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cerevisor_tui.config import ConfigError, load_config
from tests.conftest import cli_here

KEYS = ["run", "stall", "ui", "endpoints", "agents", "mode", "max_concurrency", "name", "base_url", "kind",
        "prompt", "depends_on", "turns", "idle_timeout_s", "warn_at", "liveness", "sim", "keys", "theme", "bogus"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["parallel", "sequential", "local", "hosted", "simulated",
                                           "http://127.0.0.1:1/v1", "tokens", "bytes", "a", "b"]),
)
values = st.recursive(
    scalars.filter(lambda v: v is not None),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.sampled_from(KEYS), children, max_size=4)),
    max_leaves=12,
)
agent = st.fixed_dictionaries({"name": st.sampled_from(["a", "b", "c", ""]), "prompt": st.text(max_size=20)},
                              optional={"depends_on": st.lists(st.sampled_from(["a", "b", "c", "z"]), max_size=2),
                                        "endpoint": st.sampled_from(["e", "x"]), "max_tokens": st.integers(-5, 5),
                                        "turns": st.lists(st.text(max_size=5), max_size=2)})
endpoint = st.fixed_dictionaries({"name": st.sampled_from(["e", "f"])},
                                 optional={"base_url": st.sampled_from(["http://127.0.0.1:1/v1", "ftp://x", ""]),
                                           "kind": st.sampled_from(["local", "hosted", "simulated", "cloud"]),
                                           "idle_timeout_s": st.floats(-1, 10), "warn_at": st.lists(st.floats(-1, 2), max_size=3)})
documents = st.fixed_dictionaries({}, optional={
    "run": st.dictionaries(st.sampled_from(["mode", "max_concurrency", "run_dir", "bogus"]), values, max_size=3),
    "stall": st.dictionaries(st.sampled_from(["idle_timeout_s", "warn_at", "liveness", "extend_s"]), values, max_size=3),
    "endpoints": st.lists(endpoint, max_size=3),
    "agents": st.lists(agent, max_size=4),
    "other": values,
})


def _dump(doc) -> str | None:
    try:
        return tomli_w.dumps(doc)
    except (TypeError, ValueError):
        return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=documents)
def test_loader_raises_only_config_errors_on_structured_documents(tmp_path, doc):
    text = _dump(doc)
    if text is None:
        return
    path = tmp_path / "c.toml"
    path.write_text(text)
    try:
        load_config(path)
    except ConfigError as exc:
        assert str(path) in str(exc)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_loader_raises_only_config_errors_on_arbitrary_bytes(tmp_path, raw):
    path = tmp_path / "c.toml"
    path.write_bytes(raw)
    try:
        load_config(path)
    except ConfigError as exc:
        assert str(path) in str(exc)


def test_cli_answers_a_generated_bad_document_with_one_line(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(tomli_w.dumps({"run": {"max_concurrency": [1, 2]}, "agents": [{"name": "a"}]}))
    proc = cli_here(capsys, "run", str(path))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "run.max_concurrency" in proc.stderr
