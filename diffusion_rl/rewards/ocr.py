"""`ocr`: how well an image shows the text it was asked for, read with rapidocr (PP-OCR models on onnxruntime).

The target text is metadata["ground_truth"], else the first double-quoted string of the prompt. The recognised
lines are joined in reading order and scored with `text_match_score` (1 = the target appears, 0 = nothing like
it). A sample without a target is failed (NaN), with the reason logged.

Runs offline on CPU: rapidocr's wheel ships its detection and recognition models. One engine per process and
configuration, created on first use and shared by every reward instance that asks for the same settings.
Install with `pip install 'diffusion-rl[ocr]'`; without rapidocr or onnxruntime, creating the reward is a UserError
naming the missing package (at start-up, not at the first batch).

Speed/accuracy knobs (measured on rendered DejaVu text, 2 CPU cores):
- `det_limit_side_len` / `det_limit_type`: the size the *detector* sees. With type "max" (default) a larger image
  is shrunk so its longer side is at most `det_limit_side_len` and a smaller one is left alone; recognition always
  reads the text lines at full resolution. 320 reads 64–512 px images as well as 736 and costs far less. Raise
  it (640–960) for large images with small text. Type "min" instead enlarges images whose shorter side is below
  the limit (rapidocr's default, 736: slow for small images, no accuracy gain at 48–64 px in our tests).
- `min_image_side`: enlarge images whose shorter side is below this before OCR (bicubic). Off by default:
  enlarging 32–64 px renders to 128/256 px did not improve recognition (and cost time).
- `num_threads`: onnxruntime threads per model, 1 by default: on a 2-core machine shared with another busy process,
  1 thread read 2–3× more images per second than onnxruntime's one-thread-per-core default (its threads spin
  while waiting for each other). For more throughput run more reward processes (e.g. `serve-reward` replicas).

Throughput (batch 16, rendered 1–2 word texts, defaults, shared 2-core machine): ~38 images/s at 64 px, ~12.5
at 256 px, ~9 at 512 px, ~8 at 1024 px; with rapidocr's own defaults (det 736 "min", all cores): ~1.5 at 64 px.
"""

import importlib
import logging
import threading
from typing import Any

import numpy as np

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS
from diffusion_rl.rewards.text_match import target_text, text_match_score

logger = logging.getLogger(__name__)

DET_LIMIT_TYPES = ("max", "min")
REQUIRED_PACKAGES = ("rapidocr", "onnxruntime")  # pyproject's `ocr` extra
INSTALL_COMMAND = "pip install 'diffusion-rl[ocr]'"

_ENGINES: dict[tuple, Any] = {}  # engine settings -> (RapidOCR engine, lock serialising its calls)
_ENGINES_LOCK = threading.Lock()


def _engine(settings: tuple[tuple[str, Any], ...]) -> tuple[Any, threading.Lock]:
    """The process-wide rapidocr engine for these settings, created on first use."""
    with _ENGINES_LOCK:
        if settings not in _ENGINES:
            try:
                from rapidocr import RapidOCR
            except ImportError as e:
                raise UserError(
                    f"the 'ocr' reward needs rapidocr and onnxruntime ({e}); install them with {INSTALL_COMMAND}"
                ) from None
            # Only settings that keep rapidocr on its bundled models: asking for another model downloads it.
            # log level "error": rapidocr warns on every image in which it finds no text, a normal outcome here.
            params = {"Global.log_level": "error", **dict(settings)}
            _ENGINES[settings] = (RapidOCR(params=params), threading.Lock())
        return _ENGINES[settings]


def check_installed() -> None:
    """UserError naming the first of rapidocr / onnxruntime that cannot be imported, and the install command."""
    for package in REQUIRED_PACKAGES:
        try:
            importlib.import_module(package)
        except ImportError as e:
            raise UserError(
                f"the 'ocr' reward needs the {package} package, which cannot be imported ({e}); install it with "
                f"{INSTALL_COMMAND}"
            ) from None


