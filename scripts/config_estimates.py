"""The ready configs' estimates, written by `estimate` and checked against it: each ready config's header (configs/
*.yaml with an "Expects:" paragraph; the quickstarts are not ready configs) carries a block of the figures
`diffusion-rl estimate` gives for it on the GPUs it names — GiB per GPU, seconds per step, the whole run's
wall-clock and GPU-hours — and docs/estimate.md a table of them all. Nobody types these numbers:

    python scripts/config_estimates.py            # check: one line per config or table that drifted, exit 1
    python scripts/config_estimates.py --write    # rewrite them from today's estimator

tests/test_config_estimates.py runs the check (without writing) and fails when a figure drifts.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU = "h100"  # every ready config expects GPUs with 80 GB each; the estimate names the device it times
BLOCK = "# Estimate (written by `python scripts/config_estimates.py --write`; not a measurement):"
INDENT = "#   "  # the block's continuation lines; the header line after the block must not start so
WIDTH = 120
NBSP = "\u00a0"  # between a figure and its unit while wrapping (textwrap does not break at it)
TABLE_START = "<!-- ready-config estimates: written by `python scripts/config_estimates.py --write` -->"
TABLE_END = "<!-- end of ready-config estimates -->"
DOC = ROOT / "docs" / "estimate.md"


def ready_configs() -> list[Path]:
    """The configs for real runs: those whose header says what hardware they expect."""
    return [p for p in sorted((ROOT / "configs").glob("*.yaml")) if "# Expects:" in header_of(p)]


def header_of(path: Path) -> str:
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(line for line in lines[: next((i for i, x in enumerate(lines) if not x.startswith("#")), None)])


def run_estimate(path: Path):
    """`diffusion-rl estimate PATH --gpu h100 --arch NAME` (the shipped architecture, whatever is on this disk)."""
    from diffusion_rl.config import load
    from diffusion_rl.estimate.architectures import from_shipped, shipped
    from diffusion_rl.estimate.devices import device_named
    from diffusion_rl.estimate.estimator import estimate

    cfg = load(str(path))
    arch = {k.lower(): k for k in shipped()}[Path(cfg.model.path).name.lower()]
    gpus = cfg.engine.num_workers if cfg.engine.kind == "ray" else 1
    name = f"configs/{path.name}"
    return cfg, arch, estimate(cfg, from_shipped(arch), device_named(GPU), gpus, config_name=name)


def _hours(h: float, space: str = " ") -> str:
    return f"{h:,.0f}{space}h" if h >= 10 else f"{h:.1f}{space}h"


def block(cfg, arch: str, r) -> list[str]:
    """The header's lines: what the estimate says of this config on its GPUs."""
    checkpointing = cfg.model.gradient_checkpointing
    other = r.peak_memory_gib_per_gpu_unchecked if checkpointing else r.peak_memory_gib_per_gpu_checkpointed
    _ = NBSP
    text = (
        f"`diffusion-rl estimate {r.config} --gpu {GPU} --arch {arch}` ({r.gpus} GPUs: engine.num_workers; the "
        f"shipped {arch} architecture; efficiency {r.efficiency:.3f}): {r.peak_memory_gib_per_gpu:.1f}{_}GiB per GPU "
        f"of {r.gpu_memory_gib:.1f} ({other:.1f} {'without' if checkpointing else 'with'} gradient checkpointing), "
        f"{r.step_seconds:,.0f}{_}s per step of {r.images_per_step:,}{_}{r.samples} ({r.images_per_second:.3g}{_}"
        f"{r.samples}/s); {r.total_steps:,}{_}steps (train.total_steps) take {_hours(r.gpu_hours / r.gpus, _)} on "
        f"{r.gpus}×{_}{GPU.upper()}: {r.gpu_hours:,.0f}{_}GPU-hours."
    )
    if r.host_memory_gib_per_worker:  # what the memory savers keep on the CPU
        text += (f" On the CPU: {r.host_memory_gib_per_worker:.1f}{_}GiB per worker, {r.host_memory_gib_per_node:.0f}"
                 f"{_}GiB per node of {r.workers_per_node}{_}workers.")  # fmt: skip
    wrapped = textwrap.wrap(text, WIDTH - len(INDENT), break_on_hyphens=False)  # a figure keeps its unit: NBSP
    return [BLOCK, *(INDENT + line.replace(NBSP, " ") for line in wrapped)]


