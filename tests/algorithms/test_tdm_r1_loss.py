"""TDM-R1's formulas (algorithms/preference/tdm_r1_terms.py) on fixed inputs against the authors' expressions written
out as plain loops over groups, rows and elements in Python floats: the re-noising and its σ draw, the fake score's,
the surrogate's and the generator's losses, their gradients, and the chunk's total."""

import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.preference.tdm_r1_terms import (
    FakeScoreInput,
    GeneratorInput,
    SurrogateInput,
    TdmR1Input,
    draw_tau,
    fake_score_loss,
    generator_loss,
    renoise,
    surrogate_loss,
    surrogate_target,
    tdm_r1_terms,
)


def _t(x, grad=False):
    return torch.tensor(x, dtype=torch.float32, requires_grad=grad)


# -- the re-noising, by hand ---------------------------------------------------------------------------------------
def test_renoise_and_the_surrogate_target_by_hand():
    # σ' = 0.5, τ = 0.8: α = 0.2/0.5 = 0.4, β = √(0.64 − 0.2²) = √0.6; y = 1, ε = 0.5
    beta = math.sqrt(0.6)
    x = renoise(_t([[1.0]]), _t([0.5]), _t([0.8]), _t([[0.5]]))
    assert x.item() == pytest.approx(0.4 + beta * 0.5, rel=1e-6)
    # −y/(1 − σ') + ε/β·(τ + σ'²α/(1 − σ')) = −2 + 0.5/√0.6·(0.8 + 0.2)
    target = surrogate_target(_t([[1.0]]), _t([0.5]), _t([0.8]), _t([[0.5]]))
    assert target.item() == pytest.approx(-2 + 0.5 / beta, rel=1e-6)


def test_from_a_clean_state_they_are_the_forward_process_and_its_velocity():
    y, eps, tau = _t([[0.3, -1.2]]), _t([[0.7, 0.1]]), _t([0.6])
    x = renoise(y, _t([0.0]), tau, eps)
    assert torch.allclose(x, 0.4 * y + 0.6 * eps, atol=1e-7)
    assert torch.allclose(surrogate_target(y, _t([0.0]), tau, eps), eps - y, atol=1e-6)


def test_tau_is_uniform_on_the_shifted_scale_above_its_bound():
    # unshift(0.5) = 0.5/(3 − 2·0.5) = 0.25; start 0.27; u = 0.25 → 0.4525; shift 3·0.4525/(1 + 2·0.4525)
    assert draw_tau(_t([0.5]), _t([0.25])).item() == pytest.approx(1.3575 / 1.905, rel=1e-6)
    # a lowest σ of 0.6 above σ' = 0.5: unshift(0.6) = 0.6/1.8; start + 0.02; u = 0.25
    start = 0.6 / 1.8 + 0.02
    z = 0.25 * (1 - start) + start
    assert draw_tau(_t([0.5]), _t([0.25]), lowest=0.6).item() == pytest.approx(3 * z / (1 + 2 * z), rel=1e-6)
    assert draw_tau(_t([0.5]), _t([0.0]), lowest=0.6).item() >= 0.6
    assert draw_tau(_t([0.2]), _t([0.999])).item() <= 1.0


def test_each_row_draws_tau_with_its_own_uniform():
    # rows of two groups: σ' 0.5 and 0.2, u 0.25 and 0.75 (each row as if alone)
    tau = draw_tau(_t([0.5, 0.5, 0.2, 0.2]), _t([0.25, 0.25, 0.75, 0.75]), lowest=0.3)
    for n, (sigma, u) in enumerate([(0.5, 0.25), (0.5, 0.25), (0.2, 0.75), (0.2, 0.75)]):
        lo = max(sigma, 0.3)
        start = lo / (3 - 2 * lo) + 0.02
        z = u * (1 - start) + start
        assert tau[n].item() == pytest.approx(max(3 * z / (1 + 2 * z), lo), rel=1e-6)


