"""ShapesWorld rewards on hand-drawn images whose answers are worked out from the pixel layout."""

import numpy as np
import pytest

from diffusion_rl.data.shapes import COLORS, ShapesWorld
from diffusion_rl.errors import UserError
from diffusion_rl.rewards import make_reward
from diffusion_rl.rewards.shapes import classify_pixels

SIZE = 64
NAMES = ("shapes_color", "shapes_count", "shapes_position", "shapes_geneval")  # exact on the generator's scenes


def canvas() -> np.ndarray:
    return np.zeros((SIZE, SIZE, 3), dtype=np.uint8)


def square(image: np.ndarray, color: str, x0: int, y0: int, side: int = 10) -> np.ndarray:
    """Paints pixels [y0, y0+side) × [x0, x0+side); its pixel centroid is ((x0 + side/2) / 64, (y0 + side/2) / 64)."""
    image[y0 : y0 + side, x0 : x0 + side] = COLORS[color]
    return image


def scores(name: str, images: list[np.ndarray], prompts: list[str], metadata=None) -> np.ndarray:
    metadata = metadata if metadata is not None else [{} for _ in prompts]
    return make_reward(name)(np.stack(images), prompts, metadata)


def test_right_image_scores_one_and_wrong_colour_scores_zero():
    image = square(canvas(), "red", 6, 27)  # centroid x = 11/64, far left
    prompts = ["a red square on the left", "a blue square on the left"]
    assert scores("shapes_color", [image, image], prompts).tolist() == [1.0, 0.0]
    assert scores("shapes_count", [image, image], prompts).tolist() == [1.0, 0.0]
    assert scores("shapes_position", [image, image], prompts).tolist() == [1.0, 0.0]
    assert scores("shapes_geneval", [image, image], prompts).tolist() == [1.0, 0.0]


def test_colour_score_is_presence_times_purity():
    image = square(square(canvas(), "red", 5, 5), "green", 40, 40)  # 100 red, 100 green pixels
    image3 = square(square(square(canvas(), "red", 5, 5), "green", 40, 40), "blue", 5, 40)
    got = scores(
        "shapes_color", [image, image3, image], ["a red square", "a red square", "a red square above a blue circle"]
    )
    # presence 1 × purity 100/200; presence 1 × purity 100/300; presence 1/2 × purity 100/200
    np.testing.assert_allclose(got, [0.5, 1 / 3, 0.25], rtol=1e-6)


def test_count_score_is_one_minus_relative_error():
    two = square(square(canvas(), "blue", 5, 5), "blue", 40, 5)
    three = square(two.copy(), "blue", 5, 40)
    five = square(square(three.copy(), "blue", 40, 40), "blue", 22, 22)
    prompts = ["two blue squares"] * 3 + ["three blue squares"]
    got = scores("shapes_count", [two, three, five, two], prompts)
    np.testing.assert_allclose(got, [1.0, 0.5, 0.0, 1 - 1 / 3], rtol=1e-6)


def test_objects_touching_at_a_corner_are_one_component_and_specks_are_not_objects():
    image = square(square(canvas(), "red", 10, 10), "red", 20, 20)  # diagonal neighbours: 8-connected
    assert scores("shapes_count", [image], ["two red squares"]).tolist() == [0.5]
    speck = square(square(canvas(), "red", 10, 10), "red", 50, 50, side=2)  # 4 px < 0.5 % of 4096 px
    assert scores("shapes_count", [speck], ["a red square"]).tolist() == [1.0]


def test_position_score_ramps_with_the_centroid_offset():
    centred = square(canvas(), "red", 27, 27)  # centroid x = 32/64 = 0.5
    near = square(canvas(), "red", 23, 27)  # centroid x = 28/64: 0.0625 left of centre
    mirrored = square(canvas(), "red", 48, 27)  # centroid x = 53/64
    got = scores("shapes_position", [centred, near, near, mirrored], ["a red square on the left"] * 2 +
                 ["a red square on the right", "a red square on the left"])  # fmt: skip
    full = 0.5 - 0.35 - 0.03  # POSITION_FULL: offsets ≥ 0.12 of the image score 1
    np.testing.assert_allclose(got, [0.5, 0.5 + 0.0625 / (2 * full), 0.5 - 0.0625 / (2 * full), 0.0], rtol=1e-5)


def test_relation_score_compares_the_two_centroids():
    image = square(square(canvas(), "red", 27, 11), "blue", 27, 43)  # red centroid y = 16/64, blue 48/64
    prompts = ["a red square above a blue circle", "a red square below a blue circle",
               "a red square to the left of a blue circle", "a red square above a green circle"]  # fmt: skip
    got = scores("shapes_position", [image] * 4, prompts)
    np.testing.assert_allclose(got, [1.0, 0.0, 0.5, 0.0])  # same x: "left of" is undecided; green absent: 0


