"""The command line, run in-process: init-tiny, sample, config show|reference, and one-line user errors."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffusion_rl.cli import main
from diffusion_rl.tracking import image_grid
from tests.helpers import check_generated

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/quickstart_flow_grpo.yaml")
FAST_SAMPLE = ["--steps", "2", "--height", "32", "--width", "32", "--max-sequence-length", "16", "--device", "cpu"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("diffusion-rl: error: ") and "Traceback" not in err
    return lines[0]


def test_init_tiny_then_sample_writes_a_grid(tmp_path):
    model_dir, out = tmp_path / "tiny", tmp_path / "grid.png"
    assert main(["init-tiny", str(model_dir), "--preset", "small"]) == 0
    assert (model_dir / "model_index.json").is_file()
    argv = ["sample", "--model", str(model_dir), "--prompt", "a", "--prompt", "b", "--n", "2", "--out", str(out)]
    assert main(argv + FAST_SAMPLE) == 0
    with Image.open(out) as image:
        width, height = image.size
        assert image.mode == "RGB" and len(image.getbands()) == 3
    assert width > 32 and height > 32
    # 2 prompts × 2 images, one row per prompt: the layout image_grid gives 4 tiles of 32 px in 2 columns
    expected = image_grid(np.zeros((4, 32, 32, 3), np.uint8), ["a", "a", "b", "b"], ncols=2)
    assert (height, width) == expected.shape[:2]


def test_sample_with_a_missing_model_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main(["sample", "--model", str(missing), "--prompt", "a", *FAST_SAMPLE]) == 2
    line = _one_error_line(capsys)
    assert "does not exist" in line and "init-tiny" in line


@pytest.mark.parametrize("what", ["empty folder", "file"])
def test_doctor_on_a_folder_or_file_that_is_no_model_names_the_flag_it_came_from(tmp_path, capsys, what):
    path = tmp_path / "not_a_model"
    path.mkdir() if what == "empty folder" else path.write_text("x")
    assert main(["doctor", "--model", str(path)]) == 2
    line = _one_error_line(capsys)
    assert str(path) in line and "model.path (a command's --model)" in line


def test_sample_sde_needs_two_steps(tiny_model_dir, capsys):
    argv = ["sample", "--model", str(tiny_model_dir), "--prompt", "a", "--steps", "1", "--sde-type", "sde"]
    assert main(argv) == 2
    assert "--steps must be ≥ 2" in _one_error_line(capsys)


def test_sample_refuses_an_out_it_would_not_write(tiny_model_dir, tmp_path, capsys):
    """--out keep.jpg would have written keep.png, over a file of that name: refused before any work."""
    (tmp_path / "keep.png").write_bytes(b"the user's")
    out = ["--out", str(tmp_path / "keep.jpg")]
    assert main(["sample", "--model", str(tiny_model_dir), "--prompt", "a", *FAST_SAMPLE, *out]) == 2
    assert "keep.jpg: sample writes a .png sheet" in _one_error_line(capsys)
    assert (tmp_path / "keep.png").read_bytes() == b"the user's"


def test_sample_rejects_n_below_one(tiny_model_dir, capsys):
    assert main(["sample", "--model", str(tiny_model_dir), "--prompt", "a", "--n", "0"]) == 2
    assert "--n must be ≥ 1" in _one_error_line(capsys)


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--guidance", "0.5"], "--guidance must be ≥ 1"), (["--frames", "0"], "--frames must be ≥ 1")],
)
def test_sample_checks_its_flags_as_eval_does(tiny_model_dir, capsys, flags, message):
    """`sample` and `eval` share one check of the sampler flags (EvalSettings), before any model loads."""
    assert main(["sample", "--model", str(tiny_model_dir), "--prompt", "a", *flags]) == 2
    assert message in _one_error_line(capsys)


def test_sample_rejects_a_size_the_model_cannot_make(tiny_model_dir, capsys):
    argv = ["sample", "--model", str(tiny_model_dir), "--prompt", "a", *FAST_SAMPLE, "--height", "36"]
    assert main(argv) == 2
    assert "--height/--width" in _one_error_line(capsys)


def test_sample_rejects_a_negative_noise_level(tiny_model_dir, capsys):
    argv = ["sample", "--model", str(tiny_model_dir), "--prompt", "a", "--sde-type", "sde", "--noise-level", "-1"]
    assert main(argv) == 2
    assert "--noise-level" in _one_error_line(capsys)


def test_config_show_applies_overrides(capsys):
    assert main(["config", "show", QUICKSTART, "train.lr=3e-4"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.0003" in out
    assert "total_steps: 100" in out  # the rest comes from the file


def test_config_show_suggests_the_key_for_a_typo(capsys):
    assert main(["config", "show", QUICKSTART, "train.lrr=1"]) == 2
    assert "did you mean 'train.lr'" in _one_error_line(capsys)


def test_config_show_with_a_missing_file(tmp_path, capsys):
    assert main(["config", "show", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in _one_error_line(capsys)


def test_config_reference_lists_every_key(capsys):
    assert main(["config", "reference"]) == 0
    out = capsys.readouterr().out
    assert "train.lr:" in out and "model.lora.rank:" in out


def test_docs_config_md_is_the_current_markdown_reference(capsys):
    """Regenerated here when stale (a new loss's section with it), refused stale in CI (tests/helpers.py)."""
    assert main(["config", "reference", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| `train.lr` | float in (0, 1000000] |" in out and "### `model.lora`" in out
    check_generated(ROOT / "docs/config.md", out, "diffusion-rl config reference --markdown > docs/config.md")


def test_a_stale_generated_file_is_rewritten_outside_ci_and_refused_in_it(tmp_path, monkeypatch):
    path = tmp_path / "config.md"
    path.write_text("old\n")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(AssertionError, match="config.md is stale: run the tests outside CI, or regen, and commit"):
        check_generated(path, "new\n", "regen")
    assert path.read_text() == "old\n"  # CI checks; it never hides a stale commit by fixing its own copy
    monkeypatch.delenv("CI")
    with pytest.warns(UserWarning, match="was stale and is regenerated: commit it"):
        check_generated(path, "new\n", "regen")
    assert path.read_text() == "new\n"
    monkeypatch.setenv("CI", "true")
    check_generated(path, "new\n", "regen")  # current: passes in CI too


def test_init_tiny_refuses_a_non_empty_dir_without_force(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["init-tiny", str(tmp_path), "--preset", "small"]) == 2
    assert "--force" in _one_error_line(capsys)
    assert (tmp_path / "keep.txt").read_text() == "mine" and not (tmp_path / "model_index.json").exists()


def test_init_tiny_refuses_a_file(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("mine")
    assert main(["init-tiny", str(target), "--force"]) == 2
    assert "is a file" in _one_error_line(capsys)


def test_unknown_command_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["nonsense"])
    assert info.value.code == 2


def test_sample_past_the_models_position_table_suggests_a_size_that_fits(tiny_model_dir, capsys):
    # the tiny SD3 transformer's position table is 32 patches: 32 × patch 2 × VAE 4 = 256 px a side at most
    argv = ["sample", "--model", str(tiny_model_dir), "--prompt", "a", *FAST_SAMPLE, "--height", "512"]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert "at most 256 px" in line and "try --height 256 --width 32" in line


# ---- errors of the environment: one line naming the path and the cause (exit status 1) ----


@pytest.mark.parametrize("under", [False, True])
def test_a_run_dir_that_is_or_is_under_a_file_is_one_line_before_the_model_loads(
    train_argv, tmp_path, capsys, model_must_not_load, under
):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    run_dir = blocker / "run" if under else blocker
    assert main(train_argv(f"run.dir={run_dir}", "train.total_steps=0")) == 2
    assert _one_error_line(capsys) == (
        f"diffusion-rl: error: run.dir {run_dir}: {blocker} is a file, not a folder; give run.dir a folder"
    )


def test_an_eval_out_that_is_a_file_is_one_line(tiny_model_dir, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    argv = ["eval", "--model", str(tiny_model_dir), "--prompts", str(ROOT / "configs/prompts/val.txt"), "--reward",
            "jpeg_compressibility", "--out", str(blocker), *FAST_SAMPLE]  # fmt: skip
    assert main(argv) == 2
    assert _one_error_line(capsys) == (
        f"diffusion-rl: error: --out {blocker}: {blocker} is a file, not a folder; give --out a folder"
    )


def test_a_read_only_run_dir_is_one_line_naming_it(train_argv, tmp_path, capsys, monkeypatch):
    parent = tmp_path / "read_only"
    parent.mkdir()
    parent.chmod(0o555)
    if os.geteuid() == 0:  # root writes into it anyway: refuse as the file system does for other users

        def refuse(self, *args, real_mkdir=Path.mkdir, **kwargs):
            if parent in self.parents:
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", refuse)
    try:
        assert main(train_argv(f"run.dir={parent / 'run'}", "train.total_steps=0")) == 1
    finally:
        parent.chmod(0o755)
    line = _one_error_line(capsys)
    assert f"{parent / 'run'}" in line and "Permission denied" in line


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),  # torch.save's
        OSError(errno.ENOSPC, "No space left on device", "trainer_state.pt"),
    ],
)
def test_a_full_disk_while_checkpointing_is_one_line(train_argv, tmp_path, capsys, monkeypatch, error):
    import torch

    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "save", full)
    assert main(train_argv("train.total_steps=1")) == 1
    line = _one_error_line(capsys)
    assert "No space left on device" in line
    if isinstance(error, RuntimeError):  # where the checkpoint was being written, and what torch said
        assert str(tmp_path / "run" / "checkpoints" / "step_000001") in line and "unexpected pos 704 vs 598" in line
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("truncate", "transformer/diffusion_pytorch_model.safetensors: not a complete safetensors file"),
        ("truncate", "text_encoder/model.safetensors: not a complete safetensors file"),  # via transformers
        ("delete", "vae/config.json: missing"),
    ],
)
def test_a_damaged_model_directory_is_one_line_naming_the_file(tiny_model_dir, tmp_path, capsys, damage, named):
    import shutil

    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    file = model / named.split(":")[0]
    if damage == "truncate":
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
    else:
        file.unlink()
    assert main(["sample", "--model", str(model), "--prompt", "a", *FAST_SAMPLE]) == 2
    line = _one_error_line(capsys)
    assert f"cannot load the model in {model}: {model / named.split(':')[0]}:" in line and named.split(": ")[1] in line


