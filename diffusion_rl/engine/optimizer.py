"""The optimizer step of every update (`OptimizerStepper`): AdamW with one param group per trained policy, each
clipped on its own gradient norm over all shards; a non-finite gradient skipped; the warm-up schedule; the EMA of
the trained `default` policy; counters. And `apply_train_hyperparameters`: a resumed optimizer takes the config's
settings.

An algorithm names its groups (algorithms/base.py `OptimizerGroup`: the policy, an lr scale, its betas); most
have one, the `default` policy's, with train's settings.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from diffusion_rl.algorithms.base import OptimizerGroup
from diffusion_rl.engine.ema import EmaWeights
from diffusion_rl.engine.fingerprint import fingerprint
from diffusion_rl.errors import TrainingDiverged, WeightsUnchanged
from diffusion_rl.metrics import reduce_metrics
from diffusion_rl.models.compiling import on_cuda

logger = logging.getLogger(__name__)

WEIGHT_CHANGE_AUTO_MAX = 50_000_000  # trained parameters up to which log.weight_change=auto measures it

Params = list[torch.nn.Parameter]


class OptimizerStepper:
    """AdamW over the trained parameters with a linear warm-up, gradient clipping and an optional EMA.

    `params_or_groups`: the parameters (one group with train's settings), or `(OptimizerGroup, params)` pairs, the
    `default` policy's first: one AdamW param group each, its lr train.lr × lr_scale and its betas; the warm-up
    scales every group alike. Each group is clipped on its own gradient norm, which `parallel`
    (engine/parallel.py) computes over all shards, so every worker clips and skips alike; `grad_norm` and `lr`
    report the first group, `grad_norm/<policy>` the others. A step with a gradient (norm > 0) and a learning rate
    that leaves every weight as it was stops the run (WeightsUnchanged; engine/fingerprint.py compares the weights
    before and after). A step whose gradient norm (any group's) is not finite is skipped (gradients dropped);
    `train.max_consecutive_skips` of them in a row raise TrainingDiverged. The EMA (train.ema) averages the first
    group. With `weight_change` each step also measures |Δθ| / |θ| of the first group (over all shards), from a
    copy of its weights taken before it.
    """

    def __init__(self, params_or_groups: Params | list[tuple[OptimizerGroup, Params]], train, parallel,
                 weight_change: str = "off"):  # fmt: skip
        self.train, self.parallel = train, parallel
        pairs = params_or_groups
        if not pairs or not isinstance(pairs[0], tuple):  # plain parameters: one group with train's settings
            pairs = [(OptimizerGroup(), list(params_or_groups))]
        self.groups: tuple[OptimizerGroup, ...] = tuple(group for group, _ in pairs)
        # each group's gradient-norm metric: the first group's is `grad_norm`, the others' grad_norm/<policy>
        self.norm_names = ["grad_norm", *(f"grad_norm/{group.policy}" for group in self.groups[1:])]
        self.max_norm = train.grad_clip if train.grad_clip > 0 else float("inf")  # 0: no clipping
        first = pairs[0][1]
        count = sum(p.numel() for p in first)  # a shard's count under FSDP2: the auto rule errs towards measuring
        self.measure_change = weight_change == "on" or (weight_change == "auto" and count <= WEIGHT_CHANGE_AUTO_MAX)
        self.taken: list[dict[str, float]] = []  # this update's optimizer steps taken: grad_norm (and |Δθ| / |θ|)
        every = [p for _, params in pairs for p in params]
        fused = all(on_cuda(train.fused_adamw, p.device) for p in every)  # auto: CUDA's fused kernel, CPU as before
        self.optimizer = torch.optim.AdamW(
            [{"params": params, **_settings(group, train)} for group, params in pairs], lr=train.lr,
            betas=tuple(train.betas), weight_decay=train.weight_decay, eps=train.adam_eps, fused=fused or None,
        )  # fmt: skip
        warmup = train.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda n: min(1.0, (n + 1) / warmup) if warmup > 0 else 1.0
        )
        self.ema = EmaWeights(first, train.ema.decay) if train.ema.enabled else None
        self.steps = 0  # optimizer steps taken
        self.skipped = 0  # updates skipped for a non-finite gradient
        self.consecutive_skips = 0

    @property
    def params(self) -> Params:
        """Every group's parameters: the optimizer's own lists (under FSDP2 the module may hold gathered copies now,
        the optimizer the shards)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self) -> None:
        """Clip each group, then step (or skip a non-finite gradient); `metrics` reports the gradient norms before
        clipping."""
        norms = [self.parallel.clip_grad_norm(group["params"], self.max_norm) for group in self.optimizer.param_groups]
        if not all(math.isfinite(norm) for norm in norms):
            return self._skip(next(norm for norm in norms if not math.isfinite(norm)))
        before = [p.detach().clone() for p in self.optimizer.param_groups[0]["params"]] if self.measure_change else None
        lrs = self.scheduler.get_last_lr()  # AdamW must change some weight when a norm > 0 and its lr > 0
        print_before = fingerprint(self.params, self.parallel.sum) if any(map(min, zip(norms, lrs))) else None
        self.optimizer.step()
        if print_before is not None and fingerprint(self.params, self.parallel.sum) == print_before:
            raise WeightsUnchanged(
                f"optimizer step {self.steps + 1} left every trained weight exactly as it was (gradient norm "
                f"{norms[0]:.3g}, lr {lrs[0]:.3g}): the update does not reach the weights — an lr below the weights' "
                "precision (model.dtype), or parameters the optimizer does not hold"
            )
        change = {} if before is None else {"train/weight_change_rel": self._relative_change(before)}
        self.taken.append({**dict(zip(self.norm_names, norms)), **change})
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.consecutive_skips = 0
        if self.ema is not None and self.steps % self.train.ema.update_every == 0:
            ema = self.train.ema  # flow_grpo's warm-up: min(n / (n + 9), decay) at the n-th step
            self.ema.update(min(self.steps / (self.steps + 9), ema.decay) if ema.warmup else None)

    @torch.no_grad()
    def _relative_change(self, before: list[torch.Tensor]) -> float:
        """|θ_after − θ_before| / |θ_before| over the first group (and every shard); `before` is overwritten."""
        norm_before = _total_norm(before)
        torch._foreach_sub_(before, [p.detach() for p in self.optimizer.param_groups[0]["params"]])  # −Δθ, in place
        return _total_norm(before) / norm_before if norm_before > 0 else float("nan")

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

    def metrics(self) -> dict[str, float]:
        """What every update reports about its optimizer steps: the means over those taken (a skipped one changes
        nothing) of the gradient norms (NaN when none was) and |Δθ| / |θ|, the lr and the step counts."""
        taken, self.taken = self.taken, []
        return {**dict.fromkeys(self.norm_names, float("nan")), "lr": self.scheduler.get_last_lr()[0],
                "train/optimizer_steps": self.steps, "train/skipped_updates": self.skipped,
                **reduce_metrics(taken)}  # fmt: skip

    # -- state (the scheduler and counters are plain data; the optimizer and EMA tensors go to DCP) ----------------
    def counters_state(self) -> dict:
        return {
            "scheduler": self.scheduler.state_dict(),
            "counters": [self.steps, self.skipped, self.consecutive_skips],
        }

    def load_counters_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps, self.skipped, self.consecutive_skips = state["counters"]


def _settings(group: OptimizerGroup, train) -> dict:
    """A param group's lr and betas: train's, scaled and replaced as `group` says."""
    return {"lr": train.lr * group.lr_scale, "betas": tuple(group.betas or train.betas)}


def _total_norm(tensors: list[torch.Tensor]) -> float:
    """The 2-norm of all `tensors` together, over every shard of a DTensor."""
    from torch.distributed.tensor import DTensor

    total = torch.nn.utils.get_total_norm(tensors)
    return float(total.full_tensor() if isinstance(total, DTensor) else total)


def apply_train_hyperparameters(optimizer: torch.optim.Optimizer, scheduler, train, log: bool = True,
                                groups: Sequence[OptimizerGroup] = (OptimizerGroup(),)) -> None:  # fmt: skip
    """Give a restored optimizer and LR schedule the config's lr, betas, weight decay, eps and warm-up, each param
    group as its `groups` entry says (its lr scale, its betas).

    Loading a checkpoint restores the saved param groups and the schedule's base lr; a resume must instead use
    the settings it was started with (lowering train.lr is how a diverged run goes on), keeping Adam's moments and
    the step count. `log`: say once (on one worker) what changed from the checkpoint's settings.
    """
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{len(groups)} optimizer groups for an optimizer with {len(optimizer.param_groups)}")
    changed = []
    for i, (group, param_group) in enumerate(zip(groups, optimizer.param_groups)):
        wanted = {**_settings(group, train), "weight_decay": train.weight_decay, "eps": train.adam_eps}
        saved = {"lr": scheduler.base_lrs[i], **{k: param_group[k] for k in ("betas", "weight_decay", "eps")}}
        tag = "" if i == 0 else f"{group.policy} "
        changed += [f"{tag}{k} {saved[k]} → {v}" for k, v in wanted.items() if _differs(saved[k], v)]
        param_group.update(initial_lr=wanted["lr"], betas=wanted["betas"], weight_decay=train.weight_decay,
                           eps=train.adam_eps)  # fmt: skip
    scheduler.base_lrs = [param_group["initial_lr"] for param_group in optimizer.param_groups]
    for param_group, base, lr_lambda in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        param_group["lr"] = base * lr_lambda(scheduler.last_epoch)  # the warm-up of this config
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() (metric `lr`) reports
    if changed and log:
        logger.info("resumed with this config's optimizer settings, not the checkpoint's: %s", ", ".join(changed))


def _differs(saved, wanted) -> bool:
    if isinstance(wanted, tuple):
        return any(_differs(a, b) for a, b in zip(saved, wanted))
    return not math.isclose(float(saved), float(wanted), rel_tol=1e-12, abs_tol=0.0)
