import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffusion_rl.data.prompts import PromptRecord, load_prompts, write_prompts
from diffusion_rl.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---- .txt ----


def test_txt_strips_lines_and_skips_blanks(tmp_path):
    path = write_lines(tmp_path / "p.txt", ["  a red apple  ", "", "   ", "a blue car\r", "a cat"])
    assert load_prompts(path) == [PromptRecord("a red apple"), PromptRecord("a blue car"), PromptRecord("a cat")]


def test_txt_defaults(tmp_path):
    (record,) = load_prompts(write_lines(tmp_path / "p.txt", ["a dog"]))
    assert record.negative_prompt is None
    assert record.ground_truth is None
    assert record.data_source == "default"
    assert record.metadata == {}


def test_shipped_prompt_files_load():
    quickstart = load_prompts(REPO / "configs/prompts/quickstart.txt")
    val = load_prompts(REPO / "configs/prompts/val.txt")
    assert 16 <= len(quickstart) <= 32
    assert len(val) == 4
    assert len({r.prompt for r in quickstart}) == len(quickstart)
    assert not {r.prompt for r in quickstart} & {r.prompt for r in val}


# ---- .jsonl ----


def test_jsonl_reads_all_fields_and_skips_blank_lines(tmp_path):
    lines = [
        json.dumps({"prompt": "a sign that says hello", "ground_truth": "hello", "data_source": "ocr"}),
        "",
        json.dumps({"prompt": "two cats", "negative_prompt": "blurry", "metadata": {"count": 2, "tags": ["x"]}}),
    ]
    records = load_prompts(write_lines(tmp_path / "p.jsonl", lines))
    assert records == [
        PromptRecord("a sign that says hello", ground_truth="hello", data_source="ocr"),
        PromptRecord("two cats", negative_prompt="blurry", metadata={"count": 2, "tags": ["x"]}),
    ]


def test_jsonl_null_optional_fields_mean_defaults(tmp_path):
    line = json.dumps({"prompt": "a", "negative_prompt": None, "data_source": None, "metadata": None})
    assert load_prompts(write_lines(tmp_path / "p.jsonl", [line])) == [PromptRecord("a")]


