"""What an algorithm is made of, and the registry that selects one by `algorithm.loss`.

A loss is registered once, in its own file, with `register_loss`: its name, its settings (a dataclass next to it,
read from the config's `algorithm.<name>` section), the `Algorithm` class that runs it, and its constraints. The
engine's update loop (`PolicyWorker.update`, engine/worker.py) is the same for every algorithm; an `Algorithm`
supplies only

- on the driver, `prepare`: the step's scores → `Targets`, the O(B) numbers the update needs (advantages, pairs);
- on the worker that holds the rollout: `attach` (the named policies it keeps), `begin` (the batch → its own
  units: samples, or pairs, with what they train on), `loss` (one micro-batch chunk), `end` (after the update).

Algorithms import neither models nor the engine: they get the model (a `FlowModel`) in `attach`. The default
`prepare`, group-relative advantages (Flow-GRPO's, and MixGRPO's per-reward sum), is at the end of this file.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from tensordict import tensorclass

from diffusion_rl.registry import Registry
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.sampling.trajectory import Trajectory

if TYPE_CHECKING:
    from diffusion_rl.config import Config
    from diffusion_rl.config.algorithm import AlgorithmConfig
    from diffusion_rl.config.sampling import SamplingConfig, TreePruneConfig

DEFAULT_POLICY = "default"  # the trained policy's name among the model's named policies


@tensorclass
class Targets:
    """What the update needs from scoring, per row of the step: set by `Algorithm.prepare` on the driver."""

    # [B] fp32: group-relative advantage (0 for a failed sample); tree rollouts: [B, D + 1], per depth of the row's
    # path (algorithms/tree_credit.py), with `step_weights` [B, D + 1] the weight of its steps of each depth
    advantages: torch.Tensor | None = None
    step_weights: torch.Tensor | None = None
    pair_id: torch.Tensor | None = None  # [B] long: the preference pair a row belongs to (−1: none)
    pair_role: torch.Tensor | None = None  # [B] long: 1 chosen, −1 rejected, 0 unpaired


@tensorclass
class TrainBatch:
    """A rollout and its targets, row by row: what `Algorithm.begin` turns into the update's units."""

    traj: Trajectory
    targets: Targets


@dataclass(frozen=True)
class UpdatePosition:
    """Where in the update a loss chunk is: its PPO epoch, mini-batch and the training step (0-based)."""

    epoch: int
    minibatch: int
    step: int


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, to call backward on
    metrics: dict[str, torch.Tensor]  # scalar tensors, detached: averaged over the update's backward passes
    # detached scalars that are shares of this chunk's (row, step) entries: averaged weighted by rows instead
    entry_metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class LossSettings:
    """Base of every loss's settings dataclass (its `algorithm.<loss>` config section)."""

    def check_config(self, algorithm: AlgorithmConfig, sampling: SamplingConfig) -> None:
        """Refuse settings of the algorithm and sampling sections that this loss cannot work with (ValueError)."""


def minibatch_rows(units: int, minibatches: int, m: int) -> torch.Tensor:
    """[≤ U / M] the units of mini-batch m: m, m + M, m + 2M, … (interleaved, so every mini-batch mixes groups)."""
    return torch.arange(m, units, minibatches)