# -- the fake score ------------------------------------------------------------------------------------------------
def test_fake_score_loss_and_gradient():
    v, vt, x, m, tau = [[0.5, -0.1], [0.2, 0.3]], [[0.4, 0.0], [0.1, 0.5]], [[1.0, 0.2], [-0.4, 0.6]], \
        [[0.2, 0.1], [0.0, 0.3]], [0.5, 0.8]  # fmt: skip
    inp = FakeScoreInput(v_fake=_t(v, True), v_teacher=_t(vt), x_tau=_t(x), x0=_t(m), tau=_t(tau))
    per_row, error = fake_score_loss(inp, 0.02)
    per_row.sum().backward()
    for n in range(2):
        target = [(x[n][e] - m[n][e]) / tau[n] for e in range(2)]
        err = sum((target[e] - v[n][e]) ** 2 for e in range(2)) / 2
        reg = sum((vt[n][e] - v[n][e]) ** 2 for e in range(2)) / 2
        assert per_row[n].item() == pytest.approx(err + 0.02 * reg, rel=1e-6)
        assert error[n].item() == pytest.approx(err, rel=1e-6)
        for e in range(2):
            grad = (-2 * (target[e] - v[n][e]) - 0.04 * (vt[n][e] - v[n][e])) / 2
            assert inp.v_fake.grad[n, e].item() == pytest.approx(grad, rel=1e-5)


# -- the surrogate -------------------------------------------------------------------------------------------------
# U = 2 groups of G = 3 rows, D = 2 elements a row
PHI = [[[0.5, -0.2], [0.1, 0.4], [-0.3, 0.9]], [[1.0, 0.0], [0.2, -0.6], [0.7, 0.3]]]
OLD = [[[0.5, -0.2], [0.3, 0.4], [-0.3, 0.7]], [[0.9, 0.1], [0.2, -0.6], [0.7, 0.3]]]
TEACHER = [[[0.4, 0.0], [0.3, 0.3], [-0.1, 0.6]], [[0.9, 0.1], [0.0, -0.2], [0.4, 0.1]]]
TARGET = [[[0.3, 0.1], [0.0, 0.2], [0.1, 0.5]], [[0.6, 0.2], [0.1, -0.1], [0.2, 0.4]]]
ADV = [[1.2, -0.4, -0.8], [7.0, -2.0, -5.5]]  # group 1's 7 and −5.5 are clamped to ±5


def _mse(a, b):
    return sum((x - y) ** 2 for x, y in zip(a, b)) / len(a)


def _surrogate_expected(beta, clip, threshold, reg, c, time_weight):
    """Per group: the loss, its gradient in φ's velocity, and the stopped rows, by the authors' steps; time_weight
    one number, or one per group."""
    U, G, D = 2, 3, 2
    weights = time_weight if isinstance(time_weight, list) else [time_weight] * U
    distance = [[_mse(PHI[u][i], TEACHER[u][i]) for i in range(G)] for u in range(U)]
    far = sum(sum(row) for row in distance) / (U * G) > threshold
    losses, grads, stopped = [], [], []
    for u in range(U):
        adv = [max(-c, min(c, a)) for a in ADV[u]]
        e = [_mse(TARGET[u][i], PHI[u][i]) for i in range(G)]
        e_old = [_mse(TARGET[u][i], OLD[u][i]) for i in range(G)]
        e_t = [_mse(TARGET[u][i], TEACHER[u][i]) for i in range(G)]
        s = beta / G * sum(adv[i] * (e[i] - e_t[i]) for i in range(G))
        w = 1 / (1 + math.exp(-s))
        rows, loss, grad, time_weight = [], 0.0, [], weights[u]
        for i in range(G):
            ratio, ref_ratio = math.exp(e_old[i] - e[i]), math.exp(e_t[i] - e[i])
            moved = ratio > 1 + clip if adv[i] > 0 else ratio < 1 - clip
            ahead = ref_ratio > 1 if adv[i] > 0 else ref_ratio < 1
            stop = moved or (far and ahead)
            rows.append(stop)
            loss += time_weight * (w * adv[i] * e[i] + reg * distance[u][i]) / G
            preference = [0.0 if stop else w * adv[i] * -2 * (TARGET[u][i][d] - PHI[u][i][d]) / D for d in range(D)]
            grad.append(
                [time_weight / G * (preference[d] + reg * 2 * (PHI[u][i][d] - TEACHER[u][i][d]) / D) for d in range(D)]
            )
        losses.append(loss)
        grads.append(grad)
        stopped.append(rows)
    return losses, grads, stopped


