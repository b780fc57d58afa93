"""Prompt datasets: one `PromptRecord` per prompt, read from .txt, .jsonl or .parquet (plain or verl-style rows).

File layouts:
  .txt      one prompt per line; lines are stripped and blank lines skipped.
  .jsonl    one object per line: {"prompt": str, "negative_prompt"?: str, "ground_truth"?: str,
            "data_source"?: str, "metadata"?: object, "images"?: [path, ...]}; blank lines skipped; image paths
            are relative to the .jsonl file's folder.
  .parquet  rows with the .jsonl columns, or verl-style rows (verl-omni's layout): "data_source", "prompt" as chat
            messages [{"role": "user", "content": ...}], "ability" (the task, e.g. "ocr"; read into
            metadata["ability"]), "reward_model": {"ground_truth": ..., "style": ...}, "extra_info" (becomes
            metadata; may hold "negative_prompt"), "images": [{"bytes": ..., "path"?: ...}, ...] (the condition
            images of an edit); a "negative_prompt" column may also be chat messages.

A prompt's "<image>" placeholders (verl's multimodal rows) are taken out of its text: an editing family places its
condition images itself (data/condition_images.py); when a prompt has placeholders, their count must match its
images.

`write_prompts` writes .jsonl, or .parquet in the verl layout (those five columns, in that order, and "images" when a
record has some; metadata["ability"] goes to the "ability" column), so that `load_prompts` reads back the same
records.
"""

import dataclasses
import functools
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffusion_rl.data.condition_images import ConditionImage
from diffusion_rl.errors import UserError, did_you_mean
from diffusion_rl.utils.json_input import parse_json

logger = logging.getLogger(__name__)

READABLE_EXTENSIONS = (".txt", ".jsonl", ".parquet")
WRITABLE_EXTENSIONS = (".jsonl", ".parquet")
DEFAULT_DATA_SOURCE = "default"
# a prompt's characters kept: 8 per token of the longest text a model reads (model.max_sequence_length ≤ 8192; English
# takes ~4 a token), so only text that no encoder would read is cut
MAX_PROMPT_CHARS = 65_536

