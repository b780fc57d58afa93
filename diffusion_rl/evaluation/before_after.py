"""The first and the last validation of a run, prompt by prompt: what training changed, in one picture.

`before_after.png` has two rows per band of prompts: the first validation's images (the base model's, with
`val.before_train`) above the last one's, the same prompt and seed in each column, captioned with the prompt and
that prompt's mean reward over its samples at each step. The prompts are the validation file's first ones, in its
order (no choosing the flattering ones); each column shows the prompt's first sample.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from diffusion_rl.tracking.images import image_grid, save_png
from diffusion_rl.tracking.val_images import read_validation_images

MAX_PROMPTS = 8


def _by_prompt(rows: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for row in rows:
        out.setdefault(int(row["prompt_index"]), []).append(row)
    return out


def _score(rows: list[dict]) -> str:
    scores = [r["reward"] for r in rows if r.get("reward") is not None]
    return f"{np.mean(scores):.2f}" if scores else "failed"


def plot_before_after(samples_dir: Path, out_png: Path, max_prompts: int = MAX_PROMPTS) -> Path | None:
    """Write `out_png` from the first and last validations under `samples_dir`; None when there are fewer than two
    or they share no prompt."""
    by_step = read_validation_images(samples_dir)
    if len(by_step) < 2:
        return None
    first, last = min(by_step), max(by_step)
    before, after = _by_prompt(by_step[first]), _by_prompt(by_step[last])
    prompts = [i for i in sorted(before) if i in after][:max_prompts]
    if not prompts:
        return None
    images, captions = [], []
    for step, rows in ((first, before), (last, after)):
        for i in prompts:
            sample = min(rows[i], key=lambda r: r["sample"])
            images.append(np.asarray(Image.open(sample["path"]).convert("RGB")))
            label = f"{sample['prompt']} | " if step == first else ""
            captions.append(f"{label}step {step}: {_score(rows[i])}")
    return save_png(image_grid(images, captions, ncols=len(prompts)), out_png)