@pytest.mark.parametrize(
    ("model_dir", "said"),
    [  # an SD3 transformer's last block is context_pre_only, with a smaller norm: one block fewer changes a shape
        ("tiny_model_dir", r"transformer/config\.json describes another network than its weights "
         r"\(transformer_blocks\.\d+\.norm1_context\.linear\.bias: torch\.Size\(\[\d+\]\) by the config, "),
        # Wan's blocks are all alike: one block fewer, and diffusers would drop the last one's weights with a log line
        ("wan_model_dir", r"\d+ weights in \S+/transformer have no place in the network its config\.json describes "
         r"\(e\.g\. blocks\.\d+\."),
    ],
)  # fmt: skip
def test_a_config_that_describes_another_network_than_its_weights_is_one_line(
    request, tmp_path, capsys, model_dir, said
):
    import re
    import shutil

    model = Path(shutil.copytree(request.getfixturevalue(model_dir), tmp_path / "model"))
    config = json.loads((model / "transformer/config.json").read_text())
    (model / "transformer/config.json").write_text(json.dumps({**config, "num_layers": config["num_layers"] - 1}))
    capsys.readouterr()  # the fixture's own output, when it built the model just now
    assert main(["sample", "--model", str(model), "--prompt", "a", *FAST_SAMPLE]) == 2
    line = _one_error_line(capsys)
    assert f"cannot load the model in {model}: " in line and re.search(said, line), line
    assert line.endswith("restore the config.json the weights were saved with"), line


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        (["evilmod", "X"], "component 'scheduler' names the library 'evilmod'; a model directory may name diffusers or "
         "transformers only (no other module is imported for it)"),
        (["diffusers", "NoSuchScheduler"], "component 'scheduler': diffusers has no class 'NoSuchScheduler'"),
        ("FlowMatchEulerDiscreteScheduler", "component 'scheduler' is 'FlowMatchEulerDiscreteScheduler', not "
         "[library, class]"),
    ],
)  # fmt: skip
def test_a_model_index_naming_a_module_or_class_that_cannot_load_is_one_line(
    tiny_model_dir, tmp_path, capsys, monkeypatch, entry, named
):
    import json
    import shutil

    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    index = json.loads((model / "model_index.json").read_text())
    index["scheduler"] = entry
    (model / "model_index.json").write_text(json.dumps(index))
    (tmp_path / "evilmod.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\nclass X: pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # importable, were anything to import it
    assert main(["sample", "--model", str(model), "--prompt", "a", *FAST_SAMPLE]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(
        f"diffusion-rl: error: cannot load the model in {model}: {model / 'model_index.json'}: {named}"
    )
    assert not (tmp_path / "ran").exists()


def test_config_show_redacts_an_inline_api_key(capsys):
    argv = ["config", "show", QUICKSTART, "rewards.0.name=vlm", "rewards.0.kwargs={api_key: sk-1, api_key_env: null}"]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "sk-1" not in shown and "api_key: '***redacted***'" in shown and "api_key_env: null" in shown


def test_sample_ode_solver_changes_the_ode_steps_only(tiny_model_dir, tmp_path):
    base = ["sample", "--model", str(tiny_model_dir), "--prompt", "a", *FAST_SAMPLE, "--steps", "5"]
    grids = {}
    for solver in ("euler", "ab2"):
        out = tmp_path / f"{solver}.png"
        assert main([*base, "--ode-solver", solver, "--out", str(out)]) == 0
        with Image.open(out) as image:
            grids[solver] = np.asarray(image.convert("RGB")).astype(int)
    assert grids["euler"].shape == grids["ab2"].shape
    assert np.abs(grids["euler"] - grids["ab2"]).max() > 0  # 5 ODE steps: steps 1–3 are two-step ab2 steps


@pytest.mark.parametrize("command", ["train", "estimate", "pretrain", "prepare embeddings"])
def test_a_command_without_its_config_asks_for_the_config_only_overrides_are_optional(command, capsys):
    with pytest.raises(SystemExit) as done:
        main(command.split())
    err = capsys.readouterr().err
    assert done.value.code == 2 and "the following arguments are required: config\n" in err
    assert "[overrides ...]" in err


def test_init_tiny_help_lists_each_familys_presets(capsys):
    from diffusion_rl.config.plugins import FAMILIES
    from diffusion_rl.models.tiny import tiny_presets

    with pytest.raises(SystemExit):
        main(["init-tiny", "--help"])
    lines = capsys.readouterr().out.splitlines()
    for family in FAMILIES.names():
        assert f"  {family:<16} {', '.join(tiny_presets(family))}" in lines
    assert "  sd3              base, small, sd35, shapes" in lines