@REWARDS.register("ocr")
class OcrReward:
    """Reward = text_match_score(OCR(image), target text), in [0, 1]; NaN for a sample without a target."""

    def __init__(
        self,
        det_limit_side_len: int = 320,
        det_limit_type: str = "max",
        min_confidence: float = 0.0,
        use_cls: bool = False,
        min_image_side: int = 0,
        num_threads: int | None = 1,
    ):
        """
        det_limit_side_len: the detector's size limit in pixels (see det_limit_type).
        det_limit_type: "max" = shrink images whose longer side exceeds the limit; "min" = enlarge images whose
            shorter side is below it.
        min_confidence: recognised lines with a lower confidence (0–1) are ignored; 0 keeps every line.
        use_cls: run the 180°-rotation classifier on each text line (for upside-down text; slower).
        min_image_side: enlarge images whose shorter side is below this many pixels before OCR; 0 = never.
        num_threads: onnxruntime threads per model; None = onnxruntime's default (one per core).
        """
        if not isinstance(det_limit_side_len, int) or det_limit_side_len < 32:
            raise UserError(f"ocr: det_limit_side_len must be an integer >= 32 pixels, got {det_limit_side_len!r}")
        if det_limit_type not in DET_LIMIT_TYPES:
            raise UserError(f"ocr: det_limit_type must be one of {', '.join(DET_LIMIT_TYPES)}; got {det_limit_type!r}")
        if not 0.0 <= min_confidence <= 1.0:
            raise UserError(f"ocr: min_confidence must be in [0, 1], got {min_confidence}")
        if not isinstance(min_image_side, int) or min_image_side < 0:
            raise UserError(f"ocr: min_image_side must be an integer >= 0 (0 = off), got {min_image_side!r}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise UserError(f"ocr: num_threads must be a positive integer or null, got {num_threads!r}")
        check_installed()  # a missing install fails here, at start-up, not on the first batch
        self.min_confidence = float(min_confidence)
        self.use_cls = bool(use_cls)
        self.min_image_side = min_image_side
        settings = {"Det.limit_side_len": det_limit_side_len, "Det.limit_type": det_limit_type}
        if num_threads is not None:
            settings["EngineConfig.onnxruntime.intra_op_num_threads"] = num_threads
        self._settings = tuple(sorted(settings.items()))

    def recognize(self, image_HW3: np.ndarray) -> str:
        """The text rapidocr reads in one uint8 RGB image: its lines in reading order, joined with spaces."""
        engine, lock = _engine(self._settings)
        bgr = np.ascontiguousarray(self._enlarged(image_HW3)[..., ::-1])  # rapidocr takes arrays as BGR (OpenCV)
        with lock:  # an engine call changes the engine's settings: one call at a time
            # use_det/use_cls/use_rec and text_score persist into later calls: pass them every time.
            result = engine(bgr, use_det=True, use_cls=self.use_cls, use_rec=True, text_score=self.min_confidence)
        texts = getattr(result, "txts", None)
        return " ".join(texts) if texts else ""

    def _enlarged(self, image_HW3: np.ndarray) -> np.ndarray:
        height, width = image_HW3.shape[:2]
        if not self.min_image_side or min(height, width) >= self.min_image_side:
            return image_HW3
        from PIL import Image

        scale = self.min_image_side / min(height, width)
        size = (round(width * scale), round(height * scale))
        return np.asarray(Image.fromarray(image_HW3).resize(size, Image.Resampling.BICUBIC))

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        scores = np.full(len(images), np.nan, dtype=np.float32)
        missing = []
        for i, (image, prompt, meta) in enumerate(zip(images, prompts, metadata)):
            target = target_text(prompt, meta)
            if target is None:
                missing.append(i)
                continue
            scores[i] = text_match_score(self.recognize(image), target)
        if missing:
            logger.warning(
                "ocr: %d of %d samples failed: no text to check (no metadata 'ground_truth' and no double-quoted "
                "text in the prompt), e.g. sample %d, prompt %r",
                len(missing),
                len(images),
                missing[0],
                prompts[missing[0]][:120],
            )
        return scores
