"""Save the settings the console edits back into the TOML file, keeping everything else.

Only the managed keys change: every `[run]` and `[stall]` key, each endpoint's base_url, model,
kind, max_concurrency and timeouts (endpoints matched by name), and the numbers of `[gateway]` (a run that serves
one: a new file gets its whole table). Agents, other tables, unknown
tables and `api_key_env` names stay as they were. The file is written atomically (a temp file in the
same folder, fsynced, then renamed over the original) with tomli-w, which cannot keep comments: the
caller must allow that explicitly, and the original is then kept next to it as FILE.bak. The text is
checked before writing: it must load as a valid config and hold no API key value.
"""

from __future__ import annotations

import copy
import os
import shutil
import stat
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from cerevisor_tui.config.errors import ConfigError
from cerevisor_tui.config.load import validate
from cerevisor_tui.config.models import Config, GatewayConfig

ENDPOINT_KEYS = ("base_url", "model", "kind", "max_concurrency", "first_byte_timeout_s", "idle_timeout_s")
"""The endpoint keys the settings screen edits; every other endpoint key is left as the file has it."""
GATEWAY_KEYS = ("release_after_s", "max_sessions_per_key", "keepalive_s", "down_after_s", "forget_after_s",
                "max_body_mib", "header_timeout_s", "body_timeout_s", "max_connections", "max_connections_per_peer")
"""The `[gateway]` keys the settings screen edits (its numbers; where it listens, its upstream, keys and model_map
are left as the file has them)."""


class SaveError(Exception):
    """The settings could not be saved; the file is unchanged."""


class CommentsWouldBeLost(SaveError):
    """The file has comments that tomli-w cannot keep, and the caller did not allow dropping them."""


@dataclass(frozen=True)
class SaveResult:
    path: Path
    backup: Path | None  # the original, kept because its comments could not be
    created: bool


def has_comments(text: str) -> bool:
    """Whether TOML text holds a comment (a `#` outside every kind of string)."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            return True
        if c in "\"'":
            triple = text.startswith(c * 3, i)
            if triple:
                end = text.find(c * 3, i + 3)
                while c == '"' and end != -1 and _escaped(text, end):
                    end = text.find(c * 3, end + 1)
                if end == -1:
                    return False
                i = end + 3
                while i < n and text[i] == c:  # up to two quotes may close a multi-line string
                    i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if (c == '"' and text[j] == "\\") else 1
            i = j + 1
            continue
        i += 1
    return False


def _escaped(text: str, index: int) -> bool:
    backslashes = 0
    while index - 1 - backslashes >= 0 and text[index - 1 - backslashes] == "\\":
        backslashes += 1
    return backslashes % 2 == 1


def _set_or_drop(table: dict[str, Any], key: str, value: Any) -> None:
    """TOML has no null: a None value (use the default) removes the key."""
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


def merge_settings(document: dict[str, Any], config: Config) -> dict[str, Any]:
    """A copy of `document` with the managed keys taken from `config`; nothing else changes.

    An endpoint the document does not have is added whole (without any secret: the model has only
    `api_key_env`, a variable's name). A document with no `[[agents]]` gets the config's agents, so
    a saved demo still runs.
    """
    doc = copy.deepcopy(document)
    run = doc.setdefault("run", {})
    for key, value in config.run.model_dump().items():
        _set_or_drop(run, key, value)
    stall = doc.setdefault("stall", {})
    for key, value in config.stall.model_dump().items():
        _set_or_drop(stall, key, value)
    tables = doc.setdefault("endpoints", [])
    by_name = {t.get("name"): t for t in tables if isinstance(t, dict)}
    for ep in config.endpoints:
        table = by_name.get(ep.name)
        if table is None:
            table = ep.model_dump(exclude_defaults=True, exclude_none=True)
            table["name"] = ep.name
            table.setdefault("kind", ep.kind)
            tables.append(table)
            continue
        for key in ENDPOINT_KEYS:
            value = getattr(ep, key)
            if key not in table and value == type(ep).model_fields[key].default:
                continue  # still the default: do not add a key the file never had
            _set_or_drop(table, key, value)
    if config.gateway is not None:
        if not isinstance(doc.get("gateway"), dict):  # a new file for a gateway's run: its whole table
            doc["gateway"] = config.gateway.model_dump(exclude_defaults=True)
        gateway = doc["gateway"]
        for key in GATEWAY_KEYS:
            value = getattr(config.gateway, key)
            if key not in gateway and value == GatewayConfig.model_fields[key].default:
                continue
            gateway[key] = value
    if not doc.get("agents") and config.agents:
        doc["agents"] = [a.model_dump(exclude_defaults=True) for a in config.agents]
    return doc


def _secret_values(config: Config) -> list[tuple[str, str]]:
    found = []
    for ep in config.endpoints:
        value = os.environ.get(ep.api_key_env) if ep.api_key_env else None
        if value and len(value) >= 4:
            found.append((ep.api_key_env, value))
    return found


def render_settings(document: dict[str, Any], config: Config, *, file: str = "") -> str:
    """The TOML text to write, checked: it loads as a valid config and holds no API key value."""
    text = tomli_w.dumps(merge_settings(document, config), multiline_strings=True)
    for variable, value in _secret_values(config):
        if value in text:
            raise SaveError(f"refusing to save: the value of ${variable} (an API key) would be written to {file}")
    try:
        validate(tomllib.loads(text), file=file or None)
    except ConfigError as exc:
        raise SaveError(f"refusing to save an invalid config: {exc}") from None
    return text


def save_settings(path: str | os.PathLike[str], config: Config, *, template: str | None = None,
                  allow_comment_loss: bool = False) -> SaveResult:
    """Write `config`'s managed keys into the TOML file at `path`, atomically.

    `template`: TOML text to start from when the file does not exist yet (the demo workflow).
    Raises CommentsWouldBeLost when the file has comments and `allow_comment_loss` is false, and
    SaveError for anything else; the file is unchanged then.
    """
    path = Path(path)
    created = not path.exists()
    if created:
        original = template or ""
    else:
        try:
            original = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SaveError(f"{path}: cannot read: {exc}") from None
    try:
        document = tomllib.loads(original)
    except tomllib.TOMLDecodeError as exc:
        raise SaveError(f"{path}: invalid TOML, not overwriting it: {exc}") from None
    commented = not created and has_comments(original)
    if commented and not allow_comment_loss:
        raise CommentsWouldBeLost(f"{path} has comments that saving cannot keep")
    text = render_settings(document, config, file=str(path))

    backup = None
    if commented:
        backup = path.with_name(path.name + ".bak")
        try:
            shutil.copy2(path, backup)
        except OSError as exc:
            raise SaveError(f"cannot keep the original as {backup}: {exc.strerror or exc}") from None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = stat.S_IMODE(path.stat().st_mode) if not created else 0o644
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise SaveError(f"cannot write in {path.parent}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise SaveError(f"cannot write {path}: {exc.strerror or exc}") from None
    return SaveResult(path, backup, created)
