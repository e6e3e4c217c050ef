"""The console says the same thing whether its run is in its own process or detached: the run's answer to a
key's command comes back as one typed Answer either way (engine/control.py, supervisor/client.py), and the
console takes it through one path. Here the same engine is reached both ways, the detached one through a real
control socket, and `e` on an agent that has ended is told the same notice twice."""

from __future__ import annotations

import pytest

from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.supervisor.client import ControlClient, RemoteControl
from cerevisor_tui.supervisor.server import ControlServer
from tests.conftest import until
from tests.ui.conftest import console, engine_of, sim_config

pytestmark = pytest.mark.anyio


def notified(app) -> list[tuple[str, str]]:
    return [(n.title, n.message) for n in app._notifications]


async def test_a_key_gets_the_same_words_from_an_in_process_run_and_over_the_socket(tmp_path):
    app = console(sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi", "max_tokens": 4}]))
    engine = engine_of(app)
    server = ControlServer(tmp_path / "run", "r1", engine.handle, in_flight=engine.in_flight)
    async with app.run_test(size=(120, 30)) as pilot:
        await until(lambda: app.mirror.finished is not None, "the run to finish")
        said = "a has no running attempt to extend."
        await pilot.press("e")  # in-process: the engine's answer (False: nothing to extend), at once
        await until(lambda: [m for _, m in notified(app)].count(said) == 1, "the in-process answer")
        refused = ("Not done", "no agent named 'nobody' in this run")
        app.command(cmd.Kill(agent="nobody"))  # a refusal: the run's own line
        await until(lambda: notified(app).count(refused) == 1, "the in-process refusal")

        (tmp_path / "run").mkdir()
        await server.start()
        client = await ControlClient.connect(tmp_path / "run", replay=False)
        reader = app.run_worker(client.run(lambda e: None))
        remote = RemoteControl(lambda line: app.notice(line, title="Not done", severity="warning"))
        remote.bind(client)
        app.control = remote
        app.clear_notifications()  # (a notice said again while it is still shown is not shown twice)
        await pilot.press("e")  # detached: the same answer, when the socket's reply comes
        await until(lambda: [m for _, m in notified(app)].count(said) == 1, "the socket's answer")

        app.command(cmd.Kill(agent="nobody"))  # the same refusal, in the same words
        await until(lambda: notified(app).count(refused) == 1, "the socket's refusal")
        remote.bind(None, "run r1 has ended")
        app.command(cmd.Kill(agent="nobody"))
        await until(lambda: ("Not done", "run r1 has ended") in notified(app), "the unbound control's refusal")
        await client.close()
        reader.cancel()
        await server.close()
