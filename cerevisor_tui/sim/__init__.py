"""Simulated vLLM-like OpenAI-compatible server: run it with `SimServer`, `start_in_thread` or `cerevisor-tui sim`."""

from cerevisor_tui.sim.app import SimState, create_app
from cerevisor_tui.sim.profiles import ProfileError, SimServerSpec, resolve
from cerevisor_tui.sim.server import SimServer, ThreadedSim, start_in_thread

__all__ = ["ProfileError", "SimServer", "SimServerSpec", "SimState", "ThreadedSim", "create_app", "resolve",
           "start_in_thread"]
