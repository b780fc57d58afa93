"""A tiny pretraining run end to end: a loadable model directory, a VAE that learned, exact resume, config errors."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from diffusion_rl.cli import main
from diffusion_rl.config.model import ModelConfig
from diffusion_rl.data.prompts import load_prompts
from diffusion_rl.data.shapes import ShapesWorld
from diffusion_rl.errors import UserError
from diffusion_rl.models.loader import load_model
from diffusion_rl.pretrain.config import load_pretrain_config
from diffusion_rl.pretrain.model import build_pipeline, settings_digest
from diffusion_rl.pretrain.trainer import PretrainTrainer
from diffusion_rl.pretrain.vae import reconstruction_mse, to_pixels
from diffusion_rl.sampling.rollout import SamplerSettings, sample_images

# a few steps at the smallest sizes: the small preset, 32 px, short prompts pools, 2-step evaluation
TINY = [
    "model.preset=small",
    "model.vae_channels=[8,16,16]",
    "vae.steps=20",
    "vae.batch_size=8",
    "vae.lr=3e-3",
    "vae.stats_images=32",
    "flow.steps=4",
    "flow.batch_size=4",
    "flow.latent_pool=64",
    "flow.warmup_steps=2",
    "eval.every=0",
    "eval.prompts=4",
    "eval.n=1",
    "eval.num_steps=2",
    "log.every=10",
    "log.console_every=0",
    "log.tensorboard=false",
    "log.progress_bar=false",
]


def tiny_config(tmp_path, *overrides, run="run", out="model"):
    return load_pretrain_config(
        "configs/shapes_pretrain.yaml",
        [f"run.dir={tmp_path / run}", f"run.out={tmp_path / out}", *TINY, *overrides],
    )


def test_pretrain_writes_a_loadable_model_whose_vae_learned(tmp_path):
    cfg = tiny_config(tmp_path)
    assert main(["pretrain", "configs/shapes_pretrain.yaml", f"run.dir={tmp_path / 'run'}",
                 f"run.out={tmp_path / 'model'}", *TINY]) == 0  # fmt: skip
    out = tmp_path / "model"
    info = json.loads((out / "shapes.json").read_text())
    assert info["size"] == 32 and info["text_tokens"] == 48 and 0 <= info["shapes/geneval"] <= 1
    assert info["settings_sha256"] == settings_digest(cfg)  # a rerun of these settings may replace it
    assert len(load_prompts(out / "shapes_prompts" / "val.jsonl")) == 4

    model = load_model(ModelConfig(path=str(out), device="cpu", max_sequence_length=48,
                                   lora=ModelConfig().lora.__class__(enabled=False)))  # fmt: skip
    _, images = ShapesWorld(32, seed=0).batch(range(16), "heldout", stream="test")
    pixels = to_pixels(images)
    untrained = build_pipeline(cfg).vae  # the same random initial weights the run started from
    assert reconstruction_mse(model.vae, pixels) < 0.5 * reconstruction_mse(untrained, pixels)
    # the exported latent scale makes the data's latents roughly standard
    z = (model.vae.encode(pixels).latent_dist.mean - model.vae.config.shift_factor) * model.vae.config.scaling_factor
    assert abs(z.mean().item()) < 0.5 and 0.5 < z.std().item() < 2.0

    images = sample_images(model, ["a red circle", "two blue squares"], ["", ""], SamplerSettings(2, 4.5, 32, 32),
                           init_seeds=[0, 1])  # fmt: skip
    assert images.shape == (2, 32, 32, 3)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("vae/loss" in r for r in rows) and any("flow/loss" in r for r in rows)
    assert (tmp_path / "run" / "samples" / "final.png").is_file()


def test_resumed_pretraining_ends_where_a_straight_run_ends(tmp_path):
    straight = tiny_config(tmp_path, "vae.steps=3", "flow.steps=4", "save_every=5", "keep_last=0")
    PretrainTrainer(straight).train()
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000005"
    resumed = tiny_config(tmp_path, "vae.steps=3", "flow.steps=4", "save_every=5", "keep_last=0",
                          f"run.resume={checkpoint}", run="run2", out="model2")  # fmt: skip
    trainer = PretrainTrainer(resumed)
    trainer.train()
    assert trainer.step == 7
    for part in ("transformer", "vae"):
        a = load_file(tmp_path / "model" / part / "diffusion_pytorch_model.safetensors")
        b = load_file(tmp_path / "model2" / part / "diffusion_pytorch_model.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=f"{part}.{key}")


def test_pretrain_config_errors_name_the_key(tmp_path):
    with pytest.raises(UserError, match="flow.stepz"):
        tiny_config(tmp_path, "flow.stepz=3")
    with pytest.raises(UserError, match="multiple of 8"):
        tiny_config(tmp_path, "model.size=30")
    # the final scores need them: refused when the config loads, not after all the training
    for override, said in (("eval.n=0", "eval.prompts and eval.n must be ≥ 1"),
                           ("eval.num_steps=0", "eval.num_steps must be ≥ 1"),
                           ("eval.guidance=0.5", "eval.guidance must be a finite number ≥ 1")):  # fmt: skip
        with pytest.raises(UserError, match=said):
            tiny_config(tmp_path, override)
    assert main(["pretrain", str(tmp_path / "missing.yaml")]) == 2


def test_empty_prompt_dropout_and_pool_draws_repeat_with_the_seed(tmp_path):
    cfg = tiny_config(tmp_path, "vae.steps=1", "flow.steps=0")
    first, second = PretrainTrainer(cfg), PretrainTrainer(cfg)
    for trainer in (first, second):
        trainer.vae_step(0)
        trainer.prepare_flow()
    np.testing.assert_array_equal(first.pool.numpy(), second.pool.numpy())
    assert first.text.shape[1] == 48 * 2  # CLIP and T5 each read text_tokens tokens
    assert first.flow_step(0)["flow/loss"] == second.flow_step(0)["flow/loss"]
