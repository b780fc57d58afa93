"""ShapesWorld: a synthetic text-to-image task generated on the fly, for measuring learning on a CPU.

A scene is one or two groups of coloured shapes on a black background, with an optional position:

    "a red circle"                           one object
    "a blue square on the left"              one object in a region (left, right, top, bottom)
    "two green triangles"                    a count (1-3) of one colour and shape
    "a red circle above a yellow square"     two objects of different colours in a relation
                                             (above, below, to the left of, to the right of)

`SceneSpec` is the parsed form (`parse_prompt` reads a prompt back into one; `SceneSpec.prompt` writes it);
`draw_scene` draws a matching image with PIL (drawn 4× larger and box-filtered down, so edges are smooth).
`ShapesWorld` holds the seeded train / held-out split of all prompts and yields (spec, image) pairs that depend
only on (seed, split, index). The rewards in `diffusion_rl.rewards.shapes` score images against a spec.

Positions are drawn with a margin: an object "on the left" has its centre at most `REGION` of the width from
the left edge; "A above B" puts A's centre at least `MIN_SEPARATION` of the height above B's. The rewards use
the same constants, so every drawn image scores 1.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from diffusion_rl.data.prompts import PromptRecord, write_prompts
from diffusion_rl.errors import UserError
from diffusion_rl.utils.seeding import seed_for

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (225, 35, 35),
    "green": (35, 190, 60),
    "blue": (45, 85, 235),
    "yellow": (235, 215, 35),
}
BACKGROUND = (0, 0, 0)
SHAPES = ("circle", "square", "triangle")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles"}
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
# absolute regions of a single object, and how each reads in a prompt
POSITIONS = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}
# relations between the first and the second object, and how each reads in a prompt
RELATIONS = {"above": "above", "below": "below", "left of": "to the left of", "right of": "to the right of"}
KINDS = ("single", "position", "count", "relation")

REGION = 0.35  # an object in a region has its centre within this fraction of the size from that edge
MIN_SEPARATION = 0.3  # centres of related objects are at least this fraction of the size apart along the axis
RADIUS = (0.09, 0.13)  # object half-size as a fraction of the image size
SUPERSAMPLE = 4
MIN_SIZE, MAX_SIZE = 16, 1024  # image side in px; 1024 is drawn on a 4096² canvas


@dataclass(frozen=True)
class ShapeGroup:
    color: str
    shape: str
    count: int = 1

    def __post_init__(self):
        if self.color not in COLORS:
            raise UserError(f"unknown ShapesWorld colour {self.color!r}; known: {', '.join(COLORS)}")
        if self.shape not in SHAPES:
            raise UserError(f"unknown ShapesWorld shape {self.shape!r}; known: {', '.join(SHAPES)}")
        if self.count not in COUNT_WORDS:
            raise UserError(f"ShapesWorld counts are 1-3, got {self.count}")

    def words(self) -> str:
        noun = self.shape if self.count == 1 else PLURALS[self.shape]
        return f"{COUNT_WORDS[self.count]} {self.color} {noun}"


@dataclass(frozen=True)
class SceneSpec:
    """What a prompt asks for: groups of shapes, plus either a region for the only object or a relation."""

    groups: tuple[ShapeGroup, ...]
    position: str | None = None  # region of groups[0] (a single object): one of POSITIONS
    relation: str | None = None  # groups[0] RELATION groups[1] (single objects of two colours): one of RELATIONS

    def __post_init__(self):
        if not 1 <= len(self.groups) <= 2:
            raise UserError(f"a ShapesWorld scene has 1 or 2 groups of shapes, got {len(self.groups)}")
        if self.position is not None and self.position not in POSITIONS:
            raise UserError(f"unknown ShapesWorld position {self.position!r}; known: {', '.join(POSITIONS)}")
        if self.relation is not None and self.relation not in RELATIONS:
            raise UserError(f"unknown ShapesWorld relation {self.relation!r}; known: {', '.join(RELATIONS)}")
        if self.position is not None and (len(self.groups) != 1 or self.groups[0].count != 1):
            raise UserError("a ShapesWorld position applies to a scene of exactly one object")
        if len(self.groups) == 2:
            a, b = self.groups
            if self.relation is None or a.count != 1 or b.count != 1:
                raise UserError("two ShapesWorld groups need a relation between two single objects")
            if a.color == b.color:
                raise UserError(
                    f"the two objects of a ShapesWorld relation need different colours (got {a.color} twice), "
                    "so that a reward can tell them apart"
                )
        elif self.relation is not None:
            raise UserError("a ShapesWorld relation needs two objects")

    @property
    def kind(self) -> str:
        if self.relation is not None:
            return "relation"
        if self.position is not None:
            return "position"
        return "count" if self.groups[0].count > 1 else "single"

    def prompt(self) -> str:
        first = self.groups[0].words()
        if self.relation is not None:
            return f"{first} {RELATIONS[self.relation]} {self.groups[1].words()}"
        if self.position is not None:
            return f"{first} {POSITIONS[self.position]}"
        return first

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": [{"color": g.color, "shape": g.shape, "count": g.count} for g in self.groups],
            "position": self.position,
            "relation": self.relation,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SceneSpec:
        try:
            groups = tuple(ShapeGroup(g["color"], g["shape"], int(g["count"])) for g in data["groups"])
            return cls(groups, data.get("position"), data.get("relation"))
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"not a ShapesWorld scene spec: {data!r} ({e!r})") from None


# ---------------------------------------------------------------------------------------------------------------
# Prompts: enumerate, parse, split

_WORD_COUNTS = {word: n for n, word in COUNT_WORDS.items()} | {"an": 1, "one": 1}
_SHAPE_WORDS = {s: s for s in SHAPES} | {p: s for s, p in PLURALS.items()}
_GROUP = r"(a|an|one|two|three) (\w+) (\w+)"
_PHRASES = "|".join(re.escape(p) for p in list(POSITIONS.values()) + list(RELATIONS.values()))
_PROMPT_RE = re.compile(rf"^{_GROUP}(?: ({_PHRASES})(?: {_GROUP})?)?$")


def _group(count: str, color: str, shape: str, prompt: str) -> ShapeGroup:
    if shape not in _SHAPE_WORDS:
        raise UserError(f"ShapesWorld prompt {prompt!r}: unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    n = _WORD_COUNTS[count]
    plural = shape in PLURALS.values()
    if plural != (n > 1):
        raise UserError(f"ShapesWorld prompt {prompt!r}: '{count} {shape}' mixes singular and plural")
    return ShapeGroup(color, _SHAPE_WORDS[shape], n)


def parse_prompt(prompt: str) -> SceneSpec:
    """The SceneSpec a ShapesWorld prompt asks for; a UserError for text outside the grammar."""
    text = " ".join(prompt.lower().strip().rstrip(".").split())
    match = _PROMPT_RE.match(text)
    if match is None:
        raise UserError(
            f"{prompt!r} is not a ShapesWorld prompt; expected e.g. 'a red circle', 'two blue squares', "
            "'a green triangle on the left' or 'a red circle above a yellow square'"
        )
    count, color, shape, phrase, count2, color2, shape2 = match.groups()
    first = _group(count, color, shape, prompt)
    if phrase is None:
        return SceneSpec((first,))
    positions = {v: k for k, v in POSITIONS.items()}
    relations = {v: k for k, v in RELATIONS.items()}
    if phrase in positions and count2 is None:
        return SceneSpec((first,), position=positions[phrase])
    if phrase in relations and count2 is not None:
        return SceneSpec((first, _group(count2, color2, shape2, prompt)), relation=relations[phrase])
    raise UserError(
        f"ShapesWorld prompt {prompt!r}: '{phrase}' needs {'no' if phrase in positions else 'a'} second object"
    )


def all_specs() -> list[SceneSpec]:
    """Every prompt of the grammar, in a fixed order (516 scenes)."""
    singles = [ShapeGroup(c, s) for c in COLORS for s in SHAPES]
    specs = [SceneSpec((g,)) for g in singles]
    specs += [SceneSpec((g,), position=p) for g in singles for p in POSITIONS]
    specs += [SceneSpec((ShapeGroup(g.color, g.shape, n),)) for g in singles for n in (2, 3)]
    specs += [SceneSpec((a, b), relation=r) for a in singles for b in singles if a.color != b.color for r in RELATIONS]
    return specs


def split_specs(seed: int, heldout_fraction: float) -> tuple[list[SceneSpec], list[SceneSpec]]:
    """(train, held-out): within each kind, the held-out share is the prompts with the smallest seeded hashes."""
    if not 0 <= heldout_fraction < 1:
        raise UserError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    train, heldout = [], []
    for kind in KINDS:
        specs = sorted(
            (s for s in all_specs() if s.kind == kind), key=lambda s: seed_for(seed, "shapes_split", s.prompt())
        )
        n_heldout = round(heldout_fraction * len(specs))
        heldout += specs[:n_heldout]
        train += specs[n_heldout:]
    return train, heldout


# ---------------------------------------------------------------------------------------------------------------
# Drawing


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, color) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif shape == "square":
        side = r * 0.9  # a square of the same area share as the circle looks the same size
        draw.rectangle([cx - side, cy - side, cx + side, cy + side], fill=color)
    else:  # an upward triangle whose centroid is (cx, cy): apex 2/3 of its height above, base 1/3 below
        half_width = r * 1.15
        draw.polygon([(cx, cy - 1.2 * r), (cx + half_width, cy + 0.6 * r), (cx - half_width, cy + 0.6 * r)], fill=color)


def _centre_ranges(spec: SceneSpec, index: int, r: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """Allowed (x, y) ranges of object `index`'s centre, as fractions of the size, before relation checks."""
    lo, hi = r, 1 - r
    x, y = (lo, hi), (lo, hi)
    if spec.position == "left":
        x = (lo, REGION)
    elif spec.position == "right":
        x = (1 - REGION, hi)
    elif spec.position == "top":
        y = (lo, REGION)
    elif spec.position == "bottom":
        y = (1 - REGION, hi)
    return x, y


