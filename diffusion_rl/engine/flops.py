"""FLOPs a worker spends per training step, counted exactly on its real modules and cached by shape.

The first rollout and the first update of each shape run under a dispatch mode that counts every matmul,
convolution and attention op with torch.utils.flop_counter's formulas (the ones FlopCounterMode uses: text
encoders, transformer calls with CFG, VAE decode; the update's forwards and backwards); later ones of the same shape
reuse the count. Not FlopCounterMode itself: its module tracker hooks every module's backward, which reorders the
accumulation of gradients that several blocks add to (the timestep embedding's) — the counted step would differ
from an uncounted one in the last bits, and a resumed run (which counts again) from a straight one. The counted call
runs slower (see docs/estimate.md for the measured one-time cost); `log.flops: false` turns it off. Under FSDP2 the
counts are this device's own share; collectives are not FLOPs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from diffusion_rl.estimate.devices import peak_flops_of


def _cpu_attention(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# flop_counter has the CUDA attention kernels but not the CPU one: without these, a CPU run counts no attention
FORMULAS = {
    **flop_registry,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


class FlopCounter(TorchDispatchMode):
    """Within the block, `total` grows by the FLOPs of each op with a formula (flop_counter's: 2·m·n·k a matmul;
    attention on the CPU too)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = FORMULAS.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


class FlopTally:
    def __init__(self, enabled: bool = True, peak: float | None = None):
        self.enabled, self.peak = enabled, peak  # peak: the device's dense bf16 FLOP/s, when known
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

    def metrics(self) -> dict[str, float]:
        """The device's FLOPs since the last call and its peak FLOP/s when known (none when not counting)."""
        if not self.enabled:
            return {}
        peak = {} if self.peak is None else {"perf/peak_flops_per_device": self.peak}
        return {"perf/flops_per_device": self.take(), **peak}


def device_peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """Peak dense bf16 FLOP/s of `device` from the table (estimate/devices.py), or the configured override."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return peak_flops_of(name, override_tflops)