class Algorithm(ABC):
    """How one registered loss trains; see the module docstring. One instance per process that needs it."""

    family: ClassVar[str]  # "policy_gradient" or "direct_preference"
    rollout_policy: ClassVar[str] = DEFAULT_POLICY  # the named policy that samples training rollouts
    # What the rest of the code (the config checks, `estimate`) knows of an algorithm, set here and nowhere else:
    guided: ClassVar[bool] = True  # trains the velocity as sampled (true CFG: two rows a call); False: conditional
    offline: ClassVar[bool] = False  # trains on offline pairs too (data.sample_source=offline)

    @classmethod
    def needs_reference(cls, settings) -> bool:
        """Whether the frozen reference policy is kept (and run): by default, for a KL term to it."""
        return getattr(settings, "kl_beta", 0.0) > 0

    @classmethod
    def trained_calls(cls, algorithm: AlgorithmConfig, sampling: SamplingConfig) -> int:
        """Transformer calls with gradient per sample and epoch of the update."""
        return 1

    @classmethod
    def frozen_calls(cls, settings) -> int:
        """Forwards without gradient (reference, old or EMA policies) per trained call."""
        return int(cls.needs_reference(settings))

    def __init__(self, section: AlgorithmConfig, spec: LossSpec, *, seed: int, sampler: SamplerSettings,
                 reward_weights: dict[str, float], micro_batch_size: int, num_minibatches: int = 1,
                 ppo_epochs: int = 1, tree_prune: TreePruneConfig | None = None):  # fmt: skip
        """`section`: the config's `algorithm` section; the rest is what an algorithm needs from outside it: the
        run seed, the training rollouts' sampler, the rewards' weights by metric name, the update's sizes and the
        tree rollouts' pruning (`make_algorithm` reads them from the config)."""
        self.section = section
        self.settings = section.settings  # this loss's section, algorithm.<loss>
        self.seed = seed
        self.sampler = sampler
        self.reward_weights = dict(reward_weights)
        self.micro_batch_size = micro_batch_size
        self.num_minibatches = num_minibatches
        self.ppo_epochs = ppo_epochs
        self.tree_prune = tree_prune
        self.loss_fn = spec.fn
        self.model = None

    @classmethod  # noqa: B027  (an optional hook: most families accept any config)
    def check_config(cls, algorithm: AlgorithmConfig, sampling: SamplingConfig, sample_source: str) -> None:
        """Refuse values of the algorithm and sampling sections (and data.sample_source) this family cannot work
        with (ValueError naming the key)."""

    # -- driver side ------------------------------------------------------------------------------------------
    def prepare(self, scored, group_index: torch.Tensor) -> tuple[Targets, dict[str, float]]:
        """Targets from the step's scores (`RewardResult`: total [B], per_reward, failed); default: group-relative
        advantages (algorithm.advantage), which every algorithm but DPO trains on."""
        result = group_advantages(scored, group_index, self.section.advantage, self.reward_weights)
        return Targets(advantages=result.advantages, batch_size=[len(group_index)]), result.metrics

    # -- worker side ------------------------------------------------------------------------------------------
    def attach(self, model) -> None:
        """Take the model to train (before it is sharded): add the named policies this algorithm keeps (the
        frozen reference when `needs_reference`)."""
        self.model = model
        if self.needs_reference(self.settings):
            model.policies.keep_reference()

    @abstractmethod
    def begin(self, batch: TrainBatch, step: int) -> tuple[Any, dict[str, float]]:
        """The update's units (a tensorclass of U rows: samples or pairs) and metrics, before any optimizer step."""

    def count(self, units) -> int:
        """How many of `units` carry weight (every units tensorclass has `weight` [U], 1 or 0): the loss of each
        chunk is scaled by the global count."""
        return int(units.weight.sum())

    def unit_rows(self, targets: Targets) -> list[list[int]]:
        """The rows each unit of the update trains on (driver side: where rows must be for the update); default:
        one unit per row."""
        return [[row] for row in range(targets.batch_size[0])]

    @property
    def micro_size(self) -> int:
        """Units per forward/backward."""
        return self.micro_batch_size

    def chunks(self, units) -> int:
        """Backward passes per micro-batch (trained steps or timesteps, one at a time: flat activation memory)."""
        return 1

    @abstractmethod
    def loss(self, units, k: int, at: UpdatePosition) -> LossOutput:
        """The loss of chunk k of one micro-batch of units (with grad), averaged over its units."""

    def end(self, step: int) -> dict[str, float]:
        """After the update of training step `step` (0-based): `step + 1` steps are complete."""
        return {}


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: `fn(input, settings) -> LossOutput` run by `algorithm`, configured by `settings`."""

    name: str
    fn: Callable[[Any, Any], LossOutput]
    settings: type  # a LossSettings dataclass: the config section algorithm.<name>
    algorithm: type[Algorithm]
    sde_only: bool = False  # its formulas assume Flow-GRPO's `sde` step (its std and √dt)

    @property
    def family(self) -> str:
        return self.algorithm.family

    def __call__(self, inp, cfg) -> LossOutput:
        return self.fn(inp, cfg)


def loss_names(**facts) -> str:
    """The registered losses whose algorithm has these facts (e.g. offline=True), comma-separated (for messages)."""
    return ", ".join(n for n, spec in LOSSES.items() if all(getattr(spec.algorithm, k) == v for k, v in facts.items()))


LOSSES: Registry[LossSpec] = Registry(
    "loss", plugins=("diffusion_rl.algorithms.losses", "diffusion_rl.algorithms.preference")
)


def register_loss(name: str, *, settings: type, algorithm: type[Algorithm], sde_only: bool = False):
    """Decorator: register `fn(input, settings) -> LossOutput` as loss `name` (see LossSpec)."""
    if not (isinstance(settings, type) and issubclass(settings, LossSettings)):
        raise TypeError(f"loss '{name}': settings must be a LossSettings dataclass, got {settings!r}")

    def add(fn):
        LOSSES.register(name)(LossSpec(name, fn, settings, algorithm, sde_only))
        return fn

    return add


def make_algorithm(config: Config) -> Algorithm:
    """The algorithm of `config.algorithm.loss` (not attached to a model yet), given its section and what it needs
    from the others."""
    spec, t = LOSSES.get(config.algorithm.loss), config.train
    return spec.algorithm(
        config.algorithm,
        spec,
        seed=config.run.seed,
        sampler=SamplerSettings.of(config.sampling),
        reward_weights={r.metric_name: r.weight for r in config.rewards},
        micro_batch_size=t.micro_batch_size,
        num_minibatches=t.num_minibatches,
        ppo_epochs=t.ppo_epochs,
        tree_prune=None if config.sampling.tree is None else config.sampling.tree.prune,
    )


# -- group-relative advantages: the default `prepare` ----------------------------------------------------------
# Group-relative advantages (Flow-GRPO), and MixGRPO's per-reward aggregation.
#
# Samples that share a group id (the images of one prompt) form a group. For a sample i of group g:
#
#     A_i = (r_i - mean_g) / (std + eps)        std: of all valid rewards of the batch (global_std=True, as in
#                                                Flow-GRPO's default) or of group g's own valid rewards
#     A_i = r_i - mean_g                         when normalize_by_std=False
#
# - The std is taken over ONE value per sample, with `std_ddof`. verl-omni repeats each reward once per trained
#   timestep before taking the std, which makes the advantages depend on how many steps are trained; we use one
#   value per sample, as flow_grpo does (its np.std is ddof 0).
# - A failed sample (reward NaN or inf) is left out of its group's mean and of the std, and gets A = 0.
# - A group with a single valid sample gives A = 0 (no comparison is possible); so does a group whose std is
#   undefined (fewer than std_ddof + 1 valid samples), and a group whose valid rewards are all equal.
# - Advantages are not clipped here; the loss clamps them (adv_clip_max).
#
# Everything is vectorised over the batch with index_add / scatter_reduce on dense group indices.

_STAT_KEYS = ("mean", "std", "min", "max", "abs_mean")


@dataclass(frozen=True)
class GroupNorm:
    """How a group's rewards become advantages (the config's algorithm.advantage section; module docstring)."""

    global_std: bool = True
    std_ddof: int = 0
    eps: float = 1e-4
    normalize_by_std: bool = True

    def __post_init__(self):
        if isinstance(self.std_ddof, bool) or not isinstance(self.std_ddof, int) or self.std_ddof < 0:
            raise ValueError(
                f"std_ddof must be an integer >= 0 (0: population std, 1: sample std); got {self.std_ddof!r}"
            )
        if not math.isfinite(self.eps) or self.eps < 0:
            raise ValueError(f"eps must be a finite number >= 0; got {self.eps}")

    @classmethod
    def of(cls, options) -> GroupNorm:
        """From any object with these four attributes (the config's algorithm.advantage)."""
        return cls(options.global_std, options.std_ddof, options.eps, options.normalize_by_std)


@dataclass
class AdvantageResult:
    advantages: torch.Tensor  # float32 [B], on the rewards' device
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Groups:
    """One reward's advantages and the per-group facts the metrics need."""

    advantages_B: torch.Tensor  # float64 [B]
    has_valid_G: torch.Tensor  # bool [G]: at least one valid sample
    constant_G: torch.Tensor  # bool [G]: at least one valid sample, all valid rewards equal
    singleton_G: torch.Tensor  # bool [G]: exactly one valid sample


def compute_group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, norm: GroupNorm = GroupNorm()
) -> AdvantageResult:
    """Advantages for rewards [B] (NaN = failed) grouped by group_ids [B] (any integers, e.g. prompt indices).
    Metrics: advantage/{mean,std,min,max,abs_mean} over the batch (failed samples' zeros included: what the loss
    sees), advantage/{zero_std,singleton}_group_fraction over the groups with a valid sample (a singleton: both)."""
    group_B, num_groups = _dense_groups(rewards, group_ids)
    groups = _group_advantages(rewards, group_B, num_groups, norm)
    metrics = _batch_stats("advantage", groups.advantages_B)
    metrics.update(_group_fractions("advantage", groups.has_valid_G, groups.constant_G, groups.singleton_G))
    return AdvantageResult(advantages=groups.advantages_B.float(), metrics=metrics)


