"""`geneval`: a GenEval-style compositional reward (object presence, count, colour, relative position).

OWLv2 detects the classes a prompt's GenEval metadata names (detector.py); GenEval's rules judge the detections
(rules.py). The score is the share of the metadata's clauses that hold (include and exclude clauses alike), with
`count_credit: true` a clause short of its count earning part of its point, or with `strict: true` GenEval's own 0/1
verdict. A sample without GenEval metadata fails (NaN), with the reason logged.
ShapesWorld scenes convert to GenEval metadata with `shapes.scene_metadata`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS
from diffusion_rl.rewards.geneval.rules import GenEvalSpec, evaluate, parse_metadata

logger = logging.getLogger(__name__)


@REWARDS.register("geneval")
class GenEvalReward:
    """Share of GenEval clauses an image satisfies, in [0, 1] (strict: 1 only when all hold)."""

    def __init__(
        self,
        detector_path: str,
        threshold: float = 0.2,
        counting_threshold: float = 0.3,
        nms_iou: float = 0.5,
        max_objects: int = 16,
        strict: bool = False,
        count_credit: bool = False,
        device: str | None = None,
        dtype: str = "float32",
        batch_size: int = 8,
    ):
        """
        detector_path: a local OWLv2 directory (e.g. google/owlv2-base-patch16-ensemble).
        threshold: detection confidence (sigmoid of OWLv2's logit) above which a box counts as the object.
        counting_threshold: the same for prompts tagged "counting" (GenEval raises it there).
        nms_iou: boxes overlapping a more confident one of the class by more than this are dropped.
        max_objects: detections kept per class.
        strict: GenEval's verdict (1 when every clause holds, else 0) instead of the share of clauses.
        count_credit: an include clause short of its count earns n / count of its point for its n detections (a
            near miss scores above a blank image, as in flow_grpo's reward server's count score).
        """
        from diffusion_rl.rewards.geneval.detector import OwlDetector

        if not (0 < threshold < 1 and 0 < counting_threshold < 1 and 0 < nms_iou <= 1):
            raise UserError(
                "geneval: need 0 < threshold, counting_threshold < 1 and 0 < nms_iou ≤ 1; got "
                f"{threshold}, {counting_threshold}, {nms_iou}"
            )
        if strict and count_credit:
            raise UserError("geneval: strict (a 0/1 verdict) and count_credit (partial credit) exclude each other")
        if max_objects < 1 or batch_size < 1:
            raise UserError(f"geneval: max_objects and batch_size must be ≥ 1, got {max_objects}, {batch_size}")
        self.detector = OwlDetector(detector_path, device, dtype)
        self.settings = (threshold, counting_threshold, nms_iou, max_objects)
        self.strict, self.count_credit, self.batch_size = strict, count_credit, batch_size

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        scores = np.full(len(images), np.nan, dtype=np.float32)
        specs: dict[int, GenEvalSpec] = {}
        errors: dict[int, UserError] = {}
        for i, m in enumerate(metadata):
            try:
                specs[i] = parse_metadata(m)
            except UserError as e:
                errors[i] = e
        if errors:
            i, error = next(iter(errors.items()))
            logger.warning("geneval: %d of %d samples have no usable GenEval metadata (NaN); first: sample %d (%r): %s",
                           len(errors), len(images), i, prompts[i][:80], error)  # fmt: skip
        rows = sorted(specs)
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            found = self.detector.detect(images[chunk], [specs[i] for i in chunk], *self.settings)
            for i, detections in zip(chunk, found):
                verdict = evaluate(specs[i], detections)
                scores[i] = (float(verdict.correct) if self.strict
                             else verdict.graded if self.count_credit else verdict.fraction)  # fmt: skip
        return scores
