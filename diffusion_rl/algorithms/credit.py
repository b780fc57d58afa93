"""Credit: how a step's scores become the advantage of each row (`Targets`), on the driver, and of each trained step,
on the worker. `FlatCredit` is every algorithm's (`Algorithm.prepare`): one group-relative advantage per row, the same
on each of its trained steps (Flow-GRPO and its relatives; TempFlow-GRPO's per-step credit is flat too: its branching
is the sampler's shared initial noise with a one-step window). `SummedCredit` is MixGRPO's (`algorithm.advantage.
combine: sum_advantages`); tree rollouts take `TreeCredit` (algorithms/tree_credit.py) instead. Each is chosen when
the algorithm is built, so the plain step walks past neither.

Group-relative advantages (Flow-GRPO's), pure tensor functions:

Samples that share a group id (the images of one prompt) form a group. For a sample i of group g:

    A_i = (r_i - mean_g) / (std + eps)        std: of all valid rewards of the batch (global_std=True, as in
                                               Flow-GRPO's default) or of group g's own valid rewards
    A_i = r_i - mean_g                         when normalize_by_std=False

- The std is taken over ONE value per sample, with `std_ddof`. verl-omni repeats each reward once per trained
  timestep before taking the std, which makes the advantages depend on how many steps are trained; we use one
  value per sample, as flow_grpo does (its np.std is ddof 0).
- A failed sample (reward NaN or inf) is left out of its group's mean and of the std, and gets A = 0.
- A group with a single valid sample gives A = 0 (no comparison is possible); so does a group whose std is
  undefined (fewer than std_ddof + 1 valid samples), and a group whose valid rewards are all equal.
- Advantages are not clipped here; the loss clamps them (adv_clip_max).
- Several rewards (MixGRPO's `sum_advantages`): A = sum_k weight_k · A_k, each A_k as above from reward k alone; a
  sample failed on reward k takes A_k = 0 and still its other rewards' advantages.

The options are any object with `global_std`, `std_ddof`, `eps` and `normalize_by_std`: the config's
algorithm.advantage (which checks their ranges when it loads), or a `GroupNorm`. Everything is vectorised over the
batch with index_add / scatter_reduce on dense group indices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from tensordict import tensorclass

_METRIC_KEYS = ("mean", "std", "min", "max", "abs_mean", "zero_std_group_fraction", "singleton_group_fraction")


@tensorclass
class Targets:
    """What the update needs from scoring, per row of the step: set by `Algorithm.prepare` on the driver."""

    # [B] fp32: group-relative advantage (0 for a failed sample); tree rollouts: [B, D + 1], per depth of the row's
    # path (algorithms/tree_credit.py), with `step_weights` [B, D + 1] the weight of its steps of each depth
    advantages: torch.Tensor | None = None
    step_weights: torch.Tensor | None = None
    pair_id: torch.Tensor | None = None  # [B] long: the preference pair a row belongs to (−1: none)
    pair_role: torch.Tensor | None = None  # [B] long: 1 chosen, −1 rejected, 0 unpaired
    group_index: torch.Tensor | None = None  # [B] long: each row's group, for an algorithm whose unit is a whole group
    kl_weights: torch.Tensor | None = None  # [B] fp32: each row's weight of the KL term (GARDO's gate); None: 1


@dataclass(frozen=True)
class GroupNorm:
    """The advantage options as a plain value (Flow-GRPO's by default), for callers without a config."""

    global_std: bool = True
    std_ddof: int = 0
    eps: float = 1e-4
    normalize_by_std: bool = True


@dataclass
class AdvantageResult:
    advantages: torch.Tensor  # float32 [B], on the rewards' device
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Groups:
    """One reward's advantages (or the weighted sum's) and the per-group facts the metrics need."""

    advantages_B: torch.Tensor  # float64 [B]
    has_valid_G: torch.Tensor  # bool [G]: at least one valid sample
    constant_G: torch.Tensor  # bool [G]: at least one valid sample, all valid rewards equal
    singleton_G: torch.Tensor  # bool [G]: exactly one valid sample


def group_advantages(
    per_reward: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_ids: torch.Tensor,
    norm=GroupNorm(),
    itemize: bool = False,
) -> AdvantageResult:
    """A = sum_k weights[k] · A_k, each A_k the group-relative advantage of per_reward[k] [B] (NaN = failed) grouped
    by group_ids [B] (any integers, e.g. prompt indices); one reward: its own advantages.

    Metrics: advantage/{mean,std,min,max,abs_mean} of the sum over the batch (failed samples' zeros included: what the
    loss sees); advantage/{zero_std,singleton}_group_fraction over the groups with a valid sample, counting the
    groups in which no reward gives a signal (all constant / all at most one valid sample); `itemize`: the same
    per reward, under advantage/<name>/."""
    if set(per_reward) != set(weights) or not per_reward:
        raise ValueError(f"per_reward {sorted(per_reward)} and weights {sorted(weights)} must name the same rewards")
    first = next(iter(per_reward.values()))
    num_groups = torch.unique(group_ids).numel()
    total_B = torch.zeros(first.shape, dtype=torch.float64, device=first.device)
    no_signal_G = torch.ones(num_groups, dtype=torch.bool, device=first.device)
    all_singleton_G = torch.ones_like(no_signal_G)
    any_valid_G = torch.zeros_like(no_signal_G)
    metrics: dict[str, float] = {}
    for name, rewards in per_reward.items():
        groups = _group_advantages(rewards, group_ids, norm)
        total_B += weights[name] * groups.advantages_B
        # A group gives a signal for reward k unless it has no valid sample, one, or only equal rewards.
        no_signal_G &= groups.constant_G | ~groups.has_valid_G
        all_singleton_G &= groups.singleton_G | ~groups.has_valid_G
        any_valid_G |= groups.has_valid_G
        if itemize:
            metrics.update(_advantage_metrics(f"advantage/{name}", groups.advantages_B, groups))
    summed = _Groups(total_B, any_valid_G, no_signal_G & any_valid_G, all_singleton_G & any_valid_G)
    metrics.update(_advantage_metrics("advantage", total_B, summed))
    return AdvantageResult(advantages=total_B.float(), metrics=metrics)


def compute_group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, norm=GroupNorm()) -> AdvantageResult:
    """One reward's group-relative advantages: rewards [B] (NaN = failed) grouped by group_ids [B]; the metrics of
    `group_advantages` of it alone."""
    groups = _group_advantages(rewards, group_ids, norm)
    return AdvantageResult(groups.advantages_B.float(), _advantage_metrics("advantage", groups.advantages_B, groups))