def combine_per_reward_advantages(
    per_reward: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_ids: torch.Tensor,
    norm: GroupNorm = GroupNorm(),
) -> AdvantageResult:
    """MixGRPO's advantage aggregation: A = sum_k weights[k] * A_k, each A_k computed as above from per_reward[k].

    A sample failed on reward k (NaN) gets A_k = 0 and still takes its other rewards' advantages; to drop a
    sample altogether, set it to NaN in every reward.

    Metrics: advantage/{mean,...} of the sum; advantage/<name>/... for each reward; the top-level group fractions
    count groups in which no reward gives a signal (all constant / all at most one valid sample).
    """
    if not per_reward:
        raise ValueError("combine_per_reward_advantages needs at least one reward")
    if set(per_reward) != set(weights):
        no_weight, no_reward = sorted(set(per_reward) - set(weights)), sorted(set(weights) - set(per_reward))
        raise ValueError(
            f"per_reward and weights must name the same rewards; rewards without a weight: {no_weight}, "
            f"weights without a reward: {no_reward}"
        )
    bad = {k: w for k, w in weights.items() if not math.isfinite(w)}
    if bad:
        raise ValueError(f"advantage weights must be finite; got {bad}")

    first = next(iter(per_reward.values()))
    group_B, num_groups = _dense_groups(first, group_ids)
    total_B = torch.zeros(first.shape, dtype=torch.float64, device=first.device)
    no_signal_G = torch.ones(num_groups, dtype=torch.bool, device=first.device)
    all_singleton_G = torch.ones_like(no_signal_G)
    any_valid_G = torch.zeros_like(no_signal_G)
    metrics: dict[str, float] = {}
    for name, rewards in per_reward.items():
        _dense_groups(rewards, group_ids)  # shape and dtype checks for this reward
        groups = _group_advantages(rewards, group_B, num_groups, norm)
        total_B += weights[name] * groups.advantages_B
        # A group gives a signal for reward k unless it has no valid sample, one, or only equal rewards.
        no_signal_G &= groups.constant_G | ~groups.has_valid_G
        all_singleton_G &= groups.singleton_G | ~groups.has_valid_G
        any_valid_G |= groups.has_valid_G
        metrics.update(_batch_stats(f"advantage/{name}", groups.advantages_B))
        metrics.update(_group_fractions(f"advantage/{name}", groups.has_valid_G, groups.constant_G, groups.singleton_G))
    metrics.update(_batch_stats("advantage", total_B))
    metrics.update(_group_fractions("advantage", any_valid_G, no_signal_G & any_valid_G, all_singleton_G & any_valid_G))
    return AdvantageResult(advantages=total_B.float(), metrics=metrics)


