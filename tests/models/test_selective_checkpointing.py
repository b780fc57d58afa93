"""Selective gradient checkpointing (`model.gradient_checkpointing`: true, false, N, auto; models/checkpointing.py):
the count auto chooses, exactly N blocks checkpointed, gradients unchanged, the bad values, and estimate's peak at the
chosen count."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from diffusion_rl.config import load
from diffusion_rl.errors import UserError
from diffusion_rl.estimate.architectures import architecture_for
from diffusion_rl.estimate.devices import DEVICES
from diffusion_rl.estimate.estimator import estimate
from diffusion_rl.models.checkpointing import (
    CHECKPOINTED,
    MARGIN,
    CheckpointPlan,
    checkpointable_blocks,
    marked_blocks,
    resolved,
)

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs/quickstart_flow_grpo.yaml"
GIB = 2**30


def chosen_by_loop(fixed, blocks, per_block, block_input, free):
    """The fewest checkpointed blocks whose peak leaves 5 % of `free` unused, walked block by block."""
    for n in range(blocks + 1):
        live = n * block_input + (blocks - n) * per_block  # inputs kept; the plain blocks' activations
        if n == blocks:
            live += per_block  # the last checkpointed block recomputed in the backward
        if fixed + live <= 0.95 * free:
            return n
    return blocks


@pytest.mark.parametrize(
    "fixed, free, expected",
    [
        (40 * GIB, 100 * GIB, 0),  # 40 + 10 × 4 = 80 ≤ 0.95 × 100: nothing to checkpoint
        (40 * GIB, 80 * GIB, 2),  # room 76 − 40 = 36: 2 × 0.5 + 8 × 4 = 33 fits, 0.5 + 9 × 4 = 36.5 does not
        (40 * GIB, 50 * GIB, 10),  # room 7.5: 10 × 0.5 + 4 = 9 does not fit either: every block
        (60 * GIB, 70 * GIB, 10),  # room 6.5: 10 × 0.5 + 4 = 9 too much; all of them (and it will not fit)
    ],
)
def test_auto_takes_the_fewest_blocks_that_fit_the_free_memory(fixed, free, expected):
    plan = CheckpointPlan(fixed=fixed, blocks=10, saved=10 * 4 * GIB, block_input=0.5 * GIB)
    assert plan.choose(free) == expected == chosen_by_loop(fixed, 10, 4 * GIB, 0.5 * GIB, free)
    assert MARGIN == 0.05
    assert plan.activations(0) == 40 * GIB and plan.activations(10) == 9 * GIB and plan.activations(3) == 29.5 * GIB


def test_auto_on_a_device_of_unknown_memory_checkpoints_nothing():
    assert CheckpointPlan(fixed=1e12, blocks=4, saved=4e9, block_input=1e8).choose(None) == 0


def checkpoint_calls(monkeypatch) -> list[torch.nn.Module]:
    """The callables torch.utils.checkpoint runs, recorded as they run (diffusers' path and ours both call it)."""
    calls, real = [], torch.utils.checkpoint.checkpoint

    def counted(function, *args, **kwargs):
        calls.append(function)
        return real(function, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counted)
    return calls


def gradients(model, setting) -> dict[str, torch.Tensor]:
    """d(sum of the velocity²)/dθ of every trained parameter at fixed latents, prompts and σ."""
    latents = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["a red cube", "a blue ball"], ["blurry", ""])
    model.velocity(latents, 0.6, cond, 4.0).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in model.policies.trained.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("setting, count", [(False, 0), (0, 0), (1, 1), (2, 2), (True, 2)])
def test_n_blocks_checkpointed_are_the_first_n_and_leave_the_gradients_as_they_were(
    tiny_model_dir, load, monkeypatch, setting, count
):
    model = load(tiny_model_dir, gradient_checkpointing=setting)
    network = model.policies.trained
    blocks = checkpointable_blocks(network)
    assert len(blocks) == 2  # the tiny SD3's two joint blocks
    if setting is not True:  # true is diffusers' own every-block path: no marks
        assert marked_blocks(network) == count
        assert [getattr(b, CHECKPOINTED, False) for b in blocks] == [True] * count + [False] * (2 - count)
    calls = checkpoint_calls(monkeypatch)
    grads = gradients(model, setting)
    assert len(calls) == count  # each checkpointed block recomputed once, no other
    assert [getattr(f, "__self__", None) for f in calls] == blocks[:count]
    plain = gradients(load(tiny_model_dir, gradient_checkpointing=False), False)
    assert grads.keys() == plain.keys() and len(grads) > 10
    # fp32 on the CPU: the recomputed forward is the same ops on the same inputs, so the same bits (allowed: 1e-6)
    assert max((grads[n] - plain[n]).abs().max().item() for n in grads) <= 1e-6


