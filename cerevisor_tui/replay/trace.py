"""The replay file: one JSON line per turn of an agentic session, read line by line with every problem named.

A turn's whole prompt is the previous turn's prompt, its answer, and `input_length` new tokens (turn 1: the
whole first prompt), and it is the blocks `hash_ids` names, `BLOCK_TOKENS` tokens each, Mooncake style: the
same block id anywhere in a file is the same text, so a replay's prompts share exactly the prefixes the trace
says. `delay_ms` is the gap before the turn: after the previous answer, or for turn 1 after the replay's start.
A subagent (`parent` names its session) starts its turn 1 `delay_ms` after the answer to its parent's last
turn before that line: the file's order says which turn spawned it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, BinaryIO

import msgspec

BLOCK_TOKENS = 512
"""Tokens per hash block: Mooncake's and AIPerf's block size; an imported trace with another is re-blocked."""

MAX_LINE_BYTES = 16 * 1024 * 1024
"""A line past this is refused as it is read, never held whole: a 1M-token prompt's 2,000 ids take ~16 KB."""

MAX_PROMPT_TOKENS = 10_000_000
"""The longest prompt a replay file may hold (ten times the longest context windows served today): past it a
file is refused as it is read, before a replay builds the text."""

MAX_DELAY_MS = 7 * 24 * 3600 * 1000
"""The longest gap before a turn (a week: people leave sessions open over days, not longer)."""

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_PROMPT_TOKENS)]


class TraceTurn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One turn of one session."""

    session_id: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    turn: Annotated[int, msgspec.Meta(ge=1)]
    input_length: Tokens
    output_length: Tokens
    hash_ids: Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_PROMPT_TOKENS // BLOCK_TOKENS + 1)]
    delay_ms: Annotated[float, msgspec.Meta(ge=0, le=MAX_DELAY_MS)] = 0.0
    parent: str | None = None


class TraceError(Exception):
    """A replay file that cannot be read or written, said in one line (file, line, field)."""


_decoder = msgspec.json.Decoder(TraceTurn)
_encoder = msgspec.json.Encoder()


def read_trace(path: str | Path) -> list[TraceTurn]:
    """Every turn of the file at `path`, in file order, checked; a `TraceError` names the first problem."""
    return list(iter_trace(path))


def iter_trace(path: str | Path) -> Iterator[TraceTurn]:
    """The file's turns one by one: each line decoded and checked against the ones before it."""
    path = Path(path)
    last_turn: dict[str, int] = {}
    prompts: dict[str, int] = {}  # each session's last whole prompt and answer, tokens
    seen_any = False
    for number, line in numbered_lines(path):
        try:
            turn = _decoder.decode(line)
        except msgspec.ValidationError as exc:
            raise TraceError(f"{path}:{number}: {_field_problem(str(exc))}") from None
        except msgspec.DecodeError as exc:
            raise TraceError(f"{path}:{number}: not a JSON object ({exc})") from None
        _check_order(turn, last_turn, f"{path}:{number}")
        whole = turn.input_length + (prompts.get(turn.session_id, 0) if turn.turn > 1 else 0)
        if whole > MAX_PROMPT_TOKENS:
            raise TraceError(f"{path}:{number}: input_length: the prompt grows to {whole:,} tokens, past the "
                             f"{MAX_PROMPT_TOKENS:,} a replay takes")
        prompts[turn.session_id] = whole + turn.output_length
        seen_any = True
        yield turn
    if not seen_any:
        raise TraceError(f"{path}: no turns (an empty replay file)")


def numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """The file's lines that are not blank, each with its number (from 1); a line longer than
    `MAX_LINE_BYTES` is an error as soon as that much of it has been read."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    with handle:
        yield from _bounded_lines(handle, path)


def _bounded_lines(handle: BinaryIO, path: Path) -> Iterator[tuple[int, bytes]]:
    number = 0
    while line := handle.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(line) > MAX_LINE_BYTES:
            raise TraceError(f"{path}:{number}: line longer than {MAX_LINE_BYTES} bytes")
        if line.strip():
            yield number, line


def _field_problem(message: str) -> str:
    """msgspec's "Expected `int` >= 0 - at `$.hash_ids[2]`" as "hash_ids[2]: expected `int` >= 0"."""
    problem, _, where = message.partition(" - at `$")
    field = where.rstrip("`").lstrip(".")
    problem = problem[:1].lower() + problem[1:]
    return f"{field}: {problem}" if field else problem


def _check_order(turn: TraceTurn, last_turn: dict[str, int], where: str) -> None:
    """Turns of a session come in order from 1; a subagent names a session that came before it."""
    expected = last_turn.get(turn.session_id, 0) + 1
    if turn.turn != expected:
        raise TraceError(f"{where}: turn: session {turn.session_id!r} has turn {turn.turn} where turn "
                         f"{expected} was due")
    if turn.turn == 1 and turn.parent is not None and turn.parent not in last_turn:
        raise TraceError(f"{where}: parent: session {turn.parent!r} does not come before its subagent "
                         f"{turn.session_id!r}")
    last_turn[turn.session_id] = turn.turn


def write_trace(turns: Iterable[TraceTurn], path: str | Path) -> int:
    """Write `turns` to `path` atomically (a temp file renamed over it); returns how many were written."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    count = 0
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides, as for any file
    except OSError as exc:
        raise TraceError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as out:
            buffer = bytearray()
            for turn in turns:
                _encoder.encode_into(turn, buffer, len(buffer))
                buffer += b"\n"
                count += 1
                if len(buffer) > 1 << 20:
                    out.write(buffer)
                    buffer.clear()
            out.write(buffer)
        os.replace(temp, path)
    except BaseException as exc:
        temp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise TraceError(f"{path}: cannot write ({exc.strerror or exc})") from None
        raise
    return count


def whole_prompts(turns: Iterable[TraceTurn]) -> Iterator[tuple[TraceTurn, int]]:
    """Each turn with its whole prompt in tokens: the previous prompt, its answer and the new tokens."""
    previous: dict[str, tuple[int, int]] = {}
    for turn in turns:
        prompt, answer = previous.get(turn.session_id, (0, 0))
        whole = turn.input_length if turn.turn == 1 else prompt + answer + turn.input_length
        previous[turn.session_id] = (whole, turn.output_length)
        yield turn, whole
