"""Reading a /score request safely: size limits, JSON of any shape, PNG only, pixel caps checked before decoding.

Every check that can be made before decoding an image is: the body size (Content-Length, then the bytes actually
read), the JSON's shape, and each image's PNG signature and IHDR size, read from the first 33 bytes of its base64
text. A 27 kB 1-bit PNG can declare 13000 × 13000 pixels and take gigabytes to decode: its header says so, and it
is refused (413) without being decoded. Any other image format is refused (400), so no other PIL decoder runs.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_HEADER_B64_CHARS = 44  # 33 bytes = signature (8) + IHDR length and type (8) + width, height, depth, colour (10)...


class BadRequest(ValueError):
    """A request that breaks the wire format: HTTP 400 with this message."""

    status = 400


class TooLarge(BadRequest):
    """A request over a size limit: HTTP 413 with this message."""

    status = 413


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 256 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096  # per image, from its PNG header
    max_request_pixels: int = 64 * 1024 * 1024  # sum over the request's images
    max_images: int = 1024


def parse_json(body: bytes | str) -> Any:
    """The body as JSON, or BadRequest for anything that is not (bad UTF-8, bad syntax, nesting too deep)."""
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise BadRequest(f"the body is not JSON ({reason})") from None


def png_size(text: str, name: str) -> tuple[int, int]:
    """(width, height) from the PNG header at the start of base64 `text`; BadRequest when it is not a PNG."""
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        head = base64.b64decode(text[:_HEADER_B64_CHARS], validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{name} is not base64 text") from None
    if not head.startswith(PNG_SIGNATURE):
        raise BadRequest(f"{name} is not a base64-encoded PNG (only PNG is accepted)")
    if len(head) < 24 or head[12:16] != b"IHDR":
        raise BadRequest(f"{name} is not a valid PNG (no IHDR header)")
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def decode_png(text: str, name: str, size: tuple[int, int]) -> np.ndarray:
    """uint8 RGB [H, W, 3] of a PNG whose header was checked; BadRequest when it does not decode as that PNG."""
    from PIL import Image

    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        raw = base64.b64decode(text, validate=True)
        with Image.open(io.BytesIO(raw), formats=["PNG"]) as image:
            if image.size != size:
                raise BadRequest(f"{name}: the PNG's size {image.size} is not its header's {size}")
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except BadRequest:
        raise
    except Exception as e:  # binascii.Error, PIL errors, zlib errors, truncated data: all mean a bad image
        raise BadRequest(f"{name} is not a valid PNG ({type(e).__name__}: {e})") from None


def parse_score_request(
    body: bytes | str, limits: Limits = Limits()
) -> tuple[np.ndarray, list[str], list[dict[str, Any]]]:
    """(images uint8 [n, H, W, 3] or videos [n, F, H, W, 3], prompts, metadata with any "condition_images" decoded)
    from a /score body, or BadRequest / TooLarge saying why not.

    An entry of "images" is one base64 PNG (an image) or a list of them (a video's frames; every video of a request
    has the same number); metadata[i]["condition_images"], when present, is a list of base64 PNGs (an edit's
    sources), decoded to uint8 [H, W, 3] arrays. Every picture counts towards the pixel limits."""
    request = parse_json(body)
    if not isinstance(request, dict):
        raise BadRequest('expected a JSON object {"images": [...], "prompts": [...], "metadata": [...]}')
    unknown = sorted(set(request) - {"images", "prompts", "metadata"})
    if unknown:
        raise BadRequest(f"unknown keys {unknown[:10]}; expected images, prompts and (optional) metadata")
    encoded, prompts = request.get("images"), request.get("prompts")
    if not isinstance(encoded, list) or not encoded:
        raise BadRequest("'images' must be a non-empty list of base64 PNG strings (or of lists of them: videos)")
    videos = all(isinstance(s, list) and s and all(isinstance(f, str) for f in s) for s in encoded)
    if not videos and not all(isinstance(s, str) for s in encoded):
        raise BadRequest("'images' must hold base64 PNG strings (images) or lists of them (videos), not a mix")
    if videos and len({len(s) for s in encoded}) > 1:
        raise BadRequest(
            f"every video of a request needs the same number of frames, got {sorted({len(s) for s in encoded})}"
        )
    if len(encoded) > limits.max_images:
        raise TooLarge(f"{len(encoded)} images in one request, over max_images={limits.max_images}; send fewer")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("'prompts' must be a list of strings")
    metadata = request.get("metadata")
    metadata = [{} for _ in encoded] if metadata is None else metadata
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise BadRequest("'metadata' must be a list of objects (or left out)")
    if not len(encoded) == len(prompts) == len(metadata):
        raise BadRequest(f"got {len(encoded)} images, {len(prompts)} prompts, {len(metadata)} metadata; need one each")
    pictures = [(f"images[{i}]" + (f"[{f}]" if videos else ""), text)
                for i, entry in enumerate(encoded) for f, text in enumerate(entry if videos else [entry])]  # fmt: skip
    sources = _condition_pictures(metadata)
    sizes = _checked_sizes(pictures + sources, limits)  # before decoding any picture
    frame_sizes = set(list(sizes.values())[: len(pictures)])
    if len(frame_sizes) > 1:
        raise BadRequest(f"all images of one request must have the same size; got {sorted(frame_sizes)}")
    decoded = {name: decode_png(text, name, sizes[name]) for name, text in pictures + sources}
    for i, entry in enumerate(metadata):
        if "condition_images" in entry:
            entry["condition_images"] = [decoded[f"metadata[{i}].condition_images[{k}]"]
                                         for k in range(len(entry["condition_images"]))]  # fmt: skip
    frames = np.stack([decoded[name] for name, _ in pictures])
    if videos:
        frames = frames.reshape(len(encoded), len(encoded[0]), *frames.shape[1:])
    return frames, prompts, metadata


def _condition_pictures(metadata: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(name, base64 PNG) of every metadata[i]["condition_images"] entry, checked to be a list of strings."""
    out = []
    for i, entry in enumerate(metadata):
        sources = entry.get("condition_images")
        if sources is None:
            continue
        if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
            raise BadRequest(f"metadata[{i}].condition_images must be a list of base64 PNG strings")
        out += [(f"metadata[{i}].condition_images[{k}]", text) for k, text in enumerate(sources)]
    return out


def _checked_sizes(pictures: list[tuple[str, str]], limits: Limits) -> dict[str, tuple[int, int]]:
    """name → (width, height) from each PNG header, within the pixel limits (TooLarge otherwise)."""
    sizes = {name: png_size(text, name) for name, text in pictures}
    for name, (width, height) in sizes.items():
        if width * height > limits.max_image_pixels:
            raise TooLarge(f"{name} is {width} × {height} pixels, over max_image_pixels={limits.max_image_pixels}")
    total = sum(w * h for w, h in sizes.values())
    if total > limits.max_request_pixels:
        raise TooLarge(
            f"the request's images hold {total} pixels, over max_request_pixels={limits.max_request_pixels}; send "
            "smaller chunks"
        )
    return sizes
