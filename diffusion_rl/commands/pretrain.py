"""`diffusion-rl pretrain CONFIG [key=value ...]`: pretrain a tiny model on ShapesWorld (VAE, then flow matching)."""

from __future__ import annotations

import json
import logging

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "pretrain",
        help="pretrain a tiny model on ShapesWorld: the VAE, then the transformer by flow matching",
        description="Trains the tiny AutoencoderKL on ShapesWorld images and freezes it, then trains the tiny "
        "transformer by flow matching; writes a diffusers-format model (with its prompt split and scores) to "
        "run.out. Resumes from the latest checkpoint in run.dir (run.resume=never starts over).",
    )
    p.add_argument("config", help="YAML pretraining config, e.g. configs/shapes_pretrain.yaml")
    p.add_argument("overrides", nargs="*", default=[], help="optional dotted key=value overrides, e.g. flow.steps=100")
    p.set_defaults(fn=cmd_pretrain)


def cmd_pretrain(args) -> None:
    from diffusion_rl.pretrain.config import load_pretrain_config
    from diffusion_rl.pretrain.trainer import PretrainTrainer

    cfg = load_pretrain_config(args.config, args.overrides)
    scores = PretrainTrainer(cfg).train()
    logger.info("held-out ShapesWorld scores: %s", json.dumps({k: round(v, 4) for k, v in scores.items()}))
    logger.info("model: %s (run directory: %s)", cfg.run.out, cfg.run.dir)