_JSONL_KEYS = ("prompt", "negative_prompt", "ground_truth", "data_source", "metadata", "images")
IMAGE_PLACEHOLDER = "<image>"  # verl's multimodal prompts mark each image's place in the text with it
# verl rows carry "reward_model", "extra_info" and "ability" next to the plain columns.
_PARQUET_COLUMNS = (*_JSONL_KEYS, "reward_model", "extra_info", "ability")  # "images": [{"bytes", "path"}]
_EXAMPLE_LINE = '{"prompt": "a red apple on a wooden table"}'


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a dataset and what a reward function may need to score its images."""

    prompt: str  # the text the model is conditioned on; non-empty
    negative_prompt: str | None = None  # for classifier-free guidance; None = the pipeline's default
    ground_truth: str | None = None  # the reference answer for rule-based rewards (e.g. the text to render)
    data_source: str = DEFAULT_DATA_SOURCE  # names the subset, so rewards and metrics can be split by it
    metadata: dict[str, Any] = field(default_factory=dict)  # anything else a reward function reads
    images: tuple[ConditionImage, ...] = ()  # condition images (an edit's sources); read when used

    def __post_init__(self):
        problem = _field_problem(self.prompt, self.negative_prompt, self.ground_truth, self.data_source, self.metadata)
        if problem:
            raise UserError(f"invalid PromptRecord: {problem}")
        if not isinstance(self.images, tuple) or not all(isinstance(i, ConditionImage) for i in self.images):
            raise UserError(
                f"invalid PromptRecord: 'images' must be a tuple of ConditionImage, got {self.images!r:.80}"
            )

    def reward_metadata(self) -> dict[str, Any]:
        """What a reward gets with each image of this prompt: the metadata plus ground_truth and data_source (these
        two win on a clash). A new dict each call, so a reward may change one without touching the others."""
        return {**self.metadata, "ground_truth": self.ground_truth, "data_source": self.data_source}


def load_prompts(path: str | Path) -> list[PromptRecord]:
    """Read a prompt dataset; the format follows the extension (.txt, .jsonl, .parquet)."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in READABLE_EXTENSIONS:
        raise UserError(
            f"{path}: unknown prompt file extension '{path.suffix}'; supported: {', '.join(READABLE_EXTENSIONS)}"
        )
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise UserError(f"prompt file {path} {what}; check the path (relative paths start from {Path.cwd()})")
    stat = path.stat()  # the file as it is now: a replaced or edited one (another inode, time or size) is read again
    return list(_read_prompts(path, path.resolve(), stat.st_ino, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _read_prompts(path: Path, resolved: Path, inode: int, mtime_ns: int, size: int) -> tuple[PromptRecord, ...]:
    """A prompt file read (and logged) once per process, however many parts of a command ask for it (the memory check
    before training, the trainer, the embedding cache); its records are frozen."""
    ext = path.suffix.lower()
    if ext == ".txt":
        records = _load_txt(path)
    elif ext == ".jsonl":
        records = _load_jsonl(path)
    else:
        records = _load_parquet(path)
    if not records:
        raise UserError(f"{path}: no prompts found; expected at least one non-blank line or row")
    logger.info("loaded %d prompts from %s", len(records), path)
    return tuple(_cut_long_prompts(records, path))


def _cut_long_prompts(records: list[PromptRecord], path: Path) -> list[PromptRecord]:
    """Prompts cut to MAX_PROMPT_CHARS, with one warning: no text encoder reads that far, and the tokenizer would
    cut them anyway, without a word."""
    long = [i for i, r in enumerate(records) if len(r.prompt) > MAX_PROMPT_CHARS]
    if long:
        logger.warning(
            "%s: %d prompt(s) longer than %s characters (the first: prompt %d, %s characters) cut to their first %s: "
            "the text encoders read at most model.max_sequence_length tokens, far less", path, len(long),
            f"{MAX_PROMPT_CHARS:,}", long[0] + 1, f"{len(records[long[0]].prompt):,}", f"{MAX_PROMPT_CHARS:,}",
        )  # fmt: skip
    for i in long:
        records[i] = dataclasses.replace(records[i], prompt=records[i].prompt[:MAX_PROMPT_CHARS])
    return records


def condition_images_in(path: str | Path) -> int | None:
    """Condition images per record of the dataset at `path`, for `estimate` (not checked: training does that): 0 for a
    .txt file (it has none), the first record's count for a .jsonl or .parquet file, None when that file is not there
    (a dataset still to be prepared)."""
    path = Path(path)
    if path.suffix.lower() == ".txt":
        return 0
    if not path.is_file():
        return None
    return len(load_prompts(path)[0].images)


def write_prompts(records: Iterable[PromptRecord], path: str | Path) -> None:
    """Write records as .jsonl or verl-style .parquet; `load_prompts` reads them back unchanged.

    Parquet limits (from its typed columns): a metadata key must hold the same type in every record, and
    metadata entries whose value is None are not kept.
    """
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in WRITABLE_EXTENSIONS:
        raise UserError(f"{path}: cannot write prompts as '{path.suffix}'; supported: {', '.join(WRITABLE_EXTENSIONS)}")
    records = list(records)
    if not records:
        raise UserError(f"{path}: no records to write; load_prompts rejects an empty dataset")
    path.parent.mkdir(parents=True, exist_ok=True)
    if ext == ".jsonl":
        _write_jsonl(records, path)
    else:
        _write_parquet(records, path)


# ---- validation shared by PromptRecord and the readers ----


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _field_problem(prompt, negative_prompt, ground_truth, data_source, metadata) -> str | None:
    """What is wrong with these field values, or None when they make a valid record."""
    if not isinstance(prompt, str):
        return f"'prompt' must be a string, got {_type_name(prompt)}"
    if not prompt.strip():
        return "'prompt' is empty; expected non-empty text"
    for name, value in (("negative_prompt", negative_prompt), ("ground_truth", ground_truth)):
        if value is not None and not isinstance(value, str):
            return f"'{name}' must be a string or null, got {_type_name(value)}"
    if not isinstance(data_source, str) or not data_source:
        return f"'data_source' must be a non-empty string, got {data_source!r}"
    if not isinstance(metadata, dict):
        return f"'metadata' must be an object (key → value), got {_type_name(metadata)}"
    return None


def _make_record(
    where: str, prompt, negative_prompt, ground_truth, data_source, metadata, images: tuple[ConditionImage, ...] = ()
) -> PromptRecord:
    data_source = DEFAULT_DATA_SOURCE if data_source is None else data_source
    metadata = {} if metadata is None else metadata
    if isinstance(prompt, str) and IMAGE_PLACEHOLDER in prompt:
        placeholders = prompt.count(IMAGE_PLACEHOLDER)
        if placeholders != len(images):
            raise UserError(
                f"{where}: the prompt has {placeholders} '{IMAGE_PLACEHOLDER}' placeholders but {len(images)} images"
            )
        prompt = " ".join(prompt.replace(IMAGE_PLACEHOLDER, " ").split())
    problem = _field_problem(prompt, negative_prompt, ground_truth, data_source, metadata)
    if problem:
        raise UserError(f"{where}: {problem}")
    return PromptRecord(prompt, negative_prompt, ground_truth, data_source, metadata, images)


def _prompt_text(value: Any, where: str, name: str = "prompt") -> Any:
    """A plain prompt, or the content of the last user message of a chat-style prompt (verl); `name` is the column."""
    if not isinstance(value, list):
        return value  # _field_problem reports non-strings
    user_contents = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
    if not user_contents:
        roles = [m.get("role") if isinstance(m, dict) else _type_name(m) for m in value]
        raise UserError(
            f"{where}: chat-style '{name}' has no message with role 'user' (roles found: {roles}); "
            f'expected [{{"role": "user", "content": "..."}}] or a plain string'
        )
    content = user_contents[-1]
    if not isinstance(content, str):
        raise UserError(
            f"{where}: the user message's 'content' in '{name}' must be a string, got {_type_name(content)}"
        )
    return content


def _read_text(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: drop a byte-order mark some editors write
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save the file as UTF-8") from None
    # split on "\n" only: str.splitlines also splits at U+2028 etc., which would shift line numbers
    return [line.rstrip("\r") for line in text.split("\n")]


# ---- readers ----


def read_jsonl(path: Path, keys: Sequence[str], example: str, hint: str = "") -> Iterator[tuple[dict, str]]:
    """(object, "FILE, line N") for each non-blank line of a JSON-lines file, each checked to be an object whose keys
    are among `keys`; a UserError naming the file and line otherwise (`example`: a valid line; `hint`: said after
    the known keys)."""
    for line_no, line in enumerate(_read_text(path), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {line_no}"
        try:
            obj = parse_json(line)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{where}: invalid JSON ({e.msg} at column {e.colno}); expected one object per line, e.g. {example}"
            ) from None
        if not isinstance(obj, dict):
            raise UserError(f"{where}: expected a JSON object, got {_type_name(obj)}; e.g. {example}")
        for key in obj:
            if key not in keys:
                raise UserError(
                    f"{where}: unknown key '{key}'{did_you_mean(key, keys)}; known keys: {', '.join(keys)}{hint}"
                )
        yield obj, where


def _load_txt(path: Path) -> list[PromptRecord]:
    return [PromptRecord(prompt=line.strip()) for line in _read_text(path) if line.strip()]


def _load_jsonl(path: Path) -> list[PromptRecord]:
    records = []
    for obj, where in read_jsonl(path, _JSONL_KEYS, _EXAMPLE_LINE, " (put anything else under 'metadata')"):
        if "prompt" not in obj:
            raise UserError(f"{where}: missing 'prompt'; expected a non-empty string, e.g. {_EXAMPLE_LINE}")
        records.append(
            _make_record(
                where,
                prompt=_prompt_text(obj["prompt"], where),
                negative_prompt=obj.get("negative_prompt"),
                ground_truth=obj.get("ground_truth"),
                data_source=obj.get("data_source"),
                metadata=obj.get("metadata"),
                images=_jsonl_images(obj.get("images"), path, where),
            )
        )
    return records


def _jsonl_images(value: Any, path: Path, where: str) -> tuple[ConditionImage, ...]:
    """A .jsonl line's "images": file paths relative to the .jsonl file's folder."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise UserError(
            f"{where}: 'images' must be a list of image file paths (relative to {path.parent}), got {value!r}"
        )
    return tuple(
        ConditionImage(str((path.parent / v).resolve()), f"{where}, images[{k}] ({v})") for k, v in enumerate(value)
    )


def _load_parquet(path: Path) -> list[PromptRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: cannot read as parquet ({e})") from None
    for column in table.column_names:
        if column not in _PARQUET_COLUMNS:
            raise UserError(
                f"{path}: unknown column '{column}'{did_you_mean(column, _PARQUET_COLUMNS)}; known columns: "
                f"{', '.join(_PARQUET_COLUMNS)} (put anything else in 'metadata' or 'extra_info')"
            )
    if "prompt" not in table.column_names:
        raise UserError(
            f"{path}: no 'prompt' column (columns: {', '.join(table.column_names)}); expected 'prompt' holding "
            "a string or verl-style chat messages"
        )
    return [_parquet_row_record(row, f"{path}, row {i} (0-based)", path) for i, row in enumerate(table.to_pylist())]


def _without_nulls(mapping: Any, name: str, where: str) -> dict[str, Any]:
    # A struct column has the union of all rows' keys, with null where a row lacked one: drop those.
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        raise UserError(f"{where}: '{name}' must be an object (key → value), got {_type_name(mapping)}")
    return {k: v for k, v in mapping.items() if v is not None}


def _one_of(row: dict[str, Any], name: str, nested: dict[str, Any], nested_name: str, where: str) -> Any:
    """A field given as a top-level column or inside a verl struct column; both is fine only when they agree."""
    top, inner = row.get(name), nested.pop(name, None)
    if top is not None and inner is not None and top != inner:
        raise UserError(f"{where}: '{name}' ({top!r}) and '{nested_name}.{name}' ({inner!r}) differ; keep only one")
    return top if top is not None else inner


def _parquet_images(value: Any, path: Path, where: str) -> tuple[ConditionImage, ...]:
    """A parquet row's "images": verl's [{"bytes": ..., "path": ...}] (bytes first; a path is relative to the file)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise UserError(f"{where}: 'images' must be a list of {{\"bytes\": ...}} objects, got {_type_name(value)}")
    images = []
    for k, item in enumerate(value):
        here = f"{where}, images[{k}]"
        data = item.get("bytes") if isinstance(item, dict) else None
        file = item.get("path") if isinstance(item, dict) else None
        if isinstance(data, bytes) and data:
            images.append(ConditionImage(data, here))
        elif isinstance(file, str) and file:
            images.append(ConditionImage(str((path.parent / file).resolve()), f"{here} ({file})"))
        else:
            raise UserError(f'{here}: expected {{"bytes": <image file bytes>}} or {{"path": ...}}, got {item!r:.80}')
    return tuple(images)


def _parquet_row_record(row: dict[str, Any], where: str, path: Path) -> PromptRecord:
    extra_info = _without_nulls(row.get("extra_info"), "extra_info", where)
    reward_model = _without_nulls(row.get("reward_model"), "reward_model", where)
    negative_prompt = _one_of(row, "negative_prompt", extra_info, "extra_info", where)
    ground_truth = _one_of(row, "ground_truth", reward_model, "reward_model", where)
    ability = _one_of(row, "ability", extra_info, "extra_info", where)
    metadata = {**extra_info, **_without_nulls(row.get("metadata"), "metadata", where)}
    if ability is not None:
        metadata["ability"] = ability
    return _make_record(
        where,
        prompt=_prompt_text(row.get("prompt"), where),
        negative_prompt=_prompt_text(negative_prompt, where, "negative_prompt"),
        ground_truth=ground_truth,
        data_source=row.get("data_source"),
        metadata=metadata,
        images=_parquet_images(row.get("images"), path, where),
    )


# ---- writers ----


def _write_jsonl(records: list[PromptRecord], path: Path) -> None:
    lines = []
    for i, r in enumerate(records):
        obj: dict[str, Any] = {"prompt": r.prompt}
        if r.negative_prompt is not None:
            obj["negative_prompt"] = r.negative_prompt
        if r.ground_truth is not None:
            obj["ground_truth"] = r.ground_truth
        if r.data_source != DEFAULT_DATA_SOURCE:
            obj["data_source"] = r.data_source
        if r.metadata:
            obj["metadata"] = r.metadata
        if r.images:
            obj["images"] = [_image_path_for_jsonl(image, path, i) for image in r.images]
        try:
            lines.append(json.dumps(obj, ensure_ascii=False))
        except (TypeError, ValueError) as e:
            raise UserError(f"{path}: record {i} (0-based) cannot be written as JSON ({e})") from None
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _image_path_for_jsonl(image: ConditionImage, path: Path, index: int) -> str:
    if isinstance(image.source, bytes):
        raise UserError(
            f"{path}: record {index} (0-based) holds image bytes, which .jsonl cannot; write .parquet instead"
        )
    source = Path(image.source)
    try:
        return source.relative_to(path.parent.resolve()).as_posix()
    except ValueError:
        return str(source)


def _write_parquet(records: list[PromptRecord], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i, r in enumerate(records):
        if "negative_prompt" in r.metadata:
            raise UserError(
                f"{path}: record {i} (0-based) has 'negative_prompt' in its metadata, which would collide with "
                "the negative prompt stored in extra_info; rename that metadata key"
            )
        extra_info = {k: v for k, v in r.metadata.items() if k != "ability"}
        rows.append(
            {
                "data_source": r.data_source,
                # verl's multimodal rows mark each image's place in the text; load_prompts takes the marks out again
                "prompt": [{"role": "user", "content": IMAGE_PLACEHOLDER * len(r.images) + r.prompt}],
                "ability": r.metadata.get("ability"),
                "reward_model": {"ground_truth": r.ground_truth, "style": "rule"},
                # negative_prompt is always present so extra_info never becomes a struct without fields,
                # which parquet cannot store
                "extra_info": {"negative_prompt": r.negative_prompt, **extra_info},
            }
        )
        if r.images:
            rows[-1]["images"] = [{"bytes": image.file_bytes()} for image in r.images]
    try:
        pq.write_table(pa.Table.from_pylist(rows), path)
    except pa.ArrowException as e:
        raise UserError(
            f"{path}: cannot store this metadata in parquet ({e}); each metadata key must hold the same type in "
            "every record and nested objects must not be empty — or write .jsonl instead"
        ) from None
