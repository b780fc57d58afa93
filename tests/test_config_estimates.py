"""The ready configs' header figures and docs/estimate.md's table are what `estimate` says today
(scripts/config_estimates.py writes both; here it only checks)."""

from __future__ import annotations

import functools
import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("config_estimates", ROOT / "scripts" / "config_estimates.py")
config_estimates = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(config_estimates)
READY = config_estimates.ready_configs()


def test_every_config_but_the_quickstarts_and_the_pretraining_is_ready_and_in_the_table():
    others = {p.name for p in (ROOT / "configs").glob("*.yaml")} - {p.name for p in READY}
    assert len(READY) >= 17 and all(n.startswith("quickstart") for n in others - {"shapes_pretrain.yaml"})
    doc = (ROOT / "docs/estimate.md").read_text(encoding="utf-8").split("\n")
    table = doc[doc.index(config_estimates.TABLE_START) + 3 : doc.index(config_estimates.TABLE_END)]
    assert [row.split(" | ")[0][2:] for row in table] == [p.stem for p in READY]


@pytest.mark.parametrize("path", READY, ids=[p.stem for p in READY])
def test_a_ready_configs_figures_are_todays_estimate(path):
    assert config_estimates.drift(path) == [], "run `python scripts/config_estimates.py --write`"


def test_a_stale_figure_is_found_and_rewritten_and_a_video_config_counts_videos(tmp_path, monkeypatch, capsys):
    for name in ("sd35_pickscore_fast.yaml", "wan21_t2v_1_3b_ocr_lora.yaml"):
        shutil.copy(ROOT / "configs" / name, tmp_path / name)
    doc = tmp_path / "estimate.md"
    shutil.copy(ROOT / "docs/estimate.md", doc)
    monkeypatch.setattr(config_estimates, "ROOT", tmp_path.parent)
    monkeypatch.setattr(config_estimates, "DOC", doc)
    monkeypatch.setattr(config_estimates, "ready_configs", lambda: sorted(tmp_path.glob("*.yaml")))
    monkeypatch.setattr(config_estimates, "run_estimate", functools.cache(config_estimates.run_estimate))  # 3 passes
    fast = tmp_path / "sd35_pickscore_fast.yaml"
    good = fast.read_text(encoding="utf-8")
    figure = good[good.index(" GiB per GPU") - 4 : good.index(" GiB per GPU")]  # e.g. "25.4"
    fast.write_text(good.replace(f"{figure} GiB per GPU", "99.9 GiB per GPU"), encoding="utf-8")
    assert config_estimates.main([]) == 1
    out = capsys.readouterr().out
    assert "sd35_pickscore_fast.yaml: its header's estimate drifted" in out and "wan21" not in out
    assert config_estimates.main(["--write"]) == 0
    assert fast.read_text(encoding="utf-8") == good
    assert config_estimates.main([]) == 0
    video = config_estimates.header_of(tmp_path / "wan21_t2v_1_3b_ocr_lora.yaml")
    block = video[video.index(config_estimates.BLOCK) :]
    assert "videos/s" in block and "of 128 videos" in block and "images" not in block
    assert " h on 8× H100" in block and "GPU-hours" in block  # the whole run's wall-clock on the GPUs it names


def test_choosing_an_algorithm_quotes_the_estimate_tables_figures():
    """docs/choosing_an_algorithm.md's cost table repeats, per ready config, docs/estimate.md's GPUs, seconds per
    step, whole run and GPU-hours: the same figures, so a rewritten estimate shows up here as a failure."""
    estimated = {}
    doc = (ROOT / "docs/estimate.md").read_text(encoding="utf-8").split("\n")
    for row in doc[doc.index(config_estimates.TABLE_START) + 3 : doc.index(config_estimates.TABLE_END)]:
        name, gpus, _, step, run, _, hours, _ = (cell.strip() for cell in row.strip("|").split("|"))
        estimated[name] = (gpus, step.removesuffix(" s"), run, hours)
    text = (ROOT / "docs/choosing_an_algorithm.md").read_text(encoding="utf-8")
    table = text[text.index("| ready config |") :].split("\n\n")[0].split("\n")[2:]
    quoted = {}
    for row in table:
        config, _, gpus, step, run, hours = (cell.strip() for cell in row.strip("|").split("|"))
        quoted[config.split(" ")[0]] = (gpus, step, run, hours)
    assert {"sd35_dgpo_lora", "qwen_image_dgpo_lora", "sd35_crd_lora", "sd35_flash_grpo_lora"} <= quoted.keys()
    assert {name: estimated[name] for name in quoted} == quoted
