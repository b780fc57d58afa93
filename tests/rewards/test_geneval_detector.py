"""The `geneval` reward's OWLv2 detector on a tiny random Owlv2ForObjectDetection saved with save_pretrained: its
detections against the model's raw outputs post-processed by hand, and the reward end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessorPil

from diffusion_rl.data.shapes import SceneSpec, ShapeGroup, draw_scene
from diffusion_rl.models.tiny.parts import build_tokenizers
from diffusion_rl.rewards import make_reward
from diffusion_rl.rewards.geneval.detector import OwlDetector, iou
from diffusion_rl.rewards.geneval.rules import COLORS, evaluate, parse_metadata
from diffusion_rl.rewards.geneval.shapes import scene_metadata

SIZE = 64
SCENES = [
    SceneSpec((ShapeGroup("red", "circle", 2),)),
    SceneSpec((ShapeGroup("blue", "square"), ShapeGroup("yellow", "triangle")), relation="left of"),
]


@pytest.fixture(scope="module")
def owl_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("owlv2")
    tokenizer = build_tokenizers(32)[0]
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=24, bos_token_id=512, eos_token_id=513,
                pad_token_id=513)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=SIZE,
                  patch_size=16)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Owlv2ForObjectDetection(Owlv2Config(text_config=text, vision_config=vision, projection_dim=32))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Owlv2ImageProcessorPil(size={"height": SIZE, "width": SIZE}).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def scenes():
    images = np.stack([draw_scene(spec, SIZE, np.random.default_rng(i)) for i, spec in enumerate(SCENES)])
    specs = [parse_metadata(scene_metadata(s)) for s in SCENES]
    return images, specs


def test_detections_are_the_models_boxes_thresholded_and_deduplicated_by_hand(owl_dir, scenes):
    images, specs = scenes
    detector = OwlDetector(str(owl_dir), device="cpu")
    threshold, nms_iou = 0.3, 0.5
    found = detector.detect(images, specs, threshold, threshold, nms_iou, max_objects=5)

    # by hand: the same queries through the model, then sigmoid, threshold, greedy NMS, pixel boxes, colour argmax
    queries = []
    for spec in specs:
        for cls in spec.classes:
            queries.append(f"a photo of a {cls}")
        for cls in spec.colored_classes:
            queries += [f"a photo of a {c} {cls}" for c in COLORS]
    queries = list(dict.fromkeys(queries))
    logits, boxes = detector.logits(images, queries)
    assert logits.shape == (2, (SIZE // 16) ** 2, len(queries)) and boxes.shape == (2, (SIZE // 16) ** 2, 4)
    for b, spec in enumerate(specs):
        for cls in spec.classes:
            column = queries.index(f"a photo of a {cls}")
            probabilities = 1 / (1 + np.exp(-logits[b, :, column]))
            kept = []
            for p in sorted(range(len(probabilities)), key=lambda p: -probabilities[p]):
                cx, cy, w, h = boxes[b, p] * SIZE  # a square image: no padding
                box = tuple(float(np.clip(v, 0, SIZE)) for v in (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2))
                if probabilities[p] > threshold and all(iou(box, k[1]) <= nms_iou for k in kept):
                    colors = [logits[b, p, queries.index(f"a photo of a {c} {cls}")] for c in COLORS]
                    kept.append((p, box, COLORS[int(np.argmax(colors))]))
            got = found[b][cls]
            assert [d.box for d in got] == pytest.approx([k[1] for k in kept][:5], abs=1e-4)
            assert [d.color for d in got] == [k[2] for k in kept][:5]
            assert all(d.label == cls for d in got)
    assert sum(len(v) for f in found for v in f.values()) > 0  # the random model does detect something


def test_boxes_of_a_non_square_image_are_scaled_by_the_longer_side(owl_dir):
    detector = OwlDetector(str(owl_dir), device="cpu")
    image = np.zeros((1, 32, 64, 3), dtype=np.uint8)  # padded to 64 × 64 at the bottom
    spec = parse_metadata({"include": [{"class": "circle"}]})
    logits, boxes = detector.logits(image, ["a photo of a circle"])
    found = detector.detect(image, [spec], 0.01, 0.01, 1.0, max_objects=100)[0]["circle"]
    assert all(0 <= d.box[1] <= d.box[3] <= 32 and 0 <= d.box[0] <= d.box[2] <= 64 for d in found)
    p = int(np.argmax(logits[0, :, 0]))
    cx, cy, w, h = boxes[0, p] * 64
    assert found[0].box == pytest.approx(
        (max(cx - w / 2, 0), max(cy - h / 2, 0), min(cx + w / 2, 64), min(cy + h / 2, 32))
    )


def test_reward_is_the_share_of_clauses_or_the_strict_verdict(owl_dir, scenes):
    images, specs = scenes
    metadata = [scene_metadata(s) for s in SCENES] + [{}]
    batch = np.concatenate([images, images[:1]])
    prompts = [s.prompt() for s in SCENES] + ["no metadata"]
    reward = make_reward("geneval", detector_path=str(owl_dir), threshold=0.3, counting_threshold=0.3, device="cpu")
    strict = make_reward("geneval", detector_path=str(owl_dir), threshold=0.3, counting_threshold=0.3, device="cpu",
                         strict=True)  # fmt: skip
    scores, verdicts = reward(batch, prompts, metadata), strict(batch, prompts, metadata)
    found = OwlDetector(str(owl_dir), device="cpu").detect(images, specs, 0.3, 0.3, 0.5, 16)
    expected = [evaluate(spec, f) for spec, f in zip(specs, found)]
    np.testing.assert_allclose(scores[:2], [v.fraction for v in expected])
    np.testing.assert_allclose(verdicts[:2], [float(v.correct) for v in expected])
    assert np.isnan(scores[2]) and np.isnan(verdicts[2])  # no GenEval metadata: a failed sample, not a 0


def test_a_missing_detector_directory_names_the_download(tmp_path):
    from diffusion_rl.errors import UserError

    with pytest.raises(UserError, match="huggingface-cli download google/owlv2-base-patch16-ensemble"):
        make_reward("geneval", detector_path=str(tmp_path / "nowhere"))
