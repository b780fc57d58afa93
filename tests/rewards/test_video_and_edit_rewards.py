"""Rewards of videos and edits: the frame-wise reduction, temporal consistency, source preservation and ShapesWorld
edits by hand; the vlm judge's edit mode and the reward server with videos and condition images."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from diffusion_rl.data.shapes_edits import EDIT_KINDS, EditSpec, PlacedShape, draw_source, draw_target, random_edit
from diffusion_rl.errors import UserError
from diffusion_rl.rewards import RewardCombiner, WeightedReward, make_reward
from diffusion_rl.rewards.remote import decode_png_base64
from diffusion_rl.rewards.server import make_server
from diffusion_rl.rewards.shapes_edit import edit_region
from diffusion_rl.rewards.video import FramewiseReward, framewise

ROOT = Path(__file__).resolve().parents[2]


def constant_video(values, size: int = 4) -> np.ndarray:
    """uint8 [F, size, size, 3] whose frame f is all values[f]."""
    return np.stack([np.full((size, size, 3), v, dtype=np.uint8) for v in values])


def brightness(images, prompts, metadata):
    """An image reward: the mean pixel value (NaN for an image of all 13s: a 'failed' frame)."""
    brightness.calls.append(len(images))
    means = images.reshape(len(images), -1).mean(axis=1)
    return np.where(means == 13, np.nan, means).astype(np.float32)


brightness.calls = []


@pytest.mark.parametrize(("reduction", "expected", "frames_scored"),
                         [("mean", [20.0, 5.0], 6), ("min", [10.0, 0.0], 6), ("first", [10.0, 0.0], 2),
                          ("last", [30.0, 5.0], 2)])  # fmt: skip
def test_an_image_reward_scores_videos_frame_by_frame(reduction, expected, frames_scored):
    videos = np.stack([constant_video([10, 20, 30]), constant_video([0, 10, 5])])
    brightness.calls.clear()
    scores = FramewiseReward(brightness, reduction, "brightness")(videos, ["a", "b"], [{}, {}])
    assert scores.tolist() == pytest.approx(expected)
    assert brightness.calls == [frames_scored]  # first/last score only the frame they need
    images = videos[:, 0]  # images pass through unchanged
    assert FramewiseReward(brightness, reduction, "brightness")(images, ["a", "b"], [{}, {}]).tolist() == [10, 0]


def test_a_failed_frame_fails_its_video_and_video_rewards_are_not_wrapped():
    videos = np.stack([constant_video([10, 13, 30]), constant_video([1, 2, 3])])
    scores = FramewiseReward(brightness, "mean", "brightness")(videos, ["a", "b"], [{}, {}])
    assert np.isnan(scores[0]) and scores[1] == pytest.approx(2.0)
    consistency = make_reward("temporal_consistency")
    assert framewise(consistency, "mean", "t") is consistency


def test_group_rewards_compare_the_group_frame_by_frame():
    class Rank:
        group = True

        def score_group(self, images, prompts, metadata):  # 1 for the brightest of the group, 0 for the others
            means = images.reshape(len(images), -1).mean(axis=1)
            return (means == means.max()).astype(np.float32)

    videos = np.stack([constant_video([10, 50]), constant_video([20, 40])])  # video 1 wins frame 0, video 0 frame 1
    wrapped = FramewiseReward(Rank(), "mean", "rank")
    assert wrapped.group
    assert wrapped.score_group(videos, ["p", "p"], [{}, {}]).tolist() == [0.5, 0.5]
    assert FramewiseReward(Rank(), "last", "rank").score_group(videos, ["p", "p"], [{}, {}]).tolist() == [1.0, 0.0]


def test_temporal_consistency_by_hand():
    # frames 0 → 51 → 51: changes of 51/255 = 0.2 and 0 → mean 0.1 → score 0.9; a still video scores 1
    videos = np.stack([constant_video([0, 51, 51]), constant_video([7, 7, 7])])
    assert make_reward("temporal_consistency")(videos, ["a", "b"], [{}, {}]).tolist() == pytest.approx([0.9, 1.0])
    with pytest.raises(ValueError, match="scores videos"):
        make_reward("temporal_consistency")(videos[:, 0], ["a", "b"], [{}, {}])


def test_combiner_scores_a_video_batch_with_an_image_and_a_video_reward():
    brightness.calls.clear()
    videos = np.stack([constant_video([0, 51, 51]), constant_video([100, 100, 100])])
    combiner = RewardCombiner([
        WeightedReward("brightness", 1.0, brightness, frames="min"),  # an image reward: frame by frame
        WeightedReward("consistency", 10.0, make_reward("temporal_consistency")),  # takes the videos whole
    ])  # fmt: skip
    result = combiner(videos, ["a", "b"], [{}, {}])
    assert result.per_reward["brightness"].tolist() == pytest.approx([0.0, 100.0])  # the darkest frame
    assert result.total.tolist() == pytest.approx([0.0 + 9.0, 100.0 + 10.0])
    images = RewardCombiner([WeightedReward("brightness", 1.0, brightness, frames="min")])
    assert images(videos[:, 1], ["a", "b"], [{}, {}]).total.tolist() == [51.0, 100.0]  # images: as they are
    with pytest.raises(ValueError, match="frames='median'; known: mean, min, first, last"):
        WeightedReward("b", 1.0, brightness, frames="median")


def test_source_preservation_by_hand():
    source = np.zeros((2, 2, 3), dtype=np.uint8)
    result = source.copy()
    result[0, 0] = 255  # one pixel of four fully changed: mean |Δ| = 1/4 → 0.75
    reward = make_reward("source_preservation")
    metadata = [{"condition_images": [source]}, {"condition_images": [source]}]
    assert reward(np.stack([result, source]), ["edit", "edit"], metadata).tolist() == pytest.approx([0.75, 1.0])
    combiner = RewardCombiner([WeightedReward("keep", 1.0, reward), WeightedReward("b", 1.0, brightness)])
    scored = combiner(np.stack([result, source]), ["edit", "edit"], [metadata[0], {}])  # row 1: no source
    assert scored.per_reward["keep"][0] == pytest.approx(0.75) and np.isnan(scored.per_reward["keep"][1])


def test_source_preservation_outside_a_shapes_edit_counts_only_what_the_edit_leaves_alone():
    spec = EditSpec("move", (PlacedShape("red", "circle", 0.3, 0.5, 0.1),), 0, direction="right")
    region = edit_region(spec, 32, 32)
    # the circle spans x 0.2…0.4 of 32 px and goes to 0.5…0.7, rows 0.4…0.6, widened by 2 px on every side
    assert (
        region[16, 6:24].all() and region[16, 4:26].sum() >= 18 and not region[:10].any() and not region[:, 26:].any()
    )
    source = draw_source(spec, 32)
    result = draw_target(spec, 32).copy()  # the circle moved: every changed pixel lies in the region
    result[0, 0] = 255  # and one pixel outside it fully changed
    metadata = [{"shapes_edit": spec.to_dict(), "condition_images": [source]}]
    outside = make_reward("source_preservation", outside="shapes_edit")(result[None], ["e"], metadata)
    everywhere = make_reward("source_preservation")(result[None], ["e"], metadata)
    assert outside[0] == pytest.approx(1 - 1 / (32 * 32 - region.sum()), abs=1e-6)
    changed = (np.abs(result.astype(int) - source).mean(-1) / 255).sum()
    assert everywhere[0] == pytest.approx(1 - changed / (32 * 32), abs=1e-6) and everywhere[0] < outside[0]
    with pytest.raises(UserError, match="outside takes shapes_edit, with metric pixel"):
        make_reward("source_preservation", outside="everything")


def test_the_edit_quickstart_rewards_editing_over_copying():
    """Under configs/quickstart_edit.yaml's rewards an unedited copy of the source scores below the drawn target on
    every training edit, and earns less than half of what the target earns over noise (with equal weights on
    shapes_edit and whole-image preservation a copy earned 58 %, and a run learnt to copy)."""
    from diffusion_rl.config import load
    from diffusion_rl.data.prompts import load_prompts
    from diffusion_rl.rewards.build import build_combiner

    cfg = load(str(ROOT / "configs/quickstart_edit.yaml"))
    combiner = build_combiner(cfg.rewards, lambda r: make_reward(r.name, **r.kwargs))
    specs = [EditSpec.from_dict(r.metadata["shapes_edit"]) for r in load_prompts(ROOT / cfg.data.train)]
    sources = np.stack([draw_source(s, 32) for s in specs])
    metadata = [{"shapes_edit": s.to_dict(), "condition_images": [source]} for s, source in zip(specs, sources)]
    noise = np.clip(np.random.default_rng(0).normal(128, 60, sources.shape), 0, 255).astype(np.uint8)
    copy, target, noisy = (
        combiner(images, [s.instruction() for s in specs], metadata).total
        for images in (sources, np.stack([draw_target(s, 32) for s in specs]), noise)
    )
    assert (copy < target).all(), np.flatnonzero(copy >= target)
    share = (copy.mean() - noisy.mean()) / (target.mean() - noisy.mean())
    assert share < 0.5, share


@pytest.mark.parametrize("kind", EDIT_KINDS)
def test_shapes_edit_scores_the_target_high_and_the_source_and_black_low(kind):
    reward, rng = make_reward("shapes_edit"), np.random.default_rng(1)
    for _ in range(10):
        spec = random_edit(rng, kind)
        metadata = [{"shapes_edit": spec.to_dict()}] * 3
        images = np.stack([draw_target(spec, 32), draw_source(spec, 32), np.zeros((32, 32, 3), np.uint8)])
        target, source, black = reward(images, [spec.instruction()] * 3, metadata)
        assert target >= 0.95 and source <= 2 / 3 + 1e-6 and black <= 1 / 3 + 1e-6, (spec, target, source, black)


def _chat(content) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


def test_vlm_edit_mode_shows_the_sources_then_the_result_in_one_request(fake_server):
    def respond(method, path, body):
        if path == "/v1/models":
            return 200, {"data": [{"id": "judge"}]}
        return 200, _chat("8")

    server = fake_server(respond)
    judge = make_reward("vlm", base_url=server.url, model="judge", mode="edit", retries=0, timeout=5.0)
    source, result = constant_video([40, 200], size=8)
    scores = judge(result[None], ["make it brighter"], [{"condition_images": [source]}])
    assert scores.tolist() == pytest.approx([0.8])
    (body,) = [b for m, p, b in server.requests if p == "/v1/chat/completions"]
    first, second, text = body["messages"][0]["content"]
    assert np.array_equal(decode_png_base64(first["image_url"]["url"]), source)
    assert np.array_equal(decode_png_base64(second["image_url"]["url"]), result)
    assert "make it brighter" in text["text"]
    assert np.isnan(judge(result[None], ["x"], [{}])[0])  # no source to compare with: failed, not 0


@pytest.fixture
def served():
    servers = []

    def start(reward_fn, **kwargs):
        server = make_server(reward_fn, host="127.0.0.1", port=0, **kwargs)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_remote_reward_sends_videos_and_condition_images_over_the_wire(served):
    seen = {}

    def reward(images, prompts, metadata):
        seen["shape"], seen["sources"] = images.shape, [m["condition_images"] for m in metadata]
        return images.reshape(len(images), -1).mean(axis=1).astype(np.float32)

    url = served(framewise(reward, "mean", "r"))  # as serve-reward wraps its reward
    videos = np.stack([constant_video([10, 20, 30]), constant_video([1, 2, 3])])
    sources = [np.full((4, 4, 3), 9, np.uint8)]
    client = make_reward("remote", url=url, video=True, retries=0, timeout=10.0)
    scores = client(videos, ["a", "b"], [{"condition_images": sources}, {"condition_images": sources}])
    assert scores.tolist() == pytest.approx([20.0, 2.0])
    assert seen["shape"] == (6, 4, 4, 3)  # the server's frame-wise wrapper gave its image reward the frames
    assert all(np.array_equal(s[0], sources[0]) for s in seen["sources"])
    assert framewise(client, "mean", "remote") is client  # video=True: the trainer sends whole videos
