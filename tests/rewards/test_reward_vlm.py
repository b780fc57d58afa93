"""The vlm judge against a fake OpenAI-compatible server on 127.0.0.1 (tests/rewards/conftest.py)."""

import logging
import threading
import time

import numpy as np
import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.rewards import make_reward
from diffusion_rl.rewards.remote import decode_png_base64
from diffusion_rl.rewards.vlm import parse_score

MODEL = "judge-1"


def _images(n: int = 2) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(n, 16, 24, 3), dtype=np.uint8)


def _chat(content) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


def openai_server(answer):
    """respond() for an OpenAI-style server: /v1/models lists MODEL; chat answers come from answer(body)."""

    def respond(method, path, body):
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
        if method == "POST" and path == "/v1/chat/completions":
            return answer(body)
        return 404, {"error": {"message": f"no route {method} {path}"}}

    return respond


def _judge(url: str, **kwargs):
    kwargs = {"retries": 2, "backoff": 0.01, "timeout": 5.0, **kwargs}
    return make_reward("vlm", base_url=url, model=MODEL, **kwargs)


def test_score_mode_sends_the_image_and_prompt_and_divides_by_scale(fake_server):
    server = fake_server(openai_server(lambda body: (200, _chat("Score: 7 out of 10"))))
    images = _images()
    scores = _judge(server.url)(images, ["a red cube", "a blue ball"], [{}, {}])
    np.testing.assert_allclose(scores, [0.7, 0.7], rtol=1e-6)
    bodies = sorted((b for m, p, b in server.requests if p == "/v1/chat/completions"), key=str)
    assert len(bodies) == 2
    sent = {}
    for body in bodies:
        assert body["model"] == MODEL and body["temperature"] == 0.0
        image_part, text_part = body["messages"][0]["content"]
        assert image_part["image_url"]["url"].startswith("data:image/png;base64,")
        prompt = "a red cube" if "a red cube" in text_part["text"] else "a blue ball"
        sent[prompt] = decode_png_base64(image_part["image_url"]["url"])
    np.testing.assert_array_equal(sent["a red cube"], images[0])  # lossless, and each image with its own prompt
    np.testing.assert_array_equal(sent["a blue ball"], images[1])


def test_ocr_mode_scores_the_transcription_against_the_target(fake_server):
    server = fake_server(openai_server(lambda body: (200, _chat("<think>it says open lake</think>OPEN LAKE"))))
    prompts = ['A sign that says "OPEN LAKE"', 'A sign that says "OPEN LATE"']
    scores = _judge(server.url, mode="ocr")(_images(), prompts, [{}, {}])
    # "openlake" read for target "openlate": one substitution over 8 characters
    np.testing.assert_allclose(scores, [1.0, 1 - 1 / 8], rtol=1e-6)


def test_template_placeholders_are_filled(fake_server):
    server = fake_server(openai_server(lambda body: (200, _chat("1"))))
    judge = _judge(server.url, template="Does it show {ground_truth}? Prompt: {prompt}. Braces: {{x}}", scale=1)
    judge(_images(1), ['a sign "HI"'], [{}])
    text = server.requests[-1][2]["messages"][0]["content"][1]["text"]
    assert text == 'Does it show HI? Prompt: a sign "HI". Braces: {x}'
    n_requests = len(server.requests)
    assert np.isnan(judge(_images(1), ["no quoted text"], [{}])).all()  # {ground_truth} has nothing to fill in
    assert len(server.requests) == n_requests


def test_retries_a_503_then_succeeds(fake_server):
    calls = []
    lock = threading.Lock()

    def answer(body):
        with lock:
            calls.append(1)
            first = len(calls) == 1
        return (503, {"error": "warming up"}) if first else (200, _chat("9"))

    server = fake_server(openai_server(answer))
    judge = _judge(server.url)
    np.testing.assert_allclose(judge(_images(1), ["p"], [{}]), [0.9], rtol=1e-6)
    assert server.paths("POST") == ["/v1/chat/completions"] * 2
    assert judge.failed_samples == 0


