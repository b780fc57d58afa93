import pytest

from diffusion_rl.algorithms.preference.base import ramped_decay
from diffusion_rl.algorithms.preference.nft import old_decay

STEPS = [0, 1, 74, 75, 76, 100, 200]


def test_copy_is_always_zero():
    assert [old_decay(s, "copy") for s in STEPS] == [0.0] * len(STEPS)


def test_linear_to_half():
    # min(0.001 * step, 0.5)
    expected = [0.0, 0.001, 0.074, 0.075, 0.076, 0.1, 0.2]
    assert [old_decay(s, "linear_to_0_5") for s in STEPS] == pytest.approx(expected)
    assert old_decay(500, "linear_to_0_5") == pytest.approx(0.5)
    assert old_decay(10_000, "linear_to_0_5") == 0.5


def test_delayed_linear_to_0_999():
    # 0 before step 75, then min((step - 75) * 0.0075, 0.999): 76 -> 0.0075, 100 -> 25 * 0.0075, 200 -> 125 * 0.0075
    expected = [0.0, 0.0, 0.0, 0.0, 0.0075, 0.1875, 0.9375]
    assert [old_decay(s, "delayed_linear_to_0_999") for s in STEPS] == pytest.approx(expected)
    assert old_decay(208, "delayed_linear_to_0_999") == pytest.approx(0.9975)
    assert old_decay(209, "delayed_linear_to_0_999") == 0.999  # 134 * 0.0075 = 1.005, capped


def test_schedules_never_decrease_and_stay_below_one_over_the_first_steps():
    for kind in ("copy", "linear_to_0_5", "delayed_linear_to_0_999"):
        values = [old_decay(s, kind) for s in range(300)]
        assert all(0.0 <= v < 1.0 for v in values)
        assert all(a <= b for a, b in zip(values, values[1:]))


def test_fixed_decay():
    assert [old_decay(s, "fixed", fixed=0.9) for s in STEPS] == [0.9] * len(STEPS)
    with pytest.raises(ValueError, match="fixed"):
        old_decay(0, "fixed")
    with pytest.raises(ValueError, match="fixed"):
        old_decay(0, "fixed", fixed=1.5)
    with pytest.raises(ValueError, match="fixed"):
        old_decay(0, "copy", fixed=0.5)


def test_unknown_kind_lists_the_known_ones():
    with pytest.raises(ValueError, match="copy, linear_to_0_5, delayed_linear_to_0_999, fixed"):
        old_decay(0, "linear")
    with pytest.raises(ValueError, match="step"):
        old_decay(-1, "copy")


def test_ramped_decay_of_the_closely_following_ema_adapters():
    # min(0.3, 0.001 * step)
    expected = [0.0, 0.001, 0.074, 0.075, 0.076, 0.1, 0.2]
    assert [ramped_decay(s) for s in STEPS] == pytest.approx(expected)
    assert ramped_decay(300) == pytest.approx(0.3)
    assert ramped_decay(5000) == 0.3
