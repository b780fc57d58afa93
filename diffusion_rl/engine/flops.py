"""FLOPs a worker spends per training step, counted exactly on its real modules and cached by shape.

The first rollout and the first update of each shape run under torch.utils.flop_counter.FlopCounterMode, which
counts every matmul, convolution and attention op that dispatches (text encoders, transformer calls with CFG, VAE
decode; the update's forwards and backwards); later ones of the same shape reuse the count. Counting is a dispatch
mode, so that one call runs slower (see docs/metrics.md for the measured one-time cost); `log.flops: false` turns
it off. Under FSDP2 the counts are this device's own share; collectives are not FLOPs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from diffusion_rl.estimate.devices import peak_flops_of


class FlopTally:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.cache: dict[Hashable, float] = {}
        self.pending = 0.0  # FLOPs since the last `take`

    @contextlib.contextmanager
    def count(self, key: Hashable) -> Iterator[None]:
        """Add the block's FLOPs to the step's: counted the first time `key` is seen, the cached count after."""
        if not self.enabled:
            yield
            return
        if key in self.cache:
            yield
            self.pending += self.cache[key]
            return
        with FlopCounterMode(display=False) as counter:
            yield
        self.cache[key] = float(counter.get_total_flops())
        self.pending += self.cache[key]

    def take(self) -> float:
        flops, self.pending = self.pending, 0.0
        return flops


def device_peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """Peak dense bf16 FLOP/s of `device` from the table (estimate/devices.py), or the configured override."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return peak_flops_of(name, override_tflops)