def test_jsonl_accepts_chat_style_prompt(tmp_path):
    msgs = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "a red apple"}]
    (record,) = load_prompts(write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": msgs})]))
    assert record.prompt == "a red apple"


@pytest.mark.parametrize(
    "bad_line, expected",
    [
        ('{"prompt": "a", ', "invalid JSON"),
        ('{"negative_prompt": "x"}', "missing 'prompt'"),
        ('{"prompt": 3}', "'prompt' must be a string, got int"),
        ('{"prompt": "   "}', "'prompt' is empty"),
        ('["a red apple"]', "expected a JSON object, got list"),
        ('{"prompt": "a", "ground_truht": "x"}', "did you mean 'ground_truth'"),
        ('{"prompt": "a", "metadata": [1]}', "'metadata' must be an object"),
        ('{"prompt": "a", "ground_truth": 5}', "'ground_truth' must be a string or null, got int"),
        ('{"prompt": [{"role": "system", "content": "x"}]}', "no message with role 'user'"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, bad_line, expected):
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "fine"}', "", bad_line])
    with pytest.raises(UserError) as err:
        load_prompts(path)
    message = str(err.value)
    assert "bad.jsonl" in message
    assert "line 3" in message
    assert expected in message


@pytest.mark.parametrize(
    "value, expected",
    [
        ("[" * 100_000 + "]" * 100_000, "invalid JSON (arrays or objects nested over 100 deep at column 128)"),
        ('{"n": ' + "1" * 5000 + "}", "invalid JSON (an integer of over 4,300 digits at column 35)"),
    ],
    ids=["nested", "long_int"],
)
def test_json_that_python_fails_on_otherwise_names_file_and_line(tmp_path, value, expected):
    """json.loads raises RecursionError and ValueError there, not a JSONDecodeError."""
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "fine"}', '{"prompt": "a", "metadata": ' + value + "}"])
    with pytest.raises(UserError) as err:
        load_prompts(path)
    assert str(err.value).startswith(f"{path}, line 2: {expected}")


# ---- .parquet ----


def test_parquet_plain_rows(tmp_path):
    path = tmp_path / "plain.parquet"
    rows = [
        {"prompt": "a red apple", "negative_prompt": None, "ground_truth": None, "data_source": None},
        {"prompt": "a sign saying hi", "negative_prompt": "blurry", "ground_truth": "hi", "data_source": "ocr"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_prompts(path) == [
        PromptRecord("a red apple"),
        PromptRecord("a sign saying hi", negative_prompt="blurry", ground_truth="hi", data_source="ocr"),
    ]


def test_parquet_verl_rows(tmp_path):
    path = tmp_path / "verl.parquet"
    rows = [
        {
            "data_source": "ocr",
            "prompt": [
                {"role": "system", "content": "you draw pictures"},
                {"role": "user", "content": "a sign that says open"},
            ],
            "ability": "text_rendering",
            "reward_model": {"ground_truth": "open", "style": "rule"},
            "extra_info": {"index": 0, "split": "train", "negative_prompt": "low quality"},
        },
        {
            "data_source": "ocr",
            "prompt": [{"role": "user", "content": "a mug that says tea"}],
            "ability": "text_rendering",
            "reward_model": {"ground_truth": "tea", "style": "rule"},
            "extra_info": {"index": 1, "split": "train", "negative_prompt": None},
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    first, second = load_prompts(path)
    assert first == PromptRecord(
        "a sign that says open",
        negative_prompt="low quality",
        ground_truth="open",
        data_source="ocr",
        metadata={"index": 0, "split": "train", "ability": "text_rendering"},
    )
    assert second.prompt == "a mug that says tea"
    assert second.negative_prompt is None
    assert second.ground_truth == "tea"
    assert second.metadata == {"index": 1, "split": "train", "ability": "text_rendering"}


def test_parquet_takes_last_user_message(tmp_path):
    path = tmp_path / "chat.parquet"
    msgs = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}]
    msgs.append({"role": "user", "content": "second"})
    pq.write_table(pa.Table.from_pylist([{"prompt": msgs}]), path)
    assert load_prompts(path)[0].prompt == "second"


def test_parquet_chat_without_user_message_names_row(tmp_path):
    path = tmp_path / "chat.parquet"
    rows = [
        {"prompt": [{"role": "user", "content": "fine"}]},
        {"prompt": [{"role": "system", "content": "only a system message"}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(UserError, match=r"chat\.parquet, row 1 \(0-based\).*no message with role 'user'"):
        load_prompts(path)


def test_parquet_non_string_prompt_names_row(tmp_path):
    path = tmp_path / "nums.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": 1}, {"prompt": 2}]), path)
    with pytest.raises(UserError, match=r"nums\.parquet, row 0 \(0-based\): 'prompt' must be a string, got int"):
        load_prompts(path)


def test_parquet_unknown_column_suggests_name(tmp_path):
    path = tmp_path / "typo.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "negative_promt": "b"}]), path)
    with pytest.raises(UserError, match=r"typo\.parquet: unknown column 'negative_promt'.*did you mean"):
        load_prompts(path)


def test_parquet_without_prompt_column(tmp_path):
    path = tmp_path / "noprompt.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "a"}]), path)
    with pytest.raises(UserError, match=r"noprompt\.parquet: no 'prompt' column"):
        load_prompts(path)


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "junk.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match=r"junk\.parquet: cannot read as parquet"):
        load_prompts(path)


# ---- round trips ----

RECORDS = [
    PromptRecord("a red apple"),
    PromptRecord(
        "a sign that says open",
        negative_prompt="blurry",
        ground_truth="open",
        data_source="ocr",
        metadata={"index": 1, "tags": ["sign", "text"]},
    ),
    PromptRecord("a cat", data_source="animals", metadata={"index": 2, "tags": []}),
]


@pytest.mark.parametrize("ext", [".jsonl", ".parquet"])
def test_write_then_load_round_trips(tmp_path, ext):
    path = tmp_path / "sub" / f"out{ext}"
    write_prompts(RECORDS, path)
    assert load_prompts(path) == RECORDS


def test_written_parquet_has_verl_layout(tmp_path):
    path = tmp_path / "out.parquet"
    write_prompts(RECORDS[1:2], path)
    table = pq.read_table(path)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    (row,) = table.to_pylist()
    assert row["prompt"] == [{"role": "user", "content": "a sign that says open"}]
    assert row["reward_model"]["ground_truth"] == "open"
    assert row["data_source"] == "ocr"
    assert row["ability"] is None  # the record names no task
    assert row["extra_info"] == {"negative_prompt": "blurry", "index": 1, "tags": ["sign", "text"]}


def test_verl_omni_rows_keep_their_layout_through_load_and_write(tmp_path):
    # the row layout of verl-omni's OCR data (examples/flowgrpo_trainer/data_process/qwenimage_ocr.py)
    system = {"role": "system", "content": "Describe the image:"}
    source = tmp_path / "verl_omni.parquet"
    row = {
        "data_source": "flow_grpo/ocr",
        "prompt": [system, {"role": "user", "content": 'A sign that says "OPEN"'}],
        "negative_prompt": [system, {"role": "user", "content": "blurry"}],
        "ability": "ocr",
        "reward_model": {"style": "rule", "ground_truth": "OPEN"},
        "extra_info": {"split": "train", "index": 0},
    }
    pq.write_table(pa.Table.from_pylist([row]), source)
    (record,) = load_prompts(source)
    assert record == PromptRecord('A sign that says "OPEN"', negative_prompt="blurry", ground_truth="OPEN",
                                  data_source="flow_grpo/ocr", metadata={"split": "train", "index": 0,
                                                                         "ability": "ocr"})  # fmt: skip
    out = tmp_path / "out.parquet"
    write_prompts([record], out)
    table = pq.read_table(out)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    (written,) = table.to_pylist()
    assert {k: written[k] for k in ("data_source", "ability", "reward_model")} == {
        k: row[k] for k in ("data_source", "ability", "reward_model")
    }
    assert written["extra_info"] == {"negative_prompt": "blurry", "split": "train", "index": 0}  # no "ability"
    assert load_prompts(out) == [record]


def test_parquet_ability_column_and_extra_info_ability_must_agree(tmp_path):
    path = tmp_path / "both.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "ability": "ocr", "extra_info": {"ability": "math"}}]), path)
    with pytest.raises(
        UserError, match=r"both\.parquet, row 0 \(0-based\): 'ability' \('ocr'\) and 'extra_info\.ability'"
    ):
        load_prompts(path)


def test_write_rejects_unsupported_extension(tmp_path):
    with pytest.raises(UserError, match=r"out\.txt.*supported: \.jsonl, \.parquet"):
        write_prompts(RECORDS, tmp_path / "out.txt")


def test_write_rejects_empty_dataset(tmp_path):
    with pytest.raises(UserError, match="no records"):
        write_prompts([], tmp_path / "out.jsonl")


def test_write_parquet_with_inconsistent_metadata_types_explains(tmp_path):
    records = [PromptRecord("a", metadata={"x": 1}), PromptRecord("b", metadata={"x": "one"})]
    with pytest.raises(UserError, match="same type in every record"):
        write_prompts(records, tmp_path / "out.parquet")


def test_write_parquet_rejects_negative_prompt_metadata_key(tmp_path):
    with pytest.raises(UserError, match="collide"):
        write_prompts([PromptRecord("a", metadata={"negative_prompt": "x"})], tmp_path / "out.parquet")


# ---- file-level errors ----


def test_unknown_extension_lists_supported(tmp_path):
    path = write_lines(tmp_path / "prompts.csv", ["a"])
    with pytest.raises(UserError, match=r"prompts\.csv.*'\.csv'.*supported: \.txt, \.jsonl, \.parquet"):
        load_prompts(path)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match=r"nowhere\.txt does not exist"):
        load_prompts(tmp_path / "nowhere.txt")


@pytest.mark.parametrize("name, lines", [("empty.txt", ["", "  "]), ("empty.jsonl", [""])])
def test_empty_dataset(tmp_path, name, lines):
    path = write_lines(tmp_path / name, lines)
    with pytest.raises(UserError, match=re.escape(name) + ": no prompts found"):
        load_prompts(path)


def test_non_utf8_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.txt: not UTF-8"):
        load_prompts(path)


def test_record_validates_direct_construction():
    with pytest.raises(UserError, match="'prompt' is empty"):
        PromptRecord("")
    with pytest.raises(UserError, match="'data_source' must be a non-empty string"):
        PromptRecord("a", data_source="")


def test_parquet_conflicting_top_level_and_verl_ground_truth(tmp_path):
    path = tmp_path / "both.parquet"
    row = {"prompt": "a", "ground_truth": "x", "reward_model": {"ground_truth": "y", "style": "rule"}}
    pq.write_table(pa.Table.from_pylist([row]), path)
    with pytest.raises(UserError, match=r"both\.parquet, row 0 \(0-based\): 'ground_truth' .* differ"):
        load_prompts(path)


def test_a_prompt_no_encoder_could_read_is_cut_with_a_warning(tmp_path, caplog):
    from diffusion_rl.data.prompts import MAX_PROMPT_CHARS

    path = tmp_path / "p.txt"
    path.write_text("a short one\n" + "word " * 200_000 + "\n")  # a 1 MB line
    with caplog.at_level("WARNING", logger="diffusion_rl.data.prompts"):
        records = load_prompts(path)
    assert records[0].prompt == "a short one" and len(records[1].prompt) == MAX_PROMPT_CHARS
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"{path}: 1 prompt(s) longer than 65,536 characters (the first: prompt 2, 999,999 characters) cut" in (
        warning
    )


def test_a_prompt_file_is_read_and_logged_once_per_process_until_it_changes(tmp_path, caplog):
    """`train` asks for data.train in its memory check (an edit's images per row) and in the trainer: one line."""
    import logging
    import os

    from diffusion_rl.data.prompts import condition_images_in

    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a cat"}\n{"prompt": "a dog"}\n')
    with caplog.at_level(logging.INFO, logger="diffusion_rl.data.prompts"):
        assert condition_images_in(path) == 0
        first = load_prompts(path)
        again = load_prompts(path)
        assert [r.prompt for r in first] == [r.prompt for r in again] == ["a cat", "a dog"]
        again.pop()  # each caller gets its own list
        assert len(load_prompts(path)) == 2
        assert [r.getMessage() for r in caplog.records].count(f"loaded 2 prompts from {path}") == 1
        path.write_text('{"prompt": "a cow"}\n')  # changed: read again
        os.utime(path, ns=(1, 1))  # even within the file system's time resolution: another size, another time
        assert [r.prompt for r in load_prompts(path)] == ["a cow"]
