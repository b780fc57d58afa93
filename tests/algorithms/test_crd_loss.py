"""CRD's loss and gradient on fixed inputs against the formula written out as a plain loop over groups, members and
elements (Python floats); its timestep draw and its decay schedules."""

import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.preference.crd import CrdInput, CrdSettings, crd_timestep_indices, linear_decay
from diffusion_rl.config.plugins import LOSSES

# U = 2 groups of G = 3 rows, D = 2 elements a row
V = [[[0.5, -0.2], [0.1, 0.4], [-0.3, 0.9]], [[1.0, 0.0], [0.2, -0.6], [0.7, 0.3]]]
U_TARGET = [[[0.3, 0.1], [0.0, 0.2], [0.1, 0.5]], [[0.6, 0.2], [0.1, -0.1], [0.2, 0.4]]]
V_BASE = [[[0.45, -0.1], [0.05, 0.35], [-0.25, 0.85]], [[0.8, 0.1], [0.25, -0.55], [0.65, 0.35]]]
V_REF = [[[0.4, 0.0], [0.3, 0.3], [-0.1, 0.6]], [[0.9, 0.1], [0.0, -0.2], [0.4, 0.1]]]
ADV = [[1.2, -0.4, -0.8], [7.0, -2.0, -5.5]]  # group 1's 7 and -5.5 are clamped to ±5


def _cfg(**over):
    base = dict(crd_beta=1.0, loss_type="mse", adv_clip_max=5.0, adaptive_logp=True, weight_floor=1e-5, kl_beta=0.0,
                reward_adaptive_kl=True)  # fmt: skip
    return SimpleNamespace(**{**base, **over})


def _input(weights=None, v_ref=True):
    return CrdInput(
        v=torch.tensor(V, dtype=torch.float32, requires_grad=True),
        target=torch.tensor(U_TARGET),
        advantages=torch.tensor(ADV),
        v_base=torch.tensor(V_BASE),
        v_ref=torch.tensor(V_REF) if v_ref else None,
        weights=weights,
    )


def _mean(xs):
    return sum(xs) / len(xs)


def _expected(cfg, weights=(1.0, 1.0)):
    """(loss, d loss / d v) from the formula, one group, member and element at a time."""
    U, G, D = len(V), len(V[0]), len(V[0][0])
    beta, c = cfg.crd_beta, cfg.adv_clip_max
    loss, grad = 0.0, [[[0.0] * D for _ in range(G)] for _ in range(U)]
    for u in range(U):
        a, r, w = [], [], []
        for i in range(G):
            a.append(min(max(min(max(ADV[u][i], -c), c) / (2 * c) + 0.5, 0.0), 1.0))
            e = _mean([(V[u][i][d] - U_TARGET[u][i][d]) ** 2 for d in range(D)])
            e_base = _mean([(V_BASE[u][i][d] - U_TARGET[u][i][d]) ** 2 for d in range(D)])
            w_i, w_base = 1.0, 1.0
            if cfg.adaptive_logp:
                w_i = max(_mean([abs(V[u][i][d] - U_TARGET[u][i][d]) for d in range(D)]), cfg.weight_floor)
                w_base = max(_mean([abs(V_BASE[u][i][d] - U_TARGET[u][i][d]) for d in range(D)]), cfg.weight_floor)
            r.append(-(e / w_i - e_base / w_base))
            w.append(w_i)
        a_mean, r_mean = _mean(a), _mean(r)
        for i in range(G):
            R, rho = a[i] - a_mean, r[i] - r_mean
            if cfg.loss_type == "bce":
                x, y = beta * rho, 1 / (1 + math.exp(-R))
                term = max(x, 0) - x * y + math.log1p(math.exp(-abs(x)))
                d_term = 1 / (1 + math.exp(-x)) - y  # d term / d x
            else:
                term, d_term = (beta * rho - R) ** 2, 2 * (beta * rho - R)
            loss += weights[u] * c / beta * term / (U * G)
            kl_weight = 0.0
            if cfg.kl_beta > 0:
                m = 1e-4 / cfg.kl_beta
                kl_weight = cfg.kl_beta * ((m + a[i] * (1 - m)) if cfg.reward_adaptive_kl else 1.0)
                kl = _mean([(V[u][i][d] - V_REF[u][i][d]) ** 2 for d in range(D)])
                loss += weights[u] * kl_weight * kl / (U * G)
            for d in range(D):
                # ρ_i's gradient is r_i's (the group mean is detached); r_i = −e_i / w_i, w_i detached
                d_r = -2 * (V[u][i][d] - U_TARGET[u][i][d]) / (D * w[i])
                g = c / beta * d_term * beta * d_r + kl_weight * 2 * (V[u][i][d] - V_REF[u][i][d]) / D
                grad[u][i][d] = weights[u] * g / (U * G)
    return loss, grad


