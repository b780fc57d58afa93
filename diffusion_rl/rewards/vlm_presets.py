"""Ready settings of the `vlm` judge for published judge models, and the parsers of their answers.

- `unifiedreward`: UnifiedReward (Wang et al. 2025; a Qwen-VL fine-tune served with vLLM's OpenAI API, as in
  Pref-GRPO's recipes). Pointwise: the model rates the image on named axes, one line each,
  "Alignment Score (1-5): 4"; the score is the mean over `dimensions` of (value − 1) / 4, in [0, 1].
- `unifiedreward_pairwise`: UnifiedReward-Think comparing two images of one prompt; the verdict in
  <answer>…</answer> is "Image 1 is better" or "Image 2 is better" (a <think> part before it is ignored). Used as
  `pairwise_win_rate`'s preference (Pref-GRPO).
- `hpsv3`: HPSv3 (Ma et al. 2025), a Qwen2-VL with a reward head that outputs (μ, σ); it answers no text, so it
  is asked through vLLM's pooling API (`POST /pooling` on the server's root, with the same chat messages), and the
  score is μ, the first number of the returned vector, as the authors' inferencer reads it.

The templates below are ours: they ask for the answer formats those models were trained to give. The models were
trained with their authors' own prompt texts; to send those exactly, pass them as `template` (with {prompt}).
"""

from __future__ import annotations

import re
from typing import Any

UNIFIEDREWARD_DIMENSIONS = ("Alignment", "Coherence", "Style")

TEMPLATES = {
    "unifiedreward": (
        "Evaluate this generated image against its caption on three axes, each from 1 (poor) to 5 (excellent): "
        "Alignment (does the image show what the caption describes), Coherence (is it free of glitches, distorted "
        "objects and artefacts) and Style (how visually pleasing it is, whatever the caption). Answer with exactly "
        "these three lines:\nAlignment Score (1-5): <number>\nCoherence Score (1-5): <number>\n"
        "Style Score (1-5): <number>\n\nCaption: {prompt}"
    ),
    "unifiedreward_pairwise": (
        "Two images were generated for the caption below; Image 1 is shown first and Image 2 second. Compare them "
        "on how closely they follow the caption, how good they look, and how realistic and detailed they are. You "
        "may reason inside <think></think> first. Then give the verdict inside <answer></answer>: exactly "
        "'Image 1 is better' or 'Image 2 is better'.\n\nCaption: {prompt}"
    ),
    "hpsv3": "How well does this image match the following prompt, and how much would people like it?\n{prompt}",
}
PRESETS: dict[str, dict[str, Any]] = {
    "unifiedreward": {"mode": "score", "dimensions": list(UNIFIEDREWARD_DIMENSIONS), "dimension_range": (1.0, 5.0)},
    "unifiedreward_pairwise": {"mode": "pairwise"},
    "hpsv3": {"mode": "reward_model"},
}

_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL)
_DIMENSION = re.compile(
    r"([A-Za-z][A-Za-z ]*?)\s+Score\s*(?:\((\d+(?:\.\d+)?)\s*-\s*(\d+(?:\.\d+)?)\))?\s*:\s*([-+]?\d+(?:\.\d+)?)"
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_VERDICT = re.compile(r"image\s*([12])\s*is\s*better", re.IGNORECASE)


class AnswerError(ValueError):
    """The model answered, but not with what the mode needs (e.g. no number)."""


def without_thinking(answer: str) -> str:
    return _THINKING.sub("", answer)


def parse_dimensions(answer: str, dimensions: list[str], default_range: tuple[float, float] | None = None) -> float:
    """Mean over `dimensions` of (value − lo) / (hi − lo) from lines "<Name> Score (lo-hi): value" (a line may say
    more before the name, "The Alignment Score"; without "(lo-hi)" the range is `default_range`, the judge's own
    scale, when there is one); AnswerError when one is missing or out of its range."""
    found: dict[str, float] = {}
    for name, lo, hi, value in _DIMENSION.findall(without_thinking(answer)):
        if not lo and default_range is None:
            continue  # no range to normalise by
        lo_f, hi_f = (float(lo), float(hi)) if lo else default_range
        value_f = float(value)
        if hi_f <= lo_f or not lo_f <= value_f <= hi_f:
            raise AnswerError(f"'{name.strip()} Score ({lo_f:g}-{hi_f:g}): {value}' is out of its range")
        words = name.strip().lower()
        for d in dimensions:  # the line's name ends with the dimension's ("The Alignment" for "Alignment")
            if words == d.lower() or words.endswith(" " + d.lower()):
                found.setdefault(d.lower(), (value_f - lo_f) / (hi_f - lo_f))
    missing = [d for d in dimensions if d.lower() not in found]
    if missing:
        raise AnswerError(f"no '{missing[0]} Score (lo-hi): value' line in the answer {answer[:200]!r}")
    return sum(found[d.lower()] for d in dimensions) / len(dimensions)


def parse_preference(answer: str) -> float:
    """1.0 for "Image 1 is better", 0.0 for "Image 2 is better" (inside <answer> when there is one); AnswerError when
    the answer says neither or both."""
    text = without_thinking(answer)
    tagged = _ANSWER.findall(text)
    verdicts = set(_VERDICT.findall(tagged[-1] if tagged else text))
    if len(verdicts) != 1:
        raise AnswerError(f"no single 'Image 1/2 is better' verdict in the answer {answer[:200]!r}")
    return 1.0 if verdicts == {"1"} else 0.0


def parse_pooling(answer: Any) -> float:
    """The first number of the first pooled vector of a vLLM /pooling answer {"data": [{"data": [...]}]}: HPSv3's μ."""
    try:
        vector = answer["data"][0]["data"]
    except (KeyError, IndexError, TypeError):
        raise AnswerError(f"unexpected pooling answer (no data[0].data): {str(answer)[:200]}") from None
    while isinstance(vector, list) and vector and isinstance(vector[0], list):
        vector = vector[-1]  # per-token outputs: the last token's (where a reward head reads)
    if not isinstance(vector, list) or not vector or not isinstance(vector[0], int | float):
        raise AnswerError(f"the pooled output is not a vector of numbers: {str(vector)[:200]}")
    return float(vector[0])
