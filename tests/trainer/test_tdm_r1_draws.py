"""TDM-R1's draws (algorithms/preference/tdm_r1.py `TdmR1._draws`) are a group's: the rows of a prompt's group share
their trained step j, the surrogate's recorded step j' and the σ draws τ, τ', τ''; other groups draw their own; no
draw depends on how the groups are split into micro-batches; the reward's forwards run on the rows whose step trains
the reward, and on none when no row's does.

Read from the loss's forwards on the tiny model (configs/quickstart_tdm_r1.yaml: 4 steps, 4 prompts × 2): each
`velocity` call's rows and σ's, in the loss's order — θ at x_j (σ_j), the teacher and ψ at x_τ (τ), the teacher, φ_old
and φ at the recorded state (τ''), ψ and the teacher's pair at x_τ (τ), then, for the rows that train the reward, φ and
the teacher at x_τ' (τ').

And the input the loss builds for the formulas (tdm_r1_terms.py `TdmR1Input`), every tensor of it, against a plain
loop, on a known network: each policy's velocity a simple function of its inputs with its own constants.
"""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.algorithms.base import UpdatePosition
from diffusion_rl.models.guidance import GuidanceCost

CONFIG = "configs/quickstart_tdm_r1.yaml"
G = 2  # rows of a group
THETA, FAKE_TEACHER, FAKE, SURROGATE_TEACHER, SURROGATE_OLD, SURROGATE = range(6)
TEACHER_TERMS = 9  # the forwards every row takes; the reward's two follow


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A worker after one step (4 groups of 2, one micro-batch), and the units and position its first chunk had."""
    from diffusion_rl.config import load
    from diffusion_rl.trainer import make_trainer

    from ..conftest import ROOT, fast_overrides

    run = tmp_path_factory.mktemp("tdm_r1_draws")
    cfg = load(ROOT / CONFIG, fast_overrides(tiny_model_dir, run) + [
        "model.lora.enabled=true", "data.prompts_per_step=4", f"data.group_size={G}", "train.micro_batch_size=8",
        "train.total_steps=1", "algorithm.tdm_r1.reward_steps=2",
    ])  # fmt: skip
    trainer = make_trainer(cfg)
    worker, seen = trainer.engine, []
    loss = worker.algorithm.loss

    def keep(units, k, at):
        seen.append((units.clone(), at))
        return loss(units, k, at)

    worker.algorithm.loss = keep
    trainer.train()
    worker.algorithm.loss = loss
    units, at = seen[0]
    assert units.batch_size[0] == 4
    return worker.algorithm, units, at


def _forwards(algorithm, units, k: int, at: UpdatePosition) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, σ) of each `velocity` call of one chunk's loss, rows [N, …] and [N]; and, last, the surrogate's time
    weights [U] (its input to the formulas)."""
    calls, velocity, loss_fn = [], algorithm.model.velocity, algorithm.loss_fn

    def record(x, sigma, cond, guidance):
        calls.append((x.detach().clone(), torch.as_tensor(sigma).expand(x.shape[0]).detach().clone()))
        return velocity(x, sigma, cond, guidance)

    def formulas(inp, settings):
        calls.append((None, inp.surrogate.time_weight.clone()))
        return loss_fn(inp, settings)

    algorithm.model.velocity, algorithm.loss_fn = record, formulas
    try:
        algorithm.loss(units, k, at)
    finally:
        del algorithm.model.velocity  # the class's again
        algorithm.loss_fn = loss_fn
    return calls


def _steps(algorithm, sigma_N: torch.Tensor) -> list[int]:
    """Each row's step j from θ's σ_j."""
    sigmas = algorithm.sigmas.tolist()
    return [sigmas.index(s) for s in sigma_N.tolist()]


@pytest.mark.parametrize("k", [0, 1])
def test_a_groups_rows_share_their_draws_and_other_groups_draw_their_own(trained, k):
    algorithm, units, at = trained
    calls = _forwards(algorithm, units, k, at)
    for index in (THETA, FAKE, SURROGATE):  # j (θ's σ_j), τ (ψ's), τ'' (φ's: its step j' and its draw)
        per_group = calls[index][1].view(-1, G)
        assert bool((per_group == per_group[:, :1]).all()), index
        assert len(set(per_group[:, 0].tolist())) > 1, index  # 4 groups, not all alike (seed 42)
    # the surrogate's weight (j' + 1)/T, one per group: j' drawn with weight j' + 1 from the 4 steps
    time_weights = calls[-1][1].tolist()
    assert len(time_weights) == 4 and set(time_weights) <= {0.25, 0.5, 0.75, 1.0}
    # τ' (the reward's, on its rows only): a group's rows alike
    if len(calls) > TEACHER_TERMS + 1:
        tau_r = calls[TEACHER_TERMS][1].view(-1, G)
        assert bool((tau_r == tau_r[:, :1]).all())


