"""What the trainer shows of its samples: captions of the validation gallery, and rollout dumps.

Training rollouts are written to disk every `log.rollout_every` steps, to see what the policy samples and how
it was scored: `<run.dir>/rollouts/step_XXXXXX/` with

    rollout.jsonl   one row per sample of the batch: uid, group, prompt, ground truth, data source, total and
                    per-reward scores, failed, advantage, and its image file (null past the image bound)
    sNNN.png        the first `log.rollout_max_images` samples of the batch (whole groups come first); videos
                    as sNNN.webp (animated)
    sheet.png       those images with prompt, reward and advantage captions, one group per row (videos: an
                    animated sheet.webp; edits: each tile shows its source images, then the result)

The folder is written under a temporary name and renamed, so it is complete or absent; a resumed run that
dumps the same step again replaces it.
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

from diffusion_rl.tracking.media import sample_sheet, save_sample
from diffusion_rl.utils.files import naming

ROLLOUTS_DIR = "rollouts"


def _number(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def write_rollout_dump(
    directory: str | os.PathLike[str],
    step: int,
    images_BHW3: np.ndarray,
    records: Sequence[Any],
    uids: Sequence[str],
    group_index: Sequence[int],
    scored: Any,
    advantages_B: Sequence[float],
    max_images: int,
    group_size: int,
    sources: Sequence[Sequence[np.ndarray]] | None = None,
) -> tuple[Path, np.ndarray | None]:
    """Write one step's dump (see the module docstring); returns its folder and the sheet (None: no images).
    `sources`: each row's condition images (an edit), shown left of its result on the sheet."""
    directory = Path(directory)
    final = directory / f"step_{step:06d}"
    tmp = directory / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    kept = min(max_images, len(records))
    names = list(scored.per_reward)
    rows, captions = [], []
    for i, record in enumerate(records):
        image = None
        if i < kept:
            image = save_sample(images_BHW3[i], tmp / f"s{i:03d}").name
            reward, advantage = float(scored.total[i]), float(advantages_B[i])
            captions.append(f"{record.prompt} | r {reward:.4g} | A {advantage:+.3g}")
        rows.append(
            {
                "step": step,
                "index": i,
                "uid": uids[i],
                "group": int(group_index[i]),
                "prompt": record.prompt,
                "ground_truth": record.ground_truth,
                "data_source": record.data_source,
                "reward": _number(scored.total[i]),
                "rewards": {n: _number(scored.per_reward[n][i]) for n in names},
                "failed": bool(scored.failed[i]),
                "advantage": _number(advantages_B[i]),
                "image": image,
            }
        )
    with naming(tmp / "rollout.jsonl"), open(tmp / "rollout.jsonl", "w", encoding="utf-8") as file:
        file.writelines(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in rows)
    sheet = None
    if kept:
        sheet = sample_sheet(images_BHW3[:kept], captions, min(group_size, kept), sources and sources[:kept])
        save_sample(sheet, tmp / "sheet")
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final, sheet


def validation_caption(step: int, prompts: Sequence[str], scores_PN: np.ndarray) -> str:
    """The caption of a validation grid in the trackers: mean reward, then each prompt with its samples' rewards.

    Lines end in two spaces so TensorBoard's markdown keeps the line breaks; W&B shows the text as it is.
    """
    finite = scores_PN[np.isfinite(scores_PN)]
    mean = f"{finite.mean():.4g}" if finite.size else "n/a"
    lines = [f"step {step}: validation reward mean {mean}"]
    for prompt, scores in zip(prompts, scores_PN):
        lines.append(f"{prompt}: " + ", ".join("failed" if not math.isfinite(s) else f"{s:.4g}" for s in scores))
    return "  \n".join(lines)
