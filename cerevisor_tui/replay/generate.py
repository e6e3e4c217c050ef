"""Agentic coding sessions, generated from AIPerf's layer model: the same formulas, no dependency on aiperf.

Source: ai-dynamo/aiperf, src/aiperf/dataset/agentic_code_gen/ (README.md, session_synthesizer.py,
prefix_model.py, distributions.py, configs/inference-day-2026.json; reference trace
datasets/1k_sessions_200k_ctx/quality.json). The model, as documented there:
- A prompt is layers of 512-token blocks: L1 (tools and system prompt, the same for every session), L1.5
  (a group's repository context; groups drawn Zipf), L2 (the session's start), L3 (its growing history).
- Every size is a lognormal fitted from a mean and a median: mu = ln(median), sigma = sqrt(2 ln(mean/median)),
  values outside [min, max] drawn again (100 tries, then clamped).
- Turn growth: input = previous input + previous output + new tokens.
- The gap before a turn is a two-component mixture (agentic 70%, human 30%), shortened as the context fills:
  x max(0.2, 1 - 0.8 x input / max_prompt_tokens).
- A session ends when the next prompt would pass max_prompt_tokens (forced retire), or by a reset whose
  probability grows with the context: p = base x (1 + (scaling - 1) x input / max_prompt_tokens).
- A restart splits a session at a turn in [5, 15): the continuation's first prompt carries the earlier
  session's whole prompt and answer (its blocks), and it is placed later in the file. The chance of a restart
  decays linearly from its initial value to 0 over the first 75% of sessions.
- Or (explicit turn-count mode) a session's turn count is itself a lognormal, cut short at the context limit.
Subagents are ours (AIPerf has none): a subagent's first prompt is its parent's prompt and answer at the turn
that spawns it plus a task, so it shares its parent's prefix, as the AgentX study's subagent branches do.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from cerevisor_tui.replay.trace import BLOCK_TOKENS, TraceTurn


@dataclass(frozen=True)
class Lognormal:
    """A lognormal given by its real-space mean and median, drawn again outside [min_value, max_value]."""

    mean: float
    median: float
    min_value: float | None = None
    max_value: float | None = None

    @property
    def mu(self) -> float:
        return math.log(self.median)

    @property
    def sigma(self) -> float:
        ratio = self.mean / self.median
        return math.sqrt(2 * math.log(ratio)) if ratio > 1 else 0.0

    def sample(self, rng: random.Random) -> float:
        mu, sigma = self.mu, self.sigma
        value = rng.lognormvariate(mu, sigma)
        for _ in range(100):
            if (self.min_value is None or value >= self.min_value) and (
                    self.max_value is None or value <= self.max_value):
                return value
            value = rng.lognormvariate(mu, sigma)
        low = self.min_value if self.min_value is not None else value
        high = self.max_value if self.max_value is not None else value
        return min(max(value, low), high)


@dataclass(frozen=True)
class Preset:
    """A workload: the layer model's parameters, and where its figures come from."""

    name: str
    source: str
    new_tokens: Lognormal
    output_tokens: Lognormal
    agentic_gap_ms: Lognormal | None  # None: no gap between turns
    human_gap_ms: Lognormal | None
    session_tokens: Lognormal  # L2: what a session starts with beyond the shared layers
    shared_tokens: int  # L1: tools and system prompt, every session
    group_tokens: int  # L1.5: a group's repository context
    groups: int = 100
    zipf_alpha: float = 0.6
    agentic_fraction: float = 0.7
    max_prompt_tokens: int = 200_000
    output_min_tokens: int = 30
    reset_base_probability: float = 0.0
    reset_context_scaling: float = 1.0
    restart_probability: float = 0.0
    restart_turns: tuple[int, int] = (5, 15)  # [low, high): the turn a restart splits at
    restart_decay_end: float = 0.75  # restarts' chance reaches 0 this far through the sessions
    turns: Lognormal | None = None  # explicit turn-count mode
    subagent_share: float = 0.0  # top-level sessions that spawn subagents
    subagents_most: int = 3  # a spawning session has 1 to this many
    subagent_turns: Lognormal | None = None
    default_sessions: int = 100


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="aiperf-inference-day",
            source="AIPerf agentic-code configs/inference-day-2026.json; reference trace 1,131 sessions "
                   "(seed 42): medians 11 turns, first context 47.3K, 3.9K new tokens a turn, 786 output, 2.0 s gap",
            new_tokens=Lognormal(6000, 4000, max_value=50_000),
            output_tokens=Lognormal(1000, 800, max_value=10_000),
            agentic_gap_ms=Lognormal(5000, 2000),
            human_gap_ms=Lognormal(30_000, 15_000),
            session_tokens=Lognormal(15_000, 5000, max_value=50_000),
            shared_tokens=32_000,
            group_tokens=10_000,
            reset_base_probability=0.05,
            reset_context_scaling=1.5,
            restart_probability=0.3,
            default_sessions=1131,
        ),
        Preset(
            name="agentx",
            source="vLLM AgentX study (2026-09-08): median 43 turns, median input 142K tokens and output 444 "
                   "a turn, prefix hits > 95%, 44% of sessions spawn subagents (DeepSeek V4 Pro, 12 GB300)",
            new_tokens=Lognormal(2200, 1400, max_value=40_000),
            output_tokens=Lognormal(640, 444, max_value=8000),
            agentic_gap_ms=Lognormal(5000, 2000),
            human_gap_ms=Lognormal(30_000, 15_000),
            session_tokens=Lognormal(30_000, 20_000, max_value=120_000),
            shared_tokens=24_000,
            group_tokens=12_000,
            max_prompt_tokens=1_000_000,
            turns=Lognormal(52, 43, min_value=4, max_value=200),
            subagent_share=0.44,
            subagent_turns=Lognormal(12, 8, min_value=2, max_value=60),
            default_sessions=256,
        ),
        Preset(
            name="tiered-offload",
            source="vLLM tiered KV offloading study (2026-09-10): 12K initial tokens + 2K per round, 8 rounds "
                   "(the answer, 200 tokens, and no gap are ours: the study gives the inputs)",
            new_tokens=Lognormal(2000, 2000),
            output_tokens=Lognormal(200, 200),
            agentic_gap_ms=None,
            human_gap_ms=None,
            session_tokens=Lognormal(12_000, 12_000),
            shared_tokens=0,
            group_tokens=0,
            agentic_fraction=1.0,
            output_min_tokens=1,
            turns=Lognormal(8, 8),
            default_sessions=128,
        ),
    )
}
"""The presets `replay generate --preset` knows, by name."""

