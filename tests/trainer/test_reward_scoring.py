"""Rewards in the trainer: chunks scored while the next chunk samples, per-reward advantages, OCR end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffusion_rl.algorithms.credit import GroupNorm, compute_group_advantages
from diffusion_rl.sampling.window import window_for_step
from diffusion_rl.trainer.timing import PhaseTimer


def _first_batch(trainer):
    """The first step's prompts, the trajectory the engine kept, and the scores."""
    collected = trainer.source.collect(0, window_for_step(trainer.cfg.sampling, trainer.cfg.run.seed, 0), PhaseTimer())
    return collected.prompts, trainer.engine.kept.rows(0), collected.scored


def test_chunked_sampling_and_scoring_equals_one_chunk(make_trainer, tmp_path):
    (_, batch1, scored1), (_, batch3, scored3) = (
        _first_batch(make_trainer(f"run.dir={tmp_path / str(n)}", f"sampling.score_chunks={n}")) for n in (1, 3)
    )
    assert len(batch3.ids.sample_index) == 4 and batch3.ids.sample_index.tolist() == [0, 1, 2, 3]
    assert torch.allclose(batch1.log_probs, batch3.log_probs, atol=1e-5)
    assert torch.allclose(batch1.final_latents, batch3.final_latents, atol=1e-5)
    assert np.allclose(scored1.total, scored3.total, atol=1e-6)
    assert scored1.metrics.keys() == scored3.metrics.keys()


def test_chunks_spread_over_several_samplers_are_scored_at_their_own_rows(make_trainer, tmp_path):
    """A Ray engine's chunks hold a piece of every worker's rows (rows 0, 2 then 1, 3 for two workers): the scores
    and images come back at their rows, as one chunk's do."""
    (_, _, one), trainer = _first_batch(make_trainer(f"run.dir={tmp_path / 'one'}")), make_trainer()
    trainer.engine.sampling_chunks = lambda rows, parts: [[0, 2], [1, 3]]
    plain = trainer.source.collect(0, window_for_step(trainer.cfg.sampling, trainer.cfg.run.seed, 0), PhaseTimer())
    assert not np.array_equal(one.total[[0, 2, 1, 3]], one.total)  # the rows' scores differ: a mix-up would show
    assert np.allclose(plain.scored.total, one.total, atol=1e-6)
    for name in one.per_reward:
        assert np.allclose(plain.scored.per_reward[name], one.per_reward[name], atol=1e-6)
    assert plain.scored.metrics.keys() == one.metrics.keys()


def test_sum_advantages_normalises_each_reward_then_weights(make_trainer, user_reward):
    first = user_reward("return np.arange(len(images), dtype=np.float32)")
    second = user_reward("return (np.arange(len(images)) % 2).astype(np.float32) * 10")
    trainer = make_trainer(
        f"rewards=[{{name: '{first}', weight: 1.0}}, {{name: '{second}', weight: 0.5}}]",
        "algorithm.advantage.combine=sum_advantages",
    )
    prompts, _, scored = _first_batch(trainer)
    got = trainer.algorithm.prepare(scored, prompts.group_index)[0].advantages
    # by hand: each reward normalised on its own (global std, ddof 0, eps 1e-8), then 1.0·A1 + 0.5·A2
    expected = torch.zeros(len(prompts))
    for name, weight in ((first, 1.0), (second, 0.5)):
        r = torch.from_numpy(scored.per_reward[name]).double()
        group_mean = torch.stack([r[prompts.group_index == g].mean() for g in prompts.group_index.tolist()])
        expected += weight * ((r - group_mean) / (r.std(unbiased=False) + 1e-8)).float()
    assert torch.allclose(got, expected, atol=1e-5)
    summed = compute_group_advantages(torch.from_numpy(scored.total), prompts.group_index, GroupNorm(eps=1e-8))
    assert not torch.allclose(got, summed.advantages)


def test_ocr_reward_trains_end_to_end_and_is_logged(make_trainer, tmp_path):
    pytest.importorskip("rapidocr")
    from diffusion_rl.data.ocr_prepare import write_synthetic_ocr

    prompts = tmp_path / "ocr.jsonl"
    write_synthetic_ocr(8, prompts, seed=0)
    trainer = make_trainer(
        f"data.train={prompts}", f"val.prompts={prompts}", "rewards=[{name: ocr}]", "train.total_steps=2"
    )
    rows = trainer.train()
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["reward/failed_fraction"] == 0
        assert 0.0 <= row["reward/ocr/mean"] <= 1.0
        assert "reward/source/ocr/mean" in row
