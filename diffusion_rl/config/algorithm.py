"""The algorithm section: the registered loss, its own settings section `algorithm.<loss>`, advantages, rollout
correction; and the checks of the selected loss and family on the rest of the config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from diffusion_rl.algorithms import LOSSES, loss_spec
from diffusion_rl.config.rollout_correction import RolloutCorrectionConfig
from diffusion_rl.config_io.convert import SECTIONS
from diffusion_rl.errors import UserError, did_you_mean
from diffusion_rl.settings import MAX_GROUP, Range, check, opt
from diffusion_rl.user_code import is_user_function_spec, user_code_refused

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


def _loss_sections(data: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every registered loss's settings dataclass, by loss name: the sections algorithm.<loss>. When the section's
    `data` names a user loss (algorithm.loss: file.py:fn), its module is imported first, which registers it; where
    user code is refused (a checkpoint's config, user_code.py), the sections the data holds beyond the registered
    ones are kept as written, unchecked."""
    loss = data.get("loss") if isinstance(data, Mapping) else None
    if isinstance(loss, str) and is_user_function_spec(loss):
        if user_code_refused():
            known = {f.name for f in dataclasses.fields(AlgorithmConfig)} | set(LOSSES.names())
            return {**_loss_sections(), **{k: dict[str, Any] for k, v in data.items()
                                          if k not in known and isinstance(v, Mapping)}}  # fmt: skip
        loss_spec(loss)
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
        "final latents), or your own registered in your file, module:fn or file.py:fn (docs/policy_gradient.md); "
        "every loss has its settings section algorithm.<the name it registers>.",
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

    # False for a user loss named by a checkpoint's config: kept by name, its section as written, never imported
    loaded: bool = field(default=True, init=False, repr=False, compare=False)

    def __post_init__(self):
        if is_user_function_spec(self.loss):
            if user_code_refused():
                self.loaded = False
                return
        else:
            check(
                self.loss in LOSSES,
                f"algorithm.loss '{self.loss}' is not a registered loss{did_you_mean(self.loss, LOSSES.names())}; "
                f"known: {', '.join(LOSSES.names())}; or name your own, module:fn or file.py:fn",
            )
        spec = loss_spec(self.loss)
        # only the selected loss's section is kept (at its defaults when the config has none): the others were
        # checked, but a run never reads them, and a written config.yaml should not suggest it does
        self.losses = {spec.name: self.losses.get(spec.name) or spec.settings()}

    @property
    def settings(self):
        """The selected loss's settings (its section algorithm.<loss>, by the name it registers under)."""
        return self.losses[self.spec.name]

    @property
    def spec(self):
        """The selected loss's registration: its function, settings class, algorithm and constraints."""
        if not self.loaded:
            raise UserError(
                f"algorithm.loss '{self.loss}' is a user loss named by a checkpoint's config, which is not imported: "
                f"a checkpoint cannot choose code to run; train with your own config to use it"
            )
        return loss_spec(self.loss)

    @property
    def family(self) -> str | None:
        """The selected loss's family; None for a checkpoint's user loss, which is not imported."""
        return self.spec.family if self.loaded else None


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


def check_rollout_correction(alg: AlgorithmConfig) -> None:
    rc = alg.rollout_correction
    for c in rc.criteria:
        check(
            rc.mode == "decoupled" or c.level == "step",
            f"algorithm.rollout_correction: rs_level={c.level} (criterion {c.name}) needs every step's current "
            "log-prob before the update; use mode=decoupled, or level step with mode=bypass",
        )
