import pytest

from diffusion_rl.sampling.window import sliding_window, window_generator


def test_progressive_window_positions_over_20_steps():
    # num_steps 10, size 4 → max_start = 10 − 2 − 4 = 4; stride 2 → starts 0, 2, 4, then back to 0
    starts = [sliding_window(s, 10, 4, iters_per_window=3, stride=2, strategy="progressive").start for s in range(20)]
    expected = [0, 0, 0, 2, 2, 2, 4, 4, 4, 0, 0, 0, 2, 2, 2, 4, 4, 4, 0, 0]
    assert starts == expected


def test_progressive_window_never_truncates_and_stays_before_the_last_two_steps():
    for step in range(100):
        w = sliding_window(step, 12, 4, iters_per_window=1, stride=1, strategy="progressive")
        assert w.size == 4 and w.start + w.size <= 12 - 2


def test_random_window_is_uniform_over_valid_starts_and_reproducible():
    starts = {
        sliding_window(
            s, 10, 4, iters_per_window=25, stride=1, strategy="random", generator=window_generator(0, s)
        ).start
        for s in range(200)
    }
    assert starts == {0, 1, 2, 3, 4}
    a = sliding_window(7, 10, 4, iters_per_window=25, stride=1, strategy="random", generator=window_generator(3, 7))
    b = sliding_window(7, 10, 4, iters_per_window=25, stride=1, strategy="random", generator=window_generator(3, 7))
    assert a == b


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_steps=5, size=4, iters_per_window=1, stride=1, strategy="progressive"),
        dict(num_steps=10, size=4, iters_per_window=0, stride=1, strategy="progressive"),
        dict(num_steps=10, size=4, iters_per_window=1, stride=1, strategy="sideways"),
    ],
)
def test_invalid_sliding_windows_raise(kwargs):
    with pytest.raises(ValueError):
        sliding_window(0, **kwargs)