def _group_advantages(rewards_B: torch.Tensor, group_ids: torch.Tensor, norm: GroupNorm) -> _Groups:
    # fp64: reward spreads can be ~1e-5 of their magnitude (JPEG sizes), below fp32's resolution of the mean
    r_B = rewards_B.detach().to(torch.float64)
    unique_G, group_B = torch.unique(group_ids.to(r_B.device), return_inverse=True)  # any integers onto 0..G-1
    valid_B = torch.isfinite(r_B)
    r0_B = torch.where(valid_B, r_B, 0.0)
    zeros_G = torch.zeros(unique_G.numel(), dtype=torch.float64, device=r_B.device)

    count_G = zeros_G.index_add(0, group_B, valid_B.double())
    mean_G = zeros_G.index_add(0, group_B, r0_B) / count_G.clamp_min(1)
    max_G = torch.full_like(zeros_G, -math.inf).scatter_reduce(0, group_B, r_B.masked_fill(~valid_B, -math.inf), "amax")
    min_G = torch.full_like(zeros_G, math.inf).scatter_reduce(0, group_B, r_B.masked_fill(~valid_B, math.inf), "amin")
    has_valid_G = count_G >= 1
    constant_G = has_valid_G & (max_G == min_G)

    dev_B = torch.where(valid_B, r0_B - mean_G[group_B], 0.0)
    # Exactly 0 in a constant group: the mean of equal floats can differ from them in the last bit.
    dev_B = torch.where(constant_G[group_B], 0.0, dev_B)

    adv_B, std_defined_B = dev_B, torch.ones_like(valid_B)
    if norm.normalize_by_std:
        if norm.global_std:
            n_valid = valid_B.sum().double()
            mean_all = r0_B.sum() / n_valid.clamp_min(1)
            sq_dev = torch.where(valid_B, (r0_B - mean_all) ** 2, 0.0).sum()
            dof = n_valid - norm.std_ddof
            std_B = torch.sqrt(sq_dev / dof.clamp_min(1)).expand_as(r_B)
            std_defined_B = (dof > 0).expand_as(valid_B)
        else:
            sq_dev_G = zeros_G.index_add(0, group_B, dev_B**2)
            dof_G = count_G - norm.std_ddof
            std_B = torch.sqrt(sq_dev_G / dof_G.clamp_min(1))[group_B]
            std_defined_B = (dof_G > 0)[group_B]
        denom_B = std_B + norm.eps
        # denom is 0 only with eps=0 and std=0, where dev is 0 too (constant group or batch): advantage 0
        adv_B = dev_B / torch.where(denom_B > 0, denom_B, 1.0)

    keep_B = valid_B & (count_G[group_B] >= 2) & std_defined_B
    return _Groups(torch.where(keep_B, adv_B, 0.0), has_valid_G, constant_G, singleton_G=count_G == 1)


