"""ShapesWorld edits: an instruction, a source image ShapesWorld draws, and what the edited image must show.

A source scene holds one or two objects of different shapes and different colours (so the instruction can name an
object by its shape and a reward can find it by its colour). The edits:

    "make the circle blue"     recolor: the circle turns blue; everything else stays
    "remove the square"        remove: the square goes; the other object stays (two-object scenes only)
    "move the triangle left"   move: the triangle moves MOVE of the image width (or height) that way

`EditSpec` is the source's objects (`PlacedShape`: colour, shape, centre and radius as fractions of the size) and
the edit; `edited()` is the scene the instruction asks for. `draw_source` / `draw_target` draw either one,
`random_edit` makes one from a seeded generator, and `write_edit_files` writes a dataset: images/NNNN.png (the
sources) and train.jsonl / val.jsonl rows {"prompt": instruction, "images": [source], "metadata": {"shapes_edit":
spec}}, which `diffusion-rl train` reads as an edit dataset and the `shapes_edit` reward scores
(rewards/shapes_edit.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from diffusion_rl.data.shapes import COLORS, RADIUS, SHAPES, check_size, draw_objects
from diffusion_rl.errors import UserError

EDIT_KINDS = ("recolor", "remove", "move")
DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
MOVE = 0.3  # how far a "move" instruction moves its object, as a fraction of the image size
GAP = 0.04  # objects never touch: centres at least 1.3·(r₁ + r₂) + GAP apart (1.3 r: square corners, apexes)
DATA_SOURCE = "shapes_edit"


@dataclass(frozen=True)
class PlacedShape:
    color: str
    shape: str
    x: float  # centre, fraction of the width
    y: float  # centre, fraction of the height (down)
    r: float  # radius, fraction of the size

    def __post_init__(self):
        if self.color not in COLORS or self.shape not in SHAPES:
            raise UserError(f"not a ShapesWorld object: {self.color} {self.shape}")

    def moved(self, direction: str) -> PlacedShape:
        dx, dy = DIRECTIONS[direction]
        return PlacedShape(self.color, self.shape, self.x + MOVE * dx, self.y + MOVE * dy, self.r)


@dataclass(frozen=True)
class EditSpec:
    kind: str  # recolor, remove or move
    objects: tuple[PlacedShape, ...]  # the source scene
    target: int  # the object the instruction names
    color: str | None = None  # recolor: its new colour
    direction: str | None = None  # move: left, right, up or down

    def __post_init__(self):
        if self.kind not in EDIT_KINDS:
            raise UserError(f"unknown ShapesWorld edit {self.kind!r}; known: {', '.join(EDIT_KINDS)}")
        if not 0 <= self.target < len(self.objects) <= 2:
            raise UserError(f"a ShapesWorld edit names one of 1-2 objects, got target {self.target} of {self.objects}")
        if len({o.color for o in self.objects}) < len(self.objects) or len({o.shape for o in self.objects}) < len(
            self.objects
        ):
            raise UserError("the objects of a ShapesWorld edit need different colours and different shapes")
        taken = {o.color for o in self.objects}
        if self.kind == "recolor" and (self.color not in COLORS or self.color in taken):
            raise UserError(f"recolor needs a new colour not in the scene, got {self.color!r}")
        if self.kind == "remove" and len(self.objects) != 2:
            raise UserError("remove needs a two-object scene (an empty result says nothing)")
        if self.kind == "move" and self.direction not in DIRECTIONS:
            raise UserError(f"move needs a direction ({', '.join(DIRECTIONS)}), got {self.direction!r}")

    def instruction(self) -> str:
        shape = self.objects[self.target].shape
        if self.kind == "recolor":
            return f"make the {shape} {self.color}"
        if self.kind == "remove":
            return f"remove the {shape}"
        return f"move the {shape} {self.direction}"

    def edited(self) -> tuple[PlacedShape, ...]:
        """The scene the instruction asks for."""
        out = []
        for i, o in enumerate(self.objects):
            if i != self.target:
                out.append(o)
            elif self.kind == "recolor":
                out.append(PlacedShape(self.color, o.shape, o.x, o.y, o.r))
            elif self.kind == "move":
                out.append(o.moved(self.direction))
        return tuple(out)

    def gone_colors(self) -> list[str]:
        """Colours the result must not show: the recoloured or removed object's."""
        return [self.objects[self.target].color] if self.kind in ("recolor", "remove") else []

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "objects": [asdict(o) for o in self.objects], "target": self.target,
                "color": self.color, "direction": self.direction}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EditSpec:
        try:
            objects = tuple(PlacedShape(**o) for o in data["objects"])
            return cls(data["kind"], objects, int(data["target"]), data.get("color"), data.get("direction"))
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"not a ShapesWorld edit spec: {data!r:.200} ({e!r})") from None


