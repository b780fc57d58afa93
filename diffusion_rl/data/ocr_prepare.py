"""Prompt datasets for text rendering (the `ocr` reward): from Flow-GRPO-style prompt lists, or synthetic.

Flow-GRPO's OCR prompts are plain text, one per line, with the text to render between double quotes:

    A storefront sign that says "OPEN LATE"

`prepare_ocr` turns such a file into PromptRecords with ground_truth = the quoted text, data_source "ocr" and
metadata["ability"] "ocr" (verl's task column; unless an input record has its own) and metadata["split"] ("train"
or "val"), written as .jsonl or verl-style .parquet (columns data_source, prompt, ability, reward_model, extra_info);
a validation share goes to a file of its own (nothing reads `split`, so val rows left in the training file would
be trained on). `synthetic_ocr_prompts` makes prompts of the same shape from the templates and word list shipped
in diffusion_rl/assets.
"""

import argparse
import logging
import random
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from diffusion_rl.data.prompts import DEFAULT_DATA_SOURCE, PromptRecord, load_prompts, write_prompts
from diffusion_rl.data.text_targets import target_text
from diffusion_rl.errors import UserError
from diffusion_rl.utils.files import refuse_same_file

logger = logging.getLogger(__name__)

OCR_DATA_SOURCE = "ocr"
OCR_ABILITY = "ocr"  # verl's `ability` column, as verl-omni's OCR data has it
_MAX_LISTED = 20  # line numbers listed in an error; the count says how many more


@dataclass
class PreparedOcr:
    """What `prepare_ocr` wrote."""

    n_train: int
    n_val: int
    skipped_lines: list[int] = field(default_factory=list)  # 1-based lines (.txt) or rows (.jsonl/.parquet)


def prepare_ocr(
    input_path: str | Path,
    out_path: str | Path,
    negative_prompt: str | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    skip_invalid: bool = False,
    val_path: str | Path | None = None,
    data_source: str = OCR_DATA_SOURCE,
) -> PreparedOcr:
    """Read OCR prompts from `input_path` and write them as PromptRecords to `out_path` (.jsonl or .parquet).

    input_path: .txt (one prompt per line; blank lines skipped), or .jsonl/.parquet prompt records (a record's own
        ground_truth is kept; otherwise the prompt's quoted text is used).
    negative_prompt: stored with every record (None = the pipeline's default).
    val_fraction: the share of records, drawn at random with `seed`, written to `val_path` with metadata["split"]
        = "val"; the rest go to `out_path` as "train". Records keep the input order. Needs `val_path`.
    skip_invalid: drop prompts without quoted text (their line numbers are logged) instead of raising UserError.
    val_path: where the val records go (with val_fraction > 0; `out_path` then gets the train records only).
    data_source: the data_source of records without their own (every .txt line; a .jsonl/.parquet record that
        sets one keeps it).
    """
    input_path = Path(input_path)
    _check_split(val_fraction, val_path)
    refuse_same_file("prepare ocr", input=input_path, output=out_path, val_output=val_path)
    records, invalid = [], []
    for number, record in _numbered_prompts(input_path):
        target = target_text(record.prompt, {"ground_truth": record.ground_truth})
        if target is None:
            invalid.append((number, record.prompt))
            continue
        negative = negative_prompt if negative_prompt is not None else record.negative_prompt
        source = record.data_source if record.data_source != DEFAULT_DATA_SOURCE else data_source
        metadata = {"ability": OCR_ABILITY, **record.metadata}
        records.append(
            replace(record, ground_truth=target, negative_prompt=negative, data_source=source, metadata=metadata)
        )
    if invalid:
        _report_invalid(input_path, invalid, "line" if input_path.suffix.lower() == ".txt" else "record", skip_invalid)
    if not records:
        raise UserError(f"{input_path}: no prompt has double-quoted text to render; nothing to write")
    result = _split_and_write(records, out_path, val_fraction, seed, val_path)
    result.skipped_lines = [number for number, _ in invalid]
    return result


