"""`diffusion-rl prepare geneval`: GenEval's metadata rows (as GenEval and flow_grpo's dataset/geneval ship them:
the clauses beside the prompt) become prompt records the trainer loads, with the clauses as the reward's metadata;
a bad row is one error naming the file and line."""

from __future__ import annotations

import json

import pytest

from diffusion_rl.cli import main
from diffusion_rl.data.prompts import load_prompts
from diffusion_rl.errors import UserError
from diffusion_rl.rewards.geneval.prepare import prepare_geneval
from diffusion_rl.rewards.geneval.rules import parse_metadata

ROWS = [  # the first two rows of flow_grpo's dataset/geneval/test_metadata.jsonl
    {"tag": "counting", "include": [{"class": "wine glass", "count": 2}],
     "exclude": [{"class": "wine glass", "count": 3}], "prompt": "a photo of two wine glasses"},
    {"tag": "color_attr", "include": [{"class": "handbag", "count": 1, "color": "pink"},
                                      {"class": "scissors", "count": 1, "color": "black"}],
     "prompt": "a photo of a pink handbag and a black scissors"},
]  # fmt: skip


def test_geneval_rows_become_prompt_records_with_their_clauses_as_metadata(tmp_path):
    source = tmp_path / "test_metadata.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS) + "\n")  # a trailing blank line is skipped
    out = tmp_path / "geneval.jsonl"
    assert main(["prepare", "geneval", str(source), str(out)]) == 0
    records = load_prompts(out)
    assert [r.prompt for r in records] == [row["prompt"] for row in ROWS]
    assert {r.data_source for r in records} == {"geneval"}
    for record, row in zip(records, ROWS):
        assert record.metadata == {k: v for k, v in row.items() if k != "prompt"}
        assert parse_metadata(record.reward_metadata()).tag == row["tag"]  # what the reward reads


@pytest.mark.parametrize(
    ("line", "message"),
    [("not json", r"rows\.jsonl, line 2: invalid JSON"),
     (json.dumps({"tag": "single_object", "include": []}), r"rows\.jsonl, line 2: a row needs a non-empty 'prompt'"),
     (json.dumps({"prompt": "a cat", "include": [{"class": "cat", "count": 0}]}),
      r"rows\.jsonl, line 2: GenEval metadata: include\[0\]\.count must be an integer ≥ 1, got 0"),
     (json.dumps({"prompt": "a cat", "includes": []}), r"rows\.jsonl, line 2: unknown key 'includes'")],
)  # fmt: skip
def test_a_bad_row_is_one_error_naming_its_line_and_nothing_is_written(tmp_path, line, message):
    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(UserError, match=message):
        prepare_geneval(source, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_an_output_that_is_the_input_is_refused(tmp_path):
    source = tmp_path / "g.jsonl"
    source.write_text('{"prompt": "a red cube", "tag": "single_object", "include": [{"class": "cube", "count": 1}]}\n')
    with pytest.raises(UserError, match="prepare geneval: the input and the output are one file"):
        prepare_geneval(source, source)
    assert "red cube" in source.read_text()
