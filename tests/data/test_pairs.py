"""Offline preference pairs: reading .jsonl/.parquet, resolving image paths, and errors that name file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from diffusion_rl.data.pairs import PreferencePair, load_image, load_pairs, write_pairs
from diffusion_rl.errors import UserError


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for name in ("a.png", "b.png"):
        Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(folder / name)
    return folder


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


GOOD = {"prompt": "a cat", "chosen": "images/a.png", "rejected": "images/b.png"}


def test_jsonl_pairs_resolve_image_paths_against_the_file(tmp_path, images):
    path = _write(tmp_path / "pairs.jsonl", [GOOD, "", {**GOOD, "chosen_score": 2, "rejected_score": 1.5}])
    pairs = load_pairs(path)
    assert len(pairs) == 2  # the blank line is skipped
    assert pairs[0].chosen == (images / "a.png").resolve() and pairs[0].rejected == (images / "b.png").resolve()
    assert pairs[0].chosen_score is None and pairs[1].chosen_score == 2.0 and pairs[1].rejected_score == 1.5


def test_parquet_pairs_read_like_jsonl(tmp_path, images):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # the second row's absent optional columns are nulls in the table: they read as absent
    rows = [{**GOOD, "negative_prompt": "blurry", "chosen_score": 1.0, "rejected_score": 0.0}, GOOD]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    pairs = load_pairs(tmp_path / "pairs.parquet")
    assert [p.negative_prompt for p in pairs] == ["blurry", None]
    assert pairs[0].chosen_score == 1.0 and pairs[1].chosen_score is None


def test_write_pairs_reads_back_with_relative_paths(tmp_path, images):
    pair = PreferencePair("a cat", images / "a.png", images / "b.png", None, 3.0, 1.0)
    write_pairs([pair], tmp_path / "pairs.jsonl")
    assert json.loads((tmp_path / "pairs.jsonl").read_text())["chosen"] == "images/a.png"
    assert load_pairs(tmp_path / "pairs.jsonl") == [
        PreferencePair("a cat", (images / "a.png").resolve(), (images / "b.png").resolve(), None, 3.0, 1.0)
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"line 2: invalid JSON"),
        ('["a", "b"]', r"line 2: expected a JSON object"),
        ({"chosen": "images/a.png", "rejected": "images/b.png"}, r"line 2: 'prompt' must be a non-empty string"),
        ({**GOOD, "rejected": ""}, r"line 2: 'rejected' must be a non-empty string"),
        ({**GOOD, "chosen_scor": 1.0}, r"line 2: unknown key 'chosen_scor' \(did you mean 'chosen_score'\?\)"),
        ({**GOOD, "chosen_score": "high"}, r"line 2: 'chosen_score' must be a number"),
        ({**GOOD, "chosen_score": 0.1, "rejected_score": 0.9}, r"line 2: chosen_score 0.1 < rejected_score 0.9"),
        ({**GOOD, "chosen": "images/missing.png"}, r"line 2: chosen image 'images/missing.png' not found"),
    ],
)
def test_malformed_rows_name_the_file_and_line(tmp_path, images, line, message):
    path = _write(tmp_path / "pairs.jsonl", [GOOD, line])
    with pytest.raises(UserError, match=message) as error:
        load_pairs(path)
    assert str(path) in str(error.value)


def test_missing_empty_or_unknown_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_pairs(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match="no pairs found"):
        load_pairs(_write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(UserError, match=r"\.jsonl or \.parquet"):
        load_pairs(_write(tmp_path / "pairs.csv", ["prompt,chosen,rejected"]))


def test_load_image_resizes_the_short_side_and_crops_the_centre(tmp_path):
    # 4 × 8 (h × w): left half black, right half white; to 2 × 2 the short side halves, then the centre 2 columns
    pixels = np.zeros((4, 8, 3), dtype=np.uint8)
    pixels[:, 4:] = 255
    Image.fromarray(pixels).save(tmp_path / "wide.png")
    image = load_image(tmp_path / "wide.png", 2, 2)
    assert image.shape == (2, 2, 3) and image.dtype.is_floating_point is False
    assert image[:, 0].float().mean() < 128 < image[:, 1].float().mean()  # the crop straddles the edge
    Image.fromarray(pixels).save(tmp_path / "same.png")
    assert np.array_equal(load_image(tmp_path / "same.png", 4, 8).numpy(), pixels)  # the right size is kept as is


def test_unreadable_image_is_a_user_error(tmp_path):
    (tmp_path / "bad.png").write_text("not an image")
    with pytest.raises(UserError, match="bad.png"):
        load_image(tmp_path / "bad.png", 4, 4)
