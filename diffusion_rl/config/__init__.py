"""The configuration, in one package: the typed dataclass tree of a run, and the loader for any such tree.

The tree, one module per section group, each section with its own checks:
    algorithm.py (+ rollout_correction.py)  data.py  engine.py  guard.py  log.py  model.py  sampling.py  train.py
`Config` (here) holds them all and, once the tree is built, runs the checks that span sections (below it). A name
that a plugin registers (a loss, a model family, a step type, an ODE solver) is checked against its registry in
plugins.py, into which the plugins register from their own layers: config/ is the ground and imports no layer above
it (tests/test_layers.py).

What every settings dataclass is made of, and the loader (it works for any tree of them: the run's, pretraining's, a
loss's settings, and imports nothing of the tree):
    fields.py     `opt` (a field with its help text and range), `Range`, `OneOf`, the size limits, `check`
    loading.py    YAML files (with their bases) and dotted `key=value` overrides → a tree (`load_config`)
    convert.py    plain data ↔ dataclasses, every key, type and range checked (`from_dict`, `to_dict`)
    reference.py  the reference of every key (`diffusion-rl config reference`, docs/config.md)
    secrets.py    secret values hidden in what a run writes

`__post_init__` rejects impossible combinations with a message that says what to change. `diffusion-rl config show
CONFIG` prints the resolved tree.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from diffusion_rl.config.algorithm import AlgorithmConfig, check_rollout_correction
from diffusion_rl.config.data import DataConfig, RewardSpec
from diffusion_rl.config.engine import EngineConfig
from diffusion_rl.config.fields import check, opt
from diffusion_rl.config.guard import GuardConfig
from diffusion_rl.config.loading import config_from_data, read_yaml_config
from diffusion_rl.config.log import LogConfig, ProfileConfig
from diffusion_rl.config.model import ModelConfig
from diffusion_rl.config.sampling import SamplingConfig, check_window
from diffusion_rl.config.train import RunConfig, TrainConfig, ValConfig

logger = logging.getLogger(__name__)


@dataclass
class Config:
    run: RunConfig = opt(RunConfig, "Run identity and resume.", factory=True)
    model: ModelConfig = opt(ModelConfig, "Model to train.", factory=True)
    sampling: SamplingConfig = opt(SamplingConfig, "Training rollouts.", factory=True)
    data: DataConfig = opt(DataConfig, "Prompts.", factory=True)
    rewards: list[RewardSpec] = opt(lambda: [RewardSpec()], "Rewards, summed with their weights.", factory=True)
    algorithm: AlgorithmConfig = opt(AlgorithmConfig, "Algorithm and loss.", factory=True)
    train: TrainConfig = opt(TrainConfig, "Optimisation.", factory=True)
    val: ValConfig = opt(ValConfig, "Validation.", factory=True)
    log: LogConfig = opt(LogConfig, "Metrics and trackers.", factory=True)
    engine: EngineConfig = opt(EngineConfig, "Execution engine.", factory=True)
    profile: ProfileConfig = opt(ProfileConfig, "torch.profiler traces of chosen steps.", factory=True)
    guard: GuardConfig = opt(GuardConfig, "Reward-hacking guard: image statistics no reward optimises.", factory=True)

    def __post_init__(self):
        # the checks that span sections (below)
        check_val(self)
        check_batch(self)
        check_window(self.sampling)
        check_algorithm(self)
        check_tree(self)
        check_engine(self)  # may set algorithm.rollout_correction.mode=decoupled: before the check of its criteria
        check_rollout_correction(self.algorithm)
        check_rewards(self)

    @property
    def batch_size(self) -> int:
        """Rows of a training step: prompts × group size; offline pairs: chosen and rejected of each."""
        return self.data.batch_size


def load(path: str | None, overrides: list[str] = ()) -> Config:
    """The config in YAML file `path` (None: the defaults) with `overrides`. A file that sets no run.dir (nor does
    its base) runs in runs/<its name> (my_run.yaml: runs/my_run), never in another config's run directory."""
    overrides = list(overrides)
    data = read_yaml_config(path) if path is not None else {}
    run = data.get("run")
    if path is not None and not (isinstance(run, dict) and "dir" in run):
        overrides.insert(0, f"run.dir=runs/{Path(path).stem}")  # the user's own run.dir=… (later) wins
    return config_from_data(Config, data, path, overrides)


def check_val(cfg: Config) -> None:
    check(
        not cfg.run.val_only or bool(cfg.val.prompts),
        "run.val_only=true validates and exits, but val.prompts is null: set val.prompts to a prompt file",
    )


def check_batch(cfg: Config) -> None:
    """Groups that can be compared, and a batch that splits into the mini-batches."""
    data = cfg.data
    # every loss is group-relative (advantages normalised within a prompt's group; online dpo pairs two of its
    # samples): a group of one gives every sample advantage 0 and the run learns nothing
    check(
        data.group_size >= 2 or data.sample_source == "offline",
        f"data.group_size=1: algorithm.loss={cfg.algorithm.loss} compares the samples of each prompt's group "
        "(group-normalised advantages; online dpo: pairs within the group), so every advantage would be 0 and "
        "nothing is learned; set data.group_size to 2 or more",
    )
    batch = data.prompts_per_step * data.group_size
    minibatches = cfg.train.num_minibatches
    check(
        batch % minibatches == 0,
        f"the batch (data.prompts_per_step × data.group_size = {batch}) must split evenly into "
        f"train.num_minibatches = {minibatches}",
    )


