"""An exponential moving average of the trained weights, used for validation when enabled."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class EmaWeights:
    def __init__(self, parameters: list[nn.Parameter], decay: float):
        self.parameters = parameters
        self.decay = decay
        self.shadow = [p.detach().float().clone() for p in parameters]  # fp32: bf16 loses small EMA increments

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        """shadow ← d·shadow + (1 − d)·weights, d = `decay` (None: the constant one)."""
        d = self.decay if decay is None else decay
        for s, p in zip(self.shadow, self.parameters):
            s.lerp_(p.detach().float(), 1.0 - d)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Run the block with the EMA weights in place of the trained ones."""
        saved = [p.detach().clone() for p in self.parameters]
        with torch.no_grad():
            for p, s in zip(self.parameters, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.parameters, saved):
                    p.copy_(s)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": [s.clone() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        self.load_shadow(state["shadow"])

    def load_shadow(self, shadow: list[torch.Tensor]) -> None:
        """Replace the averaged weights (as a checkpoint stored them, in trainable-parameter order)."""
        if len(shadow) != len(self.shadow) or any(a.shape != b.shape for a, b in zip(shadow, self.shadow)):
            raise ValueError("EMA state does not match the trainable parameters of this model")
        self.shadow = [s.clone() for s in shadow]
