"""Zero-shot detections for the GenEval rules, from OWLv2 (transformers' `Owlv2ForObjectDetection`).

Why OWLv2: it predicts one box per image patch, whatever the text query, and scores every query against every
box in one forward pass. So an object's colour is a second question about the same box: next to "a photo of a
{class}" the detector is also asked "a photo of a {colour} {class}" for GenEval's ten colours, and a detected
box's colour is the colour query with the highest logit at that box. GenEval itself asks CLIP about each crop; here
no second model is needed. (Grounding DINO ties boxes to phrases of one caption, which makes that reuse awkward.)

For each image and each class of its metadata:
1. boxes whose sigmoid(class logit) exceeds the threshold (`counting_threshold` for the tag "counting", as GenEval
   raises its threshold there);
2. most confident first; a box overlapping a kept one by IoU > `nms_iou` is dropped (OWL predicts one box per patch,
   so one object lights up several neighbouring patches); at most `max_objects` kept;
3. box coordinates: OWLv2's are (cx, cy, w, h) relative to the image padded to a square at the bottom/right, so
   they are scaled by the longer side and clipped to the image.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.geneval.rules import COLORS, Detection, GenEvalSpec


def query(cls: str, color: str | None = None) -> str:
    return f"a photo of a {color} {cls}" if color else f"a photo of a {cls}"


def iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def select(boxes_P4: np.ndarray, scores_P: np.ndarray, threshold: float, nms_iou: float, max_objects: int) -> list[int]:
    """Indices of the boxes kept: above the threshold, most confident first, greedy NMS, at most max_objects."""
    order = [int(i) for i in np.argsort(-scores_P, kind="stable") if scores_P[i] > threshold]
    kept: list[int] = []
    for i in order:
        if all(iou(tuple(boxes_P4[i]), tuple(boxes_P4[j])) <= nms_iou for j in kept):
            kept.append(i)
        if len(kept) == max_objects:
            break
    return kept


class OwlDetector:
    """OWLv2 from a local directory (save_pretrained layout: config, weights, tokenizer, preprocessor config)."""

    def __init__(self, path: str, device: str | None = None, dtype: str = "float32"):
        import torch
        from transformers import AutoTokenizer, Owlv2ForObjectDetection, Owlv2ImageProcessorPil

        from diffusion_rl.rewards.clip import check_settings

        self.dtype, self.device = check_settings(dtype, 1, device, "geneval")
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise UserError(
                f"geneval: detector_path {directory} is not a directory; download OWLv2 first, e.g. "
                "`huggingface-cli download google/owlv2-base-patch16-ensemble --local-dir DIR`"
            )
        try:
            self.model = Owlv2ForObjectDetection.from_pretrained(directory, dtype=self.dtype)
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            self.processor = Owlv2ImageProcessorPil.from_pretrained(directory)
        except (OSError, ValueError) as e:
            raise UserError(f"geneval: cannot load OWLv2 from {directory} ({e})") from None
        self.model.to(self.device).eval().requires_grad_(False)
        self.max_length = self.model.config.text_config.max_position_embeddings
        self._torch = torch

    def logits(self, images_BHW3: np.ndarray, queries: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(logits [B, P, Q], boxes [B, P, 4] as (cx, cy, w, h) relative to the padded square)."""
        torch = self._torch
        pixels = self.processor(images=list(images_BHW3), return_tensors="pt")["pixel_values"]
        tokens = self.tokenizer(list(queries), padding="max_length", truncation=True, max_length=self.max_length,
                                return_tensors="pt")  # fmt: skip
        batch = len(images_BHW3)
        with torch.inference_mode():
            out = self.model(
                input_ids=tokens["input_ids"].repeat(batch, 1).to(self.device),
                attention_mask=tokens["attention_mask"].repeat(batch, 1).to(self.device),
                pixel_values=pixels.to(self.device, self.dtype),
            )
        return out.logits.float().cpu().numpy(), out.pred_boxes.float().cpu().numpy()

    def detect(
        self,
        images_BHW3: np.ndarray,
        specs: Sequence[GenEvalSpec],
        threshold: float,
        counting_threshold: float,
        nms_iou: float,
        max_objects: int,
    ) -> list[dict[str, list[Detection]]]:
        """Per image: class -> its detections, most confident first (module docstring)."""
        queries: list[str] = []
        for spec in specs:
            for cls in spec.classes:
                queries.append(query(cls))
            for cls in spec.colored_classes:
                queries += [query(cls, c) for c in COLORS]
        queries = list(dict.fromkeys(queries))
        index = {q: i for i, q in enumerate(queries)}
        logits, boxes = self.logits(images_BHW3, queries)
        height, width = images_BHW3.shape[1:3]
        side = max(height, width)
        out = []
        for b, spec in enumerate(specs):
            cx, cy, w, h = (boxes[b] * side).T
            corners = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=-1)
            corners = np.clip(corners, 0, [width, height, width, height])
            scores = 1 / (1 + np.exp(-logits[b]))
            limit = counting_threshold if spec.tag == "counting" else threshold
            found: dict[str, list[Detection]] = {}
            for cls in spec.classes:
                kept = select(corners, scores[:, index[query(cls)]], limit, nms_iou, max_objects)
                color_columns = [index[query(cls, c)] for c in COLORS] if cls in spec.colored_classes else None
                found[cls] = [
                    Detection(
                        cls,
                        tuple(float(v) for v in corners[p]),
                        float(scores[p, index[query(cls)]]),
                        COLORS[int(np.argmax(logits[b, p, color_columns]))] if color_columns else None,
                    )
                    for p in kept
                ]
            out.append(found)
        return out
