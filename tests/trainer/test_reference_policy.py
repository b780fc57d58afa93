"""The KL reference: LoRA disabled, or a frozen copy under full fine-tuning; it stays the base model."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.models.loader import load_model

PROMPTS = ["a red apple on a wooden table", "a lighthouse at dusk"]


def _velocity(model, reference: bool = False) -> torch.Tensor:
    cond = model.encode_prompts(PROMPTS, ["", ""])
    x = torch.randn(len(PROMPTS), *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if reference:
            with model.reference():
                return model.velocity(x, 0.6, cond, guidance=4.5)
        return model.velocity(x, 0.6, cond, guidance=4.5)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_reference_stays_the_base_model_while_the_policy_trains(make_trainer, make_config, lora):
    trainer = make_trainer(f"model.lora.enabled={str(lora).lower()}", "algorithm.flow_grpo.kl_beta=0.04")
    rows = trainer.train()
    model = trainer.engine.model
    assert rows[-1]["train/optimizer_steps"] == 2

    base = load_model(make_config("model.lora.enabled=false").model)
    v_base = _velocity(base)
    assert torch.equal(_velocity(model, reference=True), v_base)  # same weights, same kernels: bit for bit
    assert (_velocity(model) - v_base).abs().max() > 1e-3, "the trained policy did not move"

    # step 1 starts at the reference (LoRA B = 0, or the copy), so the KL is 0 until an update has happened
    assert rows[0]["kl_ref"] == 0
    assert rows[1]["kl_ref"] > 0