MAX_SESSIONS = 5000
"""The most sessions one file may hold: the file is built in memory, and 5,000 `agentx` sessions (about 300,000
turns of ~300 block ids each) take ~1 GB; more is several files with different seeds."""


@dataclass
class _Session:
    session_id: str
    parent: str | None = None
    turns: list[TraceTurn] = field(default_factory=list)
    prompts: list[int] = field(default_factory=list)  # each turn's whole prompt, tokens
    subagents: dict[int, list[_Session]] = field(default_factory=dict)  # by the turn index that spawns them

    def lines(self) -> Iterator[TraceTurn]:
        """Its turns in file order: each subagent's right after the turn of this session that spawns it."""
        for index, turn in enumerate(self.turns):
            yield turn
            for child in self.subagents.get(index, ()):
                yield from child.turns


class _Generator:
    """One preset's sessions for one seed: the same seed, the same file."""

    def __init__(self, preset: Preset, seed: int) -> None:
        self.preset = preset
        self.rng = random.Random(seed)
        self.shared_ids = list(range(math.ceil(preset.shared_tokens / BLOCK_TOKENS)))
        self.group_blocks = math.ceil(preset.group_tokens / BLOCK_TOKENS)
        self.next_id = len(self.shared_ids) + preset.groups * self.group_blocks
        weights = [1 / k**preset.zipf_alpha for k in range(1, preset.groups + 1)]
        total = sum(weights)
        running = 0.0
        self.group_cumulative = []
        for weight in weights:
            running += weight / total
            self.group_cumulative.append(running)

    def sessions(self, count: int) -> list[_Session]:
        """`count` top-level sessions in file order, their restart continuations placed later."""
        preset = self.preset
        placed: list[_Session] = []
        later: list[tuple[_Session, _Session]] = []
        for index in range(count):
            progress = index / max(1, count - 1)
            chance = preset.restart_probability * max(0.0, 1 - progress / preset.restart_decay_end)
            restart = preset.turns is None and self.rng.random() < chance
            primary, continuation = self._session(f"s{index + 1:05d}", restart)
            placed.append(primary)
            if preset.subagent_share and self.rng.random() < preset.subagent_share:
                self._spawn(primary)
            if continuation is not None:
                later.append((primary, continuation))
        min_gap = max(1, int(count * 0.02))
        for primary, continuation in later:
            low = placed.index(primary) + min_gap
            placed.insert(self.rng.randint(min(low, len(placed)), len(placed)), continuation)
        return placed

    # ---- one session ----------------------------------------------------------------------------------
    def _session(self, session_id: str, restart: bool) -> tuple[_Session, _Session | None]:
        preset = self.preset
        session = _Session(session_id)
        group = bisect.bisect_left(self.group_cumulative, self.rng.random())
        group = min(group, preset.groups - 1)
        fixed = preset.shared_tokens + preset.group_tokens
        first = min(fixed + max(1, round(preset.session_tokens.sample(self.rng))), preset.max_prompt_tokens - 1)
        base = self._group_base(group)
        blocks = self._extend(self.shared_ids + list(range(base, base + self.group_blocks)), first)
        self._add(session, first, first, blocks, 0.0)
        if preset.turns is not None:
            target = round(preset.turns.sample(self.rng))
            self._grow(session, target)
            return session, None
        low, high = preset.restart_turns
        split_at = self.rng.randrange(low, high) if restart else -1
        if not self._grow(session, None, split_at=split_at):
            return session, None
        carried = min(session.prompts[-1] + session.turns[-1].output_length, preset.max_prompt_tokens - 1)
        continuation = _Session(f"{session_id}-r1")
        self._add(continuation, carried, carried, self._extend(session.turns[-1].hash_ids, carried), 0.0)
        self._grow(continuation, None)
        return session, continuation

    def _grow(self, session: _Session, target: int | None, split_at: int = -1) -> bool:
        """Add turns until `target` turns (explicit mode), the context limit, or a reset; True when it stopped
        at `split_at` turns for a restart."""
        preset = self.preset
        while target is None or len(session.turns) < target:
            if len(session.turns) == split_at:
                return True
            prompt, answer = session.prompts[-1], session.turns[-1].output_length
            delay_ms = self._gap_ms(prompt)
            new = max(1, round(preset.new_tokens.sample(self.rng)))
            whole = prompt + answer + new
            if whole >= preset.max_prompt_tokens:
                break
            if preset.reset_base_probability and self.rng.random() < self._reset_chance(whole):
                break
            self._add(session, new, whole, self._extend(session.turns[-1].hash_ids, whole), delay_ms)
        return False

    def _spawn(self, parent: _Session) -> None:
        """Give `parent` 1 to `subagents_most` subagents, each spawned by the answer to one of its turns."""
        preset = self.preset
        assert preset.subagent_turns is not None
        for number in range(1, self.rng.randint(1, preset.subagents_most) + 1):
            at = self.rng.randrange(len(parent.turns))  # the parent's turn whose answer spawns it
            task = max(1, round(preset.new_tokens.sample(self.rng)))
            first = parent.prompts[at] + parent.turns[at].output_length + task
            if first >= preset.max_prompt_tokens:
                continue
            child = _Session(f"{parent.session_id}-a{number}", parent=parent.session_id)
            blocks = self._extend(parent.turns[at].hash_ids, first)
            self._add(child, first, first, blocks, self._gap_ms(first))
            self._grow(child, round(preset.subagent_turns.sample(self.rng)))
            parent.subagents.setdefault(at, []).append(child)

    # ---- the layer model's parts ----------------------------------------------------------------------
    def _group_base(self, group: int) -> int:
        return len(self.shared_ids) + group * self.group_blocks

    def _extend(self, blocks: list[int], whole: int) -> list[int]:
        """A prompt of `whole` tokens that starts with `blocks`: cut to it, or extended with fresh blocks."""
        needed = math.ceil(whole / BLOCK_TOKENS)
        if len(blocks) >= needed:
            return blocks[:needed]
        fresh = list(range(self.next_id, self.next_id + needed - len(blocks)))
        self.next_id += len(fresh)
        return blocks + fresh

    def _add(self, session: _Session, new: int, whole: int, blocks: list[int], delay_ms: float) -> None:
        preset = self.preset
        output = max(preset.output_min_tokens, round(preset.output_tokens.sample(self.rng)))
        session.turns.append(TraceTurn(
            session_id=session.session_id, turn=len(session.turns) + 1, input_length=new,
            output_length=output, hash_ids=blocks, delay_ms=round(delay_ms, 1),
            parent=session.parent if not session.turns else None,
        ))
        session.prompts.append(whole)

    def _gap_ms(self, prompt: int) -> float:
        preset = self.preset
        agentic = self.rng.random() < preset.agentic_fraction
        gap = preset.agentic_gap_ms if agentic else preset.human_gap_ms
        if gap is None:
            return 0.0
        return gap.sample(self.rng) * max(0.2, 1 - 0.8 * prompt / preset.max_prompt_tokens)

    def _reset_chance(self, whole: int) -> float:
        preset = self.preset
        return preset.reset_base_probability * (
            1 + (preset.reset_context_scaling - 1) * whole / preset.max_prompt_tokens)


def generate(preset: Preset | str, sessions: int | None = None, seed: int = 42) -> list[TraceTurn]:
    """The turns of `sessions` top-level sessions of `preset` (default: the preset's own count), file order."""
    if isinstance(preset, str):
        try:
            preset = PRESETS[preset]
        except KeyError:
            raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})") from None
    count = preset.default_sessions if sessions is None else sessions
    if not 1 <= count <= MAX_SESSIONS:
        raise ValueError(f"sessions must be 1 to {MAX_SESSIONS:,}, not {count:,} (for more, write several files "
                         "with different seeds)")
    return [turn for session in _Generator(preset, seed).sessions(count) for turn in session.lines()]
