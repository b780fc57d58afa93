"""Offline preference pairs for Diffusion-DPO: a prompt, a chosen image and a rejected image per row.

File layouts (.jsonl: one object per line, blank lines skipped; .parquet: the same columns):

    {"prompt": "a red apple", "chosen": "images/0_best.png", "rejected": "images/0_worst.png",
     "negative_prompt"?: str, "chosen_score"?: float, "rejected_score"?: float}

Image paths are relative to the pair file's directory (absolute paths work too). Scores are optional and only
checked (chosen ≥ rejected: a reversed pair would teach the opposite preference). `diffusion-rl prepare pairs`
writes this layout. Images are resized (shorter side) and centre-cropped to the training resolution when read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffusion_rl.data.images import cover_and_crop
from diffusion_rl.data.prompts import read_jsonl
from diffusion_rl.errors import UserError, did_you_mean

PAIR_EXTENSIONS = (".jsonl", ".parquet")
_REQUIRED = ("prompt", "chosen", "rejected")
_KEYS = (*_REQUIRED, "negative_prompt", "chosen_score", "rejected_score")
_EXAMPLE = '{"prompt": "a red apple", "chosen": "images/a.png", "rejected": "images/b.png"}'


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: Path  # absolute (resolved against the pair file's directory)
    rejected: Path
    negative_prompt: str | None = None
    chosen_score: float | None = None
    rejected_score: float | None = None


def load_pairs(path: str | Path) -> list[PreferencePair]:
    """Read and check a pair file; every problem is a UserError naming the file and line (or row)."""
    path = Path(path)
    if path.suffix.lower() not in PAIR_EXTENSIONS:
        raise UserError(f"{path}: pair files are {' or '.join(PAIR_EXTENSIONS)}, got '{path.suffix}'")
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise UserError(f"pair file {path} {what} (make one with `diffusion-rl prepare pairs`)")
    rows = list(read_jsonl(path, _KEYS, _EXAMPLE)) if path.suffix.lower() == ".jsonl" else _parquet_rows(path)
    pairs = [_pair(obj, where, path.parent) for obj, where in rows]
    if not pairs:
        raise UserError(f"{path}: no pairs found; expected one object per line, e.g. {_EXAMPLE}")
    return pairs


def write_pairs(pairs: list[PreferencePair], path: str | Path) -> None:
    """Write .jsonl with image paths relative to the file's directory when they lie under it."""
    path = Path(path)
    lines = []
    for p in pairs:
        obj: dict[str, Any] = {"prompt": p.prompt, "chosen": _relative(p.chosen, path.parent)}
        obj["rejected"] = _relative(p.rejected, path.parent)
        if p.negative_prompt is not None:
            obj["negative_prompt"] = p.negative_prompt
        for name in ("chosen_score", "rejected_score"):
            if getattr(p, name) is not None:
                obj[name] = getattr(p, name)
        lines.append(json.dumps(obj, ensure_ascii=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def load_image(path: Path, height: int, width: int) -> torch.Tensor:
    """uint8 [height, width, 3]: RGB, the shorter side resized to fit, then centre-cropped (data/images.py)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return torch.from_numpy(cover_and_crop(image, height, width))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read image {path} ({e})") from None


def _relative(image: Path, root: Path) -> str:
    try:
        return image.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(image)


def _parquet_rows(path: Path) -> list[tuple[Any, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: cannot read as parquet ({e})") from None
    # a missing optional value is a null in its column: drop it, so it reads as absent
    return [
        ({k: v for k, v in row.items() if v is not None}, f"{path}, row {i} (0-based)")
        for i, row in enumerate(table.to_pylist())
    ]


def _pair(obj: dict[str, Any], where: str, root: Path) -> PreferencePair:
    for key in obj:
        if key not in _KEYS:
            raise UserError(f"{where}: unknown key '{key}'{did_you_mean(key, _KEYS)}; known: {', '.join(_KEYS)}")
    for key in _REQUIRED:
        value = obj.get(key)
        if not isinstance(value, str) or not value.strip():
            got = "missing" if key not in obj else f"got {value!r}"
            raise UserError(f"{where}: '{key}' must be a non-empty string ({got}); e.g. {_EXAMPLE}")
    negative = obj.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise UserError(f"{where}: 'negative_prompt' must be a string, got {negative!r}")
    scores = {}
    for key in ("chosen_score", "rejected_score"):
        value = obj.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UserError(f"{where}: '{key}' must be a number, got {value!r}")
        if value is not None and not math.isfinite(value):
            raise UserError(f"{where}: '{key}' must be finite, got {value!r}")
        scores[key] = None if value is None else float(value)
    if None not in scores.values() and scores["chosen_score"] < scores["rejected_score"]:
        raise UserError(
            f"{where}: chosen_score {scores['chosen_score']} < rejected_score {scores['rejected_score']}; the chosen "
            "image must be the preferred one (swap 'chosen' and 'rejected')"
        )
    images = {}
    for key in ("chosen", "rejected"):
        image = (root / obj[key]).resolve()  # an absolute path stays as it is
        if not image.is_file():
            raise UserError(f"{where}: {key} image {obj[key]!r} not found (looked for {image})")
        images[key] = image
    return PreferencePair(obj["prompt"], images["chosen"], images["rejected"], negative, **scores)
