"""`diffusion-rl` command line: train, sample, init-tiny, config show|reference, and the commands/ modules.

User errors (bad config, missing file, bad value) print one line and exit with status 2, no traceback; an OSError
(read-only directory, full disk) prints its path and cause in one line and exits with status 1, as does a run that
stopped itself (divergence, every sample failing); a run the reward-hacking guard ended (guard.action stop or
rollback) prints that outcome last and exits with status 3; Ctrl-C is one line too (a training run's says how many
steps were done and which checkpoint holds them), status 130.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # quiet the torchvision notices of image processors

from diffusion_rl.config.secrets import redact_text  # noqa: E402  (config/ imports no torch)
from diffusion_rl.errors import GuardStopped, RunStopped, UserError  # noqa: E402
from diffusion_rl.utils import cuda_alloc, omp  # noqa: E402  (stdlib only: imported before torch)

logger = logging.getLogger("diffusion_rl")

# Each module in diffusion_rl/commands/ defines `register(subparsers)`, adding its subcommand(s) with
# `set_defaults(fn=...)`. Keep imports of heavy libraries inside the command functions.
COMMAND_MODULES: list[str] = [
    "eval",
    "report",
    "prepare_pairs",
    "prepare_embeddings",
    "export",
    "doctor",
    "estimate",
    "pretrain",
    "checkpoint",
]


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    import diffusers
    import transformers

    from diffusion_rl.config.secrets import RedactingFilter

    for handler in logging.getLogger().handlers:  # a URL's credentials never reach the console or a log file
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def cmd_train(args) -> None:
    from diffusion_rl.config import load
    from diffusion_rl.tracking.console import run_summary
    from diffusion_rl.trainer import make_trainer

    cfg = load(args.config, args.overrides)
    refuse_what_cannot_fit(cfg)
    trainer = make_trainer(cfg)
    for line in run_summary(trainer.train()):
        logger.info("%s", line)
    logger.info("run directory: %s", cfg.run.dir)
    ended = trainer.guard.ending()  # last: what the guard did, and how to go on
    if ended:
        raise GuardStopped(ended)


def refuse_what_cannot_fit(cfg) -> None:
    """Refuse, before anything is loaded, a config whose peak memory (estimate/estimator.py's count for one device,
    the one `diffusion-rl estimate` prints) exceeds what this machine's device has: its GPU's memory, or the RAM
    that the process (and a local Ray cluster's CPU workers, each with its own copy) share."""
    import torch

    from diffusion_rl.estimate.architectures import architecture_for
    from diffusion_rl.estimate.devices import device_named
    from diffusion_rl.estimate.estimator import GIB, estimate
    from diffusion_rl.models.loader import resolve_device

    e = cfg.engine
    ray = e.kind == "ray"
    if ray and (e.address is not None or e.gpus_per_worker > 0):
        return  # the cluster's devices, not this process's (which must not open CUDA): `estimate --gpu NAME` says
    # a CUDA device this machine lacks is one line here, before anything is created
    local = None if ray else resolve_device(cfg.model.device)
    cuda = local is not None and local.type == "cuda"
    workers = e.num_workers if ray else 1  # a local Ray cluster's CPU workers share this machine's RAM
    if cuda:
        props = torch.cuda.get_device_properties(local.index or 0)
        capacity, what, sharing = props.total_memory, f"the GPU ({props.name})", 1
    else:
        capacity, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
        sharing = workers
    try:
        arch = architecture_for(cfg.model)
    except UserError:
        return  # no model directory to count yet: loading it names what is missing
    device = device_named("cpu").with_overrides(peak_tflops=1.0, bandwidth_gbs=1.0)  # the time is not used here
    try:
        result = estimate(cfg, arch, device, workers)  # a size the model cannot make: a UserError naming the keys
    except ValueError:
        return  # a shape the meta forward cannot take (a frame count): the model's own check names it when loaded
    context = 0.0 if cuda else result.memory_gib["context"]  # the CUDA context: a CPU run has none
    need = (result.peak_memory_gib_per_gpu - context) * sharing
    if need * GIB > capacity:
        parts = sorted(result.memory_gib.items(), key=lambda kv: -kv[1])[:2]
        largest = ", ".join(f"{k} {v * sharing:.3g} GiB" for k, v in parts)
        raise UserError(
            f"this config needs about {need:.3g} GiB at its peak ({largest}; `diffusion-rl estimate` lists it all), "
            f"more than {what} has ({capacity / GIB:.3g} GiB): lower data.prompts_per_step × data.group_size, "
            "sampling.height × sampling.width or train.micro_batch_size"
        )


SAMPLE_DEFAULTS = {"steps": 20, "guidance": 4.5, "guidance_low_noise": None, "height": 64, "width": 64,
                   "frames": 1}  # without --checkpoint  # fmt: skip


def cmd_sample(args) -> None:
    from diffusion_rl.config.fields import check_flag
    from diffusion_rl.config.model import ModelConfig
    from diffusion_rl.data.condition_images import fit_rows
    from diffusion_rl.evaluation.evaluate import EvalSettings
    from diffusion_rl.models.image_size import require_size
    from diffusion_rl.models.loader import load_model
    from diffusion_rl.sampling.rollout import sample_images
    from diffusion_rl.sampling.window import default_window
    from diffusion_rl.tracking.media import sample_sheet, save_sample
    from diffusion_rl.utils.seeding import seed_for

    check_flag("--max-sequence-length", args.max_sequence_length, "model.max_sequence_length", ModelConfig)
    if Path(args.out).suffix.lower() not in ("", ".png", ".webp"):  # it writes <name>.png: never another file
        raise UserError(f"--out {args.out}: sample writes a .png sheet (a video family's: .webp); name it .png")
    EvalSettings(**{k: v for k, v in _sample_flags(args).items() if v is not None})  # the flags given, before loading
    if args.checkpoint:  # the run's LoRA settings and trained (or EMA) weights on top of --model
        from diffusion_rl.checkpoint.weights import checkpoint_config, load_checkpoint_model, validation_sampling

        model, directory, _ = load_checkpoint_model(
            args.checkpoint,
            args.model,
            device=args.device,
            max_sequence_length=args.max_sequence_length,
            use_ema=not args.no_ema,
        )
        defaults = validation_sampling(checkpoint_config(directory))  # sample as the run validated
    else:
        defaults = SAMPLE_DEFAULTS
        length = {} if args.max_sequence_length is None else {"max_sequence_length": args.max_sequence_length}
        model = load_model(
            ModelConfig(path=args.model, device=args.device, lora=ModelConfig().lora.__class__(enabled=False), **length)
        )
    if args.condition_size is not None:
        model.condition_sizing = args.condition_size
    for key, value in defaults.items():  # flags the user left out: as the run validated, or SAMPLE_DEFAULTS
        if getattr(args, key) is None:
            setattr(args, key, value)
    flags = EvalSettings(**_sample_flags(args))
    require_size(model, args.height, args.width, args.frames)  # a size the model cannot make is the user's to fix
    model.check_low_noise_guidance(args.guidance_low_noise, "--guidance-low-noise")
    prompts = [p for p in args.prompt for _ in range(args.n)]
    settings = flags.sampler()
    window = None if args.sde_type == "ode" else default_window(args.steps)
    seeds = [seed_for(args.seed, i) for i in range(len(prompts))]
    rows = []
    if args.image:  # an edit: every prompt edits the same condition image(s)
        from diffusion_rl.data.condition_images import ConditionImage

        rows = [[ConditionImage(str(Path(p).resolve()), f"--image {p}") for p in args.image]] * len(prompts)
    images = sample_images(model, prompts, [args.negative_prompt] * len(prompts), settings, init_seeds=seeds,
                           window=window, images=model.fit_conditions(rows, args.height, args.width))  # fmt: skip
    sheet = sample_sheet(images.numpy(), prompts, args.n, fit_rows(rows, args.height, args.width))
    path = save_sample(sheet, Path(args.out).with_suffix("").as_posix())  # .png, or .webp for a video
    logger.info("wrote %s (%d samples, %d×%d)", path, len(prompts), args.height, args.width)


def _sample_flags(args) -> dict:
    """`sample`'s sampling flags as EvalSettings' fields (its checks: each flag in its config key's range)."""
    return dict(n=args.n, num_steps=args.steps, guidance=args.guidance, height=args.height, width=args.width,
                sde_type=args.sde_type, noise_level=args.noise_level, ode_solver=args.ode_solver, frames=args.frames,
                guidance_low_noise=args.guidance_low_noise)  # fmt: skip


def cmd_init_tiny(args) -> None:
    from diffusion_rl.models.tiny import save_tiny

    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; init-tiny writes a directory")
    if out.exists() and any(out.iterdir()) and not args.force:
        raise UserError(f"{out} exists and is not empty; pass --force to overwrite")
    save_tiny(out, args.family, args.preset, seed=args.seed)  # UserError for a preset the family lacks
    logger.info("wrote the tiny %s model (%s preset) to %s", args.family, args.preset, out)


def cmd_serve_reward(args) -> None:
    from diffusion_rl.rewards.server import run_server_from_args

    run_server_from_args(args)


def cmd_prepare_ocr(args) -> None:
    from diffusion_rl.data.ocr_prepare import run_prepare_ocr_from_args

    result = run_prepare_ocr_from_args(args)
    logger.info("prepared %s", result)


def cmd_prepare_geneval(args) -> None:
    from diffusion_rl.rewards.geneval.prepare import prepare_geneval

    logger.info("prepared %d GenEval prompts in %s", prepare_geneval(args.input, args.out), args.out)


def cmd_prepare_edit(args) -> None:
    from diffusion_rl.data.edit_prepare import run_prepare_edit_from_args

    logger.info("prepared %s", run_prepare_edit_from_args(args))


def cmd_prepare_shapes_edits(args) -> None:
    from diffusion_rl.data.edit_prepare import run_prepare_shapes_edits_from_args

    logger.info("wrote %s", run_prepare_shapes_edits_from_args(args))


def cmd_config(args) -> None:
    from diffusion_rl.config import Config, load
    from diffusion_rl.config.loading import to_yaml
    from diffusion_rl.config.reference import describe, describe_markdown
    from diffusion_rl.config.secrets import redact_secrets

    if args.action == "show":  # secrets (an inline api_key) show as ***redacted***, as in a run's config.yaml
        print(to_yaml(redact_secrets(load(args.config, args.overrides))), end="")
    elif args.markdown:
        print(describe_markdown(Config, "Config reference"), end="")
    else:
        print(describe(Config))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffusion-rl",
        description="Fine-tune flow-matching image and video models with reinforcement learning from rewards. "
        "Start with `diffusion-rl train configs/quickstart.yaml`; `diffusion-rl COMMAND -h` for each command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="RL-train a model from a YAML config")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", default=[],
                   help="optional dotted key=value overrides, e.g. train.total_steps=10")  # fmt: skip
    p.set_defaults(fn=cmd_train)

    from diffusion_rl.config.model import device_flag
    from diffusion_rl.config.plugins import FAMILIES
    from diffusion_rl.sampling.ode import ODE_SOLVER_NAMES
    from diffusion_rl.sampling.sde import STEP_TYPE_NAMES

    p = sub.add_parser("sample", help="sample a labelled image grid")
    p.add_argument("--model", required=True, help="a diffusers model directory, or a Hub id owner/name")
    p.add_argument("--prompt", action="append", required=True, help="prompt (repeatable)")
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--n", type=int, default=1, help="images per prompt")
    run_or = "default: with --checkpoint the run's validation setting, else"
    p.add_argument("--steps", type=int, default=None, help=f"sampling steps ({run_or} 20)")
    p.add_argument("--guidance", type=float, default=None, help=f"{run_or} 4.5")
    p.add_argument(
        "--guidance-low-noise", type=float, default=None,
        help=f"Wan 2.2 A14B: the low-noise expert's guidance, guidance_scale_2 ({run_or} --guidance)",
    )  # fmt: skip
    p.add_argument("--height", type=int, default=None, help=f"{run_or} 64")
    p.add_argument("--width", type=int, default=None, help=f"{run_or} 64")
    p.add_argument("--frames", type=int, default=None, help=f"video frames per sample, 4k + 1 ({run_or} 1)")
    p.add_argument(
        "--image", action="append", default=[], help="condition image of an editing family (repeatable: several)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sde-type", default="ode", choices=STEP_TYPE_NAMES)
    p.add_argument("--noise-level", type=float, default=0.7)
    p.add_argument("--ode-solver", default="euler", choices=ODE_SOLVER_NAMES, help="solver of the ODE steps")
    p.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        help="text tokens per prompt (default: with --checkpoint the run's model.max_sequence_length, else 256)",
    )
    p.add_argument("--condition-size", default=None, choices=["output", "pipeline"],
                   help="an editing family's --image at the output size or its pipeline's (default: with --checkpoint "
                   "the run's model.condition_size, else output)")  # fmt: skip
    p.add_argument("--device", default="auto", type=device_flag)
    p.add_argument("--out", default="grid.png", help="the sheet: .png (a video family: the same name, .webp)")
    p.add_argument("--checkpoint", default=None, help="apply a training checkpoint (step_NNNNNN or run directory)")
    p.add_argument("--no-ema", action="store_true", help="with --checkpoint: the trained weights even if an EMA exists")
    p.set_defaults(fn=cmd_sample)

    from diffusion_rl.models.tiny import tiny_presets

    presets = "\n".join(f"  {family:<16} {', '.join(tiny_presets(family))}" for family in FAMILIES.names())
    p = sub.add_parser("init-tiny", help="write a tiny random-weight model of a model family to a directory",
                       epilog=f"presets of each family (--family, --preset):\n{presets}\nsd3's shapes is the "
                       "pretrained ShapesWorld model shipped in the package.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--family", default="sd3", help=f"the model family ({', '.join(FAMILIES.names())})")
    p.add_argument("dir")
    p.add_argument("--preset", default="base", help="the tiny model's size (the family's presets: below)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true")
    p.set_defaults(fn=cmd_init_tiny)

    from diffusion_rl.data.edit_prepare import add_prepare_edit_arguments, add_prepare_shapes_edits_arguments
    from diffusion_rl.data.ocr_prepare import add_prepare_ocr_arguments
    from diffusion_rl.rewards.server import add_serve_reward_arguments

    p = sub.add_parser("serve-reward", help="serve a reward over HTTP (JSON + PNG) for the `remote` reward")
    add_serve_reward_arguments(p)
    p.set_defaults(fn=cmd_serve_reward)

    p = sub.add_parser("prepare", help="prepare datasets")
    prepare = p.add_subparsers(dest="dataset", required=True)
    p = prepare.add_parser("ocr", help="OCR prompts (text to render between double quotes) → jsonl/parquet rows")
    add_prepare_ocr_arguments(p)
    p.set_defaults(fn=cmd_prepare_ocr)
    p = prepare.add_parser("geneval", help="GenEval metadata (prompt, tag, include, exclude) → prompt records")
    p.add_argument("input", help="GenEval-format metadata .jsonl (prompt, tag, include, exclude per line)")
    p.add_argument("out", help="prompt records: .jsonl or .parquet")
    p.set_defaults(fn=cmd_prepare_geneval)
    p = prepare.add_parser("edit", help="a folder of {prompt, image} edits → verl-style parquet with the images inside")
    add_prepare_edit_arguments(p)
    p.set_defaults(fn=cmd_prepare_edit)
    p = prepare.add_parser("shapes-edits", help="the ShapesWorld edit dataset (instructions, source images)")
    add_prepare_shapes_edits_arguments(p)
    p.set_defaults(fn=cmd_prepare_shapes_edits)

    for module in COMMAND_MODULES:  # commands that live in their own module: diffusion_rl/commands/<name>.py
        importlib.import_module(f"diffusion_rl.commands.{module}").register(sub)

    p = sub.add_parser("config", help="show the resolved config, or the reference of every key")
    p.add_argument("action", choices=["show", "reference"])
    p.add_argument("--markdown", action="store_true", help="reference: as Markdown tables (docs/config.md)")
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("overrides", nargs="*", default=[], help="optional dotted key=value overrides")
    p.set_defaults(fn=cmd_config)
    return parser


