"""Loading a model and encoding prompts print no progress bars and no empty truncation warnings, in any process."""

from __future__ import annotations

import logging

import diffusers
import pytest
import transformers

from diffusion_rl.models import quiet

LONG = "a cat sleeping on a windowsill in the afternoon sun"  # 50 characters: past 16 tokens of the tiny T5


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def loud_libraries(monkeypatch):
    """diffusers and transformers as a fresh process has them (bars on, warnings shown), whatever earlier tests
    set; diffusers' log records collected (its loggers do not propagate to the root logger pytest watches)."""
    libraries = (diffusers.utils.logging, transformers.utils.logging)
    saved = [(lib, lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in libraries]
    for lib in libraries:
        lib.set_verbosity(logging.INFO)
        lib.enable_progress_bar()
    records = _Records()
    logging.getLogger("diffusers").addHandler(records)
    monkeypatch.setattr(quiet, "_NOTED", set())  # the once-per-process note, as in a new process
    yield records
    logging.getLogger("diffusers").removeHandler(records)
    for lib, verbosity, bars in saved:
        lib.set_verbosity(verbosity)
        (lib.enable_progress_bar if bars else lib.disable_progress_bar)()


@pytest.mark.parametrize("name", ["sd3", "flux_schnell"])  # SD3 encodes negatives apart; schnell in one batch
def test_loading_and_encoding_print_no_bars_and_no_blank_truncation_lines(
    family_dirs, load, loud_libraries, capsys, caplog, name
):
    model = load(family_dirs[name])  # max_sequence_length 16
    assert "Loading" not in capsys.readouterr().err  # "Loading pipeline components", "Loading weights" bars
    assert diffusers.utils.logging.is_progress_bar_enabled()  # restored after loading
    assert transformers.utils.logging.get_verbosity() == logging.INFO
    with caplog.at_level(logging.WARNING):
        model.encode_prompts(["a prompt"], [""])
        model.encode_prompts([LONG, "a prompt"], ["", ""])
        model.encode_prompts([LONG], [""])
    assert not [m for m in loud_libraries.messages if "truncated because `max_sequence_length`" in m]
    assert "indexing errors" not in capsys.readouterr().err  # transformers' untruncated-length warning
    notes = [r.getMessage() for r in caplog.records if r.name == quiet.__name__]
    assert notes == [
        "prompts longer than 16 text-encoder tokens are cut to that length (model.max_sequence_length; raise it "
        "to keep whole prompts)"
    ]


def test_a_truncation_warning_that_shows_cut_text_is_kept():
    filtered = quiet._BlankTruncationFilter()
    message = "The following part of your input was truncated because `max_sequence_length` is set to  16 tokens: {}"
    record = logging.LogRecord(
        "diffusers.x", logging.WARNING, __file__, 1, message.format("['on the table', '']"), (), None
    )
    assert filtered.filter(record)
    blank = logging.LogRecord(
        "diffusers.x", logging.WARNING, __file__, 1, message.format("['', '<pad><pad>']"), (), None
    )
    assert not filtered.filter(blank)
