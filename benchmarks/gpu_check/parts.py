"""The parts of the GPU check, each a function of the `Context` returning a JSON-able dict (or raising `Skipped`).

Every model part builds its trainer as `diffusion-rl train` does (config load, `make_trainer`: engine, worker,
algorithm, rewards, data) on a real-size random-weight model (models.py), and times `Trainer.train_step`: step 0
warms up (autotuning, the FLOP count of each shape, engine/flops.py), step 1 is measured. The ready config runs as it
is (dtype, CFG, steps, window, LoRA, gradient checkpointing, micro-batch), except: one prompt per step with a group of
micro_batch_size × num_minibatches rows (one micro-batch per optimizer step, both optimizer steps taken), the reward
`jpeg_compressibility` (CPU, milliseconds), no validation, checkpoints or logging, and the local engine.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from diffusion_rl.config import load
from diffusion_rl.estimate.architectures import from_shipped, from_tiny
from diffusion_rl.estimate.devices import Device, device_of_name
from diffusion_rl.estimate.estimator import estimate

from .models import TINY_PRESET, lender, one_rank_engine, random_model, trainer_with

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
PROMPT_TOKENS = 64  # the estimate's default prompt length (Qwen-Image cuts padding); the random texts' mask too
PACKAGES = ("torch", "diffusers", "transformers", "peft", "accelerate", "tensordict", "safetensors", "numpy")


class Skipped(Exception):
    """A part that cannot run here; the message says why."""


@dataclass
class Context:
    dry_run: bool
    work: Path  # a scratch folder of this check
    device_type: str = field(init=False)
    deadline: float = float("inf")  # time.monotonic() by which the running part is killed (set in its process)
    partial_file: Path | None = None  # where a part leaves what it has measured so far (set in its process)
    threads: int = 1  # torch's CPU threads in a process that computes (main: torch's own count; see gpu_check.py)

    def __post_init__(self):
        self.device_type = "cpu" if self.dry_run else "cuda"

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def keep(self, result: dict) -> None:
        """Leave what a part of several runs has measured so far: kept if the part is killed at its cap."""
        if self.partial_file is not None:
            self.partial_file.write_text(json.dumps(result, default=str))

    def device_entry(self) -> Device | None:
        """The peak table's entry for this device (estimate/devices.py); on the CPU one with a measured peak."""
        if self.device_type == "cuda":
            return device_of_name(torch.cuda.get_device_name())
        if not hasattr(self, "_cpu"):  # measured once: the dry run's MFU and roofline need some peak
            self._cpu = Device("cpu", round(matmul_tflops(256, 3), 4), None, 20.0, ())
        return self._cpu


@dataclass(frozen=True)
class ModelRun:
    config: str  # a ready config under configs/
    arch: str  # the shipped architecture (diffusion_rl/assets/architectures) it trains
    family: str  # its family (the dry run's tiny architecture)
    overrides: tuple[str, ...] = ()
    dry: tuple[str, ...] = ()  # what else the dry run's toy sizes need
    rows: int | None = None  # images per step (default: micro_batch_size × num_minibatches)
    preset: str = TINY_PRESET  # the tiny preset shaped like the checkpoint: its pipeline settings, the dry run's sizes


