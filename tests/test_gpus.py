"""The run reads its box's GPUs through nvidia-ml-py and tells them as GpuSample events.

No GPU here: NVML is faked at the library boundary (the `pynvml` functions engine/gpus.py calls are replaced
by a small fake with NVML's own error type); the engine, the simulator and the events are the real ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pynvml
import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.gpus import GpuReader

GiB = 2**30


class FakeNvml:
    """Two GPUs; the second reports neither power nor its limit (as some boards do). Utilisation rises by
    10 points at each read, so a refreshed sample is told from a repeated one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, init_error: int | None = None) -> None:
        self.init_error = init_error
        self.reads = 0
        self.shutdowns = 0
        self.open = False
        for name in ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                     "nvmlDeviceGetName", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo",
                     "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetTemperature"):
            monkeypatch.setattr(pynvml, name, getattr(self, name))

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.open = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        self.open = False

    def _live(self) -> None:
        if not self.open:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def nvmlDeviceGetCount(self) -> int:
        self._live()
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> object:
        self._live()
        return ("handle", i)

    def nvmlDeviceGetName(self, handle) -> str:
        return "NVIDIA H100 80GB HBM3" if handle[1] == 0 else "NVIDIA L4"

    def nvmlDeviceGetUtilizationRates(self, handle):
        self._live()
        if handle[1] == 0:
            self.reads += 1
        return SimpleNamespace(gpu=min(100, 10 * self.reads), memory=5)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=(71 if handle[1] == 0 else 2) * GiB, total=(80 if handle[1] == 0 else 24) * GiB,
                               free=0)

    def nvmlDeviceGetPowerUsage(self, handle) -> int:
        if handle[1] == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 512_300  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, handle) -> int:
        if handle[1] == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 700_000

    def nvmlDeviceGetTemperature(self, handle, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return 63 if handle[1] == 0 else 41


def sim_engine(**run) -> Engine:
    return Engine(validate({
        "run": {"metrics_interval_s": 0.05, **run},
        "endpoints": [{"name": "sim", "kind": "simulated", "sim": {"speed": 20.0}}],
        "agents": [{"name": "a", "prompt": "p", "max_tokens": 120}],
    }))


@pytest.mark.anyio
async def test_each_gpu_is_read_with_the_metrics_and_told_as_an_event(monkeypatch):
    nvml = FakeNvml(monkeypatch)
    engine = sim_engine()
    seen = []
    engine.subscribe(seen.append)
    assert await engine.run() == 0
    samples = [e for e in seen if e.kind == "GpuSample"]
    assert len(samples) >= 2, "read more than once over the run"
    first = samples[0]
    assert first.error == ""
    assert msgspec.to_builtins(first.gpus[0]) == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "utilization": 0.1,
                             "memory_used_bytes": 71 * GiB, "memory_total_bytes": 80 * GiB, "power_w": 512.3,
                             "power_limit_w": 700.0, "temperature_c": 63}
    # what this GPU does not report is None; the rest of it is still read
    assert msgspec.to_builtins(first.gpus[1]) == {"index": 1, "name": "NVIDIA L4", "utilization": 0.1, "memory_used_bytes": 2 * GiB,
                             "memory_total_bytes": 24 * GiB, "power_w": None, "power_limit_w": None,
                             "temperature_c": 41}
    assert samples[1].gpus[0].utilization == 0.2  # refreshed, not repeated
    assert nvml.shutdowns == 1 and not nvml.open  # NVML closed with the run


@pytest.mark.parametrize("error, words", [
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "no NVIDIA driver: Driver Not Loaded"),
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "no NVIDIA driver: NVML Shared Library Not Found"),
])
@pytest.mark.anyio
async def test_without_a_driver_one_event_says_so_and_the_run_is_the_same(monkeypatch, error, words):
    FakeNvml(monkeypatch, init_error=error)
    engine = sim_engine()
    seen = []
    engine.subscribe(seen.append)
    assert await engine.run() == 0
    samples = [e for e in seen if e.kind == "GpuSample"]
    assert [(s.gpus, s.error) for s in samples] == [([], words)]
    assert [e.status for e in seen if e.kind == "AgentFinished"] == ["completed"]


def test_without_the_bindings_the_reader_says_what_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import pynvml raises ImportError
    assert GpuReader().open() == "nvidia-ml-py is not installed (pip install nvidia-ml-py)"


def test_a_driver_that_sees_no_gpu(monkeypatch):
    nvml = FakeNvml(monkeypatch)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 0)
    reader = GpuReader()
    assert reader.open() == "the NVIDIA driver sees no GPU"
    assert nvml.shutdowns == 1


def test_this_machine_has_no_driver_and_says_so():
    """The real bindings on this GPU-less machine: the reader's answer is the operator's message, not a crash."""
    reader = GpuReader()
    problem = reader.open()
    if not problem:  # pragma: no cover - a machine with an NVIDIA GPU
        reader.close()
        pytest.skip("this machine has an NVIDIA driver")
    assert problem.startswith("no NVIDIA driver: ")