def _surrogate_input(time_weight=1.0):
    time_weight = _t(time_weight) if isinstance(time_weight, list) else time_weight
    return SurrogateInput(v_surrogate=_t(PHI, True), v_old=_t(OLD), v_teacher=_t(TEACHER), target=_t(TARGET),
                          advantages=_t(ADV), time_weight=time_weight)  # fmt: skip


@pytest.mark.parametrize("threshold", [0.01, 10.0], ids=["far-from-the-teacher", "near-it"])
@pytest.mark.parametrize("time_weight", [1.0, 0.75, [0.25, 1.0]], ids=["1", "0.75", "per-group"])
def test_surrogate_loss_and_gradient_match_the_authors_steps(threshold, time_weight):
    settings = dict(beta=10.0, clip=1e-3, threshold=threshold, reg=0.001, c=5.0, time_weight=time_weight)
    inp = _surrogate_input(time_weight)
    per_group, metrics = surrogate_loss(inp, None, beta=10.0, clip_range=1e-3, reg_threshold=threshold, reg=0.001,
                                        c=5.0)  # fmt: skip
    per_group.sum().backward()
    losses, grads, stopped = _surrogate_expected(**settings)
    assert per_group.tolist() == pytest.approx(losses, rel=1e-5)
    assert torch.allclose(inp.v_surrogate.grad, _t(grads), rtol=1e-4, atol=1e-8)
    assert any(any(rows) for rows in stopped) and not all(all(rows) for rows in stopped)  # the cases are exercised
    moved = sum(row for rows in _surrogate_expected(**{**settings, "threshold": 1e9})[2] for row in rows) / 6
    assert metrics["tdm_r1/surrogate_clip_fraction"].item() == pytest.approx(moved, rel=1e-6)
    # far from the teacher (mean distance 0.048 > 0.01), rows whose error passed the teacher's stop too
    assert (metrics["tdm_r1/surrogate_teacher_clip_fraction"].item() > 0) is (threshold < 0.048)


# -- the generator -------------------------------------------------------------------------------------------------
M = [[0.2, -0.4], [1.0, 0.3]]
FAKE_X0 = [[0.1, -0.2], [0.8, 0.5]]
TEACHER_X0 = [[0.3, -0.3], [0.7, 0.2]]
DIRECTION = [[0.05, -0.1], [0.2, 0.0]]
GUIDED_X0 = [[0.35, -0.5], [1.4, 0.2]]
REWARD_X0 = [[0.6, -0.1], [0.9, 0.9]]
REWARD_REF_X0 = [[0.4, -0.2], [1.1, 0.4]]


def _generator_expected(w, s, reward):
    """Per row the loss and its gradient in m: err = Δ², ∂err/∂m = −2Δ."""
    losses, grads = [], []
    for n in range(2):
        W = sum(abs(M[n][e] - GUIDED_X0[n][e]) for e in range(2)) / 2
        W_R = sum(abs(M[n][e] - REWARD_X0[n][e]) for e in range(2)) / 2
        kl = [TEACHER_X0[n][e] - FAKE_X0[n][e] for e in range(2)]
        cfg = [s * DIRECTION[n][e] for e in range(2)]
        r = [REWARD_X0[n][e] - REWARD_REF_X0[n][e] for e in range(2)]
        if reward:
            coef = [(w * cfg[e] ** 2 / W + (1 - w) * r[e] ** 2 / W_R + kl[e] ** 2 / W) for e in range(2)]
            grad = [(w * cfg[e] / W + (1 - w) * r[e] / W_R + kl[e] / W) * -2 / 2 for e in range(2)]
        else:
            coef = [w * (cfg[e] ** 2 + kl[e] ** 2) / W for e in range(2)]
            grad = [w * (cfg[e] + kl[e]) / W * -2 / 2 for e in range(2)]
        losses.append(sum(coef) / 2)
        grads.append(grad)
    return losses, grads


