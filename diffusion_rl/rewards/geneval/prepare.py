"""`diffusion-rl prepare geneval IN OUT`: GenEval's metadata files as prompt records.

GenEval's `evaluation_metadata.jsonl` and flow_grpo's `dataset/geneval/{train,test}_metadata.jsonl` hold one JSON
object per line: the prompt and, beside it, the clauses the `geneval` reward checks (`tag`, `include`, `exclude`).
A prompt record keeps what a reward reads under `metadata`, so each row becomes {prompt, data_source: "geneval",
metadata: the row without its prompt}. Every row's clauses are checked as the reward will read them
(rules.py `parse_metadata`) before anything is written; a row that is not a JSON object of those keys with a
non-empty prompt, or whose clauses the reward cannot read, is one error naming the file and line.
"""

from __future__ import annotations

from pathlib import Path

from diffusion_rl.data.prompts import PromptRecord, read_jsonl, write_prompts
from diffusion_rl.errors import UserError
from diffusion_rl.rewards.geneval.rules import parse_metadata
from diffusion_rl.utils.files import refuse_same_file

GENEVAL_DATA_SOURCE = "geneval"
GENEVAL_KEYS = ("prompt", "tag", "include", "exclude")
EXAMPLE = '{"tag": "counting", "include": [{"class": "cat", "count": 2}], "prompt": "a photo of two cats"}'


def prepare_geneval(input_path: str | Path, out_path: str | Path) -> int:
    """Write the rows of `input_path` (GenEval-format .jsonl) to `out_path` (.jsonl or .parquet); the row count."""
    source = Path(input_path)
    if not source.is_file():
        raise UserError(f"prepare geneval: {source} is not a file")
    refuse_same_file("prepare geneval", input=source, output=out_path)
    records = []
    for row, where in read_jsonl(source, GENEVAL_KEYS, EXAMPLE):
        if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise UserError(f"prepare geneval: {where}: a row needs a non-empty 'prompt'; e.g. {EXAMPLE}")
        metadata = {key: value for key, value in row.items() if key != "prompt"}
        try:
            parse_metadata(metadata)
        except UserError as e:
            raise UserError(f"prepare geneval: {where}: {e}") from None
        records.append(PromptRecord(row["prompt"], data_source=GENEVAL_DATA_SOURCE, metadata=metadata))
    if not records:
        raise UserError(f"prepare geneval: {source} holds no rows")
    write_prompts(records, out_path)
    return len(records)
