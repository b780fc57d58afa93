"""DiffusionNFT's reward-probability modes, its configurable weight floor, and its positive/negative loss metrics,
against numbers worked out by hand and with plain Python loops."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.preference.nft import NftInput, NftSettings, reward_probability
from diffusion_rl.config import load
from diffusion_rl.config.plugins import LOSSES
from diffusion_rl.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
C = 2.0
ADV = [3.0, 1.0, 0.0, -0.5, -5.0]
# r = a / (2c) + 1/2 with c = 2, a per mode worked out by hand from A = 3, 1, 0, -0.5, -5 (clamped to ±2 first)
EXPECTED_R = {
    "continuous": [1.0, 0.75, 0.5, 0.375, 0.0],  # a = 2, 1, 0, -0.5, -2
    "positive_only": [1.0, 0.75, 0.5, 0.5, 0.5],  # a = 2, 1, 0, 0, 0
    "negative_only": [0.5, 0.5, 0.5, 0.375, 0.0],  # a = 0, 0, 0, -0.5, -2
    "one_only": [0.75, 0.75, 0.5, 0.5, 0.5],  # a = 1, 1, 0, 0, 0
    "binary": [0.75, 0.75, 0.5, 0.25, 0.25],  # a = 1, 1, 0, -1, -1
}


@pytest.mark.parametrize("mode", sorted(EXPECTED_R))
def test_reward_probability_of_each_mode(mode):
    assert reward_probability(torch.tensor(ADV), C, mode).tolist() == pytest.approx(EXPECTED_R[mode])


def test_an_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="reward_mode must be one of"):
        reward_probability(torch.tensor(ADV), C, "sigmoid")


# two samples with 2 elements each
X0 = [[0.0, 0.0], [1.0, -1.0]]
X_T = [[1.0, 1.0], [0.0, 0.0]]
T = [0.5, 0.8]
V = [[2.0, 2.0], [-1.0, 3.0]]
V_OLD = [[1.0, 1.0], [-2.0, 2.0]]
BETA = 0.5


def _cfg(mode="continuous", floor=1e-5):
    return SimpleNamespace(nft_beta=BETA, adv_clip_max=C, kl_beta=0.0, reward_mode=mode, weight_floor=floor)


def _input(adv, v=V, v_old=V_OLD, x_t=X_T, x0=X0, t=T):
    return NftInput(v=torch.tensor(v, requires_grad=True), v_old=torch.tensor(v_old), v_ref=None,
                    x_t=torch.tensor(x_t), x0=torch.tensor(x0), t=torch.tensor(t),
                    advantages=torch.tensor(adv))  # fmt: skip


def _hand(r, v=V, v_old=V_OLD, x_t=X_T, x0=X0, t=T, floor=1e-5):
    """(per-sample positive terms, negative terms, policy terms) by plain loops."""
    pos_terms, neg_terms, pol = [], [], []
    for i in range(len(v)):
        n = len(v[i])
        d_pos = [x_t[i][j] - t[i] * (BETA * v[i][j] + (1 - BETA) * v_old[i][j]) - x0[i][j] for j in range(n)]
        d_neg = [x_t[i][j] - t[i] * ((1 + BETA) * v_old[i][j] - BETA * v[i][j]) - x0[i][j] for j in range(n)]
        w_pos = max(sum(abs(d) for d in d_pos) / n, floor)
        w_neg = max(sum(abs(d) for d in d_neg) / n, floor)
        pos = sum(d * d for d in d_pos) / n / w_pos
        neg = sum(d * d for d in d_neg) / n / w_neg
        pos_terms.append(pos)
        neg_terms.append(neg)
        pol.append((r[i] * pos + (1 - r[i]) * neg) / BETA)
    return pos_terms, neg_terms, pol


@pytest.mark.parametrize("mode, adv, r", [
    ("binary", [0.3, -4.0], [0.75, 0.25]),
    ("one_only", [0.3, -4.0], [0.75, 0.5]),
    ("positive_only", [-1.0, 1.0], [0.5, 0.75]),
    ("negative_only", [-1.0, 1.0], [0.25, 0.5]),
])  # fmt: skip
def test_loss_uses_the_mode_reward_probability(mode, adv, r):
    pos, neg, pol = _hand(r)
    out = LOSSES.get("nft")(_input(adv), _cfg(mode))
    assert out.loss.item() == pytest.approx(C * sum(pol) / 2, rel=1e-6)
    assert out.metrics["nft/r_mean"].item() == pytest.approx(sum(r) / 2)
    assert out.metrics["nft/positive_loss"].item() == pytest.approx(sum(pos) / 2, rel=1e-6)
    assert out.metrics["nft/negative_loss"].item() == pytest.approx(sum(neg) / 2, rel=1e-6)


def test_positive_and_negative_losses_by_hand():
    # sample 0 (t = 0.5): x0+ = 1 - 0.5 * 1.5 = 0.25 → pos = 0.0625 / 0.25 = 0.25; x0- = 1 - 0.5 * 0.5 = 0.75 → 0.75
    # sample 1 (t = 0.8): v+ = [-1.5, 2.5], x0+ - x0 = [0.2, -1.0] → mean d² 0.52, w 0.6 → 0.8667
    #                     v- = [-2.5, 1.5], x0- - x0 = [1.0, -0.2] → the same 0.8667
    pos, neg, _ = _hand([0.5, 0.5])
    assert pos == pytest.approx([0.25, 0.52 / 0.6]) and neg == pytest.approx([0.75, 0.52 / 0.6])
    out = LOSSES.get("nft")(_input([0.0, 0.0]), _cfg())
    assert out.metrics["nft/positive_loss"].item() == pytest.approx((0.25 + 0.52 / 0.6) / 2, rel=1e-6)
    assert out.metrics["nft/negative_loss"].item() == pytest.approx((0.75 + 0.52 / 0.6) / 2, rel=1e-6)


def test_metrics_leave_out_weight_zero_samples():
    inp = _input([1.0, -1.0])
    inp.weights = torch.tensor([1.0, 0.0])
    pos, neg, _ = _hand([0.75, 0.25])
    out = LOSSES.get("nft")(inp, _cfg())
    assert out.metrics["nft/positive_loss"].item() == pytest.approx(pos[0], rel=1e-6)
    assert out.metrics["nft/negative_loss"].item() == pytest.approx(neg[0], rel=1e-6)


def test_the_weight_floor_is_an_option():
    # sample 0's mean |x0± − x0| are 0.25 and 0.75; sample 1's 0.6: a floor of 0.5 lifts the 0.25 only
    floor = 0.5
    pos, neg, pol = _hand([0.5, 0.5], floor=floor)
    assert pos[0] == pytest.approx(0.0625 / 0.5) and neg[0] == pytest.approx(0.75)
    out = LOSSES.get("nft")(_input([0.0, 0.0]), _cfg(floor=floor))
    assert out.loss.item() == pytest.approx(C * sum(pol) / 2, rel=1e-6)
    default = LOSSES.get("nft")(_input([0.0, 0.0]), _cfg())
    assert default.loss.item() > out.loss.item()  # dividing 0.0625 by 0.25 instead of 0.5
    with pytest.raises(ValueError, match="weight_floor"):
        LOSSES.get("nft")(_input([0.0, 0.0]), _cfg(floor=0.0))


def test_settings_defaults_and_checks():
    s = NftSettings()
    assert (s.reward_mode, s.weight_floor) == ("continuous", 1e-5)
    with pytest.raises(UserError, match=r"'algorithm.nft.weight_floor' must be in \(0, 1\], got -1"):
        load(ROOT / "configs/quickstart_nft.yaml", ["algorithm.nft.weight_floor=-1.0"])
    overrides = ["algorithm.nft.reward_mode=binary", "algorithm.nft.weight_floor=1e-3"]
    cfg = load(ROOT / "configs/quickstart_nft.yaml", overrides)
    assert (cfg.algorithm.settings.reward_mode, cfg.algorithm.settings.weight_floor) == ("binary", 1e-3)
    with pytest.raises(UserError, match="one_only"):
        load(ROOT / "configs/quickstart_nft.yaml", ["algorithm.nft.reward_mode=one-only"])