def test_a_groups_chunks_train_distinct_steps(trained):
    algorithm, units, at = trained
    first, second = (_steps(algorithm, _forwards(algorithm, units, k, at)[THETA][1]) for k in (0, 1))
    assert all(a != b for a, b in zip(first, second))


def test_the_draws_do_not_depend_on_the_micro_batch(trained):
    """The batch's 4 groups in one micro-batch, or in two of 2: every row's forwards take the same σ's (j, τ, j' and
    τ'', τ') at the same states, and the chunk's loss is the mean of the halves' (the reference's threshold is off
    in the quickstart, so nothing is computed over the micro-batch)."""
    algorithm, units, at = trained
    halves = (torch.arange(2), torch.arange(2, 4))
    for k in (0, 1):
        whole, parts = _forwards(algorithm, units, k, at), [_forwards(algorithm, units[rows], k, at) for rows in halves]
        for index in [*range(TEACHER_TERMS), -1]:  # each forward's σ's, and the surrogate's time weights
            assert torch.equal(whole[index][1], torch.cat([part[index][1] for part in parts])), (k, index)
        assert torch.equal(whole[THETA][0], torch.cat([part[THETA][0] for part in parts]))  # x_j, the recorded states
        # the reward's σ's, its rows in order (a half without such rows runs no reward forward)
        reward = [calls[TEACHER_TERMS][1] for calls in (whole, *parts) if len(calls) > TEACHER_TERMS + 1]
        assert torch.equal(reward[0], torch.cat(reward[1:])) if len(reward) > 1 else not reward
        loss = float(algorithm.loss(units, k, at).loss.detach())
        halves_loss = [float(algorithm.loss(units[rows], k, at).loss.detach()) for rows in halves]
        assert loss == pytest.approx(sum(halves_loss) / 2, rel=1e-5)


@pytest.mark.parametrize("reward_steps", [0, 2, 4])
def test_the_reward_forwards_run_on_the_rows_whose_step_trains_it(trained, reward_steps, monkeypatch):
    algorithm, units, at = trained
    monkeypatch.setattr(algorithm.settings, "reward_steps", reward_steps)
    counts = []
    for k in (0, 1):
        calls = _forwards(algorithm, units, k, at)
        steps = _steps(algorithm, calls[THETA][1])
        rows = [n for n, j in enumerate(steps) if j < reward_steps]
        counts.append(len(rows))
        forwards = calls[:-1]
        if not rows:  # no reward forward at all
            assert len(forwards) == TEACHER_TERMS
            continue
        assert len(forwards) == TEACHER_TERMS + 2  # φ at its CFG scale and the teacher, on those rows only
        assert [x.shape[0] for x, _ in forwards[TEACHER_TERMS:]] == [len(rows)] * 2
    if reward_steps == 2:  # a chunk of reward and teacher-only rows
        assert any(0 < n < 4 * G for n in counts), counts
    else:
        assert counts == [0 if reward_steps == 0 else 4 * G] * 2


