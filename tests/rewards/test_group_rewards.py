"""Group rewards (rank, pairwise_win_rate) and how the combiner scores them: numbers worked out by hand."""

import sys
import textwrap

import numpy as np
import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.rewards import RewardCombiner, RewardOutputError, WeightedReward, make_reward
from diffusion_rl.rewards.group import normalized_rank, win_rates
from diffusion_rl.rewards.user_fn import load_user_function


def _images(values):
    """Image i has every pixel equal to values[i]."""
    return np.stack([np.full((2, 2, 3), v, dtype=np.uint8) for v in values])


@pytest.fixture
def user_fn(tmp_path):
    """user_fn(source) -> 'file.py:' spec prefix for a module holding `source`."""

    def write(source: str) -> str:
        path = tmp_path / f"fns_{abs(hash(source))}.py"
        path.write_text("import numpy as np\n\n" + textwrap.dedent(source))
        return str(path)

    return write


@pytest.fixture
def pixel_reward(user_fn):
    return user_fn(
        """
        def pixel(images, prompts, metadata):
            return images[:, 0, 0, 0].astype(np.float32)
        """
    )


def test_normalized_rank_by_hand():
    # scores 3, 1, 2, 2: lower counts 3, 0, 1, 1; tied others 0, 0, 1, 1 -> ranks 3, 0, 1.5, 1.5 over G' - 1 = 3
    np.testing.assert_allclose(normalized_rank(np.array([3.0, 1.0, 2.0, 2.0])), [1.0, 0.0, 0.5, 0.5])
    # a NaN is left out: the other three rank among themselves (G' = 3)
    np.testing.assert_allclose(normalized_rank(np.array([np.nan, 5.0, 1.0, 3.0])), [np.nan, 1.0, 0.0, 0.5])
    np.testing.assert_allclose(normalized_rank(np.array([np.nan, 7.0])), [np.nan, 0.5])  # one left: neutral


def test_win_rates_by_hand():
    # P(i beats j): 0 beats 1 (0.8) and 2 (0.6); 1 beats 2 (0.3)
    beats = np.array([[np.nan, 0.8, 0.6], [0.2, np.nan, 0.3], [0.4, 0.7, np.nan]])
    np.testing.assert_allclose(win_rates(beats), [0.7, 0.25, 0.55], rtol=1e-6)
    beats[0, 2] = beats[2, 0] = np.nan  # a failed comparison is left out of both means
    np.testing.assert_allclose(win_rates(beats), [0.8, 0.25, 0.7], rtol=1e-6)


def test_rank_reward_ranks_each_group_on_its_own(pixel_reward):
    combiner = RewardCombiner([WeightedReward("rank", 1.0, make_reward("rank", reward=f"{pixel_reward}:pixel"))])
    images = _images([10, 30, 20, 5, 5, 9])
    groups = [0, 0, 0, 1, 1, 1]
    result = combiner(images, ["a"] * 3 + ["b"] * 3, [{}] * 6, group_index=groups)
    # group 0: 10 < 20 < 30 -> 0, 1, 0.5; group 1: 5 = 5 < 9 -> 0.25, 0.25, 1
    np.testing.assert_allclose(result.total, [0.0, 1.0, 0.5, 0.25, 0.25, 1.0])


def test_without_group_index_samples_are_grouped_by_prompt(pixel_reward):
    combiner = RewardCombiner([WeightedReward("rank", 1.0, make_reward("rank", reward=f"{pixel_reward}:pixel"))])
    result = combiner(_images([1, 50, 2, 40]), ["a", "b", "a", "b"], [{}] * 4)
    np.testing.assert_allclose(result.total, [0.0, 1.0, 1.0, 0.0])


def test_win_rate_from_a_pointwise_reward(pixel_reward):
    reward = make_reward("pairwise_win_rate", reward={"name": f"{pixel_reward}:pixel"})
    # pixels 4, 9, 4, 1: sample 0 beats 3, ties 2, loses to 1 -> (0 + 0.5 + 1) / 3
    np.testing.assert_allclose(reward.score_group(_images([4, 9, 4, 1]), ["p"] * 4, [{}] * 4), [0.5, 1.0, 0.5, 0.0])