def _relation_holds(relation: str, a: tuple[float, float], b: tuple[float, float]) -> bool:
    dx, dy = b[0] - a[0], b[1] - a[1]  # image y grows downwards
    along = {"above": dy, "below": -dy, "left of": dx, "right of": -dx}[relation]
    across = abs(dx) if relation in ("above", "below") else abs(dy)
    return along >= MIN_SEPARATION and across <= along  # clearly more along the asked axis than across it


def layout(spec: SceneSpec, rng: np.random.Generator) -> list[tuple[ShapeGroup, float, float, float]]:
    """(group, cx, cy, r) of every object as fractions of the size; objects never touch.

    r is the radius of a circle; a square's corners and a triangle's apex reach up to 1.3 r from the centre.
    """
    objects = [g for g in spec.groups for _ in range(g.count)]
    for _ in range(1000):  # rejection sampling; a valid layout is found within a few tries
        placed = []
        for i, group in enumerate(objects):
            r = float(rng.uniform(*RADIUS))
            (x0, x1), (y0, y1) = _centre_ranges(spec, i, r)
            placed.append((group, float(rng.uniform(x0, x1)), float(rng.uniform(y0, y1)), r))
        apart = all(
            np.hypot(a[1] - b[1], a[2] - b[2]) > 1.3 * (a[3] + b[3]) + 0.04  # 1.3 r: square corners, apexes
            for k, a in enumerate(placed)
            for b in placed[k + 1 :]
        )
        if apart and (spec.relation is None or _relation_holds(spec.relation, placed[0][1:3], placed[1][1:3])):
            return placed
    raise RuntimeError(f"no layout found for {spec.prompt()!r}")  # pragma: no cover - the ranges always allow one


