"""Step formulas against numbers worked out by hand or with plain `math` on scalars, plus sampling statistics."""

import math

import pytest
import torch

from diffusion_rl.config.plugins import STEP_TYPES
from diffusion_rl.errors import UserError
from diffusion_rl.sampling.sde import STEP_TYPE_NAMES, StepOutput
from diffusion_rl.utils.seeding import make_generator

# The worked example: one pixel, one step from sigma 0.8 to 0.6 (dt = -0.2), and an observed next value.
X, V, SIGMA, SIGMA_NEXT, A, X_PREV = 0.5, -0.3, 0.8, 0.6, 0.7, 0.42
LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))
RANDOM_TYPES = ["sde", "sde_linear", "cps", "dance_sde"]


def scalar(value: float) -> torch.Tensor:
    return torch.tensor([[value]])  # [B=1, 1]


def run_scalar(name, x=X, v=V, sigma=SIGMA, sigma_next=SIGMA_NEXT, a=A, prev=X_PREV) -> StepOutput:
    return STEP_TYPES.get(name)(scalar(x), scalar(v), sigma, sigma_next, a, prev_sample=scalar(prev))


# --- plain-python references, one element at a time -------------------------------------------------------------


def ref_sde(x, v, s, s_next, a, x_prev):
    s_tilde = s_next if s == 1 else s
    std = a * math.sqrt(s / (1 - s_tilde))
    dt = s_next - s
    mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    noise_std = std * math.sqrt(-dt)
    log_prob = -((x_prev - mean) ** 2) / (2 * noise_std**2) - math.log(noise_std) - LOG_SQRT_2PI
    return mean, std, log_prob


def ref_sde_linear(x, v, s, s_next, a, x_prev):
    # flow_grpo's Wan step with sigma_max = a, sigma_min = 0; its reported std is the noise std
    std_dev_t = a * s
    dt = s_next - s
    mean = x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
    noise_std = std_dev_t * math.sqrt(-dt)
    log_prob = -((x_prev - mean) ** 2) / (2 * noise_std**2) - math.log(noise_std) - LOG_SQRT_2PI
    return mean, noise_std, log_prob


def ref_cps(x, v, s, s_next, a, x_prev):
    std = s_next * math.sin(a * math.pi / 2)
    x0, x1 = x - s * v, x + (1 - s) * v
    mean = x0 * (1 - s_next) + x1 * math.sqrt(s_next**2 - std**2)
    return mean, std, -((x_prev - mean) ** 2)


def ref_dance(x, v, s, s_next, a, x_prev):
    dt = s_next - s
    x0 = x - s * v
    score = -(x - x0 * (1 - s)) / s**2
    mean = x + dt * v - 0.5 * a**2 * score * dt
    std = a * math.sqrt(s - s_next)
    log_prob = -((x_prev - mean) ** 2) / (2 * std**2) - math.log(std) - LOG_SQRT_2PI
    return mean, std, log_prob


REFS = {"sde": ref_sde, "sde_linear": ref_sde_linear, "cps": ref_cps, "dance_sde": ref_dance}


# --- single-element worked examples ----------------------------------------------------------------------------


def test_ode_is_euler_step_with_zero_log_prob():
    out = run_scalar("ode", prev=0.56)
    assert out.mean.item() == pytest.approx(0.5 + (-0.3) * (-0.2), abs=1e-7)  # 0.56
    assert out.prev_sample.item() == pytest.approx(0.56)
    assert out.log_prob.item() == 0 and out.std.item() == 0
    drawn = STEP_TYPES.get("ode")(scalar(X), scalar(V), SIGMA, SIGMA_NEXT, A)
    assert drawn.prev_sample.item() == pytest.approx(0.56)


def test_sde_worked_example():
    out = run_scalar("sde")
    # std = 0.7·sqrt(0.8 / 0.2) = 1.4
    # mean = 0.5·(1 + 1.96/1.6·(-0.2)) + (-0.3)·(1 + 1.96·0.2/1.6)·(-0.2) = 0.3775 + 0.0747 = 0.4522
    assert out.std.item() == pytest.approx(1.4, rel=1e-6)
    assert out.mean.item() == pytest.approx(0.4522, abs=1e-6)
    noise_std = 1.4 * math.sqrt(0.2)
    expected = -((0.42 - 0.4522) ** 2) / (2 * noise_std**2) - math.log(noise_std) - LOG_SQRT_2PI
    assert out.log_prob.item() == pytest.approx(expected, abs=1e-6)
    assert out.prev_sample.item() == pytest.approx(X_PREV)


