"""The video quickstart trains with flow_grpo's Wan step (`sampling.sde_type: sde_linear`) and its KL to the
reference: the update replays the rollout's log-probs exactly, the KL term is live, and the weights move."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from diffusion_rl.models.tiny import save_tiny

from .conftest import trained_weights

ROOT = Path(__file__).resolve().parents[2]


def test_the_video_quickstart_trains_with_the_sde_linear_step_and_a_kl(make_trainer, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    wan = save_tiny(tmp_path / "wan", "wan", "base", seed=0)  # flow_shift 3, as Wan2.1-T2V-1.3B
    trainer = make_trainer(f"model.path={wan}", "sampling.num_frames=5", "sampling.num_steps=6",
                           "sampling.sde_type=sde_linear", "sampling.noise_level=0.9",
                           "algorithm.flow_grpo.kl_beta=0.004", "train.total_steps=3", "train.micro_batch_size=4",
                           config=ROOT / "configs/quickstart_video.yaml")  # fmt: skip
    before = {k: v.clone() for k, v in trained_weights(trainer).items()}
    rows = trainer.train()
    assert len(rows) == 3
    assert rows[0]["train/logp_diff_max"] == 0.0  # the update's recomputed log-probs are the rollout's
    assert rows[0]["ratio_min"] == rows[0]["ratio_max"] == 1.0  # on-policy, before any optimizer step
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["kl_ref"]) for r in rows)
    assert rows[-1]["kl_ref"] > 0  # the policy has left the reference
    # 0.9 is not this schedule's σ_max: UniPC's 6 flow σ points put u_1 = 1 − 0.999/6 = 0.8335 before the shift, and
    # shift 3 makes it 3·0.8335 / (1 + 2·0.8335) = 0.93757 — said in one line
    assert caplog.text.count("set sampling.noise_level=0.9376 to match it") == 1
    after = trained_weights(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)
