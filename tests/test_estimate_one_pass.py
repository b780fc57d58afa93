"""estimate/counting.py's transformer_cost counts a call's forward and its training (forward + backward) in one pass:
the forward's counts are those of a forward alone, without gradients, counted here on their own."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from diffusion_rl.estimate import counting
from diffusion_rl.estimate.counting import Shapes, counting_traffic, transformer_inputs

from .test_estimate import SMALL_SD3, small_sd3_arch


@pytest.mark.parametrize("lora", [None, (("to_q", "to_k", "to_v"), 4)], ids=["full", "lora"])
def test_the_forward_counts_come_from_the_training_pass_and_equal_a_forward_alone(monkeypatch, lora):
    calls, real = [], counting.build_on_meta

    def counted_build(*args):
        module = real(*args)
        module.register_forward_pre_hook(lambda module, inputs: calls.append(1))
        return module

    monkeypatch.setattr(counting, "build_on_meta", counted_build)
    # a config no other test counts (the counts are kept per architecture and arguments)
    arch = dataclasses.replace(small_sd3_arch(), transformer_config={**SMALL_SD3, "num_layers": 2})
    shapes = Shapes(batch=2, height=32, width=32, frames=1, text=9)
    cost = counting.transformer_cost.__wrapped__(arch, shapes, lora is None, torch.float32, lora)
    assert len(calls) == 1  # the training pass only

    module = real(arch.transformer_class, arch.transformer_config)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        with counting.META:
            module = get_peft_model(module, LoraConfig(r=lora[1], lora_alpha=lora[1], target_modules=list(lora[0])))
    inputs = transformer_inputs(arch, shapes, torch.float32)
    with FlopCounterMode(display=False) as flops, torch.no_grad(), counting_traffic() as traffic:
        module(**inputs)
    assert cost.forward_flops == flops.get_total_flops() > 0
    assert cost.forward_traffic == traffic.bytes > 0
    assert cost.train_flops > 2 * cost.forward_flops and cost.train_traffic > cost.forward_traffic
