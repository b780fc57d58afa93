"""Checkpoint settings a family does not sample as its pipeline would are refused at load, in one line naming the
file and the key: SD3 with a dynamic shift (the pipeline would compute μ from the image tokens) and a
guidance-distilled Qwen-Image (the pipeline would pass its guidance scale to the transformer)."""

from __future__ import annotations

import json
import shutil

import pytest

from diffusion_rl.errors import UserError


def _copy_with(source, tmp_path, file: str, key: str, value) -> str:
    directory = tmp_path / "model"
    shutil.copytree(source, directory)
    config = directory / file
    data = json.loads(config.read_text())
    data[key] = value
    config.write_text(json.dumps(data))
    return str(directory)


def test_sd3_with_a_dynamic_shift_is_refused(tiny_model_dir, tmp_path, load):
    path = _copy_with(tiny_model_dir, tmp_path, "scheduler/scheduler_config.json", "use_dynamic_shifting", True)
    with pytest.raises(UserError, match=r"scheduler/scheduler_config\.json sets use_dynamic_shifting: true"):
        load(path)


def test_a_guidance_distilled_qwen_image_is_refused(qwen_image_model_dir, tmp_path, load):
    path = _copy_with(qwen_image_model_dir, tmp_path, "transformer/config.json", "guidance_embeds", True)
    with pytest.raises(UserError, match=r"transformer/config\.json sets guidance_embeds: true"):
        load(path)
