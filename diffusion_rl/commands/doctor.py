"""`diffusion-rl doctor --model PATH`: load a model, show what it is and what training it will need, sample once."""

from __future__ import annotations

import time
from pathlib import Path


def register(subparsers) -> None:
    from diffusion_rl.config.model import device_flag

    p = subparsers.add_parser(
        "doctor",
        help="check a model directory: family, parameter counts, dtype, a memory estimate, one sample image",
        description="The first thing to run on a new checkpoint: loads it as training would, prints its family, "
        "the parameters and dtype of each component, the trainable parameters (LoRA preset or full), an "
        "estimate of the device memory a training run holds for the given batch and resolution, and samples one "
        "image (timed; saved with --out).",
    )
    p.add_argument("--model", required=True, help="a diffusers model directory, or a Hub id owner/name")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="weights dtype")
    p.add_argument("--device", default="auto", type=device_flag)
    p.add_argument("--height", type=int, default=None, help="image height (default: the model's native size)")
    p.add_argument("--width", type=int, default=None, help="image width (default: the model's native size)")
    p.add_argument("--frames", type=int, default=1, help="video frames per sample (a video family: 4k + 1)")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        help="an editing family's condition image (repeatable; default: a generated test picture)",
    )
    p.add_argument("--micro-batch", type=int, default=8, help="samples per forward/backward (train.micro_batch_size)")
    p.add_argument("--rollout-batch", type=int, default=None, help="samples per rollout held on the device")
    p.add_argument("--steps", type=int, default=10, help="sampling steps (training rollout and the sample image)")
    p.add_argument("--guidance", type=float, default=4.5)
    p.add_argument("--lora-rank", type=int, default=32, help="LoRA rank of the estimate; 0 = full fine-tuning")
    p.add_argument("--kl", action="store_true", help="count the frozen reference copy of full fine-tuning")
    p.add_argument("--max-sequence-length", type=int, default=256)
    p.add_argument("--condition-size", default="output", choices=["output", "pipeline"],
                   help="an editing family's condition images at the output size or its pipeline's "
                   "(model.condition_size)")  # fmt: skip
    p.add_argument("--no-activations", action="store_true", help="skip measuring activations (a forward pass)")
    p.add_argument("--prompt", default="a photograph of a red apple on a wooden table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=None, help="save the sample there (a video: the same name, .webp); without it none is written"
    )
    p.set_defaults(fn=cmd_doctor)


