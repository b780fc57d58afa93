"""What an algorithm is made of, and how a loss registers into the registry that `algorithm.loss` selects from
(`LOSSES`, config/plugins.py).

A loss is registered once, in its own file, with `register_loss`: its name, its settings (a dataclass next to it,
read from the config's `algorithm.<name>` section), the `Algorithm` class that runs it, and its constraints. The
engine's update loop (`PolicyWorker.update`, engine/worker.py) is the same for every algorithm; an `Algorithm`
supplies only

- on the driver, `prepare`: the step's scores → `Targets`, the O(B) numbers the update needs (advantages, pairs);
- on the worker that holds the rollout: `attach` (the named policies it keeps), `begin` (the batch → its own
  units: samples, or pairs, with what they train on), `loss` (one micro-batch chunk), `end` (after the update).

Algorithms import neither models nor the engine: they get the model (a `FlowModel`) in `attach`. The default
`prepare` is the algorithm's credit (algorithms/credit.py): group-relative advantages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from tensordict import tensorclass

from diffusion_rl.algorithms.credit import FlatCredit, SummedCredit, Targets
from diffusion_rl.config.plugins import LOSSES
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.sampling.trajectory import Trajectory

if TYPE_CHECKING:
    from diffusion_rl.config import Config
    from diffusion_rl.config.algorithm import AlgorithmConfig
    from diffusion_rl.config.sampling import SamplingConfig, TreePruneConfig

DEFAULT_POLICY = "default"  # the trained policy's name among the model's named policies


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


@dataclass(frozen=True)
class OptimizerGroup:
    """One AdamW param group of the update's optimizer: a trained policy's tensors (`default`, or an adapter the
    algorithm adds with `policies.add(name, trained=True)`), its lr train.lr × `lr_scale`, its betas (None:
    train.betas); weight decay, eps, warm-up and gradient clipping (on the group's own norm) are train's."""

    policy: str = DEFAULT_POLICY
    lr_scale: float = 1.0
    betas: tuple[float, float] | None = None

    def __post_init__(self):
        if not self.lr_scale > 0:
            raise ValueError(f"optimizer group '{self.policy}': lr_scale must be > 0, got {self.lr_scale}")
        if self.betas is not None and not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer group '{self.policy}': betas must be in [0, 1), got {self.betas}")


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, to call backward on
    # scalar tensors, detached: reduced over the update's backward passes by their declared rule (the mean unless
    # the loss declares another: diffusion_rl/metrics.py)
    metrics: dict[str, torch.Tensor]


class LossSettings:
    """Base of every loss's settings dataclass (its `algorithm.<loss>` config section)."""

    def check_config(self, algorithm: AlgorithmConfig, sampling: SamplingConfig) -> None:
        """Refuse settings of the algorithm and sampling sections that this loss cannot work with (ValueError)."""

    def check_run(self, cfg: Config) -> None:
        """Refuse other sections of the run this loss cannot work with (what it reads of the guard, the rewards)."""


def minibatch_rows(units: int, minibatches: int, m: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[≤ U / M] the units of mini-batch m: m, m + M, m + 2M, … (interleaved, so every mini-batch mixes groups), on
    `device`: that of the tensors they index, since an index on another device is copied there first, and a copy
    between the host and a GPU waits for the GPU (once per tensor of a tensorclass indexed)."""
    return torch.arange(m, units, minibatches, device=device)


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
    def optimizer_groups(cls, settings) -> tuple[OptimizerGroup, ...]:
        """The optimizer's param groups, the trained `default` policy's first (the one whose gradient norm is the
        `grad_norm` metric and whose weights the EMA averages); by default that one alone, with train's settings."""
        return (OptimizerGroup(),)

    @classmethod
    def trained_calls(cls, algorithm: AlgorithmConfig, sampling: SamplingConfig) -> int:
        """Transformer calls with gradient per sample and epoch of the update."""
        return 1

    @classmethod
    def trained_share(cls, algorithm: AlgorithmConfig, group_size: int) -> float:
        """The share of a step's samples the update trains (`estimate`): every one by default."""
        return 1.0

    @classmethod
    def frozen_calls(cls, algorithm: AlgorithmConfig, sampling: SamplingConfig, guidance_cost) -> float:
        """Forwards without gradient (reference, old or EMA policies) per trained call, on a model whose velocity at
        a guidance scale costs `guidance_cost.forwards(scale)` (models/guidance.py's GuidanceCost, which `estimate`
        reads from the architecture)."""
        return int(cls.needs_reference(algorithm.settings))

    @classmethod
    def calls_before_update(cls, algorithm, sampling) -> int:
        """Forwards without gradient per sample that an update runs once, before its epochs (`estimate`)."""
        return 0

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
        summed = section.advantage.combine == "sum_advantages"  # how scores become targets:
        self.credit = (SummedCredit if summed else FlatCredit)(section.advantage, self.reward_weights)
        self.model = None

    @classmethod  # noqa: B027  (an optional hook: most families accept any config)
    def check_config(cls, algorithm: AlgorithmConfig, sampling: SamplingConfig, sample_source: str) -> None:
        """Refuse values of the algorithm and sampling sections (and data.sample_source) this family cannot work
        with (ValueError naming the key)."""

    # -- driver side ------------------------------------------------------------------------------------------
    def prepare(self, scored, group_index: torch.Tensor) -> tuple[Targets, dict[str, float]]:
        """Targets from the step's scores (`RewardResult`: total [B], per_reward, failed): the credit's
        (algorithms/credit.py: group-relative advantages, which every algorithm but DPO trains on)."""
        return self.credit.targets(scored, group_index)

    # -- worker side ------------------------------------------------------------------------------------------
    def attach(self, model) -> None:
        """Take the model to train (before it is sharded): add the named policies this algorithm keeps (the
        frozen reference when `needs_reference`)."""
        self.model = model
        if self.needs_reference(self.settings):
            model.policies.keep_reference()

    @abstractmethod
    def begin(self, batch: TrainBatch, step: int) -> tuple[Any, dict[str, float]]:
        """The update's units (a tensorclass of U rows: samples or pairs, with `weight` [U] 1 or 0: the update scales
        each chunk's loss by how many carry weight) and metrics, before any optimizer step."""

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

    @staticmethod
    def sum_over_workers(value: float) -> float:
        """`value` summed over the workers that train (a collective there: every worker calls it alike); set by the
        engine (engine/parallel.py `sum`); one process: the value."""
        return value

    # -- checkpoint (each side keeps its own: the driver's `prepare`, the worker's update) ------------------------
    def state_dict(self) -> dict:
        """What the algorithm carries from step to step beside the model's policies ({}: nothing)."""
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027  (an optional hook: most algorithms keep nothing)
        """Restore `state_dict()` (a checkpoint from before the algorithm kept state: {})."""


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: `fn(input, settings) -> LossOutput` run by `algorithm`, configured by `settings`."""

    name: str
    fn: Callable[[Any, Any], LossOutput]
    settings: type  # a LossSettings dataclass: the config section algorithm.<name>
    algorithm: type[Algorithm]
    sde_only: bool = False  # its formulas assume Flow-GRPO's `sde` step (its std and √dt)
    metric_prefixes: tuple[str, ...] = ()  # its own metrics' "<prefix>/…" (the run report's algorithm panel)

    @property
    def family(self) -> str:
        return self.algorithm.family

    def __call__(self, inp, cfg) -> LossOutput:
        return self.fn(inp, cfg)


def loss_names(**facts) -> str:
    """The registered losses whose algorithm has these facts (e.g. offline=True), comma-separated (for messages)."""
    return ", ".join(n for n, spec in LOSSES.items() if all(getattr(spec.algorithm, k) == v for k, v in facts.items()))


def register_loss(
    name: str, *, settings: type, algorithm: type[Algorithm], sde_only: bool = False, metrics: tuple[str, ...] = ()
):
    """Decorator: register `fn(input, settings) -> LossOutput` as loss `name` (see LossSpec); `metrics`: the prefixes
    of its own metrics, when not `name/…`."""
    if not (isinstance(settings, type) and issubclass(settings, LossSettings)):
        raise TypeError(f"loss '{name}': settings must be a LossSettings dataclass, got {settings!r}")

    def add(fn):
        LOSSES.register(name)(LossSpec(name, fn, settings, algorithm, sde_only, metrics or (name,)))
        return fn

    return add


@dataclass(frozen=True)
class AlgorithmInputs:
    """What an `Algorithm` is built from: its config section and the few numbers it needs from the others (the run
    seed, the training rollouts' sampler, the rewards' weights by metric name, the update's sizes, the tree
    rollouts' pruning). The trainer makes it from the config (`of`) and hands it to the workers, which build their
    own algorithm from it."""

    section: AlgorithmConfig
    seed: int
    sampler: SamplerSettings
    reward_weights: dict[str, float]
    micro_batch_size: int
    num_minibatches: int = 1
    ppo_epochs: int = 1
    tree_prune: TreePruneConfig | None = None

    @classmethod
    def of(cls, config: Config) -> AlgorithmInputs:
        t = config.train
        return cls(config.algorithm, config.run.seed, SamplerSettings.of(config.sampling),
                   {r.metric_name: r.weight for r in config.rewards}, t.micro_batch_size, t.num_minibatches,
                   t.ppo_epochs, None if config.sampling.tree is None else config.sampling.tree.prune)  # fmt: skip

    def build(self) -> Algorithm:
        """The algorithm of `section.loss`, not attached to a model yet."""
        spec = self.section.spec
        return spec.algorithm(self.section, spec, seed=self.seed, sampler=self.sampler,
                              reward_weights=self.reward_weights, micro_batch_size=self.micro_batch_size,
                              num_minibatches=self.num_minibatches, ppo_epochs=self.ppo_epochs,
                              tree_prune=self.tree_prune)  # fmt: skip


def make_algorithm(config: Config) -> Algorithm:
    """The algorithm of `config.algorithm.loss` (not attached to a model yet), given its section and what it needs
    from the others."""
    return AlgorithmInputs.of(config).build()
