"""`diffusion-rl prepare edit INPUT_DIR OUT`: a folder of edit instructions with their source images → verl-style
parquet, the images inside; `prepare shapes-edits OUT`: the ShapesWorld edit dataset (data/shapes_edits.py).

INPUT_DIR holds one or more .jsonl files (read in name order), one edit per line:

    {"prompt": "make the sky pink", "image": "photos/beach.png"}            one source image
    {"prompt": "put the cat on the sofa", "images": ["cat.png", "sofa.png"]} several (Qwen-Image-Edit Plus)

with paths relative to the .jsonl file, and optionally "negative_prompt", "data_source", "ground_truth",
"metadata". Each image is letterboxed to --size × --size (scaled to fit, centred on black; data/images.py) and
stored as PNG bytes. OUT is a folder: train.parquet, and val.parquet with --val-fraction of the edits (a seeded
draw). Rows are verl's layout (data/prompts.py): the prompt as chat messages "<image>…<image>{instruction}" (one
placeholder per image), `images: [{"bytes": …}]`, `ability: "edit"`. A missing, unreadable or truncated image, one
smaller than --size / 4 on a side, or one over 8192×8192 pixels (data/condition_images.py) is an error naming the
file and the line; --size is at most 4096.
"""

from __future__ import annotations

import argparse
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diffusion_rl.data.condition_images import MAX_UPSCALE, ConditionImage
from diffusion_rl.data.images import letterbox
from diffusion_rl.data.prompts import PromptRecord, read_jsonl, write_prompts
from diffusion_rl.errors import UserError

logger = logging.getLogger(__name__)

KEYS = ("prompt", "image", "images", "negative_prompt", "data_source", "ground_truth", "metadata")
ABILITY = "edit"
MIN_SIZE, MAX_SIZE = 16, 4096  # --size; a 4096² PNG is up to 50 MB per image in the parquet file


@dataclass(frozen=True)
class PreparedEdits:
    train: Path
    val: Path | None
    count: int


def read_edit_lines(directory: Path) -> list[tuple[dict, list[ConditionImage], str]]:
    """(line object, its images, where) for every edit line of the .jsonl files in `directory`."""
    files = sorted(directory.glob("*.jsonl")) if directory.is_dir() else []
    if not files:
        raise UserError(f"prepare edit: {directory} holds no .jsonl file of edits (one {{prompt, image}} per line)")
    out = []
    for file in files:
        for obj, where in read_jsonl(file, KEYS, '{"prompt": "make it red", "image": "a.png"}'):
            paths = [obj["image"]] if "image" in obj else obj.get("images")
            if "image" in obj and "images" in obj:
                raise UserError(f"{where}: give 'image' or 'images', not both")
            if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
                raise UserError(f"{where}: needs 'image' (a path) or 'images' (a non-empty list of paths)")
            images = [ConditionImage(str((file.parent / p).resolve()), f"{where} ({p})") for p in paths]
            out.append((obj, images, where))
    return out


def letterboxed_png(image: ConditionImage, size: int) -> bytes:
    """The image letterboxed to size × size as PNG bytes; an error naming it when it is too small."""
    width, height = image.size()
    if max(width, height) * MAX_UPSCALE < size:
        raise UserError(
            f"{image.where}: the image is {width}×{height}, too small for --size {size} (it would be upscaled "
            f"more than {MAX_UPSCALE}×)"
        )
    boxed = image.decode(lambda picture: letterbox(picture, size))
    buffer = io.BytesIO()
    boxed.save(buffer, format="PNG")
    return buffer.getvalue()


def prepare_edit(input_dir: str | Path, out: str | Path, size: int, val_fraction: float, seed: int) -> PreparedEdits:
    if not MIN_SIZE <= size <= MAX_SIZE:
        raise UserError(f"prepare edit: --size must be in [{MIN_SIZE}, {MAX_SIZE}] px, got {size}")
    if not 0 <= val_fraction < 1:
        raise UserError(f"prepare edit: --val-fraction must be in [0, 1), got {val_fraction}")
    records = []
    for obj, images, where in read_edit_lines(Path(input_dir)):
        stored = tuple(ConditionImage(letterboxed_png(image, size), image.where) for image in images)
        try:
            records.append(
                PromptRecord(
                    prompt=obj.get("prompt"),
                    negative_prompt=obj.get("negative_prompt"),
                    ground_truth=obj.get("ground_truth"),
                    data_source=obj.get("data_source") or "edit",
                    metadata={**(obj.get("metadata") or {}), "ability": ABILITY},
                    images=stored,
                )
            )
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
    order = np.random.default_rng(seed).permutation(len(records))
    n_val = round(val_fraction * len(records))
    if n_val == len(records):
        raise UserError(f"prepare edit: --val-fraction {val_fraction} leaves no training edits of {len(records)}")
    out = Path(out)
    val_rows, train_rows = sorted(order[:n_val]), sorted(order[n_val:])
    write_prompts([records[i] for i in train_rows], out / "train.parquet")
    val_path = None
    if n_val:
        val_path = out / "val.parquet"
        write_prompts([records[i] for i in val_rows], val_path)
    logger.info("prepared %d edits: %d train, %d val, images %d×%d, in %s", len(records), len(train_rows), n_val,
                size, size, out)  # fmt: skip
    return PreparedEdits(out / "train.parquet", val_path, len(records))


def add_prepare_edit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input_dir", help="folder of .jsonl files: {prompt, image | images} per line")
    parser.add_argument("out", help="output folder: train.parquet (and val.parquet)")
    parser.add_argument("--size", type=int, default=512, help="images are letterboxed to size × size (PNG)")
    parser.add_argument("--val-fraction", type=float, default=0.0, help="share of edits in val.parquet")
    parser.add_argument("--seed", type=int, default=0, help="seed of the validation draw")


def run_prepare_edit_from_args(args: argparse.Namespace) -> PreparedEdits:
    return prepare_edit(args.input_dir, args.out, args.size, args.val_fraction, args.seed)


def add_prepare_shapes_edits_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output folder: train.jsonl, val.jsonl and images/")
    parser.add_argument("--size", type=int, default=32, help="source images are size × size")
    parser.add_argument("--train", type=int, default=48, help="training edits")
    parser.add_argument("--val", type=int, default=6, help="validation edits")
    parser.add_argument("--seed", type=int, default=0)


def run_prepare_shapes_edits_from_args(args: argparse.Namespace) -> dict:
    from diffusion_rl.data.shapes_edits import write_edit_files

    return write_edit_files(args.out, args.size, args.train, args.val, args.seed)
