import argparse

import pyarrow.parquet as pq
import pytest

from diffusion_rl.data.ocr_prepare import (
    add_prepare_ocr_arguments,
    prepare_ocr,
    run_prepare_ocr_from_args,
    synthetic_ocr_prompts,
    write_synthetic_ocr,
)
from diffusion_rl.data.prompts import PromptRecord, load_prompts
from diffusion_rl.errors import UserError

PROMPTS = [
    'A storefront sign that says "OPEN LATE"',
    'A coffee mug printed with "Good Morning"',
    'A chalkboard with "SOUP OF THE DAY" and "tea"',
    'A neon sign glowing "24/7"',
]


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.mark.parametrize("ext", [".jsonl", ".parquet"])
def test_prepare_round_trip(prompt_file, tmp_path, ext):
    out = tmp_path / f"ocr{ext}"
    result = prepare_ocr(prompt_file, out, negative_prompt="blurry, low quality")
    assert (result.n_train, result.n_val, result.skipped_lines) == (4, 0, [])
    records = load_prompts(out)
    assert [r.prompt for r in records] == PROMPTS
    assert [r.ground_truth for r in records] == ["OPEN LATE", "Good Morning", "SOUP OF THE DAY", "24/7"]
    assert all(r.data_source == "ocr" for r in records)
    assert all(r.negative_prompt == "blurry, low quality" for r in records)
    assert all(r.metadata == {"ability": "ocr", "split": "train"} for r in records)
    if ext == ".parquet":  # verl's layout, with the task in its own column
        table = pq.read_table(out)
        assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        assert table.column("ability").to_pylist() == ["ocr"] * 4
        assert all("ability" not in info for info in table.column("extra_info").to_pylist())


