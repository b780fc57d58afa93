"""Config rules of the algorithms: the loss selects its family and its own settings section, each loss's defaults
live with it, and the settings that only one family can use are refused elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.config import load
from diffusion_rl.config.loading import to_yaml
from diffusion_rl.config.plugins import LOSSES
from diffusion_rl.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs/quickstart_flow_grpo.yaml"


@pytest.mark.parametrize("mode", ["dpo", "dpo_offline", "nft", "awm"])
def test_direct_preference_quickstart_configs_load(mode):
    cfg = load(ROOT / f"configs/quickstart_{mode}.yaml")
    assert cfg.algorithm.spec.family == "direct_preference"
    assert cfg.algorithm.loss == mode.split("_")[0]
    assert cfg.run.dir == f"runs/quickstart_{mode}"


def test_nft_quickstart_keeps_the_recipe_values():
    nft = load(ROOT / "configs/quickstart_nft.yaml").algorithm.settings
    assert (nft.kl_beta, nft.timestep_fraction, nft.nft_beta) == (1e-4, 0.99, 1.0)


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        ("flow_grpo", {"clip_range": 1e-4, "kl_beta": 0.0}),
        ("grpo_guard", {"clip_range": 2e-6, "kl_beta": 0.0}),
        ("flow_dppo", {"kl_mask_threshold": 1e-5, "kl_beta": 0.0}),
        ("nft", {"kl_beta": 1e-4, "timestep_fraction": 0.99}),
        ("awm", {"clip_range": 1.0, "kl_beta": 0.0, "timestep_fraction": 1.0}),
        ("dpo", {"dpo_beta": 2000.0}),
    ],
)
def test_each_loss_has_its_own_defaults_and_only_its_section_is_kept(loss, expected):
    ode = [] if loss in ("flow_grpo", "grpo_guard", "flow_dppo") else ["sampling.sde_type=ode"]
    cfg = load(None, [f"algorithm.loss={loss}", *ode])
    assert {name: getattr(cfg.algorithm.settings, name) for name in expected} == expected
    key = next(iter(expected))
    explicit = load(None, [f"algorithm.loss={loss}", *ode, f"algorithm.{loss}.{key}=0.5"])
    assert getattr(explicit.algorithm.settings, key) == 0.5
    # another loss's section is checked but not kept: a written config shows only what the run reads
    other = "nft" if loss != "nft" else "awm"
    written = to_yaml(load(None, [f"algorithm.loss={loss}", *ode, f"algorithm.{other}.kl_beta=0.5"]))
    assert f"\n  {loss}:\n" in written and f"\n  {other}:\n" not in written


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.loss=dpx"],
            r"'dpx' is not a registered loss \(did you mean 'dpo'\?\); known: awm, crd, dgpo, dpo",
        ),
        (["algorithm.family=direct_preference"], r"'algorithm.family' is gone: the family follows from algorithm.loss"),
        (["algorithm.clip_range=0.1"], r"'algorithm.clip_range' moved into the loss's own section"),
        (["algorithm.flow_grpo.clip_rang=0.1"], r"unknown config key 'algorithm.flow_grpo.clip_rang' \(did you mean"),
        (["algorithm.flow_grpo.clip_range=0"], r"'algorithm.flow_grpo.clip_range' must be in \(0, 100\], got 0"),
        (["sampling.sde_type=ode"], r"sde_type=ode has no per-step log-probs"),
        (["algorithm.loss=dpo", "sampling.sde_type=ode", "sampling.window.kind=random"], r"use window.kind=all"),
        (
            ["algorithm.loss=nft", "sampling.sde_type=ode", "algorithm.rollout_correction.mode=decoupled"],
            r"rollout_correction applies",
        ),
        (
            ["algorithm.loss=awm", "sampling.sde_type=ode", "sampling.num_steps=6"],
            r"train_timesteps=6: awm draws .* from 1\.\.5",
        ),
        (
            ["algorithm.loss=nft", "sampling.sde_type=ode", "algorithm.nft.old_decay=fixed"],
            r"old_decay=fixed needs old_decay_value",
        ),
        (
            ["algorithm.loss=nft", "sampling.sde_type=ode", "algorithm.nft.old_decay_value=0.5"],
            r"only goes with old_decay=fixed",
        ),
        (
            ["algorithm.loss=nft", "sampling.sde_type=ode", "algorithm.nft.old_update_interval=0"],
            r"'algorithm.nft.old_update_interval' must be in \[1, 100000000\], got 0",
        ),
        (
            ["algorithm.loss=dpo", "sampling.sde_type=ode", "algorithm.dpo.dpo_beta=0"],
            r"'algorithm.dpo.dpo_beta' must be in \(0, 1000000\], got 0",
        ),
        (["algorithm.loss=awm", "sampling.sde_type=ode", "algorithm.awm.weighting=huber"], r"weighting"),
        (
            ["algorithm.loss=nft", "sampling.sde_type=ode", "data.sample_source=offline", "data.pairs=p.jsonl"],
            r"offline trains .*dpo only",
        ),
        (["algorithm.loss=dpo", "sampling.sde_type=ode", "data.sample_source=offline"], r"needs data.pairs"),
        (["data.sample_source=offline", "data.pairs=p.jsonl"], r"offline trains algorithm.loss=dpo only"),
        (["algorithm.loss=dpo", "sampling.sde_type=ode", "rewards=[]"], r"at least one reward"),
        (["algorithm.loss=grpo_guard", "sampling.sde_type=cps"], r"grpo_guard is defined for sampling.sde_type=sde"),
        (["algorithm.loss=dgpo"], r"dgpo trains on deterministic rollouts: set sampling.sde_type=ode, got sde"),
        (
            ["algorithm.loss=dgpo", "sampling.sde_type=ode", "sampling.num_steps=4"],
            r"train_timesteps=4: dgpo draws that many distinct steps from 0\.\.2",
        ),
        (["algorithm.loss=dgpo", "sampling.sde_type=ode", "algorithm.dgpo.clip_kl=true"], r"set kl_beta > 0"),
        (
            ["algorithm.loss=dgpo", "sampling.sde_type=ode", "algorithm.dgpo.reference_guidance=0.5"],
            r"'algorithm.dgpo.reference_guidance' must be in \[1, 100\], got 0.5",
        ),
        (["algorithm.loss=crd"], r"crd trains on deterministic rollouts: set sampling.sde_type=ode, got sde"),
        (["algorithm.loss=crd", "sampling.sde_type=ode", "algorithm.crd.kl_beta=1e-5"], r"set kl_beta ≥ 0.0001"),
    ],
)
def test_mismatches_are_user_errors(overrides, message):
    with pytest.raises(UserError, match=message):
        load(QUICKSTART, overrides)


def test_offline_dpo_may_train_without_a_reward():
    overrides = ["algorithm.loss=dpo", "sampling.sde_type=ode", "data.sample_source=offline", "data.pairs=p.jsonl"]
    cfg = load(QUICKSTART, [*overrides, "rewards=[]"])
    assert cfg.rewards == []


@pytest.mark.parametrize("key", ["dpo_beta", "nft_beta", "kl_mask_threshold", "clip_range", "weighting"])
def test_the_hint_for_an_old_algorithm_key_names_a_section_that_has_it(key):
    """An old top-level algorithm key points to where it lives now; the example it gives is a key that loads (the
    hint once said algorithm.flow_grpo.dpo_beta, which does not exist)."""
    import re

    from diffusion_rl.config.algorithm import losses_with_key

    with pytest.raises(UserError, match=rf"'algorithm.{key}' moved into the loss's own section") as error:
        load(QUICKSTART, [f"algorithm.{key}=1"])
    loss = re.search(rf"e\.g\. algorithm\.(\w+)\.{key}\)", str(error.value)).group(1)
    assert loss in losses_with_key(key) and f"a key of {' and '.join(losses_with_key(key))}" in str(error.value)
    ode = ["sampling.sde_type=ode"] if LOSSES.get(loss).family == "direct_preference" else []
    default = getattr(load(None, [f"algorithm.loss={loss}", *ode]).algorithm.settings, key)
    load(None, [f"algorithm.loss={loss}", *ode, f"algorithm.{loss}.{key}={default}"])
