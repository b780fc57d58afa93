"""The throughput table of docs/gpu.md and benchmarks/RESULTS.md, computed from the GPU check's record (nobody types
its figures): per ready config the GPU check measured, seconds per step, images per GPU-second and MFU at the
config's own per-GPU batch, beside verl-omni's published rows.

    python scripts/throughput_table.py            # check: exit 1 naming each file whose table drifted
    python scripts/throughput_table.py --write    # rewrite both tables from the record

The check measured micro-batch × minibatches images per step, not a config's whole batch (benchmarks/gpu_check/
parts.py), so a row scales the measured GPU seconds per image — the rollout's and the update's, `timing/generate` +
`timing/update` — to the config's images per GPU (data.prompts_per_step × data.group_size over engine.num_workers):
s/step = images per GPU × seconds per image, img/GPU/s = 1 / seconds per image, MFU = the step's FLOPs over those
seconds and the GPU's dense bf16 peak. A config that moved since its part ran is scaled as it was measured, the
overrides that give it back (benchmarks/gpu_check/as_measured.py) named in its row. Left out of those seconds: the
reward model, the text encoders (the check runs neither), FSDP's communication across GPUs and Ray's traffic.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # as benchmarks/gpu_check.py finds its parts
from gpu_check.as_measured import AS_MEASURED  # noqa: E402

RECORD = ROOT / "benchmarks" / "results" / "gpu_check_h200.json"
DOCS = (ROOT / "docs" / "gpu.md", ROOT / "benchmarks" / "RESULTS.md")
START = "<!-- throughput table: written by `python scripts/throughput_table.py --write` from gpu_check_h200.json -->"
END = "<!-- end of throughput table -->"
# the table's rows in order (those the record measured)
MODEL_PARTS = ("sd35_lora", "sd35_full", "flux_lora", "qwen_image_lora", "wan21_lora", "z_image_lora",
               "flux2_klein_lora", "wan22_ti2v_lora", "wan22_a14b_lora")  # fmt: skip
OURS_AT_VERL_SHAPE = "qwen_image_lora"  # qwen_image_ocr_lora.yaml: verl-omni's run_qwen_image_ocr_lora.sh recipe


@dataclass(frozen=True)
class Published:
    """A row of verl-omni's docs/algo/performance.md (commit 0324b39, 'Last updated: 09/10/2026')."""

    recipe: str
    gpus: str
    images_per_step: int
    seconds_per_step: float
    images_per_gpu_s: float
    note: str = ""


NFT_NOTE = "listed as 24 × 12 images; 0.175 fits 24 × 16 = 384"
VERL_OMNI = (
    Published("Flow-GRPO, Qwen-Image OCR, LoRA r64, CFG 4, 512²", "4× H800", 512, 420, 0.305),
    Published("the same, reward on a 5th GPU (async)", "5× H800", 512, 360, 0.280),
    Published("Flow-GRPO, Qwen-Image OCR, full fine-tuning, no CFG", "4× H200", 512, 250, 0.510),
    Published("Flow-DPPO, Qwen-Image OCR, LoRA r64", "4× H200", 512, 540, 0.240),
    Published("DiffusionNFT, Qwen-Image OCR, LoRA r64, no CFG", "4× H200", 288, 550, 0.175, NFT_NOTE),
)


def throughput(result: dict, images_per_step: int, gpus: int, peak_tflops: float) -> dict:
    """A model part's `result` scaled to a config's `images_per_step` over `gpus`: images per GPU, seconds per
    image, seconds per step, images per GPU-second and MFU (of rollout + update at `peak_tflops`)."""
    gpu_s = result["rollout_s"] + result["update_s"]
    per_image = gpu_s / result["images_per_step"]
    per_gpu = images_per_step / gpus
    mfu = result["flops_per_step"] / gpu_s / (peak_tflops * 1e12)
    return {"images_per_gpu": per_gpu, "seconds_per_image": per_image, "seconds_per_step": per_gpu * per_image,
            "images_per_gpu_s": 1 / per_image, "mfu": mfu}  # fmt: skip


