"""`remote`: score images with a reward that runs in another process or machine (`diffusion-rl serve-reward`).

Wire format (JSON only, never pickle), served by `diffusion_rl.rewards.server`:

    GET  {url}/health  -> 200 {"status": "ok", "reward": name, ...}
    POST {url}/score   {"images": [base64 PNG, ...], "prompts": [...], "metadata": [{...}, ...]}
                       -> 200 {"scores": [float | null, ...]}   (null = failed sample; "error" may say why)

    Shapes: an image is one base64 PNG of uint8 [H, W, 3] (RGB); a video (uint8 [F, H, W, 3]) is a list of F of
    them, its frames in order (every video of a request has the same F and size). An edit's condition images go
    as metadata[i]["condition_images"]: a list of base64 PNGs, each [H, W, 3]; the server decodes them back to
    arrays before calling its reward. The trainer sends videos only to a `remote` reward made with video: true
    (the server's reward then scores whole videos); otherwise it sends the frames as images and reduces their
    scores itself (rewards.N.frames).

Failure rules (shared with the `vlm` judge through `http_json` and `call_with_retries`):
- connection errors, timeouts, HTTP 5xx, 408 and 429 are retried, `retries` times, with exponential backoff
  (backoff, 2·backoff, 4·backoff, ... seconds, capped at 60 s); any other 4xx is not retried: the request is wrong.
- a batch is sent in requests of at most `chunk_size` images; a request that still fails has all its samples
  failed (NaN, counted, logged), never scored 0.
- after `max_failed_batches` failed requests in a row (requests of `chunk_size` images, not trainer batches; the
  kwarg keeps its old name) the reward raises RemoteRewardError: the server is gone. A later call asks
  {url}/health first (at most every 30 s) and goes on if the server is back; else it raises at once.
- an unreachable {url}/health when the reward is created is a UserError naming the URL.

Auth: when the server has a token, the reward sends it as "Authorization: Bearer <token>": `token`, else the
environment variable named by `token_env` (default DIFFUSION_RL_REWARD_TOKEN, the one `serve-reward` reads too).
A 401 is not retried. When the reward is created it asks {url}/metrics, which needs the token as /score does, so a
missing or wrong token is a UserError naming the 401 at start-up, not failed samples after the model has loaded; a
401 later (the server restarted with another token) raises RemoteRewardError at once.
"""

import base64
import http.client
import io
import json
import logging
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from diffusion_rl.data.condition_images import METADATA_KEY
from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_BACKOFF_S = 60.0
PROBE_INTERVAL_S = 30.0  # once given up on, the server is asked /health at most this often
RETRYABLE_4XX = (408, 429)  # request timeout, too many requests: the server asks to try again later
TOKEN_ENV = "DIFFUSION_RL_REWARD_TOKEN"  # also read by `serve-reward`


class HttpError(Exception):
    """An HTTP request that failed; `retryable` says whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool, status: int | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.status = status


class RemoteRewardError(RuntimeError):
    """The reward server failed too many requests in a row: it is down or broken."""


# ---- HTTP helpers (also used by the vlm judge) ----


def http_json(
    url: str, payload: Any = None, *, timeout: float, headers: dict[str, str] | None = None, method: str | None = None
) -> Any:
    """Send `payload` as JSON (POST; GET when None) and return the decoded JSON answer, or raise HttpError."""
    data = None if payload is None else json.dumps(payload, default=_json_default).encode("utf-8")
    request = urllib.request.Request(url, data=data, method=method or ("GET" if data is None else "POST"))
    request.add_header("Accept", "application/json")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        retryable = e.code >= 500 or e.code in RETRYABLE_4XX
        raise HttpError(f"HTTP {e.code} from {url}: {_error_body(e)}", retryable=retryable, status=e.code) from None
    except (OSError, http.client.HTTPException) as e:  # refused, reset, DNS, timeout (URLError is an OSError)
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise HttpError(f"no answer from {url} ({type(reason).__name__}: {reason})", retryable=True) from None
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HttpError(f"{url} answered with invalid JSON ({e}): {body[:200]!r}", retryable=False) from None


def call_with_retries(fn: Callable[[], T], *, retries: int, backoff: float, what: str) -> T:
    """fn(), tried again up to `retries` times on a retryable HttpError, sleeping backoff·2^attempt in between."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except HttpError as e:
            if not e.retryable or attempt == retries:
                raise
            delay = min(backoff * 2**attempt, MAX_BACKOFF_S)
            logger.info("%s: %s; retry %d of %d in %.2g s", what, e, attempt + 1, retries, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _error_body(error: urllib.error.HTTPError) -> str:
    try:
        text = error.read().decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException):
        return error.reason or ""
    try:  # our server and OpenAI-style servers put the message in "error" (a string or {"message": ...})
        detail = json.loads(text).get("error", text)
        text = detail.get("message", str(detail)) if isinstance(detail, dict) else str(detail)
    except (json.JSONDecodeError, AttributeError):
        pass
    return text.strip()[:500] or str(error.reason)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable; reward metadata must be plain JSON values")


