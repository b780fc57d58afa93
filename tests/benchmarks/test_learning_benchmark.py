"""The learning benchmark's parts on a tiny pretrained ShapesWorld model: config discovery, a budgeted run, the plot."""

import argparse
import json
import math
from pathlib import Path

import pytest

from diffusion_rl.pretrain.config import load_pretrain_config
from diffusion_rl.pretrain.trainer import PretrainTrainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def learning(load_benchmark):
    return load_benchmark("learning")


@pytest.fixture(scope="module")
def shapes_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shapes")
    cfg = load_pretrain_config(str(ROOT / "configs/shapes_pretrain.yaml"), [
        f"run.dir={tmp / 'run'}", f"run.out={tmp / 'model'}", "model.preset=small", "model.vae_channels=[8,16,16]",
        "vae.steps=3", "vae.batch_size=4", "vae.stats_images=16", "flow.steps=2", "flow.batch_size=4",
        "flow.latent_pool=16", "eval.every=0", "eval.prompts=4", "eval.n=1", "eval.num_steps=2",
        "log.tensorboard=false", "log.progress_bar=false", "log.console_every=0",
    ])  # fmt: skip
    PretrainTrainer(cfg).train()
    return tmp / "model"


def test_every_quickstart_config_is_an_algorithm(learning):
    found = learning.algorithm_configs(None)
    assert found["flow_grpo"].name == "quickstart.yaml"
    assert {p.name for name, p in found.items() if name != "flow_grpo"} == {
        p.name for p in (ROOT / "configs").glob("quickstart_*.yaml")
    }
    assert list(learning.algorithm_configs(["fast"])) == ["fast"]


def test_a_budgeted_run_validates_at_start_and_end_and_plots(learning, shapes_model, tmp_path):
    info = learning.ensure_base_model(shapes_model, threads=2)
    assert info["size"] == 32
    args = argparse.Namespace(seed=0, threads=2, set=["data.prompts_per_step=1", "data.group_size=2",
                                                      "val.n=1", "val.num_steps=2", "sampling.num_steps=3"],
                              budget_minutes=0.02, steps=None, val_every_seconds=100.0)  # fmt: skip
    result = learning.run_algorithm("flow_grpo", ROOT / "configs/quickstart.yaml", tmp_path, args, shapes_model, info)
    assert result["steps"] >= 1 and result["train_seconds"] >= 1.2
    assert [c["step"] for c in result["curve"]] == [0, result["steps"]]
    assert all(0 <= c["val_reward"] <= 1 for c in result["curve"])
    learning.plot({"flow_grpo": result}, tmp_path / "learning.png", result["val_reward_start"], "shapes_geneval")
    assert (tmp_path / "learning.png").stat().st_size > 1000


def test_the_quickstart_task_runs_a_config_as_is_for_a_number_of_steps(learning, tiny_model_dir, tmp_path):
    small = ["data.prompts_per_step=1", "data.group_size=2", "sampling.num_steps=3", "sampling.height=32",
             "sampling.width=32", "val.n=1", "val.num_steps=2", f"model.path={tiny_model_dir}"]  # fmt: skip
    args = argparse.Namespace(seed=0, threads=2, set=small, budget_minutes=None, steps=2, val_every_seconds=100.0)
    result = learning.run_algorithm("nft", ROOT / "configs/quickstart_nft.yaml", tmp_path, args)
    assert (result["loss"], result["steps"]) == ("nft", 2)
    assert [c["step"] for c in result["curve"]] == [0, 2]
    assert result["val_reward_start"] < 0  # the quickstart's own reward: JPEG compressibility
    args.set = [*small, f"data.pairs={tmp_path / 'missing.jsonl'}"]
    offline = learning.run_algorithm("dpo_offline", ROOT / "configs/quickstart_dpo_offline.yaml", tmp_path, args)
    assert "missing.jsonl" in offline["skipped"] and "prepare pairs" in offline["skipped"]


