"""FLOPs a worker spends per training step, counted exactly on its real modules and cached by shape.

The first rollout and the first update of each shape run under a dispatch mode that counts every matmul,
convolution and attention op with torch.utils.flop_counter's formulas (the ones FlopCounterMode uses: text
encoders, transformer calls with CFG, VAE decode; the update's forwards and backwards); later ones of the same shape
reuse the count. Not FlopCounterMode itself: its module tracker hooks every module's backward, which reorders the
accumulation of gradients that several blocks add to (the timestep embedding's) — the counted step would differ
from an uncounted one in the last bits, and a resumed run (which counts again) from a straight one. The counted call
runs slower (see docs/metrics.md for the measured one-time cost); `log.flops: false` turns it off. Under FSDP2 the
counts are this device's own share; collectives are not FLOPs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from diffusion_rl.estimate.devices import peak_flops_of


class FlopCounter(TorchDispatchMode):
    """Within the block, `total` grows by the FLOPs of each op flop_counter has a formula for (2·m·n·k a matmul)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


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
        with FlopCounter() as counter:
            yield
        self.cache[key] = float(counter.total)
        self.pending += self.cache[key]

    def take(self) -> float:
        flops, self.pending = self.pending, 0.0
        return flops


def device_peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """Peak dense bf16 FLOP/s of `device` from the table (estimate/devices.py), or the configured override."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return peak_flops_of(name, override_tflops)
