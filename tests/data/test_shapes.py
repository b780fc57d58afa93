import numpy as np
import pytest

from diffusion_rl.data.prompts import load_prompts
from diffusion_rl.data.shapes import (
    COLORS,
    KINDS,
    SceneSpec,
    ShapeGroup,
    ShapesWorld,
    all_specs,
    draw_scene,
    parse_prompt,
    split_specs,
    spread_subset,
    write_prompt_files,
)
from diffusion_rl.errors import UserError


def test_every_prompt_of_the_grammar_parses_back_to_its_spec():
    specs = all_specs()
    # 12 single objects, 48 with a region, 24 with a count of 2 or 3, 12 × 9 × 4 pairs of colours in a relation
    assert len(specs) == 12 + 48 + 24 + 432
    assert len({s.prompt() for s in specs}) == len(specs)
    for spec in specs:
        assert parse_prompt(spec.prompt()) == spec


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("a red circle on the left", SceneSpec((ShapeGroup("red", "circle"),), position="left")),
        ("two blue squares", SceneSpec((ShapeGroup("blue", "square", 2),))),
        (
            "a green triangle above a yellow circle",
            SceneSpec((ShapeGroup("green", "triangle"), ShapeGroup("yellow", "circle")), relation="above"),
        ),
        (
            "  A Red  Square to the right of a blue circle. ",
            SceneSpec((ShapeGroup("red", "square"), ShapeGroup("blue", "circle")), relation="right of"),
        ),
    ],
)
def test_parse_prompt_reads_colours_shapes_counts_and_positions(prompt, expected):
    assert parse_prompt(prompt) == expected


@pytest.mark.parametrize(
    "prompt",
    [
        "a photo of a cat",
        "a purple circle",
        "a red hexagon",
        "two red circle",  # plural mismatch
        "a red circles",
        "a red circle above a red square",  # a relation needs two colours
        "a red circle on the left of",
        "two red circles on the left",  # a region is for a single object
    ],
)
def test_parse_prompt_rejects_text_outside_the_grammar(prompt):
    with pytest.raises(UserError):
        parse_prompt(prompt)


def test_split_is_seeded_disjoint_complete_and_has_every_kind():
    train, heldout = split_specs(seed=0, heldout_fraction=0.15)
    assert set(train).isdisjoint(heldout)
    assert set(train) | set(heldout) == set(all_specs())
    assert {s.kind for s in heldout} == set(KINDS)
    assert split_specs(0, 0.15) == (train, heldout)
    assert split_specs(1, 0.15)[1] != heldout
    assert len(heldout) == round(0.15 * 12) + round(0.15 * 48) + round(0.15 * 24) + round(0.15 * 432)


def test_same_seed_and_index_give_the_same_sample_in_any_batch():
    world = ShapesWorld(size=32, seed=3)
    specs, images = world.batch(range(8))
    spec5, image5 = ShapesWorld(size=32, seed=3).sample(5)
    assert spec5 == specs[5]
    np.testing.assert_array_equal(image5, images[5])
    assert not np.array_equal(images[0], images[1])
    other_stream = world.batch(range(8), stream="other")[1]
    assert not np.array_equal(other_stream, images)
    assert not np.array_equal(ShapesWorld(size=32, seed=4).batch(range(8))[1], images)


def test_samples_of_each_split_use_only_that_splits_prompts():
    world = ShapesWorld(size=32, seed=0)
    train_specs, _ = world.batch(range(200), "train")
    heldout_specs, _ = world.batch(range(50), "heldout")
    assert set(train_specs) <= set(world.train)
    assert set(heldout_specs) <= set(world.heldout)
    assert {s.kind for s in train_specs} == set(KINDS)  # kinds are drawn uniformly, not by their prompt counts


@pytest.mark.parametrize("size", [32, 48, 64])
def test_drawn_image_has_the_asked_colours_on_a_black_background(size):
    spec = parse_prompt("three yellow triangles")
    image = draw_scene(spec, size, np.random.default_rng(0))
    assert image.shape == (size, size, 3) and image.dtype == np.uint8
    pixels = image.reshape(-1, 3)
    assert (pixels == 0).all(axis=1).mean() > 0.6  # mostly background
    exact = {name: (pixels == color).all(axis=1).sum() for name, color in COLORS.items()}
    assert exact["yellow"] > 0 and all(n == 0 for name, n in exact.items() if name != "yellow")


def test_region_and_relation_layouts_hold_their_positions():
    rng = np.random.default_rng(0)
    for _ in range(20):
        image = draw_scene(parse_prompt("a blue square on the left"), 64, rng)
        xs = np.nonzero((image == COLORS["blue"]).all(axis=-1))[1]
        assert (xs + 0.5).mean() / 64 <= 0.36
        image = draw_scene(parse_prompt("a red circle above a green square"), 64, rng)
        red_y = np.nonzero((image == COLORS["red"]).all(axis=-1))[0].mean()
        green_y = np.nonzero((image == COLORS["green"]).all(axis=-1))[0].mean()
        assert green_y - red_y >= 0.29 * 64


def test_spread_subset_takes_kinds_in_turn():
    _, heldout = split_specs(0, 0.15)
    subset = spread_subset(heldout, 8)
    assert [s.kind for s in subset] == list(KINDS) * 2


def test_prompt_files_carry_the_spec_in_metadata(tmp_path):
    paths = write_prompt_files(tmp_path, seed=0, heldout_fraction=0.15, val_size=12)
    train, heldout = split_specs(0, 0.15)
    records = load_prompts(paths["heldout"])
    assert [r.prompt for r in records] == [s.prompt() for s in heldout]
    assert all(SceneSpec.from_dict(r.metadata["shapes"]) == parse_prompt(r.prompt) for r in records)
    assert len(load_prompts(paths["train"])) == len(train)
    assert len(load_prompts(paths["val"])) == 12
