"""TDM-R1's loss and gradient on fixed inputs against the formula written out as a plain loop over groups, rows and
elements (Python floats; the G×G ridge solve by Cramer's rule), and the direction of its surrogate's ascent."""

import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.base import LOSSES
from diffusion_rl.algorithms.preference.tdm_r1 import TdmR1Input, surrogate_direction

# U = 2 groups of G = 3 rows, D = 2 elements a row
V = [[[0.5, -0.2], [0.1, 0.4], [-0.3, 0.9]], [[1.0, 0.0], [0.2, -0.6], [0.7, 0.3]]]
V_REF = [[[0.4, 0.0], [0.3, 0.3], [-0.1, 0.6]], [[0.9, 0.1], [0.0, -0.2], [0.4, 0.1]]]
NEXT = [[[0.3, 0.1], [0.0, 0.2], [0.1, 0.5]], [[0.6, 0.2], [0.1, -0.1], [0.2, 0.4]]]
ADV = [[1.2, -0.4, -0.8], [7.0, -2.0, -5.5]]  # group 1's 7 and -5.5 are clamped to ±5


def _cfg(**over):
    return SimpleNamespace(**{**dict(push=0.7, kl_beta=0.3, ridge=0.1, adv_clip_max=5.0), **over})


def _input(weights=None, v_ref=True, adv=ADV):
    return TdmR1Input(
        v=torch.tensor(V, dtype=torch.float32, requires_grad=True),
        next_states=torch.tensor(NEXT),
        advantages=torch.tensor(adv),
        v_ref=torch.tensor(V_REF) if v_ref else None,
        weights=weights,
    )


def _det3(m):
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))  # fmt: skip


def _direction(u, ridge, c):
    """d of group u: −b/rms(b), b = Yᵀ (YYᵀ + ρ·tr/G·I)⁻¹ a, by loops."""
    G, D = 3, 2
    a = [max(-c, min(c, x)) for x in ADV[u]]
    a = [x - sum(a) / G for x in a]
    mean = [sum(NEXT[u][j][e] for j in range(G)) / G for e in range(D)]
    Y = [[NEXT[u][j][e] - mean[e] for e in range(D)] for j in range(G)]
    gram = [[sum(Y[i][e] * Y[j][e] for e in range(D)) for j in range(G)] for i in range(G)]
    lam = ridge * sum(gram[i][i] for i in range(G)) / G
    m = [[gram[i][j] + (lam if i == j else 0.0) for j in range(G)] for i in range(G)]
    det = _det3(m)
    coef = []
    for k in range(G):  # Cramer: column k replaced by a
        mk = [[a[i] if j == k else m[i][j] for j in range(G)] for i in range(G)]
        coef.append(_det3(mk) / det)
    b = [sum(coef[j] * Y[j][e] for j in range(G)) for e in range(D)]
    rms = math.sqrt(sum(x * x for x in b) / D)
    return [-x / rms for x in b]


def _expected(cfg, weights=None, v_ref=True):
    """loss and ∂loss/∂v by the formula, one group, row and element at a time."""
    U, G, D = 2, 3, 2
    w = weights or [1.0] * U
    total, grad = 0.0, [[[0.0] * D for _ in range(G)] for _ in range(U)]
    for u in range(U):
        d = _direction(u, cfg.ridge, cfg.adv_clip_max)
        group = 0.0
        for j in range(G):
            delta = [V[u][j][e] - (V_REF[u][j][e] if v_ref else V[u][j][e]) for e in range(D)]
            kl = sum(x * x for x in delta) / D
            push = sum(d[e] * delta[e] for e in range(D)) / D
            group += cfg.kl_beta / 2 * kl - cfg.push * push
            for e in range(D):
                grad[u][j][e] = w[u] / U / G * (cfg.kl_beta * delta[e] - cfg.push * d[e]) / D
        total += w[u] * group / G
    return total / U, grad


@pytest.mark.parametrize("weights", [None, [1.0, 0.0]], ids=["all", "padded-group"])
def test_loss_and_gradient_match_the_formula(weights):
    cfg = _cfg()
    inp = _input(None if weights is None else torch.tensor(weights))
    out = LOSSES.get("tdm_r1")(inp, cfg)
    out.loss.backward()
    loss, grad = _expected(cfg, weights)
    assert out.loss.item() == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert torch.allclose(inp.v.grad, torch.tensor(grad), rtol=1e-5, atol=1e-7)


def test_without_kl_the_push_alone_trains():
    cfg = _cfg(kl_beta=0.0)
    inp = _input(v_ref=False)
    out = LOSSES.get("tdm_r1")(inp, cfg)
    out.loss.backward()
    loss, grad = _expected(cfg, v_ref=False)
    assert out.loss.item() == loss == 0.0  # the anchor is the policy's own detached velocity
    assert torch.allclose(inp.v.grad, torch.tensor(grad), rtol=1e-5, atol=1e-8)
    assert out.metrics["kl_ref"].item() == 0


def test_kl_needs_the_reference():
    with pytest.raises(ValueError, match="needs v_ref"):
        LOSSES.get("tdm_r1")(_input(v_ref=False), _cfg())


def test_the_ascent_moves_the_next_state_towards_the_better_sample():
    # two rows: the better one's next state is y1; an Euler step y = x + (σ' − σ)·v, σ' < σ, moves y by −|Δσ|·v, so
    # the velocity's ascent direction points from y1 back to y0
    y = torch.tensor([[[0.0, 0.0], [2.0, -1.0]]])
    d = surrogate_direction(y, torch.tensor([[-1.0, 1.0]]), ridge=0.1, c=5.0)
    expected = -(y[0, 1] - y[0, 0]) / (y[0, 1] - y[0, 0]).pow(2).mean().sqrt()
    assert torch.allclose(d[0], expected, atol=1e-6)


def test_a_group_whose_rewards_tie_is_not_pushed():
    adv = [[0.5, 0.5, 0.5], ADV[1]]
    out = LOSSES.get("tdm_r1")(_input(adv=adv), _cfg())
    assert out.metrics["tdm_r1/tied_groups"].item() == pytest.approx(0.5)
    d = surrogate_direction(torch.tensor(NEXT), torch.tensor(adv), ridge=0.1, c=5.0)
    assert d[0].abs().max().item() == 0 and d[1].abs().max().item() > 0
