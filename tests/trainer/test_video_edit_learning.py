"""The video and edit quickstarts at reduced size learn: their validation reward rises (JPEG size of the frames for
the tiny Wan); the edit quickstart's rollouts score higher on ShapesWorld edit success (the tiny FLUX.1 Kontext).

Measured gains of the fixed-seed validation reward for run.seed 0, 1, 2: video (16 steps, lr 3e-3, each step's 16
samples in one micro-batch) +0.8/+2.1/+1.3 % (2026-11-26; in micro-batches of 4, the same gradient up to float
rounding in more time: +1.2/+3.1/+7.4 %; lr 1e-2 overshoots: −1.7 % for seed 0). Edit (12 steps, lr 2e-3, half of
each sample's steps trained): the rollouts' shapes_edit, last 4 steps over the first 4, +0.107/+0.132/+0.061
(2026-11-26, AMD EPYC without AMX; the curves, and the old rewards' beside them, in benchmarks/RESULTS.md), and
+0.107/+0.132/+0.061 again with each step's 16 samples in one micro-batch, as the test trains (0.93x its time). The
earlier 24 steps at lr 1e-3 with every step trained gave +0.179/+0.030/−0.005 (last 6 over first 6) on that CPU for
2.9× the CPU time (178.8 vs 61.2 CPU s for the whole test; it took 90 s, over the 45 s an end-to-end test may take).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.models.tiny import save_tiny

from .conftest import ONE_MICRO_BATCH

ROOT = Path(__file__).resolve().parents[2]
EDITS = ROOT / "configs/prompts/shapes_edits"
# the reduced quickstart's shape (tests/trainer/conftest.py LEARNS) without its reward: each quickstart keeps its own
REDUCED = ("data.prompts_per_step=4", "data.group_size=4", "train.total_steps=16", "val.before_train=true",
           "val.every=1000", "val.n=4", "sampling.num_steps=6")  # fmt: skip


@pytest.fixture(scope="module")
def base_models(tmp_path_factory):
    """The quickstarts' own tiny models (base presets)."""
    root = tmp_path_factory.mktemp("quickstart_models")
    return {family: save_tiny(root / family, family, "base", seed=0) for family in ("wan", "flux_kontext")}


def test_video_quickstart_learns_to_make_compressible_videos(make_trainer, base_models):
    trainer = make_trainer(*REDUCED, "train.lr=3e-3", f"model.path={base_models['wan']}", "sampling.num_frames=9",
                           ONE_MICRO_BATCH, config=ROOT / "configs/quickstart_video.yaml")  # fmt: skip
    rows = trainer.train()
    before, after = rows[0]["val/reward/mean"], rows[-1]["val/reward/mean"]
    assert after > before, f"val/reward/mean {before:.6g} -> {after:.6g}"
    assert "val/reward/temporal_consistency/mean" in rows[-1]  # logged, weight 0


def test_edit_quickstart_moves_its_edits_towards_the_asked_scene(make_trainer, base_models, tmp_path):
    """The rollouts' shapes_edit rises (the mean of the last 4 steps over the first 4, averaged over seeds 0-2). Its
    ODE validation (6 instructions × 4) is too noisy at this size to show it."""
    gains = []
    for seed in (0, 1, 2):
        trainer = make_trainer(*REDUCED, "train.lr=2e-3", "train.total_steps=12", "algorithm.timestep_fraction=0.5",
                               "val.before_train=false", "val.every=0", ONE_MICRO_BATCH, f"run.seed={seed}",
                               f"model.path={base_models['flux_kontext']}",
                               f"data.train={EDITS / 'train.jsonl'}", f"val.prompts={EDITS / 'val.jsonl'}",
                               f"run.dir={tmp_path / str(seed)}",
                               config=ROOT / "configs/quickstart_edit.yaml")  # fmt: skip
        edits = [row["reward/shapes_edit/mean"] for row in trainer.train()]
        gains.append(sum(edits[-4:]) / 4 - sum(edits[:4]) / 4)
    assert sum(gains) / 3 > 0.03, f"shapes_edit gains of the rollouts: {gains}"
