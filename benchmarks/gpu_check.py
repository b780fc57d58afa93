"""The GPU check: one command that measures the real-size paths on one GPU within its budget (--budget, 470 s).

    python benchmarks/gpu_check.py --out DIR [--dry-run] [--only sd35_lora,replay] [--budget 470]

Writes DIR/gpu_check.json (after every part, so a killed run keeps what it measured) and DIR/gpu_check.md (a
summary). The parts (benchmarks/gpu_check/catalog.py), most important first: the device; one Flow-GRPO step of each
ready config on a real-size random-weight model (SD3.5-Medium LoRA and full fine-tuning, FLUX.1-dev LoRA, Qwen-Image
LoRA where the memory allows, Wan 2.1 1.3B LoRA; last, FLUX.2-klein-4B, Z-Image-Turbo and Wan 2.2 TI2V-5B LoRA) with
`estimate`'s error against it; the rollout's log-prob replay
(train/logp_diff_max) for sde and cps in bf16 and fp32; model.compile_blocks against eager; each installed
model.attention_backend against sdpa; the Ray engine's FSDP2 worker at world size 1 without Ray; past the default
budget (run with --only), torch's cuDNN attention kernel off against on for each model (gpu_check/cudnn_ab.py),
CUDA's allocator with fixed blocks against expandable segments (gpu_check/alloc_ab.py), compiled blocks and fused
AdamW (on by default on CUDA) against both off (gpu_check/defaults_ab.py), gradient checkpointing of every block
against `auto`'s count and half the blocks (gpu_check/checkpoint_ab.py), the FSDP2 worker eager and with compiled
blocks (gpu_check/fsdp2_compiled.py), the text encoders at real size held and offloaded (gpu_check/encoders.py)
and Wan 2.2 T2V-A14B LoRA (both 14B experts, a short clip). Every part runs with the allocator the CLI gives a run
by default (diffusion_rl/utils/cuda_alloc.py), recorded as `allocator`.

Each part runs in a child process forked from this one (imports and the runs' architectures made once, here): a
crash (even a segfault or an out-of-memory kill) is recorded and the next part runs; a part past its time cap is
killed and recorded as `timeout`. A part starts only while the whole check's budget has room for it, and then gets
at most what is left. This process never touches CUDA (a forked child could not use it after that), and it computes
on one CPU thread: torch's CPU threads are GNU OpenMP's, which do not survive a fork, so a child forked after this
process had run a parallel region hangs in its first one (run 8 of the check lost every part to it). A process
that computes takes `Context.threads` (torch's own count, read here first); one that only forks (this one, the A/B
parts' own) keeps one. `--dry-run` runs the same parts on the CPU with the tiny presets' architectures
(tests/benchmarks/test_gpu_check.py), so the check cannot rot.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # torch.cuda.is_available() without a CUDA context
from diffusion_rl.utils import cuda_alloc  # noqa: E402  (stdlib only)

ALLOCATOR = cuda_alloc.apply(True)  # what the CLI gives a run by default (the user's variables win), before torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check.catalog import PARTS  # noqa: E402
from gpu_check.parts import Context, Skipped, warm_architectures, warm_imports  # noqa: E402
from gpu_check.summary import markdown  # noqa: E402

SCHEMA = 1
STATUSES = ("ok", "skipped", "failed", "timeout", "not_run")
MIN_PART_S = 20  # a part is not started with less of the budget left


def run_part(name: str, ctx: Context, result_file: Path, cap_s: float) -> None:
    """In the child: run one part, write {"status", "result" | "error"} to `result_file`."""
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(ctx.threads)
    ctx.deadline, ctx.partial_file = time.monotonic() + cap_s, result_file.with_suffix(".partial.json")
    function = PARTS[name][0]
    try:
        record = {"status": "ok", "result": function(ctx)}
    except Skipped as e:
        record = {"status": "skipped", "reason": str(e)}
    except BaseException as e:  # noqa: BLE001 — every failure is recorded, the next part still runs
        record = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    result_file.write_text(json.dumps(record, default=str))
    sys.stdout.flush()
    os._exit(0)  # no atexit work in a child (a forked one shares the parent's)


def start_method() -> str:
    """fork (the imports done once, here) unless something initialised CUDA in this process: a forked child could not
    use it then, and each child imports everything again (spawn)."""
    import torch

    return "spawn" if torch.cuda.is_initialized() else "fork"


def supervise(name: str, ctx: Context, cap_s: float, method: str = "fork") -> dict:
    """Run part `name` in a child process for at most `cap_s` seconds; its record with the seconds it took."""
    result_file = ctx.work / f"{name}.json"
    child = multiprocessing.get_context(method).Process(target=run_part, args=(name, ctx, result_file, cap_s),
                                                        daemon=True)  # fmt: skip
    started, cpu = time.perf_counter(), os.times()
    child.start()
    child.join(cap_s)
    if child.is_alive():
        child.kill()
        child.join()
        record = {"status": "timeout", "error": f"killed after its cap of {cap_s:.0f} s"}
        partial = result_file.with_suffix(".partial.json")
        if partial.is_file():  # what a part of several runs had measured before
            record["result"] = json.loads(partial.read_text())
    elif result_file.is_file():
        record = json.loads(result_file.read_text())
    else:  # died without a word: a signal (segfault, OOM kill) or os._exit elsewhere
        record = {"status": "failed", "error": f"the part's process died (exit code {child.exitcode})"}
    after = os.times()  # the child's CPU seconds: a loaded machine's wall-clock says little
    cpu_s = after.children_user + after.children_system - cpu.children_user - cpu.children_system
    record.update(seconds=time.perf_counter() - started, cpu_s=cpu_s, cap_s=cap_s)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU with tiny shapes (a test runs this)")
    parser.add_argument("--only", default="", help=f"comma-separated parts (default all: {', '.join(PARTS)})")
    parser.add_argument("--budget", type=float, default=470.0, help="seconds for all parts together")
    parser.add_argument("--start-method", choices=("auto", "fork", "spawn"), default="auto",
                        help="how part processes start (auto: fork unless CUDA is initialised here)")  # fmt: skip
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(PARTS)
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    if "device" in PARTS:  # always, first: the record names the machine it ran on
        names = ["device", *(n for n in names if n != "device")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ctx = Context(dry_run=args.dry_run, work=work, threads=torch.get_num_threads())
    torch.set_num_threads(1)  # before any work here: OpenMP's threads would not survive the forks (see above)
    warm_imports()
    method = start_method() if args.start_method == "auto" else args.start_method
    if method == "fork":  # a spawned part would build them again anyway
        warm_architectures(ctx)
    record = {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "argv": sys.argv if argv is None else argv,
        "budget_s": args.budget,
        "start_method": method,
        "allocator": ALLOCATOR,  # from run 8 on; runs 1-7 ran with torch's default (fixed blocks)
        "parts": {name: {"status": "not_run", "cap_s": PARTS[name][1]} for name in names},
    }
    start = time.perf_counter()
    for name in names:
        left = args.budget - (time.perf_counter() - start)
        if left < MIN_PART_S:
            record["parts"][name]["reason"] = f"the check's budget of {args.budget:.0f} s was spent"
            continue
        part = supervise(name, ctx, min(PARTS[name][1], left), method)
        record["parts"][name] = part
        note = part.get("error") or part.get("reason") or ""
        print(f"{name:<16} {part['status']:<8} {part['seconds']:6.1f} s  {note}", flush=True)
        write(out, record)
    record["total_s"] = time.perf_counter() - start
    write(out, record)
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


def write(out: Path, record: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(record))


if __name__ == "__main__":
    sys.exit(main())
