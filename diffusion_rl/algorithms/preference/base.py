"""What the direct-preference / forward-process algorithms (Diffusion-DPO, DiffusionNFT, AWM, DGPO, CRD, TDM-R1)
share.

These train on the final clean latents x0 of rollouts, re-noised by the forward process
x_t = (1 - t) * x0 + t * eps with fresh eps, instead of on the sampler's per-step log-probs, so their rollouts
may be plain ODE samples. Each loss is `fn(inp, settings) -> LossOutput` with an input dataclass of its own;
velocities are the model's conditional predictions (at `FlowModel.conditional_guidance` of sampling.guidance: 1
with classifier-free guidance, the sampled scale for a guidance-distilled model such as FLUX.1-dev, whose guidance
is an input; offline pairs too), and "old", reference and EMA predictions are computed the same way under no_grad
(the losses detach them anyway). Every eps and t comes from a generator seeded by (run seed, step, sample, …), so
a sample's draws never depend on the batch it is in, and a resumed run draws the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, tensorclass

from diffusion_rl.algorithms.base import Algorithm, TrainBatch, UpdatePosition, loss_names
from diffusion_rl.algorithms.credit import Targets
from diffusion_rl.config.fields import check
from diffusion_rl.sampling.trajectory import Trajectory
from diffusion_rl.utils.seeding import make_generator


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N]: the mean over every non-batch dim."""
    return x.flatten(1).mean(dim=1)


