"""How well a recognised text matches the text an image was asked to show (the Flow-GRPO OCR rule).

Both texts are normalised (all whitespace removed, lower-cased). With r the recognised and t the target text:

    d = 0                               if t is a substring of r (extra text around the target is not penalised)
    d = min(Levenshtein(r, t), len(t))  otherwise (many unrelated characters cost at most the whole target)
    score = 1 - d / len(t)              in [0, 1]

Used by the `ocr` reward (rapidocr) and the `vlm` judge in transcription mode. The target text comes from
`diffusion_rl.data.text_targets` (re-exported here).
"""

import re

from diffusion_rl.data.text_targets import quoted_text, target_text

__all__ = ["levenshtein", "normalize_text", "quoted_text", "target_text", "text_match_score"]

_WHITESPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """`text` without any whitespace, lower-cased: OCR engines disagree on spaces and case, the reward ignores both."""
    return _WHITESPACE.sub("", text).lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1) between `a` and `b` (rapidfuzz's C++)."""
    from rapidfuzz.distance import Levenshtein  # imported when an OCR score is computed: a GPU image may lack it

    return Levenshtein.distance(a, b)


def text_match_score(recognized: str, target: str) -> float:
    """The OCR reward of `recognized` for `target` (see the module docstring), in [0, 1].

    Raises ValueError if `target` has no visible character: the score would divide by zero.
    """
    r, t = normalize_text(recognized), normalize_text(target)
    if not t:
        raise ValueError(f"the target text {target!r} has no visible character to match")
    distance = 0 if t in r else min(levenshtein(r, t), len(t))
    return 1.0 - distance / len(t)
