"""What a loss's and a family's registration tell `diffusion-rl estimate`: the plugins own their facts (a loss
registered in its own file is costed and documented; a family's adapter gives its text tokens and meta inputs, and
a count made once is kept per architecture, shape and adapter)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from diffusion_rl.algorithms.base import register_loss
from diffusion_rl.algorithms.policy_gradient import (
    PolicyGradient,
    PolicyLossSettings,
    kl_to_reference,
    policy_loss_output,
)
from diffusion_rl.cli import main
from diffusion_rl.config import load
from diffusion_rl.config.plugins import FAMILIES, LOSSES
from diffusion_rl.estimate.architectures import architecture_for
from diffusion_rl.estimate.counting import Shapes, transformer_cost, vae_decode_cost
from diffusion_rl.estimate.devices import DEVICES
from diffusion_rl.estimate.estimator import estimate
from diffusion_rl.models.families.sd3 import SD3Model
from diffusion_rl.models.registry import ModelFamily, register_family

from .test_estimate import QUICKSTART, ROOT, SMALL_SD3, sd3_forward_flops_by_hand, small_sd3_arch


@dataclass
class ToyLossSettings(PolicyLossSettings):
    pass


def toy_loss(inp, settings):
    """REINFORCE on the step's log-prob: −A · log π (with the shared KL term)."""
    return policy_loss_output(inp, -inp.advantages * inp.log_prob, kl_to_reference(inp, settings.kl_beta),
                              settings.kl_beta)  # fmt: skip


@pytest.fixture
def toy_pg_loss():
    """A policy-gradient loss registered as its own file would register it, and nothing else edited."""
    register_loss("toy_pg", settings=ToyLossSettings, algorithm=PolicyGradient)(toy_loss)
    yield "toy_pg"
    LOSSES.remove("toy_pg")


def policy_gradient_update_by_hand(cfg, trained_steps: int) -> float:
    """The update's FLOPs of a policy-gradient step on one device: every row trains `trained_steps` steps with the
    guided velocity (true CFG: two transformer rows a call), micro-batch by micro-batch."""
    arch = architecture_for(cfg.model)
    rows, micro = cfg.data.prompts_per_step * cfg.data.group_size, cfg.train.micro_batch_size
    text = 77 + cfg.model.max_sequence_length  # SD3: the CLIPs' 77 positions, then T5's tokens
    shapes = Shapes(micro * 2, cfg.sampling.height, cfg.sampling.width, 1, text)
    cost = transformer_cost(arch, shapes, full_finetune=not cfg.model.lora.enabled, dtype=torch.float32)
    return math.ceil(rows * trained_steps * cfg.train.ppo_epochs / micro) * cost.train_flops


def test_a_loss_registered_in_its_own_file_is_estimated_and_documented(toy_pg_loss, capsys):
    # the override after the flags, as the docs write it
    assert main(["estimate", QUICKSTART, "--gpu", "h100", "--json", f"algorithm.loss={toy_pg_loss}"]) == 0
    toy = json.loads(capsys.readouterr().out)
    cfg = load(QUICKSTART, [f"algorithm.loss={toy_pg_loss}"])
    # the quickstart's window: all 9 SDE steps of 10, each trained (timestep_fraction 1)
    assert toy["flops_update"] == pytest.approx(policy_gradient_update_by_hand(cfg, 9), rel=1e-9)
    assert main(["config", "reference", "--markdown"]) == 0  # docs/config.md
    assert f"### `algorithm.{toy_pg_loss}`" in capsys.readouterr().out


def test_tempflow_grpo_is_costed_as_the_policy_gradient_step_it_is():
    """TempFlow-GRPO trains its window's step with the guided velocity, like every policy-gradient loss (the
    estimate once took it for a direct-preference loss: one call, no CFG — half the update)."""
    cfg = load(str(ROOT / "configs/quickstart_tempflow.yaml"))
    r = estimate(cfg, architecture_for(cfg.model), DEVICES["h100"], 1)
    assert r.flops_update == pytest.approx(policy_gradient_update_by_hand(cfg, 1), rel=1e-9)  # window.size 1


class ToySd3(SD3Model):
    """An SD3-like family whose adapter reads 5 text tokens, and that records the inputs estimate asked it for."""

    asked: ClassVar[list] = []

    @classmethod
    def text_tokens(cls, arch, max_sequence_length: int, prompt_tokens: int) -> int:
        return 5

    @classmethod
    def meta_inputs(cls, config, batch, latent, text, dtype):
        cls.asked.append((batch, latent, text))
        return super().meta_inputs(config, batch, latent, text, dtype)


@pytest.fixture
def toy_family():
    register_family(ModelFamily("toy_sd3", "ToySd3Pipeline", ToySd3, "diffusion_rl.models.tiny.sd3", ("to_q",)))
    yield "toy_sd3"
    FAMILIES.remove("toy_sd3")


