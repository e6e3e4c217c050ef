"""What a replay file holds, in the figures the published studies give: turns a session, first context, new
tokens and output a turn, gaps, whole prompt a turn, prefix share, subagents."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from cerevisor_tui.replay.trace import BLOCK_TOKENS, TraceTurn, whole_prompts


@dataclass(frozen=True)
class Spread:
    """The median and mean of one figure (0 when there is nothing to measure)."""

    median: float
    mean: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            return cls(0.0, 0.0)
        return cls(float(statistics.median(values)), statistics.fmean(values))


@dataclass(frozen=True)
class TraceStats:
    """A replay file summed up. Sessions are the top-level ones (a subagent belongs to its parent's); turn
    figures count every turn, subagents' included."""

    sessions: int
    subagent_sessions: int
    turns: int
    turns_per_session: Spread
    first_context_tokens: Spread  # a top-level session's whole first prompt
    new_tokens: Spread  # a turn's new tokens, turns after the first
    output_tokens: Spread
    gap_s: Spread  # the gap before a turn, turns after the first
    prompt_tokens: Spread  # a turn's whole prompt
    prefix_share: float  # mean, turns after the first: the part of the prompt that the previous turn's
    # prompt and answer already were
    subagent_spawn_share: float  # top-level sessions with at least one subagent

    def to_dict(self) -> dict:
        return asdict(self)


def trace_stats(turns: Iterable[TraceTurn]) -> TraceStats:
    """The figures of `turns` (a file's, in file order)."""
    turn_counts: dict[str, int] = {}
    parents: set[str] = set()
    subagents = 0
    first_context: list[float] = []
    new_tokens: list[float] = []
    output: list[float] = []
    gaps: list[float] = []
    prompts: list[float] = []
    shares: list[float] = []
    previous: dict[str, tuple[list[int], int]] = {}  # session -> (its last turn's blocks, whole prompt)
    top_level: set[str] = set()
    for turn, whole in whole_prompts(turns):
        if turn.turn == 1:
            if turn.parent is None:
                top_level.add(turn.session_id)
                first_context.append(whole)
            else:
                subagents += 1
                parents.add(turn.parent)
        else:
            new_tokens.append(turn.input_length)
            gaps.append(turn.delay_ms / 1000)
            blocks, prompt = previous[turn.session_id]
            shares.append(_prefix_tokens(turn, whole, blocks, prompt) / whole if whole else 1.0)
        if turn.session_id in top_level:
            turn_counts[turn.session_id] = turn.turn
        output.append(turn.output_length)
        prompts.append(whole)
        previous[turn.session_id] = (turn.hash_ids, whole)
    return TraceStats(
        sessions=len(top_level),
        subagent_sessions=subagents,
        turns=len(prompts),
        turns_per_session=Spread.of(list(turn_counts.values())),
        first_context_tokens=Spread.of(first_context),
        new_tokens=Spread.of(new_tokens),
        output_tokens=Spread.of(output),
        gap_s=Spread.of(gaps),
        prompt_tokens=Spread.of(prompts),
        prefix_share=statistics.fmean(shares) if shares else 0.0,
        subagent_spawn_share=len(parents & top_level) / len(top_level) if top_level else 0.0,
    )


def _prefix_tokens(turn: TraceTurn, whole: int, before: list[int], before_prompt: int) -> int:
    """How much of this turn's prompt the previous turn's prompt and answer were: all but the new tokens when
    its blocks extend the previous prompt's full blocks, else the blocks the two share from the start."""
    full_before = before_prompt // BLOCK_TOKENS
    if turn.hash_ids[:full_before] == before[:full_before] and len(turn.hash_ids) >= full_before:
        return whole - turn.input_length
    shared = 0
    for mine, theirs in zip(turn.hash_ids, before, strict=False):
        if mine != theirs:
            break
        shared += 1
    return min(shared * BLOCK_TOKENS, whole)
