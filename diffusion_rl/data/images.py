"""Fitting a picture to a size: the rules every dataset image follows.

- `cover_and_crop` (training inputs: offline pair images, condition images): scale so the picture covers the
  height × width (the shorter side fits, bicubic), then cut the centre out. The aspect ratio is kept; what sticks out
  of the frame is lost.
- `letterbox` (`prepare edit`): scale so the whole picture fits in size × size (bicubic), then pad the rest
  with black, centred. Nothing is lost; the bands are part of the image.
"""

from __future__ import annotations

import numpy as np
from PIL import Image


def cover_and_crop(image: Image.Image, height: int, width: int) -> np.ndarray:
    """uint8 [height, width, 3]: RGB, scaled to cover the size, then centre-cropped."""
    image = image.convert("RGB")
    scale = max(height / image.height, width / image.width)
    size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    if size != image.size:
        image = image.resize(size, Image.Resampling.BICUBIC)
    left, top = (image.width - width) // 2, (image.height - height) // 2
    image = image.crop((left, top, left + width, top + height))
    return np.asarray(image, dtype=np.uint8).copy()


def letterbox(image: Image.Image, size: int) -> Image.Image:
    """An RGB size × size image: the picture scaled to fit inside it, centred on black."""
    image = image.convert("RGB")
    scale = min(size / image.width, size / image.height)
    fitted = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    if fitted != image.size:
        image = image.resize(fitted, Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", (size, size), (0, 0, 0))
    canvas.paste(image, ((size - fitted[0]) // 2, (size - fitted[1]) // 2))
    return canvas
