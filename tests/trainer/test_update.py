"""The policy-gradient update: gradient accumulation, mini-batches, PPO epochs, timestep picks, dropped samples."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_rl.algorithms.credit import Targets
from diffusion_rl.algorithms.policy_gradient import PolicyGradient, trained_columns
from diffusion_rl.data.sampler import make_step_prompts
from diffusion_rl.engine.worker import UpdatePlan
from diffusion_rl.sampling.window import window_for_step


def _record_gradients(worker) -> list[list[torch.Tensor]]:
    """Make the worker keep a copy of the accumulated gradients at each optimizer step (which still runs)."""
    grads: list[list[torch.Tensor]] = []
    optimizer_step = worker.optimizer.step

    def step() -> float:
        grads.append([p.grad.clone() for p in worker.model.trainable_parameters()])
        return optimizer_step()

    worker.optimizer.step = step
    return grads


def _record_backward_steps(worker) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    """Make the worker keep (sample indices, trained columns, loss metrics) of each backward pass (which still runs)."""
    calls: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
    loss = worker.algorithm.loss

    def chunk(units, k, at):
        out = loss(units, k, at)
        metrics = {"loss": float(out.loss.detach()), **{name: float(v) for name, v in out.metrics.items()}}
        calls.append((units.traj.ids.sample_index.clone(), units.columns[:, k].clone(), metrics))
        return out

    worker.algorithm.loss = chunk
    return calls


def _targets(*advantages: float) -> Targets:
    return Targets(advantages=torch.tensor(advantages), batch_size=[len(advantages)])


def _max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_micro_batches_of_1_give_the_same_update_as_one_micro_batch_of_4(make_trainer, tmp_path, weights):
    # AdamW's first step is lr·g/(|g| + eps): where |g| ≈ eps it turns float noise in g (~1e-8 here) into
    # ~1e-5 of parameter change. eps = 1e-4 keeps the comparison about the gradient, not Adam's sign.
    results = {}
    for micro in (4, 1):
        trainer = make_trainer(
            f"run.dir={tmp_path / f'micro{micro}'}",
            "train.total_steps=1",
            f"train.micro_batch_size={micro}",
            "train.adam_eps=1e-4",
        )
        grads = _record_gradients(trainer.engine)
        rows = trainer.train()
        assert rows[0]["train/optimizer_steps"] == 1
        results[micro] = (grads[0], weights(trainer))

    (grads4, params4), (grads1, params1) = results[4], results[1]
    grad_scale = max(float(g.abs().max()) for g in grads4)
    assert grad_scale > 0
    assert _max_abs_diff(grads4, grads1) <= 1e-5 * grad_scale
    param_scale = max(float(p.abs().max()) for p in params4.values())
    param_diff = _max_abs_diff(list(params4.values()), [params1[k] for k in params4])
    assert param_diff <= 1e-6 * max(param_scale, 1.0), f"max parameter difference {param_diff:.3g}"


def test_two_minibatches_make_two_optimizer_steps(make_trainer):
    trainer = make_trainer("train.total_steps=1", "train.num_minibatches=2", "train.micro_batch_size=1")
    calls = _record_backward_steps(trainer.engine)
    rows = trainer.train()
    assert rows[0]["train/optimizer_steps"] == 2
    assert rows[0]["train/skipped_updates"] == 0
    # interleaved mini-batches: rows 0, 2 then 1, 3 (each mixes the two prompt groups); 3 trained steps each
    assert [int(index) for index, _, _ in calls] == [0] * 3 + [2] * 3 + [1] * 3 + [3] * 3


def test_second_ppo_epoch_has_ratios_off_1_and_clips(make_trainer):
    trainer = make_trainer("train.total_steps=1", "train.ppo_epochs=2", "algorithm.flow_grpo.clip_range=1e-6")
    calls = _record_backward_steps(trainer.engine)
    rows = trainer.train()
    assert rows[0]["train/optimizer_steps"] == 2
    per_epoch = len(calls) // 2  # 3 trained steps × one micro-batch of 4
    first, second = calls[:per_epoch], calls[per_epoch:]
    # the first epoch recomputes the rollout's own log-probs; the second runs after an optimizer step
    assert all(abs(m["ratio_mean"] - 1) < 1e-5 and m["ratio_std"] < 1e-5 for _, _, m in first)
    assert all(m["ratio_std"] > 1e-6 for _, _, m in second)
    assert max(m["clip_fraction"] for _, _, m in second) > 0
    assert rows[0]["clip_fraction"] > 0


def test_first_timesteps_trains_columns_0_to_k_minus_1(make_trainer):
    # 5 steps: an SDE window of W = 4 steps, of which K = 2 are trained
    trainer = make_trainer("train.total_steps=1", "sampling.num_steps=5", "algorithm.timestep_fraction=0.5")
    calls = _record_backward_steps(trainer.engine)
    trainer.train()
    assert [cols.tolist() for _, cols, _ in calls] == [[0, 0, 0, 0], [1, 1, 1, 1]]


def test_the_trained_step_count_truncates_as_flow_grpo_does(make_config):
    # K = int(W · fraction), at least 1: 10 · 0.75 = 7.5 → 7 (rounding would give 8), 3 · 0.1 → 1
    assert trained_columns(torch.arange(2), 10, 0.75, "first", 0, 0).tolist() == [list(range(7))] * 2
    assert trained_columns(torch.arange(2), 10, 0.75, "random", 0, 0).shape == (2, 7)
    assert trained_columns(torch.arange(1), 3, 0.1, "first", 0, 0).tolist() == [[0]]
    # what `estimate` counts is the same K (11 sampling steps: a window of 10 SDE steps)
    cfg = make_config("sampling.num_steps=11", "algorithm.timestep_fraction=0.75")
    assert PolicyGradient.trained_calls(cfg.algorithm, cfg.sampling) == 7


def test_random_timesteps_differ_between_samples_and_repeat_for_the_same_seed_and_step(make_trainer, tmp_path):
    def columns(seed: int, step: int) -> torch.Tensor:
        return trained_columns(torch.arange(8), 4, 0.5, "random", seed, step)

    options = ("sampling.num_steps=5", "algorithm.timestep_fraction=0.5", "algorithm.timestep_selection=random")
    picked = columns(0, 3)
    assert picked.shape == (8, 2)
    assert all(len(set(row)) == 2 and min(row) >= 0 and max(row) < 4 for row in picked.tolist())
    assert len({tuple(sorted(row)) for row in picked.tolist()}) > 1, "every sample trained the same steps"
    assert torch.equal(columns(0, 3), picked)
    assert not torch.equal(columns(0, 4), picked)
    assert not torch.equal(columns(1, 3), picked)

    # the update trains exactly those columns
    trainer = make_trainer(*options, "train.total_steps=1", f"run.dir={tmp_path / 'run'}")
    calls = _record_backward_steps(trainer.engine)
    trainer.train()
    expected = trained_columns(torch.arange(4), 4, 0.5, "random", trainer.cfg.run.seed, 0)
    assert torch.equal(torch.stack([cols for _, cols, _ in calls], dim=1), expected)


def test_zero_advantage_samples_are_left_out_of_the_gradient(make_trainer):
    trainer = make_trainer("algorithm.drop_zero_advantage=true")
    worker = trainer.engine
    prompts = make_step_prompts(trainer.records, trainer.sampler, 0, trainer.cfg.data.group_size)
    trainer.engine.generate(prompts, 0, window_for_step(trainer.cfg.sampling, 0, 0))
    traj = worker.kept.rows(0)

    grads = []

    def capture() -> float:  # keep the gradient, leave the weights as they are
        grads.append([p.grad.clone() for p in worker.model.trainable_parameters()])
        worker.optimizer.optimizer.zero_grad(set_to_none=True)
        return 0.0

    worker.optimizer.step = capture
    metrics = worker.update(_targets(1.0, 0.0, -1.0, 0.0), 0)
    assert metrics["train/kept_fraction"] == 0.5
    worker.kept.add(0, traj[torch.tensor([0, 2])])  # the two kept rows alone
    worker.update(_targets(1.0, -1.0), 0)
    scale = max(float(g.abs().max()) for g in grads[1])
    assert scale > 0
    assert _max_abs_diff(grads[0], grads[1]) <= 1e-5 * scale


def test_all_zero_advantages_with_drop_make_no_optimizer_step(make_trainer, tmp_path, user_reward, weights):
    constant = user_reward("return np.zeros(len(images), dtype=np.float32)")
    rows = {}
    for drop in (True, False):
        trainer = make_trainer(
            f"run.dir={tmp_path / str(drop)}",
            f"rewards.0.name={constant}",
            f"algorithm.drop_zero_advantage={str(drop).lower()}",
            "train.total_steps=1",
        )
        before = weights(trainer)
        rows[drop] = trainer.train()[0]
        after = weights(trainer)
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        assert unchanged == drop  # without drop, AdamW's weight decay still moves the weights
    assert rows[True]["advantage/abs_mean"] == 0
    assert rows[True]["train/kept_fraction"] == 0
    assert rows[True]["train/optimizer_steps"] == 0
    assert rows[False]["train/kept_fraction"] == 1
    assert rows[False]["train/optimizer_steps"] == 1


@pytest.mark.parametrize("mode", ["bypass", "decoupled"])
def test_rejected_fraction_is_the_share_of_rejected_sample_steps_of_the_update(make_trainer, mode):
    # B = 4 samples × K = 3 trained steps in 2 micro-batches of 2: 6 backward passes over 12 (sample, step) entries
    trainer = make_trainer(
        "train.micro_batch_size=2",
        f"algorithm.rollout_correction.mode={mode}",
        "algorithm.rollout_correction.rs_stat=k2",
        "algorithm.rollout_correction.rs_bound=1.0",
    )
    worker = trainer.engine
    prompts = make_step_prompts(trainer.records, trainer.sampler, 0, trainer.cfg.data.group_size)
    trainer.engine.generate(prompts, 0, window_for_step(trainer.cfg.sampling, 0, 0))
    traj = worker.kept.rows(0)
    assert traj.log_probs.shape == (4, 3)
    # the rollout's log-prob of 3 entries, 2 in the first micro-batch and 1 in the second, is off by 5:
    # log w = −5, k2 = 12.5 > 1, rejected; the others match the current policy (k2 ≈ 0), kept
    for row, col in [(0, 0), (1, 2), (3, 1)]:
        traj.log_probs[row, col] += 5.0
    metrics = worker.update(_targets(1.0, -1.0, 1.0, -1.0), 0)
    assert metrics["rollout_corr/rejected_fraction"] == pytest.approx(3 / 12, abs=1e-6)
    # off-policy diagnostics over the same 12 entries: three at log w = −5, nine at 0
    assert metrics["rollout_corr/kl"] == pytest.approx(3 * 5 / 12, abs=1e-3)
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(3 * (math.exp(-5) - 1 + 5) / 12, abs=1e-3)
    assert metrics["rollout_corr/chi2_step"] == pytest.approx((3 * math.exp(-10) + 9) / 12 - 1, abs=1e-3)


def test_only_a_plan_whose_rows_may_lag_reports_their_staleness():
    # rows sampled by the weights of steps 4, 3, 3, 2, trained at step 4: staleness 0, 1, 1, 2
    traj = type("Rows", (), {"ids": type("Ids", (), {"policy_version": torch.tensor([4, 3, 3, 2])})})
    assert UpdatePlan().staleness(4, traj) == {}  # colocated: always on-policy, nothing reported
    assert UpdatePlan(staleness_bound=2).staleness(4, traj) == {
        "rollout/staleness_mean": 1.0,
        "rollout/staleness_max": 2.0,
        "rollout/staleness_1_fraction": 0.5,
        "rollout/staleness_2_fraction": 0.25,
    }
