"""Published traces read into the replay file: Mooncake, Weka and TraceLab.

- mooncake: JSON lines `{"timestamp", "input_length", "output_length", "hash_ids"}` (kvcache-ai/Mooncake's
  traces: each line a request, its whole prompt's 512-token blocks; `timestamp` in ms). Lines with a
  `session_id` are AIPerf's multi-turn flavour (agentic_code_gen/writer.py): the first row of a session holds
  its whole first prompt, later rows the new tokens (`input_length`, their own blocks) and `delay` (ms).
- weka: Weka's KV-cache-tester traces, a JSON object per trace (a file of one, JSON lines, or a directory of
  `.json` files, read in name order):
  `id`, `block_size`, `hash_id_scope` (local | global), `requests` of `{"t", "type": "n"|"s", "in", "out",
  "hash_ids", "think_time"?, "api_time"?}` and `{"type": "subagent", "agent_id", "requests": [...]}`
  (field names as aiperf's weka adapter reads them: dataset/graph/adapters/weka/trace_models.py).
- tracelab: uw-syfi/TraceLab's normalized round trace, JSON lines: `session_id`, `round_index`,
  `input_tokens_total`, `output_tokens`, `tools` (each with `tool_internal_latency_ms` or
  `tool_wall_latency_ms`: the gap after the round, as its csv_export sums it). It has no blocks: each session's
  prompt is its own blocks, each round extending the one before.

A turn whose prompt does not extend the previous one (a compaction, a branch) starts a new session named
`<id>~<n>`; blocks of another size than 512 tokens are re-blocked so that the same prefix keeps the same ids.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cerevisor_tui.replay.trace import (
    BLOCK_TOKENS,
    MAX_DELAY_MS,
    MAX_PROMPT_TOKENS,
    TraceError,
    TraceTurn,
    numbered_lines,
)

Format = Literal["mooncake", "weka", "tracelab"]
FORMATS: tuple[Format, ...] = ("mooncake", "weka", "tracelab")


def import_trace(path: str | Path, fmt: str) -> list[TraceTurn]:
    """The turns of the published trace at `path` in format `fmt`, as the replay file holds them."""
    path = Path(path)
    readers = {"mooncake": _mooncake, "weka": _weka, "tracelab": _tracelab}
    if fmt not in readers:
        raise TraceError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    turns = readers[fmt](path)
    if not turns:
        raise TraceError(f"{path}: no requests to import")
    return turns


# ---- shared parts -----------------------------------------------------------------------------------------
class _Ids:
    """New block ids, one per distinct key: the same key (a source block, a re-blocked run) the same id."""

    def __init__(self) -> None:
        self.ids: dict[Hashable, int] = {}

    def of(self, key: Hashable) -> int:
        return self.ids.setdefault(key, len(self.ids))

    def fresh(self, count: int) -> list[int]:
        return [self.of(object()) for _ in range(count)]


@dataclass(frozen=True)
class _Last:
    """A source session's last request as written: under which name, its turn, prompt, blocks and answer."""

    name: str
    turn: int
    prompt: int
    source: list[Any]  # its blocks as the trace names them
    blocks: list[int]  # its blocks in the replay file
    answer: int


@dataclass
class _Builder:
    """Turns of imported sessions, split where a prompt stops extending the one before."""

    ids: _Ids = field(default_factory=_Ids)
    turns: list[TraceTurn] = field(default_factory=list)
    last: dict[str, _Last] = field(default_factory=dict)
    splits: dict[str, int] = field(default_factory=dict)

    def add(self, session: str, whole: int, output: int, source: list[Any], blocks: list[int],
            delay_ms: float, where: str, parent: str | None = None) -> None:
        """A request of `session` with a prompt of `whole` tokens whose own blocks are `source` (compared to
        the previous request's to tell an extension) and `blocks` (its ids in the replay file)."""
        if whole > MAX_PROMPT_TOKENS or output > MAX_PROMPT_TOKENS:
            raise TraceError(f"{where}: a prompt of {whole:,} tokens and an answer of {output:,}: past the "
                             f"{MAX_PROMPT_TOKENS:,} a replay takes")
        if delay_ms > MAX_DELAY_MS:
            raise TraceError(f"{where}: a gap of {delay_ms / 3_600_000:,.0f} hours before a request: past the "
                             f"{MAX_DELAY_MS / 3_600_000:.0f} a replay takes")
        blocks = self.pad(blocks, whole)
        last = self.last.get(session)
        if last is not None and source[: len(last.source)] == last.source and whole >= last.prompt:
            new = max(0, whole - last.prompt - last.answer)
            self._emit(last.name, last.turn + 1, new, output, blocks, delay_ms, None)
            self.last[session] = _Last(last.name, last.turn + 1, whole, source, blocks, output)
            return
        if last is None:
            name = session
        else:  # a compaction or a branch: the prompt starts over
            self.splits[session] = self.splits.get(session, 1) + 1
            name, parent = f"{session}~{self.splits[session]}", None
        self._emit(name, 1, whole, output, blocks, delay_ms, parent)
        self.last[session] = _Last(name, 1, whole, source, blocks, output)

    def _emit(self, name: str, turn: int, new: int, output: int, blocks: list[int], delay_ms: float,
              parent: str | None) -> None:
        self.turns.append(TraceTurn(session_id=name, turn=turn, input_length=new, output_length=output,
                                    hash_ids=blocks, delay_ms=round(max(0.0, float(delay_ms)), 1), parent=parent))

    def pad(self, blocks: list[int], whole: int) -> list[int]:
        """Exactly ceil(whole / 512) ids: a trace that covers only full blocks gets a fresh tail block."""
        needed = math.ceil(whole / BLOCK_TOKENS)
        return blocks[:needed] + self.ids.fresh(max(0, needed - len(blocks)))


