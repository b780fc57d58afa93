from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.preference.nft import NftInput, nft_timestep_indices, reward_probability
from diffusion_rl.config.plugins import LOSSES

BETA, CLIP, KL = 0.5, 2.0, 0.1
# sample 0: A = -c (r = 0); sample 1: A = 0 (r = 1/2)
X0 = [[0.0, 0.0], [1.0, -1.0]]
X_T = [[1.0, 1.0], [0.0, 0.0]]
T = [0.5, 0.5]
V = [[2.0, 2.0], [-1.0, 3.0]]
V_OLD = [[1.0, 1.0], [-2.0, 2.0]]
V_REF = [[1.0, 2.0], [0.0, 0.0]]
ADV = [-2.0, 0.0]


def _cfg(nft_beta=BETA, adv_clip_max=CLIP, kl_beta=KL, reward_mode="continuous", weight_floor=1e-5):
    return SimpleNamespace(nft_beta=nft_beta, adv_clip_max=adv_clip_max, kl_beta=kl_beta, reward_mode=reward_mode,
                           weight_floor=weight_floor)  # fmt: skip


def _input(v=V, v_old=V_OLD, v_ref=V_REF, x_t=X_T, x0=X0, t=T, adv=ADV):
    return NftInput(
        v=torch.tensor(v, requires_grad=True),
        v_old=torch.tensor(v_old, requires_grad=True),
        v_ref=None if v_ref is None else torch.tensor(v_ref),
        x_t=torch.tensor(x_t),
        x0=torch.tensor(x0),
        t=torch.tensor(t),
        advantages=torch.tensor(adv),
    )


def _hand_policy_terms(v, v_old, x_t, x0, t, adv, beta=BETA, c=CLIP):
    terms = []
    for i in range(len(v)):
        r = min(max(min(max(adv[i], -c), c) / (2 * c) + 0.5, 0.0), 1.0)
        pos = [x_t[i][j] - t[i] * (beta * v[i][j] + (1 - beta) * v_old[i][j]) for j in range(len(v[i]))]
        neg = [x_t[i][j] - t[i] * ((1 + beta) * v_old[i][j] - beta * v[i][j]) for j in range(len(v[i]))]
        d_pos = [p - x for p, x in zip(pos, x0[i])]
        d_neg = [n - x for n, x in zip(neg, x0[i])]
        w_pos = max(sum(abs(d) for d in d_pos) / len(d_pos), 1e-5)
        w_neg = max(sum(abs(d) for d in d_neg) / len(d_neg), 1e-5)
        mse_pos = sum(d * d for d in d_pos) / len(d_pos)
        mse_neg = sum(d * d for d in d_neg) / len(d_neg)
        terms.append((r * mse_pos / w_pos + (1 - r) * mse_neg / w_neg) / beta)
    return terms


def test_reward_probability_maps_clipped_advantages_to_zero_one():
    r = reward_probability(torch.tensor([2.0, 0.0, -2.0, 6.0, -9.0, 1.0]), 2.0)
    assert r.tolist() == pytest.approx([1.0, 0.5, 0.0, 1.0, 0.0, 0.75])


def test_loss_and_metrics_match_hand_computation():
    terms = _hand_policy_terms(V, V_OLD, X_T, X0, T, ADV)
    # sample 0: x0- = 1 - 0.5 * 0.5 = 0.75 everywhere, w- = 0.75, mse- = 0.5625 -> 0.75 / beta = 1.5
    # sample 1: x0+ = [0.75, -1.25], x0- = [1.25, -0.75]: both at |0.25| -> (0.5 * 0.25 + 0.5 * 0.25) / beta = 0.5
    assert terms == pytest.approx([1.5, 0.5])
    kl = [(1.0 + 0.0) / 2, (1.0 + 9.0) / 2]
    out = LOSSES.get("nft")(_input(), _cfg())
    assert out.loss.item() == pytest.approx(CLIP * sum(terms) / 2 + KL * sum(kl) / 2, rel=1e-6)
    assert out.metrics["nft/policy_loss"].item() == pytest.approx(CLIP * 1.0)
    assert out.metrics["kl_ref"].item() == pytest.approx(2.75)
    assert out.metrics["nft/r_mean"].item() == pytest.approx(0.25)
    assert out.metrics["nft/old_gap"].item() == pytest.approx(1.0)
    assert all(not m.requires_grad and m.ndim == 0 for m in out.metrics.values())


