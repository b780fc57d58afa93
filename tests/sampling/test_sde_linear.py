"""The `sde_linear` step against flow_grpo's Wan step (flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py,
`sde_step_with_logprob`) written out element by element in plain Python, and its KL to the reference against the
Gaussian KL. flow_grpo's step, with σ_max = sigmas[1] and σ_min = sigmas[-1] of the sampler's schedule:

    std_dev_t = σ_min + (σ_max − σ_min)·σ
    mean      = x·(1 + std_dev_t²/(2σ)·dt) + v·(1 + std_dev_t²·(1 − σ)/(2σ))·dt,    dt = σ_next − σ
    sample    = mean + std_dev_t·√(−dt)·ε
    log_prob  = mean over elements of log N(sample; mean, (std_dev_t·√(−dt))²)
    kl (train_wan2_1.py) = mean over elements of (mean − ref_mean)² / (2·(std_dev_t·√(−dt))²)
"""

import math
from pathlib import Path

import pytest
import torch

from diffusion_rl.algorithms.policy_gradient import PolicyLossInput, kl_to_reference
from diffusion_rl.config import load
from diffusion_rl.config.plugins import STEP_TYPES
from diffusion_rl.models.families.wan import unipc_flow_sigmas
from diffusion_rl.utils.seeding import make_generator

ROOT = Path(__file__).resolve().parents[2]
STEP = STEP_TYPES.get("sde_linear")
LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


def flow_grpo_wan_step(x, v, eps, s, s_next, sigma_max, sigma_min):
    """flow_grpo's step on plain floats (lists of elements): mean, the std it uses, sample, log-prob (row mean)."""
    std_dev_t = sigma_min + (sigma_max - sigma_min) * s
    dt = s_next - s
    means = [x_e * (1 + std_dev_t**2 / (2 * s) * dt) + v_e * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
             for x_e, v_e in zip(x, v)]  # fmt: skip
    noise_std = std_dev_t * math.sqrt(-dt)
    samples = [m + noise_std * e for m, e in zip(means, eps)]
    log_probs = [-((p - m) ** 2) / (2 * noise_std**2) - math.log(noise_std) - LOG_SQRT_2PI
                 for p, m in zip(samples, means)]  # fmt: skip
    return means, noise_std, samples, sum(log_probs) / len(log_probs)


def test_worked_example():
    # σ 0.8 → 0.6, a = 0.7: std_dev_t = 0.56; x·(1 + 0.3136/1.6·(−0.2)) = 0.5·0.9608 = 0.4804;
    # v·(1 + 0.3136·0.2/1.6)·(−0.2) = −0.3·1.0392·(−0.2) = 0.062352; mean = 0.542752; noise std 0.56·√0.2 = 0.250440
    out = STEP(torch.tensor([[0.5]]), torch.tensor([[-0.3]]), 0.8, 0.6, 0.7, prev_sample=torch.tensor([[0.42]]))
    assert out.mean.item() == pytest.approx(0.542752, abs=1e-6)
    assert out.std.item() == pytest.approx(0.56 * math.sqrt(0.2), rel=1e-6)  # the noise std
    # −(0.42 − 0.542752)²/(2·0.06272) − ln 0.250440 − ln √(2π) = −0.120122 + 1.384537 − 0.918939
    assert out.log_prob.item() == pytest.approx(0.345476, abs=2e-6)


