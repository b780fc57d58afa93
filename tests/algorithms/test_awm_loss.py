import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.preference.awm import AwmInput, awm_log_p, awm_timestep_indices
from diffusion_rl.config.plugins import LOSSES

CLIP = 0.2
# row 0: mse = (1 + 0)/2 = 0.5 at t = 0.25; row 1: mse = (1 + 4)/2 = 2.5 at t = 0.8
V = [[1.0, 0.0], [1.0, -1.0]]
U = [[0.0, 0.0], [0.0, 1.0]]
T = [0.25, 0.8]
MSE = [0.5, 2.5]
# row 0: ratio e^0.1, inside [0.8, 1.2]; row 1: ratio e^0.5 above 1.2 with A > 0 -> clipped
LOG_RATIOS = [0.1, 0.5]
ADV = [1.0, 3.0]  # clamped to +-2, divided by 2, times advantage_max 1 -> 0.5, 1.0


def _hand_log_p(mse, t, weighting):
    if weighting == "uniform":
        return -mse
    if weighting == "t":
        return -t * mse
    p = 0.25
    return -t * ((mse + 1e-10) ** p - (1e-10) ** p) / p


def _cfg(weighting="uniform", kl_beta=0.0, ema_beta=0.0, clip_range=CLIP):
    return SimpleNamespace(
        clip_range=clip_range,
        adv_clip_max=2.0,
        advantage_max=1.0,
        weighting=weighting,
        kl_beta=kl_beta,
        ema_beta=ema_beta,
    )


def _input(weighting="uniform", v_ref=None, v_ema=None):
    old = [_hand_log_p(m, t, weighting) - lr for m, t, lr in zip(MSE, T, LOG_RATIOS)]
    return AwmInput(
        v=torch.tensor(V, requires_grad=True),
        target=torch.tensor(U),
        t=torch.tensor(T),
        log_p_old=torch.tensor(old, dtype=torch.float64),
        advantages=torch.tensor(ADV),
        v_ref=v_ref,
        v_ema=v_ema,
    )


def test_log_p_weightings_match_hand_computation():
    mse, t = torch.tensor([0.5, 2.0], dtype=torch.float64), torch.tensor([0.25, 0.8], dtype=torch.float64)
    assert awm_log_p(mse, t, "uniform").tolist() == [-0.5, -2.0]
    assert awm_log_p(mse, t, "t").tolist() == pytest.approx([-0.125, -1.6])
    # ghuber, p = 1/4: -t * 4 * ((mse + 1e-10)^(1/4) - 1e-10^(1/4)); 1e-10^(1/4) = 10^-2.5
    expected = [-0.25 * 4 * (0.5**0.25 - 10**-2.5), -0.8 * 4 * (2.0**0.25 - 10**-2.5)]
    assert awm_log_p(mse, t, "ghuber").tolist() == pytest.approx(expected, rel=1e-8)
    assert awm_log_p(mse, t, "t").dtype == torch.float64
    with pytest.raises(ValueError, match="uniform, t, ghuber"):
        awm_log_p(mse, t, "huber")


@pytest.mark.parametrize("weighting", ["uniform", "t", "ghuber"])
def test_loss_with_one_clipped_and_one_unclipped_row(weighting):
    inp = _input(weighting)
    out = LOSSES.get("awm")(inp, _cfg(weighting))
    # row 0: -0.5 * e^0.1 (unclipped); row 1: max(-1 * e^0.5, -1 * 1.2) = -1.2
    expected = (-0.5 * math.exp(0.1) - 1.2) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.metrics["awm/clip_fraction"].item() == 0.5
    assert out.metrics["awm/ratio_mean"].item() == pytest.approx((math.exp(0.1) + math.exp(0.5)) / 2, rel=1e-6)
    assert out.metrics["awm/mse"].item() == pytest.approx(1.5)
    assert out.metrics["kl_ref"].item() == 0.0 and out.metrics["awm/ema_gap"].item() == 0.0

    out.loss.backward()
    assert inp.v.grad[1].tolist() == [0.0, 0.0]  # the clipped row carries no gradient
    # row 0: d/dv of -A^ * exp(log p - old) / N, d log p / d mse = -w'(mse, t), d mse / d v_j = 2 (v_j - u_j) / D
    t0, mse0 = T[0], MSE[0]
    dlogp_dmse = {"uniform": -1.0, "t": -t0, "ghuber": -t0 * (mse0 + 1e-10) ** -0.75}[weighting]
    dmse_dv = [2 * (a - b) / 2 for a, b in zip(V[0], U[0])]
    expected_grad = [-0.5 * math.exp(0.1) * dlogp_dmse * d / 2 for d in dmse_dv]
    assert inp.v.grad[0].tolist() == pytest.approx(expected_grad, rel=1e-5)
    # A > 0: descent lowers row 0's error (the gradient has the sign of v - u)
    assert inp.v.grad[0, 0].item() > 0


