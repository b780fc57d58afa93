"""GenEval's rules on detected objects: presence, count, colour and relative position (Ghosh et al. 2023).

A prompt's metadata is GenEval's (`evaluation_metadata.jsonl`):

    {"tag": "color_attr", "include": [{"class": "car", "count": 1, "color": "red"},
                                      {"class": "bench", "count": 1, "position": ["left of", 0]}],
     "exclude": [{"class": "car", "count": 2}]}

- every `include` clause must hold (AND): at least `count` detections of `class`; of its `count` most confident
  ones, at least `count` have `color` (when given); and (when `position` = [relation, i] is given) each of them
  stands in `relation` to every object matched by include clause i, which must have been satisfied itself;
- no `exclude` clause may hold (OR): `count` or more detections of `class` make the image wrong.

`relative_position(a, b)` is GenEval's: with box centres c and sizes d, the offset c_a − c_b is shrunk towards 0
by 0.1 · (d_a + d_b) on each axis and divided by the length of the unshrunk offset; "left of" when its x part is
below −0.5, "right of" above 0.5, "above" / "below" likewise for y (image y grows downwards); none when the
shrunk offset is 0 on both axes.

`evaluate` says whether the image is correct and how many clauses hold (the reward's partial credit), with
GenEval-style reasons. It knows nothing of detectors: the rules are tested on detections whose content is known.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diffusion_rl.errors import UserError

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
POSITION_THRESHOLD = 0.1
_CLAUSE_KEYS = {"class", "count", "color", "position"}


@dataclass(frozen=True)
class Detection:
    label: str  # the class it was detected as
    box: tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels
    score: float  # detector confidence
    color: str | None = None  # its colour (one of COLORS) when asked for


@dataclass(frozen=True)
class Clause:
    cls: str
    count: int
    color: str | None = None
    position: tuple[str, int] | None = None  # (relation, index of the include clause it is relative to)


@dataclass(frozen=True)
class GenEvalSpec:
    tag: str
    include: tuple[Clause, ...]
    exclude: tuple[Clause, ...] = ()

    @property
    def classes(self) -> list[str]:
        return list(dict.fromkeys(c.cls for c in self.include + self.exclude))

    @property
    def colored_classes(self) -> list[str]:
        return list(dict.fromkeys(c.cls for c in self.include if c.color is not None))


def _clause(data: Any, where: str, include: bool, index: int) -> Clause:
    if not isinstance(data, Mapping) or not isinstance(data.get("class"), str):
        raise UserError(f"GenEval metadata: {where} must be an object with a 'class' string, got {data!r}")
    unknown = sorted(set(data) - _CLAUSE_KEYS)
    if unknown:
        raise UserError(f"GenEval metadata: {where} has unknown keys {unknown}; known: class, count, color, position")
    count = data.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UserError(f"GenEval metadata: {where}.count must be an integer ≥ 1, got {count!r}")
    color = data.get("color")
    if color is not None and color not in COLORS:
        raise UserError(f"GenEval metadata: {where}.color {color!r} is not one of {', '.join(COLORS)}")
    position = data.get("position")
    if position is not None:
        ok = isinstance(position, Sequence) and len(position) == 2 and position[0] in RELATIONS
        if not ok or not isinstance(position[1], int) or not include or not 0 <= position[1] < index:
            raise UserError(
                f"GenEval metadata: {where}.position must be [relation, i] with relation one of {list(RELATIONS)} "
                f"and i an earlier include clause, got {position!r}"
            )
        position = (position[0], position[1])
    if not include and (color is not None or position is not None):
        raise UserError(f"GenEval metadata: {where}: an exclude clause has only class and count")
    return Clause(data["class"], count, color, position)


def parse_metadata(metadata: Mapping[str, Any]) -> GenEvalSpec:
    """The GenEvalSpec in a sample's metadata (GenEval's keys tag, include, exclude), or UserError saying why not."""
    include, exclude = metadata.get("include"), metadata.get("exclude", [])
    if not isinstance(include, list) or not include:
        raise UserError(
            "GenEval metadata needs 'include': a non-empty list of {class, count, color?, position?}; the row's "
            f"metadata has keys {sorted(metadata)}"
        )
    if not isinstance(exclude, list):
        raise UserError(f"GenEval metadata: 'exclude' must be a list, got {exclude!r}")
    clauses = tuple(_clause(c, f"include[{i}]", True, i) for i, c in enumerate(include))
    excluded = tuple(_clause(c, f"exclude[{i}]", False, i) for i, c in enumerate(exclude))
    return GenEvalSpec(str(metadata.get("tag", "")), clauses, excluded)


def relative_position(a: Detection, b: Detection) -> set[str]:
    """The relations of a to b (module docstring); empty when they overlap too much to tell."""
    (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = a.box, b.box
    offset = ((ax0 + ax1) / 2 - (bx0 + bx1) / 2, (ay0 + ay1) / 2 - (by0 + by1) / 2)
    sizes = ((ax1 - ax0) + (bx1 - bx0), (ay1 - ay0) + (by1 - by0))
    revised = [max(abs(o) - POSITION_THRESHOLD * s, 0.0) * (1 if o > 0 else -1 if o < 0 else 0)
               for o, s in zip(offset, sizes)]  # fmt: skip
    if all(abs(r) < 1e-3 for r in revised):
        return set()
    norm = (offset[0] ** 2 + offset[1] ** 2) ** 0.5
    dx, dy = revised[0] / norm, revised[1] / norm
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


@dataclass
class Verdict:
    correct: bool
    satisfied: int  # clauses that hold
    total: int  # include + exclude clauses
    reasons: list[str] = field(default_factory=list)
    count_credit: float = 0.0  # Σ n / count over the include clauses short of their count (n detections)

    @property
    def fraction(self) -> float:
        return self.satisfied / self.total

    @property
    def graded(self) -> float:
        """`fraction`, where an include clause short of its count earns n / count for its n detections of the class:
        1 − |n − count| / count, flow_grpo's reward server's count score, for the n < count that fail here (an
        extra object fails the exclude clause instead)."""
        return (self.satisfied + self.count_credit) / self.total


def evaluate(spec: GenEvalSpec, detections: Mapping[str, Sequence[Detection]]) -> Verdict:
    """GenEval's verdict on detections grouped by class, each list most confident first (module docstring)."""
    reasons: list[str] = []
    matched: list[Sequence[Detection] | None] = []
    satisfied, count_credit = 0, 0.0
    for clause in spec.include:
        found = list(detections.get(clause.cls, []))[: clause.count]
        ok = len(found) >= clause.count
        if not ok:
            reasons.append(f"expected {clause.cls}>={clause.count}, found {len(found)}")
            count_credit += len(found) / clause.count  # all of them: fewer than count
        if ok and clause.color is not None:
            colors = [d.color for d in found]
            if colors.count(clause.color) < clause.count:
                ok = False
                seen = ", ".join(f"{colors.count(c)} {c}" for c in COLORS if c in colors)
                reasons.append(f"expected {clause.color} {clause.cls}>={clause.count}, found {seen or 'no colour'}")
        if ok and clause.position is not None:
            relation, target = clause.position
            targets = matched[target]
            if targets is None:
                ok = False
                reasons.append(f"no target for {clause.cls} to be {relation}")
            else:
                for obj in found:
                    bad = next((t for t in targets if relation not in relative_position(obj, t)), None)
                    if bad is not None:
                        rels = " and ".join(sorted(relative_position(obj, bad))) or "no clear relation to the"
                        reasons.append(f"expected {clause.cls} {relation} target, found {rels} target")
                        ok = False
                        break
        matched.append(found if ok else None)
        satisfied += ok
    for clause in spec.exclude:
        present = len(detections.get(clause.cls, []))
        if present >= clause.count:
            reasons.append(f"expected {clause.cls}<{clause.count}, found {present}")
        else:
            satisfied += 1
    total = len(spec.include) + len(spec.exclude)
    return Verdict(satisfied == total, satisfied, total, reasons, count_credit)
