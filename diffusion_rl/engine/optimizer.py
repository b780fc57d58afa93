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
            self._skip(grad_norm)
            return grad_norm
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.consecutive_skips = 0
        if self.ema is not None and self.steps % t.ema.update_every == 0:
            self.ema.update()
        return grad_norm

    def _skip(self, grad_norm: float) -> None:
        """Drop a non-finite gradient; train.max_consecutive_skips in a row raise TrainingDiverged."""
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped += 1
        self.consecutive_skips += 1
        logger.warning("non-finite gradient norm (%s): update skipped (%d in a row)", grad_norm, self.consecutive_skips)
        if self.consecutive_skips >= self.train.max_consecutive_skips:
            raise TrainingDiverged(
                f"{self.consecutive_skips} consecutive updates had a non-finite loss or gradient norm; "
                "stopping (the last good checkpoint is kept). Lower train.lr or check the rewards."
            )

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


def apply_train_hyperparameters(optimizer: torch.optim.Optimizer, scheduler, train, log: bool = True) -> None:
    """Give a restored optimizer and LR schedule the config's lr, betas, weight decay, eps and warm-up.

    Loading a checkpoint restores the saved param groups and the schedule's base lr; a resume must instead use
    the settings it was started with (lowering train.lr is how a diverged run goes on), keeping Adam's moments and
    the step count. `log`: say once (on one worker) what changed from the checkpoint's settings.
    """
    wanted = {"lr": train.lr, "betas": tuple(train.betas), "weight_decay": train.weight_decay, "eps": train.adam_eps}
    group = optimizer.param_groups[0]
    saved = {"lr": scheduler.base_lrs[0], **{k: group[k] for k in ("betas", "weight_decay", "eps")}}
    changed = [f"{k} {saved[k]} → {v}" for k, v in wanted.items() if _differs(saved[k], v)]
    scheduler.base_lrs = [train.lr] * len(optimizer.param_groups)
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):  # the warm-up of this config
        group.update(
            initial_lr=train.lr, betas=wanted["betas"], weight_decay=wanted["weight_decay"], eps=train.adam_eps
        )
        group["lr"] = train.lr * lr_lambda(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() (metric `lr`) reports
    if changed and log:
        logger.info("resumed with this config's optimizer settings, not the checkpoint's: %s", ", ".join(changed))


def _differs(saved, wanted) -> bool:
    if isinstance(wanted, tuple):
        return any(_differs(a, b) for a, b in zip(saved, wanted))
    return not math.isclose(float(saved), float(wanted), rel_tol=1e-12, abs_tol=0.0)