@pytest.mark.parametrize("reward", [True, False], ids=["reward-step", "teacher-terms-only"])
def test_generator_loss_and_gradient_match_the_authors_steps(reward):
    inp = GeneratorInput(x0=_t(M, True), fake_x0=_t(FAKE_X0), teacher_x0=_t(TEACHER_X0),
                         teacher_guidance_dir=_t(DIRECTION), teacher_guided_x0=_t(GUIDED_X0),
                         reward_x0=_t(REWARD_X0) if reward else None,
                         reward_ref_x0=_t(REWARD_REF_X0) if reward else None)  # fmt: skip
    per_row, metrics = generator_loss(inp, teacher_weight=0.3, cfg_scale=3.5)
    per_row.sum().backward()
    losses, grads = _generator_expected(0.3, 3.5, reward)
    assert per_row.tolist() == pytest.approx(losses, rel=1e-5)
    assert torch.allclose(inp.x0.grad, _t(grads), rtol=1e-5, atol=1e-8)
    assert ("tdm_r1/generator_reward" in metrics) is reward


def test_rows_that_train_the_reward_and_rows_that_do_not_each_take_their_form_and_gradient():
    # row 1's step trains the reward (j < reward_steps), row 0's the teacher terms only: each as the loop has it
    inp = GeneratorInput(x0=_t(M, True), fake_x0=_t(FAKE_X0), teacher_x0=_t(TEACHER_X0),
                         teacher_guidance_dir=_t(DIRECTION), teacher_guided_x0=_t(GUIDED_X0),
                         reward_rows=torch.tensor([1]), reward_x0=_t(REWARD_X0[1:]),
                         reward_ref_x0=_t(REWARD_REF_X0[1:]))  # fmt: skip
    per_row, metrics = generator_loss(inp, teacher_weight=0.3, cfg_scale=3.5)
    per_row.sum().backward()
    (reward_losses, reward_grads), (teacher_losses, teacher_grads) = (_generator_expected(0.3, 3.5, reward)
                                                                      for reward in (True, False))  # fmt: skip
    assert per_row.tolist() == pytest.approx([teacher_losses[0], reward_losses[1]], rel=1e-5)
    assert torch.allclose(inp.x0.grad, _t([teacher_grads[0], reward_grads[1]]), rtol=1e-5, atol=1e-8)
    # the reward term's metric: row 1's alone, mean (x0_φ − x0_T)² / mean |m − x0_φ|
    w_r = sum(abs(M[1][e] - REWARD_X0[1][e]) for e in range(2)) / 2
    term = sum((REWARD_X0[1][e] - REWARD_REF_X0[1][e]) ** 2 for e in range(2)) / 2 / w_r
    assert metrics["tdm_r1/generator_reward"].tolist() == pytest.approx([term], rel=1e-5)


# -- the chunk -----------------------------------------------------------------------------------------------------
def _settings(**over):
    values = dict(fake_reg=0.02, dpo_beta=10.0, clip_range=1e-3, reg_threshold=0.05, surrogate_reg=0.001,
                  adv_clip_max=5.0, teacher_weight=0.3, cfg_scale=None, cfg_reward_scale=3.5)  # fmt: skip
    return SimpleNamespace(**{**values, **over})


REWARD_ROW_X0, REWARD_ROW_REF_X0 = [[0.3, -0.2], [0.1, 0.4], [-0.5, 0.2]], [[0.2, 0.0], [0.4, 0.1], [-0.2, 0.3]]


