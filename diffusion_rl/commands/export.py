"""`diffusion-rl export`: a checkpoint's trained weights for diffusers — a LoRA folder, or a merged model."""

from __future__ import annotations

import logging
from pathlib import Path

from diffusion_rl.errors import UserError

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    from diffusion_rl.config.model import device_flag

    p = subparsers.add_parser(
        "export",
        help="write a checkpoint's weights for diffusers — a LoRA folder (load_lora_weights) or, with --merge, a model "
        "— with a model card",
        description="Without --merge: the trained LoRA in diffusers' format (pytorch_lora_weights.safetensors, for "
        "pipeline.load_lora_weights(OUT)) and in peft's (adapter_model.safetensors + adapter_config.json). With "
        "--merge: the whole pipeline with the trained weights merged into its transformer, saved with "
        "save_pretrained (load it with from_pretrained, or train/sample it with --model OUT). Both write a model card, "
        "README.md: the Hub's front matter, how it was trained, and a diffusers snippet that samples as the run "
        "validated (its steps, guidance, size and text length).",
    )
    p.add_argument("--checkpoint", required=True, help="a step_NNNNNN checkpoint directory, or a run directory")
    p.add_argument(
        "--model",
        default=None,
        help="the base model: a directory or a Hub id owner/name (default: the run's model.path)",
    )
    p.add_argument("--merge", action="store_true", help="merge into the transformer and write a full diffusers model")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="weights dtype (default: the run's)")
    p.add_argument("--device", default="cpu", type=device_flag, help="where to merge (cpu needs no GPU memory)")
    p.add_argument("--no-ema", action="store_true", help="export the trained weights even when the run kept an EMA")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.set_defaults(fn=cmd_export)


def cmd_export(args) -> None:
    from diffusion_rl.checkpoint.weights import load_checkpoint_model

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; export writes a directory")
    if out.exists() and any(out.iterdir()) and not args.force:
        raise UserError(f"--out {out} exists and is not empty; pass --force to write into it")
    model, checkpoint, which = load_checkpoint_model(
        args.checkpoint, args.model, device=args.device, dtype=args.dtype, use_ema=not args.no_ema
    )
    if not args.merge and model.policies.lora is None:
        raise UserError(
            f"{checkpoint} is a full fine-tuning checkpoint (no LoRA): pass --merge to write the whole model"
        )
    _export(model, checkpoint, which, out, args)


def _export(model, checkpoint: Path, which: str, out: Path, args) -> None:
    """The weights, then the model card (README.md) that says how they were trained and how to sample them."""
    from diffusion_rl.checkpoint.model_card import model_card, write_model_card
    from diffusion_rl.checkpoint.paths import step_of
    from diffusion_rl.checkpoint.weights import checkpoint_config
    from diffusion_rl.models.export import export_merged, write_lora_adapter

    cfg = checkpoint_config(checkpoint)
    if args.merge:
        export_merged(model, out)
        logger.info("exported %s (%s weights) merged into a %s model at %s", checkpoint, which, model.family, out)
    else:
        file = write_lora_adapter(model, out)
        logger.info("exported the LoRA of %s (%s weights) to %s", checkpoint, which, file)
    card = model_card(model, cfg, out=out, base=args.model or cfg.model.path, step=step_of(checkpoint),
                      weights=which, merged=args.merge)  # fmt: skip
    logger.info("wrote the model card %s", write_model_card(out, card))
