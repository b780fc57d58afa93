"""Condition images of a prompt (the source images of an edit): where they come from, how they are checked and fitted.

A prompt record may carry images: in .jsonl as `"images": ["path.png", ...]` with paths relative to the .jsonl
file, in .parquet (verl's layout) as `images: [{"bytes": <PNG/JPEG bytes>}, ...]` (a `"path"` there is read when
`bytes` is null, relative to the .parquet file). A `ConditionImage` keeps that reference and reads the pixels only
when used, so a large dataset is not held decoded in memory.

The size rule: a condition image is fitted to a height × width by `cover_and_crop` (scaled to cover, the shorter side
fitting, then centre-cropped; data/images.py). Rewards and sheets get it at the output size, so a result and its
source line up pixel by pixel (metadata["condition_images"]); a model at the size it reads it (`FlowModel.
fit_conditions`, model.condition_size: the output size, or its pipeline's at the output's aspect ratio), and resizes
further where its pipeline does (Qwen-Image-Edit shows its text encoder a ~384² copy).

Checked when a run starts, before its first step (`check_condition_images`): a missing file, an unreadable image, an
image over MAX_PIXELS (refused from its header, before any pixel is decoded: a 12000² photo takes 1.2 GB to fit; a
bomb more), an image smaller than a quarter of the output on a side (it would be upscaled more than 4×), pixels that
do not decode (a truncated or corrupt file: every distinct image is decoded in full once, in parallel threads), or
rows with different numbers of images (a batch of them must line up) is an error naming the file and the line or row.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from diffusion_rl.data.images import cover_and_crop
from diffusion_rl.errors import UserError

if TYPE_CHECKING:
    from PIL import Image

MAX_UPSCALE = 4  # a condition image needs at least 1/MAX_UPSCALE of the output's height and width
MAX_SIDE = 8192
MAX_PIXELS = MAX_SIDE * MAX_SIDE  # 67 MP, 201 MB decoded as RGB: larger is a photo to shrink first, or a bomb
T = TypeVar("T")
METADATA_KEY = "condition_images"  # where a reward finds a sample's condition images (rewards/base.py)
DECODE_THREADS = 8  # the start-up check's threads: each holds one decoded image (at most 201 MB) at a time


@dataclass(frozen=True)
class ConditionImage:
    """One condition image: a file or encoded bytes, and where the dataset named it (for messages)."""

    source: str | bytes  # an absolute file path, or the image file's bytes (PNG, JPEG, …)
    where: str = field(compare=False)  # e.g. "data/edit.jsonl, line 3, images[0]"; equal images compare equal

    def __post_init__(self):
        if not isinstance(self.source, (str, bytes)) or not self.source:
            raise UserError(f"{self.where}: a condition image is a file path or image bytes, got {self.source!r:.80}")

    def open(self):
        """The image, opened with PIL (its header read; the pixels when used); a UserError naming it otherwise."""
        from PIL import Image

        if isinstance(self.source, str) and not Path(self.source).is_file():
            raise UserError(f"{self.where}: the image file {self.source} does not exist")
        try:
            with warnings.catch_warnings():  # PIL warns from 89 MP on; MAX_PIXELS refuses those below
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(self.source if isinstance(self.source, str) else io.BytesIO(self.source))
        except Image.DecompressionBombError as e:  # over 179 MP: PIL refuses before giving the sides
            count = re.search(r"\((\d+) pixels\)", str(e))
            what = f"has {count[1]} pixels" if count else f"over PIL's decompression-bomb limit ({e})"
            raise UserError(f"{self.where}: {self._too_large(what)}") from None
        except (OSError, ValueError) as e:
            raise UserError(f"{self.where}: cannot read the image ({e})") from None
        if image.width * image.height > MAX_PIXELS:
            image.close()
            raise UserError(f"{self.where}: {self._too_large(f'is {image.width}×{image.height}')}")
        return image

    @staticmethod
    def _too_large(what: str) -> str:
        return (
            f"the image {what}, more than {MAX_SIDE}×{MAX_SIDE} pixels; shrink it first (a condition image is fitted "
            "to the output size anyway)"
        )

    def decode(self, fit: Callable[[Image.Image], T]) -> T:
        """fit(the opened image), a UserError naming the image when its pixels do not decode (a truncated file)."""
        try:
            with self.open() as image:
                return fit(image)
        except UserError:
            raise
        except (OSError, ValueError) as e:  # a header that reads but pixels that do not
            raise UserError(f"{self.where}: cannot decode the image ({e})") from None

    def size(self) -> tuple[int, int]:
        """(width, height) from the image's header (the pixels are not decoded)."""
        with self.open() as image:
            return image.size

    def load(self, height: int, width: int) -> np.ndarray:
        """uint8 [height, width, 3]: the image fitted to the output size (cover_and_crop)."""
        return self.decode(lambda image: cover_and_crop(image, height, width))

    def file_bytes(self) -> bytes:
        """The encoded image file (for writing parquet rows)."""
        if isinstance(self.source, bytes):
            return self.source
        self.open().close()  # a clear error for a missing or unreadable file
        return Path(self.source).read_bytes()