def group_errors(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[U, G, ...] → [U, G]: mean (v − target)² over each row's non-batch dims, fp32."""
    # fp32: a group preference lives in differences of errors ~1e-3 apart, which bf16 rounds away
    return (v.float() - target.float()).pow(2).flatten(2).mean(dim=2)


def batch_rows(name: str, x: torch.Tensor) -> int:
    """N of a [N, ...] tensor with at least 2 dims; a clear error otherwise."""
    if x.ndim < 2:
        raise ValueError(f"{name} must be [N, ...] with at least 2 dims; got {tuple(x.shape)}")
    return x.shape[0]


def check_vectors(batch: int, **tensors: torch.Tensor | None) -> None:
    """Every given tensor must be [batch]; None is skipped."""
    for name, value in tensors.items():
        if value is not None and tuple(value.shape) != (batch,):
            raise ValueError(f"{name} must be [N] = ({batch},); got {tuple(value.shape)}")


def check_same_shape(like: torch.Tensor, like_name: str, **tensors: torch.Tensor | None) -> None:
    for name, value in tensors.items():
        if value is not None and value.shape != like.shape:
            raise ValueError(f"{name} {tuple(value.shape)} must have {like_name}'s shape {tuple(like.shape)}")


def check_groups(v: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor | None, **like_v) -> None:
    """A group unit's inputs: v [U, G, ...], advantages [U, G], weights [U] or None, and `like_v` shaped as v."""
    if v.ndim < 3:
        raise ValueError(f"v must be [U, G, ...] with at least 3 dims; got {tuple(v.shape)}")
    check_same_shape(v, "v", **like_v)
    if tuple(advantages.shape) != tuple(v.shape[:2]):
        raise ValueError(f"advantages must be [U, G] = {tuple(v.shape[:2])}; got {tuple(advantages.shape)}")
    if weights is not None and tuple(weights.shape) != (v.shape[0],):
        raise ValueError(f"weights must be [U] = ({v.shape[0]},); got {tuple(weights.shape)}")


def detached(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in metrics.items()}


def weighted(values_N: torch.Tensor, weights_N: torch.Tensor | None) -> torch.Tensor:
    """Per-unit loss terms times their weights (None: all 1). A zero weight (a unit that only pads a worker's share
    of an update to its peers') leaves the unit in the mean's denominator, as the policy-gradient weights do."""
    return values_N if weights_N is None else values_N * weights_N.detach().to(values_N.dtype)


def metric_mean(values_N: torch.Tensor, weights_N: torch.Tensor | None) -> torch.Tensor:
    """The mean of a metric over the units that carry weight (all units when weights is None)."""
    if weights_N is None:
        return values_N.mean()
    w = weights_N.detach().to(values_N.dtype)
    return (values_N * w).sum() / w.sum().clamp_min(1)


RAMP_RATE = 0.001
RAMP_CAP = 0.3


def ramped_decay(step: int) -> float:
    """min(0.3, 0.001·step): the decay d of an EMA adapter that follows the policy closely (adapter ← d·adapter +
    (1 − d)·θ; 0 at first, so the first update copies θ), as the reference code of AWM's `ema` and DGPO's `old`
    ramps it."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return min(RAMP_CAP, RAMP_RATE * step)


def noise_like(x0: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """ε [B, …] with row i drawn from generators[i] (on the CPU, so the draw is the same on every device)."""
    shape = tuple(x0.shape[1:])
    return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(x0.device, torch.float32)


def forward_noise(x0: torch.Tensor, eps: torch.Tensor, t_B: torch.Tensor) -> torch.Tensor:
    """x_t = (1 − t)·x0 + t·ε, fp32."""
    t = t_B.to(x0.device, torch.float32).view(-1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0.float() + t * eps


class ForwardProcess(Algorithm):
    """Base of the direct-preference algorithms: velocities of the named policies at re-noised final latents."""

    family = "direct_preference"
    guided = False  # velocities are the model's conditional predictions (no CFG: one row a call)

    @classmethod
    def check_config(cls, algorithm, sampling, sample_source) -> None:
        check(
            sampling.window.kind == "all",
            f"sampling.window.kind={sampling.window.kind} selects the steps a policy-gradient loss trains; "
            f"algorithm.loss={algorithm.loss} trains on final latents: use window.kind=all "
            "(sde_type=ode for pure ODE sampling)",
        )
        rc = algorithm.rollout_correction
        check(
            rc.mode == "bypass" and rc.rs_stat is None,
            "algorithm.rollout_correction applies to the policy-gradient losses; leave it at its defaults",
        )
        check(
            sample_source == "online" or cls.offline,
            f"data.sample_source=offline trains algorithm.loss={loss_names(offline=True)} only, got {algorithm.loss}",
        )

    def attach(self, model) -> None:
        super().attach(model)
        s = self.sampler
        self.sigmas = model.sigma_schedule(s.num_steps, s.height, s.width, s.frames)  # [T + 1], σ_0 = 1, σ_T = 0

    def velocity(self, x_t: torch.Tensor, t_B: torch.Tensor, cond: TensorDict) -> torch.Tensor:
        """The conditional velocity of the active policy: no CFG, the embedded guidance as sampled (module doc)."""
        return self.model.velocity(x_t, t_B, cond, self.model.conditional_guidance(self.sampler.guidance))

    @torch.no_grad()
    def velocity_of(self, policy: str, x_t: torch.Tensor, t_B: torch.Tensor, cond: TensorDict) -> torch.Tensor:
        """The velocity of a named policy (`reference`: the frozen start), without gradient."""
        if policy == "reference":
            with self.model.reference():
                return self.velocity(x_t, t_B, cond)
        with self.model.using(policy):
            return self.velocity(x_t, t_B, cond)

    @torch.no_grad()
    def reference_velocity(self, x_t: torch.Tensor, t_B: torch.Tensor, cond: TensorDict, guidance: float | None):
        """The frozen reference's velocity: conditional as the policy's (guidance None), or at that CFG scale."""
        if guidance is None:
            return self.velocity_of("reference", x_t, t_B, cond)
        with self.model.reference():
            return self.model.velocity(x_t, t_B, cond, guidance)


@dataclass
class NoisedGroups:
    """A micro-batch of U groups of G rows, its final latents re-noised at one σ: the rows flat for the forwards,
    the targets grouped for the loss."""

    x_t: torch.Tensor  # [U·G, ...] fp32
    t: torch.Tensor  # [U·G] the σ of every row
    cond: TensorDict  # [U·G]
    target: torch.Tensor  # [U, G, ...] u = ε − x0

    def grouped(self, v: torch.Tensor | None) -> torch.Tensor | None:
        """A velocity of the flat rows, [U·G, ...] → [U, G, ...] (None stays None)."""
        return None if v is None else v.view(self.target.shape)


@tensorclass
class GroupUnits:
    """The update's units when a unit is a prompt's whole group: its G rows side by side."""

    traj: Trajectory  # [U, G]
    advantages: torch.Tensor  # [U, G]
    weight: torch.Tensor  # [U] 1, or 0 for a group that only pads this worker's share


class GroupProcess(ForwardProcess):
    """A forward-process algorithm whose unit is a prompt's whole group (DGPO, CRD), on ODE rollouts: a micro-batch
    holds ⌊train.micro_batch_size / G⌋ groups (at least one) and every worker trains whole groups."""

    group_rows = 1  # G, the rows of a unit: set by `begin` from the batch (every group of a step has the same size)

    @classmethod
    def check_config(cls, algorithm, sampling, sample_source) -> None:
        super().check_config(algorithm, sampling, sample_source)
        cls.check_rollout(algorithm, sampling)

    @classmethod
    def check_rollout(cls, algorithm, sampling) -> None:
        """The rollouts it trains on: plain ODE samples (their final latents)."""
        check(
            sampling.sde_type == "ode",
            f"algorithm.loss={algorithm.loss} trains on deterministic rollouts: set sampling.sde_type=ode, got "
            f"{sampling.sde_type}",
        )

    def prepare(self, scored, group_index: torch.Tensor) -> tuple[Targets, dict[str, float]]:
        """The credit's advantages, and each row's group: the update's unit (`unit_rows`)."""
        targets, metrics = self.credit.targets(scored, group_index)
        targets.group_index = group_index.long()
        return targets, metrics

    def unit_rows(self, targets: Targets) -> list[list[int]]:
        """Each group's rows, groups in order of first appearance."""
        rows: dict[int, list[int]] = {}
        for row, group in enumerate(targets.group_index.tolist()):
            rows.setdefault(group, []).append(row)
        return list(rows.values())

    def begin(self, batch: TrainBatch, step: int) -> tuple[GroupUnits, dict[str, float]]:
        traj = batch.traj
        groups = traj.ids.group_index
        order = torch.argsort(groups, stable=True)  # each group's rows together, in row order
        _, sizes = torch.unique_consecutive(groups[order], return_counts=True)
        if len(sizes) and bool((sizes != sizes[0]).any()):
            raise ValueError(
                f"{self.section.loss} trains whole groups of one size; this worker holds groups of {sizes.tolist()}"
            )
        U = len(sizes)
        G = int(sizes[0]) if U else 1
        self.group_rows = G
        units = GroupUnits(traj=traj[order].reshape(U, G), advantages=batch.targets.advantages[order].view(U, G),
                           weight=torch.ones(U, device=traj.device), batch_size=[U])  # fmt: skip
        return units, {}

    @property
    def micro_size(self) -> int:
        return max(1, self.micro_batch_size // self.group_rows)  # groups per micro-batch

    def noised(
        self, units: GroupUnits, index: int, at: UpdatePosition, k: int, tag: tuple, per: str = "sample"
    ) -> NoisedGroups:
        """The units' final latents at step index `index` of the schedule: x_t = (1 − σ)·x0 + σ·ε, ε of a row from
        make_generator(run seed, step, *tag, i, k), i its sample's index (per="group": its group's, one ε per
        group), so a row's draw never depends on the micro-batch it is in."""
        U, G = units.advantages.shape
        traj = units.traj.reshape(U * G)
        t_N = self.sigmas[index].expand(U * G).to(traj.device)
        x0 = traj.final_latents.float()
        keys = traj.ids.group_index if per == "group" else traj.ids.sample_index
        eps = noise_like(x0, [make_generator(self.seed, at.step, *tag, int(i), k) for i in keys])
        x_t = forward_noise(x0, eps, t_N)
        return NoisedGroups(x_t=x_t, t=t_N, cond=traj.cond, target=(eps - x0).view(U, G, *x0.shape[1:]))
