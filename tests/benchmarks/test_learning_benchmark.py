"""The learning benchmark's parts on a tiny pretrained ShapesWorld model: config discovery, a budgeted run, the plot."""

import argparse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def learning(load_benchmark):
    return load_benchmark("learning")


def test_every_quickstart_config_is_an_algorithm(learning):
    found = learning.algorithm_configs(None)
    assert found["flow_grpo"].name == "quickstart_flow_grpo.yaml"
    assert {p.name for p in found.values()} == {p.name for p in (ROOT / "configs").glob("quickstart_*.yaml")}
    assert list(learning.algorithm_configs(["fast"])) == ["fast"]


def test_a_missing_base_model_is_the_shipped_one_copied_not_pretrained(learning, tmp_path, monkeypatch):
    """Every machine starts from the same bits (a pretraining differs across CPUs): the ranking's kept runs name it."""
    from diffusion_rl.models.tiny.shipped import shipped_dir
    from diffusion_rl.utils.digest import file_sha256

    monkeypatch.setattr("diffusion_rl.pretrain.trainer.PretrainTrainer.train", lambda self: pytest.fail("pretrained"))
    info = learning.ensure_base_model(tmp_path / "shapes")
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert file_sha256(tmp_path / "shapes" / weights) == file_sha256(shipped_dir("sd3", "shapes") / weights)
    assert info["size"] == 32


def test_a_budgeted_run_validates_at_start_and_end_and_plots(learning, shapes_model, tmp_path):
    info = learning.ensure_base_model(shapes_model)
    assert info["size"] == 32
    args = argparse.Namespace(seed=0, threads=2, set=["data.prompts_per_step=1", "data.group_size=2",
                                                      "val.n=1", "val.num_steps=2", "sampling.num_steps=3"],
                              budget_minutes=0.02, steps=None, val_every_seconds=100.0)  # fmt: skip
    result = learning.run_algorithm(
        "flow_grpo", ROOT / "configs/quickstart_flow_grpo.yaml", tmp_path, args, shapes_model, info
    )
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
    outlined = argparse.Namespace(seed=0, threads=2, set=[], shape_weight=0.5)  # trains on the outlines too
    pairwise = learning.build_config(found["pairwise"], tmp_path / "c", outlined, tmp_path / "model", info)
    task = {"name": "shapes_geneval", "kwargs": {"shape_weight": 0.5}}
    assert pairwise.rewards[0].kwargs == {"reward": task} and pairwise.rewards[1].kwargs == task["kwargs"]
    nft = learning.build_config(found["nft"], tmp_path / "d", outlined, tmp_path / "model", info)
    assert [(r.name, r.weight, r.kwargs) for r in nft.rewards] == [("shapes_geneval", 1.0, task["kwargs"])]
    assert [(r.name, r.kwargs) for r in nft.val.rewards] == [("shapes_geneval", {})]  # validated plain


def test_the_shapes_task_fine_tunes_fully_but_where_the_algorithm_trains_lora_adapters(learning, tmp_path):
    args, info = argparse.Namespace(seed=0, threads=2, set=[]), {"size": 32, "text_tokens": 16}
    found = learning.algorithm_configs(None)
    build = {name: learning.build_config(found[name], tmp_path / name, args, tmp_path / "model", info)
             for name in ("flow_grpo", "nft", "tdm_r1")}  # fmt: skip
    assert {name: cfg.model.lora.enabled for name, cfg in build.items()} == {"flow_grpo": False, "nft": False,
                                                                             "tdm_r1": True}  # fmt: skip