RUNS = {
    "sd35_lora": ModelRun("sd35_ocr_lora.yaml", "stable-diffusion-3.5-medium", "sd3"),
    "sd35_full": ModelRun(
        "sd35_ocr_lora.yaml", "stable-diffusion-3.5-medium", "sd3", ("model.lora.enabled=false", "train.lr=1.0e-5")
    ),  # fmt: skip
    "flux_lora": ModelRun("flux_pickscore_lora.yaml", "FLUX.1-dev", "flux"),
    "qwen_image_lora": ModelRun("qwen_image_ocr_lora.yaml", "Qwen-Image", "qwen_image", dry=("sampling.window.hi=3",)),
    # a short clip: 17 frames (5 latent frames) of the ready config's 33, two videos (one per optimizer step)
    "wan21_lora": ModelRun(
        "wan21_t2v_1_3b_ocr_lora.yaml",
        "Wan2.1-T2V-1.3B-Diffusers",
        "wan",
        ("sampling.num_frames=17",),
        dry=("sampling.num_frames=5",),
        rows=2,
    ),  # fmt: skip
    # the few-step distilled image models: micro-batch 3 of the ready config's 9 (6 images), so the part stays short
    "z_image_lora": ModelRun(
        "z_image_turbo_pickscore_lora.yaml",
        "Z-Image-Turbo",
        "z_image",
        ("train.micro_batch_size=3",),
        dry=("sampling.window.hi=2",),
    ),
    "flux2_klein_lora": ModelRun("flux2_klein_pickscore_lora.yaml", "FLUX.2-klein-4B", "flux2"),
    # DanceGRPO in text-to-video mode, the ready config's clip as shipped (verl-omni's: 9 frames at 704×1280, 10
    # steps, a window of 2), two videos in one optimizer step (the config's 4 mini-batches need 4 × its micro-batch;
    # run 10 measured the config before it moved: benchmarks/gpu_check/as_measured.py)
    "wan22_ti2v_lora": ModelRun(
        "wan22_ti2v_5b_dance_lora.yaml",
        "Wan2.2-TI2V-5B-Diffusers",
        "wan",
        ("train.num_minibatches=1",),
        dry=("sampling.num_frames=5", "sampling.window.hi=3"),
        rows=2,
        preset="ti2v",
    ),  # fmt: skip
    # Wan 2.2 T2V-A14B: both 14B experts held and trained (LoRA on each), a short clip (9 frames, 3 latent frames) of
    # 8 steps at the ready config's 240×416, which puts t = 1000 … 902 on the high-noise expert and 833, 684, 126 on
    # the low-noise one; two videos (one per optimizer step). Past the default budget: run with --only
    "wan22_a14b_lora": ModelRun(
        "wan22_t2v_a14b_ocr_lora.yaml",
        "Wan2.2-T2V-A14B-Diffusers",
        "wan",
        ("sampling.num_frames=9", "sampling.num_steps=8"),
        dry=("sampling.num_frames=5",),
        rows=2,
        preset="a14b",
    ),  # fmt: skip
}
# issue 45's CUDA defaults off, as runs 2–9 ran, so the parts' figures stay comparable: defaults_ab.py measures them.
# Kept after run 10 kept both defaults: the model parts' series since run 2 (MFU, the throughput table, estimate's
# fitted EFFICIENCY) is eager with the per-tensor AdamW, and a cold compile (67 s) would take most of a part's cap
PINNED = ("model.compile_blocks=false", "train.fused_adamw=false")
# the dry run: the same configs at toy sizes on the tiny presets' architectures
DRY = ["sampling.height=32", "sampling.width=32", "sampling.num_steps=3", "model.max_sequence_length=32",
       "train.micro_batch_size=2"]  # fmt: skip


