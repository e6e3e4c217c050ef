"""SSE frames as the gateway relays them: cut only at frame ends (searched once per byte, bounded in length), split,
read for llama-server's prompt_progress, and rid of the usage chunk the gateway asked for itself."""

from __future__ import annotations

from typing import Any

import msgspec

from cerevisor_tui.endpoints import bounds

FRAME_LIMIT_BYTES = 8 << 20  # the longest SSE frame relayed: a model's chunk is bytes to kilobytes


class FrameTooLong(Exception):
    """An upstream's SSE frame grew past FRAME_LIMIT_BYTES without its end."""


class Frames:
    """What a relayed stream has sent past its last complete SSE frame. Each read is searched from where the
    search before it stopped, so a frame that grows read by read costs its length once, not once per read (a
    24 MiB frame in 64 KiB reads was 10-20 s of the run's loop); one over FRAME_LIMIT_BYTES raises FrameTooLong."""

    def __init__(self, limit_bytes: int = FRAME_LIMIT_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._data = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        """Take one read; returns the complete frames it ends (b"" while none is)."""
        data = self._data
        if not data and chunk[-2:] == b"\n\n":  # the usual read: whole frames, nothing held (no copy made)
            return chunk
        searched = len(data)  # what is held has no frame end in it: only the new bytes, and a straddling end, are new
        data += chunk
        end = frames_end(data, max(0, searched - 3))
        if end == 0:
            if len(data) > self.limit_bytes:
                raise FrameTooLong(f"sent a frame over {self.limit_bytes // (1 << 20)} MiB without ending it")
            return b""
        frames = bytes(data[:end])
        del data[:end]
        return frames

    def rest(self) -> bytes:
        """What came after the last frame end, as the stream ended."""
        return bytes(self._data)


def frames_end(data: bytes | bytearray, start: int = 0) -> int:
    """Where the last complete SSE frame in `data` ends, looking from `start` (0: none is complete yet)."""
    end = data.rfind(b"\n\n", start)
    crlf = data.rfind(b"\r\n\r\n", start)
    return max(end + 2 if end >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def split_frames(data: bytes) -> list[bytes]:
    """Complete SSE frames, each with its blank line."""
    data = data.replace(b"\r\n", b"\n")
    return [part + b"\n\n" for part in data.split(b"\n\n") if part]


def frame_progress(frame: bytes) -> tuple[dict[str, Any], tuple[int, int, int, int]] | None:
    """A frame that carries llama-server's prompt_progress: its JSON and (total, cache, processed, time_ms)."""
    if b'"prompt_progress"' not in frame:
        return None
    data = b"\n".join(line[5:].lstrip(b" ") for line in frame.split(b"\n") if line.startswith(b"data:"))
    try:
        obj = msgspec.json.decode(data)
        p = obj["prompt_progress"]
        told = bounds.prompt_progress(p["total"], p.get("cache", 0), p["processed"], p.get("time_ms", 0))
    except (msgspec.DecodeError, KeyError, TypeError, AttributeError, RecursionError):
        return None  # not the shape we know: relayed as it came
    return None if told is None else (obj, told)  # numbers that cannot be true: relayed, not believed


def without_usage_chunks(frames: bytes) -> bytes:
    """The frames less each chat chunk that carries only usage (no choices): asked by the gateway, not the client."""
    kept = []
    for frame in split_frames(frames):
        if b'"usage"' in frame and b'"choices":[]' in frame.replace(b" ", b""):
            continue
        kept.append(frame)
    return b"".join(kept)
