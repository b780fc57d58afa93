"""The video and editing families' trained LoRA out of a checkpoint: diffusers' load_lora_weights reads it, and a
merged export loads back as the same family (Qwen-Image-Edit with a real checkpoint's processor layout)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from diffusion_rl.cli import main

ROOT = Path(__file__).resolve().parents[2]
EDITS = ROOT / "configs/prompts/shapes_edits"
GUIDANCE = 4.0
SOURCE = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)


def probe(model) -> torch.Tensor:
    """The velocity on fixed latents, prompts (and, for an editing family, a fixed source image)."""
    frames = 5 if model.video else 1
    latents = torch.randn((2, *model.latent_shape(32, 32, frames)), generator=torch.Generator().manual_seed(0))
    sources = [[SOURCE], [SOURCE]] if model.edits else None
    cond = model.encode_prompts(["make the circle blue", "a blue ball"], ["blurry", "blurry"], sources)
    with torch.no_grad():
        return model.velocity(latents, 0.6, cond, GUIDANCE)


@pytest.fixture
def trained(train_model, wan_model_dir, qwen_image_edit_model_dir, flux_kontext_model_dir, tmp_path):
    """trained(name) → (model directory, trained model, checkpoint) after one LoRA step at lr 1e-2."""
    runs = {
        "wan": (wan_model_dir, ["sampling.num_frames=5"]),
        "qwen_image_edit": (qwen_image_edit_model_dir, ["model.max_sequence_length=256"]),
        "flux_kontext": (flux_kontext_model_dir, []),
    }

    def train(name):
        model_dir, extra = runs[name]
        data = [] if name == "wan" else [f"data.train={EDITS / 'train.jsonl'}", f"val.prompts={EDITS / 'val.jsonl'}"]
        trainer = train_model(model_dir, f"run.dir={tmp_path / 'run'}", "model.lora.enabled=true", "model.lora.rank=4",
                              "model.lora.alpha=8", "train.total_steps=1", "train.lr=1e-2", *extra, *data)  # fmt: skip
        trainer.train()
        return model_dir, trainer.engine.model, tmp_path / "run" / "checkpoints" / "step_000001"

    return train


@pytest.mark.parametrize("name", ["wan", "qwen_image_edit", "flux_kontext"])
def test_checkpoint_lora_loads_with_diffusers_and_merges_into_the_same_family(trained, load, tmp_path, name):
    model_dir, model, checkpoint = trained(name)
    v_trained = probe(model)
    fresh = load(model_dir, max_sequence_length=model.max_sequence_length)
    v_base = probe(fresh)
    fresh.pipeline.load_lora_weights(checkpoint / "adapter")  # the family pipeline's own LoRA loader
    assert (v_trained - v_base).abs().max() > 1e-5
    assert torch.allclose(probe(fresh), v_trained, atol=1e-5)

    out = tmp_path / "merged"
    assert (
        main(["export", "--checkpoint", str(checkpoint), "--model", str(model_dir), "--merge", "--out", str(out)]) == 0
    )
    merged = load(out, max_sequence_length=model.max_sequence_length)
    assert merged.family == model.family
    assert torch.allclose(probe(merged), v_trained, atol=1e-5)
    if name == "qwen_image_edit":
        assert json.loads((out / "model_index.json").read_text())["processor"] == ["transformers", "Qwen2VLProcessor"]
