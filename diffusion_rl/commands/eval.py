"""`diffusion-rl eval`: compare the base model and checkpoints on a prompt file with one or more rewards."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from diffusion_rl.errors import UserError
from diffusion_rl.utils.json_input import parse_json

logger = logging.getLogger(__name__)

FALLBACK = {"steps": 20, "guidance": 4.5, "guidance_low_noise": None, "height": 64, "width": 64, "frames": 1,
            "dtype": "fp32", "max_sequence_length": 256, "ode_solver": "euler", "condition_size": "output"}  # fmt: skip


def register(subparsers) -> None:
    from diffusion_rl.config.model import device_flag
    from diffusion_rl.sampling.ode import ODE_SOLVER_NAMES  # the registries' names: no list kept here
    from diffusion_rl.sampling.sde import STEP_TYPE_NAMES

    p = subparsers.add_parser(
        "eval",
        help="evaluate the base model and checkpoints on a prompt file: K samples per prompt, every reward",
        description="Samples K images per prompt with the same seeds for every model, scores them with each "
        "reward, and writes metrics.json, samples.jsonl, compare.md, images and contact sheets to --out. "
        "Unset sampling settings come from the first checkpoint's training config (its validation settings).",
    )
    p.add_argument("--model", required=True, help="the base model: a diffusers model directory, or a Hub id owner/name")
    p.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="CKPT",
        help="`base`, a checkpoint step_NNNNNN directory, or a run directory (its latest); repeatable, one "
        "column each in the given order (default: base alone)",
    )
    p.add_argument("--prompts", required=True, help="prompt file: .txt, .jsonl or .parquet")
    p.add_argument(
        "--reward",
        help="reward name(s), comma-separated (registered names or module:fn / file.py:fn); "
        "default: the first checkpoint's training rewards",
    )
    p.add_argument(
        "--trust-checkpoint-rewards",
        action="store_true",
        help="run the user reward functions (module:fn, file.py:fn) that the checkpoint's config.yaml names; "
        "without it a checkpoint's config cannot choose code to run: name such a reward with --reward instead",
    )
    p.add_argument(
        "--reward-kwargs",
        default=None,
        help="JSON object: reward name (a training reward's label when it has one) → kwargs, e.g. '{\"ocr\": {}}'",
    )
    p.add_argument("--n", type=int, default=4, help="samples per prompt (K)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps")
    p.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale")
    p.add_argument("--guidance-low-noise", type=float, default=None,
                   help="Wan 2.2 A14B: the low-noise expert's guidance (diffusers' guidance_scale_2; default: the "
                        "run's validation setting, else --guidance)")  # fmt: skip
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None, help="video frames per sample (a video family; 4k + 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sde-type", default="ode", choices=STEP_TYPE_NAMES)
    p.add_argument("--noise-level", type=float, default=0.7)
    p.add_argument(
        "--ode-solver", default=None, choices=ODE_SOLVER_NAMES,
        help="solver of the ODE steps (default: the run's validation solver, else euler)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=8, help="images per forward pass and reward call")
    p.add_argument("--sheet-prompts", type=int, default=16, help="prompts shown on the contact sheets")
    p.add_argument("--no-ema", action="store_true", help="use the trained weights even when the run kept an EMA")
    p.add_argument("--device", default="auto", type=device_flag)
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"])
    p.add_argument("--max-sequence-length", type=int, default=None)
    p.add_argument("--condition-size", default=None, choices=["output", "pipeline"],
                   help="an editing family's condition images at the output size or its pipeline's "
                   "(model.condition_size)")  # fmt: skip
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--force", action="store_true", help="replace an earlier evaluation in --out")
    p.set_defaults(fn=cmd_eval)


def _refuse_untrusted_code(args: argparse.Namespace, first_config, checkpoint) -> None:
    """A checkpoint directory must not choose code to run: a user reward function (module:fn, file.py:fn) named only
    by its config.yaml runs when the user names it with --reward or passes --trust-checkpoint-rewards."""
    from diffusion_rl.rewards.user_fn import user_functions_named

    code = list(
        dict.fromkeys(user_functions_named([{"name": r.name, "kwargs": r.kwargs} for r in first_config.rewards]))
    )
    if code and not args.trust_checkpoint_rewards:
        raise UserError(
            f"the config.yaml of checkpoint {checkpoint} names the user reward function(s) {', '.join(code)}, which "
            f"would run as code; a checkpoint cannot choose code to run: name it with --reward {','.join(code)}, "
            f"or pass --trust-checkpoint-rewards if you trust this run"
        )


def _reward_choices(args: argparse.Namespace, first_config, checkpoint=None) -> list:
    from diffusion_rl.config.secrets import without_redacted
    from diffusion_rl.evaluation import RewardChoice

    if args.reward:
        names = [n.strip() for n in args.reward.split(",")]
        if not all(names):
            raise UserError(f"--reward {args.reward!r} has an empty name; use NAME[,NAME...]")
        choices = {n: RewardChoice(n) for n in names}
    elif first_config is not None:  # keyed by label (else name), as the run logged them
        _refuse_untrusted_code(args, first_config, checkpoint)
        choices = {}
        for i, r in enumerate(first_config.rewards):
            kwargs, redacted = without_redacted(r.kwargs)  # an inline api_key is not in a written config
            if redacted:
                logger.warning(
                    "the checkpoint's config.yaml has rewards.%d.kwargs %s redacted: give them again with "
                    "--reward-kwargs (or, for vlm, api_key_env)", i, ", ".join(redacted)
                )  # fmt: skip
            choices[r.metric_name] = RewardChoice(r.name, kwargs, r.label, r.frames)
    else:
        raise UserError("--reward is required when no checkpoint is given (e.g. --reward jpeg_compressibility)")
    if args.reward_kwargs:
        try:
            given = parse_json(args.reward_kwargs)
        except json.JSONDecodeError as e:
            raise UserError(f"--reward-kwargs is not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(given, dict) or not all(isinstance(v, dict) for v in given.values()):
            raise UserError("--reward-kwargs must be a JSON object of reward name → kwargs, e.g. '{\"ocr\": {}}'")
        unknown = sorted(set(given) - set(choices))
        if unknown:
            raise UserError(f"--reward-kwargs names {unknown}, which are not among the rewards {sorted(choices)}")
        for key, kwargs in given.items():
            choices[key] = dataclasses.replace(choices[key], kwargs={**choices[key].kwargs, **kwargs})
    return list(choices.values())


def cmd_eval(args: argparse.Namespace) -> None:
    from diffusion_rl.checkpoint.weights import checkpoint_config
    from diffusion_rl.config.fields import check_flag
    from diffusion_rl.config.model import LoraConfig, ModelConfig
    from diffusion_rl.data.prompts import load_prompts
    from diffusion_rl.evaluation import EvalSettings, evaluate, resolve_targets

    targets = resolve_targets(args.checkpoint)
    first_checkpoint = next((t.checkpoint for t in targets if not t.is_base), None)
    first = None if first_checkpoint is None else checkpoint_config(first_checkpoint)
    defaults = dict(FALLBACK)
    if first is not None:  # sample as the run validated, unless told otherwise
        guidance, low_noise = first.val.guidance_scales(first.sampling)
        defaults.update(
            steps=first.val.num_steps,
            guidance=guidance,
            guidance_low_noise=low_noise,
            height=first.val.size(first.sampling)[0],
            width=first.val.size(first.sampling)[1],
            frames=first.sampling.num_frames,
            ode_solver=first.val.ode_solver or first.sampling.ode_solver,
            dtype=first.model.dtype,
            max_sequence_length=first.model.max_sequence_length,
            condition_size=first.model.condition_size,
        )

    def pick(name: str):
        value = getattr(args, name)
        return defaults[name] if value is None else value

    settings = EvalSettings(
        n=args.n,
        num_steps=pick("steps"),
        guidance=pick("guidance"),
        guidance_low_noise=pick("guidance_low_noise"),
        height=pick("height"),
        width=pick("width"),
        sde_type=args.sde_type,
        noise_level=args.noise_level,
        ode_solver=pick("ode_solver"),
        seed=args.seed,
        batch_size=args.batch_size,
        sheet_prompts=args.sheet_prompts,
        use_ema=not args.no_ema,
        frames=pick("frames"),
    )
    check_flag("--max-sequence-length", args.max_sequence_length, "model.max_sequence_length", ModelConfig)
    model_cfg = ModelConfig(
        path=args.model,
        device=args.device,
        dtype=pick("dtype"),
        max_sequence_length=pick("max_sequence_length"),
        condition_size=pick("condition_size"),
        lora=LoraConfig(enabled=False),
    )
    rewards = _reward_choices(args, first, first_checkpoint)
    records = load_prompts(args.prompts)
    logger.info(
        "eval: %s on %d prompts × %d, %d %s steps, guidance %g, %d×%d, seed %d, rewards %s",
        ", ".join(t.name for t in targets),
        len(records),
        settings.n,
        settings.num_steps,
        settings.sde_type,
        settings.guidance,
        settings.height,
        settings.width,
        settings.seed,
        ", ".join(r.metric_name for r in rewards),
    )
    result = evaluate(model_cfg, targets, records, rewards, settings, args.out, args.prompts, force=args.force)
    print(result["table"], end="")
    logger.info("wrote %s (metrics.json, samples.jsonl, compare.md, sheets)", args.out)
