"""model.offload_reference: full fine-tuning's frozen reference copy lives on the CPU and moves to model.device only
for its forward; the KL runs the same numbers as with the copy kept on the device.

On a CPU-only machine the move is no move: the model is loaded with device "cpu:0" (the CPU under another name), so
that the recorded move to the device and the move back read differently."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.errors import UserError
from diffusion_rl.models.loader import load_model
from diffusion_rl.models.policies import REFERENCE


def test_the_reference_copy_is_on_the_device_only_for_its_forward(tiny_model_dir):
    model = load_model(ModelConfig(path=str(tiny_model_dir), device="cpu:0", max_sequence_length=16,
                                   lora=LoraConfig(enabled=False), offload_reference=True))  # fmt: skip
    model.policies.keep_reference()
    copy = model.policies.frozen_copies()[REFERENCE]
    trained = dict(model.policies.trained.named_parameters())
    for name, p in copy.named_parameters():  # a copy of its own, made on the CPU
        assert torch.equal(p, trained[name]) and p.data_ptr() != trained[name].data_ptr() and not p.requires_grad
    events = []
    move = copy.to
    copy.to = lambda device: events.append(f"to {torch.device(device)}") or move(device)
    copy.register_forward_pre_hook(lambda *_: events.append("forward"))
    cond = model.encode_prompts(["a red cube"])
    x = torch.randn(1, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.velocity(x, 0.6, cond, 1.0)  # the trained policy: the copy stays where it is
        assert events == []
        with model.reference():
            model.velocity(x, 0.6, cond, 1.0)
    assert events == ["to cpu:0", "forward", "to cpu"]


def test_a_kl_run_with_the_offloaded_reference_takes_the_same_steps(make_trainer, tmp_path):
    def rows(offload: bool):
        return make_trainer("algorithm.flow_grpo.kl_beta=0.04", f"model.offload_reference={str(offload).lower()}",
                            f"run.dir={tmp_path / str(offload)}").train()  # fmt: skip

    kept, offloaded = rows(False), rows(True)
    assert offloaded[1]["kl_ref"] > 0  # the policy has moved from the reference by step 2
    for a, b in zip(kept, offloaded, strict=True):
        for key in ("kl_ref", "loss", "grad_norm", "reward/mean"):
            assert b[key] == a[key], key


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model.lora.enabled=true",), "with model.lora.enabled the reference is the base model"),
        (("engine.kind=ray",), "use engine.fsdp_cpu_offload=true"),
    ],
    ids=["lora", "ray"],
)
def test_the_offload_is_refused_where_there_is_no_local_copy(make_config, overrides, message):
    with pytest.raises(UserError, match=message):
        make_config("model.offload_reference=true", *overrides)
