"""ShapesWorld rewards read from pixels: colour, count and position correctness, and their mean (a small GenEval).

Each score is in [0, 1] and compares an image with the prompt's `SceneSpec` (from metadata["shapes"] when the
dataset row carries it, otherwise parsed from the prompt; see `diffusion_rl.data.shapes`).

How an image is read: a pixel belongs to an object when its chroma (max − min channel) is at least
`chroma_threshold`; it then takes the nearest palette colour (grey, black and white pixels are background). A
colour is present when it covers at least `min_area_fraction` of the image; its objects are its 8-connected
components of at least that area; its position is the centroid of all its pixels (x, y in [0, 1]).

- `shapes_color`: (share of the asked colours that are present) × (share of object pixels that have an asked
  colour). 1 for exactly the asked colours, 0 when none of them is there.
- `shapes_count`: per asked colour, 1 − |found − asked| / asked (at least 0), averaged over the asked colours.
- `shapes_position`: for "on the left" etc., how far the object's centroid lies towards that side; for
  "A above B" etc., how far A's centroid lies from B's along the asked direction. The offset d (a fraction of the
  image) maps to clip(0.5 + d / (2·d_full)), with d_full a little less than the offset the generator draws at
  least (`POSITION_FULL`, `RELATION_FULL`), so a drawn image scores 1, a centred one 0.5 and a mirrored one 0.
  An absent object scores 0; a prompt without a position scores 1 (nothing to get wrong).
- `shapes_shape`: per asked colour, the share of its objects whose outline is an asked shape of that colour (0
  when the colour is absent), averaged over the asked colours. An object's outline is read from its pixels: a
  square fills its bounding box (fill ≥ `SQUARE_FILL`), a triangle's top third is much narrower than its bottom
  third (`TRIANGLE_TAPER`), a circle is neither; a component too elongated or too sparse for any of them
  (`OUTLINE_ASPECT`, `OUTLINE_FILL`) is no shape. On the generator's own drawings at 32 px it reads 97 % of
  circles and every square and triangle right (tests/rewards/test_shapes_reward.py).
- `shapes_geneval`: the mean of colour, count and (when the prompt has one) position. It does not read shapes:
  a model can raise it by drawing blobs of the asked colours (benchmarks/RESULTS.md, the pilot at lr 1e-4);
  `shape_weight` w weighs `shapes_shape` in: (mean + w · shape) / (1 + w).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from diffusion_rl.data.shapes import COLORS, MIN_SEPARATION, REGION, SHAPES, SceneSpec, parse_prompt
from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS, RewardFn

POSITION_FULL = 0.5 - REGION - 0.03  # the generator puts "left" objects at least 0.5 − REGION off the centre
RELATION_FULL = MIN_SEPARATION - 0.05  # ... and related objects at least MIN_SEPARATION apart
_PALETTE = np.array(list(COLORS.values()), dtype=np.float32)  # [K, 3]
_COLOR_INDEX = {name: k for k, name in enumerate(COLORS)}
_SHAPE_INDEX = {name: k for k, name in enumerate(SHAPES)}
SQUARE_FILL = 0.9  # a component filling at least this share of its bounding box is a square (circles: 0.59-0.92)
TRIANGLE_TAPER = 0.6  # ... one whose top third is narrower than this share of its bottom third a triangle (≤ 0.40)
OUTLINE_ASPECT = 1.67  # height / width (or width / height) beyond this: no shape (the drawn ones: ≤ 1.43)
OUTLINE_FILL = 0.45  # a component filling less of its bounding box: no shape (the drawn ones: ≥ 0.51)


@dataclass
class ImageReading:
    """What one image shows, per palette colour k (in COLORS order)."""

    area: np.ndarray  # [K] pixels of colour k
    objects: np.ndarray  # [K] connected components of colour k with at least min_area pixels
    centroid: np.ndarray  # [K, 2] (x, y) in [0, 1] of colour k's pixels; NaN where the colour is absent
    min_area: float
    outlines: np.ndarray | None = None  # [K, S] objects of colour k whose outline reads as SHAPES[s] (if read)

    def present(self, color: str) -> bool:
        return bool(self.area[_COLOR_INDEX[color]] >= self.min_area)


def classify_pixels(images_BHW3: np.ndarray, chroma_threshold: float = 80.0) -> np.ndarray:
    """int [B, H, W]: 0 for background, k + 1 for the k-th palette colour."""
    pixels = images_BHW3.astype(np.float32)
    brightest = pixels.max(axis=-1)
    chroma = brightest - pixels.min(axis=-1)
    # Compare colours scaled to a brightest channel of 1: an edge pixel blended with the black background is a
    # darker shade of its colour (dark yellow would otherwise sit nearer green than yellow).
    shade = pixels / np.maximum(brightest, 1.0)[..., None]
    palette = _PALETTE / _PALETTE.max(axis=-1, keepdims=True)
    distance = ((shade[..., None, :] - palette) ** 2).sum(axis=-1)  # [B, H, W, K]
    labels = distance.argmin(axis=-1) + 1
    return np.where(chroma >= chroma_threshold, labels, 0)


def _components(mask_NHW: np.ndarray) -> np.ndarray:
    """int [N, H, W]: an id per 8-connected component of `mask` (unique across N), -1 off the mask.

    Every mask pixel holds the flat index of a pixel of its component (itself at first). Each round it takes the
    smallest id in its 3×3 neighbourhood, then the id held at that index (pointer jumping, which halves the
    distance ids still have to travel); at the fixed point each component holds one id: its first pixel's.
    """
    n, h, w = mask_NHW.shape
    big = n * h * w
    ids = np.where(mask_NHW, np.arange(big).reshape(n, h, w), big)
    while True:
        padded = np.pad(ids, ((0, 0), (1, 1), (1, 1)), constant_values=big)
        smallest = ids.copy()
        for dy in range(3):
            for dx in range(3):
                np.minimum(smallest, padded[:, dy : dy + h, dx : dx + w], out=smallest)
        smallest = np.where(mask_NHW, smallest, big)
        flat = np.append(smallest.ravel(), big)
        smallest = flat[flat[smallest]]  # two jumps: ids stay within the component
        if np.array_equal(smallest, ids):
            return np.where(mask_NHW, ids, -1)
        ids = smallest


def read_images(
    images_BHW3: np.ndarray, min_area_fraction: float = 0.005, chroma_threshold: float = 80.0, outlines: bool = False
):
    """One `ImageReading` per image; with `outlines`, each object's outline read too (`shapes_shape`)."""
    batch, height, width = images_BHW3.shape[:3]
    k_count = len(_PALETTE)
    labels = classify_pixels(images_BHW3, chroma_threshold)
    masks_BKHW = labels[:, None] == np.arange(1, k_count + 1)[None, :, None, None]
    min_area = max(1.0, min_area_fraction * height * width)
    area_BK = masks_BKHW.sum(axis=(2, 3)).astype(np.float64)
    ys, xs = (np.arange(n) + 0.5 for n in (height, width))  # pixel centres
    with np.errstate(invalid="ignore", divide="ignore"):  # absent colours: 0 / 0 = NaN, as documented
        cx_BK = (masks_BKHW.sum(axis=2) * xs).sum(axis=-1) / area_BK / width
        cy_BK = (masks_BKHW.sum(axis=3) * ys).sum(axis=-1) / area_BK / height
    # components of every (image, colour) mask at once: an id is a flat pixel index, so id // (H·W) = mask index
    # (colours covering less than min_area have no object and are skipped)
    masks_NHW = masks_BKHW.reshape(batch * k_count, height, width)
    candidates = np.flatnonzero(area_BK.ravel() >= min_area)
    ids = _components(masks_NHW[candidates])
    pixels = np.nonzero(ids >= 0)  # (mask index, y, x) of every object pixel
    comp_ids, inverse, sizes = np.unique(ids[pixels], return_inverse=True, return_counts=True)
    objects = np.bincount(comp_ids[sizes >= min_area] // (height * width), minlength=len(candidates))
    objects_BK = np.zeros(batch * k_count)
    objects_BK[candidates] = objects
    objects_BK = objects_BK.reshape(batch, k_count)
    shapes_BKS = None
    if outlines:
        shapes_BKS = np.zeros((batch * k_count, len(SHAPES)))
        for c, shape in _outlines(pixels[1], pixels[2], inverse, sizes, min_area):
            shapes_BKS[candidates[comp_ids[c] // (height * width)], _SHAPE_INDEX[shape]] += 1
        shapes_BKS = shapes_BKS.reshape(batch, k_count, len(SHAPES))
    centroids = np.stack([cx_BK, cy_BK], -1)
    return [ImageReading(area_BK[b], objects_BK[b], centroids[b], min_area, None if shapes_BKS is None else
                         shapes_BKS[b]) for b in range(batch)]  # fmt: skip


def _outlines(ys, xs, inverse, sizes, min_area: float) -> list[tuple[int, str]]:
    """(component, shape) of each component of at least `min_area` pixels whose outline reads as a shape: the
    components as `np.unique` numbered them (`inverse`: each object pixel's, at (ys, xs); `sizes`: their pixels)."""
    count = len(sizes)
    if count == 0:
        return []
    top, bottom, left, right = (np.full(count, fill) for fill in (ys.max() + 1, -1, xs.max() + 1, -1))
    np.minimum.at(top, inverse, ys)
    np.maximum.at(bottom, inverse, ys)
    np.minimum.at(left, inverse, xs)
    np.maximum.at(right, inverse, xs)
    rows, cols = bottom - top + 1, right - left + 1
    third = np.maximum(rows // 3, 1)  # rows in the top (and in the bottom) third
    in_top = ys < (top + third)[inverse]
    in_bottom = ys > (bottom - third)[inverse]
    top_width = np.bincount(inverse, weights=in_top, minlength=count) / third
    bottom_width = np.bincount(inverse, weights=in_bottom, minlength=count) / third
    fill, aspect, taper = sizes / (rows * cols), rows / cols, top_width / np.maximum(bottom_width, 1e-9)
    found = []
    for c in np.flatnonzero(sizes >= min_area):
        if fill[c] < OUTLINE_FILL or not 1 / OUTLINE_ASPECT <= aspect[c] <= OUTLINE_ASPECT:
            continue
        shape = "square" if fill[c] >= SQUARE_FILL else "triangle" if taper[c] < TRIANGLE_TAPER else "circle"
        found.append((int(c), shape))
    return found


# ---------------------------------------------------------------------------------------------------------------
# Scores of one reading against one spec


def color_score(spec: SceneSpec, reading: ImageReading) -> float:
    asked = {g.color for g in spec.groups}
    presence = np.mean([reading.present(c) for c in asked])
    coloured = reading.area.sum()
    purity = sum(reading.area[_COLOR_INDEX[c]] for c in asked) / coloured if coloured > 0 else 0.0
    return float(presence * purity)


def count_score(spec: SceneSpec, reading: ImageReading) -> float:
    asked: dict[str, int] = {}
    for g in spec.groups:
        asked[g.color] = asked.get(g.color, 0) + g.count
    scores = [max(0.0, 1 - abs(reading.objects[_COLOR_INDEX[c]] - n) / n) for c, n in asked.items()]
    return float(np.mean(scores))


def shape_score(spec: SceneSpec, reading: ImageReading) -> float:
    asked: dict[str, set[str]] = {}
    for g in spec.groups:
        asked.setdefault(g.color, set()).add(g.shape)
    scores = []
    for color, shapes in asked.items():
        objects = reading.objects[_COLOR_INDEX[color]]
        right = sum(reading.outlines[_COLOR_INDEX[color], _SHAPE_INDEX[shape]] for shape in shapes)
        scores.append(right / objects if objects > 0 else 0.0)
    return float(np.mean(scores))


def _ramp(offset: float, full: float) -> float:
    """0.5 at offset 0, 1 at offset ≥ full, 0 at offset ≤ −full."""
    return float(np.clip(0.5 + offset / (2 * full), 0.0, 1.0))


def position_score(spec: SceneSpec, reading: ImageReading) -> float:
    if spec.position is None and spec.relation is None:
        return 1.0
    if not all(reading.present(g.color) for g in spec.groups):
        return 0.0
    x, y = reading.centroid[_COLOR_INDEX[spec.groups[0].color]]
    if spec.position is not None:
        offset = {"left": 0.5 - x, "right": x - 0.5, "top": 0.5 - y, "bottom": y - 0.5}[spec.position]
        return _ramp(offset, POSITION_FULL)
    bx, by = reading.centroid[_COLOR_INDEX[spec.groups[1].color]]
    offset = {"above": by - y, "below": y - by, "left of": bx - x, "right of": x - bx}[spec.relation]
    return _ramp(offset, RELATION_FULL)


def geneval_score(spec: SceneSpec, reading: ImageReading) -> float:
    parts = [color_score(spec, reading), count_score(spec, reading)]
    if spec.position is not None or spec.relation is not None:
        parts.append(position_score(spec, reading))
    return float(np.mean(parts))


# ---------------------------------------------------------------------------------------------------------------
# Reward callables


def spec_of(prompt: str, metadata: dict[str, Any]) -> SceneSpec:
    """The scene a sample asks for: metadata["shapes"] if present, else the prompt parsed."""
    data = metadata.get("shapes") if metadata else None
    return SceneSpec.from_dict(data) if data is not None else parse_prompt(prompt)


def _make(
    score: Callable[[SceneSpec, ImageReading], float],
    min_area_fraction: float,
    chroma_threshold: float,
    outlines: bool = False,
):
    if not 0 < min_area_fraction < 1:
        raise UserError(f"shapes rewards: min_area_fraction must be in (0, 1), got {min_area_fraction}")
    if not 0 <= chroma_threshold <= 255:
        raise UserError(f"shapes rewards: chroma_threshold must be in [0, 255], got {chroma_threshold}")

    def reward(images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        specs = [spec_of(p, m) for p, m in zip(prompts, metadata)]
        readings = read_images(images, min_area_fraction, chroma_threshold, outlines)
        return np.array([score(s, r) for s, r in zip(specs, readings)], dtype=np.float32)

    return reward


@REWARDS.register("shapes_color")
def shapes_color(min_area_fraction: float = 0.005, chroma_threshold: float = 80.0) -> RewardFn:
    """ShapesWorld colour correctness in [0, 1]."""
    return _make(color_score, min_area_fraction, chroma_threshold)


@REWARDS.register("shapes_count")
def shapes_count(min_area_fraction: float = 0.005, chroma_threshold: float = 80.0) -> RewardFn:
    """ShapesWorld object-count correctness in [0, 1]."""
    return _make(count_score, min_area_fraction, chroma_threshold)


@REWARDS.register("shapes_position")
def shapes_position(min_area_fraction: float = 0.005, chroma_threshold: float = 80.0) -> RewardFn:
    """ShapesWorld position correctness in [0, 1] (1 for prompts without a position)."""
    return _make(position_score, min_area_fraction, chroma_threshold)


@REWARDS.register("shapes_shape")
def shapes_shape(min_area_fraction: float = 0.005, chroma_threshold: float = 80.0) -> RewardFn:
    """ShapesWorld outline correctness in [0, 1]: the share of each asked colour's objects drawn as an asked shape."""
    return _make(shape_score, min_area_fraction, chroma_threshold, outlines=True)


@REWARDS.register("shapes_geneval")
def shapes_geneval(
    min_area_fraction: float = 0.005, chroma_threshold: float = 80.0, shape_weight: float = 0.0
) -> RewardFn:
    """Mean of the ShapesWorld colour, count and (when asked) position scores; with `shape_weight` w > 0,
    (that mean + w · shapes_shape) / (1 + w): the outlines weighed in, still in [0, 1] (a group reward can wrap it)."""
    if not 0 <= shape_weight <= 100:
        raise UserError(f"shapes_geneval: shape_weight must be in [0, 100], got {shape_weight}")
    if shape_weight == 0:
        return _make(geneval_score, min_area_fraction, chroma_threshold)

    def with_outlines(spec: SceneSpec, reading: ImageReading) -> float:
        return (geneval_score(spec, reading) + shape_weight * shape_score(spec, reading)) / (1 + shape_weight)

    return _make(with_outlines, min_area_fraction, chroma_threshold, outlines=True)