def test_win_rate_from_a_pairwise_preference_asks_each_pair_once(user_fn):
    path = user_fn(
        """
        CALLS = []

        def prefer(images_a, images_b, prompts, metadata):
            a, b = images_a[:, 0, 0, 0].astype(float), images_b[:, 0, 0, 0].astype(float)
            CALLS.append(len(a))
            return (a / (a + b)).astype(np.float32)  # the brighter image is preferred, in proportion
        """
    )
    reward = make_reward("pairwise_win_rate", preference={"name": f"{path}:prefer"})
    wins = reward.score_group(_images([1, 3, 4]), ["p"] * 3, [{}] * 3)
    # P(0>1) = 1/4, P(0>2) = 1/5, P(1>2) = 3/7
    expected = [(1 / 4 + 1 / 5) / 2, (3 / 4 + 3 / 7) / 2, (4 / 5 + 4 / 7) / 2]
    np.testing.assert_allclose(wins, expected, rtol=1e-6)
    module = sys.modules[load_user_function(f"{path}:prefer").__module__]
    assert module.CALLS == [3]  # the three unordered pairs, in one call


def test_both_orders_averages_out_a_position_bias(user_fn):
    path = user_fn(
        """
        def first_wins(images_a, images_b, prompts, metadata):
            return np.full(len(images_a), 0.9, dtype=np.float32)  # always prefers the image shown first
        """
    )
    biased = make_reward("pairwise_win_rate", preference=f"{path}:first_wins")
    fair = make_reward("pairwise_win_rate", preference=f"{path}:first_wins", both_orders=True)
    images = _images([1, 2, 3])
    assert biased.score_group(images, ["p"] * 3, [{}] * 3).tolist() != [0.5] * 3
    np.testing.assert_allclose(fair.score_group(images, ["p"] * 3, [{}] * 3), [0.5, 0.5, 0.5])


def test_with_both_orders_a_pair_one_order_failed_keeps_the_other_verdict(user_fn):
    path = user_fn(
        """
        def fails_when_the_darker_is_first(images_a, images_b, prompts, metadata):
            a, b = images_a[:, 0, 0, 0].astype(float), images_b[:, 0, 0, 0].astype(float)
            return np.where(a < b, np.nan, 0.8).astype(np.float32)  # the brighter one, when shown first
        """
    )
    reward = make_reward("pairwise_win_rate", preference=f"{path}:fails_when_the_darker_is_first", both_orders=True)
    # every pair: the (darker, brighter) order fails; the (brighter, darker) order says the brighter wins with 0.8
    # win rates: darkest 0.2 against both; middle 0.8 and 0.2; brightest 0.8 against both
    np.testing.assert_allclose(reward.score_group(_images([1, 2, 3]), ["p"] * 3, [{}] * 3), [0.2, 0.5, 0.8])


def test_a_group_of_one_scores_one_half(pixel_reward):
    for name in ("rank", "pairwise_win_rate"):
        reward = make_reward(name, reward=f"{pixel_reward}:pixel")
        assert reward.score_group(_images([7]), ["p"], [{}]).tolist() == [0.5]


def test_preference_outside_0_1_is_a_bug_naming_it(user_fn):
    path = user_fn(
        """
        def scores_not_probabilities(images_a, images_b, prompts, metadata):
            return np.full(len(images_a), 3.0, dtype=np.float32)
        """
    )
    reward = make_reward("pairwise_win_rate", preference=f"{path}:scores_not_probabilities")
    with pytest.raises(RewardOutputError, match="scores_not_probabilities.*in \\[0, 1\\]"):
        reward.score_group(_images([1, 2]), ["p"] * 2, [{}] * 2)


