"""Config rules of the algorithm families: each loss in its family's registry, loss-specific defaults, and the
settings that only one family can use."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.config import load
from diffusion_rl.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs/quickstart.yaml"
DP = "algorithm.family=direct_preference"


@pytest.mark.parametrize("mode", ["dpo", "dpo_offline", "nft", "awm"])
def test_direct_preference_quickstart_configs_load(mode):
    cfg = load(ROOT / f"configs/quickstart_{mode}.yaml")
    assert cfg.algorithm.family == "direct_preference"
    assert cfg.algorithm.loss == mode.split("_")[0]
    assert cfg.run.dir == f"runs/quickstart_{mode}"


def test_nft_quickstart_keeps_the_recipe_values():
    alg = load(ROOT / "configs/quickstart_nft.yaml").algorithm
    assert (alg.kl_beta, alg.timestep_fraction, alg.nft_beta) == (1e-4, 0.99, 1.0)


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        ("flow_grpo", {"clip_range": 1e-4, "kl_beta": 0.0, "timestep_fraction": 1.0}),
        ("nft", {"clip_range": 1e-4, "kl_beta": 1e-4, "timestep_fraction": 0.99}),
        ("awm", {"clip_range": 1.0, "kl_beta": 0.0, "timestep_fraction": 1.0}),
        ("dpo", {"clip_range": 1e-4, "kl_beta": 0.0, "timestep_fraction": 1.0}),
    ],
)
def test_unset_fields_take_the_losss_default(loss, expected):
    family = "policy_gradient" if loss == "flow_grpo" else "direct_preference"
    cfg = load(None, [f"algorithm.family={family}", f"algorithm.loss={loss}"])
    assert {name: getattr(cfg.algorithm, name) for name in expected} == expected
    explicit = load(None, [f"algorithm.family={family}", f"algorithm.loss={loss}", "algorithm.kl_beta=0.5"])
    assert explicit.algorithm.kl_beta == 0.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.loss=dpo"], r"'dpo' is not a policy_gradient loss .*set algorithm.family=direct_preference"),
        ([DP], r"'flow_grpo' is not a direct_preference loss \(known: awm, dpo, nft\)"),
        ([DP, "algorithm.loss=dpx"], r"'dpx' is not a direct_preference loss"),
        (["sampling.sde_type=ode"], r"sde_type=ode has no per-step log-probs"),
        ([DP, "algorithm.loss=dpo", "sampling.window.kind=random"], r"use window.kind=all"),
        ([DP, "algorithm.loss=nft", "algorithm.rollout_correction.mode=decoupled"], r"rollout_correction applies"),
        ([DP, "algorithm.loss=awm", "sampling.num_steps=6"], r"train_timesteps=6: awm draws .* from 1\.\.5"),
        ([DP, "algorithm.loss=nft", "algorithm.old_decay=fixed"], r"old_decay=fixed needs old_decay_value"),
        ([DP, "algorithm.loss=nft", "algorithm.old_decay_value=0.5"], r"only goes with old_decay=fixed"),
        ([DP, "algorithm.loss=nft", "algorithm.old_update_interval=0"], r"old_update_interval must be ≥ 1"),
        ([DP, "algorithm.loss=dpo", "algorithm.dpo_beta=0"], r"dpo_beta must be > 0"),
        ([DP, "algorithm.loss=awm", "algorithm.weighting=huber"], r"weighting"),
        ([DP, "algorithm.loss=nft", "data.sample_source=offline", "data.pairs=p.jsonl"], r"offline trains .*dpo only"),
        ([DP, "algorithm.loss=dpo", "data.sample_source=offline"], r"needs data.pairs"),
        (["data.sample_source=offline", "data.pairs=p.jsonl"], r"offline needs algorithm.family=direct_preference"),
        ([DP, "algorithm.loss=dpo", "rewards=[]"], r"at least one reward"),
    ],
)
def test_family_mismatches_are_user_errors(overrides, message):
    with pytest.raises(UserError, match=message):
        load(QUICKSTART, overrides)


def test_offline_dpo_may_train_without_a_reward():
    cfg = load(QUICKSTART, [DP, "algorithm.loss=dpo", "data.sample_source=offline", "data.pairs=p.jsonl", "rewards=[]"])
    assert cfg.rewards == []
