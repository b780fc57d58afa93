"""Low-resolution training, full-resolution validation: `val.height/width` (null = the rollouts' size)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from diffusion_rl.errors import UserError
from diffusion_rl.sampling.rollout import SamplerSettings


def _sizes(folder, pattern: str) -> set[tuple[int, int]]:
    return {Image.open(p).size for p in folder.glob(pattern)}


def test_a_run_trains_at_32_px_and_validates_at_64_px(make_trainer):
    trainer = make_trainer("val.height=64", "val.width=64", "val.before_train=true", "val.every=1",
                           "val.ode_solver=ab2", "train.total_steps=1", "log.rollout_every=1")  # fmt: skip
    asked: list[SamplerSettings] = []
    sample_images = trainer.engine.sample_images

    def spy(prompts, negative, seeds, settings, **kwargs):
        asked.append(settings)
        return sample_images(prompts, negative, seeds, settings, **kwargs)

    trainer.engine.sample_images = spy
    trainer.train()
    # two validations (before step 1, after it), at val's size with val's solver
    assert [(s.height, s.width, s.ode_solver) for s in asked] == [(64, 64, "ab2")] * 2
    samples = trainer.run_dir / "samples"
    for step in ("step_000000", "step_000001"):
        assert _sizes(samples / step, "p*_s*.png") == {(64, 64)}, step  # the per-image val gallery
    rollouts = trainer.run_dir / "rollouts" / "step_000001"
    assert _sizes(rollouts, "s[0-9]*.png") == {(32, 32)}  # what was trained on
    scored = {r["step"]: r["val/reward/mean"] for r in trainer.finish() if "val/reward/mean" in r}
    assert sorted(scored) == [0, 1] and all(np.isfinite(v) for v in scored.values())


def test_validation_defaults_to_the_rollouts_size(make_trainer):
    trainer = make_trainer()
    trainer.validate()
    images = list((trainer.run_dir / "samples" / "step_000000").glob("p*_s*.png"))
    assert images and {np.asarray(Image.open(p)).shape for p in images} == {(32, 32, 3)}


def test_a_validation_size_the_model_cannot_make_names_the_key(make_trainer):
    with pytest.raises(UserError, match=r"val\.height/val\.width.*try val\.height 32 val\.width 64"):
        make_trainer("val.height=36", "val.width=64")


def test_a_non_positive_validation_size_is_a_config_error(make_config):
    with pytest.raises(UserError, match=r"val\.width"):
        make_config("val.width=0")


def test_a_training_size_beyond_the_models_position_table_is_refused_before_sampling(make_config, monkeypatch):
    """512 px is in sampling.height's range but past the tiny SD3's pos_embed_max_size: one line naming the keys
    and a size that works, from the same check as val.*'s, before any rollout."""
    from diffusion_rl.engine.worker import PolicyWorker
    from diffusion_rl.trainer import make_trainer

    monkeypatch.setattr(PolicyWorker, "generate", lambda *a, **k: pytest.fail("sampling started"))
    with pytest.raises(UserError) as caught:
        make_trainer(make_config("sampling.height=512", "sampling.width=512")).train()
    message = str(caught.value)
    assert "\n" not in message and "sampling.height" in message and "pos_embed_max_size" in message
    assert "try sampling.height 256 sampling.width 256" in message