def fit_condition_images(rows: Sequence[Sequence[ConditionImage]], height: int, width: int) -> list[list[np.ndarray]]:
    """Each row's images fitted to height × width (uint8 [height, width, 3]); an image several rows share (a prompt's
    group) is read once."""
    fitted: dict[ConditionImage, np.ndarray] = {}
    for row in rows:
        for image in row:
            if image not in fitted:
                fitted[image] = image.load(height, width)
    return [[fitted[image] for image in row] for row in rows]


def fit_rows(rows: Sequence[Sequence[ConditionImage]] | None, height: int, width: int) -> list[list[np.ndarray]] | None:
    """fit_condition_images for a batch that may be text-only: None when no row has a condition image."""
    if rows is None or not any(rows):
        return None
    return fit_condition_images(rows, height, width)


def with_condition_images(
    metadata: list[dict], rows: Sequence[Sequence[ConditionImage]], height: int, width: int
) -> list[dict]:
    """The rewards' metadata of a batch with each row's condition images (fitted, uint8 [H, W, 3]) under
    "condition_images"; unchanged when no row has any."""
    if not any(rows):
        return metadata
    for entry, images in zip(metadata, fit_condition_images(rows, height, width)):
        entry[METADATA_KEY] = images
    return metadata


def check_condition_images(
    records: Sequence, height: int, width: int, where: str, decoded: set[ConditionImage] | None = None
) -> int:
    """The number of condition images each record of a dataset (`where`, for messages) carries, after checking every
    image exists, is large enough for height × width and decodes in full; records must all carry the same number.
    `decoded`: images decoded already (e.g. by the check of the training set, for the validation set's), updated."""
    counts = {len(r.images) for r in records}
    if len(counts) > 1:
        by_count = {n: next(i for i, r in enumerate(records) if len(r.images) == n) for n in sorted(counts)}
        examples = ", ".join(f"{n} (record {i})" for n, i in by_count.items())
        raise UserError(
            f"{where}: the records carry different numbers of condition images: {examples}; a batch needs the same "
            "number in every row (split the dataset by count)"
        )
    decoded = set() if decoded is None else decoded
    distinct = list(dict.fromkeys(image for record in records for image in record.images))  # in dataset order

    def check(image: ConditionImage) -> None:
        def fits(opened: Image.Image) -> None:
            w, h = opened.size  # from the header: a too small (or too large: open) image is refused undecoded
            if w * MAX_UPSCALE < width or h * MAX_UPSCALE < height:
                raise UserError(
                    f"{image.where}: the image is {w}×{h}, too small for the output {width}×{height} (it would be "
                    f"upscaled more than {MAX_UPSCALE}×); use larger sources or a smaller sampling.height/width"
                )
            if image not in decoded:
                opened.load()  # every pixel: a truncated file fails here, not at the step that first reads it

        image.decode(fits)

    # PIL decodes without the GIL: threads decode images side by side; the first bad one in dataset order is reported
    with ThreadPoolExecutor(max_workers=max(1, min(DECODE_THREADS, os.cpu_count() or 1))) as pool:
        try:
            for _ in pool.map(check, distinct):
                pass
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    decoded.update(distinct)
    return counts.pop() if counts else 0


def count_mismatch(train: int, val: int, train_where: str, val_where: str) -> str | None:
    """A warning when the validation rows carry another number of condition images than the training rows (counts
    from `check_condition_images`), or None: validation then samples without the sources training edits, and a
    reward that compares with them fails on the validation batch, which reads as if the training data had lost them."""
    if train == val or not train:
        return None
    return (f"data.train ({train_where}) rows carry {train} condition image(s) each, val.prompts ({val_where}) rows "
            f"{val}: validation samples {'without' if not val else 'with other'} sources, and a reward that "
            "compares with them (source_preservation) fails on the validation batch; give val.prompts rows with the "
            "same number of images")  # fmt: skip