def test_the_summary_prints_a_zero_start_as_a_number_and_a_missing_value_as_a_dash(learning):
    finished = {"steps": 3, "seconds_per_step": 0.5, "step_time_vs_flow_grpo": 1.0, "images_per_second": 16.0,
                "val_reward_start": 0.0, "val_reward_end": 0.25, "val_gain_percent": None,  # gain % of 0: undefined
                "val_reward_best": 0.25, "curve": []}  # fmt: skip
    lines = learning.summary_lines({"flow_grpo": finished, "dpo_offline": {"skipped": "no pair file"}})
    header, row, skipped = lines
    assert header.split() == ["algorithm", "steps", "s/step", "×fgrpo", "img/s", "val", "start", "val", "end",
                              "gain", "%", "val", "best"]  # fmt: skip
    assert row.split() == ["flow_grpo", "3", "0.500", "1.00", "16.00", "0", "0.25", "–", "0.25"]
    assert len(row) == len(header)  # the dash keeps the column's width
    assert skipped.split(maxsplit=1) == ["dpo_offline", "no pair file"]


def test_the_shapes_task_keeps_a_pairwise_config_pairwise_and_validates_every_config_on_shapes(learning, tmp_path):
    args = argparse.Namespace(seed=0, threads=2, set=[])
    info = {"size": 32, "text_tokens": 16}
    found = learning.algorithm_configs(None)
    pairwise = learning.build_config(found["pairwise"], tmp_path / "a", args, tmp_path / "model", info)
    reward, logged = pairwise.rewards  # the win rate trains; shapes_geneval at weight 0 is logged for the lr choice
    assert (reward.name, reward.kwargs) == ("pairwise_win_rate", {"reward": {"name": "shapes_geneval"}})
    assert (logged.name, logged.weight) == ("shapes_geneval", 0.0)
    assert learning.training_reward({"reward/mean": 0.5, "reward/shapes_geneval/mean": 0.61}) == 0.61
    assert learning.training_reward({"reward/mean": 0.5}) == 0.5
    nft = learning.build_config(found["nft"], tmp_path / "b", args, tmp_path / "model", info)
    assert [r.name for r in nft.rewards] == ["shapes_geneval"]
    for cfg in (pairwise, nft):
        assert [r.name for r in cfg.val.rewards] == ["shapes_geneval"]
    for family in ("edit", "video"):  # not text-to-image: skipped on ShapesWorld, with the reason
        cfg = learning.build_config(found[family], tmp_path / family, args, tmp_path / "model", info)
        assert "ShapesWorld trains a text-to-image model" in learning.skip_reason(cfg, shapes=True)
    assert learning.skip_reason(nft, shapes=True) is None


def test_the_learning_rate_is_chosen_on_training_reward_never_validation(learning):
    by_lr = {  # 1e-4 trains better, 1e-5 validates better: the choice reads training reward only
        1e-5: [{"selection_reward": 0.40, "val_reward_end": 0.9}, {"selection_reward": 0.42, "val_reward_end": 0.9}],
        1e-4: [{"selection_reward": 0.50, "val_reward_end": 0.1}, {"selection_reward": 0.46, "val_reward_end": 0.1}],
        1e-3: [{"error": "diverged"}],
    }
    chosen, means = learning.choose_lr(by_lr)
    assert chosen == 1e-4
    assert means == {"1e-05": pytest.approx(0.41), "0.0001": pytest.approx(0.48), "0.001": None}
    # the last third of the training time: steps ending after 6 s
    assert learning.selection_reward([(1.0, 0.0), (5.0, 0.0), (6.5, 0.3), (9.0, 0.5)]) == pytest.approx(0.4)
    assert learning.parse_lrs("/3,x1,x3", 3e-5) == [1e-5, 3e-5, 9e-5]
    assert learning.parse_lrs("x1,2e-4", 1e-3) == [1e-3, 2e-4]


