"""Classifier-free guidance scales: one for every step, or, for a model with two timestep experts (Wan 2.2 A14B,
models/experts.py), a second one for the low-noise expert's steps — diffusers' `guidance_scale_2`.

A `velocity` takes its guidance as a float. `Guidance` is that float (the scale of the high-noise expert, and of every
step when it carries no second one) with the low-noise expert's scale beside it: a family with one network reads it
as it reads any scale, and the second scale cannot get lost on the way from the sampler settings to the family that
reads it (`FlowModel.row_guidance`). A plain float is a `Guidance` without a second scale.

As in diffusers' Wan pipelines, a call's rows at t ≥ boundary use the scale, the rows below the low-noise one, and
`None` for the low-noise scale means the same scale for both. The unconditional branch runs when either scale is > 1
(`runs_cfg`); diffusers runs it only when `guidance_scale` > 1 and otherwise ignores `guidance_scale_2`, so the two
agree wherever diffusers uses guidance_scale_2 at all, and `guidance 1, low-noise 3` guides the low-noise steps here.
`guided` is the combination every family applies; `GuidanceCost` what a model's velocity at a scale costs, as
`estimate` counts it. Imports nothing of the project but its error type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_rl.errors import UserError


class Guidance(float):
    """A CFG scale carrying the low-noise expert's own (`low_noise`; None: the same)."""

    __slots__ = ("low_noise",)

    def __new__(cls, scale: float, low_noise: float | None = None) -> Guidance:
        self = super().__new__(cls, scale)
        self.low_noise = None if low_noise is None else float(low_noise)
        return self

    def __reduce__(self):  # pickled (Ray) with its second scale
        return (Guidance, (float(self), self.low_noise))

    def __repr__(self) -> str:
        return f"Guidance({float(self)!r}, low_noise={self.low_noise!r})"

    __str__ = float.__repr__  # printed and formatted as the number it is


def low_noise_scale(guidance: float) -> float:
    """The scale of the low-noise expert's steps: its own where `guidance` carries one, else `guidance`."""
    low = getattr(guidance, "low_noise", None)
    return float(guidance) if low is None else low


def runs_cfg(guidance: float) -> bool:
    """Whether a velocity call at `guidance` runs the unconditional branch: when either expert's scale is > 1."""
    return max(float(guidance), low_noise_scale(guidance)) > 1.0


@dataclass(frozen=True)
class GuidanceCost:
    """What a model does with a guidance scale, from its configs alone (`estimate`): `embedded`, the scale is an input
    of its one forward (guidance-distilled: FLUX.1-dev); `ignored`, one function at every scale (step-distilled and
    CFG-free: FLUX.2-klein); neither, classifier-free guidance over a doubled batch."""

    embedded: bool = False
    ignored: bool = False

    def forwards(self, guidance: float) -> int:
        """Transformer forwards per row of one velocity at `guidance`: 2 with classifier-free guidance, else 1."""
        return 2 if runs_cfg(guidance) and not (self.embedded or self.ignored) else 1


def refuse_low_noise_without_experts(low_noise: float | None, key: str, model: str, experts: int) -> None:
    """A low-noise expert's guidance (`key`'s value) needs a model with two experts: else a UserError naming `key`."""
    if low_noise is not None and experts < 2:
        raise UserError(
            f"{key}={low_noise:g} sets the guidance of a low-noise expert, but this {model} model has one "
            "transformer (Wan 2.2 A14B has two: transformer_2/ and a boundary_ratio); remove it or set it to null"
        )


def guided(v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance, u + s·(c − u): `scale` a float, or fp32 [rows], one per row (`row_guidance`)."""
    if isinstance(scale, torch.Tensor):
        scale = scale.view(-1, *[1] * (v_cond.ndim - 1))
    return v_uncond + scale * (v_cond - v_uncond)