def matmul_tflops(n: int, repeats: int, dtype=torch.float32) -> float:
    """TFLOP/s of an n×n×n matmul on this process's device (the best of `repeats`)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def sync() -> None:
    if cuda_in_use():
        torch.cuda.synchronize()


def memory_gib() -> dict[str, float | None]:
    """Peak device memory since the last reset (allocated and reserved, GiB); the process's peak RSS on a CPU."""
    if cuda_in_use():
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}  # fmt: skip
    import resource

    return {"peak_allocated_gib": None, "peak_reserved_gib": None,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # fmt: skip


def reset_peaks() -> None:
    if cuda_in_use():
        torch.cuda.reset_peak_memory_stats()


# -- building a run -----------------------------------------------------------------------------------------------
def run_config(ctx: Context, run: ModelRun, extra: list[str], rows: int | None = None, as_was: list[str] = ()):
    """The ready config with the check's overrides; `rows` per step (default micro_batch × num_minibatches);
    `as_was`: overrides that give back the config as a part once measured it (as_measured.py), before the part's."""
    dry = [*DRY, *run.dry, f"log.peak_tflops={ctx.device_entry().peak_tflops}"] if ctx.dry_run else []
    base = load(ROOT / "configs" / run.config, [*as_was, *run.overrides, *dry])
    rows = rows or run.rows or base.train.micro_batch_size * base.train.num_minibatches
    overrides = [
        *as_was, *run.overrides, *dry,
        f"run.dir={tempfile.mkdtemp(dir=ctx.work)}", f"model.device={ctx.device_type}", "model.embedding_cache=null",
        f"data.train={ROOT / 'configs/prompts/quickstart.txt'}", "data.prompts_per_step=1", f"data.group_size={rows}",
        "rewards=[{name: jpeg_compressibility}]", "val.prompts=null", "val.every=0", "val.before_train=false",
        "train.save_every=0", "log.tensorboard=false", "log.console_every=0", "log.progress_bar=false",
        "engine.kind=local", "engine.num_threads=null", *PINNED, *extra,
    ]  # fmt: skip
    return load(ROOT / "configs" / run.config, overrides)


def architecture(ctx: Context, run: ModelRun):
    return _architecture(run.family, run.arch, run.preset if ctx.dry_run else None)


@functools.cache
def _architecture(family: str, name: str, tiny: str | None):
    return from_tiny(family, tiny) if tiny else from_shipped(name)


def warm_architectures(ctx: Context) -> None:
    """Every run's architecture and the tiny pipeline that lends it its scheduler and tokenizers, once in the parent:
    a forked part finds them in the caches. Each is a tiny pipeline built (~0.3-0.5 s), which each part and variant
    process built again for every trainer it made."""
    for run in RUNS.values():
        architecture(ctx, run)
        lender(run.family, run.preset)


def build(ctx: Context, name: str, extra: list[str] = (), rows: int | None = None, engine_factory=None):
    """(cfg, architecture, trainer) of run `name` with `extra` overrides on a random-weight model."""
    run = RUNS[name]
    cfg = run_config(ctx, run, list(extra), rows)
    arch = architecture(ctx, run)
    model = random_model(arch, cfg.model, PROMPT_TOKENS, seed=cfg.run.seed, preset=run.preset)
    return cfg, arch, trainer_with(cfg, model, engine_factory)


def estimated(ctx: Context, run: ModelRun, cfg, arch) -> tuple:
    """`estimate` of `cfg` (training `arch`) on this device: (the estimate, its peak GiB, its step seconds), both left
    without the text encoders' share (the check runs none); (None, None, None) where the peak table has no entry."""
    entry = ctx.device_entry()
    if entry is None:
        return None, None, None
    predicted = estimate(cfg, arch, entry, 1, config_name=run.config, prompt_tokens=PROMPT_TOKENS)
    return (predicted, predicted.peak_memory_gib_per_gpu - predicted.memory_gib["text_encoders"],
            predicted.step_seconds - predicted.phase_seconds["encode_prompts"])  # fmt: skip


def step_health(metrics: dict) -> dict:
    """What a step's metrics say of its gradients: the updates skipped so far for a non-finite gradient norm (a kernel
    that returns NaN shows here, not in the seconds) and the mean finite norm."""
    return {"skipped_updates": metrics.get("train/skipped_updates"), "grad_norm": metrics.get("grad_norm")}


def timed_steps(trainer, steps: int, first: int = 0) -> list[dict]:
    """`steps` training steps from step `first`; each one's metrics with its wall-clock seconds (`wall_s`, synced)."""
    out = []
    for step in range(first, first + steps):
        sync()
        start = time.perf_counter()
        metrics = trainer.train_step(step)
        sync()
        out.append({**metrics, "wall_s": time.perf_counter() - start})
    return out


def release() -> None:
    """Give the device memory of the last trainer back (the caller drops its reference first)."""
    import gc

    if cuda_in_use():  # a CPU run needs none of this (a full collection costs a second there)
        gc.collect()
        torch.cuda.empty_cache()


# -- the parts ------------------------------------------------------------------------------------------------------
def device_part(ctx: Context) -> dict:
    """The machine: GPU, driver, torch/CUDA/cuDNN, the packages, the peak table's entry, a bf16 matmul's speed."""
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "packages": {p: _version(p) for p in PACKAGES}, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available()}  # fmt: skip
    if ctx.device_type == "cuda":
        props = torch.cuda.get_device_properties(0)
        entry = ctx.device_entry()
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / GIB, sms=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version(),
                    driver=_nvidia_smi("driver_version"), table_entry=entry and entry.key,
                    table_peak_tflops=entry and entry.peak_tflops, tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                    bf16_matmul_tflops=matmul_tflops(8192, 5, torch.bfloat16))  # fmt: skip
    else:
        info.update(gpu=None, cpu_fp32_matmul_tflops=matmul_tflops(256, 3))
    return info


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_smi(field_name: str) -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={field_name}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=True)  # fmt: skip
        return done.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def model_part(name: str):
    """The part that measures one Flow-GRPO step of run `name` and compares `estimate` with it."""

    def part(ctx: Context) -> dict:
        run = RUNS[name]
        cfg = run_config(ctx, run, [])
        arch = architecture(ctx, run)
        entry = ctx.device_entry()
        predicted, est_peak, est_step = estimated(ctx, run, cfg, arch)
        capacity = entry and entry.memory_gib
        if ctx.device_type == "cuda":
            capacity = torch.cuda.get_device_properties(0).total_memory / GIB
        if est_peak and capacity and est_peak > 0.95 * capacity:
            raise Skipped(f"estimate says {est_peak:.1f} GiB at its peak, more than this device's {capacity:.1f} GiB")
        reset_peaks()
        started = time.perf_counter()
        cfg, arch, trainer = build(ctx, name)
        built_s = time.perf_counter() - started
        after_build = memory_gib()
        reset_peaks()
        steps = timed_steps(trainer, 2)
        measured = steps[-1]
        mem = memory_gib()
        rollout, update = measured.get("timing/generate", 0.0), measured.get("timing/update", 0.0)
        result = {
            "config": run.config, "overrides": list(run.overrides), "architecture": arch.name,
            "gradient_checkpointing": cfg.model.gradient_checkpointing,  # the config may change after the run
            "images_per_step": cfg.data.prompts_per_step * cfg.data.group_size,
            "transformer_params": sum(p.numel() for p in trainer.engine.model.pipeline.transformer.parameters()),
            "trainable_params": sum(p.numel() for p in trainer.engine.model.trainable_parameters()),
            "build_s": built_s, "memory_after_build_gib": after_build.get("peak_allocated_gib"),
            "warmup_step_s": steps[0]["wall_s"], "step_s": measured["wall_s"], "rollout_s": rollout,
            "update_s": update, "images_per_s": measured.get("perf/images_per_s"), "mfu": measured.get("perf/mfu"),
            "flops_per_step": measured.get("perf/flops_per_step"), **mem,
            "logp_diff_max": measured.get("train/logp_diff_max"), **step_health(measured),
        }  # fmt: skip
        if predicted is not None:
            result["estimate"] = {"peak_gib": est_peak, "step_s": est_step, "efficiency": predicted.efficiency,
                                  "phase_seconds": predicted.phase_seconds}  # fmt: skip
            measured_peak = mem.get("peak_reserved_gib")
            result["estimate_memory_rel_error"] = (est_peak - measured_peak) / measured_peak if measured_peak else None
            gpu_s = rollout + update
            result["estimate_time_rel_error"] = (est_step - gpu_s) / gpu_s if gpu_s else None
            # the efficiency at which the roofline's time would equal the measured one
            result["efficiency_fit"] = predicted.efficiency * est_step / gpu_s if gpu_s else None
        return result

    part.__doc__ = f"One Flow-GRPO step of {RUNS[name].config} ({RUNS[name].arch}, random weights)."
    return part


