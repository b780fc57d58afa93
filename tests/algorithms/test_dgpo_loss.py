"""DGPO's loss and gradient on fixed inputs against the formula written out as a plain loop over groups, members and
elements (Python floats), and the claim that its policy term is the gradient of the group preference loss over β."""

import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.preference.dgpo import DgpoInput, dgpo_timestep_indices
from diffusion_rl.config.plugins import LOSSES
from diffusion_rl.models.guidance import GuidanceCost

# U = 2 groups of G = 3 rows, D = 2 elements a row
V = [[[0.5, -0.2], [0.1, 0.4], [-0.3, 0.9]], [[1.0, 0.0], [0.2, -0.6], [0.7, 0.3]]]
U_TARGET = [[[0.3, 0.1], [0.0, 0.2], [0.1, 0.5]], [[0.6, 0.2], [0.1, -0.1], [0.2, 0.4]]]
V_REF = [[[0.4, 0.0], [0.3, 0.3], [-0.1, 0.6]], [[0.9, 0.1], [0.0, -0.2], [0.4, 0.1]]]
V_OLD = [[[0.45, -0.1], [0.05, 0.35], [-0.25, 0.85]], [[0.8, 0.1], [0.25, -0.55], [0.65, 0.35]]]
ADV = [[1.2, -0.4, -0.8], [7.0, -2.0, -5.5]]  # group 1's 7 and -5.5 are clamped to ±5


def _cfg(**over):
    base = dict(dpo_beta=100.0, adv_clip_max=5.0, kl_beta=0.0, clip=False, clip_range=0.01, clip_kl=False,
                ema_reference=False)  # fmt: skip
    return SimpleNamespace(**{**base, **over})


def _input(weights=None):
    return DgpoInput(
        v=torch.tensor(V, dtype=torch.float32, requires_grad=True),
        target=torch.tensor(U_TARGET),
        advantages=torch.tensor(ADV),
        v_ref=torch.tensor(V_REF),
        v_old=torch.tensor(V_OLD),
        weights=weights,
    )


def _err(a, b):
    return sum((x - y) ** 2 for x, y in zip(a, b)) / len(a)


def _expected(cfg, weights=(1.0, 1.0)):
    """(loss, d loss / d v, clipped rows) from the formula, one group, member and element at a time."""
    U, G, D = len(V), len(V[0]), len(V[0][0])
    c, eps = cfg.adv_clip_max, cfg.clip_range
    loss, grad, stopped = 0.0, [[[0.0] * D for _ in range(G)] for _ in range(U)], []
    for u in range(U):
        reference = V_OLD[u] if cfg.ema_reference else V_REF[u]
        adv = [min(max(a, -c), c) for a in ADV[u]]
        s = 0.0
        for i in range(G):
            s += adv[i] * (_err(V[u][i], U_TARGET[u][i]) - _err(reference[i], U_TARGET[u][i]))
        s *= cfg.dpo_beta / G
        w = 1 / (1 + math.exp(-s))
        for i in range(G):
            e = _err(V[u][i], U_TARGET[u][i])
            ratio = math.exp(_err(V_OLD[u][i], U_TARGET[u][i]) - e)
            stop = (ratio > 1 + eps) if adv[i] > 0 else (ratio < 1 - eps)
            stopped.append(stop)
            kl = _err(V[u][i], V_REF[u][i])
            loss += weights[u] * (w * adv[i] * e + cfg.kl_beta * kl) / (U * G)
            for d in range(D):
                g = 0.0
                if not (cfg.clip and stop):
                    g += w * adv[i] * 2 * (V[u][i][d] - U_TARGET[u][i][d]) / D
                if not (cfg.clip_kl and stop):
                    g += cfg.kl_beta * 2 * (V[u][i][d] - V_REF[u][i][d]) / D
                grad[u][i][d] = weights[u] * g / (U * G)
    return loss, grad, stopped


@pytest.mark.parametrize(
    "over",
    [{}, {"clip": True}, {"clip": True, "clip_range": 0.002}, {"kl_beta": 0.3, "clip": True, "clip_kl": True},
     {"ema_reference": True, "dpo_beta": 10.0}],
    ids=["plain", "clip", "clip_tight", "kl_clipped", "ema_reference"],
)  # fmt: skip
def test_loss_and_gradient_match_the_formula_as_a_loop(over):
    cfg = _cfg(**over)
    inp = _input()
    out = LOSSES.get("dgpo")(inp, cfg)
    loss, grad, stopped = _expected(cfg)
    assert out.loss.item() == pytest.approx(loss, rel=1e-5, abs=1e-8)
    out.loss.backward()
    assert inp.v.grad.tolist() == [[pytest.approx(row, rel=1e-4, abs=1e-8) for row in group] for group in grad]
    clipping = cfg.clip or cfg.clip_kl
    assert out.metrics["dgpo/clip_fraction"].item() == pytest.approx(sum(stopped) / 6 if clipping else 0.0)


