"""The model pretraining starts from (a fresh tiny SD3 pipeline sized for ShapesWorld) and how it is written out."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from diffusion_rl.checkpoint.store import rename_into_place
from diffusion_rl.config.convert import to_dict
from diffusion_rl.data.shapes import write_prompt_files
from diffusion_rl.models.tiny.parts import build_seeded
from diffusion_rl.models.tiny.sd3 import PRESETS, build
from diffusion_rl.pretrain.config import PretrainConfig

logger = logging.getLogger(__name__)

INFO_FILE = "shapes.json"  # in the exported model directory: image size, text length, split, scores
PROMPTS_DIR = "shapes_prompts"  # in the exported model directory: train / heldout / val prompt files


def build_pipeline(cfg: PretrainConfig):
    """A tiny StableDiffusion3Pipeline with random weights drawn from run.seed, at the config's sizes.

    Both CLIP encoders read `text_tokens` tokens instead of 77 (ShapesWorld prompts are short, and text tokens
    dominate the transformer's cost at this size); the saved tokenizer keeps that length.
    """
    m = cfg.model
    spec = dataclasses.replace(
        PRESETS[m.preset],
        sample_size=m.size,
        max_sequence_length=m.text_tokens,
        vae_channels=tuple(m.vae_channels),
    )
    pipeline = build_seeded(build, spec, cfg.run.seed)
    for tokenizer in {id(t): t for t in (pipeline.tokenizer, pipeline.tokenizer_2)}.values():
        tokenizer.model_max_length = m.text_tokens
    pipeline.tokenizer_max_length = m.text_tokens
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def settings_digest(cfg: PretrainConfig) -> str:
    """What a pretrained model depends on: the config but for where it goes and how the run is watched (run.dir,
    run.out, run.resume, run.num_threads, log)."""
    settings = to_dict(cfg)
    settings.pop("log")
    for key in ("dir", "out", "resume", "num_threads"):
        settings["run"].pop(key)
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def check_out(cfg: PretrainConfig) -> None:
    """A UserError, before any work, when run.out holds something the export would replace that is not this
    config's own model: a file, a folder of other files, or a model pretrained with other settings (`shapes.json`'s
    settings_sha256). An absent or empty folder, or a finished model of the same settings (a rerun), is written."""
    from diffusion_rl.errors import UserError

    out = Path(cfg.run.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"run.out {out} is a file; pretraining writes a model folder there: give another run.out")
    if not out.is_dir() or not any(out.iterdir()):
        return
    try:
        info = json.loads((out / INFO_FILE).read_text())
    except (OSError, ValueError):
        info = None
    if not isinstance(info, dict):
        raise UserError(
            f"run.out {out} holds files and no pretrained model ({INFO_FILE}), which the export would replace: give "
            "another run.out (a new or empty folder), or empty it yourself"
        )
    if info.get("settings_sha256") != settings_digest(cfg):
        raise UserError(
            f"run.out {out} holds a model pretrained with other settings ({INFO_FILE}: settings_sha256 "
            f"{info.get('settings_sha256')}, this config's {settings_digest(cfg)}), which the export would replace: "
            "give another run.out, or delete it yourself to replace it"
        )


def export_model(cfg: PretrainConfig, pipeline, info: dict[str, Any]) -> Path:
    """Write the pipeline (diffusers format), the prompt split and `shapes.json` to run.out, replacing it whole
    (`check_out` refused anything there but a model of the same settings).

    The directory is assembled next to its destination and renamed into place, so an interrupted export never
    leaves a half-written model behind.
    """
    out = Path(cfg.run.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        pipeline.save_pretrained(tmp)
        write_prompt_files(tmp / PROMPTS_DIR, cfg.data.split_seed, cfg.data.heldout_fraction, cfg.eval.prompts)
        info = {
            "size": cfg.model.size,
            "text_tokens": cfg.model.text_tokens,
            "split_seed": cfg.data.split_seed,
            "heldout_fraction": cfg.data.heldout_fraction,
            "settings_sha256": settings_digest(cfg),
            **info,
        }
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        check_out(cfg)  # again: something may have been put there while it trained
        rename_into_place(tmp, out, aside=out.parent / f".{out.name}.old-{os.getpid()}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote the pretrained model to %s", out)
    return out


def read_model_info(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """`shapes.json` of a pretrained ShapesWorld model (a UserError when the directory has none)."""
    from diffusion_rl.errors import UserError

    path = Path(model_dir) / INFO_FILE
    if not path.is_file():
        raise UserError(
            f"{model_dir} has no {INFO_FILE}: not a ShapesWorld model; make one with "
            "`diffusion-rl pretrain configs/shapes_pretrain.yaml`"
        )
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"{path}: not JSON ({e}); pretrain the model again, or restore the file") from None