def write_synthetic_ocr(
    n: int,
    out_path: str | Path,
    seed: int = 0,
    max_words: int = 3,
    negative_prompt: str | None = None,
    val_fraction: float = 0.0,
    val_path: str | Path | None = None,
) -> PreparedOcr:
    """`synthetic_ocr_prompts(n, seed, max_words)` written like `prepare_ocr` writes its records."""
    _check_split(val_fraction, val_path)
    refuse_same_file("prepare ocr", output=out_path, val_output=val_path)
    records = [replace(r, negative_prompt=negative_prompt) for r in synthetic_ocr_prompts(n, seed, max_words)]
    return _split_and_write(records, out_path, val_fraction, seed, val_path)


def _check_split(val_fraction: float, val_path: str | Path | None) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"prepare ocr: val_fraction must be in [0, 1), got {val_fraction}")
    if val_path is not None and val_fraction == 0:
        raise UserError("prepare ocr: val_path is given but val_fraction is 0; set val_fraction, e.g. 0.05")
    if val_path is None and val_fraction > 0:
        raise UserError(
            f"prepare ocr: val_fraction {val_fraction} needs val_path: nothing reads the split mark, so val records "
            "left in the training file would be trained on"
        )


def _split_and_write(
    records: list[PromptRecord], out_path: str | Path, val_fraction: float, seed: int, val_path: str | Path | None
) -> PreparedOcr:
    """Mark a seeded random `val_fraction` of the records "val" (the rest "train"), in place order, and write."""
    n_val = round(len(records) * val_fraction)
    if val_path is not None and not 0 < n_val < len(records):
        raise UserError(
            f"prepare ocr: val_fraction {val_fraction} of {len(records)} prompts gives {n_val} val prompts; both "
            "files need at least one prompt"
        )
    val_indices = set(random.Random(seed).sample(range(len(records)), n_val))
    records = [
        replace(r, metadata={**r.metadata, "split": "val" if i in val_indices else "train"})
        for i, r in enumerate(records)
    ]
    if val_path is None:
        write_prompts(records, out_path)
    else:
        write_prompts([r for r in records if r.metadata["split"] == "train"], out_path)
        write_prompts([r for r in records if r.metadata["split"] == "val"], val_path)
    where = f"{out_path} and {val_path}" if val_path is not None else str(out_path)
    logger.info("prepare ocr: wrote %d train + %d val prompts to %s", len(records) - n_val, n_val, where)
    return PreparedOcr(n_train=len(records) - n_val, n_val=n_val)


def _numbered_prompts(path: Path) -> list[tuple[int, PromptRecord]]:
    """(1-based line or record number, record) for each prompt of the file."""
    if path.suffix.lower() != ".txt":
        return list(enumerate(load_prompts(path), start=1))
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist; check the path (relative paths start from {Path.cwd()})")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save the file as UTF-8") from None
    # split on "\n" only, as load_prompts does: str.splitlines also splits at U+2028, shifting line numbers
    lines = [line.strip() for line in text.split("\n")]
    return [(number, PromptRecord(prompt=line)) for number, line in enumerate(lines, start=1) if line]


def _report_invalid(path: Path, invalid: list[tuple[int, str]], unit: str, skip: bool) -> None:
    numbers = ", ".join(str(n) for n, _ in invalid[:_MAX_LISTED])
    more = f" and {len(invalid) - _MAX_LISTED} more" if len(invalid) > _MAX_LISTED else ""
    first_number, first_prompt = invalid[0]
    what = (
        f"{path}: {len(invalid)} prompts have no double-quoted text to render ({unit}s {numbers}{more}; "
        f"{unit} {first_number}: {first_prompt[:100]!r})"
    )
    if not skip:
        raise UserError(
            f"{what}; put the text to render in double quotes, or drop such prompts with --skip-invalid "
            "(skip_invalid=True from Python)"
        )
    logger.warning("%s; skipped", what)


