"""The reward server (a real subprocess on 127.0.0.1, and in-process for request checks) and the `remote` client."""

import base64
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.rewards import RewardCombiner, RewardFailure, WeightedReward, make_reward
from diffusion_rl.rewards.remote import RemoteRewardError, encode_png_base64
from diffusion_rl.rewards.server import BatchingScorer, main, make_server

STARTUP_TIMEOUT_S = 30


def _images(n: int, size: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)


def _client(url: str, **kwargs):
    kwargs = {"retries": 1, "backoff": 0.01, "timeout": 10.0, **kwargs}
    return make_reward("remote", url=url, **kwargs)


@pytest.fixture
def server_process():
    """start(reward) -> (process, url): `python -m diffusion_rl.rewards.server` on a free loopback port."""
    processes = []

    def start(reward: str = "jpeg_incompressibility"):
        process = subprocess.Popen(
            [sys.executable, "-m", "diffusion_rl.rewards.server", "--reward", reward, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        processes.append(process)
        line = _ready_line(process)
        return process, line.rsplit(" ", 1)[-1]

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        process.stdout.close()
        process.stderr.close()


def _ready_line(process: subprocess.Popen) -> str:
    """The server's 'serving reward ... on http://...' line, read within STARTUP_TIMEOUT_S."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(STARTUP_TIMEOUT_S)
    if not lines or not lines[0].startswith("serving reward"):
        process.kill()
        raise AssertionError(f"the reward server did not start: {lines} {process.stderr.read()[-2000:]}")
    return lines[0].strip()


def test_remote_scores_equal_the_local_reward(server_process):
    _, url = server_process("jpeg_incompressibility")
    images = _images(5)
    prompts, metadata = ["a", "b", "c", "d", "e"], [{"k": i} for i in range(5)]
    remote = _client(url, chunk_size=2)  # three requests: 2 + 2 + 1
    expected = make_reward("jpeg_incompressibility")(images, prompts, metadata)
    np.testing.assert_allclose(remote(images, prompts, metadata), expected, rtol=1e-6)
    assert remote.failed_samples == 0


def test_ocr_reward_served_and_scored_remotely(server_process):
    pytest.importorskip("rapidocr")
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (128, 128), "white")
    ImageDraw.Draw(image).text((10, 50), "OPEN", fill="black", font=ImageFont.truetype("DejaVuSans-Bold.ttf", 28))
    images = np.stack([np.asarray(image), np.full((128, 128, 3), 255, np.uint8)])
    _, url = server_process("ocr")
    scores = _client(url)(images, ['a sign "OPEN"', 'a sign "OPEN"'], [{}, {}])
    np.testing.assert_allclose(scores, [1.0, 0.0], atol=1e-6)


def test_server_killed_mid_run_fails_samples_then_raises(server_process):
    process, url = server_process("jpeg_incompressibility")
    remote = _client(url, chunk_size=2, max_failed_batches=3)
    images, prompts, metadata = _images(4), ["p"] * 4, [{}] * 4
    assert np.isfinite(remote(images, prompts, metadata)).all()

    process.kill()
    process.wait(timeout=10)
    scores = remote(images, prompts, metadata)  # two chunks fail: NaN, counted
    assert np.isnan(scores).all()
    assert (remote.failed_batches, remote.failed_samples) == (2, 4)
    with pytest.raises(RemoteRewardError, match=f"{url} failed 3 requests in a row .*max_failed_batches=3"):
        remote(images, prompts, metadata)  # the third failed request (of 2 images) in a row, in the third batch
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match="still running"):
        remote(images, prompts, metadata)  # gone: raises at once, without retrying each chunk
    assert time.monotonic() - start < 1.0


def test_one_bad_image_fails_only_itself_on_a_real_server(server_process, tmp_path):
    # The reward raises on any batch holding an image whose metadata says "bad": the batch call raises, the server
    # scores the request image by image, and only that image comes back null.
    reward_file = tmp_path / "picky_reward.py"
    reward_file.write_text(
        "import numpy as np\n\n\ndef reward(images, prompts, metadata):\n"
        "    if any(m.get('bad') for m in metadata):\n"
        "        raise ValueError('cannot score a bad image')\n"
        "    return (images.reshape(len(images), -1).mean(axis=1) / 255).astype(np.float32)\n"
    )
    _, url = server_process(f"{reward_file}:reward")
    images = np.stack([np.full((16, 16, 3), value, dtype=np.uint8) for value in (51, 102, 204)])
    metadata = [{}, {"bad": True}, {}]
    payload = {"images": [encode_png_base64(image) for image in images], "prompts": ["a", "b", "c"]}
    status, answer = _post(url, json.dumps({**payload, "metadata": metadata}).encode())
    assert status == 200
    assert answer["scores"][0] == pytest.approx(0.2) and answer["scores"][2] == pytest.approx(0.8)
    assert answer["scores"][1] is None
    assert answer["error"] == (
        f"reward '{reward_file}:reward' raised on 1 of 3 samples (their scores are null); sample 1: ValueError: "
        "cannot score a bad image"
    )
    scores = _client(url)(images, ["a", "b", "c"], metadata)  # the `remote` client: NaN for the null
    np.testing.assert_allclose(scores, [0.2, np.nan, 0.8], rtol=1e-6)


def test_combiner_reports_the_dead_server(server_process):
    process, url = server_process("jpeg_incompressibility")
    combiner = RewardCombiner([WeightedReward("remote_jpeg", 1.0, _client(url, max_failed_batches=1))])
    process.kill()
    process.wait(timeout=10)
    with pytest.raises(RewardFailure, match="remote_jpeg.*RemoteRewardError"):
        combiner(_images(3), ["p"] * 3, [{}] * 3)


def test_slow_server_times_out_and_fails_the_batch(fake_server):
    def respond(method, path, body):
        if path == "/score":
            time.sleep(1.0)
        return 200, {"status": "ok"} if method == "GET" else {"scores": [1.0] * len(body["images"])}

    server = fake_server(respond)
    remote = _client(server.url, timeout=0.2, retries=0)
    assert np.isnan(remote(_images(2), ["p", "q"], [{}, {}])).all()
    assert remote.failed_samples == 2


def test_a_400_is_not_retried(fake_server):
    def respond(method, path, body):
        return (200, {"status": "ok"}) if method == "GET" else (400, {"error": "'prompts' must be a list"})

    server = fake_server(respond)
    remote = _client(server.url, retries=3)
    assert np.isnan(remote(_images(2), ["p", "q"], [{}, {}])).all()
    assert server.paths("POST") == ["/score"]


def test_a_503_then_200_is_retried_and_succeeds(fake_server):
    answers = iter([(503, {"error": "busy"}), (200, {"scores": [0.25, None]})])

    def respond(method, path, body):
        return (200, {"status": "ok"}) if method == "GET" else next(answers)

    server = fake_server(respond)
    remote = _client(server.url, retries=2)
    scores = remote(_images(2), ["p", "q"], [{}, {}])
    assert scores[0] == 0.25 and np.isnan(scores[1])  # null = a sample the server's reward failed
    assert server.paths("POST") == ["/score", "/score"]


def test_unreachable_health_is_a_user_error_naming_the_url(closed_port_url):
    with pytest.raises(UserError, match=closed_port_url.replace(".", r"\.")):
        _client(closed_port_url, retries=0)


# ---- the server in-process: request checks and batching ----


@pytest.fixture
def local_server():
    """start(reward_fn, **kw) -> url of a make_server() server running in a thread."""
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


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/score", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _mean_brightness(images, prompts, metadata):
    return images.reshape(len(images), -1).mean(axis=1).astype(np.float32)


@pytest.mark.parametrize(
    "body, message",
    [
        (b"not json", "not JSON"),
        (json.dumps({"images": [], "prompts": []}).encode(), "non-empty list"),
        (json.dumps({"images": ["aGVsbG8="], "prompts": ["p", "q"]}).encode(), "1 images, 2 prompts"),
        (json.dumps({"images": ["%%%"], "prompts": ["p"]}).encode(), "images\\[0\\]"),
        (json.dumps({"images": [base64.b64encode(b"hello").decode()], "prompts": ["p"]}).encode(), "images\\[0\\]"),
        (json.dumps({"images": [], "prompts": [], "pickle": 1}).encode(), "unknown keys"),
    ],
)
def test_malformed_requests_get_400_with_a_message(local_server, body, message):
    status, answer = _post(local_server(_mean_brightness), body)
    assert status == 400
    assert re.search(message, answer["error"])


def test_health_and_unknown_paths(local_server):
    url = local_server(_mean_brightness, name="brightness", max_batch=8)
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        assert json.loads(response.read()) == {
            "status": "ok",
            "reward": "brightness",
            "max_batch": 8,
            "max_wait_ms": 20,
        }
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url + "/nothing", timeout=10)
    assert info.value.code == 404


def test_a_raising_reward_gives_null_scores_and_the_error(local_server):
    def broken(images, prompts, metadata):
        raise RuntimeError("model exploded")

    url = local_server(broken, name="broken")
    body = json.dumps({"images": [encode_png_base64(_images(1)[0])], "prompts": ["p"]}).encode()
    status, answer = _post(url, body)
    assert status == 200 and answer["scores"] == [None]
    assert "model exploded" in answer["error"]


def test_concurrent_requests_are_scored_in_one_batch():
    calls = []

    def recording(images, prompts, metadata):
        calls.append(len(images))
        return _mean_brightness(images, prompts, metadata)

    scorer = BatchingScorer(recording, max_batch=16, max_wait_ms=300)
    try:
        jobs = [_images(2, seed=i) for i in range(4)]
        results = [None] * 4

        def submit(i):
            results[i] = scorer.score(jobs[i], ["p", "q"], [{}, {}])

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    finally:
        scorer.close()
    assert calls == [8]  # four requests of 2, one reward call
    for images, job in zip(jobs, results):
        np.testing.assert_allclose(job.scores, _mean_brightness(images, [], []), rtol=1e-6)


def test_main_rejects_bad_kwargs(capsys):
    assert main(["--reward", "jpeg_incompressibility", "--kwargs", "[1, 2]", "--port", "0"]) == 2
    assert "--kwargs must be a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_outside_0_65535_is_one_line_before_the_reward_is_built(port, capsys, monkeypatch):
    import diffusion_rl.rewards as rewards

    monkeypatch.setattr(rewards, "make_reward", lambda *a, **k: pytest.fail("the reward was built"))
    assert main(["--reward", "jpeg_incompressibility", "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: serve-reward: --port must be in [0, 65535] (0 picks a free one), got {port}", err


def test_a_port_in_use_is_one_line_before_the_reward_is_built(capsys, monkeypatch):
    import socket

    import diffusion_rl.rewards as rewards

    monkeypatch.setattr(rewards, "make_reward", lambda *a, **k: pytest.fail("the reward was built"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--reward", "jpeg_incompressibility", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: serve-reward: cannot listen on 127.0.0.1:{port} (") and err.endswith(
        "); pick another --port"
    ), err
    assert len(err.splitlines()) == 1


def test_a_missing_or_wrong_token_is_a_start_up_error_naming_the_401(local_server, monkeypatch):
    url = local_server(_mean_brightness, token="s3cret")
    monkeypatch.delenv("DIFFUSION_RL_REWARD_TOKEN", raising=False)
    with pytest.raises(UserError) as missing:
        make_reward("remote", url=url, retries=0)
    monkeypatch.setenv("DIFFUSION_RL_REWARD_TOKEN", "wrong")
    with pytest.raises(UserError) as wrong:
        make_reward("remote", url=url, retries=0)
    for error, says in ((missing, "no token was sent"), (wrong, "the token from $DIFFUSION_RL_REWARD_TOKEN is not")):
        message = str(error.value)
        assert "\n" not in message and f"reward server at {url} refused" in message and "HTTP 401" in message
        assert says in message and "wrong" not in message.replace("missing or wrong bearer token", ""), message
    monkeypatch.setenv("DIFFUSION_RL_REWARD_TOKEN", "s3cret")
    assert make_reward("remote", url=url, retries=0)(_images(1), ["p"], [{}]).shape == (1,)


def test_a_401_after_start_up_stops_the_reward_at_once_naming_it(fake_server):
    def respond(method, path, body):  # a server restarted with another token: health answers, /score refuses
        return (200, {"status": "ok"}) if method == "GET" else (401, {"error": "missing or wrong bearer token"})

    remote = _client(fake_server(respond).url, retries=3, max_failed_batches=None)
    with pytest.raises(RemoteRewardError, match=r"refused the request: HTTP 401 .*missing or wrong bearer token"):
        remote(_images(2), ["p", "q"], [{}, {}])


def test_training_with_a_wrong_remote_token_stops_at_start_in_one_line(local_server, train_argv, monkeypatch, capsys):
    from diffusion_rl.cli import main as cli_main

    url = local_server(_mean_brightness, token="s3cret")
    monkeypatch.setenv("DIFFUSION_RL_REWARD_TOKEN", "wrong")
    assert cli_main(train_argv("rewards.0.name=remote", f"rewards.0.kwargs={{url: '{url}', retries: 0}}")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"diffusion-rl: error: remote: the reward server at {url} refused the request: HTTP 401")


@pytest.mark.parametrize(
    ("flags", "got"), [(["--max-batch", "0"], "0, 20.0, 64"), (["--max-wait-ms", "-1"], "64, -1.0, 64"),
                       (["--max-queue", "0"], "64, 20.0, 0"), (["--max-wait-ms", "nan"], "64, nan, 64")]
)  # fmt: skip
def test_batching_settings_out_of_range_are_one_line_before_the_reward_is_built(flags, got, capsys, monkeypatch):
    import diffusion_rl.rewards as rewards

    monkeypatch.setattr(rewards, "make_reward", lambda *a, **k: pytest.fail("the reward was built"))
    assert main(["--reward", "jpeg_incompressibility", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: serve-reward: need --max-batch >= 1, --max-wait-ms >= 0 and --max-queue >= 1; got {got}"