def test_sde_at_sigma_one_uses_next_sigma_in_the_std_denominator():
    out = run_scalar("sde", sigma=1.0, sigma_next=0.75)
    # std = 0.7·sqrt(1 / (1 - 0.75)) = 1.4; the v coefficient's std² term vanishes since 1 - sigma = 0
    # mean = 0.5·(1 + 1.96/2·(-0.25)) + (-0.3)·(-0.25) = 0.3775 + 0.075 = 0.4525
    assert out.std.item() == pytest.approx(1.4, rel=1e-6)
    assert out.mean.item() == pytest.approx(0.4525, abs=1e-6)
    assert torch.isfinite(out.log_prob).all()
    assert out.log_prob.item() == pytest.approx(ref_sde(X, V, 1.0, 0.75, A, X_PREV)[2], abs=1e-5)


def test_cps_worked_example():
    out = run_scalar("cps")
    # std = 0.6·sin(0.35π); x0 = 0.5 + 0.8·0.3 = 0.74; x1 = 0.5 - 0.2·0.3 = 0.44
    std = 0.6 * math.sin(0.35 * math.pi)
    mean = 0.74 * 0.4 + 0.44 * math.sqrt(0.36 - std**2)
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    assert out.mean.item() == pytest.approx(mean, abs=1e-6)
    assert out.log_prob.item() == pytest.approx(-((0.42 - mean) ** 2), abs=1e-7)


def test_dance_sde_worked_example():
    out = run_scalar("dance_sde")
    # x0 = 0.74; score = -(0.5 - 0.74·0.2) / 0.64 = -0.55
    # mean = 0.5 + (-0.2)(-0.3) - 0.5·0.49·(-0.55)·(-0.2) = 0.56 - 0.02695 = 0.53305; std = 0.7·sqrt(0.2)
    std = 0.7 * math.sqrt(0.2)
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    assert out.mean.item() == pytest.approx(0.53305, abs=1e-6)
    expected = -((0.42 - 0.53305) ** 2) / (2 * std**2) - math.log(std) - LOG_SQRT_2PI
    assert out.log_prob.item() == pytest.approx(expected, abs=1e-6)


# --- tensors: per-row sigmas, mean over non-batch dims ---------------------------------------------------------


@pytest.mark.parametrize("name", RANDOM_TYPES)
def test_log_prob_is_mean_of_elementwise_densities(name):
    gen = torch.Generator().manual_seed(0)
    x, v, prev = (torch.randn(3, 2, 5, generator=gen) for _ in range(3))
    sigma = torch.tensor([1.0, 0.5, 0.3]) if name.startswith("sde") else torch.tensor([0.9, 0.5, 0.3])
    sigma_next = torch.tensor([0.7, 0.45, 0.1])
    out = STEP_TYPES.get(name)(x, v, sigma, sigma_next, 0.8, prev_sample=prev)
    assert out.log_prob.shape == (3,) and out.std.shape == (3,) and out.mean.shape == x.shape
    for i in range(3):
        s, s_next = sigma[i].item(), sigma_next[i].item()
        means, log_probs = [], []
        for x_e, v_e, p_e in zip(x[i].flatten().tolist(), v[i].flatten().tolist(), prev[i].flatten().tolist()):
            mean, std, log_prob = REFS[name](x_e, v_e, s, s_next, 0.8, p_e)
            means.append(mean)
            log_probs.append(log_prob)
        assert out.std[i].item() == pytest.approx(std, rel=1e-5)
        assert out.mean[i].flatten().tolist() == pytest.approx(means, rel=1e-5, abs=1e-6)
        assert out.log_prob[i].item() == pytest.approx(sum(log_probs) / len(log_probs), rel=1e-5, abs=1e-6)


def test_float_and_per_row_sigmas_agree():
    gen = torch.Generator().manual_seed(1)
    x, v, prev = (torch.randn(2, 4, generator=gen) for _ in range(3))
    step = STEP_TYPES.get("sde")
    rows = step(x, v, torch.tensor([0.8, 0.8]), torch.tensor([0.6, 0.6]), A, prev_sample=prev)
    scalars = step(x, v, 0.8, 0.6, A, prev_sample=prev)
    for a, b in zip(rows, scalars):
        torch.testing.assert_close(a, b)


# --- sampling --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RANDOM_TYPES)
def test_rescoring_a_drawn_sample_gives_its_log_prob(name):
    gen = torch.Generator().manual_seed(2)
    x, v = torch.randn(4, 3, 8, generator=gen), torch.randn(4, 3, 8, generator=gen)
    step = STEP_TYPES.get(name)
    drawn = step(x, v, 0.8, 0.6, A, generator=make_generator(3))
    rescored = step(x, v, 0.8, 0.6, A, prev_sample=drawn.prev_sample)
    assert (drawn.log_prob - rescored.log_prob).abs().max() <= 1e-6
    torch.testing.assert_close(rescored.prev_sample, drawn.prev_sample, rtol=0, atol=0)


