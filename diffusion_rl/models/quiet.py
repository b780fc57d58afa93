"""Quiet model loading and prompt encoding in every process that loads a model (CLI, Ray workers, notebooks).

- `quiet_loading()`: diffusers' and transformers' progress bars ("Loading pipeline components", "Loading
  weights") and info logs are off inside the block and restored after it; warnings still show.
- `quiet_prompt_truncation(pipeline)`: diffusers warns on every encode that prompts were truncated to
  `max_sequence_length` tokens, listing the cut text as `['', '', …]`: it slices the token ids at the CLIP length
  (77) instead of `max_sequence_length`, so for prompts under 77 tokens (the tiny models' usual case) the list
  is blank and the line says nothing, once per step and per worker. Such records are dropped; instead one
  warning per process and length says that prompts are cut, and which setting keeps them whole. The pipeline's
  tokenizers also skip transformers' "Token indices sequence length is longer than … will result in indexing
  errors": the pipeline tokenizes without truncation only to measure, and feeds its encoders truncated ids.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import re
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_TRUNCATED = re.compile(r"truncated because `max_sequence_length` is set to\s+(\d+) tokens: (\[.*\])\s*$", re.S)
_SPECIAL_TOKEN = re.compile(r"<[^<>\s]*>")  # <pad>, </s>, <|endoftext|>: what pads a short prompt's ids
_NOTED: set[int] = set()  # max_sequence_lengths already reported in this process


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Inside the block: no diffusers/transformers progress bars and no info logs (warnings and errors stay)."""
    import diffusers
    import transformers

    libraries = (diffusers.utils.logging, transformers.utils.logging)
    saved = [(lib, lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in libraries]
    for lib, verbosity, _ in saved:
        lib.set_verbosity(max(verbosity, logging.WARNING))
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib, verbosity, bars in saved:
            lib.set_verbosity(verbosity)
            if bars:
                lib.enable_progress_bar()


class _BlankTruncationFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        match = _TRUNCATED.search(record.getMessage())
        if match is None:
            return True
        try:
            removed = ast.literal_eval(match.group(2))
        except (ValueError, SyntaxError):
            return True
        if not isinstance(removed, list) or any(_SPECIAL_TOKEN.sub("", str(text)).strip() for text in removed):
            return True  # it shows text that was cut: worth reading
        length = int(match.group(1))
        if length not in _NOTED:
            _NOTED.add(length)
            logger.warning(
                "prompts longer than %d text-encoder tokens are cut to that length (model.max_sequence_length; "
                "raise it to keep whole prompts)",
                length,
            )
        return False


_FILTER = _BlankTruncationFilter()


def quiet_prompt_truncation(pipeline) -> None:
    """Filter the truncation warnings that list only blank text out of the logger of `pipeline`'s module, and
    mark its tokenizers as having given transformers' length warning already (the flag it warns once by)."""
    logging.getLogger(type(pipeline).__module__).addFilter(_FILTER)  # addFilter ignores a filter already there
    for component in pipeline.components.values():
        warned = getattr(component, "deprecation_warnings", None)  # tokenizers have it
        if isinstance(warned, dict):
            warned["sequence-length-is-longer-than-the-specified-maximum"] = True
