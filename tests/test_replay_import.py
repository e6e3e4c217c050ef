"""Published traces (Mooncake, AIPerf's multi-turn Mooncake rows, Weka, TraceLab) read into the replay file,
from small fixtures written in each format (tests/fixtures/replay/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cerevisor_tui.replay.importers import import_trace
from cerevisor_tui.replay.stats import trace_stats
from cerevisor_tui.replay.trace import TraceError, read_trace, whole_prompts, write_trace

FIXTURES = Path(__file__).parent / "fixtures" / "replay"


def rows(turns) -> list[tuple]:
    return [(t.session_id, t.turn, t.input_length, t.output_length, t.hash_ids, t.delay_ms, t.parent) for t in turns]


def test_mooncake_requests_are_sessions_of_one_turn_with_their_shared_blocks():
    turns = import_trace(FIXTURES / "mooncake.jsonl", "mooncake")
    assert rows(turns) == [
        ("m000001", 1, 1100, 10, [0, 1, 2], 0.0, None),
        ("m000002", 1, 1600, 20, [0, 1, 3, 4], 500.0, None),  # the same first two blocks: the same text
        ("m000003", 1, 600, 5, [0, 5], 3000.0, None),  # its start, from the trace's first timestamp
    ]


def test_aiperf_multi_turn_rows_grow_the_session_by_prompt_answer_and_new_tokens():
    turns = import_trace(FIXTURES / "mooncake_sessions.jsonl", "mooncake")
    assert rows(turns) == [
        ("sess-a1b2", 1, 1100, 100, [0, 1, 2], 0.0, None),
        ("sess-a1b2", 2, 300, 50, [0, 1, 2], 2450.3, None),  # 1,500 tokens: the same 3 blocks, the last now full
        ("sess-f0e9", 1, 600, 20, [0, 3], 0.0, None),
    ]


def test_weka_subagents_compactions_gaps_and_64_token_blocks():
    turns = import_trace(FIXTURES / "weka.json", "weka")
    assert rows(turns) == [
        ("w1", 1, 1300, 100, [0, 1, 2], 0.0, None),
        ("w1", 2, 300, 50, [0, 1, 3, 4], 500.0, None),  # think_time 0.5 s
        # the subagent starts after its parent's answer (t 2.5 + api_time 1.5 = 4.0; it starts at 4.3)
        ("w1/agent_001", 1, 700, 80, [5, 6], 300.0, "w1"),
        ("w1/agent_001", 2, 100, 40, [5, 7], 300.0, None),
        ("w1", 3, 200, 60, [0, 1, 3, 8], 2000.0, None),
        ("w1~2", 1, 600, 30, [9, 10], 2000.0, None),  # its prompt no longer extends the last: a compaction
    ]
    # eight 64-token source blocks make one 512-token block, so a turn's prompt extends the one before
    assert trace_stats(turns).prefix_share > 0.8


def test_weka_global_scope_shares_blocks_across_traces_and_local_does_not(tmp_path):
    trace = json.loads((FIXTURES / "weka.json").read_text())
    for scope, shared in (("global", True), ("local", False)):
        lines = [json.dumps({**trace, "id": name, "hash_id_scope": scope}) for name in ("x", "y")]
        path = tmp_path / f"{scope}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        turns = import_trace(path, "weka")
        first = {t.session_id: t.hash_ids for t in turns if t.turn == 1}
        assert (first["x"] == first["y"]) is shared


def test_tracelab_rounds_in_order_with_tool_time_as_the_gap_and_compaction_split():
    turns = import_trace(FIXTURES / "tracelab.jsonl", "tracelab")
    assert [(t.session_id, t.turn, t.input_length, t.output_length, t.delay_ms) for t in turns] == [
        ("A", 1, 5000, 200, 0.0),
        ("A", 2, 800, 100, 1500.0),  # Bash's own 1,200 ms (not its 1,500 ms wall) and Read's 300 ms wall
        ("A", 3, 300, 50, 0.0),
        ("A~2", 1, 3000, 80, 0.0),  # the context shrank: a compaction starts a new session
        ("B", 1, 8000, 400, 0.0),  # round 0 first, though the file has round 1 first
        ("B", 2, 600, 90, 700.0),
    ]
    prompts = dict(((t.session_id, t.turn), whole) for t, whole in whole_prompts(turns))
    assert prompts[("A", 3)] == 6400 and prompts[("B", 2)] == 9000  # the recorded input_tokens_total
    a = [t.hash_ids for t in turns if t.session_id == "A"]
    assert a[1][: len(a[0])] == a[0] and a[2][: len(a[1])] == a[1]


def test_a_directory_of_weka_traces_reads_each_file_in_name_order(tmp_path):
    trace = json.loads((FIXTURES / "weka.json").read_text())
    for name in ("b", "a"):
        (tmp_path / f"{name}.json").write_text(json.dumps({**trace, "id": f"trace-{name}"}))
    (tmp_path / "notes.txt").write_text("not a trace")
    turns = import_trace(tmp_path, "weka")
    assert [t.session_id for t in turns if t.turn == 1 and t.parent is None] == ["trace-a", "trace-a~2",
                                                                                 "trace-b", "trace-b~2"]


@pytest.mark.parametrize("fmt, name", [("mooncake", "mooncake.jsonl"), ("mooncake", "mooncake_sessions.jsonl"),
                                       ("weka", "weka.json"), ("tracelab", "tracelab.jsonl")])
def test_every_import_writes_a_file_the_reader_accepts(tmp_path, fmt, name):
    turns = import_trace(FIXTURES / name, fmt)
    write_trace(turns, tmp_path / "out.jsonl")
    assert read_trace(tmp_path / "out.jsonl") == turns


@pytest.mark.parametrize(("fmt", "text", "says"), [
    ("mooncake", '{"timestamp": 0, "output_length": 3, "hash_ids": [1]}\n', ":1: input_length: missing"),
    ("mooncake", '{"input_length": "9", "output_length": 3}\n', ":1: input_length: expected int"),
    ("mooncake", '{"input_length": 9, "output_length": 3, "hash_ids": [1, -4]}\n', ":1: hash_ids[1]"),
    ("mooncake", '{"input_length": 9, "output_length": 3}\nnot json\n', ":2: not JSON"),
    ("weka", '{"id": "w", "block_size": 100, "requests": []}', "block_size"),
    ("weka", '[{"id": "w"}]', "not a JSON object"),
    ("weka", '{"id": "w", "block_size": 64, "hash_id_scope": "planet", "requests": []}', "hash_id_scope"),
    ("weka", '{"id": "w", "block_size": 64, "requests": [{"t": 0, "type": "x"}]}', "requests[0]: type"),
    ("weka", '{"id": "w", "block_size": 64, "requests": [{"t": 0, "type": "n", "in": 5}]}', "requests[0]: out"),
    ("tracelab", '{"session_id": "a", "round_index": 0, "input_tokens_total": 5}\n', ":1: output_tokens"),
    ("tracelab", '{"session_id": "a", "round_index": 0, "input_tokens_total": 5, "output_tokens": 1, '
                 '"tools": [7]}\n', "tools[0]"),
    ("tracelab", '{"session_id": null}\n', "no requests"),
])
def test_a_bad_trace_is_one_line_naming_where(tmp_path, fmt, text, says):
    path = tmp_path / "trace"
    path.write_text(text)
    with pytest.raises(TraceError) as caught:
        import_trace(path, fmt)
    assert str(path) in str(caught.value) and says in str(caught.value)


_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 5000) | st.floats(allow_nan=False) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                         st.sampled_from(["id", "block_size", "requests", "t", "type", "in", "out", "hash_ids",
                                          "session_id", "round_index", "input_tokens_total", "output_tokens",
                                          "tools", "input_length", "output_length", "timestamp", "delay",
                                          "think_time", "agent_id", "hash_id_scope", "turn", "parent"]),
                         inner, max_size=6), max_leaves=20)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_json, min_size=1, max_size=4), fmt=st.sampled_from(["mooncake", "weka", "tracelab", "file"]))
def test_whatever_a_trace_holds_the_answer_is_turns_or_one_trace_error(tmp_path, lines, fmt):
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    try:
        turns = read_trace(path) if fmt == "file" else import_trace(path, fmt)
    except TraceError as exc:
        assert "\n" not in str(exc)
    else:
        write_trace(turns, tmp_path / "out.jsonl")
        assert read_trace(tmp_path / "out.jsonl") == turns


@pytest.mark.parametrize("fmt", ["mooncake", "weka", "tracelab"])
def test_json_nested_past_the_parsers_depth_is_one_trace_error(tmp_path, fmt):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(TraceError, match="nested too deep"):
        import_trace(path, fmt)


@pytest.mark.parametrize(("fmt", "text", "says"), [
    ("mooncake", '{"input_length": 100000000000000000000, "output_length": 3}\n', "input_length: must be at most"),
    ("mooncake", '{"session_id": "s", "input_length": 9000000, "output_length": 9000000}\n'
                 '{"session_id": "s", "input_length": 9000000, "output_length": 1, "delay": 5}\n', ":2: a prompt of"),
    ("mooncake", '{"session_id": "s", "input_length": 9, "output_length": 1}\n'
                 '{"session_id": "s", "input_length": 9, "output_length": 1, "delay": 1e300}\n', ":2: a gap of"),
    ("weka", '{"id": "w", "block_size": 64, "requests": [{"t": NaN, "type": "n", "in": 5, "out": 1}]}', "finite"),
    ("tracelab", '{"session_id": "a", "round_index": 0, "input_tokens_total": 1e400, "output_tokens": 1}\n',
     "input_tokens_total"),
])
def test_sizes_and_gaps_past_what_a_replay_takes_are_refused(tmp_path, fmt, text, says):
    path = tmp_path / "trace"
    path.write_text(text)
    with pytest.raises(TraceError, match=says):
        import_trace(path, fmt)