def config_shape(config: str, overrides: list[str]) -> tuple[int, int]:
    """(images per step, GPUs) of ready config `config` with the part's `overrides`."""
    from diffusion_rl.config import load

    cfg = load(str(ROOT / "configs" / config), overrides)
    gpus = cfg.engine.num_workers if cfg.engine.kind == "ray" else 1
    return cfg.data.prompts_per_step * cfg.data.group_size, gpus


def rows(record: dict) -> tuple[list[str], dict[str, dict]]:
    """Our rows of the table and each part's figures."""
    merged, runs = record["merged"]["parts"], {r["run"]: r["code"] for r in record["runs"]}
    peak = merged["device"]["result"]["table_peak_tflops"]
    out, figures = [], {}
    for name in MODEL_PARTS:
        part = merged.get(name)
        if not part or part.get("status") != "ok":
            continue
        result = part["result"]
        overrides = list(dict.fromkeys([*AS_MEASURED.get(name, []), *result["overrides"]]))  # the config as measured
        images, gpus = config_shape(result["config"], overrides)
        f = figures[name] = throughput(result, images, gpus, peak)
        shape = ", ".join(overrides) or "as shipped"
        commit = runs[part["run"]].split()[0]
        out.append(f"| {result['config']} ({shape}) | {images} on {gpus} | {f['images_per_gpu']:g} | "
                   f"{result['images_per_step']} | {f['seconds_per_image']:.2f} | {f['seconds_per_step']:,.0f} | "
                   f"{f['images_per_gpu_s']:.3f} | {f['mfu']:.1%} | run {part['run']} ({commit}) |")  # fmt: skip
    return out, figures


def table(record: dict) -> list[str]:
    ours, figures = rows(record)
    gpu = record["merged"]["parts"]["device"]["result"]["gpu"]
    lines = [START, "",
             f"Ours: one {gpu}, random weights, the ready config's settings (dtype, CFG, steps, window, LoRA, "
             "checkpointing), from micro-batch times, not a whole step: GPU seconds of rollout + update per image "
             "at the micro-batch × minibatches images the check ran, times the config's images per GPU.", "",
             "| config (as measured) | images/step on GPUs | images per GPU | measured images | GPU s per image "
             "| s/step | img/GPU/s | MFU | from |", "|---|---|---|---|---|---|---|---|---|", *ours, "",
             "verl-omni, as published (docs/algo/performance.md; whole steps: rollout, reward, update, weight sync):",
             "", "| recipe | GPUs | images/step | s/step | img/GPU/s | ours at its shape / it |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    ours_at_shape = figures.get(OURS_AT_VERL_SHAPE, {}).get("images_per_gpu_s")
    for p in VERL_OMNI:
        ratio = f"{ours_at_shape / p.images_per_gpu_s:.2f}" if ours_at_shape and "LoRA r64, CFG" in p.recipe else ""
        note = f" ({p.note})" if p.note else ""
        lines.append(f"| {p.recipe}{note} | {p.gpus} | {p.images_per_step} | {p.seconds_per_step:g} | "
                     f"{p.images_per_gpu_s:.3f} | {ratio} |")  # fmt: skip
    return [*lines, "", END]


def replaced(text: str, new: list[str], where: Path) -> str:
    lines = text.split("\n")
    if START not in lines or END not in lines:
        raise SystemExit(f"{where.relative_to(ROOT)}: the lines '{START}' and '{END}' are missing")
    return "\n".join(lines[: lines.index(START)] + new + lines[lines.index(END) + 1 :])


def drifted(record: dict, docs=DOCS) -> list[Path]:
    new = table(record)
    return [doc for doc in docs if replaced(doc.read_text(encoding="utf-8"), new, doc) != doc.read_text("utf-8")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables instead of checking them")
    record = json.loads(RECORD.read_text(encoding="utf-8"))
    if parser.parse_args(argv).write:
        for doc in DOCS:
            doc.write_text(replaced(doc.read_text(encoding="utf-8"), table(record), doc), encoding="utf-8")
        return 0
    stale = drifted(record)
    for doc in stale:
        print(f"{doc.relative_to(ROOT)}: its throughput table drifted: run `python scripts/throughput_table.py "
              "--write`")  # fmt: skip
    return 1 if stale else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
