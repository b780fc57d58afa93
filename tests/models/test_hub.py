"""Models by Hub id (models/hub.py): `model.path: owner/name` and every command's `--model owner/name` load the
repository's snapshot from huggingface_hub's cache, built here as huggingface_hub lays it out (blobs, snapshots of
links, refs/main), offline (HF_HUB_OFFLINE): a local folder wins, model.revision pins a commit, nothing cached is one
line, and no tiny model is ever written where a Hub id is meant."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants, snapshot_download

from diffusion_rl.cli import main
from diffusion_rl.config import load
from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.errors import UserError
from diffusion_rl.estimate.architectures import architecture_for, from_model_dir
from diffusion_rl.models.hub import model_dir
from diffusion_rl.models.loader import load_model
from diffusion_rl.models.tiny import save_tiny
from diffusion_rl.trainer.trainer import ensure_model
from diffusion_rl.utils.hub_ids import names_hub_repo

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs/quickstart.yaml")
REPO = "owner/tiny"
OLD, NEW = "1" * 40, "2" * 40  # commits: refs/main points at NEW
FAST = ["--steps", "2", "--height", "32", "--width", "32", "--max-sequence-length", "16", "--device", "cpu"]
TOKEN = "hf_NotARealTokenButSecret0123456789"


def cache_repo(cache: Path, repo: str, commit: str, model: Path, main: bool) -> Path:
    """Put the diffusers folder `model` into the Hub cache `cache` as huggingface_hub stores a download of `repo` at
    `commit`: each file once in blobs/ (named by its sha256), the snapshot a tree of relative links to them."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for file in sorted(p for p in model.rglob("*") if p.is_file()):
        blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(model)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if main:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_models(tmp_path_factory, tiny_model_dir):
    """A Hub cache holding owner/tiny at two commits (the tiny model of seed 1, then seed 0 as main)."""
    cache = tmp_path_factory.mktemp("hub_cache")
    old = save_tiny(tmp_path_factory.mktemp("old"), "sd3", "small", seed=1)
    return cache, cache_repo(cache, REPO, OLD, old, main=False), cache_repo(cache, REPO, NEW, tiny_model_dir, True)


@pytest.fixture
def hub(hub_models, monkeypatch, tmp_path):
    """huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when imported: the variables for what a child process
    reads, and the library's constants for this one. Runs in an empty working directory (no local owner/tiny)."""
    cache = hub_models[0]
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", "1"), ("HF_TOKEN", TOKEN)):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    return hub_models


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.pipeline.transformer.parameters()])


@pytest.mark.parametrize(
    "path, hub_like",
    [("owner/name", True), ("stabilityai/stable-diffusion-3.5-medium", True), ("models/tiny", True),
     ("./models/tiny", False), ("models/tiny/", False), ("/models/tiny", False), ("~/tiny", False), ("tiny", False),
     ("a/b/c", False), ("owner--x/name", False), ("owner/na me", False), ("owner/..", False)],
)  # fmt: skip
def test_a_hub_id_is_exactly_owner_slash_name(path, hub_like):
    assert names_hub_repo(path) is hub_like


def test_a_hub_id_resolves_to_its_snapshot_as_huggingface_hub_finds_it(hub):
    found = model_dir(REPO)
    assert found == Path(snapshot_download(REPO, local_files_only=True)) == hub[2]  # refs/main's commit
    assert found.name == NEW and (found / "model_index.json").is_symlink()


def test_model_revision_pins_a_commit(hub, tiny_model_dir):
    assert model_dir(REPO, OLD) == Path(snapshot_download(REPO, revision=OLD, local_files_only=True)) == hub[1]
    cfg = dict(device="cpu", max_sequence_length=16, lora=LoraConfig(enabled=False))
    pinned = load_model(ModelConfig(path=REPO, revision=OLD, **cfg))
    main = load_model(ModelConfig(path=REPO, **cfg))
    assert pinned.directory == hub[1] and main.directory == hub[2]
    assert torch.equal(weights(main), weights(load_model(ModelConfig(path=str(tiny_model_dir), **cfg))))
    assert not torch.equal(weights(pinned), weights(main))  # the seed-1 model of the older commit


def test_a_local_folder_of_that_name_wins(hub, tmp_path, flux_model_dir):
    shutil.copytree(flux_model_dir, tmp_path / REPO)
    assert model_dir(REPO) == Path(REPO)
    assert load_model(ModelConfig(path=REPO, device="cpu", max_sequence_length=16)).family == "flux"


@pytest.mark.parametrize("revision", [None, "3" * 40])
def test_offline_with_nothing_cached_is_one_line_saying_how_to_download(hub, revision):
    repo = REPO if revision else "owner/absent"  # a repository not cached, or a commit of a cached one
    with pytest.raises(UserError) as caught:
        model_dir(repo, revision)
    line = str(caught.value)
    assert "\n" not in line and f"model '{repo}'" in line and "HF_HUB_OFFLINE is set" in line
    assert f"`hf download {repo}{f' --revision {revision}' if revision else ''}`" in line
    assert not Path(repo).exists()


