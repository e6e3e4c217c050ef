"""Remember each probe's recommended cap per endpoint and model, so a later run can start from it.

The store is one small JSON file in the user state dir (`probes.json`), keyed by the endpoint's base
URL and the model, holding the newest `MAX_ENTRIES` recommendations. It is rewritten whole through a
temp file and a rename, so a reader never sees half of it; reading never raises: a missing, unreadable
or malformed store is simply empty. Two probes that finish at the same moment may lose one's entry
(last writer wins), which costs a re-probe, never a wrong cap.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cerevisor_tui.config.paths import probe_store_file, write_json_atomic

SCHEMA_VERSION = 1
MAX_ENTRIES = 50


def save_recommendation(base_url: str, model: str, cap: int, mode: str, reason: str) -> None:
    """Record a probe's recommended `cap` for `model` at `base_url`; `mode` is the probe's own
    ("single-turn" or "conversation"). Raises OSError when the state dir cannot be written."""
    path = probe_store_file()
    entries = _read(path)
    key = _key(base_url, model)
    entries.pop(key, None)
    entries[key] = {
        "base_url": _url(base_url),
        "model": model,
        "cap": int(cap),
        "mode": mode,
        "reason": reason,
        "saved_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    newest = sorted(entries.items(), key=lambda kv: str(kv[1].get("saved_at", "")))[-MAX_ENTRIES:]
    write_json_atomic(path, {"schema_version": SCHEMA_VERSION, "probes": dict(newest)})


def saved_recommendation(base_url: str, model: str | None) -> dict[str, Any] | None:
    """{"cap", "mode", "reason", "saved_at"} of the newest probe of `model` at `base_url` (any model
    there when `model` is None or empty), or None when there is none or the store cannot be read."""
    entries = _read(probe_store_file())
    if model:
        key = _key(base_url, model)
        found = [entries[key]] if key in entries else []
    else:
        url = _url(base_url)
        found = [e for e in entries.values() if e.get("base_url") == url]
    found = [e for e in found if isinstance(e.get("cap"), int) and not isinstance(e["cap"], bool) and e["cap"] >= 1]
    if not found:
        return None
    entry = max(found, key=lambda e: str(e.get("saved_at", "")))
    return {"cap": entry["cap"], "mode": str(entry.get("mode", "")), "reason": str(entry.get("reason", "")),
            "saved_at": str(entry.get("saved_at", ""))}


def _url(base_url: str) -> str:
    return base_url.strip().rstrip("/")


def _key(base_url: str, model: str) -> str:
    return f"{_url(base_url)} {model}"


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    probes = data.get("probes") if isinstance(data, dict) else None
    if not isinstance(probes, dict):
        return {}
    return {str(k): v for k, v in probes.items() if isinstance(v, dict)}
