"""model.compile: sampling passes (no grad) go through a torch.compile wrapper of the active network; training
passes call the network itself. model.compile_blocks: every pass runs the network with its repeated blocks compiled
in place. The compilers are replaced by recording stubs, except in the last test (a real inductor compile)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.models.loader import load_model


@pytest.fixture(autouse=True)
def _own_compile_cache(monkeypatch, tmp_path):
    # compiling points torch's caches at the user's cache folder (models/compiling.py): here, at the test's
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


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


def _record_block_compiles(monkeypatch) -> list[tuple[torch.nn.Module, dict]]:
    """Replace nn.Module.compile by a stand-in that routes the module's calls through a counter (no compiling)."""
    compiled: list[tuple[torch.nn.Module, dict]] = []

    def compile(module, *args, **kwargs):
        calls = {"grad": 0, "no_grad": 0}
        call = module._call_impl

        def counted(*a, **kw):
            calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1
            return call(*a, **kw)

        module._compiled_call_impl = counted
        compiled.append((module, calls))

    monkeypatch.setattr(torch.nn.Module, "compile", compile)
    monkeypatch.setattr(torch, "compile", lambda module: (_ for _ in ()).throw(AssertionError("whole network")))
    return compiled


def test_compile_blocks_compiles_every_block_once_for_training_and_sampling(tiny_model_dir, monkeypatch):
    compiled = _record_block_compiles(monkeypatch)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # torch's default
    model = load_model(ModelConfig(path=str(tiny_model_dir), device="cpu", max_sequence_length=16,
                                   lora=LoraConfig(enabled=False), compile_blocks=True))  # fmt: skip
    model.policies.keep_reference()  # a frozen copy made before the first call
    latents = torch.randn((2, *model.latent_shape(32, 32)), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["a red circle", "two blue squares"])

    model.velocity(latents, 0.5, cond, 4.5).sum().backward()  # a training pass
    with torch.no_grad():
        model.velocity(latents, 0.4, cond, 4.5)  # a sampling pass
    blocks = list(model.policies.trained.transformer_blocks)
    assert [m for m, _ in compiled] == blocks  # the repeated blocks, each once, not the network
    assert all(calls == {"grad": 1, "no_grad": 1} for _, calls in compiled)
    # room for every block variant × call mode: with torch's 8, SD3.5's later blocks ran eager on the GPU check
    assert torch._dynamo.config.recompile_limit >= 64

    with torch.no_grad(), model.reference():  # the copy compiles its own blocks on its first call
        model.velocity(latents, 0.5, cond, 4.5)
    reference_blocks = list(model.policies.frozen_copies()["__reference__"].transformer_blocks)
    assert [m for m, _ in compiled[len(blocks) :]] == reference_blocks
    assert all(calls == {"grad": 0, "no_grad": 1} for _, calls in compiled[len(blocks) :])


def test_compile_and_compile_blocks_are_alternatives():
    with pytest.raises(ValueError, match="model.compile and model.compile_blocks are alternatives"):
        ModelConfig(compile=True, compile_blocks=True)


def _train_one_step(trainer):
    """One training step; returns its metrics row and the log-probs each training pass recomputed (with grad)."""
    algorithm = trainer.engine.algorithm
    loss, recomputed = algorithm.loss, []

    def recording(units, k, at):
        out = loss(units, k, at)
        recomputed.append(algorithm._recompute(units.traj, units.columns[:, k]).log_prob.detach())
        return out

    algorithm.loss = recording
    return trainer.train()[0], torch.stack(recomputed)


def test_compiled_blocks_recompute_the_eager_log_probs_and_train(tmp_path, monkeypatch, make_config):
    # real inductor compiles (fp32) on a one-layer model, so one block variant compiles: a no-grad graph for the
    # rollout, a forward and a backward graph for the update
    from diffusion_rl.models.tiny import save_tiny
    from diffusion_rl.models.tiny import sd3 as tiny_sd3
    from diffusion_rl.trainer import make_trainer

    monkeypatch.setitem(tiny_sd3.PRESETS, "one_layer", dataclasses.replace(tiny_sd3.PRESETS["small"], layers=1))
    model_dir = save_tiny(tmp_path / "one_layer", "sd3", "one_layer", seed=0)
    torch._dynamo.reset()
    runs = {}
    for blocks in ("false", "true"):
        # adam_eps 1e-4: AdamW's first step with eps 1e-8 is ±lr wherever |g| ≫ eps, so fp32 noise in a tiny g
        # would flip whole steps; with 1e-4 the weights compare the gradients
        cfg = make_config(f"model.path={model_dir}", f"run.dir={tmp_path / blocks}", "train.total_steps=1",
                          "train.adam_eps=1e-4", f"model.compile_blocks={blocks}")  # fmt: skip
        trainer = make_trainer(cfg)
        row, log_probs = _train_one_step(trainer)
        runs[blocks] = (row, log_probs, trainer.engine.model.trainable_parameters())
    (_, logp_eager, w_eager), (row, logp_compiled, w_compiled) = runs["false"], runs["true"]
    # fp32 noise: inductor fuses and reorders sums, so log-probs agree to ~1e-6 of their size, not bit for bit
    torch.testing.assert_close(logp_compiled, logp_eager, rtol=1e-5, atol=1e-5)
    assert row["train/optimizer_steps"] == 1
    assert row["train/logp_diff_max"] == 0.0  # rollout and update both ran the compiled blocks
    assert max(float((a - b).abs().max()) for a, b in zip(w_compiled, w_eager)) < 1e-6


def test_compile_blocks_finds_the_blocks_inside_a_lora_model(tiny_model_dir, monkeypatch):
    compiled = _record_block_compiles(monkeypatch)
    model = load_model(ModelConfig(path=str(tiny_model_dir), device="cpu", max_sequence_length=16,
                                   lora=LoraConfig(rank=4, alpha=8), compile_blocks=True))  # fmt: skip
    latents = torch.randn((2, *model.latent_shape(32, 32)), generator=torch.Generator().manual_seed(0))
    v = model.velocity(latents, 0.5, model.encode_prompts(["a", "b"]), 1.0)
    v.sum().backward()
    with model.reference(), torch.no_grad():  # LoRA's reference: the same blocks with the adapters disabled
        model.velocity(latents, 0.5, model.encode_prompts(["a", "b"]), 1.0)
    blocks = list(model.policies.trained.base_model.model.transformer_blocks)
    assert [m for m, _ in compiled] == blocks
    assert all(calls == {"grad": 1, "no_grad": 1} for _, calls in compiled)
    # room for every block variant × call mode: with torch's 8, SD3.5's later blocks ran eager on the GPU check
    assert torch._dynamo.config.recompile_limit >= 64
    assert all(p.grad is not None for p in model.trainable_parameters())  # gradients reach the adapters


@pytest.mark.parametrize(
    ("family", "lists"),
    [("flux", ["transformer_blocks", "single_transformer_blocks"]), ("wan", ["blocks"]),
     ("qwen_image", ["transformer_blocks"])],
)  # fmt: skip
def test_repeated_blocks_are_every_family_block_list(family, lists):
    from diffusion_rl.models.policies import repeated_blocks
    from diffusion_rl.models.tiny import build_tiny

    transformer = build_tiny(family, "small", seed=0).transformer
    expected = [block for name in lists for block in getattr(transformer, name)]
    assert expected and repeated_blocks(transformer) == expected
