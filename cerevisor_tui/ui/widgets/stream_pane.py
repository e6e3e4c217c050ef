"""The stream pane: the selected agent's transcript so far, then its live tokens, flushed by a timer."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical

from cerevisor_tui.ui.model import META, StreamCursor, UiModel
from cerevisor_tui.ui.widgets.stream_view import StreamView


class StreamPane(Vertical):
    """Shows one agent; `flush` moves only the text that arrived since the last flush into the view."""

    ALLOW_MAXIMIZE = True

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.agent: str | None = None
        self._cursor = StreamCursor()
        self._version = -1
        self._placeholder = ""  # what the view says while no agent is shown

    def compose(self) -> ComposeResult:
        yield StreamView(id="stream")

    @property
    def view(self) -> StreamView:
        return self.query_one(StreamView)

    def show(self, agent: str | None, model: UiModel) -> None:
        """Switch to `agent`: its whole transcript so far, scrolled to the end."""
        if agent == self.agent:
            return
        self.agent = agent
        self._cursor = StreamCursor()
        self._version = -1
        self._placeholder = ""
        self.view.clear()
        self.flush(model)

    def placeholder(self, text: str) -> None:
        """While no agent is shown, say `text` (a gateway waiting for its first session: where it serves)."""
        if self.agent is not None or text == self._placeholder:
            return
        self._placeholder = text
        self.view.clear()
        if text:
            self.view.append([(META, text)])

    def reset(self, agent: str | None, model: UiModel) -> None:
        """Show `agent` from a new model (the console switched runs), even if it is the one shown."""
        self.agent = None
        self.show(agent, model)

    def flush(self, model: UiModel) -> bool:
        """Append what arrived since the last flush; returns whether anything did."""
        if self.agent is None:
            return False
        stream = model.streams.get(self.agent)
        if stream is None or stream.version == self._version:
            return False
        self._version = stream.version
        self._cursor, pieces, reset = stream.read(self._cursor)
        if reset:
            self.view.clear()
        self.view.append(pieces)
        return bool(pieces)

    @property
    def following(self) -> bool:
        return self.view.following