def test_the_ranked_benchmark_resumes_and_reports_intervals(learning, shapes_model, tmp_path, monkeypatch, capsys):
    small = ["data.prompts_per_step=1", "data.group_size=2", "sampling.num_steps=3", "val.num_steps=2"]
    work, out = tmp_path / "work", tmp_path / "ranked.json"
    argv = ["--model", str(shapes_model), "--only", "flow_grpo,dpo", "--lrs", "x0.5,x2", "--seeds", "2",
            "--select-seeds", "1", "--steps", "2", "--target-se", "0.05", "--work", str(work), "--out", str(out),
            *[a for o in small for a in ("--set", o)]]  # fmt: skip
    learning.main(argv)
    report = json.loads(out.read_text())
    assert report["seeds"] == [0, 1] and report["selection_seeds"] == [0]
    size = json.loads((work / "validation_size.json").read_text())  # measured once on the base model, kept
    assert size["prompts"] == 78 and size["source"] == "calibration" and report["validation"] == size
    assert size["val_n"] == math.ceil(math.ceil((size["calibration_sd"] * 1.1 / 0.05) ** 2) / 78)
    runs = sorted(p.relative_to(work).as_posix() for p in work.glob("runs/*/*.json"))
    assert len(runs) == 6  # per algorithm: 2 rates × seed 0, then the chosen rate × seed 1
    for name in ("flow_grpo", "dpo"):
        a = report["algorithms"][name]
        assert a["lrs"] == [1.5e-5, 6e-5]
        kept = {lr: json.loads((work / "runs" / name / f"lr{lr:.3g}_seed0.json").read_text()) for lr in a["lrs"]}
        by_training = max(kept, key=lambda lr: kept[lr]["selection_reward"])
        assert a["chosen_lr"] == by_training
        assert f"runs/{name}/lr{by_training:.3g}_seed1.json" in runs
        iv = a["interval"]
        assert iv["n"] == 2 and a["seeds"] == [0, 1]
        finals = a["final_val_reward"]
        half = 12.7062 * abs(finals[0] - finals[1]) / math.sqrt(2) / math.sqrt(2)  # t(1) × sd / √2
        assert iv["half_width"] == pytest.approx(half, abs=1e-6)
        assert a["rank"]["best_rank"] <= a["rank"]["rank"] <= a["rank"]["worst_rank"]
        assert a["band"] and all("half_width" in p for p in a["band"])
        point = kept[by_training]["curve"][0]
        assert point["images"] == 78 * size["val_n"] and point["se"] > 0  # every held-out prompt; the point's SE
    table = capsys.readouterr().out
    assert "mean ± 95 % CI" in table and " ± " in table.split("| flow_grpo |")[1]
    assert out.with_suffix(".png").stat().st_size > 1000

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished run ran again")

    monkeypatch.setattr(learning, "run_algorithm", must_not_run)
    learning.main(argv)  # resumed: every run is kept
    again = json.loads(out.read_text())
    assert again["resumed_runs"] == 6
    assert {n: a["interval"] for n, a in again["algorithms"].items()} == {
        n: a["interval"] for n, a in report["algorithms"].items()
    }
    capsys.readouterr()
    learning.main([*argv, "--plan"])
    plan = capsys.readouterr().out
    assert "6 runs, 0 to do" in plan
    with pytest.raises(SystemExit, match="steps differ"):  # kept runs of another budget are not mixed in
        learning.main([*argv, "--steps", "3"])


def test_the_plan_lists_every_run_and_estimates_the_wall_time(learning, shapes_model, tmp_path, capsys):
    learning.main(["--model", str(shapes_model), "--only", "flow_grpo,dpo_offline", "--budget-minutes", "3",
                   "--val-every-seconds", "60", "--work", str(tmp_path), "--plan"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert sum(" select " in line for line in lines) == 6  # 3 rates × 2 selection seeds
    assert sum(" report " in line and "chosen" in line for line in lines) == 3  # seeds 2–4 once a rate is chosen
    # not calibrated: sd 0.3 × 1.1 → 1089 images → 14 per prompt × 78; per run 180 s + 4 validations (0, 60, 120,
    # the end) × 1092 images × 0.01 s + 5 s = 228.68 s; 9 runs → 2058 s = 0.57 h
    assert "validation: 14 samples × 78 prompts" in lines[-2]
    assert lines[-1] == "9 runs, 9 to do, about 229 s each: estimated wall time 0.57 h"
    assert not (tmp_path / "runs").exists()
