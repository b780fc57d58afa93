"""Reward options in training: group rewards with chunked scoring, validation rewards apart from training ones,
a deadline on a hung user reward, and group rewards in the direct-preference family."""

from __future__ import annotations

import numpy as np
import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.rewards import RewardFailure
from diffusion_rl.rewards.group import normalized_rank
from diffusion_rl.sampling.window import window_for_step
from diffusion_rl.trainer.timing import PhaseTimer

RANK_OF_JPEG = "{name: rank, kwargs: {reward: {name: jpeg_incompressibility}}}"


def test_a_group_reward_sees_whole_groups_when_the_batch_is_scored_in_chunks(make_trainer):
    # 2 prompts × 3 samples in 4 chunks: the chunk boundaries cut both groups
    trainer = make_trainer(f"rewards=[{RANK_OF_JPEG}, {{name: jpeg_incompressibility, weight: 0}}]",
                           "data.group_size=3", "sampling.score_chunks=4")  # fmt: skip
    collected = trainer.source.collect(0, window_for_step(trainer.cfg.sampling, 0, 0), PhaseTimer())
    prompts, scored = collected.prompts, collected.scored
    sizes = scored.per_reward["jpeg_incompressibility"]
    for g in range(2):  # the rank of each sample's JPEG size within its own prompt's three samples
        rows = (prompts.group_index == g).numpy()
        np.testing.assert_allclose(scored.per_reward["rank"][rows], normalized_rank(sizes[rows]))
    assert sorted(scored.per_reward["rank"][:3].tolist()) == [0.0, 0.5, 1.0]


def test_validation_rewards_score_validation_and_training_keeps_its_own(make_trainer):
    trainer = make_trainer("rewards=[{name: jpeg_compressibility}]", "val.rewards=[{name: jpeg_incompressibility}]",
                           "val.every=1")  # fmt: skip
    rows = trainer.train()
    assert all("reward/jpeg_compressibility/mean" in r for r in rows)
    val_rows = [r for r in rows if "val/reward/mean" in r]
    assert val_rows and all("val/reward/jpeg_incompressibility/mean" in r for r in val_rows)
    assert not any("val/reward/jpeg_compressibility/mean" in r for r in rows)
    assert all(r["val/reward/mean"] > 0 for r in val_rows)  # kB: positive, unlike −kB/500


def test_validation_reward_labels_must_be_unique(make_config):
    with pytest.raises(UserError, match="val.rewards.0 and val.rewards.1 are both 'a'"):
        make_config("val.rewards=[{name: jpeg_compressibility, label: a}, {name: jpeg_incompressibility, label: a}]")


def test_a_hung_user_reward_fails_the_step_naming_it_instead_of_hanging(make_trainer, user_reward):
    spec = user_reward(
        """
        import threading
        threading.Event().wait()  # never returns
        """
    )
    trainer = make_trainer(f"rewards=[{{name: '{spec}', label: stuck, timeout_s: 1.0}}]")
    with pytest.raises(RewardFailure, match="'stuck' failed on 4/4 .*did not return within timeout_s=1 s"):
        trainer.train()


def test_a_user_reward_calling_sys_exit_is_named(make_trainer, user_reward):
    spec = user_reward("import sys\nsys.exit(7)")
    trainer = make_trainer(f"rewards=[{{name: '{spec}', label: quits}}]")
    with pytest.raises(RewardFailure, match="'quits' failed on .*RewardCallError: reward 'quits' raised SystemExit: 7"):
        trainer.train()


@pytest.mark.parametrize("loss", ["nft", "dpo"])
def test_group_rewards_train_the_direct_preference_family(make_trainer, loss):
    trainer = make_trainer(f"rewards=[{RANK_OF_JPEG}]", f"algorithm.loss={loss}",
                           "sampling.sde_type=ode", "data.group_size=3")  # fmt: skip
    rows = trainer.train()
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    assert all(r["reward/rank/mean"] == pytest.approx(0.5) for r in rows)  # ranks 0, ½, 1 in every group
