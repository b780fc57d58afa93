"""Wall-clock time per named phase; the names are the same in metrics (`timing/<phase>`) and logs."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase/{phase}"):  # names the phase in profiler traces
                yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{phase}": s for phase, s in self.seconds.items()}


def perf_metrics(
    images: int,
    seconds: float,
    devices: int,
    flops_per_device: float | None = None,
    peak_per_device: float | None = None,
    counted_devices: int | None = None,
) -> dict[str, float]:
    """A step's throughput: `images` in `seconds` on `devices`; with the FLOPs one device spent (the mean over the
    `counted_devices` workers that count them, default all: engine/flops.py), the step's FLOPs, and MFU against
    `peak_per_device` FLOP/s when known."""
    metrics = {"perf/images_per_s": images / seconds, "perf/images_per_device_s": images / seconds / devices}
    if flops_per_device is not None:
        metrics["perf/flops_per_step"] = flops_per_device * (counted_devices or devices)
        if peak_per_device:
            metrics["perf/mfu"] = flops_per_device / (seconds * peak_per_device)
    return metrics