@pytest.mark.parametrize(
    "over",
    [{}, {"adaptive_logp": False}, {"crd_beta": 2.5, "adv_clip_max": 3.0}, {"loss_type": "bce", "crd_beta": 4.0},
     {"kl_beta": 0.1}, {"kl_beta": 0.3, "reward_adaptive_kl": False}],
    ids=["plain", "not_adaptive", "beta_clip", "bce", "adaptive_kl", "plain_kl"],
)  # fmt: skip
def test_loss_and_gradient_match_the_formula_as_a_loop(over):
    cfg = _cfg(**over)
    inp = _input()
    out = LOSSES.get("crd")(inp, cfg)
    loss, grad = _expected(cfg)
    assert out.loss.item() == pytest.approx(loss, rel=1e-5, abs=1e-8)
    out.loss.backward()
    assert inp.v.grad.tolist() == [[pytest.approx(row, rel=1e-4, abs=1e-8) for row in group] for group in grad]


def test_only_differences_within_a_group_count():
    """Centering: shifting a group's advantages by one constant (inside the clamp) changes nothing, and a group of
    equal advantages whose errors equal the baseline's has no loss."""
    cfg = _cfg()
    shifted = _input()
    shifted.advantages = shifted.advantages + torch.tensor([[1.0], [0.0]])  # group 0: 2.2, 0.6, 0.2, within ±5
    base = LOSSES.get("crd")(_input(), cfg).loss.item()
    assert LOSSES.get("crd")(shifted, cfg).loss.item() == pytest.approx(base, rel=1e-6)
    same = _input()
    same.advantages = torch.full((2, 3), 0.7)
    same.v_base = same.v.detach().clone()
    assert LOSSES.get("crd")(same, cfg).loss.item() == pytest.approx(0.0, abs=1e-12)


def test_a_padding_group_adds_nothing_but_stays_in_the_mean():
    cfg = _cfg(kl_beta=0.1)
    inp = _input(weights=torch.tensor([1.0, 0.0]))
    out = LOSSES.get("crd")(inp, cfg)
    loss, grad = _expected(cfg, weights=(1.0, 0.0))
    assert out.loss.item() == pytest.approx(loss, rel=1e-5)
    out.loss.backward()
    assert inp.v.grad[1].abs().max().item() == 0.0
    assert inp.v.grad[0].tolist() == [pytest.approx(row, rel=1e-4, abs=1e-8) for row in grad[0]]


def test_missing_reference_and_bad_shapes_are_errors():
    with pytest.raises(ValueError, match="kl_beta > 0 needs v_ref"):
        LOSSES.get("crd")(_input(v_ref=False), _cfg(kl_beta=0.1))
    with pytest.raises(ValueError, match=r"advantages must be \[U, G\]"):
        CrdInput(v=torch.zeros(2, 3, 4), target=torch.zeros(2, 3, 4), advantages=torch.zeros(6),
                 v_base=torch.zeros(2, 3, 4))  # fmt: skip
    with pytest.raises(ValueError, match="v_base"):
        CrdInput(v=torch.zeros(2, 3, 4), target=torch.zeros(2, 3, 4), advantages=torch.zeros(2, 3),
                 v_base=torch.zeros(2, 3, 5))  # fmt: skip


def test_reward_adaptive_kl_below_its_floor_is_refused():
    with pytest.raises(ValueError, match="kl_beta ≥ 0.0001"):
        CrdSettings(kl_beta=1e-5)
    CrdSettings(kl_beta=1e-5, reward_adaptive_kl=False)
    CrdSettings(kl_beta=0.0)


def test_timestep_indices_are_stratified_over_the_range():
    sigmas = torch.linspace(1, 0, 11)[:10]  # 1.0, 0.9, …, 0.1: every index within timestep_range 0.99
    draws = [crd_timestep_indices(sigmas, 0.99, 20, torch.Generator().manual_seed(s)).tolist() for s in range(200)]
    for picks in draws:
        # 20 strata of linspace(0, 9, 21): stratum j spans ⌊0.45 j⌋..⌊0.45 (j + 1)⌋, its upper end never drawn
        for j, p in enumerate(picks):
            lower, upper = math.floor(0.45 * j), math.floor(0.45 * (j + 1))
            assert p == lower if upper == lower else lower <= p < upper
    assert {p for picks in draws for p in picks} == set(range(9))  # index 9 (σ 0.1) never: the authors' edge
    # timestep_range 0.5 keeps σ ≥ 0.5: indices 0..5, so the draws stay in 0..4
    kept = crd_timestep_indices(sigmas, 0.5, 5, torch.Generator().manual_seed(0)).tolist()
    assert kept == [0, 1, 2, 3, 4]


def test_decay_schedules_are_the_authors_presets():
    # `old`: 0.25 + 0.005·n up to 0.999; `sampling`: a copy for 75 steps, then 0.0075·(n − 75) up to 0.999
    assert [linear_decay(n, 0, 0.25, 0.005, 0.999) for n in (0, 1, 100, 200)] == pytest.approx(
        [0.25, 0.255, 0.75, 0.999]
    )
    assert [linear_decay(n, 75, 0.0, 0.0075, 0.999) for n in (1, 74, 75, 100, 300)] == pytest.approx(
        [0.0, 0.0, 0.0, 0.1875, 0.999]
    )
    with pytest.raises(ValueError, match="step must be >= 0"):
        linear_decay(-1, 0, 0.25, 0.005, 0.999)