def test_the_clip_stops_some_rows_and_not_others():
    """The fixture is a real check of the clip: at ε = 0.002 some rows stop and some do not."""
    _, _, stopped = _expected(_cfg(clip=True, clip_range=0.002))
    assert 0 < sum(stopped) < 6


def test_the_policy_term_is_the_group_preference_gradient_over_beta():
    """Without clip: ∂ loss = (1/β) ∂ mean_groups −log σ(−s(θ)), s = β/G Σ Â (e − e_ref) taken with gradient."""
    beta = 100.0
    inp = _input()
    LOSSES.get("dgpo")(inp, _cfg(dpo_beta=beta)).loss.backward()
    v = torch.tensor(V, dtype=torch.float64, requires_grad=True)
    e = ((v - torch.tensor(U_TARGET, dtype=torch.float64)) ** 2).mean(dim=2)
    e_ref = ((torch.tensor(V_REF, dtype=torch.float64) - torch.tensor(U_TARGET, dtype=torch.float64)) ** 2).mean(dim=2)
    s = beta / 3 * (torch.tensor(ADV, dtype=torch.float64).clamp(-5, 5) * (e - e_ref)).sum(dim=1)
    (-torch.nn.functional.logsigmoid(-s).mean() / beta).backward()
    torch.testing.assert_close(inp.v.grad.double(), v.grad, rtol=1e-4, atol=1e-9)


def test_a_padding_group_adds_nothing_but_stays_in_the_mean():
    cfg = _cfg(clip=True, kl_beta=0.1)
    inp = _input(weights=torch.tensor([1.0, 0.0]))
    out = LOSSES.get("dgpo")(inp, cfg)
    loss, grad, _ = _expected(cfg, weights=(1.0, 0.0))
    assert out.loss.item() == pytest.approx(loss, rel=1e-5)
    out.loss.backward()
    assert inp.v.grad[1].abs().max().item() == 0.0
    assert inp.v.grad[0].tolist() == [pytest.approx(row, rel=1e-4, abs=1e-8) for row in grad[0]]


def test_missing_velocities_are_errors():
    inp = _input()
    inp.v_old = None
    with pytest.raises(ValueError, match="v_old"):
        LOSSES.get("dgpo")(inp, _cfg(clip=True))
    with pytest.raises(ValueError, match="reference velocity"):
        LOSSES.get("dgpo")(inp, _cfg(ema_reference=True))
    inp = _input()
    inp.v_ref = None
    with pytest.raises(ValueError, match="kl_beta"):
        LOSSES.get("dgpo")(inp, _cfg(kl_beta=0.1, ema_reference=True))


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"advantages must be \[U, G\]"):
        DgpoInput(v=torch.zeros(2, 3, 4), target=torch.zeros(2, 3, 4), advantages=torch.zeros(6))
    with pytest.raises(ValueError, match="at least 3 dims"):
        DgpoInput(v=torch.zeros(6, 4), target=torch.zeros(6, 4), advantages=torch.zeros(6, 1))


def test_timestep_indices_are_distinct_and_cover_the_high_noise_end_uniformly():
    counts = [0] * 7
    for seed in range(700):
        picks = dgpo_timestep_indices(10, 0.6, 4, torch.Generator().manual_seed(seed)).tolist()
        assert len(set(picks)) == 4 and all(0 <= p <= 6 for p in picks)  # DGPO's range(trunc_steps + 1), 6 of 10
        for p in picks:
            counts[p] += 1
    assert all(abs(n / 700 - 4 / 7) < 0.07 for n in counts)  # each index in 4 of 7 draws
    # the last index is never the clean σ = 0 end: fraction 1 stops at num_steps − 1
    assert sorted(dgpo_timestep_indices(4, 1.0, 4, torch.Generator().manual_seed(0)).tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"from 0\.\.2"):
        dgpo_timestep_indices(4, 0.6, 4, torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("over", "reference", "frozen"),
    [({}, True, 2), ({"clip": False}, True, 1), ({"reference_guidance": 4.5}, True, 3),
     ({"ema_reference": True}, False, 1), ({"ema_reference": True, "kl_beta": 0.1}, True, 2)],
)  # fmt: skip
def test_what_estimate_counts(over, reference, frozen):
    """Frozen forwards per trained call: the reference (two rows when guided with true CFG; one when the model embeds
    or ignores the scale) and `old` (clip or ema_reference)."""
    from diffusion_rl.algorithms.preference.dgpo import Dgpo, DgpoSettings

    settings = DgpoSettings(**over)
    assert Dgpo.needs_reference(settings) is reference
    assert Dgpo.frozen_calls(SimpleNamespace(settings=settings), None, GuidanceCost()) == frozen
    pair = int(over.get("reference_guidance", 1) > 1)  # the CFG pair's second row
    for one_forward in (GuidanceCost(embedded=True), GuidanceCost(ignored=True)):
        assert Dgpo.frozen_calls(SimpleNamespace(settings=settings), None, one_forward) == frozen - pair
