"""The GPUs of the box the run is on: utilisation, memory, power and temperature, read through NVIDIA's own
bindings (`nvidia-ml-py`, the `pynvml` module) and told as GpuSample events.

NVML is read in the run process and its numbers travel as events, so an attached console shows them without
touching the hardware. No driver (or no bindings) is not an error: one GpuSample says why and reading stops.
A value one GPU does not support (power on some boards) is None; the others are still read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.clock import Clock


class GpuReader:
    """An NVML session: `open` it, `read` every GPU as often as wanted, `close` it. Calls block (the driver
    answers in microseconds to milliseconds), so the monitor makes them in a worker thread."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._names: list[str] = []

    def open(self) -> str:
        """Start NVML and find the GPUs; "" when it did, else why not, for the operator."""
        try:
            import pynvml
        except ImportError:
            return "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        except OSError as exc:  # its file could not be read (out of descriptors): no GPU pane, the run goes on
            return f"nvidia-ml-py could not be loaded: {_words(exc)}"
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return f"no NVIDIA driver: {_words(exc)}"
        self._nvml = pynvml
        try:
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
        except pynvml.NVMLError as exc:
            self.close()
            return f"NVML could not list the GPUs: {_words(exc)}"
        if not self._handles:
            self.close()
            return "the NVIDIA driver sees no GPU"
        return ""

    def read(self) -> list[ev.GpuReading]:
        """Each GPU's numbers now (GpuSample.gpus)."""
        nvml = self._nvml
        out = []
        for index, (handle, name) in enumerate(zip(self._handles, self._names, strict=True)):
            util = self._get(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._get(nvml.nvmlDeviceGetMemoryInfo, handle)
            power_mw = self._get(nvml.nvmlDeviceGetPowerUsage, handle)
            limit_mw = self._get(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            out.append(ev.GpuReading(
                index, name,
                utilization=util.gpu / 100 if util is not None else None,
                memory_used_bytes=int(memory.used) if memory is not None else None,
                memory_total_bytes=int(memory.total) if memory is not None else None,
                power_w=power_mw / 1000 if power_mw is not None else None,
                power_limit_w=limit_mw / 1000 if limit_mw is not None else None,
                temperature_c=self._get(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
            ))
        return out

    def _get(self, call: Any, *args: Any) -> Any:
        """One NVML value, or None where this GPU does not report it (or has just fallen off the bus)."""
        try:
            return call(*args)
        except self._nvml.NVMLError:
            return None

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
        self._nvml, self._handles, self._names = None, [], []


async def watch_gpus(emit: Callable[[ev.Event], None], interval_s: float, clock: Clock) -> None:
    """Emit a GpuSample every `interval_s` of the run's clock while the run goes on; with no GPU readable, one that
    says why."""
    reader = GpuReader()
    problem = await anyio.to_thread.run_sync(reader.open)
    if problem:
        emit(ev.GpuSample(clock.now(), error=problem))
        return
    try:
        while True:
            gpus = await anyio.to_thread.run_sync(reader.read)
            emit(ev.GpuSample(clock.now(), gpus=gpus))
            await clock.sleep(interval_s)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(reader.close)


def _words(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _text(value: str | bytes) -> str:
    """nvidia-ml-py returns str; older pynvml releases returned bytes."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