def check_algorithm(cfg: Config) -> None:
    """The selected loss's own constraints, its family's, and its settings' on the sampling and data sections."""
    if not cfg.algorithm.loaded:
        return  # a checkpoint's user loss: its run checked it
    alg, spec = cfg.algorithm, cfg.algorithm.spec
    check(
        not spec.sde_only or cfg.sampling.sde_type == "sde",
        f"algorithm.loss={spec.name} is defined for sampling.sde_type=sde, got {cfg.sampling.sde_type}",
    )
    spec.algorithm.check_config(alg, cfg.sampling, cfg.data.sample_source)
    alg.settings.check_config(alg, cfg.sampling)
    alg.settings.check_run(cfg)
    if cfg.data.sample_source == "offline":
        check(bool(cfg.data.pairs), "data.sample_source=offline needs data.pairs (a .jsonl or .parquet pair file)")


def check_tree(cfg: Config) -> None:
    """Tree rollouts: a group is one tree's leaves, sampled whole by one local policy-gradient worker."""
    tree = cfg.sampling.tree
    if tree is None:
        return
    leaves = math.prod([tree.branching] * len(tree.branch_at) if isinstance(tree.branching, int)
                       else tree.branching)  # fmt: skip
    check(
        cfg.data.group_size == leaves,
        f"sampling.tree: a group is one tree's leaves, the product of sampling.tree.branching = {leaves}; set "
        f"data.group_size={leaves} (got {cfg.data.group_size})",
    )
    check(
        cfg.engine.kind == "local",
        "sampling.tree runs on engine.kind=local only (Ray workers split a step's rows, and a tree must be sampled "
        "whole by one worker); set engine.kind=local or sampling.tree=null",
    )
    check(
        cfg.algorithm.family in ("policy_gradient", None) and cfg.data.sample_source == "online",
        f"sampling.tree trains policy-gradient losses (depth-wise advantages on per-step log-probs); "
        f"algorithm.loss={cfg.algorithm.loss} is {cfg.algorithm.family}",
    )
    check(
        cfg.algorithm.advantage.combine == "sum_rewards",
        "sampling.tree normalises the weighted reward sum at each depth; algorithm.advantage.combine="
        "sum_advantages is not implemented for trees (use sum_rewards)",
    )
    check(
        cfg.data.prompts_per_step % cfg.sampling.score_chunks == 0,
        f"sampling.tree samples whole trees: sampling.score_chunks={cfg.sampling.score_chunks} must divide "
        f"data.prompts_per_step={cfg.data.prompts_per_step}",
    )
    if cfg.sampling.window.kind == "all":  # the other kinds move: each step's window is checked when it is drawn
        check(
            cfg.sampling.sde_type != "ode",
            "sampling.tree needs SDE steps to split at; sampling.sde_type=ode has none",
        )


def check_engine(cfg: Config) -> None:
    """engine.kind=ray splits the batch into equal contiguous shards whose mini-batches make up the global ones."""
    e, batch, minibatches = cfg.engine, cfg.batch_size, cfg.train.num_minibatches
    if e.kind != "ray":
        return
    check(
        not cfg.model.offload_reference,
        "model.offload_reference moves the local engine's reference copy; under engine.kind=ray that copy is "
        "FSDP2-sharded: use engine.fsdp_cpu_offload=true to keep its shards (and the trained ones) on the CPU",
    )
    check(
        e.rollout == "colocated" or cfg.data.sample_source == "online",
        "engine.rollout=separate samples online rollouts; offline pairs (data.sample_source=offline) train with "
        "engine.rollout=colocated",
    )
    rc = cfg.algorithm.rollout_correction
    if e.staleness_bound > 0 and cfg.algorithm.family == "policy_gradient" and rc.mode == "bypass":
        # rows sampled by older weights: the PPO anchor is the current weights, the IS weight corrects the rest
        logger.info(
            "engine.max_staleness=%d, sync_every=%d: rows may be up to %d updates stale; "
            "algorithm.rollout_correction.mode set to decoupled",
            e.max_staleness,
            e.sync_every,
            e.staleness_bound,
        )
        rc.mode = "decoupled"
    check(
        batch % e.num_workers == 0 and (batch // e.num_workers) % minibatches == 0,
        f"engine.num_workers={e.num_workers}: each worker trains on batch / num_workers rows, which must be a "
        f"whole number divisible by train.num_minibatches={minibatches} (batch = data.prompts_per_step × "
        f"data.group_size = {batch}, offline: 2 × data.prompts_per_step); pick num_workers dividing "
        f"{batch // minibatches}",
    )


def check_rewards(cfg: Config) -> None:
    """A reward to train on (offline DPO needs none); each reward's metric name (label, else name) is unique (also
    val.rewards). Each weight's range is its field's (RewardSpec.weight)."""
    check(
        len(cfg.rewards) > 0 or cfg.data.sample_source == "offline",
        "rewards: at least one reward is needed (only offline DPO trains without one)",
    )
    lists = [("rewards", cfg.rewards)]
    if cfg.val.rewards is not None:
        check(bool(cfg.val.rewards), "val.rewards is an empty list; give at least one reward, or null")
        lists.append(("val.rewards", cfg.val.rewards))
    for where, specs in lists:
        first_of: dict[str, int] = {}
        for i, spec in enumerate(specs):
            key = spec.metric_name
            if key in first_of:
                raise ValueError(
                    f"{where}.{first_of[key]} and {where}.{i} are both '{key}' in metrics and logs (the label, "
                    f"else the name, must be unique): give one of them its own label, e.g. "
                    f"{where}.{i}.label={key}_2"
                )
            first_of[key] = i
