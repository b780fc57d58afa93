"""Labelled image grids (sample sheets with prompt/reward captions) and PNG writing."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from diffusion_rl.utils.files import naming

MIN_TILE_WIDTH = 128  # narrower tiles are upscaled (NEAREST, integer factor) so a caption line holds a few words
GAP = 2  # white pixels between cells
MAX_AUTO_LINES = 4  # caption lines when caption_height is not given; longer captions end in "..."
_BACKGROUND = (255, 255, 255)
_TEXT = (0, 0, 0)


@lru_cache(maxsize=8)
def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.truetype("DejaVuSans.ttf", size)  # Pillow also looks in the system font folders
    except OSError:
        pass
    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 with FreeType: a scalable built-in font
    except TypeError:
        return ImageFont.load_default()


def _line_height(font: ImageFont.ImageFont | ImageFont.FreeTypeFont) -> int:
    left, top, right, bottom = font.getbbox("Ag|")
    return int(bottom) + 2


def _ellipsize(text: str, font: ImageFont.ImageFont | ImageFont.FreeTypeFont, width: float) -> str:
    """`text` shortened as needed so that `text + "..."` fits in `width` pixels."""
    while text and font.getlength(text + "...") > width:
        text = text[:-1]
    return text.rstrip() + "..."


def _wrap(text: str, font: ImageFont.ImageFont | ImageFont.FreeTypeFont, width: float, max_lines: int) -> list[str]:
    """Greedy word wrap to `width` pixels; words longer than a line are split; the last line kept ends in '...'."""
    lines: list[str] = []
    for paragraph in text.splitlines() or [""]:
        current = ""
        for word in paragraph.split():
            candidate = f"{current} {word}" if current else word
            if font.getlength(candidate) <= width:
                current = candidate
                continue
            if current:
                lines.append(current)
            while font.getlength(word) > width and len(word) > 1:  # split a word wider than the tile
                cut = len(word) - 1
                while cut > 1 and font.getlength(word[:cut]) > width:
                    cut -= 1
                lines.append(word[:cut])
                word = word[cut:]
            current = word
        lines.append(current)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = _ellipsize(lines[-1], font, width)  # say that text was cut
    return lines


def _as_tiles(images: np.ndarray | Sequence[np.ndarray]) -> np.ndarray:
    if isinstance(images, np.ndarray):
        tiles = images
    else:
        if len(images) == 0:
            raise ValueError("image_grid needs at least one image")
        shapes = {np.shape(image) for image in images}
        if len(shapes) != 1:
            raise ValueError(f"image_grid needs images of one size, got shapes {sorted(shapes)}")
        tiles = np.stack([np.asarray(image) for image in images])
    if tiles.dtype != np.uint8 or tiles.ndim != 4 or tiles.shape[3] != 3 or tiles.shape[0] == 0:
        raise ValueError(
            f"image_grid needs uint8 images [N, H, W, 3] with N >= 1, got {tiles.dtype} {list(tiles.shape)}"
        )
    return tiles


def image_grid(
    images: np.ndarray | Sequence[np.ndarray],
    captions: Sequence[str] | None = None,
    ncols: int | None = None,
    caption_height: int | None = None,
) -> np.ndarray:
    """A grid of the images (uint8 [N, H, W, 3] or a list of [H, W, 3]) with each caption drawn below its tile.

    Tiles narrower than 128 px are upscaled by an integer factor (NEAREST) so captions stay legible. Captions
    are word-wrapped to the tile width; `caption_height` (pixels) fixes the band below each tile, otherwise it
    fits the longest caption up to 4 lines. Longer captions are cut with "...". Returns uint8 [H', W', 3].
    """
    tiles = _as_tiles(images)
    count, height, width, _ = tiles.shape
    if captions is not None and len(captions) != count:
        raise ValueError(f"image_grid got {count} images but {len(captions)} captions")
    ncols = math.ceil(math.sqrt(count)) if ncols is None else ncols
    if ncols < 1:
        raise ValueError(f"image_grid(ncols={ncols}) needs ncols >= 1")
    ncols = min(ncols, count)
    nrows = math.ceil(count / ncols)

    scale = math.ceil(MIN_TILE_WIDTH / width) if width < MIN_TILE_WIDTH else 1
    if scale > 1:
        tiles = tiles.repeat(scale, axis=1).repeat(scale, axis=2)  # NEAREST upscaling by an integer factor
        height, width = height * scale, width * scale

    font = _font(max(11, min(18, width // 10)))
    line_height = _line_height(font)
    margin = 3
    text_width = width - 2 * margin
    wrapped: list[list[str]] = []
    band = 0
    if captions is not None:
        if caption_height is None:
            wrapped = [_wrap(caption, font, text_width, MAX_AUTO_LINES) for caption in captions]
            band = max(len(lines) for lines in wrapped) * line_height + 2 * margin
        else:
            if caption_height < 0:
                raise ValueError(f"image_grid(caption_height={caption_height}) must be >= 0")
            band = caption_height
            max_lines = max(0, (caption_height - 2 * margin) // line_height)
            wrapped = [_wrap(caption, font, text_width, max_lines) if max_lines else [] for caption in captions]

    cell_height = height + band
    canvas = Image.new("RGB", (ncols * width + (ncols - 1) * GAP, nrows * cell_height + (nrows - 1) * GAP), _BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for index in range(count):
        row, col = divmod(index, ncols)
        x, y = col * (width + GAP), row * (cell_height + GAP)
        canvas.paste(Image.fromarray(tiles[index]), (x, y))
        for line_number, line in enumerate(wrapped[index] if wrapped else []):
            draw.text((x + margin, y + height + margin + line_number * line_height), line, fill=_TEXT, font=font)
    return np.asarray(canvas, dtype=np.uint8).copy()


def save_png(array: np.ndarray, path: str | os.PathLike[str]) -> Path:
    """Writes a uint8 [H, W, 3] (or [H, W]) array as a PNG, creating parent folders. Returns the path."""
    if array.dtype != np.uint8 or array.ndim not in (2, 3):
        raise ValueError(f"save_png needs a uint8 [H, W, 3] or [H, W] array, got {array.dtype} {list(array.shape)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with naming(path):
        Image.fromarray(array).save(path, format="PNG")
    return path
