"""Prompt data with condition images: .jsonl paths relative to the file, verl parquet rows with image bytes, the size
rule and the checks that name the file and line; `prepare edit` and the ShapesWorld edit files."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from diffusion_rl.cli import main
from diffusion_rl.data.condition_images import check_condition_images, fit_condition_images
from diffusion_rl.data.edit_prepare import prepare_edit
from diffusion_rl.data.prompts import load_prompts, write_prompts
from diffusion_rl.data.shapes_edits import write_edit_files
from diffusion_rl.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def png(path: Path, width: int, height: int, color=(200, 30, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:, : width // 2] = color  # left half coloured: shows where a crop or a letterbox went
    Image.fromarray(pixels).save(path)
    return path


def png_bytes(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 90, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_jsonl_image_paths_are_relative_to_the_file_and_fitted_by_cover_and_crop(tmp_path):
    png(tmp_path / "data" / "img" / "wide.png", 64, 32)
    lines = [
        {"prompt": "make it blue", "images": ["img/wide.png"]},
        {"prompt": "remove it", "images": ["img/wide.png"]},
    ]
    (tmp_path / "data" / "edits.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    records = load_prompts(tmp_path / "data" / "edits.jsonl")
    assert [len(r.images) for r in records] == [1, 1]
    assert "edits.jsonl, line 2" in records[1].images[0].where
    assert check_condition_images(records, 32, 32, "edits") == 1
    (fitted,), (again,) = fit_condition_images([records[0].images, records[1].images], 32, 32)
    # 64×32 covering 32×32: scaled by 1 (height fits), the centre 32 columns cut out: 16 red, then 16 black
    assert fitted.shape == (32, 32, 3) and fitted is again  # one image, read once
    assert (fitted[:, :16] == (200, 30, 30)).all() and (fitted[:, 16:] == 0).all()


def test_verl_parquet_rows_with_image_bytes_and_chat_prompts(tmp_path):
    rows = [
        {"data_source": "edit", "prompt": [{"role": "user", "content": "<image>make the sky pink"}],
         "images": [{"bytes": png_bytes(40, 40), "path": None}], "ability": "edit"},
        {"data_source": "edit", "prompt": [{"role": "user", "content": "<image> <image> put the cat on the sofa"}],
         "images": [{"bytes": png_bytes(40, 40)}, {"bytes": png_bytes(40, 40)}], "ability": "edit"},
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "edits.parquet")
    records = load_prompts(tmp_path / "edits.parquet")
    assert [r.prompt for r in records] == ["make the sky pink", "put the cat on the sofa"]
    assert [len(r.images) for r in records] == [1, 2] and records[0].metadata["ability"] == "edit"
    assert records[1].images[1].where.endswith("row 1 (0-based), images[1]")
    write_prompts(records, tmp_path / "again.parquet")  # the placeholders are written back and read out again
    again = load_prompts(tmp_path / "again.parquet")
    assert [(r.prompt, [i.file_bytes() for i in r.images]) for r in again] == [
        (r.prompt, [i.file_bytes() for i in r.images]) for r in records
    ]
    rows[0]["prompt"] = [{"role": "user", "content": "<image><image>too many marks"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(
        UserError, match=r"bad.parquet, row 0 \(0-based\): the prompt has 2 '<image>' placeholders but 1"
    ):
        load_prompts(tmp_path / "bad.parquet")


def test_bad_condition_images_name_the_file_and_line(tmp_path):
    png(tmp_path / "ok.png", 32, 32)
    png(tmp_path / "tiny.png", 6, 6)
    (tmp_path / "broken.png").write_text("not a picture")

    def dataset(*entries):
        path = tmp_path / "edits.jsonl"
        path.write_text("".join(json.dumps({"prompt": "edit", "images": e}) + "\n" for e in entries))
        return load_prompts(path)

    with pytest.raises(
        UserError, match=r"edits.jsonl, line 2, images\[0\] \(missing.png\): the image file .* does not"
    ):
        check_condition_images(dataset(["ok.png"], ["missing.png"]), 32, 32, "edits")
    with pytest.raises(UserError, match=r"line 1, images\[1\] \(broken.png\): cannot read the image"):
        check_condition_images(dataset(["ok.png", "broken.png"], ["ok.png", "ok.png"]), 32, 32, "edits")
    with pytest.raises(UserError, match=r"line 2, .*tiny.png.*6×6, too small for the output 32×32"):
        check_condition_images(dataset(["ok.png"], ["tiny.png"]), 32, 32, "edits")
    with pytest.raises(UserError, match=r"different numbers of condition images: 1 \(record 0\), 2 \(record 1\)"):
        check_condition_images(dataset(["ok.png"], ["ok.png", "ok.png"]), 32, 32, "edits")


def test_prepare_edit_letterboxes_into_parquet_with_a_validation_split(tmp_path):
    png(tmp_path / "in" / "a.png", 80, 40)
    png(tmp_path / "in" / "sub" / "b.png", 30, 60)
    lines = [{"prompt": f"edit {i}", "image": "a.png" if i % 2 else "sub/b.png"} for i in range(10)]
    (tmp_path / "in" / "edits.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["prepare", "edit", str(tmp_path / "in"), str(tmp_path / "out"), "--size", "40",
                 "--val-fraction", "0.2"]) == 0  # fmt: skip
    train, val = load_prompts(tmp_path / "out" / "train.parquet"), load_prompts(tmp_path / "out" / "val.parquet")
    assert len(train) == 8 and len(val) == 2
    assert sorted(r.prompt for r in train + val) == sorted(x["prompt"] for x in lines)
    wide = next(r for r in train + val if r.prompt == "edit 1").images[0]
    with wide.open() as picture:
        assert picture.format == "PNG" and picture.size == (40, 40)
        pixels = np.asarray(picture.convert("RGB"))
    # 80×40 letterboxed into 40×40: scaled to 40×20, rows 10..29; black bands above and below
    assert (pixels[:10] == 0).all() and (pixels[30:] == 0).all() and (pixels[15, :18] == (200, 30, 30)).all()
    table = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert table[0]["prompt"][0]["content"].startswith("<image>") and table[0]["ability"] == "edit"
    (tmp_path / "in" / "more.jsonl").write_text(json.dumps({"prompt": "x", "image": "gone.png"}) + "\n")
    with pytest.raises(UserError, match=r"more.jsonl, line 1 \(gone.png\): the image file .* does not exist"):
        prepare_edit(tmp_path / "in", tmp_path / "out2", 40, 0.0, 0)


def test_the_committed_shapes_edit_files_are_what_prepare_writes(tmp_path):
    committed = ROOT / "configs/prompts/shapes_edits"
    write_edit_files(tmp_path, size=32, train=48, val=6, seed=0)
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file())
    assert all((tmp_path / p).read_bytes() == (committed / p).read_bytes() for p in written)
    records = load_prompts(committed / "train.jsonl")
    assert {r.prompt.split()[0] for r in records} == {"make", "remove", "move"}
    assert check_condition_images(records, 32, 32, "shapes edits") == 1


def png_header_claiming(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width × height (its pixels are a 1×1 image's): what a decompression bomb looks like
    to a reader that checks the header first, built without allocating the pixels."""
    import struct
    import zlib

    data = bytearray(png_bytes(1, 1))
    ihdr = data[12:29]  # b"IHDR" + 13 bytes of fields; the CRC follows
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("side", [12000, 20000])  # 144 MP: PIL only warns; 400 MP: PIL's DecompressionBombError
def test_huge_condition_images_are_refused_from_the_header_naming_file_and_line(tmp_path, side):
    png(tmp_path / "in" / "ok.png", 32, 32)
    png_header_claiming(tmp_path / "in" / "huge.png", side, side)
    lines = [{"prompt": "a", "images": ["ok.png"]}, {"prompt": "b", "images": ["huge.png"]}]
    (tmp_path / "in" / "edits.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    # PIL refuses 400 MP before giving the size, so that message gives the pixel count
    size = rf"(is {side}×{side}|has {side * side} pixels)"
    message = rf"edits.jsonl, line 2 \(huge.png\): the image {size}, more than 8192×8192"
    with pytest.raises(UserError, match=message):
        prepare_edit(tmp_path / "in", tmp_path / "out", 32, 0.0, 0)
    records = load_prompts(tmp_path / "in" / "edits.jsonl")  # what `train` checks before a run
    with pytest.raises(UserError, match=message.replace(r" \(huge", r", images\[0\] \(huge")):
        check_condition_images(records, 32, 32, "edits")


def truncated_png(path: Path) -> Path:
    """A 64×64 PNG of noise cut after 3000 of its ~12 kB: its header reads, its pixels do not all decode."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, "PNG")
    path.write_bytes(buffer.getvalue()[:3000])
    return path


def test_a_truncated_image_in_prepare_edit_names_the_file_and_line(tmp_path, capsys):
    truncated_png(tmp_path / "cut.png")
    (tmp_path / "edits.jsonl").write_text(json.dumps({"prompt": "x", "image": "cut.png"}) + "\n")
    assert main(["prepare", "edit", str(tmp_path), str(tmp_path / "out"), "--size", "32"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "edits.jsonl, line 1 (cut.png): cannot decode the image" in err[0], err


def test_absurd_image_sizes_are_refused_before_any_work(tmp_path):
    with pytest.raises(UserError, match=r"--size must be in \[16, 4096\] px, got 100000"):
        prepare_edit(tmp_path, tmp_path / "out", 100000, 0.0, 0)
    with pytest.raises(UserError, match=r"ShapesWorld images need a size in \[16, 1024\] px, got 100000"):
        write_edit_files(tmp_path / "shapes", size=100000, train=1, val=0)
    assert not (tmp_path / "shapes").exists()


def test_condition_images_in_counts_a_datasets_images_for_estimate(tmp_path):
    from diffusion_rl.data.prompts import condition_images_in

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    rows = [{"prompt": "two", "images": ["a.png", "a.png"]}, {"prompt": "two more", "images": ["a.png", "a.png"]}]
    (tmp_path / "two.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert condition_images_in(tmp_path / "two.jsonl") == 2
    assert condition_images_in(tmp_path / "missing.txt") == 0  # a text file never carries images
    assert condition_images_in(tmp_path / "missing.parquet") is None  # still to be prepared: estimate assumes one


def test_a_truncated_condition_image_is_found_when_the_run_starts_naming_its_file_and_line(tmp_path):
    png(tmp_path / "ok.png", 32, 32)
    truncated_png(tmp_path / "cut.png")
    with Image.open(tmp_path / "cut.png") as header:
        assert header.size == (64, 64)  # what a check of the headers alone let through
    lines = [{"prompt": "a", "images": ["ok.png"]}, {"prompt": "b", "images": ["cut.png"]}]
    (tmp_path / "edits.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(UserError, match=r"edits.jsonl, line 2, images\[0\] \(cut.png\): cannot decode the image"):
        check_condition_images(load_prompts(tmp_path / "edits.jsonl"), 32, 32, "edits")
    rows = [{"prompt": "a", "images": [{"bytes": png_bytes(40, 40)}]},
            {"prompt": "b", "images": [{"bytes": (tmp_path / "cut.png").read_bytes()}]}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "edits.parquet")
    with pytest.raises(UserError, match=r"edits.parquet, row 1 \(0-based\), images\[0\]: cannot decode the image"):
        check_condition_images(load_prompts(tmp_path / "edits.parquet"), 32, 32, "edits")


def test_each_condition_image_is_decoded_once_whichever_records_and_sets_share_it(tmp_path, monkeypatch):
    from PIL import ImageFile

    for name in ("a.png", "b.png"):
        png(tmp_path / name, 32, 32)
    loads, load = [], ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda image: loads.append(image.filename) or load(image))
    lines = [{"prompt": p, "images": [i]} for p, i in (("a", "a.png"), ("b", "b.png"), ("c", "a.png"))]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "val.jsonl").write_text(json.dumps({"prompt": "v", "images": ["b.png"]}) + "\n")
    decoded = set()
    check_condition_images(load_prompts(tmp_path / "train.jsonl"), 32, 32, "train", decoded)
    check_condition_images(load_prompts(tmp_path / "val.jsonl"), 64, 64, "val", decoded)  # b.png again: its size only
    assert sorted(Path(f).name for f in loads) == ["a.png", "b.png"]


def test_a_run_whose_edit_data_holds_a_truncated_image_stops_before_step_1(flux_kontext_model_dir, tmp_path, capsys):
    # the first 17 ShapesWorld edits, the 17th's source image cut: a 1-step run need not sample it (it ran, exit 0)
    edits = ROOT / "configs/prompts/shapes_edits"
    lines = [json.loads(line) for line in (edits / "train.jsonl").read_text().splitlines()[:17]]
    for line in lines:
        line["images"] = [str(edits / line["images"][0])]
    lines[-1]["images"] = [str(truncated_png(tmp_path / "cut.png"))]
    (tmp_path / "edits.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["train", str(ROOT / "configs/quickstart_edit.yaml"), f"model.path={flux_kontext_model_dir}",
            f"data.train={tmp_path / 'edits.jsonl'}", f"run.dir={tmp_path / 'run'}", "train.total_steps=1",
            f"val.prompts={ROOT / 'configs/prompts/shapes_edits/val.jsonl'}", "val.before_train=false", "val.every=0",
            "model.device=cpu", "log.tensorboard=false"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "edits.jsonl, line 17, images[0]" in err[0] and "cannot decode the image" in err[0], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran
