"""The agentic workload generator against the studies' published figures (the acceptance figures of the replay
issue), the layer model's structure in the blocks it writes, and the replay file's reader."""

from __future__ import annotations

import math

import pytest

from cerevisor_tui.replay.generate import PRESETS, generate
from cerevisor_tui.replay.stats import trace_stats
from cerevisor_tui.replay.trace import (
    BLOCK_TOKENS,
    TraceError,
    TraceTurn,
    read_trace,
    whole_prompts,
    write_trace,
)


@pytest.fixture(scope="module")
def inference_day() -> list[TraceTurn]:
    return generate("aiperf-inference-day", sessions=1131, seed=42)


@pytest.fixture(scope="module")
def agentx() -> list[TraceTurn]:
    return generate("agentx", sessions=1000, seed=42)


def within(value: float, target: float, share: float) -> bool:
    return abs(value - target) <= share * target


def test_aiperf_inference_day_reproduces_the_reference_trace(inference_day):
    stats = trace_stats(inference_day)
    medians = {"turns a session": (stats.turns_per_session.median, 11),
               "first context": (stats.first_context_tokens.median, 47_300),
               "new tokens a turn": (stats.new_tokens.median, 3_900),
               "output a turn": (stats.output_tokens.median, 786),
               "gap s": (stats.gap_s.median, 2.0)}
    means = {"turns a session": (stats.turns_per_session.mean, 11.6),
             "first context": (stats.first_context_tokens.mean, 54_700),
             "new tokens a turn": (stats.new_tokens.mean, 5_800),
             "output a turn": (stats.output_tokens.mean, 991),
             "gap s": (stats.gap_s.mean, 7.6)}
    for name, (value, target) in medians.items():
        assert within(value, target, 0.05), f"median {name}: {value} against {target}"
    for name, (value, target) in means.items():
        assert within(value, target, 0.10), f"mean {name}: {value} against {target}"
    # the reference: 1,131 sessions and their restart continuations (1,205 in all, 14,163 turns)
    assert 1131 < stats.sessions < 1300 and stats.subagent_sessions == 0


def test_agentx_matches_the_agentx_study(agentx):
    stats = trace_stats(agentx)
    assert within(stats.turns_per_session.median, 43, 0.05), stats.turns_per_session
    assert within(stats.prompt_tokens.median, 142_000, 0.10), stats.prompt_tokens
    assert within(stats.output_tokens.median, 444, 0.10), stats.output_tokens
    assert stats.prefix_share >= 0.95
    assert abs(stats.subagent_spawn_share - 0.44) <= 0.03
    assert stats.subagent_sessions > 0


def test_tiered_offload_is_12k_then_2k_a_round_for_8_rounds():
    turns = generate("tiered-offload", sessions=5, seed=3)
    assert len(turns) == 5 * 8
    for turn, whole in whole_prompts(turns):
        assert turn.input_length == (12_000 if turn.turn == 1 else 2_000)
        assert whole == 12_000 + (turn.turn - 1) * (2_000 + turn.output_length)
        assert turn.delay_ms == 0.0
    assert {turn.session_id for turn in turns if turn.turn == 8} == {turn.session_id for turn in turns}


def test_the_same_seed_gives_the_same_file_and_another_seed_another(tmp_path):
    first, again, other = (generate("aiperf-inference-day", sessions=40, seed=seed) for seed in (5, 5, 6))
    assert first == again
    assert first != other
    write_trace(first, tmp_path / "a.jsonl")
    write_trace(again, tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_blocks_say_the_layer_model(preset):
    """Each prompt is ceil(tokens / 512) blocks and extends its session's previous prompt; every session
    starts with the same tools-and-system blocks; a subagent's first prompt extends a turn of its parent that
    comes before it in the file."""
    turns = generate(preset, sessions=60, seed=11)
    shared = math.ceil(PRESETS[preset].shared_tokens / BLOCK_TOKENS)
    last: dict[str, tuple[TraceTurn, int]] = {}
    for turn, whole in whole_prompts(turns):
        assert len(turn.hash_ids) == math.ceil(whole / BLOCK_TOKENS)
        if turn.turn > 1:
            before, before_whole = last[turn.session_id]
            full = before_whole // BLOCK_TOKENS
            assert turn.hash_ids[:full] == before.hash_ids[:full]
        elif turn.parent is not None:
            spawner, spawner_whole = last[turn.parent]
            full = spawner_whole // BLOCK_TOKENS
            assert turn.hash_ids[:full] == spawner.hash_ids[:full]
        if turn.turn == 1:
            assert turn.hash_ids[:shared] == list(range(shared))
        last[turn.session_id] = (turn, whole)


def test_restarts_carry_an_earlier_sessions_prompt_and_answer(inference_day):
    prompts = {}
    first_seen = {}
    for index, (turn, whole) in enumerate(whole_prompts(inference_day)):
        prompts.setdefault(turn.session_id, []).append((turn, whole))
        first_seen.setdefault(turn.session_id, index)
    restarts = [name for name in prompts if name.endswith("-r1")]
    assert 40 < len(restarts) < 150  # the reference trace has 74
    for name in restarts:
        earlier = prompts[name.removesuffix("-r1")]
        assert first_seen[name.removesuffix("-r1")] < first_seen[name]
        last_turn, last_whole = earlier[-1]
        carried_turn, carried = prompts[name][0]
        assert carried == last_whole + last_turn.output_length
        full = last_whole // BLOCK_TOKENS
        assert carried_turn.hash_ids[:full] == last_turn.hash_ids[:full]


def test_resets_grow_with_the_context(inference_day):
    """Sessions end by reset more often the fuller they are: the last prompt of a session that ended below the
    limit is, on average, well under the limit, and some sessions run into the limit itself."""
    ends = {}
    for turn, whole in whole_prompts(inference_day):
        ends[turn.session_id] = whole
    limit = PRESETS["aiperf-inference-day"].max_prompt_tokens
    assert all(whole < limit for whole in ends.values())
    assert sum(whole > 0.9 * limit for whole in ends.values()) > 50


# ---- the replay file ----------------------------------------------------------------------------------------
def test_a_written_file_reads_back_the_same(tmp_path):
    turns = generate("agentx", sessions=6, seed=2)
    path = tmp_path / "agentx.jsonl"
    assert write_trace(turns, path) == len(turns)
    assert read_trace(path) == turns


@pytest.mark.parametrize(("lines", "where", "says"), [
    (['{"session_id":"a","turn":1,"input_length":5,"output_length":1,"hash_ids":[0]}', "{"], ":2:", "not a JSON"),
    (['{"session_id":"a","turn":1,"output_length":1,"hash_ids":[0]}'], ":1:", "input_length"),
    (['{"session_id":"a","turn":1,"input_length":-1,"output_length":1,"hash_ids":[0]}'], ":1:", "input_length"),
    (['{"session_id":"a","turn":1,"input_length":1,"output_length":1,"hash_ids":[0,"x"]}'], ":1:", "hash_ids[1]"),
    (['{"session_id":"a","turn":1,"input_length":1,"output_length":1,"hash_ids":[0],"delay_ms":-2}'], ":1:",
     "delay_ms"),
    (['{"session_id":"a","turn":1,"input_length":1,"output_length":1,"hash_ids":[0],"colour":"red"}'], ":1:",
     "colour"),
    (['{"session_id":"a","turn":2,"input_length":1,"output_length":1,"hash_ids":[0]}'], ":1:", "turn"),
    (['{"session_id":"a","turn":1,"input_length":1,"output_length":1,"hash_ids":[0]}',
      '{"session_id":"a","turn":1,"input_length":1,"output_length":1,"hash_ids":[0]}'], ":2:", "turn"),
    (['{"session_id":"b","turn":1,"input_length":1,"output_length":1,"hash_ids":[0],"parent":"a"}'], ":1:",
     "parent"),
    (["", "  "], "", "no turns"),
    (["[1, 2]"], ":1:", "expected `object`"),
])
def test_every_problem_is_one_line_naming_file_line_and_field(tmp_path, lines, where, says):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    message = str(caught.value)
    assert message.startswith(f"{path}{where}") and says in message and "\n" not in message


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "none.jsonl")


def test_a_line_past_the_limit_is_refused_before_it_is_held(tmp_path, monkeypatch):
    from cerevisor_tui.replay import trace

    monkeypatch.setattr(trace, "MAX_LINE_BYTES", 200)
    path = tmp_path / "long.jsonl"
    path.write_text('{"session_id":"a","turn":1,"input_length":1,"output_length":1,"hash_ids":[0]}\n'
                    + '{"session_id":"a","turn":2,"hash_ids":[' + "1," * 500 + "1]}\n")
    with pytest.raises(TraceError, match=r":2: line longer than 200 bytes"):
        read_trace(path)


@pytest.mark.parametrize(("lines", "says"), [
    (['{"session_id":"a","turn":1,"input_length":20000000,"output_length":1,"hash_ids":[]}'], "input_length"),
    (['{"session_id":"a","turn":1,"input_length":9000000,"output_length":900000,"hash_ids":[]}',
      '{"session_id":"a","turn":2,"input_length":900000,"output_length":1,"hash_ids":[]}'], ":2: input_length: the prompt"),
    (['{"session_id":"a","turn":1,"input_length":1,"output_length":1,"hash_ids":[],"delay_ms":1e12}'], "delay_ms"),
])
def test_a_file_past_what_a_replay_takes_is_refused_as_it_is_read(tmp_path, lines, says):
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=says):
        read_trace(path)
