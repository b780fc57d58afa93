"""The one checkpoint format: read without running code from it, earlier formats upgraded, weights identified."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diffusion_rl.checkpoint.manifest import write_manifest
from diffusion_rl.checkpoint.state import SafeReader, check_format, read_saved_tensors, read_state
from diffusion_rl.checkpoint.store import CheckpointManager
from diffusion_rl.cli import main
from diffusion_rl.config.loading import to_yaml
from diffusion_rl.errors import UserError
from diffusion_rl.utils.digest import weights_digest
from diffusion_rl.utils.rng import capture_rng_state

RAN = []


class _Payload:
    """Unpickling this calls RAN.append: what a crafted checkpoint would do with os.system."""

    def __reduce__(self):
        return (RAN.append, ("code ran",))


def _checkpoint(trainer) -> Path:
    trainer.train()
    return CheckpointManager(trainer.run_dir).latest()


def test_a_state_file_that_would_run_code_is_refused(make_trainer):
    path = _checkpoint(make_trainer("train.total_steps=1"))
    torch.save({"step": 1, "payload": _Payload()}, path / "state.pt")
    write_manifest(path)  # a crafter rewrites the manifest too (it is no signature): the loader still refuses code
    with pytest.raises(UserError, match=r"state.pt: refused to load"):
        read_state(path)
    assert RAN == []


def test_dcp_metadata_that_would_run_code_is_refused(make_trainer):
    path = _checkpoint(make_trainer("train.total_steps=1"))
    (path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(UserError, match=r"\.metadata: not a readable checkpoint metadata file"):
        SafeReader(path / "dcp").read_metadata()
    assert RAN == []


def test_a_real_metadata_file_reads_back(make_trainer):
    path = _checkpoint(make_trainer("train.total_steps=1"))
    keys = set(SafeReader(path / "dcp").read_metadata().state_dict_metadata)
    assert any(k.startswith("policies.default.") for k in keys) and any(k.startswith("optimizer.") for k in keys)


def test_an_earlier_format_names_the_command_that_converts_it(tmp_path):
    old = tmp_path / "step_000003"
    old.mkdir()
    torch.save({"step": 3}, old / "run_state.pt")
    with pytest.raises(UserError, match=r"earlier diffusion-rl format; convert it once with .*checkpoint upgrade"):
        check_format(old)


def _write_old_local_checkpoint(trainer, directory: Path) -> None:
    """What diffusion-rl 0.1's local engine wrote after `trainer.step` steps."""
    worker = trainer.engine
    directory.mkdir(parents=True)
    policies = worker.model.policies
    for name in policies.saved_names():
        tensors = {k: v.contiguous() for k, v in policies.state_dict_of(name).items()}
        save_file(tensors, directory / f"policy_{name}.safetensors")
    opt = worker.optimizer
    trainer_state = {"optimizer": opt.optimizer.state_dict(), "scheduler": opt.scheduler.state_dict(), "ema": None,
                     "counters": [opt.steps, opt.skipped, opt.consecutive_skips]}  # fmt: skip
    torch.save(trainer_state, directory / "trainer_state.pt")
    run_state = {"step": trainer.step, "sampler": trainer.sampler.state_dict(), "rng": capture_rng_state(),
                 "trainer": {"window_start": 0}}  # fmt: skip
    torch.save(run_state, directory / "run_state.pt")
    (directory / "config.yaml").write_text(to_yaml(trainer.cfg))


def test_an_upgraded_checkpoint_resumes_like_a_straight_run(make_trainer, tmp_path, weights):
    straight = make_trainer("train.total_steps=2", f"run.dir={tmp_path / 'straight'}")
    straight.train()

    first = make_trainer("train.total_steps=1", f"run.dir={tmp_path / 'old'}")
    first.train()
    old = tmp_path / "old_run" / "checkpoints" / "step_000001"
    _write_old_local_checkpoint(first, old)
    with pytest.raises(UserError, match="checkpoint upgrade"):
        make_trainer("train.total_steps=2", f"run.dir={tmp_path / 'resumed'}", f"run.resume={old}").train()

    assert main(["checkpoint", "upgrade", str(old)]) == 0
    assert {"dcp", "state.pt", "config.yaml"} <= {p.name for p in old.iterdir()}
    assert not (old / "trainer_state.pt").exists()
    assert main(["checkpoint", "upgrade", str(old)]) == 2  # already current: a one-line error
    resumed = make_trainer("train.total_steps=2", f"run.dir={tmp_path / 'resumed'}", f"run.resume={old}")
    resumed.train()
    expected, got = weights(straight), weights(resumed)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_weights_digest_names_the_values_not_the_order():
    a = {"x": torch.arange(4.0), "y": torch.ones(2, 2)}
    same = {"y": torch.ones(2, 2), "x": torch.arange(4.0)}
    changed = {"x": torch.arange(4.0), "y": torch.ones(2, 2).index_put_((torch.tensor([0]),), torch.tensor(2.0))}
    assert weights_digest(a) == weights_digest(same) != weights_digest(changed)
    assert weights_digest({"x": torch.arange(4.0)}) != weights_digest({"x": torch.arange(4.0).double()})


def test_saved_weights_read_without_a_model_equal_the_trained_ones(make_trainer, weights):
    trainer = make_trainer("train.total_steps=1")
    path = _checkpoint(trainer)
    saved, now = read_saved_tensors(path, "policies.default."), weights(trainer)
    assert saved.keys() == now.keys() and all(torch.equal(saved[k], now[k]) for k in now)


def _rewrite_dcp(path: Path, change) -> None:
    """Read every entry of path/dcp, change(entries) in place, and write them back as a DCP checkpoint (and its
    manifest anew)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = path.parent / "whole.pt"
    dcp_to_torch_save(path / "dcp", whole)
    entries = torch.load(whole, weights_only=False)  # our own test file
    change(entries)
    for file in (path / "dcp").iterdir():
        file.unlink()
    torch.distributed.checkpoint.save(entries, checkpoint_id=path / "dcp")
    write_manifest(path)  # crafted with its manifest: what the safe readers below the manifest must refuse


def _code_in_optimizer(entries):
    entries["optimizer"]["param_groups"][0]["lr"] = _Payload()  # a non-tensor entry: pickled bytes


def _object_for_weight(entries):
    weights = entries["policies"]["default"]
    weights[next(iter(weights))] = "not a tensor"


@pytest.mark.parametrize("change", [_code_in_optimizer, _object_for_weight])
def test_a_crafted_non_tensor_dcp_entry_is_one_line_on_resume(change, train_argv, tmp_path, capsys):
    assert main(train_argv("train.total_steps=1", "train.save_every=1")) == 0
    path = CheckpointManager(tmp_path / "run").latest()
    _rewrite_dcp(path, change)
    capsys.readouterr()
    assert main(train_argv("train.total_steps=2", "train.save_every=1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"diffusion-rl: error: checkpoint {path} is damaged or not ours: "), err
    assert RAN == []