def table_row(cfg, r) -> str:
    m, e = cfg.model, cfg.engine
    notes = ["config checkpoints"] if m.gradient_checkpointing else []
    notes += ["frozen encoders offloaded"] if m.offload_frozen else []
    notes += ["re-sharded"] if e.reshard_after_forward else []
    if "image_encoder" in r.memory_gib:
        notes.append(f"CLIP image encoder {r.memory_gib['image_encoder']:.1f}")
    peaks = f"{r.peak_memory_gib_per_gpu_unchecked:.1f} / {r.peak_memory_gib_per_gpu_checkpointed:.1f}"
    name, said = Path(r.config).stem, f" ({'; '.join(notes)})" if notes else ""
    return (f"| {name} | {r.gpus} | {peaks}{said} | {r.step_seconds:,.0f} s | "
            f"{_hours(r.gpu_hours / r.gpus)} | {r.images_per_gpu_second:.3g} {r.samples} | {r.gpu_hours:,.0f} | "
            f"{r.flops_per_step:.2e} |")  # fmt: skip


def table(rows: list[str]) -> list[str]:
    head = ("| config | GPUs | peak GiB/GPU without / with checkpointing (80 GB = 74.5 GiB) | step | run (train."
            "total_steps) | per GPU and second | GPU-hours | FLOPs/step |")  # fmt: skip
    return [TABLE_START, head, "|---|---|---|---|---|---|---|---|", *rows, TABLE_END]


def replace_block(lines: list[str], new: list[str], where: str) -> list[str]:
    """`lines` with the block that starts at BLOCK replaced by `new` (a file without one: a one-line error)."""
    starts = [i for i, line in enumerate(lines) if line == BLOCK]
    if len(starts) != 1:
        raise SystemExit(f"{where}: needs exactly one line '{BLOCK}' in its header (found {len(starts)})")
    end = starts[0] + 1
    while end < len(lines) and lines[end].startswith(INDENT):
        end += 1
    return lines[: starts[0]] + new + lines[end:]


def replace_table(lines: list[str], new: list[str]) -> list[str]:
    if TABLE_START not in lines or TABLE_END not in lines:
        raise SystemExit(f"{DOC.relative_to(ROOT)}: the lines '{TABLE_START}' and '{TABLE_END}' are missing")
    return lines[: lines.index(TABLE_START)] + new + lines[lines.index(TABLE_END) + 1 :]


def expected(path: Path) -> tuple[list[str], str]:
    """(the config's text with today's block, its row of the docs' table)."""
    cfg, arch, r = run_estimate(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    return replace_block(lines, block(cfg, arch, r), f"configs/{path.name}"), table_row(cfg, r)


def drift(path: Path) -> list[str]:
    """What of `path`'s figures differs from today's estimate: its header's block, its row of the docs' table."""
    lines, row = expected(path)
    found = []
    if "\n".join(lines) != path.read_text(encoding="utf-8"):
        found.append(f"configs/{path.name}: its header's estimate")
    if row not in DOC.read_text(encoding="utf-8").split("\n"):
        found.append(f"{DOC.relative_to(ROOT)}: the row of {path.stem}")
    return found


def write() -> None:
    rows = []
    for path in ready_configs():
        lines, row = expected(path)
        rows.append(row)
        path.write_text("\n".join(lines), encoding="utf-8")
    doc = DOC.read_text(encoding="utf-8").split("\n")
    DOC.write_text("\n".join(replace_table(doc, table(rows))), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the figures instead of checking them")
    if parser.parse_args(argv).write:
        write()
        return 0
    drifted = [line for path in ready_configs() for line in drift(path)]
    for line in drifted:
        print(f"{line} drifted: run `python scripts/config_estimates.py --write` and commit the result")
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