def test_negative_advantage_clips_below():
    inp = _input()
    inp.advantages = torch.tensor([-1.0, 1.0])
    inp.log_p_old = torch.tensor([_hand_log_p(m, 0.0, "uniform") + 0.5 for m in MSE], dtype=torch.float64)
    out = LOSSES.get("awm")(inp, _cfg())
    # both ratios e^-0.5 < 0.8: row 0 (A^ = -0.5) takes max(0.5 e^-0.5, 0.5 * 0.8) = 0.4 (clipped);
    # row 1 (A^ = 0.5) takes max(-0.5 e^-0.5, -0.4) = -0.5 e^-0.5 (unclipped: the pessimistic side)
    assert out.loss.item() == pytest.approx((0.4 - 0.5 * math.exp(-0.5)) / 2, rel=1e-6)


def test_on_policy_ratio_is_one():
    inp = _input("ghuber")
    with torch.no_grad():
        mse = ((inp.v.double() - inp.target.double()) ** 2).mean(dim=1)
        inp.log_p_old = awm_log_p(mse, inp.t, "ghuber")
    out = LOSSES.get("awm")(inp, _cfg("ghuber"))
    assert out.metrics["awm/ratio_mean"].item() == 1.0
    assert out.loss.item() == pytest.approx(-(0.5 + 1.0) / 2)


def test_reference_and_ema_terms():
    v_ref = torch.tensor([[0.0, 0.0], [1.0, 1.0]])  # gaps (1 + 0)/2 = 0.5, (0 + 4)/2 = 2
    v_ema = torch.tensor([[1.0, 1.0], [0.0, -1.0]])  # gaps (0 + 1)/2 = 0.5, (1 + 0)/2 = 0.5
    inp = _input(v_ref=v_ref, v_ema=v_ema)
    out = LOSSES.get("awm")(inp, _cfg(kl_beta=0.1, ema_beta=2.0))
    policy = (-0.5 * math.exp(0.1) - 1.2) / 2
    assert out.loss.item() == pytest.approx(policy + 0.1 * 1.25 + 2.0 * 0.5, rel=1e-6)
    assert out.metrics["kl_ref"].item() == pytest.approx(1.25)
    assert out.metrics["awm/ema_gap"].item() == pytest.approx(0.5)
    assert out.metrics["awm/policy_loss"].item() == pytest.approx(policy, rel=1e-6)
    out.loss.backward()
    # the clipped row 1 only feels the two gaps: 0.1 * 2 (v - ref) / D / N + 2.0 * 2 (v - ema) / D / N
    assert inp.v.grad[1, 1].item() == pytest.approx(0.1 * 2 * (-2.0) / 2 / 2 + 2.0 * 2 * 0.0 / 2 / 2)
    assert inp.v.grad[1, 0].item() == pytest.approx(0.1 * 2 * 0.0 / 2 / 2 + 2.0 * 2 * 1.0 / 2 / 2)


def test_missing_reference_or_ema_is_an_error():
    with pytest.raises(ValueError, match="v_ref"):
        LOSSES.get("awm")(_input(), _cfg(kl_beta=0.1))
    with pytest.raises(ValueError, match="v_ema"):
        LOSSES.get("awm")(_input(), _cfg(ema_beta=0.1))


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="log_p_old"):
        AwmInput(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.zeros(3), torch.zeros(2))


# -- timestep indices ------------------------------------------------------------------------------------------
def _strata(train_steps, k):
    # candidates 1 .. train_steps - 1 split by integer edges 1 + floor(j * M / K)
    m = train_steps - 1
    edges = [1 + (j * m) // k for j in range(k + 1)]
    return [list(range(edges[j], edges[j + 1])) for j in range(k)]


def test_strata_when_k_does_not_divide():
    # train_steps 10 -> M = 9 candidates 1..9, K = 6: edges 1, 2, 4, 5, 7, 8, 10
    assert _strata(10, 6) == [[1], [2, 3], [4], [5, 6], [7], [8, 9]]
    seen = [set() for _ in range(6)]
    for seed in range(300):
        idx = awm_timestep_indices(6, 10, torch.Generator().manual_seed(seed))
        assert idx.dtype == torch.long and idx.shape == (6,)
        for j, i in enumerate(idx.tolist()):
            seen[j].add(i)
    assert [sorted(s) for s in seen] == _strata(10, 6)


def test_strata_when_k_divides_and_when_k_fills_every_index():
    assert _strata(13, 6) == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]
    for seed in range(20):
        idx = awm_timestep_indices(6, 13, torch.Generator().manual_seed(seed)).tolist()
        assert all(i in s for i, s in zip(idx, _strata(13, 6)))
    assert awm_timestep_indices(9, 10, torch.Generator()).tolist() == list(range(1, 10))


def test_timestep_indices_are_reproducible_and_exclude_pure_noise():
    a = awm_timestep_indices(3, 14, torch.Generator().manual_seed(5))
    assert torch.equal(a, awm_timestep_indices(3, 14, torch.Generator().manual_seed(5)))
    for seed in range(100):
        idx = awm_timestep_indices(1, 12, torch.Generator().manual_seed(seed)).tolist()
        assert 1 <= idx[0] <= 11


def test_too_many_timesteps_is_an_error():
    with pytest.raises(ValueError, match="train_timesteps"):
        awm_timestep_indices(6, 6, torch.Generator())  # only 1..5
    with pytest.raises(ValueError, match="train_timesteps"):
        awm_timestep_indices(0, 10, torch.Generator())
