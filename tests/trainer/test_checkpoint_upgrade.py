"""`checkpoint upgrade` on a checkpoint that diffusion-rl's earlier code wrote (tests/fixtures/README.md): its config
holds keys that are gone (`algorithm.family`) or moved (`algorithm.clip_range`), which the strict loader refuses."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffusion_rl.checkpoint.manifest import MANIFEST_FILE, checkpoint_files
from diffusion_rl.checkpoint.state import read_saved_tensors, read_state
from diffusion_rl.checkpoint.weights import checkpoint_config
from diffusion_rl.cli import main
from diffusion_rl.commands.checkpoint import migrate_config
from diffusion_rl.config import load
from diffusion_rl.config.loading import read_yaml_config
from diffusion_rl.trainer import make_trainer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v0" / "step_000001"
ROOT = Path(__file__).resolve().parents[2]


def test_old_algorithm_keys_move_into_the_losss_section():
    data, changes = migrate_config(read_yaml_config(FIXTURE / "config.yaml"))
    algorithm = data["algorithm"]
    assert "family" not in algorithm and "clip_range" not in algorithm and "dpo_beta" not in algorithm
    assert algorithm["flow_grpo"] == {"clip_range": 1e-4, "adv_clip_max": 5.0, "kl_beta": 0.0}
    assert "algorithm.clip_range → algorithm.flow_grpo.clip_range" in changes
    assert "algorithm.dpo_beta dropped (not a key of flow_grpo)" in changes
    old = {"loss": "awm", "family": "direct_preference", "clip_range": None, "kl_beta": 0.1, "dpo_beta": 5.0}
    assert migrate_config({"algorithm": old})[0]["algorithm"] == {"loss": "awm", "awm": {"kl_beta": 0.1}}


def test_a_checkpoint_of_the_earlier_code_upgrades_and_resumes(tmp_path, tiny_model_dir, capsys):
    old = tmp_path / "old_run" / "checkpoints" / "step_000001"
    shutil.copytree(FIXTURE, old)
    adapter = load_file(old / "policy_default.safetensors")
    assert main(["checkpoint", "upgrade", str(old), "--model", str(tiny_model_dir)]) == 0, capsys.readouterr().err
    listed = [line.split("  ", 1)[1] for line in (old / MANIFEST_FILE).read_text().splitlines()]
    assert listed == sorted(set(checkpoint_files(old)) - {MANIFEST_FILE}) and "state.pt" in listed  # verified on load

    cfg = checkpoint_config(old)  # the strict loader reads the converted config.yaml
    assert (cfg.algorithm.loss, cfg.algorithm.settings.clip_range, cfg.model.lora.rank) == ("flow_grpo", 1e-4, 2)
    assert "family:" not in (old / "config.yaml").read_text().split("algorithm:")[1].split("train:")[0]
    saved = read_saved_tensors(old, "policies.default.")
    assert saved.keys() == adapter.keys() and all(torch.equal(saved[k], adapter[k]) for k in adapter)
    assert read_state(old)["step"] == 1

    overrides = [f"run.dir={tmp_path / 'resumed'}", f"run.resume={old}", f"model.path={tiny_model_dir}",
                 f"data.train={ROOT / 'configs/prompts/quickstart.txt'}", "model.lora.enabled=true",
                 "model.lora.rank=2", "model.lora.alpha=4", "sampling.num_steps=4", "train.total_steps=2",
                 "val.every=0", "val.before_train=false", "log.tensorboard=false", "log.flops=false"]  # fmt: skip
    trainer = make_trainer(load(str(ROOT / "configs/quickstart_flow_grpo.yaml"), overrides))
    rows = trainer.train()
    assert [r["step"] for r in rows if "reward/mean" in r] == [2]  # step 1 came from the old checkpoint
