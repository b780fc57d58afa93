"""Pretraining never replaces what is not its own model: a run.out folder of other files, or a model pretrained with
other settings, is refused before any work (a rerun of the same settings replaces its own model); so is
benchmarks/ranking.py's --model, which pretrains into it."""

import json

import pytest

from diffusion_rl.cli import main
from diffusion_rl.errors import UserError
from diffusion_rl.pretrain.config import load_pretrain_config
from diffusion_rl.pretrain.model import INFO_FILE, check_out, settings_digest

CONFIG = "configs/shapes_pretrain.yaml"


def test_pretrain_into_a_folder_of_other_files_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["pretrain", CONFIG, f"run.dir={tmp_path / 'run'}", f"run.out={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"run.out {out} holds files and no pretrained model (shapes.json)" in err
    assert (out / "notes.txt").read_text() == "mine" and not (tmp_path / "run").exists()  # nothing ran


def test_only_a_model_of_the_same_settings_may_be_replaced(tmp_path):
    cfg = load_pretrain_config(CONFIG, [f"run.out={tmp_path / 'model'}"])
    check_out(cfg)  # absent: written
    (tmp_path / "model").mkdir()
    check_out(cfg)  # empty: written
    info = tmp_path / "model" / INFO_FILE
    info.write_text(json.dumps({"size": 32, "settings_sha256": settings_digest(cfg)}))
    check_out(cfg)  # this config's own model, finished: a rerun replaces it
    # where it goes and how the run is watched are no settings of the model
    check_out(load_pretrain_config(CONFIG, [f"run.out={tmp_path / 'model'}", "run.dir=elsewhere", "log.every=1"]))
    other = load_pretrain_config(CONFIG, [f"run.out={tmp_path / 'model'}", "flow.steps=7"])
    with pytest.raises(UserError, match=r"holds a model pretrained with other settings \(shapes.json: settings_sha256"):
        check_out(other)
    info.write_text(json.dumps({"size": 32}))  # a model of before the settings were recorded: not known to match
    with pytest.raises(UserError, match="other settings"):
        check_out(cfg)
    info.write_text("")
    with pytest.raises(UserError, match="holds files and no pretrained model"):
        check_out(cfg)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        check_out(load_pretrain_config(CONFIG, [f"run.out={tmp_path / 'file'}"]))