def check_http_url(url: Any, who: str) -> str:
    """`url` without a trailing slash, or UserError when it is not an http(s) URL with a host."""
    parsed = urllib.parse.urlparse(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise UserError(f"{who}: url must be an http(s) URL like http://127.0.0.1:8000, got {url!r}")
    return url.rstrip("/")


# ---- image wire format ----


def encode_png_base64(image_HW3: np.ndarray) -> str:
    """One uint8 RGB image as base64 PNG text (lossless; compress level 1: fast, PNG size matters little here)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image_HW3).save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png_base64(text: str) -> np.ndarray:
    """The uint8 RGB image [H, W, 3] in base64 image text (a "data:image/...;base64," prefix is allowed)."""
    from PIL import Image

    if text.startswith("data:"):
        text = text.partition(",")[2]
    raw = base64.b64decode(text, validate=True)
    with Image.open(io.BytesIO(raw)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)


def encode_sample(sample: np.ndarray) -> str | list[str]:
    """An image [H, W, 3] as base64 PNG; a video [F, H, W, 3] as the list of its frames' (the wire format)."""
    return [encode_png_base64(frame) for frame in sample] if sample.ndim == 4 else encode_png_base64(sample)


def wire_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """A sample's metadata as JSON can carry it: condition images as base64 PNGs (the arrays stay untouched)."""
    if METADATA_KEY not in metadata:
        return metadata
    return {**metadata, METADATA_KEY: [encode_png_base64(np.asarray(image)) for image in metadata[METADATA_KEY]]}


# ---- the reward ----


@REWARDS.register("remote")
class RemoteReward:
    """Scores from a reward server; NaN for the samples of a request the server failed (after retries)."""

    def __init__(
        self,
        url: str,
        timeout: float = 120.0,
        retries: int = 3,
        backoff: float = 1.0,
        chunk_size: int = 64,
        max_failed_batches: int | None = 3,
        check_health: bool = True,
        token: str | None = None,
        token_env: str | None = TOKEN_ENV,
        video: bool = False,
    ):
        """
        url: the server's base URL, e.g. http://127.0.0.1:8000 (from `diffusion-rl serve-reward`).
        timeout: seconds to wait for one request's answer (the server scores the whole chunk in that time).
        retries: how many times a failed request is tried again (connection errors, timeouts, 5xx, 408, 429).
        backoff: seconds before the first retry; doubled for each further one.
        chunk_size: images per request; a batch is sent in chunks of at most this many.
        max_failed_batches: raise RemoteRewardError after this many failed requests (of up to chunk_size images
            each, counted across calls) in a row; null = never. (The name is kept for existing configs.)
        check_health: ask {url}/health (and /metrics, for the token) when created, so a wrong URL or token fails at
            start, not at the first batch.
        token: the server's bearer token; prefer token_env, which keeps it out of configs.
        token_env: the environment variable holding the token when `token` is not given (unset: no token sent).
        video: send whole videos (the server's reward scores videos, e.g. `serve-reward --reward
            temporal_consistency`); false: the trainer sends a video's frames as images (rewards.N.frames).
        """
        self.video = bool(video)  # rewards/video.py: a reward that takes whole videos
        self.url = check_http_url(url, "remote")
        if timeout <= 0 or retries < 0 or backoff < 0:
            raise UserError(
                f"remote: need timeout > 0, retries >= 0, backoff >= 0; got {timeout}, {retries}, {backoff}"
            )
        if chunk_size < 1:
            raise UserError(f"remote: chunk_size must be >= 1, got {chunk_size}")
        if max_failed_batches is not None and max_failed_batches < 1:
            raise UserError(
                f"remote: max_failed_batches must be >= 1 or null (never give up), got {max_failed_batches}"
            )
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        key = token if token is not None else (os.environ.get(token_env) if token_env else None)
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.chunk_size = int(chunk_size)
        self.max_failed_batches = max_failed_batches
        self.failed_batches = 0  # failed requests (chunks), total over this reward's life, for logs and tests
        self.failed_samples = 0
        self._failures_in_a_row = 0
        self._probe_failed_at = -float("inf")  # time.monotonic() of the last /health probe that failed
        if check_health:
            try:
                info = call_with_retries(self._health, retries=self.retries, backoff=self.backoff, what="remote")
            except HttpError as e:
                raise UserError(
                    f"remote: the reward server at {self.url} does not answer {self.url}/health ({e}); start it "
                    "with `diffusion-rl serve-reward --reward NAME --port N` or fix the url"
                ) from None
            logger.info("remote: reward server at %s is up (%s)", self.url, info)
            self._check_token(token_env if token is None else None)

    def _check_token(self, token_env: str | None) -> None:
        """A UserError naming the 401 when the server refuses our token (or its absence) on /metrics, whose auth is
        /score's; any other answer (a server without /metrics, our Prometheus text that is not JSON) says nothing."""
        try:
            http_json(f"{self.url}/metrics", timeout=min(self.timeout, 10.0), headers=self._headers)
        except HttpError as e:
            if e.status in (401, 403):
                raise UserError(self._refused_message(e, token_env)) from None

    def _refused_message(self, error: HttpError, token_env: str | None = None) -> str:
        if not self._headers:
            sent = f"no token was sent (give the server's token in ${token_env or TOKEN_ENV}, or token_env)"
        elif token_env:
            sent = f"the token from ${token_env} is not the server's"
        else:
            sent = "the token given is not the server's (prefer token_env to a token in the config)"
        return f"remote: the reward server at {self.url} refused the request: {error}; {sent}"

    def _health(self, timeout: float | None = None) -> Any:
        return http_json(f"{self.url}/health", timeout=timeout or self.timeout, headers=self._headers)

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        scores = np.full(len(images), np.nan, dtype=np.float32)
        for start in range(0, len(images), self.chunk_size):
            chunk = slice(start, start + self.chunk_size)
            self._check_not_gone()
            try:
                scores[chunk] = self._score_chunk(images[chunk], prompts[chunk], metadata[chunk])
            except HttpError as e:
                if e.status in (401, 403):  # every later request would be refused too
                    raise RemoteRewardError(self._refused_message(e)) from None
                self._count_failure(len(images[chunk]), e)
            else:
                self._failures_in_a_row = 0
        return scores

    def _score_chunk(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        payload = {"images": [encode_sample(sample) for sample in images], "prompts": list(prompts),
                   "metadata": [wire_metadata(m) for m in metadata]}  # fmt: skip
        answer = call_with_retries(
            lambda: http_json(f"{self.url}/score", payload, timeout=self.timeout, headers=self._headers),
            retries=self.retries,
            backoff=self.backoff,
            what=f"remote {self.url}",
        )
        raw = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(raw, list) or len(raw) != len(images):
            got = f"{len(raw)} scores" if isinstance(raw, list) else repr(answer)[:200]
            raise HttpError(f"{self.url}/score answered {got} for {len(images)} images", retryable=False)
        if answer.get("error"):
            logger.warning("remote: the reward server reports: %s", answer["error"])
        try:
            return np.array([np.nan if s is None else float(s) for s in raw], dtype=np.float32)
        except (TypeError, ValueError):
            raise HttpError(f"{self.url}/score answered non-numeric scores: {raw[:5]!r}", retryable=False) from None

    def _count_failure(self, n_samples: int, error: HttpError) -> None:
        self.failed_batches += 1
        self.failed_samples += n_samples
        self._failures_in_a_row += 1
        logger.warning(
            "remote: a request of %d images failed after %d tries (%s); its samples are failed (NaN). %d requests "
            "failed in a row",
            n_samples,
            self.retries + 1 if error.retryable else 1,
            error,
            self._failures_in_a_row,
        )
        if self.max_failed_batches is not None and self._failures_in_a_row >= self.max_failed_batches:
            raise RemoteRewardError(self._gone_message(error)) from None

    def _check_not_gone(self) -> None:
        """After too many failures, go on only if the server answers /health again."""
        if self.max_failed_batches is None or self._failures_in_a_row < self.max_failed_batches:
            return
        # At most one probe per PROBE_INTERVAL_S: callers retry sample by sample, and a hung server would make
        # each of those calls wait for a probe's timeout.
        if time.monotonic() - self._probe_failed_at < PROBE_INTERVAL_S:
            raise RemoteRewardError(self._gone_message(None))
        try:
            self._health(timeout=min(self.timeout, 10.0))
        except HttpError as e:
            self._probe_failed_at = time.monotonic()
            raise RemoteRewardError(self._gone_message(e)) from None
        logger.warning("remote: the reward server at %s answers again", self.url)
        self._failures_in_a_row = 0

    def _gone_message(self, error: HttpError | None) -> str:
        last = f" (last: {error})" if error is not None else ""
        return (
            f"the reward server at {self.url} failed {self._failures_in_a_row} requests in a row{last} "
            f"(max_failed_batches={self.max_failed_batches}); is it still running? ({self.failed_samples} samples "
            "failed in all)"
        )
