import logging
import math

import numpy as np
import pytest

from diffusion_rl.rewards import RewardCombiner, RewardFailure, RewardOutputError, WeightedReward

# Sample i's pixels are all equal to PIXELS[i]; the rewards below read that value.
PIXELS = [10, 20, 255, 40]


def _batch(pixels=PIXELS, sources=None):
    images = np.stack([np.full((4, 4, 3), p, dtype=np.uint8) for p in pixels])
    prompts = [f"prompt {i}" for i in range(len(pixels))]
    sources = sources or [None] * len(pixels)
    metadata = [{} if s is None else {"data_source": s} for s in sources]
    return images, prompts, metadata


def pixel(images, prompts, metadata):
    return images[:, 0, 0, 0].astype(np.float32)


def prompt_length(images, prompts, metadata):
    return np.array([len(p) for p in prompts], dtype=np.float32)


def fails_on_white(images, prompts, metadata):
    """Raises when any image of its input is white: a whole batch with one white image raises."""
    if (images[:, 0, 0, 0] == 255).any():
        raise ValueError("cannot score a white image")
    return images[:, 0, 0, 0].astype(np.float32) / 10


def nan_on_white(images, prompts, metadata):
    values = images[:, 0, 0, 0].astype(np.float32) / 10
    values[images[:, 0, 0, 0] == 255] = np.nan
    return values


