"""model.compile: sampling passes (no grad) go through a torch.compile wrapper of the active network; training
passes call the network itself. torch.compile is replaced by a recording stub (a real compile takes minutes)."""

from __future__ import annotations

import torch

from diffusion_rl.config import LoraConfig, ModelConfig
from diffusion_rl.models.loader import load_model


class Wrapper(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.inner = module
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_compile_wraps_only_no_grad_calls_of_the_active_network(tiny_model_dir, monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda module: compiled.append(Wrapper(module)) or compiled[-1])
    cfg = ModelConfig(path=str(tiny_model_dir), device="cpu", max_sequence_length=16, lora=LoraConfig(enabled=False),
                      compile=True)  # fmt: skip
    model = load_model(cfg)
    model.policies.keep_reference()
    latents = torch.randn((2, *model.latent_shape(32, 32)), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["a red circle", "two blue squares"])

    v_train = model.velocity(latents, 0.5, cond, 4.5)  # grad enabled: the network itself
    assert compiled == [] and v_train.requires_grad
    with torch.no_grad():
        v_sample = model.velocity(latents, 0.5, cond, 4.5)
        model.velocity(latents, 0.4, cond, 4.5)
        with model.reference():
            model.velocity(latents, 0.5, cond, 4.5)
    assert [w.calls for w in compiled] == [2, 1]  # one wrapper per network, reused across calls
    assert compiled[0].inner is model.policies.trained
    torch.testing.assert_close(v_sample, v_train.detach())


def test_compile_is_off_by_default(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda module: (_ for _ in ()).throw(AssertionError("compiled")))
    model = load_model(ModelConfig(path=str(tiny_model_dir), device="cpu", max_sequence_length=16,
                                   lora=LoraConfig(enabled=False)))  # fmt: skip
    with torch.no_grad():
        model.velocity(torch.zeros((1, *model.latent_shape(32, 32))), 0.5, model.encode_prompts(["a"]), 1.0)
