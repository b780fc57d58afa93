"""`diffusion-rl estimate CONFIG --gpu NAME --gpus N [--json]`: memory per GPU, step time and GPU-hours before
launch, from the config and the model's architecture alone (no weights; see diffusion_rl/estimate/)."""

from __future__ import annotations

import json
import math


def register(subparsers) -> None:
    from diffusion_rl.estimate.devices import DEVICES
    from diffusion_rl.estimate.estimator import GPUS_PER_NODE, HOST_RAM_GIB

    p = subparsers.add_parser(
        "estimate",
        help="estimate memory per GPU, time per step and GPU-hours of a config before launch (no weights needed)",
        description="Counts the FLOPs of one rollout and one update exactly on the transformer built on the meta "
        "device (from the model directory's configs, a tiny preset, or the architectures shipped for the ready "
        "configs), estimates the memory each GPU holds, and times a step with a roofline of the GPU. "
        "See docs/estimate.md.",
    )
    p.add_argument("config", help="training config (YAML)")
    p.add_argument("overrides", nargs="*", default=[], help="optional dotted key=value overrides, as for train")
    p.add_argument("--gpu", default="h100", help=f"device: {', '.join(DEVICES)}")
    p.add_argument("--gpus", type=int, default=None, help="devices (default: engine.num_workers for ray, else 1)")
    p.add_argument("--arch", default=None, help="a shipped architecture to use instead of the model directory")
    p.add_argument("--prompt-tokens", type=int, default=64,
                   help="typical prompt length in tokens, for families that cut padding")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (cpu: needed)")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="override the device's memory bandwidth, GB/s")
    p.add_argument("--memory-gib", type=float, default=None, help="override the device's memory, GiB")
    p.add_argument("--efficiency", type=float, default=None, help="fraction of peak and bandwidth reached")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=GPUS_PER_NODE,
        help=f"GPUs (Ray workers) per node, for the host memory per node (default {GPUS_PER_NODE})",
    )
    p.add_argument(
        "--node-ram-gib",
        type=float,
        default=HOST_RAM_GIB,
        help=f"a node's RAM: warn when its workers' host memory needs more (default {HOST_RAM_GIB:g})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_estimate)


def cmd_estimate(args) -> None:
    from diffusion_rl.config import EngineConfig, LogConfig, ModelConfig, load
    from diffusion_rl.config.fields import check_flag
    from diffusion_rl.errors import UserError
    from diffusion_rl.estimate.architectures import architecture_for
    from diffusion_rl.estimate.devices import device_named
    from diffusion_rl.estimate.estimator import EFFICIENCY, EFFICIENCY_RANGE, estimate

    ranged = (  # (flag, the config key whose range it is checked against, its section)
        ("--gpus", "engine.num_workers", EngineConfig),
        ("--prompt-tokens", "model.max_sequence_length", ModelConfig),
        ("--peak-tflops", "log.peak_tflops", LogConfig),
    )

    device = device_named(args.gpu).with_overrides(args.peak_tflops, args.bandwidth_gbs, args.memory_gib)
    if device.peak_tflops is None or device.bandwidth_gbs is None:
        raise UserError(f"--gpu {args.gpu}: no peak or bandwidth in the table; give --peak-tflops and --bandwidth-gbs")
    for flag, key, section in ranged:
        check_flag(flag, getattr(args, flag[2:].replace("-", "_")), key, section)
    check_flag("--gpus-per-node", args.gpus_per_node, "engine.num_workers", EngineConfig)
    for name in ("bandwidth_gbs", "memory_gib", "node_ram_gib"):  # no config key: any finite positive number
        value = getattr(args, name)
        if value is not None and not (0 < value < math.inf):
            raise UserError(f"--{name.replace('_', '-')} must be > 0 and finite, got {value}")
    if args.efficiency is not None and args.efficiency not in EFFICIENCY_RANGE:
        raise UserError(f"--efficiency is a fraction of the device's peak and bandwidth, in {EFFICIENCY_RANGE}; "
                        f"got {args.efficiency:g}")  # fmt: skip
    cfg = load(args.config, args.overrides)
    gpus = args.gpus or (cfg.engine.num_workers if cfg.engine.kind == "ray" else 1)
    arch = architecture_for(cfg.model, args.arch)
    result = estimate(cfg, arch, device, gpus, config_name=args.config, prompt_tokens=args.prompt_tokens,
                      efficiency=args.efficiency or EFFICIENCY, gpus_per_node=args.gpus_per_node,
                      node_ram_gib=args.node_ram_gib)  # fmt: skip
    if args.json:
        print(json.dumps(result.as_dict(), indent=1))
        return
    print(render(result))


def render(r) -> str:
    from diffusion_rl.estimate.estimator import TIGHT

    def fits(flag):
        return "unknown" if flag is None else ("fits" if flag else "does NOT fit")

    def seconds(t):  # a tiny model's phases take milliseconds: keep 3 significant figures
        return f"{t:.1f} s" if t >= 10 else f"{t:.3g} s"

    capacity = "" if r.gpu_memory_gib is None else f" of {r.gpu_memory_gib:.2f} GiB"
    headroom = []
    if r.fits:
        share = r.headroom_gib / r.gpu_memory_gib
        headroom = [f"  headroom           {r.headroom_gib:8.2f} ({share:.1%} of the device)"]
        if share < TIGHT:
            headroom.append(f"WARNING       under {TIGHT:.0%} of the device's memory is left free at the peak: "
                            "fragmentation or a longer prompt can take it; leave more room (a memory saver, a "
                            "smaller micro-batch)")  # fmt: skip
    lines = [
        f"config        {r.config} ({r.architecture}), {r.images_per_step} {r.samples} per step on {r.gpus}× {r.gpu}",
        f"FLOPs/step    {r.flops_per_step:.3g} (rollout {r.flops_rollout:.3g}, update {r.flops_update:.3g})",
        "memory per GPU (GiB)",
        *(f"  {k:<18} {v:8.2f}" for k, v in r.memory_gib.items()),
        f"  peak               {r.peak_memory_gib_per_gpu:8.2f}{capacity}: {fits(r.fits)} "
        f"({r.checkpointed_blocks} of {r.blocks} blocks checkpointed; without gradient checkpointing "
        f"{r.peak_memory_gib_per_gpu_unchecked:.2f}: {fits(r.fits_without_checkpointing)}; with every block "
        f"{r.peak_memory_gib_per_gpu_checkpointed:.2f}: {fits(r.fits_with_checkpointing)})",
        *headroom,
        *host_lines(r),
        f"time per step {seconds(r.step_seconds)} at {r.efficiency:.0%} of peak and bandwidth: "
        + ", ".join(f"{k} {seconds(v)}" for k, v in r.phase_seconds.items()),
        f"throughput    {r.images_per_second:.3g} {r.samples}/s, {r.images_per_gpu_second:.3g} {r.samples}/GPU/s",
        f"train         {r.total_steps} steps: {r.gpu_hours:.3g} GPU-hours ({r.gpu_hours / r.gpus:.3g} h wall-clock)",
        *(f"assumes       {a}" for a in r.assumptions),
    ]
    return "\n".join(lines)


def host_lines(r) -> list[str]:
    """What the memory savers keep on the CPU: per worker by part, per node, and a warning over the node's RAM."""
    if not r.host_memory_gib_per_worker:
        return []
    parts = ", ".join(f"{k} {v:.2f}" for k, v in r.host_memory_gib.items() if v)
    lines = [f"host memory   {r.host_memory_gib_per_worker:.2f} GiB per worker ({parts}); "
             f"{r.host_memory_gib_per_node:.2f} per node of {r.workers_per_node} worker(s)"]  # fmt: skip
    if not r.host_fits:
        lines.append(f"WARNING       a node's {r.workers_per_node} worker(s) keep {r.host_memory_gib_per_node:.1f} GiB "
                     f"on the CPU, more than its {r.node_ram_gib:g} GiB of RAM (--node-ram-gib): fewer workers per "
                     "node, or the frozen encoders on the GPU (model.offload_frozen=false)")  # fmt: skip
    return lines