@pytest.mark.parametrize(
    "name, noise_std",
    [("sde", 1.4 * math.sqrt(0.2)), ("sde_linear", 0.7 * 0.8 * math.sqrt(0.2)), ("cps", None), ("dance_sde", None)],
)
def test_drawn_samples_have_the_stated_mean_and_std(name, noise_std):
    n = 200_000
    gen = torch.Generator().manual_seed(4)
    x, v = torch.randn(1, n, generator=gen), torch.randn(1, n, generator=gen)
    out = STEP_TYPES.get(name)(x, v, 0.8, 0.6, A, generator=make_generator(5))
    expected_std = noise_std if noise_std is not None else out.std.item()
    if name == "sde":
        assert out.std.item() * math.sqrt(0.2) == pytest.approx(expected_std, rel=1e-6)
    residual = (out.prev_sample - out.mean).double()
    # Standard errors: std/sqrt(n) for the mean (~0.0022·std), std/sqrt(2n) for the std (~0.16%).
    assert abs(residual.mean().item()) < 5 * expected_std / math.sqrt(n)
    assert residual.std().item() == pytest.approx(expected_std, rel=0.01)


@pytest.mark.parametrize("name", RANDOM_TYPES)
def test_tiny_noise_level_approaches_the_ode_step(name):
    gen = torch.Generator().manual_seed(6)
    x, v = torch.randn(2, 16, generator=gen), torch.randn(2, 16, generator=gen)
    out = STEP_TYPES.get(name)(x, v, 0.8, 0.6, 1e-6, generator=make_generator(7))
    euler = x + v * (0.6 - 0.8)
    torch.testing.assert_close(out.mean, euler, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.prev_sample, euler, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", RANDOM_TYPES)
def test_zero_noise_level_is_deterministic_with_zero_log_prob_and_finite_grads(name):
    x = torch.randn(2, 6)
    v = torch.randn(2, 6, requires_grad=True)
    out = STEP_TYPES.get(name)(x, v, 0.8, 0.6, 0.0, generator=make_generator(8))
    assert torch.equal(out.std, torch.zeros(2))
    assert torch.equal(out.log_prob, torch.zeros(2))
    torch.testing.assert_close(out.prev_sample, out.mean, rtol=0, atol=0)
    torch.testing.assert_close(out.mean, x + v * (0.6 - 0.8))
    out.log_prob.sum().backward()
    assert torch.isfinite(v.grad).all()


@pytest.mark.parametrize("name", RANDOM_TYPES)
def test_log_prob_gradient_flows_through_the_mean_only(name):
    x = torch.randn(2, 6)
    v = torch.randn(2, 6, requires_grad=True)
    prev = torch.randn(2, 6, requires_grad=True)
    out = STEP_TYPES.get(name)(x, v, 0.8, 0.6, A, prev_sample=prev)
    out.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert prev.grad is None


@pytest.mark.parametrize("name", RANDOM_TYPES)
def test_per_row_generators_make_rows_independent_of_batch_split(name):
    gen = torch.Generator().manual_seed(9)
    x, v = torch.randn(4, 2, 3, generator=gen), torch.randn(4, 2, 3, generator=gen)
    sigma, sigma_next = torch.tensor([0.9, 0.8, 0.7, 0.6]), torch.tensor([0.8, 0.7, 0.6, 0.5])
    step = STEP_TYPES.get(name)
    batch = step(x, v, sigma, sigma_next, A, generator=[make_generator(10, i) for i in range(4)])
    for i in range(4):
        row = step(
            x[i : i + 1], v[i : i + 1], sigma[i : i + 1], sigma_next[i : i + 1], A, generator=[make_generator(10, i)]
        )
        assert torch.equal(row.prev_sample[0], batch.prev_sample[i])
        torch.testing.assert_close(row.log_prob[0], batch.log_prob[i], rtol=0, atol=1e-7)


def test_one_generator_draws_the_whole_batch_at_once():
    x, v = torch.zeros(3, 5), torch.zeros(3, 5)
    out = STEP_TYPES.get("cps")(x, v, 0.8, 0.6, 1.0, generator=make_generator(11))
    # noise_level 1: std = sigma_next = 0.6 and, with x = v = 0, mean = 0, so the sample is 0.6·noise.
    noise = torch.randn(3, 5, generator=make_generator(11))
    torch.testing.assert_close(out.prev_sample, 0.6 * noise)


@pytest.mark.parametrize("name", ["ode", *RANDOM_TYPES])
def test_bf16_inputs_give_fp32_outputs_of_the_rounded_values(name):
    gen = torch.Generator().manual_seed(12)
    x, v, prev = (torch.randn(2, 3, 4, generator=gen).bfloat16() for _ in range(3))
    step = STEP_TYPES.get(name)
    for kwargs, kwargs32 in [
        ({"prev_sample": prev}, {"prev_sample": prev.float()}),
        ({"generator": make_generator(13)}, {"generator": make_generator(13)}),
    ]:
        out = step(x, v, 0.8, 0.6, A, **kwargs)
        out32 = step(x.float(), v.float(), 0.8, 0.6, A, **kwargs32)
        for got, want in zip(out, out32):
            assert got.dtype == torch.float32
            assert torch.equal(got, want)


# --- validation ------------------------------------------------------------------------------------------------


def test_registered_step_types():
    assert set(STEP_TYPE_NAMES) == {"ode", "sde", "sde_linear", "cps", "dance_sde"}


def test_unknown_step_type_lists_valid_names():
    with pytest.raises(UserError, match="unknown step type 'sdee'") as info:
        STEP_TYPES.get("sdee")
    for name in STEP_TYPE_NAMES:
        assert name in str(info.value)  # the CLI prints it as a one-line config error


def test_bad_shapes_and_generator_counts_are_rejected():
    step = STEP_TYPES.get("sde")
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape \\[B\\]=\\[2\\]"):
        step(x, x, torch.tensor([0.8, 0.8, 0.8]), 0.6, A)
    with pytest.raises(ValueError, match="v must have the shape of x"):
        step(x, torch.zeros(2, 4), 0.8, 0.6, A)
    with pytest.raises(ValueError, match="one per row"):
        step(x, x, 0.8, 0.6, A, generator=[make_generator(0)])
    # the schedule (sigma ≤ 1, decreasing, ≥ 0) is checked once where it is made, not by each step: check_sigmas,
    # tests/sampling/test_no_host_sync.py; the noise level when the config loads


@pytest.mark.parametrize("name", ["ode", *RANDOM_TYPES])
def test_video_latents_step_elementwise_and_average_over_channels_frames_rows_and_columns(name):
    # Video latents [B, C, F, H, W]: every step type acts element by element and its log-prob is the mean over all
    # C·F·H·W elements, checked against the scalar references on each element of two 2×3×2×2 videos.
    gen = torch.Generator().manual_seed(3)
    x, v, prev = (torch.randn(2, 2, 3, 2, 2, generator=gen) for _ in range(3))
    sigma, sigma_next = torch.tensor([0.9, 0.4]), torch.tensor([0.6, 0.25])
    out = STEP_TYPES.get(name)(x, v, sigma, sigma_next, 0.7, prev_sample=prev)
    assert out.mean.shape == x.shape and out.log_prob.shape == (2,) and out.std.shape == (2,)
    for i in range(2):
        s, s_next = sigma[i].item(), sigma_next[i].item()
        triples = zip(x[i].flatten().tolist(), v[i].flatten().tolist(), prev[i].flatten().tolist())
        if name == "ode":
            means = [x_e + v_e * (s_next - s) for x_e, v_e, _ in triples]
            log_probs = [0.0]
        else:
            refs = [REFS[name](x_e, v_e, s, s_next, 0.7, p_e) for x_e, v_e, p_e in triples]
            means, log_probs = [r[0] for r in refs], [r[2] for r in refs]
        assert len(means) == 2 * 3 * 2 * 2
        assert out.mean[i].flatten().tolist() == pytest.approx(means, rel=1e-5, abs=1e-6)
        assert out.log_prob[i].item() == pytest.approx(sum(log_probs) / len(log_probs), rel=1e-5, abs=1e-6)
    # a drawn video sample is its own batch element's: the same whether drawn alone or in a batch
    generators = [make_generator(1), make_generator(2)]
    both = STEP_TYPES.get(name)(x, v, sigma, sigma_next, 0.7, generator=generators)
    alone = STEP_TYPES.get(name)(x[1:], v[1:], sigma[1:], sigma_next[1:], 0.7, generator=[make_generator(2)])
    assert torch.equal(both.prev_sample[1:], alone.prev_sample)


def test_sde_linear_advice_names_the_schedules_sigma_max_when_the_noise_level_is_elsewhere():
    from diffusion_rl.sampling.sde import sde_linear_advice

    sigmas = [1.0, 0.9966, 0.99, 0.0]  # sigmas[1]: flow_grpo's σ_max for its Wan step
    line = sde_linear_advice("sde_linear", 0.9819, sigmas)
    assert line is not None and "sampling.noise_level=0.9966" in line and "0.9819" in line
    assert sde_linear_advice("sde_linear", 0.9968, sigmas) is None  # within 5e-4: the config's rounding
    assert sde_linear_advice("sde", 0.7, sigmas) is None  # only sde_linear's level is a σ
    assert sde_linear_advice("sde_linear", 0.5, [1.0]) is None  # no step: nothing to say
