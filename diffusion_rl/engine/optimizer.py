"""The optimizer step of every update: clip over all shards, skip a non-finite gradient, schedule, EMA, counters."""

from __future__ import annotations

import logging
import math

import torch

from diffusion_rl.engine.ema import EmaWeights
from diffusion_rl.errors import RunStopped

logger = logging.getLogger(__name__)


class TrainingDiverged(RunStopped):
    """Too many consecutive updates had a non-finite loss or gradient norm."""


class OptimizerStepper:
    """AdamW over the trained parameters with a linear warm-up, gradient clipping and an optional EMA.

    `parallel` (engine/parallel.py) computes the gradient norm over all shards, so every worker clips and skips
    alike. A step whose gradient norm is not finite is skipped (gradients dropped); `train.max_consecutive_skips`
    of them in a row raise TrainingDiverged.
    """

    def __init__(self, params: list[torch.nn.Parameter], train, parallel):
        self.train, self.parallel = train, parallel
        self.optimizer = torch.optim.AdamW(
            params, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay, eps=train.adam_eps
        )
        warmup = train.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda n: min(1.0, (n + 1) / warmup) if warmup > 0 else 1.0
        )
        self.ema = EmaWeights(params, train.ema.decay) if train.ema.enabled else None
        self.steps = 0  # optimizer steps taken
        self.skipped = 0  # updates skipped for a non-finite gradient
        self.consecutive_skips = 0

    @property
    def params(self) -> list[torch.nn.Parameter]:
        # the optimizer's own list: under FSDP2 the module may hold gathered copies now, the optimizer the shards
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self) -> float:
        """Clip, then step (or skip a non-finite gradient); returns the gradient norm before clipping."""
        t = self.train
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = self.parallel.clip_grad_norm(self.params, max_norm)  # over all shards
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
            self.consecutive_skips += 1
            logger.warning(
                "non-finite gradient norm (%s): update skipped (%d in a row)", grad_norm, self.consecutive_skips
            )
            if self.consecutive_skips >= t.max_consecutive_skips:
                raise TrainingDiverged(
                    f"{self.consecutive_skips} consecutive updates had a non-finite loss or gradient norm; "
                    "stopping (the last good checkpoint is kept). Lower train.lr or check the rewards."
                )
            return grad_norm
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.consecutive_skips = 0
        if self.ema is not None and self.steps % t.ema.update_every == 0:
            self.ema.update()
        return grad_norm

    def metrics(self, grad_norms: list[float]) -> dict[str, float]:
        """What every update reports about its optimizer steps: the mean finite gradient norm, lr, step counts."""
        finite = [g for g in grad_norms if math.isfinite(g)]
        return {
            "grad_norm": sum(finite) / len(finite) if finite else float("nan"),
            "lr": self.scheduler.get_last_lr()[0],
            "train/optimizer_steps": self.steps,
            "train/skipped_updates": self.skipped,
        }

    # -- state (the scheduler and counters are plain data; the optimizer and EMA tensors go to DCP) ----------------
    def counters_state(self) -> dict:
        return {
            "scheduler": self.scheduler.state_dict(),
            "counters": [self.steps, self.skipped, self.consecutive_skips],
        }

    def load_counters_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps, self.skipped, self.consecutive_skips = state["counters"]