def _json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, line in numbered_lines(path):
        try:
            record = _loads(line)
        except ValueError as exc:
            raise TraceError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise TraceError(f"{path}:{number}: not a JSON object")
        yield number, record


def _loads(text: str | bytes) -> Any:
    """JSON, or a ValueError that says why not (nesting too deep for the parser included)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _field(record: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str,
           default: Any = ..., minimum: float | None = 0, maximum: float | None = None) -> Any:
    """`record[name]`, checked: of `kind` (bool is not a number; a float is finite), within its bounds."""
    if name not in record or record[name] is None:
        if default is ...:
            raise TraceError(f"{where}: {name}: missing")
        return default
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TraceError(f"{where}: {name}: expected {names}, got {json.dumps(value)[:40]}")
    if isinstance(value, float) and not math.isfinite(value):
        raise TraceError(f"{where}: {name}: must be a finite number, got {value}")
    if minimum is not None and isinstance(value, int | float) and value < minimum:
        raise TraceError(f"{where}: {name}: must be at least {minimum}, got {value}")
    if maximum is not None and isinstance(value, int | float) and value > maximum:
        raise TraceError(f"{where}: {name}: must be at most {maximum:,}, got {value:,}")
    return value


def _tokens(record: dict[str, Any], name: str, where: str) -> int:
    return _field(record, name, int, where, maximum=MAX_PROMPT_TOKENS)


def _id_list(record: dict[str, Any], name: str, where: str) -> list[int]:
    values = _field(record, name, list, where, default=[])
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TraceError(f"{where}: {name}[{index}]: expected an int >= 0, got {json.dumps(value)[:40]}")
    return values


# ---- mooncake ---------------------------------------------------------------------------------------------
def _mooncake(path: Path) -> list[TraceTurn]:
    builder = _Builder()
    start_ms: float | None = None
    for number, record in _json_lines(path):
        where = f"{path}:{number}"
        whole_or_new = _tokens(record, "input_length", where)
        output = _tokens(record, "output_length", where)
        source = _id_list(record, "hash_ids", where)
        stamp = _field(record, "timestamp", (int, float), where, default=None)
        session = _field(record, "session_id", str, where, default=None)
        last = builder.last.get(session) if session is not None else None
        if last is None:
            if stamp is not None:
                start_ms = stamp if start_ms is None else start_ms
            delay_ms = stamp - start_ms if stamp is not None and start_ms is not None else 0.0
            name = session if session is not None else f"m{number:06d}"
            blocks = [builder.ids.of(block) for block in source]
            builder.add(name, whole_or_new, output, blocks, blocks, delay_ms, where)
            continue
        # AIPerf's multi-turn rows: new tokens and their own blocks, after the previous prompt and answer
        whole = last.prompt + last.answer + whole_or_new
        delay_ms = _field(record, "delay", (int, float), where, default=0.0)
        builder.add(session, whole, output, last.source, last.blocks, delay_ms, where)
    return builder.turns


# ---- weka -------------------------------------------------------------------------------------------------
def _weka(path: Path) -> list[TraceTurn]:
    builder = _Builder()
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise TraceError(f"{path}: a directory without .json traces")
    for file in files:
        for where, trace in _weka_traces(file):
            _weka_trace(trace, where, builder)
    return builder.turns


def _weka_traces(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The traces of one file: the file one JSON object, or JSON lines of them."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        whole = _loads(text)
    except ValueError:
        for number, record in _json_lines(path):
            yield f"{path}:{number}", record
        return
    if not isinstance(whole, dict):
        raise TraceError(f"{path}: not a JSON object")
    yield str(path), whole


def _weka_trace(trace: dict[str, Any], where: str, builder: _Builder) -> None:
    trace_id = _field(trace, "id", str, where)
    block_size = _field(trace, "block_size", int, where, minimum=1)
    scope = _field(trace, "hash_id_scope", str, where, default="local")
    if scope not in ("local", "global"):
        raise TraceError(f"{where}: hash_id_scope: expected local or global, got {scope!r}")
    if BLOCK_TOKENS % block_size and block_size % BLOCK_TOKENS:
        raise TraceError(f"{where}: block_size: {block_size}-token blocks cannot be re-blocked into "
                         f"{BLOCK_TOKENS}-token blocks (neither divides the other)")
    namespace = trace_id if scope == "local" else ""
    requests = _field(trace, "requests", list, where)
    _weka_requests(requests, trace_id, None, f"{where}: trace {trace_id!r}", block_size, namespace, builder)


def _weka_requests(requests: list[Any], session: str, parent: str | None, where: str, block_size: int,
                   namespace: str, builder: _Builder, answered_at: float | None = None) -> None:
    """A session's requests; `answered_at`: when the request before the first was answered (a subagent's
    parent's), in the trace's seconds."""
    for index, request in enumerate(requests):
        at = f"{where} requests[{index}]"
        if not isinstance(request, dict):
            raise TraceError(f"{at}: not a JSON object")
        kind = _field(request, "type", str, at)
        t = _field(request, "t", (int, float), at)
        think = _field(request, "think_time", (int, float), at, default=None)
        if kind == "subagent":
            agent = _field(request, "agent_id", str, at)
            inner = _field(request, "requests", list, at)
            if session not in builder.last:
                raise TraceError(f"{at}: a subagent before its parent's first request")
            _weka_requests(inner, f"{session}/{agent}", session, f"{where} subagent {agent!r}", block_size,
                           namespace, builder, answered_at)
            continue
        if kind not in ("n", "s"):
            raise TraceError(f"{at}: type: expected n, s or subagent, got {kind!r}")
        whole = _tokens(request, "in", at)
        output = _tokens(request, "out", at)
        source = _id_list(request, "hash_ids", at)
        api_s = _field(request, "api_time", (int, float), at, default=None)
        if think is not None:
            delay_ms = think * 1000
        else:
            delay_ms = (t - answered_at) * 1000 if answered_at is not None else 0.0
        keyed = [(namespace, block) for block in source]
        builder.add(session, whole, output, keyed, _reblock(keyed, block_size, builder.ids), delay_ms, at,
                    parent=parent)
        answered_at = t + api_s if api_s is not None else t


def _reblock(source: list[tuple[str, int]], block_size: int, ids: _Ids) -> list[int]:
    """`source` blocks of `block_size` tokens as 512-token block ids: each new block named by the source
    blocks it covers and the block before it, so the same prefix gives the same ids."""
    if block_size == BLOCK_TOKENS:
        return [ids.of(key) for key in source]
    if block_size > BLOCK_TOKENS:
        return [ids.of((key, part)) for key in source for part in range(block_size // BLOCK_TOKENS)]
    per = BLOCK_TOKENS // block_size
    out: list[int] = []
    previous = -1
    for start in range(0, len(source), per):
        previous = ids.of((previous, tuple(source[start:start + per])))
        out.append(previous)
    return out


# ---- tracelab ---------------------------------------------------------------------------------------------
def _tracelab(path: Path) -> list[TraceTurn]:
    rounds: dict[str, list[tuple[int, int, dict[str, Any], str]]] = {}
    for number, record in _json_lines(path):
        session = record.get("session_id")
        if not isinstance(session, str) or not session:
            continue  # as TraceLab's own csv_export: a round without a session is not part of one
        where = f"{path}:{number}"
        index = _field(record, "round_index", int, where)
        rounds.setdefault(session, []).append((index, number, record, where))
    builder = _Builder()
    for session, items in rounds.items():
        items.sort(key=lambda item: (item[0], item[1]))
        wait_ms = 0.0
        for _, _, record, where in items:
            whole = _tokens(record, "input_tokens_total", where)
            output = _tokens(record, "output_tokens", where)
            last = builder.last.get(session)
            blocks = builder.pad(last.blocks if last is not None and whole >= last.prompt else [], whole)
            builder.add(session, whole, output, blocks, blocks, wait_ms, where)
            wait_ms = _tool_wait_ms(record, where)
    return builder.turns


def _tool_wait_ms(record: dict[str, Any], where: str) -> float:
    """The tools' time after a round: each call's own duration, else its wall time (TraceLab's rule)."""
    total = 0.0
    for index, tool in enumerate(_field(record, "tools", list, where, default=[])):
        if not isinstance(tool, dict):
            raise TraceError(f"{where}: tools[{index}]: not a JSON object")
        at = f"{where}: tools[{index}]"
        internal = _field(tool, "tool_internal_latency_ms", (int, float), at, default=None, minimum=None)
        wall = _field(tool, "tool_wall_latency_ms", (int, float), at, default=None, minimum=None)
        latency = internal if internal is not None else wall
        if latency is not None and latency > 0:
            total += latency
    return total
