"""The pretrained ShapesWorld model shipped in the package (models/tiny/shipped.py): what `diffusion-rl pretrain
configs/shapes_pretrain.yaml` writes, verified file by file when it is copied out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from diffusion_rl.errors import UserError
from diffusion_rl.models.tiny import save_tiny, tiny_presets
from diffusion_rl.models.tiny.shipped import MANIFEST, shipped_dir, verify
from diffusion_rl.utils.digest import file_sha256

ROOT = Path(__file__).resolve().parents[2]
SHAPES = shipped_dir("sd3", "shapes")
# the transformer `pretrain configs/shapes_pretrain.yaml` wrote on the ranking's machines (benchmarks/results/ranking/:
# every run's base_model_sha256), rebuilt bit for bit on 2026-11-28 on an AMD EPYC with AVX-512, without AMX, 2 threads
RANKING_BASE = "c57700ac2d82ea83b2507cfe25dc03a51fe788c58e57b456c0bc7465d68f80e2"


def test_the_shipped_model_is_the_rankings_pretrained_base_and_intact():
    verify(SHAPES)
    assert file_sha256(SHAPES / "transformer/diffusion_pytorch_model.safetensors") == RANKING_BASE
    shard = json.loads((ROOT / "benchmarks/results/ranking/shard_2.json").read_text())
    assert RANKING_BASE.startswith(shard["runs"][0]["base_model_sha256"])
    assert "shapes" in tiny_presets("sd3")


def test_the_shipped_model_was_made_by_the_shipped_pretraining_config():
    from diffusion_rl.pretrain.config import load_pretrain_config
    from diffusion_rl.pretrain.model import settings_digest

    info = json.loads((SHAPES / "shapes.json").read_text())
    assert info["settings_sha256"] == settings_digest(load_pretrain_config(str(ROOT / "configs/shapes_pretrain.yaml")))
    config = yaml.safe_load((ROOT / "configs/shapes_pretrain.yaml").read_text())
    assert (info["size"], info["text_tokens"]) == (config["model"]["size"], config["model"]["text_tokens"])
    assert (info["split_seed"], info["heldout_fraction"]) == (config["data"]["split_seed"],
                                                              config["data"]["heldout_fraction"])  # fmt: skip


def test_copying_it_out_gives_a_loadable_model_with_its_prompts(tmp_path):
    from diffusion_rl.config import load
    from diffusion_rl.models.loader import load_model

    out = save_tiny(tmp_path / "models/shapes", "sd3", "shapes")
    assert (out / "shapes_prompts/train.jsonl").is_file() and not (out / MANIFEST).exists()
    (out / "vae/diffusion_pytorch_model.safetensors").write_bytes(b"stale")
    save_tiny(out, "sd3", "shapes")  # over an existing directory (init-tiny --force): its files are replaced
    verify_copy = file_sha256(out / "vae/diffusion_pytorch_model.safetensors")
    assert verify_copy == file_sha256(SHAPES / "vae/diffusion_pytorch_model.safetensors")
    model = load_model(load(None, [f"model.path={out}", "model.device=cpu"]).model)
    assert sum(p.numel() for p in model.pipeline.transformer.parameters()) > 2_000_000


@pytest.mark.parametrize("damage", ["changed", "missing", "extra"])
def test_a_damaged_shipped_model_is_one_line_naming_the_file(tmp_path, damage):
    copy = tmp_path / "shapes"
    shutil.copytree(SHAPES, copy)
    weights = copy / "vae/diffusion_pytorch_model.safetensors"
    if damage == "changed":
        data = bytearray(weights.read_bytes())
        data[-4:] = b"\x00\x00\x80\x7f"
        weights.write_bytes(bytes(data))
    elif damage == "missing":
        weights.unlink()
    else:
        (copy / "vae/notes.txt").write_text("hello")
    with pytest.raises(UserError, match="vae/(diffusion_pytorch_model.safetensors|notes.txt)") as info:
        verify(copy)
    assert "\n" not in str(info.value)
