"""A training step's metrics row: wall-clock time per named phase (the names are the same in metrics,
`timing/<phase>`, and logs), the step's throughput, and `StepMetrics`, the one place the row is put together from
what its components report (the source's scores, the algorithm's `prepare`, the engine's update)."""

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


class StepMetrics:
    """Puts a step's metrics row together: each component's metrics as it reported them (how an update's metrics
    reduce over passes and workers is declared once, diffusion_rl/metrics.py), the window's start, a tree's NFE
    saving, the phase times and the throughput. Built once per run with what does not change between steps."""

    def __init__(self, devices: int, trainer_devices: int, flat_nfe: float | None = None):
        self.devices, self.trainer_devices = devices, trainer_devices  # a step's devices; those that count FLOPs
        self.flat_nfe = flat_nfe  # tree rollouts: the forwards per image flat rollouts of as many rows would take

    def row(self, parts: list[dict[str, float]], timer: PhaseTimer, images: int, window_start: int | None):
        """The row of a step that made `images` samples (generate, reward, prepare and update: not dumps,
        validation or checkpoints)."""
        metrics = {name: value for part in parts for name, value in part.items()}
        metrics.update(timer.metrics())
        if window_start is not None:
            metrics["window/start"] = window_start
        if self.flat_nfe is not None:
            nfe = metrics["rollout/nfe_per_image"]
            metrics.update(
                {"rollout/nfe_per_image_flat": self.flat_nfe, "rollout/nfe_saving": 1.0 - nfe / self.flat_nfe}
            )
        seconds = sum(timer.seconds.values())
        metrics["images_per_second"] = images / seconds
        flops, peak = metrics.pop("perf/flops_per_device", None), metrics.pop("perf/peak_flops_per_device", None)
        metrics.update(perf_metrics(images, seconds, self.devices, flops, peak, self.trainer_devices))
        return metrics