def _inside(o: PlacedShape) -> bool:
    reach = 1.3 * o.r  # a square's corners and a triangle's apex reach this far from the centre
    return reach <= o.x <= 1 - reach and reach <= o.y <= 1 - reach


def _apart(a: PlacedShape, b: PlacedShape) -> bool:
    return float(np.hypot(a.x - b.x, a.y - b.y)) > 1.3 * (a.r + b.r) + GAP


def random_edit(rng: np.random.Generator, kind: str) -> EditSpec:
    """An edit of `kind` on a random scene (two objects for remove, one or two otherwise), drawn from `rng`."""
    if kind not in EDIT_KINDS:
        raise UserError(f"unknown ShapesWorld edit {kind!r}; known: {', '.join(EDIT_KINDS)}")
    count = 2 if kind == "remove" else int(rng.integers(1, 3))
    colors = [str(c) for c in rng.permutation(list(COLORS))]
    shapes = [str(s) for s in rng.permutation(list(SHAPES))]
    direction = str(rng.choice(list(DIRECTIONS))) if kind == "move" else None
    for _ in range(1000):  # rejection sampling; a valid scene is found within a few tries
        objects = tuple(
            PlacedShape(colors[i], shapes[i], float(rng.uniform(0.15, 0.85)), float(rng.uniform(0.15, 0.85)),
                        float(rng.uniform(*RADIUS)))
            for i in range(count)
        )  # fmt: skip
        spec = EditSpec(kind, objects, 0, colors[count] if kind == "recolor" else None, direction)
        scenes = (objects, spec.edited())
        if all(_inside(o) for scene in scenes for o in scene) and all(
            _apart(a, b) for scene in scenes for i, a in enumerate(scene) for b in scene[i + 1 :]
        ):
            return spec
    raise RuntimeError(f"no layout found for a {kind} edit")  # pragma: no cover - the ranges always allow one


def draw_source(spec: EditSpec, size: int) -> np.ndarray:
    """uint8 [size, size, 3]: the scene before the edit."""
    return draw_objects([(o.color, o.shape, o.x, o.y, o.r) for o in spec.objects], size)


def draw_target(spec: EditSpec, size: int) -> np.ndarray:
    """uint8 [size, size, 3]: the scene the instruction asks for."""
    return draw_objects([(o.color, o.shape, o.x, o.y, o.r) for o in spec.edited()], size)


def write_edit_files(directory: str | Path, size: int = 32, train: int = 48, val: int = 6, seed: int = 0) -> dict:
    """train.jsonl, val.jsonl and images/NNNN.png (the sources) of `train` + `val` edits under `directory`, the
    kinds in turn; the same files for the same arguments. Returns {"train": path, "val": path}."""
    import json

    if train < 1 or val < 0:
        raise UserError(f"write_edit_files: need train ≥ 1 and val ≥ 0, got {train} and {val}")
    check_size(size)  # before any file is written
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(train + val):
        spec = random_edit(rng, EDIT_KINDS[i % len(EDIT_KINDS)])
        name = f"images/{i:04d}.png"
        Image.fromarray(draw_source(spec, size)).save(directory / name)
        rows.append({"prompt": spec.instruction(), "images": [name], "data_source": DATA_SOURCE,
                     "metadata": {"shapes_edit": spec.to_dict()}})  # fmt: skip
    paths = {}
    for split, part in (("train", rows[:train]), ("val", rows[train:])):
        if part:
            paths[split] = directory / f"{split}.jsonl"
            paths[split].write_text("".join(json.dumps(row) + "\n" for row in part), encoding="utf-8")
    return paths
