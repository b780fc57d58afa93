"""`diffusion-rl eval` on the tiny model: base and two checkpoints of a short run, side by side."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffusion_rl.checkpoint.manifest import write_manifest
from diffusion_rl.checkpoint.state import read_saved_tensors
from diffusion_rl.cli import main
from diffusion_rl.evaluation import EvalSettings
from diffusion_rl.rewards import make_reward
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.utils.digest import weights_digest

ROOT = Path(__file__).resolve().parents[2]
VAL_PROMPTS = str(ROOT / "configs/prompts/val.txt")
REWARDS = ("jpeg_compressibility", "jpeg_incompressibility")
BOTH = ",".join(REWARDS)


def eval_argv(model_dir, out, *checkpoints, n=2, seed=0, reward=BOTH, prompts=VAL_PROMPTS) -> list[str]:
    argv = ["eval", "--model", str(model_dir), "--prompts", prompts, "--reward", reward, "--out", str(out)]
    for checkpoint in checkpoints:
        argv += ["--checkpoint", str(checkpoint)]
    return argv + ["--n", str(n), "--steps", "3", "--seed", str(seed), "--height", "32", "--width", "32"]


def read_samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def load_image(out: Path, row: dict) -> np.ndarray:
    with Image.open(out / row["image"]) as image:
        return np.asarray(image.convert("RGB"))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffusion-rl: error: ") and "Traceback" not in err, err
    return lines[0]


def test_eval_compares_base_and_two_checkpoints_with_scores_equal_to_the_reward_functions(
    trained_run, tiny_model_dir, tmp_path, capsys
):
    run = trained_run().run_dir
    ckpts = [run / "checkpoints" / "step_000001", run / "checkpoints" / "step_000002"]
    out = tmp_path / "eval"
    assert main(eval_argv(tiny_model_dir, out, "base", *ckpts)) == 0
    printed = capsys.readouterr().out

    names = ["base", "step_000001", "step_000002"]
    for name in names:
        assert (out / name / "sheet.png").stat().st_size > 0
        assert len(list((out / name / "images").glob("*.png"))) == 4 * 2
    assert (out / "compare.png").is_file()
    assert printed in (out / "compare.md").read_text()  # the printed table is the one in compare.md
    header, _, *table = printed.splitlines()
    assert [cell.strip() for cell in header.strip("|").split("|")] == ["metric", *names]
    assert [line.split("|")[1].strip() for line in table] == [
        f"{reward} {stat}" for reward in REWARDS for stat in ("mean@2", "best@2", "std")
    ]

    metrics = json.loads((out / "metrics.json").read_text())
    assert [c["name"] for c in metrics["columns"]] == names
    assert metrics["settings"]["n"] == 2 and metrics["settings"]["num_steps"] == 3
    assert metrics["settings"]["sde_type"] == "ode" and metrics["prompts"]["count"] == 4
    base, first, second = metrics["columns"]
    assert base["checkpoint"]["path"] is None and base["checkpoint"]["weights"] == "base"
    for column, ckpt, step in ((first, ckpts[0], 1), (second, ckpts[1], 2)):
        assert column["checkpoint"]["step"] == step and column["checkpoint"]["path"] == str(ckpt.resolve())
        digest = weights_digest(read_saved_tensors(ckpt, "policies.default."))  # the saved trained weights
        assert column["checkpoint"]["weights_sha256"] == digest and column["checkpoint"]["weights"] == "trained"
    assert first["checkpoint"]["weights_sha256"] != second["checkpoint"]["weights_sha256"]

    # every stored score is the reward function's on the saved (lossless) image
    rows = read_samples(out)
    assert len(rows) == 3 * 4 * 2
    fns = {name: make_reward(name) for name in REWARDS}
    direct: dict[tuple[str, str], np.ndarray] = {}
    for column in names:
        mine = [r for r in rows if r["model"] == column]
        images = np.stack([load_image(out, r) for r in mine])
        prompts, metadata = [r["prompt"] for r in mine], [{} for _ in mine]
        for reward in REWARDS:
            scores = fns[reward](images, prompts, metadata)
            assert [r["scores"][reward] for r in mine] == pytest.approx(scores.tolist(), rel=1e-6)
            direct[column, reward] = scores.astype(np.float64).reshape(4, 2)
    # ... and the statistics are those of the directly computed scores
    for column in metrics["columns"]:
        for reward in REWARDS:
            s, stats = direct[column["name"], reward], column["rewards"][reward]
            assert stats["mean@2"] == pytest.approx(s.mean(), rel=1e-6)
            assert stats["best@2"] == pytest.approx(s.max(axis=1).mean(), rel=1e-6)
            assert stats["std"] == pytest.approx(s.std(), rel=1e-5)
            assert stats["per_source"]["default"]["mean@2"] == pytest.approx(s.mean(), rel=1e-6)
            assert (stats["scored"], stats["failed"]) == (8, 0)

    # the same prompts and seeds in every column; the trained columns really sample with other weights
    keyed = {(r["model"], r["prompt_index"], r["sample"]): r for r in rows}
    assert {r["seed"] for r in rows if r["model"] == "base"} == {r["seed"] for r in rows if r["model"] != "base"}
    for key in [(p, k) for p in range(4) for k in range(2)]:
        assert keyed[("base", *key)]["seed"] == keyed[("step_000002", *key)]["seed"]
    assert any(
        not np.array_equal(load_image(out, keyed[("base", *k)]), load_image(out, keyed[("step_000002", *k)]))
        for k in [(p, s) for p in range(4) for s in range(2)]
    )


def test_eval_is_deterministic_for_a_seed(trained_run, tiny_model_dir, tmp_path, capsys):
    ckpt = trained_run().run_dir / "checkpoints" / "step_000002"
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert main(eval_argv(tiny_model_dir, a, ckpt, reward="jpeg_compressibility")) == 0
    assert main(eval_argv(tiny_model_dir, b, ckpt, reward="jpeg_compressibility")) == 0
    assert main(eval_argv(tiny_model_dir, c, ckpt, reward="jpeg_compressibility", seed=1)) == 0
    rows_a, rows_b, rows_c = read_samples(a), read_samples(b), read_samples(c)
    assert [r["scores"] for r in rows_a] == [r["scores"] for r in rows_b]
    assert all((a / r["image"]).read_bytes() == (b / r["image"]).read_bytes() for r in rows_a)
    ma, mb = json.loads((a / "metrics.json").read_text()), json.loads((b / "metrics.json").read_text())
    assert ma["columns"][0]["rewards"] == mb["columns"][0]["rewards"]
    assert any((a / r["image"]).read_bytes() != (c / r["image"]).read_bytes() for r in rows_c)


@pytest.mark.parametrize("variant", ["lora", "full_ema"])
def test_a_checkpoint_samples_as_the_trainer_that_saved_it(variant, trained_run, tiny_model_dir, tmp_path):
    """Loading weights right: the eval images of the last checkpoint equal the trainer's own ODE samples."""
    overrides = {
        "lora": ("model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "train.lr=5e-2"),
        "full_ema": ("train.ema.enabled=true", "train.ema.decay=0.5"),
    }[variant]
    trainer = trained_run(*overrides)
    out = tmp_path / "eval"
    # the trainer samples in micro-batches of train.micro_batch_size (4): eval in batches of 4 does the same
    # arithmetic (a matmul over 8 rows may round a pixel differently from two over 4)
    argv = eval_argv(tiny_model_dir, out, trainer.run_dir, reward="jpeg_compressibility") + ["--batch-size", "4"]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["columns"][0]["checkpoint"]["weights"] == ("ema" if variant == "full_ema" else "trained")

    rows = read_samples(out)
    settings = EvalSettings(n=2, num_steps=3, height=32, width=32, seed=0)
    seeds = [settings.seeds(r["prompt_index"], r["sample"])[0] for r in rows]
    expected = trainer.engine.sample_images(
        [r["prompt"] for r in rows], [None] * len(rows), seeds, SamplerSettings(3, settings.guidance, 32, 32)
    ).numpy()
    got = np.stack([load_image(out, r) for r in rows])
    assert np.array_equal(got, expected)
    if variant == "lora":  # and the trained adapter is not the identity: base images differ
        base_out = tmp_path / "base"
        assert main(eval_argv(tiny_model_dir, base_out, reward="jpeg_compressibility")) == 0
        base = np.stack([load_image(base_out, r) for r in read_samples(base_out)])
        assert not np.array_equal(base, got)


def test_eval_errors_name_the_bad_argument(trained_run, tiny_model_dir, tmp_path, capsys):
    run = trained_run().run_dir
    capsys.readouterr()  # the training run's own warnings
    out = tmp_path / "eval"
    assert main(eval_argv(tiny_model_dir, out, tmp_path / "nowhere")) == 2
    assert "--checkpoint" in one_error_line(capsys)
    assert main(eval_argv(tiny_model_dir, out, reward="jpeg_compresibility")) == 2
    assert "jpeg_compressibility" in one_error_line(capsys)  # "did you mean"
    argv = eval_argv(tiny_model_dir, out, run) + ["--reward-kwargs", '{"ocr": {}}']
    assert main(argv) == 2
    assert "--reward-kwargs" in one_error_line(capsys)
    assert main(eval_argv(tiny_model_dir, out, run, run / "checkpoints" / "step_000002")) == 2
    assert "give it once" in one_error_line(capsys)
    assert main(eval_argv(tiny_model_dir, out, n=0)) == 2
    assert "--n must be ≥ 1" in one_error_line(capsys)


def test_a_second_eval_into_the_same_directory_needs_force(trained_run, tiny_model_dir, tmp_path, capsys):
    run = trained_run().run_dir
    out = tmp_path / "eval"
    assert main(eval_argv(tiny_model_dir, out, "base", run, n=1, reward="jpeg_compressibility")) == 0
    assert main(eval_argv(tiny_model_dir, out, n=1, reward="jpeg_compressibility")) == 2
    assert "--force" in one_error_line(capsys)
    assert main(eval_argv(tiny_model_dir, out, n=1, reward="jpeg_compressibility") + ["--force"]) == 0
    assert [c["name"] for c in json.loads((out / "metrics.json").read_text())["columns"]] == ["base"]
    assert not (out / "step_000002").exists() and len(read_samples(out)) == 4


EVIL = """
import pathlib
import numpy as np

pathlib.Path(__file__).with_name("ran").write_text("imported")


def fn(images, prompts, metadata):
    return np.zeros(len(images), np.float32)
"""


@pytest.mark.parametrize("nested", [False, True])
def test_a_checkpoint_cannot_choose_reward_code_to_run(nested, trained_run, tiny_model_dir, tmp_path, capsys):
    import yaml

    run = trained_run().run_dir
    ckpt = run / "checkpoints" / "step_000002"
    evil = tmp_path / "evil.py"
    evil.write_text(EVIL)
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    # the code named by the entry itself, or by the reward a group reward wraps
    config["rewards"] = [{"name": "rank", "kwargs": {"reward": f"{evil}:fn"}} if nested else {"name": f"{evil}:fn"}]
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
    write_manifest(ckpt)  # a crafted checkpoint comes with a manifest of its own: no signature
    argv = eval_argv(tiny_model_dir, tmp_path / "eval", ckpt, n=1)
    argv.remove("--reward"), argv.remove(BOTH)  # the rewards come from the checkpoint's config
    capsys.readouterr()

    assert main(argv) == 2
    line = one_error_line(capsys)
    assert f"{evil}:fn" in line and "--trust-checkpoint-rewards" in line and "--reward" in line
    assert not (tmp_path / "ran").exists()  # nothing of the file ran

    assert main([*argv, "--trust-checkpoint-rewards"]) == 0  # the user trusts the run: its reward runs
    assert (tmp_path / "ran").exists()
    if not nested:
        assert main([*argv, "--force", "--reward", f"{evil}:fn"]) == 0  # or names it on the command line


def test_a_checkpoint_cannot_choose_loss_code_to_run(trained_run, tiny_model_dir, tmp_path):
    """A user loss (algorithm.loss: file.py:fn) named only by a checkpoint's config.yaml stays a name: eval, sample
    and export read the checkpoint without importing it, and the config refuses to hand out the loss."""
    import yaml

    from diffusion_rl.checkpoint.weights import checkpoint_config
    from diffusion_rl.errors import UserError

    run = trained_run().run_dir
    ckpt = run / "checkpoints" / "step_000002"
    evil = tmp_path / "evil.py"
    evil.write_text(EVIL)
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    config["algorithm"] = {"loss": f"{evil}:fn", "evil_loss": {"scale": 2}}
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
    write_manifest(ckpt)

    cfg = checkpoint_config(ckpt)
    assert cfg.algorithm.loss == f"{evil}:fn" and cfg.algorithm.losses == {"evil_loss": {"scale": 2}}
    with pytest.raises(UserError, match="a checkpoint cannot choose code to run"):
        _ = cfg.algorithm.spec
    assert main(eval_argv(tiny_model_dir, tmp_path / "eval", ckpt, n=1)) == 0
    assert not (tmp_path / "ran").exists()  # nothing of the file ran


@pytest.mark.parametrize("name", [".", "..", "", "a/b", "link", 3])
def test_force_removes_only_the_earlier_columns_own_folders_whatever_metrics_json_says(tmp_path, name):
    """metrics.json names the folders --force removes: an edited one naming the output folder itself, a parent, a
    path or a link removes nothing of the user's."""
    import json

    from diffusion_rl.evaluation.evaluate import prepare_output

    out = tmp_path / "out"
    (out / "a" / "b").mkdir(parents=True)
    (out / "thesis.txt").write_text("mine")
    (tmp_path / "elsewhere").mkdir()
    (out / "link").symlink_to(tmp_path / "elsewhere")
    (out / "col").mkdir()
    (out / "metrics.json").write_text(json.dumps({"columns": [{"name": name}, {"name": "col"}]}))
    prepare_output(out, force=True)
    assert (
        (out / "thesis.txt").read_text() == "mine" and (out / "a" / "b").is_dir() and (tmp_path / "elsewhere").is_dir()
    )
    assert not (out / "col").exists() and not (out / "metrics.json").exists()  # the earlier evaluation's own: gone
