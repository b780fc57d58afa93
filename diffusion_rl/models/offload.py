"""How `model.offload_frozen` moves a frozen component (a text encoder, the VAE) between the host and the device.

A frozen component's weights never change, so it keeps one copy of them in host memory for the whole run and the
device only ever holds a copy of that: going to the device copies each weight once, coming back drops the device
copy and points the weights at the host copy again, copying nothing. Where a CUDA device is present the host copy
is pinned, so the copy to the device runs at the bus's speed and without making the host wait.

The module's own `.to` (what this replaced) copies both ways from pageable memory: run 10 of the GPU check measured
9.3–9.7 s per `encode_prompts` call for SD3.5-Medium's 10.4 GiB of text encoders on an H200, about 2.2 GiB/s
(benchmarks/RESULTS.md, "The text encoders at real size").

Parameters keep their identity (only `.data` is swapped), so whatever holds them (tied weights, hooks) still does.
"""

from __future__ import annotations

import torch
from torch import nn

HOST = torch.device("cpu")


def _host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = tensor.detach().to(HOST)
    return copy.pin_memory() if pin else copy


def _copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_like(host, device=device).copy_(host, non_blocking=True)


class HostResident:
    """A frozen module whose weights live in host memory and visit the device: `to_device(d)`, then `to_host()`.
    Made, it holds the host copies; the module's weights stay where they are until one of the two is called."""

    def __init__(self, module: nn.Module):
        self.module = module
        pin = torch.cuda.is_available()
        copies: dict[int, torch.Tensor] = {}  # id(tensor) → its host copy: a tied or shared tensor is copied once

        def host(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in copies:
                copies[id(tensor)] = _host_copy(tensor, pin)
            return copies[id(tensor)]

        self._parameters: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        seen: set[int] = set()
        for owner in module.modules():
            for parameter in owner._parameters.values():
                if parameter is not None and id(parameter) not in seen:
                    seen.add(id(parameter))
                    self._parameters.append((parameter, host(parameter)))
            for name, buffer in owner._buffers.items():
                if buffer is not None:
                    self._buffers.append((owner, name, host(buffer)))

    def to_device(self, device: torch.device) -> None:
        """Every weight and buffer becomes a copy of its host copy on `device` (a new copy even on the CPU)."""
        for parameter, host in self._parameters:
            parameter.data = _copy(host, device)
        for owner, name, host in self._buffers:
            owner._buffers[name] = _copy(host, device)

    def to_host(self) -> None:
        """Every weight and buffer is its host copy again; the device copies are dropped, nothing is copied."""
        for parameter, host in self._parameters:
            parameter.data = host
        for owner, name, host in self._buffers:
            owner._buffers[name] = host