REPLAY_PRECISIONS = {  # name → overrides: the ready config's bf16 weights, fp32 weights under bf16 autocast, fp32
    "bf16_weights": [],
    "fp32_autocast_bf16": ["model.dtype=fp32", "model.autocast=bf16"],
    "fp32": ["model.dtype=fp32"],
}
SMALL = ["sampling.num_steps=4", "train.micro_batch_size=2", "train.num_minibatches=1", "log.flops=false"]


def replay_part(ctx: Context) -> dict:
    """train/logp_diff_max (the rollout's log-probs recomputed by the update's first forward) on SD3.5-Medium LoRA,
    for sde and cps under each precision: 0 on a CPU; what it is on CUDA kernels."""
    out = {"model": "stable-diffusion-3.5-medium LoRA, 2 images, 4 steps", "runs": {}}
    for precision, overrides in REPLAY_PRECISIONS.items():
        for sde in ("sde", "cps"):
            cfg, _, trainer = build(ctx, "sd35_lora", [*SMALL, *overrides, f"sampling.sde_type={sde}"], rows=2)
            metrics = timed_steps(trainer, 1)[0]
            out["runs"][f"{precision}/{sde}"] = {
                "logp_diff_max": metrics.get("train/logp_diff_max"),
                "step_s": metrics["wall_s"],
                "rollout_correction": {k: v for k, v in metrics.items() if "rollout_correction" in k or "/is_" in k},
            }
            out["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32 if cuda_in_use() else None
            ctx.keep(out)
            del trainer
            release()
    return out


def compile_part(ctx: Context) -> dict:
    """model.compile_blocks against eager on SD3.5-Medium LoRA: steady step times, and the compile time apart (the
    compiling step's time beyond a compiled step)."""
    from torch._dynamo.utils import counters

    results = {}
    if ctx.dry_run:  # the plumbing (compiled blocks in sampling and the update), not the compiler: minutes on a CPU
        torch.compiler.set_stance("force_eager")
    for compiled in (False, True):
        extra = [*SMALL, f"model.compile_blocks={str(compiled).lower()}"]
        _, _, trainer = build(ctx, "sd35_lora", extra, rows=2)
        steps = timed_steps(trainer, 3 if compiled else 2)
        results["compiled" if compiled else "eager"] = [s["wall_s"] for s in steps]
        ctx.keep({"step_times_s": results})
        del trainer
        release()
    eager, compiled = results["eager"][-1], min(results["compiled"][1:])
    return {
        "model": "stable-diffusion-3.5-medium LoRA, 2 images, 4 steps",
        "eager_step_s": eager, "compiled_step_s": compiled, "ratio": compiled / eager,
        "compile_s": results["compiled"][0] - compiled, "step_times_s": results,
        "graphs": int(counters["stats"]["unique_graphs"]), "stance": "force_eager" if ctx.dry_run else "default",
    }  # fmt: skip


def attention_part(ctx: Context) -> dict:
    """Each model.attention_backend installed here against sdpa, on Wan 2.1 1.3B LoRA at the ready config's clip
    (SD3's joint attention does not go through diffusers' dispatcher: it refuses every backend but sdpa)."""
    from diffusion_rl.models.attention import DEFAULT_BACKEND, installed_backends

    names = installed_backends()
    others = [n for n in names if n != DEFAULT_BACKEND]
    if ctx.dry_run:  # one other backend shows the plumbing
        others = ["native"] if "native" in others else others[:1]
    # the fused kernels first; the reference and unfused ones (math, flex without compile) last: they may be slow
    slow = ("_native_math", "flex")
    others = sorted(others, key=lambda n: n in slow)
    result = {"model": "Wan2.1-T2V-1.3B LoRA, 2 videos, 3 steps", "installed": names, "runs": {}}
    runs = result["runs"]
    for backend in [DEFAULT_BACKEND, *others]:
        if ctx.seconds_left() < 15:
            runs[backend] = {"error": "not run: the part's time cap was near"}
            continue
        try:
            extra = ["sampling.num_steps=3", "train.num_minibatches=1", "log.flops=false",
                     f"model.attention_backend={backend}"]  # fmt: skip
            _, _, trainer = build(ctx, "wan21_lora", extra, rows=2)
            steps = timed_steps(trainer, 2)
            runs[backend] = {"step_s": steps[-1]["wall_s"], "logp_diff_max": steps[-1].get("train/logp_diff_max")}
            del trainer
        except Exception as e:  # one backend's failure (no kernel for this GPU or dtype) is a finding, not the end
            runs[backend] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        release()
        base = runs[DEFAULT_BACKEND].get("step_s")
        if base and "step_s" in runs[backend]:
            runs[backend]["vs_sdpa"] = runs[backend]["step_s"] / base
        ctx.keep(result)
    return result


def fsdp2_part(ctx: Context, extra: tuple[str, ...] = ()) -> dict:
    """The Ray engine's sharded worker (FSDP2, NCCL on a GPU, gloo on a CPU) at world size 1 without Ray: a warm-up
    step (torch.compile's seconds in it counted, with `extra` model.compile_blocks=true: fsdp2_compiled.py), then
    one measured step; peak memory over both."""
    import socket

    import torch.distributed as dist

    from diffusion_rl.models.compiling import compile_seconds

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    _, _, trainer = build(
        ctx, "sd35_lora", [*SMALL, *extra], rows=2,
        engine_factory=lambda engine, spec: one_rank_engine(engine, spec, init),
    )  # fmt: skip
    try:
        steps = timed_steps(trainer, 2)
        backend = dist.get_backend()
    finally:
        dist.destroy_process_group()
    measured = steps[-1]
    return {"model": "stable-diffusion-3.5-medium LoRA, 2 images, 4 steps", "backend": backend, "world_size": 1,
            "compile_blocks": trainer.engine.model.policies.compile_blocks, "warmup_step_s": steps[0]["wall_s"],
            "compile_s": compile_seconds(), "step_s": measured["wall_s"], "rollout_s": measured.get("timing/generate"),
            "update_s": measured.get("timing/update"), "logp_diff_max": measured.get("train/logp_diff_max"),
            "loss": measured.get("train/loss"), **step_health(measured), **memory_gib()}  # fmt: skip


def warm_imports() -> None:
    """Import, once in the parent, what every part's child would otherwise import again (diffusers imports lazily)."""
    import diffusers
    import peft  # noqa: F401

    import diffusion_rl.engine.sharded_worker  # noqa: F401
    import diffusion_rl.trainer  # noqa: F401
    from diffusion_rl.models.registry import family_named

    for run in RUNS.values():
        arch = from_shipped(run.arch)
        for name in (family_named(run.family).pipeline, arch.transformer_class, arch.vae_class):
            getattr(diffusers, name)
