"""`vlm`: a vision-language model judges each image through an OpenAI-compatible chat API (vLLM, SGLang, ...).

Each image goes as a PNG data URL with a text built from `template` ({prompt} and {ground_truth} are filled in;
write literal braces as {{ and }}) to {base_url}/chat/completions; requests run `concurrency` at a time.

- mode "score": the first number in the answer, divided by `scale` (the default template asks for 0–10, scale 10);
  with `dimensions`, the mean over those names of lines "<Name> Score (lo-hi): value", each mapped to [0, 1].
- mode "ocr": the answer is a transcription, scored against the target text (metadata["ground_truth"], else the
  prompt's first quoted string) with the OCR rule of `text_match` (1 = the target appears).
- mode "pairwise": a preference, not a reward: `compare(images_a, images_b, prompts, metadata)` shows both images
  (a first) and reads "Image 1 is better" (1.0) or "Image 2 is better" (0.0); `pairwise_win_rate` uses it.
- mode "reward_model": a reward model without text output (HPSv3), asked through vLLM's pooling API: POST
  {server root}/pooling with the same chat messages; the score is the first number of the pooled vector.
- mode "edit": instruction following of an edit. One request shows the source image(s) (the sample's
  metadata["condition_images"]) and then the result, with the instruction as {prompt}; the answer is read as in
  mode "score". A sample without condition images fails (NaN).

`preset` (unifiedreward, unifiedreward_pairwise, hpsv3) sets the mode, template and dimensions of a published judge
model (vlm_presets.py); kwargs given explicitly win.

A "<think>...</think>" part of the answer is ignored. Connection errors, timeouts, 5xx, 408 and 429 are retried
with exponential backoff; other 4xx are not. A sample that still fails, or whose answer has no number, is failed
(NaN, counted in `failed_samples`, logged), never scored 0. A server that does not answer {base_url}/models when
the reward is created is a UserError naming the URL.
"""

import logging
import os
import re
import string
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from diffusion_rl.data.condition_images import METADATA_KEY
from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS
from diffusion_rl.rewards.remote import HttpError, call_with_retries, check_http_url, encode_png_base64, http_json
from diffusion_rl.rewards.text_match import target_text, text_match_score
from diffusion_rl.rewards.vlm_presets import (
    PRESETS,
    TEMPLATES,
    AnswerError,
    parse_dimensions,
    parse_pooling,
    parse_preference,
    without_thinking,
)

logger = logging.getLogger(__name__)

MODES = ("score", "ocr", "pairwise", "reward_model", "edit")
PLACEHOLDERS = ("prompt", "ground_truth")
DEFAULT_TEMPLATES = {
    "score": (
        'This image was generated for the prompt "{prompt}". Rate how well it matches the prompt and how good it '
        "looks, from 0 (not at all) to 10 (perfect). Reply with the number only."
    ),
    "ocr": "Write out all the text that appears in this image, exactly as written. Reply with the text only.",
    "pairwise": TEMPLATES["unifiedreward_pairwise"],
    "reward_model": TEMPLATES["hpsv3"],
    "edit": (
        'The last image is the result of editing the image(s) before it with the instruction "{prompt}". Rate from 0 '
        "(not done) to 10 (perfect) how well the result carries out the instruction while keeping everything the "
        "instruction does not ask to change. Reply with the number only."
    ),
}
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def parse_score(answer: str) -> float:
    """The first number in `answer` (after any <think> part), or AnswerError."""
    match = _NUMBER.search(without_thinking(answer))
    if match is None:
        raise AnswerError(f"no number in the answer {answer[:200]!r}")
    return float(match.group())