def test_total_is_weighted_sum():
    images, prompts, metadata = _batch()
    combiner = RewardCombiner([WeightedReward("pixel", 2.0, pixel), WeightedReward("len", 0.5, prompt_length)])
    result = combiner(images, prompts, metadata)
    expected = [2.0 * PIXELS[i] + 0.5 * len(prompts[i]) for i in range(4)]
    np.testing.assert_allclose(result.total, expected)
    assert result.total.dtype == np.float32
    assert not result.failed.any()
    np.testing.assert_allclose(result.per_reward["pixel"], PIXELS)
    assert result.metrics["reward/mean"] == pytest.approx(sum(expected) / 4)
    assert result.metrics["reward/max"] == pytest.approx(max(expected))
    assert result.metrics["reward/min"] == pytest.approx(min(expected))
    mean = sum(expected) / 4
    assert result.metrics["reward/std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in expected) / 4))
    assert result.metrics["reward/pixel/mean"] == pytest.approx(sum(PIXELS) / 4)
    assert result.metrics["reward/failed_fraction"] == 0.0


def test_reward_raising_on_one_sample_fails_only_that_sample(caplog):
    images, prompts, metadata = _batch()
    combiner = RewardCombiner([WeightedReward("picky", 1.0, fails_on_white)])
    with caplog.at_level(logging.WARNING):
        result = combiner(images, prompts, metadata)
    assert result.failed.tolist() == [False, False, True, False]
    assert math.isnan(result.total[2])
    np.testing.assert_allclose(result.total[[0, 1, 3]], [1.0, 2.0, 4.0])
    assert result.metrics["reward/failed_fraction"] == pytest.approx(0.25)
    assert result.metrics["reward/picky/failed_fraction"] == pytest.approx(0.25)
    warnings = [r for r in caplog.records if "picky" in r.getMessage()]
    assert len(warnings) == 1  # once per batch, not once per sample
    assert "cannot score a white image" in warnings[0].getMessage()


def test_reward_returning_nan_fails_that_sample():
    images, prompts, metadata = _batch()
    result = RewardCombiner([WeightedReward("nanny", 1.0, nan_on_white)])(images, prompts, metadata)
    assert result.failed.tolist() == [False, False, True, False]
    np.testing.assert_allclose(result.total[[0, 1, 3]], [1.0, 2.0, 4.0])


def test_reward_raising_on_the_batch_only_is_scored_sample_by_sample():
    def batch_of_one_only(images, prompts, metadata):
        if len(images) > 1:
            raise RuntimeError("out of memory")
        return images[:, 0, 0, 0].astype(np.float32)

    images, prompts, metadata = _batch()
    result = RewardCombiner([WeightedReward("small", 1.0, batch_of_one_only)])(images, prompts, metadata)
    assert not result.failed.any()
    np.testing.assert_allclose(result.total, PIXELS)


def test_failed_non_required_reward_is_renormalised_out():
    images, prompts, metadata = _batch()
    combiner = RewardCombiner(
        [
            WeightedReward("pixel", 1.0, pixel),
            WeightedReward("picky", 3.0, fails_on_white, required=False),
        ]
    )
    result = combiner(images, prompts, metadata)
    assert not result.failed.any()
    # Sample 2: only 'pixel' (weight 1) succeeded; scaled back up to the full weight mass 1 + 3.
    expected = [1.0 * p + 3.0 * (p / 10) for p in PIXELS]
    expected[2] = (1.0 + 3.0) * (1.0 * 255) / 1.0
    np.testing.assert_allclose(result.total, expected, rtol=1e-6)
    assert math.isnan(result.per_reward["picky"][2])
    assert result.metrics["reward/picky/failed_fraction"] == pytest.approx(0.25)
    assert result.metrics["reward/failed_fraction"] == 0.0
    assert result.metrics["reward/picky/mean"] == pytest.approx((1.0 + 2.0 + 4.0) / 3)


def test_failed_required_reward_fails_the_sample_even_if_others_succeed():
    images, prompts, metadata = _batch()
    combiner = RewardCombiner([WeightedReward("pixel", 1.0, pixel), WeightedReward("picky", 1.0, fails_on_white)])
    result = combiner(images, prompts, metadata)
    assert result.failed.tolist() == [False, False, True, False]
    assert result.per_reward["pixel"][2] == 255.0  # the other reward's score is kept for inspection


def test_every_sample_failing_raises_reward_failure_naming_the_reward():
    def broken(images, prompts, metadata):
        raise ConnectionError("reward server unreachable")

    images, prompts, metadata = _batch()
    combiner = RewardCombiner([WeightedReward("pixel", 1.0, pixel), WeightedReward("remote", 1.0, broken)])
    with pytest.raises(RewardFailure, match="remote.*reward server unreachable") as info:
        combiner(images, prompts, metadata)
    assert "'pixel'" not in str(info.value)


def test_wrong_shape_is_an_error_naming_the_reward():
    def one_score_too_many(images, prompts, metadata):
        return np.zeros(len(images) + 1, dtype=np.float32)

    images, prompts, metadata = _batch()
    with pytest.raises(RewardOutputError, match="'extra'.*shape"):
        RewardCombiner([WeightedReward("extra", 1.0, one_score_too_many)])(images, prompts, metadata)


def test_integer_scores_are_an_error_naming_the_reward():
    def ints(images, prompts, metadata):
        return np.ones(len(images), dtype=np.int64)

    images, prompts, metadata = _batch()
    with pytest.raises(RewardOutputError, match="'ints'.*dtype"):
        RewardCombiner([WeightedReward("ints", 1.0, ints)])(images, prompts, metadata)


def test_metrics_per_data_source():
    images, prompts, metadata = _batch(sources=["ocr", "geneval", "ocr", None])
    result = RewardCombiner([WeightedReward("picky", 1.0, fails_on_white)])(images, prompts, metadata)
    # sample 2 (ocr) failed; sample 3 has no source
    assert result.metrics["reward/source/ocr/mean"] == pytest.approx(1.0)
    assert result.metrics["reward/source/geneval/mean"] == pytest.approx(2.0)
    assert not [k for k in result.metrics if k.startswith("reward/source/") and "None" in k]


def test_invalid_combiner_configuration():
    with pytest.raises(ValueError, match="unique"):
        RewardCombiner([WeightedReward("a", 1.0, pixel), WeightedReward("a", 1.0, pixel)])
    with pytest.raises(ValueError, match="weight"):
        WeightedReward("a", -1.0, pixel)
    with pytest.raises(ValueError, match="at least one must be > 0"):
        RewardCombiner([WeightedReward("a", 0.0, pixel)])


def test_rows_left_unscored_are_failed_in_the_whole_batchs_result():
    from diffusion_rl.rewards.combine import with_unscored_rows

    images, prompts, metadata = _batch(PIXELS, sources=["a", "a", "b", "b"])
    combiner = RewardCombiner([WeightedReward("pixel", 1.0, pixel), WeightedReward("length", 0.5, prompt_length)])
    scored_rows = np.array([0, 2])  # rows 1 and 3 could not be scored
    part = combiner(images[scored_rows], [prompts[i] for i in scored_rows], [metadata[i] for i in scored_rows])
    result = with_unscored_rows(part, scored_rows, metadata)

    # by hand: total = 1·pixel + 0.5·len("prompt i") = pixel + 4
    assert np.allclose(result.total, [14.0, np.nan, 259.0, np.nan], equal_nan=True)
    assert result.failed.tolist() == [False, True, False, True]
    assert np.allclose(result.per_reward["pixel"], [10, np.nan, 255, np.nan], equal_nan=True)
    m = result.metrics
    assert m["reward/failed_fraction"] == 0.5 and m["reward/pixel/failed_fraction"] == 0.5
    assert m["reward/mean"] == pytest.approx((14 + 259) / 2) and m["reward/min"] == 14 and m["reward/max"] == 259
    assert m["reward/source/a/mean"] == 14 and m["reward/source/b/mean"] == 259
