"""The algorithm section: the registered loss, its own settings section `algorithm.<loss>`, advantages, rollout
correction; and the checks of the selected loss and family on the rest of the config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from diffusion_rl.algorithms import LOSSES
from diffusion_rl.config.rollout_correction import RolloutCorrectionConfig
from diffusion_rl.config_io.convert import SECTIONS
from diffusion_rl.errors import did_you_mean
from diffusion_rl.settings import MAX_GROUP, Range, check, opt

if TYPE_CHECKING:
    from diffusion_rl.config import Config


@dataclass
class AdvantageConfig:
    global_std: bool = opt(True, "Divide by the batch std (true) or each group's own std (false).")
    std_ddof: int = opt(
        0, "Delta degrees of freedom of the std (0 as flow_grpo, 1 as DanceGRPO).", within=Range(0, MAX_GROUP)
    )
    eps: float = opt(1e-4, "Added to the std in the denominator.", within=Range(0, 1))
    normalize_by_std: bool = opt(True, "false: A = r − group mean.")
    combine: Literal["sum_rewards", "sum_advantages"] = opt(
        "sum_rewards",
        "sum_rewards: normalise the weighted reward sum; sum_advantages: normalise each reward within its groups, "
        "then sum the advantages with the weights (MixGRPO's advantage_aggr).",
    )


def losses_with_key(key: str) -> list[str]:
    """The registered losses whose settings section (algorithm.<loss>) has `key`."""
    return [name for name, spec in LOSSES.items() if key in {f.name for f in dataclasses.fields(spec.settings)}]


def _loss_sections() -> dict[str, type]:
    """Every registered loss's settings dataclass, by loss name: the sections algorithm.<loss>."""
    return {name: spec.settings for name, spec in LOSSES.items()}


# keys that lived in `algorithm` before each loss got its own section (`checkpoint upgrade` moves them there)
OLD_LOSS_KEYS = ("clip_range", "adv_clip_max", "kl_beta", "kl_mask_threshold", "add_kl_coefficient", "dpo_beta",
                      "nft_beta", "old_update_interval", "old_decay", "old_decay_value", "train_timesteps",
                      "weighting", "advantage_max", "ema_beta")  # fmt: skip


@dataclass
class AlgorithmConfig:
    loss: str = opt(
        "flow_grpo",
        "The algorithm, by its registered loss (policy gradient on per-step SDE log-probs, or direct preference on "
        "final latents); every registered loss has its settings section algorithm.<loss>.",
    )
    timestep_fraction: float = opt(
        1.0, "Policy gradient: fraction of the window's steps trained per sample.", within=Range(0, 1, lo_open=True)
    )
    timestep_selection: Literal["first", "random"] = opt(
        "first", "Policy gradient: train the first steps (flow_grpo) or a seeded random subset per sample."
    )
    drop_zero_advantage: bool = opt(False, "Policy gradient: leave samples with advantage 0 out of the loss.")
    advantage: AdvantageConfig = opt(AdvantageConfig, "Group advantage normalisation.", factory=True)
    rollout_correction: RolloutCorrectionConfig = opt(
        RolloutCorrectionConfig,
        "Policy gradient: importance weights / rejection between rollout and trained policy.",
        factory=True,
    )
    losses: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            SECTIONS: _loss_sections,
            "help": "Settings of the loss `{key}`, read when algorithm.loss={key} (the others are ignored).",
        },
    )

    @staticmethod
    def moved_key(key: str) -> str | None:
        """Where a key of an earlier version of this section went (the loader's error says it); None: never was."""
        owners = losses_with_key(key) if key in OLD_LOSS_KEYS else []
        if key == "family" or (key in OLD_LOSS_KEYS and not owners):
            return "is gone: the family follows from algorithm.loss (dpo, nft and awm are direct-preference losses)"
        if not owners:
            return None
        return (
            f"moved into the loss's own section, algorithm.<loss>.{key}, a key of {' and '.join(owners)} (e.g. "
            f"algorithm.{owners[0]}.{key}); `diffusion-rl checkpoint upgrade DIR` converts a checkpoint's config.yaml"
        )

    def __post_init__(self):
        check(
            self.loss in LOSSES,
            f"algorithm.loss '{self.loss}' is not a registered loss{did_you_mean(self.loss, LOSSES.names())}; "
            f"known: {', '.join(LOSSES.names())}",
        )
        # only the selected loss's section is kept (at its defaults when the config has none): the others were
        # checked, but a run never reads them, and a written config.yaml should not suggest it does
        self.losses = {self.loss: self.losses.get(self.loss) or LOSSES.get(self.loss).settings()}

    @property
    def settings(self):
        """The selected loss's settings (its section algorithm.<loss>)."""
        return self.losses[self.loss]

    @property
    def spec(self):
        """The selected loss's registration: its function, settings class, algorithm and constraints."""
        return LOSSES.get(self.loss)


def check_algorithm(cfg: Config) -> None:
    """The selected loss's own constraints, its family's, and its settings' on the sampling and data sections."""
    alg, spec = cfg.algorithm, cfg.algorithm.spec
    check(
        not spec.sde_only or cfg.sampling.sde_type == "sde",
        f"algorithm.loss={spec.name} is defined for sampling.sde_type=sde, got {cfg.sampling.sde_type}",
    )
    spec.algorithm.check_config(alg, cfg.sampling, cfg.data.sample_source)
    alg.settings.check_config(alg, cfg.sampling)
    if cfg.data.sample_source == "offline":
        check(bool(cfg.data.pairs), "data.sample_source=offline needs data.pairs (a .jsonl or .parquet pair file)")


def check_rollout_correction(alg: AlgorithmConfig) -> None:
    rc = alg.rollout_correction
    for c in rc.criteria:
        check(
            rc.mode == "decoupled" or c.level == "step",
            f"algorithm.rollout_correction: rs_level={c.level} (criterion {c.name}) needs every step's current "
            "log-prob before the update; use mode=decoupled, or level step with mode=bypass",
        )