def test_prompts_without_quotes_are_listed_by_line_number(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text(f'{PROMPTS[0]}\nno quotes here\n\n{PROMPTS[1]}\nan empty "" pair\n')
    with pytest.raises(UserError, match=r"2 prompts have no double-quoted text.*lines 2, 5;.*'no quotes here'") as e:
        prepare_ocr(path, tmp_path / "out.jsonl")
    assert "--skip-invalid" in str(e.value)  # the flag as the command line spells it


def test_skip_invalid_drops_them_and_reports_the_lines(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text(f"{PROMPTS[0]}\nno quotes here\n\n{PROMPTS[1]}\n")
    result = prepare_ocr(path, tmp_path / "out.jsonl", skip_invalid=True)
    assert (result.n_train, result.skipped_lines) == (2, [2])
    assert [r.ground_truth for r in load_prompts(tmp_path / "out.jsonl")] == ["OPEN LATE", "Good Morning"]


def test_validation_split_is_seeded_and_goes_to_its_own_file(prompt_file, tmp_path):
    first = prepare_ocr(prompt_file, tmp_path / "a.jsonl", val_fraction=0.5, seed=3, val_path=tmp_path / "a_val.jsonl")
    prepare_ocr(prompt_file, tmp_path / "b.jsonl", val_fraction=0.5, seed=3, val_path=tmp_path / "b_val.jsonl")
    val_prompts = [r.prompt for r in load_prompts(tmp_path / "a_val.jsonl")]
    assert (first.n_train, first.n_val) == (2, 2) and len(val_prompts) == 2
    assert val_prompts == [r.prompt for r in load_prompts(tmp_path / "b_val.jsonl")]

    prepare_ocr(prompt_file, tmp_path / "train.parquet", val_fraction=0.5, seed=3, val_path=tmp_path / "val.parquet")
    train, val = load_prompts(tmp_path / "train.parquet"), load_prompts(tmp_path / "val.parquet")
    assert {r.metadata["split"] for r in train} == {"train"} and {r.metadata["split"] for r in val} == {"val"}
    assert [r.prompt for r in val] == val_prompts
    assert [r.prompt for r in train] == [p for p in PROMPTS if p not in val_prompts]


def test_jsonl_input_keeps_its_own_ground_truth(tmp_path):
    from diffusion_rl.data.prompts import write_prompts

    source = tmp_path / "in.jsonl"
    write_prompts([PromptRecord("a poster", ground_truth="EXPLICIT"), PromptRecord(PROMPTS[0])], source)
    prepare_ocr(source, tmp_path / "out.jsonl")
    assert [r.ground_truth for r in load_prompts(tmp_path / "out.jsonl")] == ["EXPLICIT", "OPEN LATE"]


def test_bad_val_fraction_is_a_user_error(prompt_file, tmp_path):
    with pytest.raises(UserError, match="val_fraction"):
        prepare_ocr(prompt_file, tmp_path / "out.jsonl", val_fraction=1.0)
    with pytest.raises(UserError, match="gives 0 val prompts"):  # 4 prompts x 0.1 rounds to 0
        prepare_ocr(prompt_file, tmp_path / "out.jsonl", val_fraction=0.1, val_path=tmp_path / "val.jsonl")


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_prepare_ocr_arguments(parser)
    return parser.parse_args(argv)


def test_command_line_helpers_prepare_a_file_or_synthetic_prompts(prompt_file, tmp_path):
    out = tmp_path / "out.parquet"
    result = run_prepare_ocr_from_args(_parse(str(prompt_file), str(out), "--negative-prompt", "blurry"))
    assert result.n_train == 4 and load_prompts(out)[0].negative_prompt == "blurry"

    train, val = tmp_path / "syn_train.jsonl", tmp_path / "syn_val.jsonl"
    args = _parse("--synthetic", "10", str(train), "--val-fraction", "0.2", "--val-out", str(val))
    assert (run_prepare_ocr_from_args(args).n_train, len(load_prompts(val))) == (8, 2)
    written = sorted(r.prompt for r in load_prompts(train) + load_prompts(val))
    assert written == sorted(r.prompt for r in synthetic_ocr_prompts(10, seed=0))
    with pytest.raises(UserError, match="usage is"):
        run_prepare_ocr_from_args(_parse("--synthetic", "3", str(prompt_file), str(out)))
    with pytest.raises(UserError, match="usage is"):
        run_prepare_ocr_from_args(_parse(str(prompt_file)))


def test_synthetic_prompts_are_deterministic_for_a_seed():
    a, b = synthetic_ocr_prompts(20, seed=7), synthetic_ocr_prompts(20, seed=7)
    assert a == b
    assert a != synthetic_ocr_prompts(20, seed=8)
    for record in a:
        assert f'"{record.ground_truth}"' in record.prompt
        assert record.data_source == "ocr"
        assert 1 <= len(record.ground_truth.split()) <= 3


def test_synthetic_prompts_round_trip_through_parquet(tmp_path):
    from diffusion_rl.data.prompts import write_prompts

    records = synthetic_ocr_prompts(5, seed=0)
    write_prompts(records, tmp_path / "synthetic.parquet")
    assert load_prompts(tmp_path / "synthetic.parquet") == records


def test_val_fraction_without_val_out_is_an_error_naming_both_flags(prompt_file, tmp_path):
    out = tmp_path / "out.jsonl"
    with pytest.raises(UserError) as info:
        run_prepare_ocr_from_args(_parse(str(prompt_file), str(out), "--val-fraction", "0.25"))
    assert str(info.value) == (
        "prepare ocr: --val-fraction 0.25 needs --val-out FILE for the val prompts (nothing reads the split=val "
        "mark, so val prompts left in OUT would be trained on)"
    )
    with pytest.raises(UserError) as info:
        prepare_ocr(prompt_file, out, val_fraction=0.25)
    assert str(info.value) == (
        "prepare ocr: val_fraction 0.25 needs val_path: nothing reads the split mark, so val records left in the "
        "training file would be trained on"
    )
    assert not out.exists()


def test_val_out_help_names_the_positional_out():
    parser = argparse.ArgumentParser()
    add_prepare_ocr_arguments(parser)
    help_of = {a.dest: a.help for a in parser._actions}
    assert help_of["val_out"] == "write the val prompts to this file (the train ones go to OUT); needs --val-fraction"
    assert "--out" not in parser.format_help()


def test_an_input_records_own_data_source_is_kept(tmp_path):
    from diffusion_rl.data.prompts import write_prompts

    source = tmp_path / "in.jsonl"
    write_prompts([PromptRecord(PROMPTS[0], data_source="signs"), PromptRecord(PROMPTS[1])], source)
    prepare_ocr(source, tmp_path / "out.jsonl")
    assert [r.data_source for r in load_prompts(tmp_path / "out.jsonl")] == ["signs", "ocr"]
    prepare_ocr(source, tmp_path / "out2.jsonl", data_source="text")
    assert [r.data_source for r in load_prompts(tmp_path / "out2.jsonl")] == ["signs", "text"]


def test_an_output_that_is_the_input_or_the_other_output_is_refused_before_writing(tmp_path):
    """The same path twice would lose a file: the val output written over the train prompts, or the input over."""
    source = tmp_path / "in.txt"
    source.write_text('"A" sign\n"B" sign\n"C" sign\n"D" sign\n')
    with pytest.raises(UserError, match=r"prepare ocr: the output and the val_output are one file \(.*t\.jsonl\)"):
        prepare_ocr(source, tmp_path / "t.jsonl", val_fraction=0.5, val_path=tmp_path / "t.jsonl")
    with pytest.raises(UserError, match="prepare ocr: the input and the output are one file"):
        prepare_ocr(source, source)
    with pytest.raises(UserError, match="prepare ocr: the output and the val_output are one file"):
        write_synthetic_ocr(4, tmp_path / "s.jsonl", val_fraction=0.5, val_path=tmp_path / "." / "s.jsonl")
    assert source.read_text().count("sign") == 4 and not (tmp_path / "t.jsonl").exists()
