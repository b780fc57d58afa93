"""Validation images one file each, for the HTML report's side-by-side views across steps.

    <run.dir>/samples/step_XXXXXX/index.json    [{"prompt_index", "prompt", "sample", "reward", "file",
                                                  "sources"}, ...]
    <run.dir>/samples/step_XXXXXX/pPPP_sK.png   prompt P's sample K (the validation seeds are fixed, so sample K of
                                                a prompt is comparable across steps); a video: pPPP_sK.webp
    <run.dir>/samples/step_XXXXXX/pPPP_cJ.png   an edit's condition image J (its source), as the model saw it;
                                                "sources" lists these files (empty for text-to-image)

The folder is written under a temporary name and renamed, so it is complete or absent.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from diffusion_rl.tracking.media import save_sample
from diffusion_rl.utils.files import naming

INDEX_FILE = "index.json"


def write_validation_images(
    samples_dir: str | os.PathLike[str],
    step: int,
    images_BHW3: np.ndarray,
    prompts: Sequence[str],
    n: int,
    rewards: Sequence[float],
    sources: Sequence[Sequence[np.ndarray]] | None = None,
) -> Path:
    """Write one validation's images (prompt-major: n samples per prompt, as the trainer orders them); videos
    ([B, F, H, W, 3]) as animated WebP. sources: each image's condition images (uint8 [H, W, 3], an edit's
    sources; written once per prompt), or None."""
    final = Path(samples_dir) / f"step_{step:06d}"
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rows = []
    for i, (image, prompt, reward) in enumerate(zip(images_BHW3, prompts, rewards)):
        p, k = divmod(i, n)
        name = save_sample(image, tmp / f"p{p:03d}_s{k}").name
        value = float(reward) if math.isfinite(float(reward)) else None
        conditions = sources[i] if sources else []
        names = [f"p{p:03d}_c{j}.png" for j in range(len(conditions))]
        if k == 0:
            for source, source_name in zip(conditions, names):
                save_sample(source, tmp / Path(source_name).stem)
        rows.append({"prompt_index": p, "prompt": prompt, "sample": k, "reward": value, "file": name,
                     "sources": names})  # fmt: skip
    with naming(tmp / INDEX_FILE):
        (tmp / INDEX_FILE).write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def read_validation_images(samples_dir: str | os.PathLike[str]) -> dict[int, list[dict[str, Any]]]:
    """step -> the index rows of that step's validation images (each with "path" added), for every step written."""
    out: dict[int, list[dict[str, Any]]] = {}
    root = Path(samples_dir)
    if not root.is_dir():
        return out
    for folder in sorted(root.glob("step_*")):
        index = folder / INDEX_FILE
        if folder.is_dir() and index.is_file():
            rows = json.loads(index.read_text(encoding="utf-8"))
            out[int(folder.name.removeprefix("step_"))] = [
                {**row, "path": folder / row["file"], "source_paths": [folder / s for s in row.get("sources", [])]}
                for row in rows
            ]
    return out
