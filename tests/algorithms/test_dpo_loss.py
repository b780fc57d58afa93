import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.preference.dpo import DpoInput, dpo_timesteps
from diffusion_rl.config.plugins import LOSSES

BETA = 2.0
# Two pairs of 2-element "latents". Per-sample error = mean of squared (v - u):
# pair 0: err_w = (1 + 0)/2 = 0.5, err_ref_w = (0.25 + 0.25)/2 = 0.25, err_l = 0, err_ref_l = (1 + 1)/2 = 1
# pair 1: err_w = (1 + 1)/2 = 1,   err_ref_w = 0,                    err_l = (4 + 0)/2 = 2, err_ref_l = 0
V_W = [[1.0, 0.0], [0.0, 0.0]]
V_L = [[0.0, 0.0], [2.0, 0.0]]
V_REF_W = [[0.5, 0.5], [1.0, 1.0]]
V_REF_L = [[1.0, 1.0], [0.0, 0.0]]
U_W = [[0.0, 0.0], [1.0, 1.0]]
U_L = [[0.0, 0.0], [0.0, 0.0]]


def _input(ref_requires_grad=False):
    return DpoInput(
        v_chosen=torch.tensor(V_W, requires_grad=True),
        v_rejected=torch.tensor(V_L, requires_grad=True),
        v_ref_chosen=torch.tensor(V_REF_W, requires_grad=ref_requires_grad),
        v_ref_rejected=torch.tensor(V_REF_L, requires_grad=ref_requires_grad),
        target_chosen=torch.tensor(U_W),
        target_rejected=torch.tensor(U_L),
    )


def _err(v, u):
    return sum((a - b) ** 2 for a, b in zip(v, u)) / len(v)


def _hand():
    rows = []
    for p in range(2):
        reward_w = -0.5 * BETA * (_err(V_W[p], U_W[p]) - _err(V_REF_W[p], U_W[p]))
        reward_l = -0.5 * BETA * (_err(V_L[p], U_L[p]) - _err(V_REF_L[p], U_L[p]))
        rows.append((reward_w, reward_l, reward_w - reward_l))
    return rows


def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_loss_and_metrics_match_hand_computation():
    rows = _hand()
    # inside = -beta/2 * [(0.5 - 0.25) - (0 - 1)] = -1.25  and  -beta/2 * [(1 - 0) - (2 - 0)] = 1
    assert [r[2] for r in rows] == pytest.approx([-1.25, 1.0])
    out = LOSSES.get("dpo")(_input(), SimpleNamespace(dpo_beta=BETA))
    expected = (math.log(1 + math.exp(1.25)) + math.log(1 + math.exp(-1.0))) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.metrics["dpo/implicit_acc"].item() == 0.5
    assert out.metrics["dpo/reward_chosen"].item() == pytest.approx((-0.25 - 1.0) / 2)
    assert out.metrics["dpo/reward_rejected"].item() == pytest.approx((1.0 - 2.0) / 2)
    assert out.metrics["dpo/margin"].item() == pytest.approx((-1.25 + 1.0) / 2)
    assert all(not v.requires_grad and v.ndim == 0 for v in out.metrics.values())


def test_gradient_lowers_chosen_error_and_raises_rejected_error():
    inp = _input(ref_requires_grad=True)
    LOSSES.get("dpo")(inp, SimpleNamespace(dpo_beta=BETA)).loss.backward()
    # d loss / d err_w = beta/2 * sigmoid(-inside) / P; d err / d v_j = 2 (v_j - u_j) / D
    # pair 0, chosen, element 0: (v - u) = 1, D = 2 -> beta/2 * sigmoid(1.25) / 2
    assert inp.v_chosen.grad[0, 0].item() == pytest.approx(0.5 * BETA * _sigmoid(1.25) / 2, rel=1e-6)
    # pair 1, rejected, element 0: (v - u) = 2, D = 2 -> -beta/2 * sigmoid(-1) * 2 / 2
    assert inp.v_rejected.grad[1, 0].item() == pytest.approx(-0.5 * BETA * _sigmoid(-1.0) * 2 / 2, rel=1e-6)
    # Descent moves v_chosen toward its target (grad has the sign of v - u) and v_rejected away from its own
    assert torch.all(inp.v_chosen.grad * (inp.v_chosen - inp.target_chosen) >= 0)
    assert torch.all(inp.v_rejected.grad * (inp.v_rejected - inp.target_rejected) <= 0)
    assert inp.v_ref_chosen.grad is None and inp.v_ref_rejected.grad is None


def test_equal_policy_and_reference_gives_log_2():
    inp = _input()
    inp.v_ref_chosen, inp.v_ref_rejected = inp.v_chosen.detach().clone(), inp.v_rejected.detach().clone()
    out = LOSSES.get("dpo")(inp, SimpleNamespace(dpo_beta=BETA))
    assert out.loss.item() == pytest.approx(math.log(2))
    assert out.metrics["dpo/implicit_acc"].item() == 0.0


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="target_rejected"):
        DpoInput(*(torch.zeros(2, 3) for _ in range(5)), target_rejected=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="v_chosen"):
        DpoInput(*(torch.zeros(2) for _ in range(6)))


def _sigmas(n=1000):
    # a shifted schedule (shift 3), descending from 1 as the scheduler stores it
    s = torch.linspace(1.0, 1.0 / n, n, dtype=torch.float64)
    return 3 * s / (1 + 2 * s)


def test_dpo_timesteps_follow_logit_normal_indices_and_are_reproducible():
    sigmas = _sigmas()
    t = dpo_timesteps(5, torch.Generator().manual_seed(7), sigmas)
    again = dpo_timesteps(5, torch.Generator().manual_seed(7), sigmas)
    assert torch.equal(t, again)
    assert not torch.equal(t, dpo_timesteps(5, torch.Generator().manual_seed(8), sigmas))
    # the same normal draws, mapped by hand: u = 1 / (1 + e^-n), index = floor(1000 u)
    normals = torch.randn(5, generator=torch.Generator().manual_seed(7), dtype=torch.float64).tolist()
    indices = [min(math.floor(1000 / (1 + math.exp(-n))), 999) for n in normals]
    assert t.tolist() == [sigmas[i].item() for i in indices]


def test_dpo_timesteps_stay_within_the_schedule_and_centre_on_it():
    sigmas = _sigmas()
    t = dpo_timesteps(20000, torch.Generator().manual_seed(0), sigmas)
    assert t.shape == (20000,) and t.dtype == sigmas.dtype
    assert torch.isin(t, sigmas).all()
    # logit-normal(0, 1) has median 1/2: the median index is ~500
    median_index = (sigmas[:, None] == t[None, :]).float().argmax(dim=0).median().item()
    assert abs(median_index - 500) < 20
    # P(u < 0.1) = Phi(logit(0.1)) = Phi(-2.197) ~ 0.014: the schedule's ends are rarely drawn
    assert ((t > sigmas[100]).float().mean().item()) == pytest.approx(0.014, abs=0.005)
