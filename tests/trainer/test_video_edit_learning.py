"""The video and edit quickstarts at reduced size learn: their validation reward rises (JPEG size of the frames for
the tiny Wan; ShapesWorld edit success plus source preservation for the tiny FLUX.1 Kontext).

Measured gains of the fixed-seed validation reward for run.seed 0, 1, 2: video (16 steps, lr 3e-3) +1.2/+3.1/+7.4 %
(lr 1e-2 overshoots: −1.7 % for seed 0); edit (24 steps, lr 1e-3) +0.048/+0.066/+0.028 on a reward in [0, 2] (16
steps gave +0.042/+0.159/−0.001, lr 3e-3 +0.043/+0.119/−0.080: the reduced edit run needs its 24 steps).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.models.tiny import save_tiny

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
                           config=ROOT / "configs/quickstart_video.yaml")  # fmt: skip
    rows = trainer.train()
    before, after = rows[0]["val/reward/mean"], rows[-1]["val/reward/mean"]
    assert after > before, f"val/reward/mean {before:.6g} -> {after:.6g}"
    assert "val/reward/temporal_consistency/mean" in rows[-1]  # logged, weight 0


def test_edit_quickstart_moves_its_edits_towards_the_asked_scene(make_trainer, base_models):
    model = base_models["flux_kontext"]
    trainer = make_trainer(*REDUCED, "train.lr=1e-3", "train.total_steps=24", f"model.path={model}",
                           f"data.train={EDITS / 'train.jsonl'}", f"val.prompts={EDITS / 'val.jsonl'}",
                           config=ROOT / "configs/quickstart_edit.yaml")  # fmt: skip
    rows = trainer.train()
    before, after = rows[0]["val/reward/mean"], rows[-1]["val/reward/mean"]
    assert after > before + 0.01, f"val/reward/mean {before:.4g} -> {after:.4g}"
