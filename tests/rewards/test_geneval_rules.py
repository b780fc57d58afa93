"""GenEval's rules on detections whose content is known: ShapesWorld layouts turned into detections."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from diffusion_rl.data.shapes import SceneSpec, ShapeGroup, all_specs, layout
from diffusion_rl.errors import UserError
from diffusion_rl.rewards.geneval.rules import Detection, evaluate, parse_metadata, relative_position
from diffusion_rl.rewards.geneval.shapes import scene_metadata

SIZE = 64


def _box(shape: str, cx: float, cy: float, r: float) -> tuple[float, float, float, float]:
    """The drawn shape's bounding box in pixels (data/shapes.py: circle radius r, square half-side 0.9 r, triangle
    apex 1.2 r above the centre, base 0.6 r below, half-width 1.15 r)."""
    if shape == "circle":
        x0, y0, x1, y1 = cx - r, cy - r, cx + r, cy + r
    elif shape == "square":
        x0, y0, x1, y1 = cx - 0.9 * r, cy - 0.9 * r, cx + 0.9 * r, cy + 0.9 * r
    else:
        x0, y0, x1, y1 = cx - 1.15 * r, cy - 1.2 * r, cx + 1.15 * r, cy + 0.6 * r
    return (x0 * SIZE, y0 * SIZE, x1 * SIZE, y1 * SIZE)


def detections_of(spec: SceneSpec, seed: int) -> dict[str, list[Detection]]:
    """What a perfect detector reports for the scene drawn with `seed`, keyed as scene_metadata names classes."""
    metadata = scene_metadata(spec)
    names = {c["class"] for c in metadata["include"]}
    found: dict[str, list[Detection]] = {}
    for rank, (group, cx, cy, r) in enumerate(layout(spec, np.random.default_rng(seed))):
        name = f"{group.color} {group.shape}" if f"{group.color} {group.shape}" in names else group.shape
        found.setdefault(name, []).append(Detection(name, _box(group.shape, cx, cy, r), 0.9 - 0.01 * rank, group.color))
    return found


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_drawn_shapesworld_scene_is_correct(seed):
    for spec in all_specs():
        verdict = evaluate(parse_metadata(scene_metadata(spec)), detections_of(spec, seed))
        assert verdict.correct and verdict.fraction == 1.0, (spec.prompt(), verdict.reasons)


def test_a_missing_object_fails_its_count():
    spec = SceneSpec((ShapeGroup("red", "circle", 3),))
    found = detections_of(spec, 0)
    found["circle"] = found["circle"][:2]
    verdict = evaluate(parse_metadata(scene_metadata(spec)), found)
    assert not verdict.correct and verdict.reasons == ["expected circle>=3, found 2"]
    assert (verdict.satisfied, verdict.total) == (1, 2)  # the exclude clause (no 4th circle) still holds


def test_an_extra_object_fails_the_exclude_clause():
    spec = SceneSpec((ShapeGroup("blue", "square", 2),))
    found = detections_of(spec, 0)
    found["square"].append(Detection("square", (0, 0, 5, 5), 0.5, "blue"))
    verdict = evaluate(parse_metadata(scene_metadata(spec)), found)
    assert verdict.reasons == ["expected square<3, found 3"] and verdict.fraction == 0.5


def test_a_wrong_colour_fails_and_names_what_was_seen():
    spec = SceneSpec((ShapeGroup("green", "triangle", 2),))
    found = detections_of(spec, 0)
    found["triangle"][1] = dataclasses.replace(found["triangle"][1], color="yellow")
    verdict = evaluate(parse_metadata(scene_metadata(spec)), found)
    assert verdict.reasons == ["expected green triangle>=2, found 1 yellow, 1 green"]


@pytest.mark.parametrize("relation", ["above", "below", "left of", "right of"])
def test_mirrored_relations_fail(relation):
    spec = SceneSpec((ShapeGroup("red", "circle"), ShapeGroup("blue", "square")), relation=relation)
    found = detections_of(spec, 3)
    mirrored = {}
    for name, dets in found.items():  # flip the image: left <-> right and top <-> bottom
        mirrored[name] = [dataclasses.replace(d, box=(SIZE - d.box[2], SIZE - d.box[3], SIZE - d.box[0],
                                                      SIZE - d.box[1])) for d in dets]  # fmt: skip
    verdict = evaluate(parse_metadata(scene_metadata(spec)), mirrored)
    assert not verdict.correct and verdict.reasons[0].startswith(f"expected circle {relation} target, found ")
    assert verdict.satisfied == 1  # the target (the square) is still there


def test_a_relation_to_an_absent_target_fails_both_clauses():
    spec = SceneSpec((ShapeGroup("red", "circle"), ShapeGroup("blue", "square")), relation="above")
    found = detections_of(spec, 0)
    del found["square"]
    verdict = evaluate(parse_metadata(scene_metadata(spec)), found)
    assert verdict.reasons == ["expected square>=1, found 0", "no target for circle to be above"]


def test_relative_position_by_hand():
    # a: centre (10, 50), size 10 × 10; b: centre (50, 50), size 20 × 20. Offset (−40, 0), shrunk by 0.1 · (10 + 20)
    # = 3 -> (−37, 0); divided by |offset| = 40: dx = −0.925 < −0.5 -> "left of"
    a, b = Detection("a", (5, 45, 15, 55), 1), Detection("b", (40, 40, 60, 60), 1)
    assert relative_position(a, b) == {"left of"} and relative_position(b, a) == {"right of"}
    # diagonal: offset (30, 30), sizes 20 + 20 -> shrunk by 4 -> (26, 26) / 42.43 = 0.61 each: both relations
    c, d = Detection("c", (40, 40, 60, 60), 1), Detection("d", (10, 10, 30, 30), 1)
    assert relative_position(c, d) == {"right of", "below"}
    # nearly on top of each other: the shrunk offset is 0, no relation
    e, f = Detection("e", (10, 10, 30, 30), 1), Detection("f", (11, 11, 31, 31), 1)
    assert relative_position(e, f) == set()


def test_geneval_metadata_as_the_benchmark_writes_it():
    row = {"tag": "position", "include": [{"class": "bench", "count": 1}, {"class": "car", "count": 1,
           "position": ["left of", 0]}], "prompt": "a photo of a car left of a bench"}  # fmt: skip
    spec = parse_metadata(row)
    assert spec.include[1].position == ("left of", 0) and spec.classes == ["bench", "car"]
    for bad, message in [
        ({"include": []}, "non-empty list"),
        ({"include": [{"class": "car", "count": 0}]}, "count must be an integer ≥ 1"),
        ({"include": [{"class": "car", "color": "teal"}]}, "'teal' is not one of red"),
        ({"include": [{"class": "car", "position": ["left of", 0]}]}, "an earlier include clause"),
        ({"include": [{"class": "car"}], "exclude": [{"class": "car", "color": "red"}]}, "only class and count"),
        ({"include": [{"class": "car", "size": 3}]}, "unknown keys \\['size'\\]"),
    ]:
        with pytest.raises(UserError, match=message):
            parse_metadata(bad)


def test_count_credit_grades_a_clause_short_of_its_count():
    # "three red circles": the include clause and the exclude clause (no 4th circle); n circles found, all red
    spec = SceneSpec((ShapeGroup("red", "circle", 3),))
    metadata = parse_metadata(scene_metadata(spec))
    for n, graded in ((0, (0 + 1) / 2), (1, (1 / 3 + 1) / 2), (2, (2 / 3 + 1) / 2), (3, 1.0)):
        found = detections_of(spec, 0)
        found["circle"] = found["circle"][:n]
        verdict = evaluate(metadata, found)
        assert verdict.graded == pytest.approx(graded), n
        assert verdict.fraction == (1.0 if n == 3 else 0.5)  # without count credit a near miss scores as a blank


def test_strict_and_count_credit_are_refused_together_before_the_detector_loads(tmp_path):
    from diffusion_rl.rewards.geneval import GenEvalReward

    with pytest.raises(UserError, match="strict .* and count_credit .* exclude each other"):
        GenEvalReward(str(tmp_path / "no_detector_here"), strict=True, count_credit=True)
