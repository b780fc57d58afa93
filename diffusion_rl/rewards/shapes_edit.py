"""`shapes_edit`: how well an image carries out a ShapesWorld edit (data/shapes_edits.py), read from its pixels.

The image is read as the other ShapesWorld rewards read it (rewards/shapes.py: a palette colour per saturated pixel,
each colour's area and centroid). With the scene the instruction asks for (`EditSpec.edited()`), the score is the
mean of:
- per object of that scene: its colour is present and its centroid lies where the object should be, 1 at the
  spot, falling linearly to 0 at `POSITION_TOLERANCE` of the image away (a moved object left in place scores 0:
  MOVE > POSITION_TOLERANCE);
- per colour that must be gone (the recoloured or removed object's): 1 − its area over half the object's area
  (0 once half the object is still there);
- purity: the share of coloured pixels that have a colour of that scene.
A drawn target scores about 1 (≥ 0.97 at 32 px); the unedited source at most 2/3, a black image at most 1/3 (it
does remove what must go). The spec comes from metadata["shapes_edit"] (the dataset row's).

`edit_region` is the part of the image the edit may change; `source_preservation` with `outside: shapes_edit`
(rewards/edit.py) scores only the rest, so that it never pulls the edited object back to the source.
"""

from __future__ import annotations

import numpy as np

from diffusion_rl.data.shapes import COLORS, draw_objects
from diffusion_rl.data.shapes_edits import EditSpec, PlacedShape
from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS, RewardFn
from diffusion_rl.rewards.shapes import ImageReading, read_images

POSITION_TOLERANCE = 0.25
_COLOR_INDEX = {name: k for k, name in enumerate(COLORS)}  # the readings' palette order


def shape_area(o: PlacedShape) -> float:
    """The drawn object's area as a fraction of the image (data/shapes.py draws these outlines)."""
    if o.shape == "circle":
        return float(np.pi * o.r**2)
    if o.shape == "square":
        return (1.8 * o.r) ** 2
    return 0.5 * (2.3 * o.r) * (1.8 * o.r)  # the triangle: base 2·1.15 r, height 1.8 r


def edit_score(spec: EditSpec, reading: ImageReading, pixels: int) -> float:
    """The score of one image's reading (`pixels` = its height × width) against the edit."""
    index = _COLOR_INDEX
    scene = spec.edited()
    terms = []
    for o in scene:
        if not reading.present(o.color):
            terms.append(0.0)
            continue
        x, y = reading.centroid[index[o.color]]
        terms.append(float(np.clip(1 - np.hypot(x - o.x, y - o.y) / POSITION_TOLERANCE, 0.0, 1.0)))
    for color in spec.gone_colors():
        area = reading.area[index[color]] / pixels
        terms.append(float(1 - min(1.0, area / (0.5 * shape_area(spec.objects[spec.target])))))
    coloured = reading.area.sum()
    wanted = sum(reading.area[index[o.color]] for o in scene)
    terms.append(float(wanted / coloured) if coloured > 0 else 0.0)
    return float(np.mean(terms))


def edit_region(spec: EditSpec, height: int, width: int) -> np.ndarray:
    """bool [height, width]: the pixels the edit may change — the named object where it is and where it goes (its
    drawn footprints, widened by 1/16 of the size for the anti-aliased edges). Everything else must stay."""
    if height != width:
        raise ValueError(f"ShapesWorld images are square, got {height}×{width}")
    named = [spec.objects[spec.target]]
    if spec.kind == "move":
        named.append(named[0].moved(spec.direction))
    drawn = draw_objects([(o.color, o.shape, o.x, o.y, o.r) for o in named], height).max(axis=-1) > 0
    reach = max(1, height // 16)
    region = drawn.copy()
    for dy in range(-reach, reach + 1):  # a square dilation: every pixel within `reach` of a drawn one
        for dx in range(-reach, reach + 1):
            region[max(dy, 0) : height + min(dy, 0), max(dx, 0) : width + min(dx, 0)] |= drawn[
                max(-dy, 0) : height + min(-dy, 0), max(-dx, 0) : width + min(-dx, 0)
            ]
    return region


def spec_of(metadata: dict) -> EditSpec:
    data = metadata.get("shapes_edit") if metadata else None
    if data is None:
        raise UserError("shapes_edit scores ShapesWorld edits: the sample's metadata has no 'shapes_edit' spec")
    return EditSpec.from_dict(data)


@REWARDS.register("shapes_edit")
def shapes_edit(min_area_fraction: float = 0.005, chroma_threshold: float = 80.0) -> RewardFn:
    """ShapesWorld edit correctness in [0, 1] (see the module docstring)."""
    if not 0 < min_area_fraction < 1 or not 0 <= chroma_threshold <= 255:
        raise UserError(
            f"shapes_edit: need min_area_fraction in (0, 1) and chroma_threshold in [0, 255], got "
            f"{min_area_fraction}, {chroma_threshold}"
        )

    def reward(images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        specs = [spec_of(m) for m in metadata]
        readings = read_images(images, min_area_fraction, chroma_threshold)
        pixels = images.shape[1] * images.shape[2]
        return np.array([edit_score(s, r, pixels) for s, r in zip(specs, readings)], dtype=np.float32)

    return reward
