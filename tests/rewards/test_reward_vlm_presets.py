"""The vlm presets for UnifiedReward (pointwise and pairwise) and HPSv3, against a fake OpenAI-compatible server
on 127.0.0.1 that answers in each model's format (tests/rewards/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.rewards import make_reward
from diffusion_rl.rewards.remote import decode_png_base64
from diffusion_rl.rewards.vlm_presets import AnswerError, parse_dimensions, parse_pooling, parse_preference

MODEL = "UnifiedReward"


def _chat(content) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


def _brightness(part) -> float:
    return float(decode_png_base64(part["image_url"]["url"]).mean())


def server_for(chat=None, pooling=None):
    def respond(method, path, body):
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
        if method == "POST" and path == "/v1/chat/completions" and chat:
            return 200, _chat(chat(body["messages"][0]["content"]))
        if method == "POST" and path == "/pooling" and pooling:
            return 200, pooling(body["messages"][0]["content"])
        return 404, {"error": {"message": f"no route {method} {path}"}}

    return respond


def _images(values):
    return np.stack([np.full((8, 8, 3), v, dtype=np.uint8) for v in values])


def _judge(url, **kwargs):
    return make_reward("vlm", base_url=url, model=MODEL, retries=0, timeout=10.0, **kwargs)


def test_unifiedreward_pointwise_averages_its_dimension_lines(fake_server):
    answer = "Alignment Score (1-5): 4\nCoherence Score (1-5): 3\nStyle Score (1-5): 5"
    server = fake_server(server_for(chat=lambda content: answer))
    scores = _judge(server.url, preset="unifiedreward")(_images([10, 20]), ["a cat", "a dog"], [{}, {}])
    # (4 − 1)/4, (3 − 1)/4, (5 − 1)/4 -> mean of 0.75, 0.5, 1.0
    np.testing.assert_allclose(scores, [0.75, 0.75])
    image_part, text_part = server.requests[-1][2]["messages"][0]["content"]
    assert image_part["type"] == "image_url" and "Alignment Score (1-5)" in text_part["text"]
    assert text_part["text"].rstrip().endswith(("Caption: a cat", "Caption: a dog"))
    style_only = _judge(server.url, preset="unifiedreward", dimensions=["Alignment", "Style"])
    np.testing.assert_allclose(style_only(_images([10]), ["a cat"], [{}]), [0.875])


def test_unifiedreward_answer_without_a_dimension_fails_the_sample(fake_server):
    server = fake_server(server_for(chat=lambda content: "Alignment Score (1-5): 4\nStyle Score (1-5): 5"))
    judge = _judge(server.url, preset="unifiedreward")
    assert np.isnan(judge(_images([10]), ["a cat"], [{}])).all() and judge.failed_samples == 1


def test_pairwise_preset_drives_pairwise_win_rate(fake_server):
    def brighter_wins(content):
        first, second, text = content
        assert text["type"] == "text" and "Image 1" in text["text"]
        winner = 1 if _brightness(first) > _brightness(second) else 2
        return f"<think>comparing...</think>\n<answer>Image {winner} is better</answer>"

    server = fake_server(server_for(chat=brighter_wins))
    judge = {"name": "vlm", "kwargs": {"base_url": server.url, "model": MODEL, "preset": "unifiedreward_pairwise",
                                       "retries": 0}}  # fmt: skip
    reward = make_reward("pairwise_win_rate", preference=judge)
    # brightness 30 > 20 > 10 > 0: win rates 1, 2/3, 1/3, 0 (each image beats the darker ones)
    wins = reward.score_group(_images([20, 0, 30, 10]), ["p"] * 4, [{}] * 4)
    np.testing.assert_allclose(wins, [2 / 3, 0.0, 1.0, 1 / 3], rtol=1e-6)
    assert len(server.paths("POST")) == 6  # the 6 unordered pairs, one request each


def test_hpsv3_preset_reads_mu_from_the_pooling_api(fake_server):
    def head(content):  # HPSv3's head outputs (mu, sigma); mu here: brightness / 10
        return {"data": [{"index": 0, "object": "pooling", "data": [_brightness(content[0]) / 10, 0.3]}]}

    server = fake_server(server_for(pooling=head))
    scores = _judge(server.url + "/v1", preset="hpsv3")(_images([10, 40]), ["a cat", "a dog"], [{}, {}])
    np.testing.assert_allclose(scores, [1.0, 4.0], rtol=1e-6)
    assert server.paths("POST") == ["/pooling", "/pooling"]  # on the server's root, not under /v1
    body = server.requests[-1][2]
    assert body["model"] == MODEL and body["messages"][0]["content"][1]["type"] == "text"


@pytest.mark.parametrize(
    "answer, value",
    [
        ("<answer>Image 1 is better</answer>", 1.0),
        ("<think>Image 1 is better at first sight, but</think><answer> Image 2 is better </answer>", 0.0),
        ("image 2 is better.", 0.0),
    ],
)
def test_parse_preference(answer, value):
    assert parse_preference(answer) == value


@pytest.mark.parametrize("answer", ["Both are fine.", "Image 1 is better. No, Image 2 is better."])
def test_parse_preference_needs_one_verdict(answer):
    with pytest.raises(AnswerError):
        parse_preference(answer)


def test_parse_dimensions_and_pooling_by_hand():
    assert parse_dimensions("Alignment Score (0-10): 5\nStyle Score (1-5): 2", ["alignment", "Style"]) == pytest.approx(
        (0.5 + 0.25) / 2
    )
    with pytest.raises(AnswerError, match="out of its range"):
        parse_dimensions("Alignment Score (1-5): 7", ["Alignment"])
    # lines that name no range, or say more before the name: the judge's own scale, when the caller knows it
    answer = "The Alignment Score (1-5): 4\nCoherence Score: 3\nStyle Score: 5"
    dims = ["Alignment", "Coherence", "Style"]
    assert parse_dimensions(answer, dims, (1.0, 5.0)) == pytest.approx((3 / 4 + 2 / 4 + 4 / 4) / 3)
    with pytest.raises(AnswerError, match="no 'Coherence Score"):
        parse_dimensions(answer, dims)  # no scale to read a bare "Coherence Score: 3" by
    with pytest.raises(AnswerError, match=r"'Style Score \(1-5\): 6' is out of its range"):
        parse_dimensions("Style Score: 6", ["Style"], (1.0, 5.0))
    assert parse_pooling({"data": [{"data": [[0.1, 0.2], [2.5, 0.4]]}]}) == 2.5  # per token: the last
    with pytest.raises(AnswerError):
        parse_pooling({"data": []})


def test_preset_settings_are_checked(fake_server):
    base = {"base_url": "http://127.0.0.1:1", "model": MODEL, "check_server": False}
    with pytest.raises(UserError, match="unknown preset 'hps'"):
        make_reward("vlm", **base, preset="hps")
    with pytest.raises(UserError, match="preset hpsv3 is mode 'reward_model', not 'ocr'"):
        make_reward("vlm", **base, preset="hpsv3", mode="ocr")
    with pytest.raises(UserError, match="dimensions"):
        make_reward("vlm", **base, mode="ocr", dimensions=["Alignment"])
    with pytest.raises(TypeError, match="preference"):
        make_reward("vlm", **base, preset="unifiedreward_pairwise")(_images([1]), ["p"], [{}])