def _dense_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """group_ids mapped onto 0..G-1 (long [B]) and G, after checking the shapes and dtypes."""
    if rewards.ndim != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a 1-D float tensor [B]; got {rewards.dtype} {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids {tuple(group_ids.shape)} must have the rewards' shape {tuple(rewards.shape)}")
    if group_ids.dtype == torch.bool or group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor; got {group_ids.dtype}")
    if rewards.numel() == 0:
        raise ValueError("cannot compute advantages of an empty batch")
    unique_G, group_B = torch.unique(group_ids.to(rewards.device), return_inverse=True)
    return group_B, unique_G.numel()


def _group_advantages(
    rewards_B: torch.Tensor,
    group_B: torch.Tensor,
    num_groups: int,
    norm: GroupNorm,
) -> _Groups:
    # fp64: reward spreads can be ~1e-5 of their magnitude (JPEG sizes), below fp32's resolution of the mean
    r_B = rewards_B.detach().to(torch.float64)
    valid_B = torch.isfinite(r_B)
    r0_B = torch.where(valid_B, r_B, 0.0)
    zeros_G = torch.zeros(num_groups, dtype=torch.float64, device=r_B.device)

    count_G = zeros_G.index_add(0, group_B, valid_B.double())
    mean_G = zeros_G.index_add(0, group_B, r0_B) / count_G.clamp_min(1)
    max_G = torch.full_like(zeros_G, -math.inf).scatter_reduce(0, group_B, r_B.masked_fill(~valid_B, -math.inf), "amax")
    min_G = torch.full_like(zeros_G, math.inf).scatter_reduce(0, group_B, r_B.masked_fill(~valid_B, math.inf), "amin")
    has_valid_G = count_G >= 1
    constant_G = has_valid_G & (max_G == min_G)

    dev_B = torch.where(valid_B, r0_B - mean_G[group_B], 0.0)
    # Exactly 0 in a constant group: the mean of equal floats can differ from them in the last bit.
    dev_B = torch.where(constant_G[group_B], 0.0, dev_B)

    std_defined_B = torch.ones_like(valid_B)
    std_ddof = norm.std_ddof
    if norm.normalize_by_std:
        if norm.global_std:
            n_valid = valid_B.sum().double()
            mean_all = r0_B.sum() / n_valid.clamp_min(1)
            sq_dev = torch.where(valid_B, (r0_B - mean_all) ** 2, 0.0).sum()
            dof = n_valid - std_ddof
            std_B = torch.sqrt(sq_dev / dof.clamp_min(1)).expand_as(r_B)
            std_defined_B = (dof > 0).expand_as(valid_B)
        else:
            sq_dev_G = zeros_G.index_add(0, group_B, dev_B**2)
            dof_G = count_G - std_ddof
            std_B = torch.sqrt(sq_dev_G / dof_G.clamp_min(1))[group_B]
            std_defined_B = (dof_G > 0)[group_B]
        denom_B = std_B + norm.eps
        # denom is 0 only with eps=0 and std=0, where dev is 0 too (constant group or batch): advantage 0
        adv_B = dev_B / torch.where(denom_B > 0, denom_B, 1.0)
    else:
        adv_B = dev_B

    keep_B = valid_B & (count_G[group_B] >= 2) & std_defined_B
    return _Groups(
        advantages_B=torch.where(keep_B, adv_B, 0.0),
        has_valid_G=has_valid_G,
        constant_G=constant_G,
        singleton_G=count_G == 1,
    )


def _batch_stats(prefix: str, adv_B: torch.Tensor) -> dict[str, float]:
    values = torch.stack([adv_B.mean(), adv_B.std(correction=0), adv_B.min(), adv_B.max(), adv_B.abs().mean()])
    return {f"{prefix}/{key}": v for key, v in zip(_STAT_KEYS, values.tolist())}


def _group_fractions(
    prefix: str, has_valid_G: torch.Tensor, constant_G: torch.Tensor, singleton_G: torch.Tensor
) -> dict[str, float]:
    n = has_valid_G.sum().clamp_min(1).double()
    return {f"{prefix}/zero_std_group_fraction": ((constant_G & has_valid_G).sum() / n).item(),
            f"{prefix}/singleton_group_fraction": ((singleton_G & has_valid_G).sum() / n).item()}  # fmt: skip


def group_advantages(scored, group_index: torch.Tensor, options, weights: Mapping[str, float]) -> AdvantageResult:
    """The advantages of a scored batch (total [B], NaN = failed; per_reward {name: [B]}; failed [B]) under `options`
    (algorithm.advantage): `combine: sum_rewards` normalises the total; `sum_advantages` (MixGRPO's) each reward
    within its groups, then sums them with `weights` (by name), a failed sample NaN in every reward (advantage 0)."""
    norm = GroupNorm.of(options)
    if options.combine == "sum_rewards":
        return compute_group_advantages(torch.from_numpy(scored.total), group_index, norm)
    per_reward = {name: torch.from_numpy(np.where(scored.failed, np.nan, s)) for name, s in scored.per_reward.items()}
    return combine_per_reward_advantages(per_reward, dict(weights), group_index, norm)
