"""Wan 2.2 A14B on two FSDP2 workers: DiffusionNFT draws a time per sample, so a call's rows on one rank may need an
expert the other rank's rows do not; every rank still joins the same experts' collectives (models/experts.py) and
the run takes the local engine's steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.models.tiny import save_tiny

pytestmark = pytest.mark.usefixtures("ray_session")

ROOT = Path(__file__).resolve().parents[2]
VIDEO = ("sampling.num_frames=5", "sampling.height=32", "sampling.width=32", "train.lr=1e-4", "engine.num_threads=1",
         "sampling.score_chunks=2", "train.total_steps=2", "algorithm.loss=nft")  # fmt: skip


def test_nft_on_two_experts_takes_the_same_steps_on_two_sharded_workers(
    tmp_path, local_and_two_workers, rows_close, max_difference
):
    model = save_tiny(tmp_path / "a14b", "wan", "a14b", seed=0)
    config = ROOT / "configs/quickstart_video.yaml"
    options = (*VIDEO, f"model.path={model}")
    local, local_rows, ray_rows, weights = local_and_two_workers(*options, config=config)
    assert len(ray_rows) == len(local_rows) == 2
    first, second = zip(local_rows, ray_rows)
    rows_close(*first, rel=1e-4, abs=1e-7)  # step 1: the same samples and the same update's metrics
    # step 2 samples with weights that differ by the gradient halves' summation order (~1e-9, which Adam's first
    # step scales up to ~1e-6, tests/engine/test_ray_engine.py NFT+LoRA): a video's JPEG size may move by a byte or
    # so (on Wan's UniPC σ points the mean reward differs by 2e-7 of its 2.6e-3: 0.1 byte of 1.3 kB), the
    # temporal-consistency statistics (a std of small per-frame differences) by ~2e-4
    assert second[0]["reward/mean"] == pytest.approx(second[1]["reward/mean"], rel=1e-3)
    assert max_difference(local.engine.model.policies.trainable_state_dict(), weights) <= 1e-5
