"""The operator's commands to a run, one tagged union: what a console's keys send, in-process or over the run's
control socket, and what `Engine.handle` carries out.

Each command is a msgspec Struct tagged by its name in the field "name" (`Kill` is "kill"), its values bounded
as the config bounds them, so a command from a socket client is checked on the way in exactly as one built
in the console. A new command is one class here and one case in `Engine.handle`. What a command changes comes
back as events; the run's `Answer` (what it did, or why it refused) is the same in-process and over the socket.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import msgspec

from cerevisor_tui.contract.events import StallPolicy
from cerevisor_tui.kinds import Mode

MAX_CAP = 4096
"""The largest cap a command may set: `[run] max_concurrency`'s bound."""
MAX_EXTEND_S = 7 * 24 * 3600.0
"""The longest extension one `extend` may give (a week): a deadline is the operator's, not a typo's."""

Cap = Annotated[int, msgspec.Meta(ge=1, le=MAX_CAP)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_EXTEND_S)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Reason = Annotated[str, msgspec.Meta(max_length=1024)]


def _name(cls_name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls_name).lower()


class Command(msgspec.Struct, frozen=True, kw_only=True, tag_field="name", tag=_name, forbid_unknown_fields=True):
    """An operator command; `name` (its tag) is the class's name in snake case."""

    @property
    def name(self) -> str:
        return type(self).__struct_config__.tag  # type: ignore[return-value]


class SetMode(Command, frozen=True):
    """sequential | parallel | auto, now; running agents are never stopped by it. Returns the mode."""

    mode: Mode


class CycleMode(Command, frozen=True):
    """The next mode (sequential -> parallel -> auto -> sequential); returns it."""


class SetConcurrency(Command, frozen=True):
    """The parallel cap; lowering it only holds admissions. Returns the cap in force."""

    cap: Cap


class NudgeCap(Command, frozen=True):
    """`+`/`-`: the parallel cap, or in auto mode its ceiling, moved by `delta`; returns the new value."""

    delta: Annotated[int, msgspec.Meta(ge=-MAX_CAP, le=MAX_CAP)]


class Pause(Command, frozen=True):
    """Hold new admissions; running agents go on."""


class Resume(Command, frozen=True):
    """Admit again."""


class Kill(Command, frozen=True):
    """Close the agent's running request (no retry follows) or drop it from the queue; in a tool call, the call
    is cancelled and the model told so. Returns False when it had ended."""

    agent: Name
    reason: Reason = "killed by operator"


class Release(Command, frozen=True):
    """Give an idle gateway session's slot back now, not `release_after_s` after its last request: the next one
    waiting is admitted, and its own next request waits for a slot again. Refused for a workflow agent and for a
    session with a request in flight or queued; returns False when it held no slot."""

    agent: Name


class Extend(Command, frozen=True):
    """Move the running attempt's deadline later (`seconds`, default [stall].extend_s), or the running tool
    call's tool deadline. Returns False when nothing runs."""

    agent: Name
    seconds: Seconds | None = None


class Retry(Command, frozen=True):
    """Restart the running attempt, or run a failed/killed agent of the current wave again; returns which."""

    agent: Name


class Approve(Command, frozen=True):
    """Let a tool call that waits for approval run: "once" (this call) or "run" (this tool, for the rest of the
    run, kept by --resume). Returns the scope."""

    agent: Name
    call_id: Name
    scope: Literal["once", "run"] = "once"


class Deny(Command, frozen=True):
    """Refuse a tool call that waits for approval: the model gets a result saying the operator denied it."""

    agent: Name
    call_id: Name


class SetStall(Command, frozen=True):
    """An endpoint's whole stall policy (RunStarted's `stall`), checked as `[stall]` is; returns whether it
    changed."""

    endpoint: Name
    policy: StallPolicy


class SetGateway(Command, frozen=True):
    """The `[gateway]` keys that apply live (the settings screen), each bounded as the config bounds it; returns the
    names of those that changed, comma-separated ("" when none did)."""

    release_after_s: Annotated[float, msgspec.Meta(ge=0, le=86400)]
    max_sessions_per_key: Annotated[int, msgspec.Meta(ge=1, le=100000)]
    keepalive_s: Annotated[float, msgspec.Meta(gt=0, le=300)]
    down_after_s: Annotated[float, msgspec.Meta(gt=0, le=86400)]


class Stop(Command, frozen=True):
    """Stop the run: no more admissions; running and queued agents are cancelled (RunStopping, then RunFinished)."""

    reason: Reason = "run stopped"


class Probe(Command, frozen=True):
    """Sweep an endpoint of the run in the background; it reports through Probe* events."""

    endpoint: Name
    max_concurrency: Cap | None = None


class CancelProbe(Command, frozen=True):
    """Cancel the endpoint's running probe (its requests are closed); returns False when none was running."""

    endpoint: Name


AnswerValue = str | int | float | bool | None
"""What a command did, as `Engine.handle` returns it."""


class Answer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A run's answer to a command, the same whether the console runs it in-process (engine/control.py) or over
    its socket (supervisor/client.py): `error`, the run's one line, when it refused the command; else `value`,
    what `Engine.handle` returned (the mode, the cap in force, False: nothing to do, a retry's outcome)."""

    value: AnswerValue = None
    error: str = ""

    @property
    def refused(self) -> bool:
        return bool(self.error)


COMMAND_TYPES: tuple[type[Command], ...] = tuple(Command.__subclasses__())
if TYPE_CHECKING:
    AnyCommand = Command  # a checker sees the base; msgspec decodes by the union of every command, built here
else:
    AnyCommand = Union[COMMAND_TYPES]  # noqa: UP007 (a union built at run time)
COMMANDS: frozenset[str] = frozenset(str(cls.__struct_config__.tag) for cls in COMMAND_TYPES)
"""The commands' names, as a client sends them."""


class CommandError(ValueError):
    """A command this version cannot take (an unknown name, a value out of bounds): one line for the client."""


def command_of(data: Any) -> Command:
    """The command a parsed JSON object holds (`{"name": "kill", "agent": "a"}`), checked; raises CommandError."""
    try:
        return msgspec.convert(data, AnyCommand)
    except msgspec.ValidationError as exc:
        raise CommandError(plain(str(exc))) from None


def checked(command: Command) -> Command:
    """The command, its values checked against their bounds: a Struct built in the console's own process is
    not checked until it is read this way (one from the socket was, as it was decoded)."""
    return command_of(msgspec.to_builtins(command))


def plain(problem: str) -> str:
    """msgspec's wording made the client's: `$.command.mode` and `$.mode` read as `mode`."""
    return re.sub(r"`\$(?:\.command)?\.?([^`]*)`", lambda m: f"`{m.group(1) or 'command'}`", problem)
