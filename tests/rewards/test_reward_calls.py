"""Reward calls: deadlines, rewards that call sys.exit, and the shared sample-by-sample retry."""

import logging
import sys
import threading

import numpy as np
import pytest

from diffusion_rl.rewards import RewardCombiner, RewardFailure, RewardOutputError, WeightedReward
from diffusion_rl.rewards.calls import RewardCallError, RewardTimeout, call_with_deadline, score_with_retry

IMAGES = np.zeros((3, 2, 2, 3), dtype=np.uint8)
PROMPTS, METADATA = ["a", "b", "c"], [{}, {}, {}]


@pytest.fixture
def release():
    """An event the hung rewards below wait on; set at the end so their abandoned threads finish."""
    event = threading.Event()
    yield event
    event.set()


def test_a_reward_past_its_deadline_fails_the_chunk_naming_the_reward(release, caplog):
    def hangs(images, prompts, metadata):
        release.wait()
        return np.ones(len(images), dtype=np.float32)

    combiner = RewardCombiner([WeightedReward("sleepy", 1.0, hangs, timeout_s=0.2)])
    with caplog.at_level(logging.WARNING), pytest.raises(RewardFailure) as info:
        combiner(IMAGES, PROMPTS, METADATA)
    assert "'sleepy' failed on 3/3" in str(info.value)
    assert "did not return within timeout_s=0.2 s" in str(info.value)
    assert any("reward 'sleepy' failed all 3 samples of a chunk of the batch" in r.getMessage() for r in caplog.records)


def test_a_timeout_is_not_retried_sample_by_sample(release):
    calls = []

    def hangs(images, prompts, metadata):
        calls.append(len(images))
        release.wait()

    scored = score_with_retry(hangs, "sleepy", IMAGES, PROMPTS, METADATA, timeout_s=0.2)
    assert calls == [3] and isinstance(scored.batch_error, RewardTimeout) and scored.failed.all()


def test_a_non_required_reward_timing_out_leaves_the_others(release):
    def hangs(images, prompts, metadata):
        release.wait()

    def ones(images, prompts, metadata):
        return np.ones(len(images), dtype=np.float32)

    combiner = RewardCombiner(
        [WeightedReward("ok", 1.0, ones, timeout_s=5.0), WeightedReward("slow", 1.0, hangs, False, timeout_s=0.2)]
    )
    result = combiner(IMAGES, PROMPTS, METADATA)
    np.testing.assert_allclose(result.total, [2.0, 2.0, 2.0])  # ok's 1, scaled back up to the full weight 2
    assert result.metrics["reward/slow/failed_fraction"] == 1.0


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_sys_exit_in_a_reward_fails_samples_and_names_it(timeout_s):
    def exits(images, prompts, metadata):
        sys.exit(3)

    combiner = RewardCombiner([WeightedReward("quitter", 1.0, exits, timeout_s=timeout_s)])
    with pytest.raises(RewardFailure, match=r"'quitter' failed on 3/3 \(RewardCallError: reward 'quitter' raised "):
        combiner(IMAGES, PROMPTS, METADATA)


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_keyboard_interrupt_still_stops(timeout_s):
    def interrupted():
        raise KeyboardInterrupt

    if timeout_s is None:
        with pytest.raises(KeyboardInterrupt):
            call_with_deadline(interrupted, "r", timeout_s)
    else:  # in a worker thread a KeyboardInterrupt cannot come from Ctrl-C; it is reported like SystemExit
        with pytest.raises(RewardCallError, match="KeyboardInterrupt"):
            call_with_deadline(interrupted, "r", timeout_s)


def test_generator_exit_is_named():
    def closes():
        raise GeneratorExit("closed")

    with pytest.raises(RewardCallError, match="reward 'gen' raised GeneratorExit: closed"):
        call_with_deadline(closes, "gen", None)


def test_retry_scores_the_good_samples_and_keeps_the_errors():
    def fails_on_b(images, prompts, metadata):
        if "b" in prompts:
            raise ValueError("not b")
        return np.full(len(images), 2.0, dtype=np.float32)

    scored = score_with_retry(fails_on_b, "r", IMAGES, PROMPTS, METADATA, timeout_s=5.0)
    np.testing.assert_array_equal(scored.scores, [2.0, np.nan, 2.0])
    assert isinstance(scored.batch_error, ValueError) and list(scored.sample_errors) == [1]


def test_wrong_output_is_a_bug_even_in_the_retry():
    def ints_when_alone(images, prompts, metadata):
        if len(images) > 1:
            raise ValueError("one at a time")
        return np.ones(1, dtype=np.int64)

    with pytest.raises(RewardOutputError, match="'r' returned dtype int64"):
        score_with_retry(ints_when_alone, "r", IMAGES, PROMPTS, METADATA)
