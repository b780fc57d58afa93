"""sampling.latents_dtype=bf16/fp16 in a training run: the on-policy update replays the rollout's log-probs exactly,
and the step's loss and gradient match fp32 storage's within the rounding of the stored window."""

from __future__ import annotations

import pytest

from diffusion_rl.errors import UserError

# one step of 8 rows in one micro-batch (the recomputation sees the rollout's batch, so it replays it bit for bit)
BATCH = ("data.prompts_per_step=2", "data.group_size=4", "train.total_steps=1", "train.micro_batch_size=8")
# the reward is the row's position: the same advantages whatever the storage rounds in the images
BY_ROW = "return np.arange(len(images), dtype=np.float32)"


def _step(make_trainer, tmp_path, reward, dtype, *overrides):
    return make_trainer(*BATCH, f"rewards.0.name={reward}", f"sampling.latents_dtype={dtype}",
                        f"run.dir={tmp_path / dtype}", *overrides).train()[0]  # fmt: skip


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_stored_latents_train_like_fp32_storage(make_trainer, user_reward, tmp_path, dtype):
    reward = user_reward(BY_ROW)
    full, half = (_step(make_trainer, tmp_path, reward, d) for d in ("fp32", dtype))
    assert half["advantage/max"] == full["advantage/max"]  # the same targets: only the storage differs
    assert half["train/logp_diff_max"] == full["train/logp_diff_max"] == 0.0
    assert half["ratio_min"] == half["ratio_max"] == 1.0
    assert half["loss"] == pytest.approx(full["loss"], abs=1e-7)
    # the gradient is taken at the rounded samples: within the storage's rounding of fp32 storage's
    assert half["grad_norm"] == pytest.approx(full["grad_norm"], rel=5e-3)  # measured: 3e-4 (bf16), 9e-5 (fp16)


def test_a_loss_reading_the_stored_means_trains_on_policy_with_fp16(make_trainer, user_reward, tmp_path):
    # grpo_guard re-centres its ratio by the drift of the step mean from the stored one: fp16's rounding of the
    # stored means leaves its ratio within 1e-7 of 1 on-policy (its clip range is 2e-6)
    half = _step(make_trainer, tmp_path, user_reward(BY_ROW), "fp16", "algorithm.loss=grpo_guard")
    assert half["train/logp_diff_max"] == 0.0
    assert abs(half["ratio_max"] - 1) < 1e-7 and abs(half["ratio_min"] - 1) < 1e-7
    assert half["clip_fraction"] == 0.0


@pytest.mark.parametrize("loss", ["grpo_guard", "flow_dppo"])
def test_bf16_storage_is_refused_for_a_loss_reading_the_stored_means(make_config, loss):
    with pytest.raises(UserError, match=f"algorithm.loss={loss} reads the rollout's stored step means.*fp16"):
        make_config(f"algorithm.loss={loss}", "sampling.latents_dtype=bf16")