def test_a_familys_estimate_facts_come_from_its_adapter(toy_family):
    arch = dataclasses.replace(small_sd3_arch(), family=toy_family)
    cost = transformer_cost(arch, Shapes(batch=2, height=32, width=32, frames=1, text=10), full_finetune=True,
                            dtype=torch.float32)  # fmt: skip
    assert ToySd3.asked[-1] == (2, (1, 16, 16), 10)  # the adapter built the inputs: 2 rows, a 16 × 16 latent
    assert cost.forward_flops == sd3_forward_flops_by_hand(2, 16, 16, 10)
    cfg = load(QUICKSTART, ["sampling.height=32", "sampling.width=32", "train.micro_batch_size=1"])
    r = estimate(cfg, arch, DEVICES["h100"], 1)
    assert r.assumptions[0].startswith("text tokens per sample 5 ")  # the adapter's count, not SD3's 77 + 32
    one_row = transformer_cost(arch, Shapes(1, 32, 32, 1, 5), full_finetune=True, dtype=torch.bfloat16)
    rollout = 8 * 10 * 2 * one_row.forward_flops  # 8 images × 10 steps × CFG's two rows, at 5 text tokens
    decode = 8 * vae_decode_cost(arch, 32, 32, 1).flops  # (no text encoder in this architecture)
    assert r.flops_rollout == pytest.approx(rollout + decode, rel=1e-9)


def test_a_count_is_made_once_per_architecture_and_arguments(monkeypatch, toy_family):
    """A repeated count is answered from memory (estimate asks again for a config's variants): the same classes and
    configs under another name too; another config, shape or family adapter is counted."""
    from diffusion_rl.estimate import counting

    built, real = [], counting.build_on_meta
    monkeypatch.setattr(counting, "build_on_meta", lambda *a: built.append(a[0]) or real(*a))
    arch, shapes = small_sd3_arch(), Shapes(1, 32, 32, 1, 7)  # shapes no other test here asks for

    def count(arch, shapes):
        return transformer_cost(arch, shapes, full_finetune=True, dtype=torch.float32)

    first = count(arch, shapes)
    assert count(dataclasses.replace(arch, name="renamed"), shapes) is first and built == ["SD3Transformer2DModel"]
    assert count(arch, dataclasses.replace(shapes, batch=2)).forward_flops == 2 * first.forward_flops
    deeper = dataclasses.replace(arch, transformer_config={**SMALL_SD3, "num_layers": 3})
    assert count(deeper, shapes).forward_flops > first.forward_flops and len(built) == 3
    count(dataclasses.replace(arch, family=toy_family), shapes)
    assert ToySd3.asked[-1] == (1, (1, 16, 16), 7) and len(built) == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.forward_flops = 0.0  # the next caller gets the same object
    decode = vae_decode_cost(arch, 32, 32, 1, torch.float32)
    assert vae_decode_cost(arch, 32, 32, 1, torch.float32) is decode and len(built) == 5


def test_each_trained_adapter_of_an_algorithm_counts_in_the_trained_state(monkeypatch):
    """TDM-R1 trains three LoRA adapters of one size, each with AdamW state: three times the gradients, weights and
    moments of one (the EMA stays the generator's alone)."""
    from diffusion_rl.algorithms.base import OptimizerGroup
    from diffusion_rl.algorithms.preference.tdm_r1 import TdmR1

    cfg = load(ROOT / "configs/z_image_turbo_tdm_r1_lora.yaml")
    arch = architecture_for(cfg.model)
    three = estimate(cfg, arch, DEVICES["h100"], 8)
    monkeypatch.setattr(TdmR1, "optimizer_groups", classmethod(lambda cls, settings: (OptimizerGroup(),)))
    one = estimate(cfg, arch, DEVICES["h100"], 8)
    assert three.memory_gib["trainable_state"] == pytest.approx(3 * one.memory_gib["trainable_state"], rel=1e-9)
    assert three.memory_gib["ema"] == one.memory_gib["ema"] > 0


def test_decoupled_rollout_correction_counts_its_old_policy_forwards_once_per_update():
    """mode=decoupled recomputes every trained step's old log-prob before the update (no gradient), once whatever
    the epochs: ⌈rows × K / micro⌉ more guided forwards than bypass."""
    base = ["train.ppo_epochs=2", "sampling.window.kind=random", "sampling.window.size=3"]
    bypass, decoupled = (load(QUICKSTART, [*base, f"algorithm.rollout_correction.mode={mode}"])
                         for mode in ("bypass", "decoupled"))  # fmt: skip
    arch = architecture_for(bypass.model)
    plain, recomputing = (estimate(cfg, arch, DEVICES["h100"], 1) for cfg in (bypass, decoupled))
    rows, micro = bypass.data.prompts_per_step * bypass.data.group_size, bypass.train.micro_batch_size
    text = 77 + bypass.model.max_sequence_length
    cost = transformer_cost(arch, Shapes(micro * 2, bypass.sampling.height, bypass.sampling.width, 1, text),
                            full_finetune=not bypass.model.lora.enabled, dtype=torch.float32)  # fmt: skip
    extra = math.ceil(rows * 3 / micro) * cost.forward_flops  # K = 3 trained steps, once for both epochs
    assert recomputing.flops_update - plain.flops_update == pytest.approx(extra, rel=1e-9)
    assert plain.flops_update == pytest.approx(policy_gradient_update_by_hand(bypass, 3), rel=1e-9)
