"""TDM-R1's draws (algorithms/preference/tdm_r1.py `TdmR1._draws`) are a group's: the rows of a prompt's group share
their trained step j, the surrogate's recorded step j' and the σ draws τ, τ', τ''; other groups draw their own; no
draw depends on how the groups are split into micro-batches; the reward's forwards run on the rows whose step trains
the reward, and on none when no row's does.

Read from the loss's forwards on the tiny model (configs/quickstart_tdm_r1.yaml: 4 steps, 4 prompts × 2): each
`velocity` call's rows and σ's, in the loss's order — θ at x_j (σ_j), the teacher and ψ at x_τ (τ), the teacher, φ_old
and φ at the recorded state (τ''), ψ and the teacher's pair at x_τ (τ), then, for the rows that train the reward, φ and
the teacher at x_τ' (τ').
"""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.algorithms.base import UpdatePosition

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
        counted = TdmR1.frozen_calls(SimpleNamespace(settings=algorithm.settings), SimpleNamespace(num_steps=T))
        assert 3 + 3 * counted == pytest.approx(10 + reward_forwards * reward_steps / T)
