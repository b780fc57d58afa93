"""benchmarks/gradient_noise.py: the noise-scale estimator against known statistics, and the per-group gradients it
records against the gradient of a plain update of the same batch."""

import argparse
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def noise(load_benchmark):
    return load_benchmark("gradient_noise")


def test_the_estimates_recover_a_known_signal_and_noise(noise):
    # group gradients h_j = G + e_j with |G|² = 4 (G = 2 on one axis) and e_j ~ N(0, σ² I): tr Σ = P σ² = 50·0.5
    gen = torch.Generator().manual_seed(0)
    P, groups, sigma2 = 50, 4000, 0.5
    signal = torch.zeros(P, dtype=torch.float64)
    signal[0] = 2.0
    grads = signal + (sigma2**0.5) * torch.randn(groups, P, generator=gen, dtype=torch.float64)
    out = noise.noise_scale(grads, replicates=50)
    assert out["trace_sigma"] == pytest.approx(P * sigma2, rel=0.03)
    assert out["signal_sq_norm"] == pytest.approx(4.0, rel=0.05)
    assert out["b_noise_groups"] == pytest.approx(P * sigma2 / 4.0, rel=0.07)
    # two halves of 2000 groups: cos ≈ |G|² / (|G|² + tr Σ / 2000)
    assert out["half_batch_cosine"] == pytest.approx(4.0 / (4.0 + 25.0 / 2000), abs=0.01)
    assert out["signal_share_at"][8] == pytest.approx(4.0 / (4.0 + 25.0 / 8), rel=0.07)
    lo, hi = out["b_noise_groups_90ci"]
    assert lo <= out["b_noise_groups"] <= hi and hi < 1.3 * out["b_noise_groups"]
    assert len(out["gram"]) == groups


def test_the_interval_covers_a_weak_signal_buried_in_noise(noise):
    # |G|² = 0.01 against tr Σ = 4 per group: B_noise = 400 groups, far more than the 32 measured. The interval must
    # reach it (a percentile bootstrap centres on |mean h|², which is |G|² + tr Σ / 32, and misses it by ~10×).
    P, groups = 400, 32
    covered = 0
    for trial in range(20):
        gen = torch.Generator().manual_seed(100 + trial)
        signal = torch.zeros(P, dtype=torch.float64)
        signal[0] = 0.1
        grads = signal + 0.1 * torch.randn(groups, P, generator=gen, dtype=torch.float64)
        lo, hi = noise.estimates(torch.as_tensor(grads @ grads.T), replicates=400)["b_noise_groups_90ci"]
        covered += (lo is None or lo <= 400) and (hi is None or hi >= 400)
    assert covered >= 15  # a 90 % interval: 18 of 20 expected


def test_pure_noise_is_reported_unresolved(noise):
    gen = torch.Generator().manual_seed(1)
    out = noise.noise_scale(torch.randn(64, 30, generator=gen, dtype=torch.float64))
    assert out["b_noise_groups"] is None or out["b_noise_groups"] > 30  # no signal: none, or a huge batch
    assert abs(out["half_batch_cosine"]) < 0.5


def test_the_recorded_group_gradients_average_to_the_plain_update_gradient(noise, load_benchmark, shapes_model,
                                                                             tmp_path):  # fmt: skip
    """The recorder's mean over groups is the gradient the trainer's own update (one mini-batch) would step with."""
    learning = load_benchmark("learning")
    from diffusion_rl.sampling.window import window_for_step
    from diffusion_rl.trainer import make_trainer
    from diffusion_rl.trainer.timing import PhaseTimer

    info = learning.ensure_base_model(shapes_model)
    small = ["sampling.num_steps=3", "val.n=1", "data.group_size=2", "data.prompts_per_step=2"]
    args = argparse.Namespace(seed=0, threads=2, set=small, groups=2, step=0, label="", work=str(tmp_path))
    measured = noise.measure("flow_grpo", ROOT / "configs/quickstart_flow_grpo.yaml", args, shapes_model, info)
    assert measured["groups"] == 2 and measured["parameters"] > 0

    # the same step through the plain update loop, the optimizer step replaced by a read of the gradient
    cfg = learning.build_config(ROOT / "configs/quickstart_flow_grpo.yaml", tmp_path / "plain",
                                argparse.Namespace(seed=0, threads=2, set=small), shapes_model, info)  # fmt: skip
    torch.manual_seed(0)
    trainer = make_trainer(cfg)
    worker = trainer.engine
    collected = trainer.source.collect(0, window_for_step(cfg.sampling, cfg.run.seed, 0), PhaseTimer())
    targets, _ = trainer.algorithm.prepare(collected.scored, collected.prompts.group_index)
    seen = []

    def read_gradient() -> float:
        seen.append(torch.cat([p.grad.reshape(-1).double() for p in worker.optimizer.params]))
        worker.optimizer.optimizer.zero_grad(set_to_none=True)
        return 1.0

    worker.optimizer.step = read_gradient
    worker.update(targets, 0)
    assert len(seen) == 1
    assert measured["batch_grad_sq_norm"] == pytest.approx(float((seen[0] ** 2).sum()), rel=1e-6)