def condition_sources(model, paths: list[str], height: int, width: int) -> list | None:
    """An editing family's condition images for the doctor at height × width: the --image files fitted to it, or as
    many generated test pictures as the model samples with (`sample_conditions`: grey with a red square, then a blue
    one elsewhere); None for other families (which refuse --image)."""
    import numpy as np

    from diffusion_rl.data.condition_images import ConditionImage
    from diffusion_rl.errors import UserError

    if not model.edits:
        if paths:
            raise UserError(f"--image: the {model.family} family takes no condition images")
        return None
    if paths:
        return [ConditionImage(str(Path(p).resolve()), f"--image {p}").load(height, width) for p in paths]
    pictures = []
    for i in range(model.sample_conditions):
        picture = np.full((height, width, 3), 128, dtype=np.uint8)
        top, left = (height // 4, width // 4) if i % 2 == 0 else (height // 2, width // 2)
        picture[top : top + height // 4, left : left + width // 4] = (220, 40, 40) if i % 2 == 0 else (40, 60, 220)
        pictures.append(picture)
    return pictures


def cmd_doctor(args) -> None:
    import torch

    from diffusion_rl.config.fields import check_flag
    from diffusion_rl.config.model import LoraConfig, ModelConfig
    from diffusion_rl.config.sampling import SamplingConfig
    from diffusion_rl.errors import UserError
    from diffusion_rl.models.doctor import dtype_of, estimate_memory, human_bytes, pipeline_components
    from diffusion_rl.models.image_size import image_sizes, require_size
    from diffusion_rl.models.loader import load_model
    from diffusion_rl.sampling.rollout import SamplerSettings, sample_images
    from diffusion_rl.tracking.media import sample_sheet, save_sample

    for name in ("micro_batch", "steps", "rollout_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    # each flag in the range of the config key it stands for, before the model loads (as `sample` checks them)
    check_flag("--max-sequence-length", args.max_sequence_length, "model.max_sequence_length", ModelConfig)
    for flag, key in (("--steps", "num_steps"), ("--guidance", "guidance"), ("--height", "height"),
                      ("--width", "width"), ("--frames", "num_frames")):  # fmt: skip
        check_flag(flag, getattr(args, flag[2:]), f"sampling.{key}", SamplingConfig)
    if args.lora_rank < 0:
        raise UserError(f"--lora-rank must be ≥ 0 (0 = full fine-tuning), got {args.lora_rank}")
    lora = LoraConfig(enabled=args.lora_rank > 0, rank=max(args.lora_rank, 1), alpha=2 * max(args.lora_rank, 1))
    cfg = ModelConfig(
        path=args.model,
        dtype=args.dtype,
        device=args.device,
        lora=lora,
        max_sequence_length=args.max_sequence_length,
        condition_size=args.condition_size,
    )
    start = time.perf_counter()
    model = load_model(cfg)
    native = image_sizes(model).native
    args.height = native if args.height is None else args.height
    args.width = native if args.width is None else args.width
    require_size(model, args.height, args.width, args.frames)
    read_at = model.condition_size(model.condition_sizing, args.height, args.width)  # model.condition_size
    sources = condition_sources(model, args.image, *read_at)
    lines = [
        f"model      {args.model}",
        f"family     {model.family} ({type(model.pipeline).__name__}), loaded in {time.perf_counter() - start:.1f} s "
        f"on {model.device}",
        "components",
    ]
    for name, module in pipeline_components(model.pipeline).items():
        count = sum(p.numel() for p in module.parameters())
        lines.append(f"  {name:<16} {type(module).__name__:<40} {count / 1e6:>10.2f}M  {dtype_of(module)}")
    trainable = sum(p.numel() for p in model.trainable_parameters())
    mode = f"LoRA r={lora.rank} on the {model.family} preset" if lora.enabled else "full fine-tuning"
    lines.append(f"trainable  {trainable / 1e6:.2f}M ({mode})")
    rollout_batch = args.rollout_batch if args.rollout_batch is not None else args.micro_batch
    estimate = estimate_memory(
        model,
        height=args.height,
        width=args.width,
        micro_batch=args.micro_batch,
        rollout_batch=rollout_batch,
        num_steps=args.steps,
        guidance=args.guidance,
        kl_reference=args.kl,
        measure_activations=not args.no_activations,
        frames=args.frames,
        sources=sources,
    )
    size = f"{args.height}×{args.width}" + (f"×{args.frames} frames" if args.frames > 1 else "")
    if sources:
        size += f", {len(sources)} condition image(s) at {read_at[0]}×{read_at[1]}"
    lines.append(
        f"memory estimate, {size}, micro-batch {args.micro_batch}, rollout batch "
        f"{rollout_batch}, guidance {args.guidance:g} (add 1–3 GiB for CUDA context and fragmentation)"
    )
    lines += [f"  {label:<28} {human_bytes(n):>10}" for label, n in estimate.rows()]
    if torch.cuda.is_available() and model.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(model.device)
        lines.append(f"  {'measured peak so far':<28} {human_bytes(peak):>10}")

    settings = SamplerSettings(args.steps, args.guidance, args.height, args.width, frames=args.frames)
    start = time.perf_counter()
    rows = [sources] if sources else None
    images = sample_images(model, [args.prompt], [""], settings, init_seeds=[args.seed], images=rows)
    seconds = time.perf_counter() - start
    timing = f"{args.steps} ODE steps in {seconds:.2f} s, {seconds / args.steps:.3f} s/step"
    if args.out is None:
        lines.append(f"sample     {timing} (not saved: --out FILE.png keeps it)")
    else:
        shown = condition_sources(model, args.image, args.height, args.width)  # beside the result, at its size
        path = save_sample(
            sample_sheet(images.numpy(), [args.prompt], 1, [shown] if shown else None),
            Path(args.out).with_suffix("").as_posix(),
        )
        lines.append(f"sample     {path} ({timing})")
    print("\n".join(lines))