def test_adaptive_weight_is_floored():
    # v = v_old and x_t - t v lands 2e-6 from x0: mean |x0+- - x0| = 2e-6 is floored at 1e-5
    inp = _input(
        v=[[-2e-6, 2e-6]], v_old=[[-2e-6, 2e-6]], v_ref=None, x_t=[[0.0, 0.0]], x0=[[0.0, 0.0]], t=[1.0], adv=[0.0]
    )
    out = LOSSES.get("nft")(inp, _cfg(kl_beta=0.0))
    # r = 1/2; both terms 4e-12 / 1e-5 = 4e-7 (unfloored they would be 2e-6) -> c * 4e-7 / beta
    assert out.loss.item() == pytest.approx(CLIP * 4e-7 / BETA, rel=1e-3)
    assert out.metrics["kl_ref"].item() == 0.0


@pytest.mark.parametrize("adv", [CLIP, -CLIP])
def test_gradient_step_moves_the_favoured_prediction_toward_x0(adv):
    # on-policy start (v = v_old): x0+ = x0- ; A = +c trains x0+ toward x0, A = -c trains x0- toward x0
    # and with it pushes x0+ away
    v = [[0.3, -0.2, 0.5]]
    inp = _input(v=v, v_old=v, v_ref=None, x_t=[[0.4, 0.1, -0.3]], x0=[[0.0, 0.5, -1.0]], t=[0.7], adv=[adv])
    LOSSES.get("nft")(inp, _cfg(kl_beta=0.0)).loss.backward()
    x_t, x0, t = inp.x_t[0].tolist(), inp.x0[0].tolist(), 0.7
    stepped = [a - 0.05 * g for a, g in zip(v[0], inp.v.grad[0].tolist())]
    before = sum((x - t * a - y) ** 2 for x, a, y in zip(x_t, v[0], x0))  # x0+ = x0- at v = v_old
    after_pos = sum((x - t * (BETA * a + (1 - BETA) * b) - y) ** 2 for x, a, b, y in zip(x_t, stepped, v[0], x0))
    after_neg = sum((x - t * ((1 + BETA) * b - BETA * a) - y) ** 2 for x, a, b, y in zip(x_t, stepped, v[0], x0))
    if adv > 0:
        assert after_pos < before < after_neg
    else:
        assert after_neg < before < after_pos
    # exact gradient for r = 1: c / (beta * B) * 2 (x0+ - x0) / D / w+ * (-t * beta)
    if adv > 0:
        d = [x - t * a - y for x, a, y in zip(x_t, v[0], x0)]
        w = sum(abs(e) for e in d) / 3
        expected = [CLIP * 2 * e / 3 / w * (-t) for e in d]
        assert inp.v.grad[0].tolist() == pytest.approx(expected, rel=1e-5)
    assert inp.v_old.grad is None


def test_kl_without_reference_is_an_error():
    with pytest.raises(ValueError, match="v_ref"):
        LOSSES.get("nft")(_input(v_ref=None), _cfg(kl_beta=1e-4))


def test_non_positive_beta_is_an_error():
    with pytest.raises(ValueError, match="nft_beta"):
        LOSSES.get("nft")(_input(), _cfg(nft_beta=0.0))


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="advantages"):
        _input(adv=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="x0"):
        _input(x0=[[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_timestep_indices_are_a_seeded_permutation_prefix():
    idx = nft_timestep_indices(10, 0.5, torch.Generator().manual_seed(3))
    assert idx.dtype == torch.long and idx.shape == (5,)
    assert len(set(idx.tolist())) == 5 and all(0 <= i < 10 for i in idx.tolist())
    assert torch.equal(idx, nft_timestep_indices(10, 0.5, torch.Generator().manual_seed(3)))
    assert torch.equal(idx, torch.randperm(10, generator=torch.Generator().manual_seed(3))[:5])
    # a bigger fraction extends the same permutation
    assert torch.equal(nft_timestep_indices(10, 0.8, torch.Generator().manual_seed(3))[:5], idx)


def test_timestep_index_counts():
    assert sorted(nft_timestep_indices(10, 1.0, torch.Generator().manual_seed(0)).tolist()) == list(range(10))
    assert nft_timestep_indices(10, 0.01, torch.Generator().manual_seed(0)).shape == (1,)  # at least one
    assert nft_timestep_indices(10, 0.35, torch.Generator().manual_seed(0)).shape == (3,)  # floor
    seen = set()
    for seed in range(200):
        seen |= set(nft_timestep_indices(10, 0.1, torch.Generator().manual_seed(seed)).tolist())
    assert seen == set(range(10))  # index 0 (sigma = 1) is a candidate too
    with pytest.raises(ValueError, match="fraction"):
        nft_timestep_indices(10, 0.0, torch.Generator())