def draw_scene(spec: SceneSpec, size: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [size, size, 3]: the scene drawn on a black background, objects laid out by `rng`."""
    return draw_objects([(group.color, group.shape, cx, cy, r) for group, cx, cy, r in layout(spec, rng)], size)


def check_size(size: int) -> None:
    """ShapesWorld images are MIN_SIZE…MAX_SIZE px a side (drawn SUPERSAMPLE× larger first)."""
    if not MIN_SIZE <= size <= MAX_SIZE:
        raise UserError(f"ShapesWorld images need a size in [{MIN_SIZE}, {MAX_SIZE}] px, got {size}")


def draw_objects(objects: Sequence[tuple[str, str, float, float, float]], size: int) -> np.ndarray:
    """uint8 [size, size, 3]: objects (colour, shape, cx, cy, r; fractions of the size) on a black background."""
    check_size(size)
    big = size * SUPERSAMPLE
    canvas = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for color, shape, cx, cy, r in objects:
        _draw_shape(draw, shape, cx * big, cy * big, r * big, COLORS[color])
    return np.asarray(canvas.resize((size, size), Image.Resampling.BOX))


# ---------------------------------------------------------------------------------------------------------------
# The dataset


class ShapesWorld:
    """The seeded prompt split and an endless stream of (spec, image) pairs per split.

    Sample `index` of a split picks a kind uniformly (so relations, 84 % of all prompts, do not crowd out the
    rest), then a prompt of that kind, then a layout; all three come from (seed, stream, split, index) alone.
    """

    def __init__(self, size: int = 32, seed: int = 0, heldout_fraction: float = 0.15):
        self.size, self.seed = size, seed
        self.train, self.heldout = split_specs(seed, heldout_fraction)
        self._by_kind = {
            split: {k: [s for s in specs if s.kind == k] for k in KINDS}
            for split, specs in (("train", self.train), ("heldout", self.heldout))
        }

    def specs(self, split: str) -> list[SceneSpec]:
        if split not in self._by_kind:
            raise UserError(f"unknown ShapesWorld split {split!r}; known: train, heldout")
        return self.train if split == "train" else self.heldout

    def sample(self, index: int, split: str = "train", stream: str = "") -> tuple[SceneSpec, np.ndarray]:
        """Sample `index` of a split; `stream` names an independent sequence (e.g. one per use and run seed)."""
        self.specs(split)
        rng = np.random.default_rng(seed_for(self.seed, "shapes_sample", stream, split, index))
        kinds = [k for k in KINDS if self._by_kind[split][k]]
        pool = self._by_kind[split][kinds[rng.integers(len(kinds))]]
        spec = pool[rng.integers(len(pool))]
        return spec, draw_scene(spec, self.size, rng)

    def batch(
        self, indices: Sequence[int], split: str = "train", stream: str = ""
    ) -> tuple[list[SceneSpec], np.ndarray]:
        """Specs and uint8 images [B, size, size, 3] of the given sample indices."""
        pairs = [self.sample(i, split, stream) for i in indices]
        return [s for s, _ in pairs], np.stack([im for _, im in pairs])


def prompt_records(specs: Sequence[SceneSpec]) -> list[PromptRecord]:
    """Prompt records whose metadata carries the parsed spec (key "shapes"), as the shapes rewards read it."""
    return [PromptRecord(s.prompt(), data_source="shapes", metadata={"shapes": s.to_dict()}) for s in specs]


def spread_subset(specs: Sequence[SceneSpec], n: int) -> list[SceneSpec]:
    """Up to n specs taken round-robin over the kinds (in each kind's order), so every kind is represented."""
    by_kind = [[s for s in specs if s.kind == k] for k in KINDS]
    out: list[SceneSpec] = []
    for i in range(max((len(b) for b in by_kind), default=0)):
        out += [b[i] for b in by_kind if i < len(b)]
    return out[:n]


def write_prompt_files(
    directory: str | Path, seed: int = 0, heldout_fraction: float = 0.15, val_size: int = 32
) -> dict[str, Path]:
    """train.jsonl, heldout.jsonl and val.jsonl (a kind-balanced subset of held-out) under `directory`."""
    train, heldout = split_specs(seed, heldout_fraction)
    directory = Path(directory)
    files = {"train": train, "heldout": heldout, "val": spread_subset(heldout, val_size)}
    paths = {}
    for name, specs in files.items():
        paths[name] = directory / f"{name}.jsonl"
        write_prompts(prompt_records(specs), paths[name])
    return paths