def _chunk_x0() -> list[list[float]]:
    return [[a * 0.5, b - 0.1] for group in PHI for a, b in group]


def _chunk(weights=None, reward_group=None):
    """U = 2 groups of G = 3 rows; the fake score's and the generator's rows are made from the surrogate's numbers;
    the rows of `reward_group` train the reward (at REWARD_ROW_X0 and REWARD_ROW_REF_X0)."""
    flat = [row for group in PHI for row in group]
    x0 = _t(_chunk_x0(), True)
    fake = FakeScoreInput(v_fake=_t(flat, True), v_teacher=_t([row for g in TEACHER for row in g]),
                          x_tau=_t([row for g in TARGET for row in g]), x0=x0.detach(), tau=_t([0.6] * 6))  # fmt: skip
    generator = GeneratorInput(x0=x0, fake_x0=_t([row for g in OLD for row in g]),
                               teacher_x0=_t([row for g in TEACHER for row in g]),
                               teacher_guidance_dir=_t([[0.1, -0.05]] * 6),
                               teacher_guided_x0=_t([[0.9, -0.9]] * 6))  # fmt: skip
    if reward_group is not None:
        generator.reward_rows = torch.arange(3 * reward_group, 3 * reward_group + 3)
        generator.reward_x0, generator.reward_ref_x0 = _t(REWARD_ROW_X0), _t(REWARD_ROW_REF_X0)
    return TdmR1Input(fake, _surrogate_input(), generator, None if weights is None else _t(weights))


@pytest.mark.parametrize("weights", [None, [1.0, 0.0]], ids=["all", "padded-group"])
def test_the_chunk_loss_is_the_mean_over_groups_of_the_three_losses(weights):
    inp = _chunk(weights)
    loss, metrics = tdm_r1_terms(inp, _settings())
    w = torch.ones(2) if weights is None else _t(weights)
    fake = fake_score_loss(inp.fake, 0.02)[0].view(2, 3).mean(dim=1)
    surrogate = surrogate_loss(inp.surrogate, inp.weights, beta=10.0, clip_range=1e-3, reg_threshold=0.05,
                               reg=0.001, c=5.0)[0]  # fmt: skip
    generator = generator_loss(inp.generator, teacher_weight=0.3, cfg_scale=3.5)[0].view(2, 3).mean(dim=1)
    expected = sum(float((part * w).mean().detach()) for part in (fake, surrogate, generator))
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    kept = w / w.sum()
    assert metrics["tdm_r1/fake_loss"].item() == pytest.approx(float((fake * kept).sum().detach()), rel=1e-5)
    # each network's gradient comes from its own loss only: the generator's x0 is read nowhere else
    loss.backward()
    assert inp.fake.v_fake.grad is not None and inp.generator.x0.grad is not None


@pytest.mark.parametrize("weights", [None, [0.0, 1.0]], ids=["all", "first-group-pads"])
def test_the_reward_metric_is_the_mean_over_the_rows_that_trained_it(weights):
    # group 1's rows train the reward, group 0's do not: the metric is theirs alone, not diluted by group 0
    _, metrics = tdm_r1_terms(_chunk(weights, reward_group=1), _settings())
    m = _chunk_x0()[3:]
    terms = []
    for n in range(3):
        w_r = sum(abs(m[n][e] - REWARD_ROW_X0[n][e]) for e in range(2)) / 2
        terms.append(sum((REWARD_ROW_X0[n][e] - REWARD_ROW_REF_X0[n][e]) ** 2 for e in range(2)) / 2 / w_r)
    assert metrics["tdm_r1/generator_reward"].item() == pytest.approx(sum(terms) / 3, rel=1e-5)
    # the share of the rows (that carry weight) which trained the reward
    assert metrics["tdm_r1/reward_fraction"].item() == (0.5 if weights is None else 1.0)
    _, without = tdm_r1_terms(_chunk(weights), _settings())
    assert "tdm_r1/generator_reward" not in without and without["tdm_r1/reward_fraction"].item() == 0