def test_without_network_nothing_cached_is_the_same_line(hub, monkeypatch):
    """Not offline, but the Hub unreachable (here: a closed local port): diffusers falls back to the cache."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", "http://127.0.0.1:9")
    assert model_dir(REPO) == hub[2]  # cached: loads without the Hub
    with pytest.raises(UserError, match=r"the Hub cannot be reached: download it .* `hf download owner/absent`"):
        model_dir("owner/absent")


def test_the_tiny_model_is_never_created_where_a_hub_id_is_meant(hub, make_config, caplog):
    ensure_model(
        make_config("model.path=stabilityai/stable-diffusion-3.5-medium", "model.create_tiny_if_missing=small")
    )
    assert not Path("stabilityai").exists() and "names a Hub repository" in caplog.text
    ensure_model(make_config("model.path=./models/tiny", "model.create_tiny_if_missing=small"))
    assert (Path("models/tiny") / "model_index.json").is_file()  # the quickstarts' way of naming a local folder
    for name in ("quickstart", "quickstart_edit", "quickstart_i2v", "quickstart_video"):
        model = load(ROOT / f"configs/{name}.yaml").model
        assert model.create_tiny_if_missing and model.tiny_to_create, name  # none of their paths is a Hub id


def test_estimate_reads_a_cached_hub_id_and_never_a_tiny_preset(hub, capsys):
    arch = architecture_for(load(QUICKSTART, [f"model.path={REPO}"]).model)
    assert arch.name == REPO and arch.source == str(hub[2])  # the snapshot, not the quickstart's tiny preset
    assert arch.transformer_config == from_model_dir(hub[2]).transformer_config
    assert main(["estimate", QUICKSTART, f"model.path={REPO}", "--gpu", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == REPO
    with pytest.raises(UserError, match=r"estimate: model 'owner/absent'.*HF_HUB_OFFLINE is set.*pass --arch NAME"):
        architecture_for(load(QUICKSTART, ["model.path=owner/absent"]).model)  # not cached, no shipped one of that name
    shipped = architecture_for(load(QUICKSTART, ["model.path=stabilityai/stable-diffusion-3.5-medium"]).model)
    assert shipped.name == "stable-diffusion-3.5-medium" and not Path("stabilityai").exists()


def test_train_from_a_hub_id_then_every_command_resolves_it(hub, train_argv, tmp_path, capsys):
    """A run trained from the cached Hub id (no folder written in the working directory, the token nowhere in the
    run), then sample, eval, export and doctor given `--model owner/tiny` each load that snapshot."""
    run = tmp_path / "run"
    assert (
        main(train_argv(f"model.path={REPO}", "model.lora.enabled=true", "train.total_steps=1", "train.save_every=1"))
        == 0
    )
    assert load(run / "config.yaml").model.path == REPO and not Path("owner").exists()
    for file in (p for p in run.rglob("*") if p.is_file()):
        assert TOKEN.encode() not in file.read_bytes(), file
    assert main(["sample", "--model", REPO, "--prompt", "a", "--out", "grid.png", *FAST]) == 0
    assert Path("grid.png").is_file()
    Path("prompts.txt").write_text("a\n")
    evaluation = ["eval", "--model", REPO, "--checkpoint", "base", "--checkpoint", str(run), "--out", "eval"]
    assert main([*evaluation, "--n", "1", "--prompts", "prompts.txt", "--reward", "jpeg_compressibility", *FAST]) == 0
    columns = json.loads(Path("eval/metrics.json").read_text())["columns"]
    assert {c["checkpoint"]["model"] for c in columns} == {str(hub[2].resolve())}
    assert main(["export", "--checkpoint", str(run), "--out", "lora", "--model", REPO, "--device", "cpu"]) == 0
    card = Path("lora/README.md").read_text()  # the commit trained on, in the snippet
    assert "base_model: owner/tiny" in card and f'from_pretrained("owner/tiny", revision="{NEW}",' in card
    capsys.readouterr()
    assert main(["doctor", "--model", REPO, "--dtype", "fp32", "--device", "cpu", "--height", "32", "--width", "32",
                 "--steps", "2", "--max-sequence-length", "16", "--no-activations"]) == 0  # fmt: skip
    assert "family     sd3" in capsys.readouterr().out


def test_the_environment_variables_reach_the_command(hub_models, tmp_path):
    """HF_HUB_OFFLINE and HF_HUB_CACHE as a user sets them: `doctor --model` of an uncached id, one line, exit 2."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_models[0]), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "diffusion_rl.cli", "doctor", "--model", "stabilityai/stable-diffusion-3.5-medium"]
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "HF_HUB_OFFLINE is set" in lines[0] and "`hf download stabilityai/stable-diffusion-3.5-medium`" in lines[0]
    assert str(hub_models[0]) in lines[0] and not (tmp_path / "stabilityai").exists()