def requested_engine(argv: list[str]) -> dict:
    """The engine section as the command line asks for it, read once before torch loads (config/ imports no torch):
    the first config file it names (with its base files) under its `engine.<key>=` overrides; {} when neither says. A
    bad file or value counts as unsaid here: the command itself refuses it in one line."""
    from diffusion_rl.config.loading import apply_overrides, read_yaml_config

    overrides = [a for a in argv if a.startswith("engine.") and "=" in a]
    files = [a for a in argv if a.endswith((".yaml", ".yml")) and os.path.isfile(a)]
    try:
        data = apply_overrides(read_yaml_config(files[0]) if files else {}, overrides)
    except UserError:
        return {}
    engine = data.get("engine")
    return engine if isinstance(engine, dict) else {}


def prepare_process_env(argv: list[str]):
    """What must be in the environment before torch loads, decided from the command line: idle OpenMP threads spin or
    sleep (utils/omp.py; libgomp reads the variables once) and CUDA's allocator uses expandable segments
    (utils/cuda_alloc.py). Returns the OpenMP decision; None when torch is already loaded (main called again in one
    process)."""
    if "torch" in sys.modules:
        return None
    engine = requested_engine(argv)
    cuda_alloc.apply(engine.get("cuda_expandable_segments") is not False)
    requested = engine.get("omp_wait_policy")
    requested = requested if requested in omp.CHOICES else "auto"
    measure = requested == "auto" and not omp.user_setting(os.environ)
    busy, cpus = omp.busy_cpus() if measure else (None, 0)
    decision = omp.decide(requested, os.environ, busy, cpus)
    omp.apply(decision)
    return decision