def test_pairwise_win_rate_needs_exactly_one_source(pixel_reward):
    with pytest.raises(UserError, match="exactly one"):
        make_reward("pairwise_win_rate")
    with pytest.raises(UserError, match="no pairwise form"):
        make_reward("pairwise_win_rate", preference={"name": "jpeg_incompressibility"})
    with pytest.raises(UserError, match="unknown keys"):
        make_reward("rank", reward={"name": "jpeg_incompressibility", "kwarg": {}})


def test_a_group_the_reward_raises_on_fails_as_a_whole_and_the_others_score(user_fn):
    path = user_fn(
        """
        def picky(images, prompts, metadata):
            if prompts[0] == "bad":
                raise ValueError("cannot rank this group")
            return images[:, 0, 0, 0].astype(np.float32)
        """
    )
    combiner = RewardCombiner(
        [
            WeightedReward("rank", 1.0, make_reward("rank", reward=f"{path}:picky")),
            WeightedReward("pixel", 0.0, make_reward(f"{path}:picky")),
        ]
    )
    result = combiner(_images([1, 2, 3, 4]), ["bad", "bad", "ok", "ok"], [{}] * 4, group_index=[0, 0, 1, 1])
    assert result.failed.tolist() == [True, True, False, False]
    np.testing.assert_allclose(result.per_reward["rank"][2:], [0.0, 1.0])


def test_chunked_scoring_keeps_groups_whole(pixel_reward):
    """The trainer scores per-sample rewards chunk by chunk; the group reward sees whole groups in combine()."""
    combiner = RewardCombiner(
        [
            WeightedReward("rank", 1.0, make_reward("rank", reward=f"{pixel_reward}:pixel")),
            WeightedReward("pixel", 0.5, make_reward(f"{pixel_reward}:pixel")),
        ]
    )
    images = _images([3, 1, 2, 8, 6, 7])
    prompts, metadata, groups = ["a"] * 3 + ["b"] * 3, [{}] * 6, [0, 0, 0, 1, 1, 1]
    chunks = [combiner.score(images[s], prompts[s], metadata[s]) for s in (slice(0, 2), slice(2, 4), slice(4, 6))]
    assert all(set(chunk) == {"pixel"} for chunk in chunks)  # the chunks split both groups: no group reward there
    result = combiner.combine(chunks, metadata, images=images, prompts=prompts, group_index=groups)
    whole = combiner(images, prompts, metadata, group_index=groups)
    np.testing.assert_allclose(result.total, whole.total)
    np.testing.assert_allclose(result.per_reward["rank"], [1.0, 0.0, 0.5, 1.0, 0.0, 0.5])
    with pytest.raises(ValueError, match="need the whole batch"):
        combiner.combine(chunks, metadata)


def test_a_group_reward_in_ray_actors_is_refused_at_build_time():
    from diffusion_rl.config.data import RewardSpec
    from diffusion_rl.errors import UserError
    from diffusion_rl.rewards.build import build_combiner

    spec = RewardSpec(name="rank", kwargs={"reward": "jpeg_incompressibility"}, actors=2)
    with pytest.raises(UserError, match="rewards.0: 'rank' is a group reward and runs in the trainer process"):
        build_combiner([spec], lambda s: pytest.fail("must not be built"))


def test_the_console_shows_the_total_unless_every_weighted_reward_is_relative_to_its_group():
    from diffusion_rl.config import RewardSpec
    from diffusion_rl.rewards.build import console_rewards

    pairwise = RewardSpec(name="pairwise_win_rate", kwargs={"reward": "jpeg_compressibility"})
    monitor = RewardSpec(name="jpeg_compressibility", weight=0.0, label="jpeg")
    rank = RewardSpec(name="rank", weight=0.0, kwargs={"reward": "jpeg_compressibility"})
    assert console_rewards([pairwise, monitor, rank]) == [("reward/jpeg/mean", "jpeg")]
    assert console_rewards([pairwise]) == []  # nothing readable: no training reward in the line (val_reward is)
    assert console_rewards([pairwise, RewardSpec(name="jpeg_compressibility", weight=0.5)]) == [
        ("reward/mean", "reward")
    ]