# ---- synthetic prompts ----


def _asset_lines(name: str) -> list[str]:
    """The non-blank, non-comment lines of a file in diffusion_rl/assets."""
    text = resources.files("diffusion_rl").joinpath("assets", name).read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def synthetic_ocr_prompts(
    n: int, seed: int = 0, max_words: int = 3, data_source: str = OCR_DATA_SOURCE
) -> list[PromptRecord]:
    """`n` prompts like 'A storefront sign that says "OPEN LATE"', with ground_truth = the quoted text.

    Each text is 1..max_words words from the bundled word list, in upper, title or lower case; the same
    (n, seed, max_words) always gives the same prompts.
    """
    if n < 1 or max_words < 1:
        raise UserError(f"synthetic OCR prompts: need n >= 1 and max_words >= 1, got n={n}, max_words={max_words}")
    templates, words = _asset_lines("ocr_templates.txt"), _asset_lines("ocr_words.txt")
    rng = random.Random(seed)
    cases = (str.upper, str.title, str.lower)
    records = []
    for _ in range(n):
        text = rng.choice(cases)(" ".join(rng.choice(words) for _ in range(rng.randint(1, max_words))))
        prompt = rng.choice(templates).format(text=text)
        records.append(
            PromptRecord(prompt=prompt, ground_truth=text, data_source=data_source, metadata={"ability": OCR_ABILITY})
        )
    return records


# ---- command line (`diffusion-rl prepare ocr` adds the same arguments) ----


def add_prepare_ocr_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="[INPUT] OUT",
        help="prompt file (.txt one prompt per line, .jsonl or .parquet; omitted with --synthetic) and the "
        "output file (.jsonl or .parquet, verl layout)",
    )
    parser.add_argument("--synthetic", type=int, metavar="N", help="write N synthetic prompts instead of an input")
    parser.add_argument("--max-words", type=int, default=3, help="words per synthetic text, at most")
    parser.add_argument("--negative-prompt", help="negative prompt stored with every record")
    parser.add_argument(
        "--val-fraction", type=float, default=0.0, help="share of prompts moved to --val-out (marked split=val)"
    )
    parser.add_argument(
        "--val-out", help="write the val prompts to this file (the train ones go to OUT); needs --val-fraction"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the val draw and the synthetic prompts")
    parser.add_argument("--skip-invalid", action="store_true", help="drop prompts without quoted text")


def run_prepare_ocr_from_args(args: argparse.Namespace) -> PreparedOcr:
    """Run `prepare_ocr` or `write_synthetic_ocr` with the arguments of add_prepare_ocr_arguments."""
    expected = 1 if args.synthetic is not None else 2
    if len(args.paths) != expected:
        raise UserError(
            "prepare ocr: usage is `prepare ocr INPUT OUT` or `prepare ocr --synthetic N OUT`; "
            f"got {len(args.paths)} path(s): {' '.join(args.paths)}"
        )
    args.input, args.out = (None, args.paths[0]) if args.synthetic is not None else tuple(args.paths)
    if 0 < args.val_fraction < 1 and args.val_out is None:  # (a fraction outside [0, 1) is reported below)
        raise UserError(
            f"prepare ocr: --val-fraction {args.val_fraction} needs --val-out FILE for the val prompts (nothing "
            "reads the split=val mark, so val prompts left in OUT would be trained on)"
        )
    if args.val_out is not None and args.val_fraction == 0:
        raise UserError("prepare ocr: --val-out is given but --val-fraction is 0; set --val-fraction, e.g. 0.05")
    split = {"val_fraction": args.val_fraction, "val_path": args.val_out, "negative_prompt": args.negative_prompt}
    if args.synthetic is not None:
        return write_synthetic_ocr(args.synthetic, args.out, seed=args.seed, max_words=args.max_words, **split)
    return prepare_ocr(args.input, args.out, seed=args.seed, skip_invalid=args.skip_invalid, **split)