def main(argv: list[str] | None = None) -> int:
    omp_decision = prepare_process_env(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list) and all(_is_override(a) for a in extra):
        args.overrides += extra  # dotted overrides after a command's flags: accepted anywhere
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging(args.verbose)
    if omp_decision is not None:  # -v: the decision and why; never a line before the command's own first one
        omp.logger.debug("%s", omp.describe(omp_decision))
    try:
        args.fn(args)
    except UserError as e:
        print(f"diffusion-rl: error: {redact_text(str(e))}", file=sys.stderr)
        return 2
    except RunStopped as e:  # divergence, every sample failing: why, and the last good checkpoint
        print(f"diffusion-rl: stopped: {redact_text(str(e))}", file=sys.stderr)
        logger.debug("the error in full:", exc_info=True)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside a training run's loop (which says how far it got, above)
        print("diffusion-rl: interrupted (Ctrl-C)", file=sys.stderr)
        logger.debug("where:", exc_info=True)
        return 130
    except OSError as e:  # read-only run dir, full disk, …: the path and the cause (-v: the traceback too)
        cause = e.cause if isinstance(getattr(e, "cause", None), OSError) else e  # Ray wraps a worker's error
        where = f"{cause.filename}: " if cause.filename is not None else ""
        print(f"diffusion-rl: error: {where}{cause.strerror or cause}", file=sys.stderr)
        logger.debug("the error in full:", exc_info=True)
        return 1
    return 0


def _is_override(arg: str) -> bool:
    return not arg.startswith("-") and "=" in arg


if __name__ == "__main__":
    sys.exit(main())