def _advantage_metrics(prefix: str, adv_B: torch.Tensor, groups: _Groups | None = None) -> dict[str, float]:
    """{prefix}/{mean,std,min,max,abs_mean} of adv_B over the batch and, with `groups`, the fractions of the groups
    with a valid sample that are constant (zero_std_group_fraction) or singletons: one read back to the host."""
    values = [adv_B.mean(), adv_B.std(correction=0), adv_B.min(), adv_B.max(), adv_B.abs().mean()]
    if groups is not None:
        n = groups.has_valid_G.sum().clamp_min(1).double()
        values += [(g & groups.has_valid_G).sum() / n for g in (groups.constant_G, groups.singleton_G)]
    return {f"{prefix}/{key}": v for key, v in zip(_METRIC_KEYS, torch.stack(values).tolist())}


class FlatCredit:
    """The advantages of the step's weighted reward total, one per row, on each of its trained steps (weight 1)."""

    def __init__(self, advantage, reward_weights: dict[str, float]):
        self.advantage, self.reward_weights = advantage, reward_weights  # the config's algorithm.advantage

    def targets(self, scored, group_index: torch.Tensor) -> tuple[Targets, dict[str, float]]:
        result = compute_group_advantages(torch.from_numpy(scored.total), group_index, self.advantage)
        return Targets(advantages=result.advantages, batch_size=[len(group_index)]), result.metrics

    def per_step(self, targets: Targets, traj, columns_BK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, K] advantages and step weights of the trained window columns `columns_BK` of the rollout `traj`."""
        adv_B = targets.advantages
        return adv_B[:, None].expand(-1, columns_BK.shape[1]), torch.ones(columns_BK.shape, device=adv_B.device)


class SummedCredit(FlatCredit):
    """MixGRPO's `sum_advantages`: each reward's advantages within its groups, summed with the rewards' weights; a
    failed sample is NaN in every reward (advantage 0)."""

    def targets(self, scored, group_index: torch.Tensor) -> tuple[Targets, dict[str, float]]:
        per_reward = {k: torch.from_numpy(np.where(scored.failed, np.nan, s)) for k, s in scored.per_reward.items()}
        result = group_advantages(per_reward, self.reward_weights, group_index, self.advantage, itemize=True)
        return Targets(advantages=result.advantages, batch_size=[len(group_index)]), result.metrics