def test_matches_flow_grpo_over_the_wan_schedule_with_its_sigma_max():
    # Wan2.1-T2V-1.3B's 20 steps at flow_shift 3 (the recipe's); noise_level = σ_max = sigmas[1], σ_min = sigmas[-1]
    sigmas = unipc_flow_sigmas(20, 3.0, 1000).float()
    sigma_max, sigma_min = float(sigmas[1]), float(sigmas[-1])
    # u_1 = 1 − 0.999/20 = 0.95005, shifted 3·0.95005 / (1 + 2·0.95005) = 2.85015 / 2.9001
    assert sigma_min == 0.0 and sigma_max == pytest.approx(2.85015 / 2.9001, abs=1e-6)
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 2, 2, 1, 3, generator=gen), torch.randn(2, 2, 2, 1, 3, generator=gen)  # [B, C, F, H, W]
    for j in range(20):
        s, s_next = float(sigmas[j]), float(sigmas[j + 1])
        out = STEP(x, v, sigmas[j], sigmas[j + 1], sigma_max, generator=make_generator(7, j))
        eps = torch.randn(x.shape, generator=make_generator(7, j))  # the one generator draws the batch at once
        for i in range(2):
            x_i, v_i, eps_i = (t[i].flatten().tolist() for t in (x, v, eps))
            means, noise_std, samples, log_prob = flow_grpo_wan_step(x_i, v_i, eps_i, s, s_next, sigma_max, sigma_min)
            assert out.mean[i].flatten().tolist() == pytest.approx(means, rel=1e-5, abs=1e-6), j
            assert out.std[i].item() == pytest.approx(noise_std, rel=1e-5), j
            assert out.prev_sample[i].flatten().tolist() == pytest.approx(samples, rel=1e-5, abs=1e-6), j
            assert out.log_prob[i].item() == pytest.approx(log_prob, rel=1e-5, abs=1e-5), j
        replayed = STEP(x, v, sigmas[j], sigmas[j + 1], sigma_max, prev_sample=out.prev_sample)
        assert torch.equal(replayed.log_prob, out.log_prob) and torch.equal(replayed.mean, out.mean)


def test_kl_to_reference_is_the_gaussian_kl_as_flow_grpo_wan_computes_it():
    gen = torch.Generator().manual_seed(1)
    x, v, v_ref = (torch.randn(2, 3, 4, generator=gen) for _ in range(3))
    sigma, sigma_next, a = torch.tensor([0.9, 0.3]), torch.tensor([0.8, 0.1]), 0.98
    policy = STEP(x, v, sigma, sigma_next, a, prev_sample=x)
    ref = STEP(x, v_ref, sigma, sigma_next, a, prev_sample=x)
    inp = PolicyLossInput(log_prob=policy.log_prob, old_log_prob=policy.log_prob, advantages=torch.zeros(2),
                          mean=policy.mean, old_mean=policy.mean, ref_mean=ref.mean, std=policy.std,
                          sqrt_dt=(sigma - sigma_next).sqrt())  # fmt: skip
    kl = kl_to_reference(inp, kl_beta=0.004)
    for i in range(2):
        s, s_next = sigma[i].item(), sigma_next[i].item()
        std1 = std2 = a * s * math.sqrt(s - s_next)  # both steps' noise std: the same step, another velocity
        mu1, mu2 = policy.mean[i].flatten().tolist(), ref.mean[i].flatten().tolist()
        # KL(N(μ1, s1²) ‖ N(μ2, s2²)) per element, averaged over the elements
        true_kl = [math.log(std2 / std1) + (std1**2 + (m1 - m2) ** 2) / (2 * std2**2) - 0.5 for m1, m2 in zip(mu1, mu2)]
        assert kl[i].item() == pytest.approx(sum(true_kl) / len(true_kl), rel=1e-5)
        # train_wan2_1.py: ((mean − ref_mean)²).mean / (2·(std_dev_t·√(−dt))²), std_dev_t = a·σ
        squared = sum((m1 - m2) ** 2 for m1, m2 in zip(mu1, mu2)) / len(mu1)
        flow_grpo = squared / (2 * (a * s * math.sqrt(s - s_next)) ** 2)
        assert kl[i].item() == pytest.approx(flow_grpo, rel=1e-5)
        assert kl[i].item() > 0


@pytest.mark.parametrize("loss", ["grpo_guard", "flow_dppo", "tempflow_grpo", "flash_grpo"])
def test_the_losses_written_for_the_sde_step_refuse_it(loss):
    # their formulas read the `sde` step's std as std_dev_t without √dt; sde_linear reports the noise std
    window = ["sampling.window.kind=random", "sampling.window.size=1"] if loss == "flash_grpo" else []
    with pytest.raises(Exception, match="sde_type=sde"):
        load(ROOT / "configs/quickstart_flow_grpo.yaml", [f"algorithm.loss={loss}", "sampling.sde_type=sde_linear",
                                                          *window])  # fmt: skip