@pytest.mark.parametrize("reward_guidance", [1.0, 4.5])
def test_estimate_counts_the_forwards_the_loss_runs(trained, reward_guidance, monkeypatch):
    """`estimate` counts TDM-R1's update as 3 trained calls and 3·frozen_calls frozen ones per row and trained step;
    the loss runs 10 row-forwards per row (a guided call is a CFG pair: two), and on a row whose step trains the
    reward φ at reward_guidance (a pair above 1) and the teacher; over the uniformly drawn steps a share
    reward_steps / T of the rows do."""
    from types import SimpleNamespace

    from diffusion_rl.algorithms.preference.tdm_r1 import TdmR1

    algorithm, units, at = trained
    T = algorithm.sampler.num_steps
    monkeypatch.setattr(algorithm.settings, "reward_guidance", reward_guidance)
    reward_forwards = 3 if reward_guidance > 1 else 2
    for reward_steps in (0, 2, 4):
        monkeypatch.setattr(algorithm.settings, "reward_steps", reward_steps)
        for k in (0, 1):
            steps = _steps(algorithm, _forwards(algorithm, units, k, at)[THETA][1])
            row_forwards, velocity = [], algorithm.model.velocity

            def count(x, sigma, cond, guidance, velocity=velocity, row_forwards=row_forwards):
                row_forwards.append(x.shape[0] * (2 if guidance is not None and guidance > 1 else 1))
                return velocity(x, sigma, cond, guidance)

            algorithm.model.velocity = count
            try:
                algorithm.loss(units, k, at)
            finally:
                del algorithm.model.velocity
            reward_rows = sum(j < reward_steps for j in steps)
            assert sum(row_forwards) == 10 * len(steps) + reward_forwards * reward_rows, (reward_steps, k)
        counted = TdmR1.frozen_calls(SimpleNamespace(settings=algorithm.settings), SimpleNamespace(num_steps=T),
                                     GuidanceCost())  # fmt: skip
        assert 3 + 3 * counted == pytest.approx(10 + reward_forwards * reward_steps / T)


# The loss's wiring on a known network: each policy's velocity a simple function of its inputs, its own constants
# (a, b, d, e): v = a·x + b·σ + (g − 1)·d·x + e·c, c a row's mean pooled text embedding and g the guidance (a CFG pair
# v_u + g·(v_c − v_u) with v_c − v_u = d·x). The trained policies' a requires gradient, so a forward with gradient
# leaves its output attached. "reference" is the teacher (the base, adapters off).
POLICY_CONSTANTS = {
    "default": (0.9, 0.3, 0.2, 0.5),
    "fake": (-0.4, 0.7, -0.3, 0.25),
    "surrogate": (0.6, -0.5, 0.45, -0.35),
    "surrogate_old": (-0.7, 0.2, 0.15, 0.6),
    "reference": (0.35, 0.8, -0.55, -0.2),
}
TRAINED_POLICIES = ("default", "fake", "surrogate")


def _row_text(cond) -> torch.Tensor:
    """c: each row's mean pooled text embedding, [B] float64."""
    return cond["pooled_prompt_embeds"].double().flatten(1).mean(dim=1)


def _known_velocity(name: str, x: torch.Tensor, sigma, c: torch.Tensor, guidance: float, grad_a=None) -> torch.Tensor:
    a, b, d, e = POLICY_CONSTANTS[name]
    a = a if grad_a is None else grad_a
    column = [-1, *[1] * (x.ndim - 1)]
    sigma = torch.as_tensor(sigma, dtype=x.dtype).expand(x.shape[0]).view(column)
    return a * x + b * sigma + (guidance - 1) * d * x + e * c.to(x.dtype).view(column)


@pytest.fixture
def known_network(trained):
    """The algorithm's model, its `velocity` the known one of the active policy (`using` and `reference` tracked)."""
    import contextlib

    algorithm = trained[0]
    model, active = algorithm.model, ["default"]
    using, reference = model.using, model.reference
    grad_a = {name: torch.tensor(POLICY_CONSTANTS[name][0], requires_grad=True) for name in TRAINED_POLICIES}

    @contextlib.contextmanager
    def entered(name, inner):
        active.append(name)
        try:
            with inner:
                yield
        finally:
            active.pop()

    def velocity(x, sigma, cond, guidance):
        name = active[-1]
        return _known_velocity(name, x.float(), sigma, _row_text(cond), guidance, grad_a.get(name)).float()

    model.velocity = velocity
    model.using = lambda name: entered(name, using(name))
    model.reference = lambda: entered("reference", reference())
    try:
        yield algorithm
    finally:
        del model.velocity, model.using, model.reference  # the class's again