def test_a_400_is_not_retried_and_fails_the_sample(fake_server, caplog):
    server = fake_server(openai_server(lambda body: (400, {"error": {"message": "image too large"}})))
    judge = _judge(server.url, retries=3)
    with caplog.at_level(logging.WARNING):
        scores = judge(_images(1), ["p"], [{}])
    assert np.isnan(scores).all()
    assert server.paths("POST") == ["/v1/chat/completions"]  # one try only
    assert judge.failed_samples == 1
    assert "HTTP 400" in caplog.text and "image too large" in caplog.text


def test_a_timeout_fails_the_sample(fake_server):
    def slow(body):
        time.sleep(1.0)
        return 200, _chat("5")

    server = fake_server(openai_server(slow))
    judge = _judge(server.url, timeout=0.2, retries=0)
    scores = judge(_images(1), ["p"], [{}])
    assert np.isnan(scores).all() and judge.failed_samples == 1


def test_an_answer_without_a_number_fails_the_sample(fake_server):
    server = fake_server(openai_server(lambda body: (200, _chat("I cannot rate this image."))))
    judge = _judge(server.url)
    assert np.isnan(judge(_images(1), ["p"], [{}])).all()
    assert judge.failed_samples == 1


def test_ocr_mode_without_a_target_fails_that_sample_only(fake_server):
    server = fake_server(openai_server(lambda body: (200, _chat("EXIT"))))
    scores = _judge(server.url, mode="ocr")(_images(), ["no quotes", 'a sign "EXIT"'], [{}, {}])
    assert np.isnan(scores[0]) and scores[1] == 1.0
    assert len(server.paths("POST")) == 1  # nothing is sent for a sample that cannot be scored


def test_unreachable_server_is_a_user_error_naming_the_url(closed_port_url):
    with pytest.raises(UserError, match=closed_port_url.replace(".", r"\.")):
        _judge(closed_port_url, retries=0)


def test_a_model_the_server_does_not_serve_is_a_user_error(fake_server):
    server = fake_server(openai_server(lambda body: (200, _chat("1"))))
    with pytest.raises(UserError, match=f"served: {MODEL}"):
        make_reward("vlm", base_url=server.url + "/v1", model="other-model")


def test_api_key_from_the_environment_is_sent(fake_server, monkeypatch):
    server = fake_server(openai_server(lambda body: (200, _chat("3"))))
    monkeypatch.setenv("JUDGE_KEY", "secret-123")
    _judge(server.url, api_key_env="JUDGE_KEY")(_images(1), ["p"], [{}])
    assert server.headers[-1]["Authorization"] == "Bearer secret-123"
    assert server.headers[0]["Authorization"] == "Bearer secret-123"  # the /v1/models check too
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(UserError, match="JUDGE_KEY"):
        _judge(server.url, api_key_env="JUDGE_KEY")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "rank"}, "unknown mode"),
        ({"template": "Rate {prompt} for {style}"}, "unknown placeholders"),
        ({"base_url": "127.0.0.1:8000"}, "http"),
        ({"concurrency": 0}, "concurrency"),
    ],
)
def test_bad_settings_are_user_errors(kwargs, message):
    kwargs = {"base_url": "http://127.0.0.1:1", "model": MODEL, "check_server": False, **kwargs}
    with pytest.raises(UserError, match=message):
        make_reward("vlm", **kwargs)


@pytest.mark.parametrize(
    "answer, value", [("7", 7.0), ("Score: 8.5/10", 8.5), ("-1e-1", -0.1), ("<think>maybe 3</think> 6", 6.0)]
)
def test_parse_score_takes_the_first_number_after_thinking(answer, value):
    assert parse_score(answer) == pytest.approx(value)