def _template_fields(template: str) -> set[str]:
    """The placeholders `template` uses, or UserError when it has others or unbalanced braces."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise UserError(f"vlm: bad template ({e}); write literal braces as {{{{ and }}}}") from None
    unknown = sorted({f for f in fields if f not in PLACEHOLDERS})
    if unknown:
        raise UserError(
            f"vlm: the template uses unknown placeholders {unknown}; known: {{prompt}}, {{ground_truth}} "
            "(write literal braces as {{ and }})"
        )
    return set(fields)


def _v1_url(base_url: str) -> str:
    """The API base: `base_url`, with /v1 added when it has no path (http://host:8000 → http://host:8000/v1)."""
    url = check_http_url(base_url, "vlm")
    return url + "/v1" if urllib.parse.urlparse(url).path in ("", "/") else url


@REWARDS.register("vlm")
class VlmJudge:
    """A reward read from a VLM's answer about each image; NaN where the request or the answer failed."""

    def __init__(
        self,
        base_url: str,
        model: str,
        mode: str | None = None,
        template: str | None = None,
        preset: str | None = None,
        dimensions: list[str] | None = None,
        scale: float = 10.0,
        api_key: str | None = None,
        api_key_env: str | None = None,
        concurrency: int = 8,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        max_tokens: int = 256,
        temperature: float = 0.0,
        check_server: bool = True,
    ):
        """
        base_url: the OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1 (/v1 is added to a URL without a path).
        model: the served model name, as in {base_url}/models.
        mode: "score" (a number in the answer; default), "ocr" (a transcription, scored against the target text),
            "pairwise" (compare two images: a preference for pairwise_win_rate), "reward_model" (the /pooling API)
            or "edit" (the source image(s) and the result in one request; scored as "score").
        template: the text sent with each image; {prompt} and {ground_truth} are filled in. None = the preset's,
            else a default for the mode.
        preset: unifiedreward, unifiedreward_pairwise or hpsv3: mode, template and dimensions of that judge.
        dimensions: in mode "score", average the named "<Name> Score (lo-hi): value" lines instead of reading the
            first number (unifiedreward: Alignment, Coherence, Style).
        scale: in mode "score", the number is divided by this (10 for the default 0–10 template).
        api_key: sent as "Authorization: Bearer ..."; prefer api_key_env, which keeps the key out of configs.
        api_key_env: name of the environment variable that holds the API key.
        concurrency: requests in flight at once.
        timeout: seconds to wait for one answer.
        retries: how many times a failed request is tried again (connection errors, timeouts, 5xx, 408, 429).
        backoff: seconds before the first retry; doubled for each further one.
        max_tokens, temperature: sampling settings sent with each request.
        check_server: ask {base_url}/models when created, so a wrong URL or model fails at start.
        """
        if preset is not None:
            if preset not in PRESETS:
                raise UserError(f"vlm: unknown preset {preset!r}; known: {', '.join(PRESETS)}")
            if mode is not None and mode != PRESETS[preset]["mode"]:
                raise UserError(f"vlm: preset {preset} is mode {PRESETS[preset]['mode']!r}, not {mode!r}")
            mode = PRESETS[preset]["mode"]
            template = TEMPLATES[preset] if template is None else template
            dimensions = PRESETS[preset].get("dimensions") if dimensions is None else dimensions
        self.dimension_range = PRESETS[preset].get("dimension_range") if preset is not None else None
        mode = "score" if mode is None else mode
        if mode not in MODES:
            raise UserError(f"vlm: unknown mode {mode!r}; known: {', '.join(MODES)}")
        if dimensions is not None and (mode not in ("score", "edit") or not dimensions):
            raise UserError(
                f"vlm: dimensions (a non-empty list of names) go with mode score or edit, got {dimensions!r}"
            )
        self.dimensions = list(dimensions) if dimensions else None
        self.url = _v1_url(base_url)
        if not isinstance(model, str) or not model:
            raise UserError(f"vlm: model must be the served model's name, got {model!r}")
        self.template = DEFAULT_TEMPLATES[mode] if template is None else template
        self._needs_target = mode == "ocr" or "ground_truth" in _template_fields(self.template)
        if not scale > 0:
            raise UserError(f"vlm: scale must be > 0, got {scale}")
        if concurrency < 1 or timeout <= 0 or retries < 0 or backoff < 0 or max_tokens < 1:
            raise UserError(
                "vlm: need concurrency >= 1, timeout > 0, retries >= 0, backoff >= 0, max_tokens >= 1; got "
                f"{concurrency}, {timeout}, {retries}, {backoff}, {max_tokens}"
            )
        self.model, self.mode, self.scale = model, mode, float(scale)
        self.concurrency, self.timeout, self.retries, self.backoff = concurrency, float(timeout), retries, backoff
        self.max_tokens, self.temperature = max_tokens, temperature
        self._headers = {"Authorization": f"Bearer {key}"} if (key := _api_key(api_key, api_key_env)) else {}
        self.failed_samples = 0  # total over this reward's life, for logs and tests
        if check_server:
            self._check_server()

    def _check_server(self) -> None:
        url = f"{self.url}/models"
        try:
            listing = call_with_retries(
                lambda: http_json(url, timeout=self.timeout, headers=self._headers),
                retries=self.retries,
                backoff=self.backoff,
                what="vlm",
            )
        except HttpError as e:
            if e.status == 404:  # a server without the listing endpoint: it answers, which is what we check
                logger.info("vlm: %s has no model list (404); not checking the model name", url)
                return
            hint = "check api_key / api_key_env" if e.status in (401, 403) else "start the server or fix base_url"
            raise UserError(f"vlm: the server at {self.url} does not answer {url} ({e}); {hint}") from None
        served = (
            [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)] if isinstance(listing, dict) else []
        )
        if served and self.model not in served:
            raise UserError(
                f"vlm: model {self.model!r} is not served at {self.url}; served: {', '.join(map(str, served))}"
            )

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        if self.mode == "pairwise":
            raise TypeError(
                "vlm mode=pairwise compares two images and gives no per-image score: use it as the `preference` of "
                "pairwise_win_rate"
            )
        if self.mode == "edit":  # the sources first, then the result: one request per sample
            shown = [(*(m.get(METADATA_KEY) or []), im) for im, m in zip(images, metadata)]
            return self._run(self._score_one, shown, prompts, metadata)
        return self._run(self._score_one, [(im,) for im in images], prompts, metadata)

    def compare(
        self, images_a: np.ndarray, images_b: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]
    ) -> np.ndarray:
        """P(a better than b) per pair: 1.0 or 0.0 from the judge's verdict, NaN where it failed (mode pairwise)."""
        if self.mode != "pairwise":
            raise TypeError(f"vlm mode={self.mode!r} scores single images; compare() needs mode pairwise")
        return self._run(self._score_one, list(zip(images_a, images_b)), prompts, metadata)

    def _run(self, fn, images: list[tuple[np.ndarray, ...]], prompts, metadata) -> np.ndarray:
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(len(images), 1))) as pool:
            results = list(pool.map(fn, images, prompts, metadata))
        errors = [(i, error) for i, (_, error) in enumerate(results) if error is not None]
        if errors:
            self.failed_samples += len(errors)
            i, error = errors[0]
            logger.warning(
                "vlm: %d of %d samples failed (NaN); first: sample %d: %s", len(errors), len(images), i, error
            )
        return np.array([score for score, _ in results], dtype=np.float32)

    def _score_one(
        self, images: tuple[np.ndarray, ...], prompt: str, metadata: dict[str, Any]
    ) -> tuple[float, str | None]:
        """(score, None), or (NaN, why the sample failed)."""
        if self.mode == "edit" and len(images) < 2:
            return np.nan, "no condition images to compare the result with (metadata 'condition_images')"
        target = target_text(prompt, metadata)
        if target is None and self._needs_target:
            return np.nan, "no target text (no metadata 'ground_truth' and no double-quoted text in the prompt)"
        text = self.template.format(prompt=prompt, ground_truth=target or "")
        try:
            if self.mode == "reward_model":
                return parse_pooling(self._request("pooling", images, text)), None
            answer = self._ask(images, text)
            if self.mode == "ocr":
                return text_match_score(without_thinking(answer), target), None
            if self.mode == "pairwise":
                return parse_preference(answer), None
            if self.dimensions:
                return parse_dimensions(answer, self.dimensions, self.dimension_range), None
            return parse_score(answer) / self.scale, None
        except (HttpError, AnswerError) as e:
            return np.nan, str(e)

    def _request(self, endpoint: str, images: tuple[np.ndarray, ...], text: str) -> Any:
        """The JSON answer of chat/completions (on the /v1 API) or pooling (vLLM: on the server's root)."""
        content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + encode_png_base64(im)}}
                   for im in images]  # fmt: skip
        payload: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": [
            *content, {"type": "text", "text": text}]}]}  # fmt: skip
        if endpoint == "pooling":
            url = self.url.removesuffix("/v1") + "/pooling"
            payload["encoding_format"] = "float"
        else:
            url = f"{self.url}/chat/completions"
            payload.update(max_tokens=self.max_tokens, temperature=self.temperature)
        return call_with_retries(
            lambda: http_json(url, payload, timeout=self.timeout, headers=self._headers),
            retries=self.retries,
            backoff=self.backoff,
            what="vlm",
        )

    def _ask(self, images: tuple[np.ndarray, ...], text: str) -> str:
        answer = self._request("chat", images, text)
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise AnswerError(
                f"unexpected answer format (no choices[0].message.content): {str(answer)[:200]}"
            ) from None
        if not isinstance(content, str):  # null (e.g. only reasoning) or a list of parts
            raise AnswerError(f"the answer has no text content: {str(content)[:200]}")
        return content


def _api_key(api_key: str | None, api_key_env: str | None) -> str | None:
    if api_key is not None and api_key_env is not None:
        raise UserError("vlm: give api_key or api_key_env, not both")
    if api_key_env is not None:
        key = os.environ.get(api_key_env)
        if not key:
            raise UserError(f"vlm: api_key_env names {api_key_env!r}, but that environment variable is not set")
        return key
    return api_key
