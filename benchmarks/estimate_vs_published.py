"""`diffusion-rl estimate` against published step times, and against a measured CPU step of the quickstart.

Published (verl-omni docs, "Performance Reference", Qwen-Image OCR, 32 prompts × 16 images = 512 images per step):
- Flow-GRPO LoRA r64, true CFG 4, 4×H800: 0.305 images/GPU/s (420 s per step)  → calibrates the efficiency
- Flow-GRPO full fine-tuning, no CFG, 4×H200: 0.510 images/GPU/s               → checks it
Our configs/qwen_image_ocr_lora.yaml is the first recipe; the second is it with model.lora.enabled=false,
sampling.guidance=1, train.lr=3e-5. Each row is estimated at the shipped efficiency (fitted on the H200 GPU check
since 2026-11-26; docs/estimate.md) and at the one fitted here on the first figure (its error 0 by construction).

The quickstart row: this machine's fp32 matmul FLOP/s and copy bandwidth are measured once, the estimate of one
quickstart step is made with them (efficiency 1: the roofline's lower bound) and with the calibrated efficiency,
and a real quickstart step is timed (the second of two; the first warms up).

    python benchmarks/estimate_vs_published.py [--json] [--skip-measured]
Writes benchmarks/results/estimate_vs_published.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

import torch  # noqa: E402

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.estimate.architectures import architecture_for  # noqa: E402
from diffusion_rl.estimate.devices import DEVICES  # noqa: E402
from diffusion_rl.estimate.estimator import EFFICIENCY, estimate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QWEN = str(ROOT / "configs" / "qwen_image_ocr_lora.yaml")
PUBLISHED = [
    # name, config overrides, device, gpus, images/GPU/s
    ("verl-omni Qwen-Image OCR LoRA Flow-GRPO, 4×H800 (calibration)", [], "h800", 4, 0.305),
    ("verl-omni Qwen-Image OCR full fine-tune, no CFG, 4×H200 (check)",
     ["model.lora.enabled=false", "sampling.guidance=1", "train.lr=3e-5"], "h200", 4, 0.510),
]  # fmt: skip


def measure_cpu() -> tuple[float, float]:
    """(fp32 matmul FLOP/s, copy bandwidth in bytes/s) of this machine, best of 5."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    flops = 2 * 1024**3 / best
    x = torch.empty(64 * 2**20 // 4)
    y = torch.empty_like(x)
    y.copy_(x)
    copy = min(_timed(lambda: y.copy_(x)) for _ in range(5))
    return flops, 2 * x.numel() * 4 / copy  # read and write


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measured_quickstart_step(overrides: list[str]) -> float:
    """Seconds of the second step of the quickstart (no validation, no checkpoint until the end)."""
    from diffusion_rl.trainer import make_trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load(str(ROOT / "configs" / "quickstart_flow_grpo.yaml"), [
            f"run.dir={tmp}/run", f"model.path={tmp}/tiny", "train.total_steps=2", "val.every=0",
            "val.before_train=false", "log.tensorboard=false", "log.progress_bar=false", "train.save_every=0",
            *overrides])  # fmt: skip
        rows = make_trainer(cfg).train()
    return float(rows[-1]["timing/step"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.add_argument("--skip-measured", action="store_true", help="leave out the measured CPU quickstart step")
    args = parser.parse_args()

    rows = []
    name, overrides, gpu, gpus, published = PUBLISHED[0]
    cfg = load(QWEN, overrides)
    arch = architecture_for(cfg.model)
    ideal = estimate(cfg, arch, DEVICES[gpu], gpus, efficiency=1.0)
    calibrated = ideal.step_seconds / (cfg.data.prompts_per_step * cfg.data.group_size / (published * gpus))
    for name, overrides, gpu, gpus, published in PUBLISHED:
        cfg = load(QWEN, overrides)
        for label, eff in (("shipped", EFFICIENCY), ("fitted here", calibrated)):
            r = estimate(cfg, arch, DEVICES[gpu], gpus, efficiency=eff)
            rows.append({
                "name": f"{name}, efficiency {eff:.3f} ({label})", "metric": "images/GPU/s", "published": published,
                "estimated": round(r.images_per_gpu_second, 4),
                "relative_error": round(r.images_per_gpu_second / published - 1, 4),
                "step_seconds": round(r.step_seconds, 1), "phase_seconds": {k: round(v, 2) for k, v in
                r.phase_seconds.items()}, "peak_memory_gib_per_gpu": round(r.peak_memory_gib_per_gpu, 1),
                "peak_memory_gib_per_gpu_checkpointed": round(r.peak_memory_gib_per_gpu_checkpointed, 1),
                "flops_per_step": r.flops_per_step,
            })  # fmt: skip

    if not args.skip_measured:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        flops, bandwidth = measure_cpu()
        cpu = DEVICES["cpu"].with_overrides(peak_tflops=flops / 1e12, bandwidth_gbs=bandwidth / 1e9)
        quick = load(str(ROOT / "configs" / "quickstart_flow_grpo.yaml"))
        measured = measured_quickstart_step([])
        arch_q = architecture_for(quick.model)
        for label, eff in (("roofline bound", 1.0), ("calibrated", EFFICIENCY)):
            r = estimate(quick, arch_q, cpu, 1, efficiency=eff)
            rows.append({
                "name": f"quickstart step on this CPU, efficiency {eff:.3f} ({label})", "metric": "seconds per step",
                "published": round(measured, 3), "estimated": round(r.step_seconds, 4),
                "relative_error": round(r.step_seconds / measured - 1, 4),
                "cpu_matmul_gflops": round(flops / 1e9, 1), "cpu_copy_gbs": round(bandwidth / 1e9, 2),
                "flops_per_step": r.flops_per_step, "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            })  # fmt: skip

    out = ROOT / "benchmarks" / "results" / "estimate_vs_published.json"
    out.write_text(json.dumps({"fitted_efficiency": calibrated, "rows": rows}, indent=1) + "\n")
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        print(f"{row['name']}: published {row['published']}, estimated {row['estimated']} "
              f"({row['relative_error']:+.1%}) {row['metric']}")  # fmt: skip
    print(f"fitted efficiency: {calibrated:.4f}", file=sys.stderr)


if __name__ == "__main__":
    main()
