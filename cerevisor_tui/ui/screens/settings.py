"""The settings screen: every [run], [run.auto] and [stall] key, each endpoint's url, model, kind, cap
and timeouts, and, for a run that serves a gateway, the numbers of [gateway]. Each value is checked by the
config's own pydantic models as it is typed, and refused inline with the reason; save writes the file through
`config.save`, and mode, cap, the stall deadlines (`[stall]` and each endpoint's timeouts) and the gateway's
live keys (release_after_s, ...: `SetGateway`) apply at once. With no config file it asks where to save (a new
file), or applies without saving.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.events import DescendantFocus
from textual.screen import Screen
from textual.widgets import Input, Select, Static

from cerevisor_tui.config.errors import ConfigError
from cerevisor_tui.config.load import validate
from cerevisor_tui.config.models import (
    AutoConfig,
    Config,
    EndpointConfig,
    GatewayConfig,
    RunConfig,
    StallConfig,
    field_doc,
    resolve_stall,
)
from cerevisor_tui.config.paths import user_config_file
from cerevisor_tui.config.save import (
    ENDPOINT_KEYS,
    GATEWAY_KEYS,
    CommentsWouldBeLost,
    SaveError,
    save_settings,
)
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.ui.widgets.footer import Footer

if TYPE_CHECKING:
    from cerevisor_tui.ui.app import CerevisorApp

GATEWAY_LIVE: tuple[str, ...] = cmd.SetGateway.__struct_fields__
"""The [gateway] keys that apply at once (the run's `set_gateway`); the others from the next run."""

OPTIONAL_EMPTY = {("stall", "first_byte_timeout_s"), ("endpoint", "first_byte_timeout_s"),
                  ("endpoint", "idle_timeout_s")}
"""Fields where an empty value means "use the default" (or, on an endpoint, the [stall] value)."""


SECTION_TABLES = {"run": "[run]", "auto": "[run.auto]", "stall": "[stall]", "gateway": "[gateway]"}
"""The TOML table of each section of the form (an endpoint's is `[[endpoints]] NAME`)."""


@dataclass(frozen=True)
class FieldSpec:
    section: str  # "run" | "auto" | "stall" | "endpoint" | "gateway"
    index: int  # the endpoint's position; 0 otherwise
    key: str
    model: type[BaseModel]

    @property
    def id(self) -> str:
        return f"f-{self.section}-{self.index}-{self.key}"

    @property
    def help(self) -> str:
        text = field_doc(self.model, self.key)
        if (self.section, self.key) in OPTIONAL_EMPTY:
            text += " Empty: the default." if self.section == "stall" else " Empty: the [stall] value."
        if self.section == "gateway":
            text += " Applies at once." if self.key in GATEWAY_LIVE else " From the next run."
        return text

    @property
    def annotation(self) -> Any:
        """The field's type without `| None`."""
        ann = self.model.model_fields[self.key].annotation
        if typing.get_origin(ann) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            ann = args[0] if len(args) == 1 else ann
        return ann

    @property
    def choices(self) -> tuple[str, ...]:
        ann = self.annotation
        return tuple(typing.get_args(ann)) if typing.get_origin(ann) is Literal else ()


def field_specs(config: Config) -> list[FieldSpec]:
    specs = [FieldSpec("run", 0, key, RunConfig) for key in RunConfig.model_fields if key != "auto"]
    specs += [FieldSpec("auto", 0, key, AutoConfig) for key in AutoConfig.model_fields]
    specs += [FieldSpec("stall", 0, key, StallConfig) for key in StallConfig.model_fields]
    for i, _ in enumerate(config.endpoints):
        specs += [FieldSpec("endpoint", i, key, EndpointConfig) for key in ENDPOINT_KEYS]
    if config.gateway is not None:
        specs += [FieldSpec("gateway", 0, key, GatewayConfig) for key in GATEWAY_KEYS]
    return specs


def shown(value: Any) -> str:
    """A config value as the form shows it."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ", ".join(shown(v) for v in value)
    return str(value)


def _message(err: ErrorDetails) -> str:
    if err["type"] == "missing":
        return "required"
    return str(err["msg"]).removeprefix("Value error, ")


class SettingField(Horizontal):
    """One key on one line: its name, an input that fits its type, and its description, or, in red,
    the reason its value is refused."""

    def __init__(self, spec: FieldSpec, value: Any) -> None:
        super().__init__(classes="field", id=spec.id)
        self.spec = spec
        self.initial = value
        self._error = ""

    def compose(self) -> ComposeResult:
        spec = self.spec
        yield Static(spec.key, classes="field-key", markup=False)
        if spec.choices or spec.annotation is bool:
            choices = spec.choices or ("true", "false")
            value = shown(self.initial).lower() if spec.annotation is bool else self.initial
            yield Select([(c, c) for c in choices], value=value, allow_blank=False, compact=True,
                         classes="field-input", id=f"{spec.id}-input")
        else:
            placeholder = "default" if (spec.section, spec.key) in OPTIONAL_EMPTY else ""
            field = Input(shown(self.initial), placeholder=placeholder, compact=True, classes="field-input",
                          id=f"{spec.id}-input")
            field.cursor_blink = not self.app.is_headless
            yield field
        yield Static(spec.help, classes="field-note", markup=False)

    @property
    def control(self) -> Input | Select:
        return self.query_one(f"#{self.spec.id}-input")  # type: ignore[return-value]

    def raw(self) -> Any:
        """The value to hand pydantic: text as typed (it parses numbers), lists split on commas."""
        control = self.control
        if isinstance(control, Select):
            return control.value == "true" if self.spec.annotation is bool else control.value
        text = control.value.strip()
        if text == "" and (self.spec.section, self.spec.key) in OPTIONAL_EMPTY:
            return None
        if typing.get_origin(self.spec.annotation) is list:
            return [part.strip() for part in text.split(",") if part.strip()]
        return text

    @property
    def changed(self) -> bool:
        raw = self.raw()
        if isinstance(raw, list):
            return raw != [shown(v) for v in self.initial or []]
        if isinstance(raw, bool) or raw is None:
            return raw != self.initial
        return raw != shown(self.initial)

    @property
    def error(self) -> str:
        """The reason the value is refused; empty when it is accepted."""
        return self._error

    def show_error(self, message: str) -> None:
        if message == self._error:
            return
        self._error = message
        self.set_class(bool(message), "-invalid")
        self.query_one(".field-note", Static).update(f"✖ {message}" if message else self.spec.help)


class SettingsScreen(Screen):
    """ctrl+s saves (asking first when the file's comments would be lost); esc goes back."""

    app: CerevisorApp
    BINDINGS = [
        Binding("ctrl+s", "save", "Save", id="settings_save", tooltip="Check every value and save to the config file"),
        Binding("escape", "back", "Back", id="settings_back", tooltip="Back to the console (asks if unsaved)"),
    ]
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]

    def compose(self) -> ComposeResult:
        app = self.app
        config = app.config
        target = str(app.save_path) if app.save_path else "nowhere (no config file)"
        with Vertical(id="settings-head"):
            yield Static(Text.assemble(("Settings", "bold"), f"  saving to {target}"), id="settings-target")
            # the footer shows ctrl+s and esc; this line fits 80 columns
            yield Static("Mode, cap, deadlines, live [gateway] keys apply when saved; the rest next run."
                         if config.gateway is not None else
                         "Saved mode, cap and stall deadlines apply at once; the rest from the next run.",
                         id="settings-hint", markup=False)
        # not focusable itself (its fields are, and it scrolls to the focused one): focus on it restyled all of its
        # ~190 widgets, twice as the screen opened (Textual focused it first, then on_mount the first field)
        with VerticalScroll(id="settings-form", can_focus=False):
            yield Static("[run]", classes="section-title", markup=False)
            for spec in field_specs(config):
                if spec.section in ("auto", "stall") and spec.key == next(iter(spec.model.model_fields)) or \
                        spec.section == "gateway" and spec.key == GATEWAY_KEYS[0]:
                    yield Static(SECTION_TABLES[spec.section], classes="section-title", markup=False)
                if spec.section == "endpoint" and spec.key == ENDPOINT_KEYS[0]:
                    ep = config.endpoints[spec.index]
                    yield Static(f"[[endpoints]] {ep.name}", classes="section-title", markup=False)
                yield SettingField(spec, self._value(config, spec))
        yield Static("", id="settings-help")
        yield Footer()

    def _value(self, config: Config, spec: FieldSpec) -> Any:
        """What the form starts from: the config, except mode and cap, which show what runs now."""
        mirror = self.app.mirror
        if (spec.section, spec.key) == ("run", "mode") and mirror.mode:
            return mirror.mode
        if (spec.section, spec.key) == ("run", "max_concurrency") and mirror.run_cap:
            return mirror.run_cap
        if spec.section == "run":
            return getattr(config.run, spec.key)
        if spec.section == "auto":
            return getattr(config.run.auto, spec.key)
        if spec.section == "stall":
            return getattr(config.stall, spec.key)
        if spec.section == "gateway":
            return getattr(config.gateway, spec.key)
        return getattr(config.endpoints[spec.index], spec.key)

    def on_mount(self) -> None:
        first = self.query(SettingField).first()
        first.control.focus()

    @property
    def fields(self) -> list[SettingField]:
        return list(self.query(SettingField))

    def field(self, section: str, key: str, index: int = 0) -> SettingField:
        return self.query_one(f"#f-{section}-{index}-{key}", SettingField)

    # ---- checking ---------------------------------------------------------------------------------
    def _groups(self) -> dict[tuple[str, int], list[SettingField]]:
        groups: dict[tuple[str, int], list[SettingField]] = {}
        for f in self.fields:
            groups.setdefault((f.spec.section, f.spec.index), []).append(f)
        return groups

    def _check_group(self, section: str, index: int, fields: list[SettingField]) -> BaseModel | None:
        """Validate one table with its model; show each field's reason; the model when all are valid."""
        values = {f.spec.key: f.raw() for f in fields}
        if section == "run":
            model: type[BaseModel] = RunConfig
            data = values
        elif section == "auto":
            model, data = AutoConfig, values
        elif section == "stall":
            model, data = StallConfig, values
        elif section == "gateway":
            gateway = self.app.config.gateway
            model, data = GatewayConfig, {**(gateway.model_dump() if gateway else {}), **values}
        else:
            model = EndpointConfig
            data = {**self.app.config.endpoints[index].model_dump(), **values}
        by_key = {f.spec.key: f for f in fields}
        problems: dict[str, str] = {}
        result = None
        try:
            result = model.model_validate(data)
        except ValidationError as exc:
            for err in exc.errors():
                # a whole-table rule: an endpoint's is about its URL, [run.auto]'s about max_cap below min_cap
                key = str(err["loc"][0]) if err["loc"] else ("max_cap" if section == "auto" else "base_url")
                if key in by_key:
                    problems.setdefault(key, _message(err))
                else:
                    self.app.notice(f"{section}: {key}: {_message(err)}", severity="error")
        for key, f in by_key.items():
            f.show_error(problems.get(key, ""))
        return result if not problems else None

    @on(Input.Changed)
    @on(Select.Changed)
    def _changed(self, event: Input.Changed | Select.Changed) -> None:
        field = next((a for a in event.control.ancestors if isinstance(a, SettingField)), None)
        if field is None:
            return
        spec = field.spec
        self._check_group(spec.section, spec.index, self._groups()[(spec.section, spec.index)])

    def on_descendant_focus(self, event: DescendantFocus) -> None:
        field = next((a for a in event.widget.ancestors_with_self if isinstance(a, SettingField)), None)
        if field is not None:
            spec = field.spec
            where = SECTION_TABLES.get(spec.section) or f"[[endpoints]] {self.app.config.endpoints[spec.index].name}"
            self.query_one("#settings-help", Static).update(Text.assemble((f"{where} {spec.key}", "bold"),
                                                                          f": {spec.help}"))

    def checked_config(self) -> Config | None:
        """The whole config with the form's values, or None (reasons shown) when any is refused."""
        config = self.app.config
        results = {group: self._check_group(*group, fields) for group, fields in self._groups().items()}
        bad = [f for f in self.fields if f.has_class("-invalid")]
        if bad or any(r is None for r in results.values()):
            if bad:
                bad[0].control.focus()
                bad[0].scroll_visible()
            self.app.notice(f"{len(bad) or 1} value(s) refused; see the reasons in red.", severity="error")
            return None
        data = config.model_dump()
        data["run"] = results[("run", 0)].model_dump()  # type: ignore[union-attr]
        data["run"]["auto"] = results[("auto", 0)].model_dump()  # type: ignore[union-attr]
        data["stall"] = results[("stall", 0)].model_dump()  # type: ignore[union-attr]
        for i in range(len(config.endpoints)):
            data["endpoints"][i] = results[("endpoint", i)].model_dump()  # type: ignore[union-attr]
        if ("gateway", 0) in results:
            data["gateway"] = results[("gateway", 0)].model_dump()  # type: ignore[union-attr]
        try:
            return validate(data, file=str(self.app.save_path or "settings"))
        except ConfigError as exc:
            self.app.notice(str(exc), title="Not saved", severity="error", timeout=10)
            return None

    # ---- saving -----------------------------------------------------------------------------------
    def action_save(self) -> None:
        new = self.checked_config()
        if new is None:
            return
        if self.app.save_path is None:
            self._ask_where(new)
            return
        self._save(new, allow_comment_loss=False)

    def _ask_where(self, new: Config) -> None:
        """No config file: ask where to save (a new file, or one to merge into), or apply without saving."""
        from cerevisor_tui.ui.screens.save_to import SaveToScreen

        def answer(choice: str | None) -> None:
            if choice is None:
                return
            if choice == "":
                self._applied(new, "Not saved.")
                return
            self.app.save_path = Path(choice).expanduser()
            self.query_one("#settings-target", Static).update(
                Text.assemble(("Settings", "bold"), f"  saving to {self.app.save_path}"))
            self._save(new, allow_comment_loss=False)

        if new.gateway is not None:  # not where every console looks: each would serve a gateway
            suggested = Path.cwd() / "cerevisor-gateway.toml"
            note = f"`cerevisor-tui gateway --config {suggested.name}` serves with it."
        else:
            suggested, note = user_config_file(), "There, every `cerevisor-tui` reads it when no --config is given."
        self.app.push_screen(SaveToScreen(str(suggested), note), answer)

    def _save(self, new: Config, *, allow_comment_loss: bool) -> None:
        app = self.app
        path = app.save_path
        assert path is not None
        try:
            result = save_settings(path, new, template=app.save_template, allow_comment_loss=allow_comment_loss)
        except CommentsWouldBeLost:
            from cerevisor_tui.ui.screens.confirm import ConfirmScreen

            def answer(yes: bool | None) -> None:
                if yes:
                    self._save(new, allow_comment_loss=True)

            app.push_screen(ConfirmScreen(
                "Comments will be lost",
                f"{path} has comments, and saving rewrites the file without them. The original is kept as "
                f"{path.name}.bak. Save anyway?", yes="Save", no="Cancel"), answer)
            return
        except SaveError as exc:
            self.app.notice(str(exc), title="Not saved", severity="error", timeout=10)
            return
        note = f"Saved to {result.path}."
        if result.backup:
            note += f" Original kept as {result.backup.name}."
        self._applied(new, note)

    def _applied(self, new: Config, note: str) -> None:
        """Apply what applies at once, take `new` as the config in force, say so and go back."""
        app = self.app
        applied = self._apply_live(new)
        app.config = new
        if applied:
            note += f" Applied now: {', '.join(applied)}."
        app.notice(note, title="Settings saved" if note.startswith("Saved") else "Settings", timeout=6)
        app.pop_screen()

    def _apply_live(self, new: Config) -> list[str]:
        """Send the run what applies at once: mode, cap, and each endpoint's stall policy that changed."""
        app, mirror = self.app, self.app.mirror
        applied = []
        if new.run.mode != mirror.mode:
            app.command(cmd.SetMode(mode=new.run.mode))
            applied.append(f"mode {new.run.mode}")
        if new.run.max_concurrency != mirror.run_cap:
            app.command(cmd.SetConcurrency(cap=new.run.max_concurrency))
            applied.append(f"cap {new.run.max_concurrency}")
        changed = []
        for ep in new.endpoints:
            running = mirror.endpoints.get(ep.name)
            policy = resolve_stall(new.stall, ep)
            if running is None or running.stall == policy:
                continue  # an endpoint the run does not have (added here: the next run has it), or unchanged
            app.command(cmd.SetStall(endpoint=ep.name, policy=policy))  # a refusal is said in the run's words
            changed.append(ep.name)
        if changed:
            applied.append(f"stall deadlines ({', '.join(changed)})")
        old = app.config.gateway
        if new.gateway is not None and old is not None:
            live = [key for key in GATEWAY_LIVE if getattr(new.gateway, key) != getattr(old, key)]
            if live:
                app.command(cmd.SetGateway(**{key: getattr(new.gateway, key) for key in GATEWAY_LIVE}))
                applied.append(f"gateway {', '.join(live)}")
        return applied

    def action_back(self) -> None:
        if not any(f.changed for f in self.fields):
            self.app.pop_screen()
            return
        from cerevisor_tui.ui.screens.confirm import ConfirmScreen

        def answer(drop: bool | None) -> None:
            if drop:
                self.app.pop_screen()

        self.app.push_screen(
            ConfirmScreen("Unsaved changes", "Leave settings and drop your changes?", yes="Drop", no="Stay"), answer)