def _expected_input(algorithm, units, k: int, at: UpdatePosition):
    """The chunk's TdmR1Input by a plain loop over its rows, in float64, from the trajectory's states and σ's, the
    draws (which j, j', uniforms; the ε's generators) and the known network."""
    from diffusion_rl.utils.seeding import make_generator

    s, T, sigmas = algorithm.settings, algorithm.sampler.num_steps, algorithm.sigmas.double().tolist()
    U, G = units.advantages.shape
    traj = units.traj.reshape(U * G)
    latents, final, cond = traj.latents.double(), traj.final_latents.double(), traj.cond
    text = _row_text(cond)
    samples, groups = traj.ids.sample_index.tolist(), traj.ids.group_index.tolist()
    draws = algorithm._draws(at, k, groups[::G])
    g_cond = algorithm.model.conditional_guidance(algorithm.sampler.guidance)

    def eps(tag: str, key: int) -> torch.Tensor:
        g = make_generator(algorithm.seed, at.step, tag, at.epoch, k, key)
        return torch.randn(tuple(latents.shape[2:]), generator=g).double()

    def v(name: str, x: torch.Tensor, sigma: float, n: int, guidance: float = g_cond) -> torch.Tensor:
        return _known_velocity(name, x[None], sigma, text[n : n + 1], guidance)[0]

    def tau_of(sigma_next: float, u: float, lowest: float) -> float:  # uniform on the σ scale shifted by 3
        lo = max(sigma_next, lowest)
        start = min(lo / (3 - 2 * lo) + 0.02, 1.0)
        w = u * (1 - start) + start
        return max(3 * w / (1 + 2 * w), lo)

    def coefficients(sigma_next: float, tau: float) -> tuple[float, float]:
        alpha = (1 - tau) / (1 - sigma_next)
        return alpha, max(tau**2 - (sigma_next * alpha) ** 2, 0.0) ** 0.5

    rows = {name: [] for name in ("v_fake", "v_teacher_fake", "x_fake", "m", "tau", "v_surrogate", "v_old",
                                  "v_teacher_rec", "target", "fake_x0", "teacher_x0", "guided_x0", "direction",
                                  "reward_x0", "reward_ref_x0")}  # fmt: skip
    reward_rows, recorded_steps = [], []
    for n in range(U * G):
        j, jp, (u_tau, u_reward, u_surrogate) = draws.steps[n // G], draws.recorded[n // G], draws.uniforms[n // G]
        x, sigma, sigma_next = latents[n, j], sigmas[j], sigmas[j + 1]
        v_theta = v("default", x, sigma, n)
        m, y = x - sigma * v_theta, x + (sigma_next - sigma) * v_theta
        tau = tau_of(sigma_next, float(u_tau), 0.0)
        alpha, beta = coefficients(sigma_next, tau)
        x_fake = alpha * y + beta * eps("tdm_r1_fake_noise", samples[n])
        rows["v_fake"].append(v("fake", x_fake, tau, n))
        rows["v_teacher_fake"].append(v("reference", x_fake, tau, n))
        rows["x_fake"].append(x_fake)
        rows["m"].append(m)
        rows["tau"].append(torch.tensor(tau, dtype=torch.float64))
        # the surrogate: the state after step j' (index j' + 1; after the last step, the final latents)
        r = jp + 1
        recorded_steps.append(r)
        y_rec, sigma_rec = (latents[n, r] if r < T else final[n]), sigmas[r]
        tau_rec = tau_of(sigma_rec, float(u_surrogate), s.surrogate_min_sigma)
        alpha, beta = coefficients(sigma_rec, tau_rec)
        e = eps("tdm_r1_surrogate_noise", groups[n])
        x_rec = alpha * y_rec + beta * e
        rows["v_surrogate"].append(v("surrogate", x_rec, tau_rec, n))
        rows["v_old"].append(v("surrogate_old", x_rec, tau_rec, n))
        rows["v_teacher_rec"].append(v("reference", x_rec, tau_rec, n))
        rows["target"].append(-y_rec / (1 - sigma_rec) + e / beta * (tau_rec + sigma_rec**2 * alpha / (1 - sigma_rec)))
        # the generator: x0's at another re-noising of y to τ
        alpha, beta = coefficients(sigma_next, tau)
        x_tau = alpha * y + beta * eps("tdm_r1_kl_noise", samples[n])
        cond_x0 = x_tau - tau * v("reference", x_tau, tau, n)
        guided_x0 = x_tau - tau * v("reference", x_tau, tau, n, s.teacher_guidance)
        rows["fake_x0"].append(x_tau - tau * v("fake", x_tau, tau, n))
        rows["teacher_x0"].append(cond_x0)
        rows["guided_x0"].append(guided_x0)
        rows["direction"].append((guided_x0 - cond_x0) / (s.teacher_guidance - 1))
        if j < s.reward_steps:  # the reward at y re-noised to τ' with the group's ε
            reward_rows.append(n)
            tau_r = tau_of(sigma_next, float(u_reward), s.reward_min_sigma)
            alpha, beta = coefficients(sigma_next, tau_r)
            x_r = alpha * y + beta * eps("tdm_r1_reward_noise", groups[n])
            rows["reward_x0"].append(x_r - tau_r * v("surrogate", x_r, tau_r, n, s.reward_guidance))
            rows["reward_ref_x0"].append(x_r - tau_r * v("reference", x_r, tau_r, n))
    expected = {name: torch.stack(values) for name, values in rows.items() if values}
    expected["time_weight"] = torch.tensor([(jp + 1) / T for jp in draws.recorded], dtype=torch.float64)
    return expected, reward_rows, recorded_steps


def test_the_loss_builds_its_input_from_the_trajectory_and_the_networks(known_network, trained, monkeypatch):
    """Every tensor of the TdmR1Input the loss hands to the formulas, on the known network, against a plain loop:
    x_j and σ_j of the trained step, the generator's Euler step y = x_j + (σ' − σ_j)·v_θ and m = x_j − σ_j·v_θ, the
    re-noisings x = α·y + β·ε to each τ, the recorded state after step j' (index j' + 1; the final latents after the
    last) and its σ, x0 = x − σ·v of each network, the teacher's CFG direction (x0_guided − x0_cond)/(g − 1), and
    which tensors carry the gradient (θ's m, ψ's and φ's velocities) and which do not."""
    algorithm, units, at = trained
    for key, value in (("reward_guidance", 2.5), ("surrogate_min_sigma", 0.55), ("reward_min_sigma", 0.3)):
        monkeypatch.setattr(algorithm.settings, key, value)  # the quickstart's 1, 0, 0 would hide their wiring
    U, G = units.advantages.shape
    seen, close = [], dict(rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(algorithm, "loss_fn", lambda inp, settings: seen.append(inp))
    recorded_last, reward_counts = set(), []
    for k in (0, 1):
        seen.clear()
        algorithm.loss(units, k, at)
        (got,) = seen
        expected, reward_rows, recorded = _expected_input(algorithm, units, k, at)
        f, sur, gen = got.fake, got.surrogate, got.generator
        pairs = {
            "v_fake": f.v_fake, "v_teacher_fake": f.v_teacher, "x_fake": f.x_tau, "m": f.x0, "tau": f.tau,
            "v_surrogate": sur.v_surrogate.flatten(0, 1), "v_old": sur.v_old.flatten(0, 1),
            "v_teacher_rec": sur.v_teacher.flatten(0, 1), "target": sur.target.flatten(0, 1),
            "time_weight": sur.time_weight, "fake_x0": gen.fake_x0, "teacher_x0": gen.teacher_x0,
            "guided_x0": gen.teacher_guided_x0, "direction": gen.teacher_guidance_dir,
        }  # fmt: skip
        for name, tensor in pairs.items():
            actual = tensor.detach().double()
            torch.testing.assert_close(actual, expected[name], **close, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(gen.x0.detach().double(), expected["m"], **close)
        assert sur.v_surrogate.shape[:2] == (U, G) and torch.equal(sur.advantages, units.advantages)
        assert torch.equal(got.weights, units.weight)
        if reward_rows:
            assert gen.reward_rows.tolist() == reward_rows
            torch.testing.assert_close(gen.reward_x0.double(), expected["reward_x0"], **close)
            torch.testing.assert_close(gen.reward_ref_x0.double(), expected["reward_ref_x0"], **close)
        else:
            assert gen.reward_x0 is None
        # the gradient reaches θ through m, ψ and φ through their velocities; nothing else carries it
        assert gen.x0.requires_grad and f.v_fake.requires_grad and sur.v_surrogate.requires_grad
        detached = [f.v_teacher, f.x_tau, f.x0, sur.v_old, sur.v_teacher, sur.target, gen.fake_x0, gen.teacher_x0,
                    gen.teacher_guided_x0, gen.teacher_guidance_dir, gen.reward_x0, gen.reward_ref_x0]  # fmt: skip
        assert not any(t is not None and t.requires_grad for t in detached)
        recorded_last.update(r == algorithm.sampler.num_steps for r in recorded)
        reward_counts.append(len(reward_rows))
    # the chunks cover a recorded state before the last step and the final latents, and reward rows among others
    assert recorded_last == {True, False} and any(0 < n < U * G for n in reward_counts), (recorded_last, reward_counts)