def test_geneval_averages_position_only_when_asked():
    image = square(square(canvas(), "red", 27, 27), "green", 5, 5)  # red centred; green extra
    got = scores("shapes_geneval", [image, image], ["a red square", "a red square on the left"])
    color, count, position = 0.5, 1.0, 0.5
    np.testing.assert_allclose(got, [(color + count) / 2, (color + count + position) / 3], rtol=1e-6)
    assert scores("shapes_position", [image], ["a red square"]).tolist() == [1.0]


def test_metadata_spec_wins_over_the_prompt_and_a_foreign_prompt_is_an_error():
    image = square(canvas(), "red", 6, 27)
    spec = {"groups": [{"color": "red", "shape": "square", "count": 1}], "position": "left", "relation": None}
    assert scores("shapes_geneval", [image], ["whatever text"], [{"shapes": spec}]).tolist() == [1.0]
    with pytest.raises(UserError, match="not a ShapesWorld prompt"):
        scores("shapes_geneval", [image], ["a photo of a cat"])


def test_darker_shades_keep_their_colour_and_greys_are_background():
    pixels = np.array([[[117, 107, 17], [112, 17, 17], [128, 128, 128], [250, 250, 250], [30, 30, 30]]], np.uint8)
    labels = classify_pixels(pixels[None])[0, 0]
    k = {name: i + 1 for i, name in enumerate(COLORS)}
    assert labels.tolist() == [k["yellow"], k["red"], 0, 0, 0]


@pytest.mark.parametrize("size", [32, 64])
def test_generated_scenes_score_one_on_every_reward(size):
    specs, images = ShapesWorld(size=size, seed=0).batch(range(12_000 // size))  # 375 scenes at 32 px, 187 at 64
    for name in NAMES:
        got = scores(name, list(images), [s.prompt() for s in specs])
        assert got.dtype == np.float32 and got.min() == 1.0, name


def test_a_mismatched_scene_scores_below_one():
    world = ShapesWorld(size=32, seed=0)
    specs, images = world.batch(range(200))
    shifted = [specs[(i + 1) % len(specs)].prompt() for i in range(len(specs))]  # each image gets another prompt
    got = scores("shapes_geneval", list(images), shifted)
    assert got.mean() < 0.6


def test_bad_kwargs_are_user_errors():
    with pytest.raises(UserError):
        make_reward("shapes_geneval", min_area_fraction=2.0)
    with pytest.raises(UserError):
        make_reward("shapes_count", min_area=3)


def test_each_drawn_shape_reads_as_itself_and_a_smear_as_no_shape():
    from diffusion_rl.data.shapes import RADIUS, SHAPES, draw_objects
    from diffusion_rl.rewards.shapes import read_images

    rng = np.random.default_rng(0)
    right = {}
    for shape in SHAPES:  # 300 objects of each shape, at the generator's sizes, in every colour, at 32 px
        objects = [(list(COLORS)[i % len(COLORS)], shape, *rng.uniform(0.2, 0.8, 2), rng.uniform(*RADIUS))
                   for i in range(300)]  # fmt: skip
        readings = read_images(np.stack([draw_objects([o], 32) for o in objects]), outlines=True)
        right[shape] = np.mean([r.outlines[list(COLORS).index(o[0]), SHAPES.index(shape)] for o, r in
                                zip(objects, readings)])  # fmt: skip
    assert right["square"] == right["triangle"] == 1.0 and right["circle"] >= 0.95, right
    smear = canvas()
    smear[30:33, 4:40] = COLORS["red"]  # 3 × 36 px: an object by area, too elongated for a shape
    (reading,) = read_images(smear[None], outlines=True)
    assert reading.objects[list(COLORS).index("red")] == 1 and reading.outlines.sum() == 0


def test_shape_score_is_the_share_of_each_asked_colours_objects_with_an_asked_shape():
    from diffusion_rl.data.shapes import draw_objects

    circle, square_ = ("red", "circle", 0.25, 0.3, 0.11), ("red", "square", 0.75, 0.3, 0.11)
    blue_triangle = ("blue", "triangle", 0.5, 0.75, 0.12)
    images = [draw_objects(objects, 32) for objects in ([circle, square_], [circle, blue_triangle], [square_])]
    prompts = ["two red circles", "a red circle above a blue triangle", "a red circle above a blue triangle"]
    # 1 of red's 2 objects is a circle; red 1/1 and blue 1/1; red 0/1 and blue absent (0)
    assert scores("shapes_shape", images, prompts).tolist() == [0.5, 1.0, 0.0]


def test_shape_weight_weighs_the_outlines_into_geneval():
    from diffusion_rl.data.shapes import draw_objects

    image = draw_objects([("red", "square", 0.5, 0.5, 0.11)], 32)  # right colour and count, wrong outline
    assert scores("shapes_geneval", [image], ["a red circle"]).tolist() == [1.0]
    outlined = make_reward("shapes_geneval", shape_weight=0.5)(image[None], ["a red circle"], [{}])
    np.testing.assert_allclose(outlined, [(1.0 + 0.5 * 0.0) / 1.5], rtol=1e-6)
    with pytest.raises(UserError):
        make_reward("shapes_geneval", shape_weight=-1)
