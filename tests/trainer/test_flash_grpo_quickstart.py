"""configs/quickstart_flash_grpo.yaml (Flash-GRPO: one SDE step per rollout, shared by the group, rectified) loads,
refuses configs that train more than one step, weights each step as its coefficient says, and, reduced, makes the
images compress better.

Learning settings: the `learns` overrides (16 steps of 4 prompts × 4, lr 1e-2, 32 px, 4 sampling steps) with the one
trained step drawn from the first half of the schedule (steps 0-1), each step's 16 samples in one micro-batch.
Gains of the fixed-seed validation reward (jpeg_compressibility, about −0.003), run.seed 0-2, about 9 s each on 2
shared cores: rectify true +1.26e-4 / +3.47e-4 / +2.90e-4 (+4.3 / +11.8 / +9.8 %); rectify false +2.51e-4 /
+4.64e-4 / +6.6e-5 (2026-11, AMD EPYC without AMX).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from diffusion_rl.config import load
from diffusion_rl.errors import UserError

from .conftest import LEARNS, ONE_MICRO_BATCH

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/quickstart_flash_grpo.yaml"
REDUCED = ("sampling.num_steps=4", "sampling.window.hi=2")  # the first half of 4 steps, as the authors' 10 of 20
SEEDS = (0, 1, 2)


def test_the_quickstart_config_loads_as_flash_grpo():
    cfg = load(CONFIG)
    assert cfg.algorithm.spec.name == "flash_grpo" and cfg.algorithm.settings.rectify
    assert cfg.algorithm.settings.clip_range == 1e-3
    w = cfg.sampling.window
    assert (w.kind, w.size, w.lo, w.hi) == ("random", 1, 0, cfg.sampling.num_steps // 2)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("sampling.window.size=2", "sampling.window"),
        ("sampling.window.kind=all", "sampling.window"),
        ("sampling.sde_type=cps", "sampling.sde_type"),
    ],
)
def test_configs_that_train_more_than_one_step_or_another_sde_are_refused_naming_the_key(override, key):
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        load(CONFIG, [override])


def hand_weight(schedule: list[float], k: int, noise: float) -> float:
    """c_k / mean_j c_j over steps j = 0 … T − 2 of Flow-GRPO's sde step, written out (std = a·√(σ/(1 − σ̃)))."""

    def c(j):
        sigma, sigma_next = schedule[j], schedule[j + 1]
        std = noise * math.sqrt(sigma / (1 - (sigma_next if sigma == 1 else sigma)))
        dt = sigma - sigma_next
        return std * math.sqrt(dt) / ((1 + std**2 * (1 - sigma) / (2 * sigma)) * dt)

    return c(k) / (sum(c(j) for j in range(len(schedule) - 2)) / (len(schedule) - 2))


def test_rectification_scales_the_first_update_s_gradient_by_the_step_s_weight(make_trainer, tmp_path):
    """The same first step (same seed, same weights) with and without rectification: every row is at one step k,
    so the whole gradient is w_k times the unrectified one."""
    first = {}
    for rectify in ("true", "false"):
        rows = make_trainer(*REDUCED, "train.total_steps=1", f"algorithm.flash_grpo.rectify={rectify}",
                            f"run.dir={tmp_path / rectify}", config=CONFIG).train()  # fmt: skip
        first[rectify] = rows[0]
    weight = first["true"]["flash/rectify_weight"]
    assert "flash/rectify_weight" not in first["false"] and weight != pytest.approx(1.0, abs=1e-3)
    assert first["true"]["grad_norm"] / first["false"]["grad_norm"] == pytest.approx(weight, rel=1e-4)


def test_the_reduced_flash_grpo_quickstart_learns_to_compress(make_trainer, tmp_path):
    gains = []
    for seed in SEEDS:
        trainer = make_trainer(
            *LEARNS, *REDUCED, ONE_MICRO_BATCH, f"run.seed={seed}", f"run.dir={tmp_path / str(seed)}", config=CONFIG
        )
        rows = trainer.train()
        gains.append(rows[-1]["val/reward/mean"] - rows[0]["val/reward/mean"])
        s = trainer.cfg.sampling
        schedule = trainer.engine.model.sigma_schedule(s.num_steps, s.height, s.width, s.num_frames).tolist()
        trained = [r for r in rows if "flash/rectify_weight" in r]
        assert len(trained) == 16 and {r["window/start"] for r in trained} == {0, 1}
        # the mean weight of a step is one step's weight: every row of the step was trained at window/start
        for r in trained:
            assert r["flash/rectify_weight"] == pytest.approx(hand_weight(schedule, r["window/start"], 0.7), rel=1e-5)
    # one byte of JPEG is 2e-6 of reward: ask the mean over seeds for more than a few bytes of the ~1.5 kB
    assert min(gains) > 0 and sum(gains) / len(gains) > 2e-5, f"val/reward/mean gains {gains}"