def test_flux_counts_its_double_blocks_then_its_single_blocks(flux_model_dir, load):
    model = load(flux_model_dir, gradient_checkpointing=1)
    network = model.policies.trained
    assert getattr(network.transformer_blocks[0], CHECKPOINTED, False)
    assert not getattr(network.single_transformer_blocks[0], CHECKPOINTED, False)


def test_more_blocks_than_the_transformer_has_is_refused_at_load(tiny_model_dir, load):
    with pytest.raises(UserError, match=r"model.gradient_checkpointing=3 but the transformer has 2 blocks") as e:
        load(tiny_model_dir, gradient_checkpointing=3)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "value, message",
    [
        ("-1", "config key .model.gradient_checkpointing. must be in \\[0, 1000\\], got -1"),
        ("sometimes", "expects bool | int | one of 'auto', got str 'sometimes'"),
        ("1.5", "expects bool | int | one of 'auto', got float 1.5"),
    ],
)
def test_bad_values_are_one_line_errors_at_config_load(value, message):
    with pytest.raises(UserError, match=message) as e:
        load(QUICKSTART, [f"model.gradient_checkpointing={value}"])
    assert "\n" not in str(e.value)


def test_every_earlier_value_still_loads():
    for value, expected in (("true", True), ("false", False), ("auto", "auto"), ("2", 2), ("0", 0)):
        assert load(QUICKSTART, [f"model.gradient_checkpointing={value}"]).model.gradient_checkpointing == expected


def test_auto_resolves_to_none_on_the_cpu_and_says_nothing_without_a_plan(caplog):
    cfg = load(QUICKSTART, ["model.gradient_checkpointing=auto"]).model
    plan = CheckpointPlan(fixed=1e12, blocks=4, saved=4e9, block_input=1e8)
    with caplog.at_level(logging.INFO):
        assert resolved(cfg, None, torch.device("cpu")).gradient_checkpointing == 0
        assert not caplog.text
        assert resolved(cfg, plan, torch.device("cpu")).gradient_checkpointing == 0
    assert "0 of 4 blocks checkpointed (no CUDA device" in caplog.text
    two = load(QUICKSTART, ["model.gradient_checkpointing=2"]).model
    assert resolved(two, plan, torch.device("cpu")) is two  # a count is the user's: kept


def test_estimate_reports_the_peak_at_the_chosen_count(tiny_model_dir):
    def run(setting, memory_gib=None):
        cfg = load(QUICKSTART, [f"model.path={tiny_model_dir}", f"model.gradient_checkpointing={setting}"])
        device = DEVICES["h200"].with_overrides(memory_gib=memory_gib)
        return estimate(cfg, architecture_for(cfg.model), device, 1)

    none, one, every = run("false"), run("1"), run("true")
    plan = one.checkpoint_plan
    assert (none.checkpointed_blocks, one.checkpointed_blocks, every.checkpointed_blocks) == (0, 1, 2)
    assert none.checkpoint_plan == plan == every.checkpoint_plan and plan.blocks == 2
    # the first block keeps its input, the second its activations: input + saved / 2 (two blocks)
    assert one.memory_gib["activations"] * GIB == plan.block_input + plan.saved / 2
    assert one.peak_memory_gib_per_gpu == (plan.fixed + plan.block_input + plan.saved / 2) / GIB
    assert none.peak_memory_gib_per_gpu == one.peak_memory_gib_per_gpu_unchecked == (plan.fixed + plan.saved) / GIB
    assert every.peak_memory_gib_per_gpu == one.peak_memory_gib_per_gpu_checkpointed
    # auto against a device whose memory fits only the one-block peak (with 5 % to spare): one block
    tight = one.peak_memory_gib_per_gpu / 0.95 + 1e-9
    assert none.peak_memory_gib_per_gpu > tight * 0.95  # the plain peak does not fit it
    assert run("auto", tight).checkpointed_blocks == 1
    assert run("auto", 10 * none.peak_memory_gib_per_gpu).checkpointed_blocks == 0
    assert one.phase_seconds["update"] < every.phase_seconds["update"]  # half the recompute
    with pytest.raises(UserError, match="model.gradient_checkpointing=5 but the transformer has 2 blocks"):
        run("5")


def test_a_run_plans_auto_only_where_a_worker_may_have_a_cuda_device(tiny_model_dir):
    from diffusion_rl.trainer.setup import checkpoint_plan

    def plan(*overrides):
        return checkpoint_plan(load(QUICKSTART, [f"model.path={tiny_model_dir}", *overrides]))

    assert plan("model.gradient_checkpointing=auto", "model.device=cpu") is None
    assert plan("model.gradient_checkpointing=true", "model.device=cuda") is None  # the user's setting: no plan
    cfg = load(QUICKSTART, [f"model.path={tiny_model_dir}", "model.gradient_checkpointing=auto"])
    expected = estimate(cfg, architecture_for(cfg.model), DEVICES["h200"], 1).checkpoint_plan
    assert plan("model.gradient_checkpointing=auto", "model.device=cuda") == expected and expected.blocks == 2
