import errno
import os
import random
import stat

import numpy as np
import pytest
import torch

from diffusion_rl.checkpoint.paths import step_of
from diffusion_rl.checkpoint.store import CheckpointManager
from diffusion_rl.errors import UserError
from diffusion_rl.utils.rng import capture_rng_state, restore_rng_state


def _writer(text):
    def write(directory):
        (directory / "state.txt").write_text(text)
        (directory / "sub").mkdir()
        (directory / "sub" / "weights.bin").write_bytes(b"\0" * 16)

    return write


def _entries(manager):
    return sorted(p.name for p in manager.dir.iterdir())


def test_save_publishes_the_dir_and_points_latest_at_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=0)
    assert manager.latest() is None
    path = manager.save(10, _writer("ten"))
    assert path == tmp_path / "checkpoints" / "step_000010"
    assert (path / "state.txt").read_text() == "ten"
    assert (path / "sub" / "weights.bin").is_file()
    assert (manager.dir / "latest").read_text().strip() == "step_000010"
    assert manager.latest() == path
    assert step_of(path) == 10
    assert _entries(manager) == ["latest", "step_000010"]


def test_keep_last_prunes_the_oldest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        manager.save(step, _writer(str(step)))
    assert [step for step, _ in manager.list()] == [30, 40]
    assert manager.latest() == manager.dir / "step_000040"


def test_keep_last_never_prunes_the_checkpoint_just_written(tmp_path):
    # e.g. resumed from step 10 of a run that had already saved step 20 and 30
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step in (10, 20, 30):
        CheckpointManager(tmp_path).save(step, _writer(str(step)))
    manager.save(15, _writer("15"))
    assert [step for step, _ in manager.list()] == [15, 30]
    assert manager.latest() == manager.dir / "step_000015"


def test_keep_last_zero_keeps_all(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=0)
    for step in range(5):
        manager.save(step, _writer(str(step)))
    assert len(manager.list()) == 5


def test_failing_write_leaves_no_partial_dir_and_latest_unchanged(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(10, _writer("ten"))

    def broken(directory):
        (directory / "half.bin").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        manager.save(20, broken)
    assert _entries(manager) == ["latest", "step_000010"]
    assert manager.latest() == manager.dir / "step_000010"


def test_saving_the_same_step_again_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(10, _writer("first"))
    path = manager.save(10, _writer("second"))
    assert (path / "state.txt").read_text() == "second"
    assert _entries(manager) == ["latest", "step_000010"]


def test_stale_tmp_dir_is_ignored_then_cleaned_by_the_next_save(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=0)
    manager.save(10, _writer("ten"))
    stale = manager.dir / ".tmp-step_000020-99999"  # a crash in the middle of writing step 20
    stale.mkdir()
    (stale / "state.txt").write_text("partial")
    assert [step for step, _ in manager.list()] == [10]
    assert manager.latest() == manager.dir / "step_000010"

    manager.save(30, _writer("thirty"))
    assert _entries(manager) == ["latest", "step_000010", "step_000030"]


def test_latest_falls_back_to_the_highest_step_when_the_pointer_is_missing_or_stale(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(10, _writer("ten"))
    manager.save(20, _writer("twenty"))
    (manager.dir / "latest").unlink()
    assert manager.latest() == manager.dir / "step_000020"
    (manager.dir / "latest").write_text("step_000099\n")
    assert manager.latest() == manager.dir / "step_000020"


def test_resolve_resume_auto_and_never(tmp_path):
    manager = CheckpointManager(tmp_path)
    assert manager.resolve_resume("auto") is None  # fresh start
    manager.save(10, _writer("ten"))
    assert manager.resolve_resume("auto") == manager.dir / "step_000010"
    assert manager.resolve_resume("never") is None


def test_resuming_an_earlier_checkpoint_moves_the_later_ones_aside_with_a_copy_of_the_metrics(tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    for step in (1, 2, 3):
        manager.save(step, _writer(str(step)))
    (manager.run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    assert manager.set_aside_later(3) is None and manager.set_aside_later(7) is None  # nothing later: nothing moved
    aside = manager.set_aside_later(1)
    assert aside.parent == tmp_path and aside.name.startswith("run.after-step_000001-")
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert (aside / "checkpoints" / "step_000003" / "state.txt").read_text() == "3"
    assert (aside / "metrics.jsonl").read_text().count("step") == 3
    assert [step for step, _ in manager.list()] == [1] and manager.latest() == manager.dir / "step_000001"
    assert (manager.dir / "latest").read_text().strip() == "step_000001"
    again = manager.save(2, _writer("2 again"))  # the resumed run's save replaces nothing kept
    assert (again / "state.txt").read_text() == "2 again"
    assert (aside / "checkpoints" / "step_000002" / "state.txt").read_text() == "2"


def test_resolve_resume_accepts_a_checkpoint_or_run_directory(tmp_path):
    old_run = CheckpointManager(tmp_path / "old_run")
    first = old_run.save(10, _writer("ten"))
    second = old_run.save(20, _writer("twenty"))
    manager = CheckpointManager(tmp_path / "new_run")
    assert manager.resolve_resume(str(first)) == first.resolve()
    assert manager.resolve_resume(str(tmp_path / "old_run")) == second.resolve()
    assert manager.resolve_resume(str(tmp_path / "old_run" / "checkpoints")) == second.resolve()


def test_resolve_resume_rejects_missing_paths_and_non_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    with pytest.raises(UserError, match="run.resume .*nope: no such directory"):
        manager.resolve_resume(str(tmp_path / "nope"))
    (tmp_path / "random_dir").mkdir()
    with pytest.raises(UserError, match="not a checkpoint"):
        manager.resolve_resume(str(tmp_path / "random_dir"))
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match="holds no checkpoint"):
        manager.resolve_resume(str(tmp_path / "empty_run"))


def test_step_of_rejects_other_names(tmp_path):
    with pytest.raises(UserError, match="step_NNNNNN"):
        step_of(tmp_path / "best")


def _draws():
    return (random.random(), float(np.random.rand()), float(np.random.randn()), torch.rand(3).tolist())


def test_rng_restore_reproduces_the_next_draws_after_a_save_and_load(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leaves numpy with a cached gaussian, which is part of the state
    state = capture_rng_state()
    expected = _draws()

    torch.save(state, tmp_path / "rng.pt")
    _draws()  # move all streams on
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draws() == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rng_restore_reproduces_cuda_draws():
    torch.cuda.manual_seed_all(4)
    state = capture_rng_state()
    expected = torch.rand(4, device="cuda").tolist()
    torch.rand(4, device="cuda")
    restore_rng_state(state)
    assert torch.rand(4, device="cuda").tolist() == expected


@pytest.mark.parametrize("error", [OSError("device busy"), KeyboardInterrupt()])
def test_a_prune_stopped_mid_delete_leaves_only_complete_checkpoints(tmp_path, monkeypatch, error):
    from diffusion_rl.checkpoint import store as checkpoint

    real_rmtree = checkpoint.shutil.rmtree
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(10, _writer("ten"))

    def dies_mid_delete(path, *args, **kwargs):  # a kill or an I/O error after deleting one file
        next(p for p in sorted(path.rglob("*")) if p.is_file()).unlink()
        raise error

    monkeypatch.setattr(checkpoint.shutil, "rmtree", dies_mid_delete)
    if isinstance(error, OSError):
        manager.save(20, _writer("twenty"))  # the new checkpoint is complete: the run goes on
    else:
        with pytest.raises(KeyboardInterrupt):
            manager.save(20, _writer("twenty"))
    leftover = [name for name in _entries(manager) if name.startswith(".tmp-")]
    assert [name for name in _entries(manager) if not name.startswith(".tmp-")] == ["latest", "step_000020"]
    assert len(leftover) == 1 and "step_000010" in leftover[0]
    assert (manager.dir / "step_000020" / "state.txt").read_text() == "twenty"
    assert (manager.dir / "step_000020" / "sub" / "weights.bin").is_file()
    assert manager.latest() == manager.dir / "step_000020"

    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    manager.save(30, _writer("thirty"))  # removes the leftover
    assert _entries(manager) == ["latest", "step_000030"]


def _has_dev_full() -> bool:
    return os.path.exists("/dev/full") and stat.S_ISCHR(os.stat("/dev/full").st_mode)


@pytest.mark.skipif(not _has_dev_full(), reason="needs the /dev/full device (always full)")
def test_torch_saves_short_write_is_reported_as_no_space_left_on_device(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=0)
    manager.save(10, _writer("ten"))

    def onto_a_full_disk(directory):
        (directory / "state.txt").write_text("partial")
        torch.save({"weights": torch.zeros(100_000)}, "/dev/full")  # RuntimeError: ... unexpected pos … vs …

    with pytest.raises(OSError) as raised:
        manager.save(20, onto_a_full_disk)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(manager.dir / "step_000020")
    assert "No space left on device" in str(raised.value) and "torch.save stopped part-way" in str(raised.value)
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert _entries(manager) == ["latest", "step_000010"]  # the partial checkpoint is gone, latest unchanged


def test_other_write_errors_pass_through_unchanged(tmp_path):
    def broken(directory):
        raise RuntimeError("a bug in a write function")

    with pytest.raises(RuntimeError, match="a bug in a write function"):
        CheckpointManager(tmp_path).save(1, broken)


def test_a_broken_latest_is_set_aside_and_latest_points_at_the_checkpoint_before(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (5, 10):
        manager.save(step, _writer(str(step)))
    assert manager.set_aside_latest() == (manager.dir / "broken-step_000010", manager.dir / "step_000005")
    assert [step for step, _ in manager.list()] == [5] and manager.latest() == manager.dir / "step_000005"
    assert (manager.dir / "broken-step_000010" / "state.txt").read_text() == "10"  # kept to inspect
    manager.save(20, _writer("20"))
    manager.save(30, _writer("30"))  # pruning keeps 2 step_* checkpoints and never touches the broken one
    assert _entries(manager) == ["broken-step_000010", "latest", "step_000020", "step_000030"]
    for _ in range(2):
        manager.set_aside_latest()
    assert manager.latest() is None and manager.list() == []  # a resume then starts from scratch
    with pytest.raises(ValueError, match="no checkpoint to set aside"):
        manager.set_aside_latest()


def test_an_earlier_run_is_set_aside_beside_its_folder_and_a_folder_without_one_is_left(tmp_path, monkeypatch):
    run = tmp_path / "run"
    manager = CheckpointManager(run)
    assert manager.set_aside_earlier_run() is None  # no folder
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    assert manager.set_aside_earlier_run() is None and (run / "notes.txt").is_file()  # no run was here: left
    manager.save(1, lambda d: (d / "x").write_text("1"))
    first = manager.set_aside_earlier_run()
    assert first.parent == tmp_path and first.name.startswith("run.before-") and list(run.iterdir()) == []
    assert sorted(p.name for p in first.iterdir()) == ["checkpoints", "notes.txt"]
    manager.save(1, lambda d: (d / "x").write_text("2"))
    second = manager.set_aside_earlier_run()  # within the same second: its own folder
    assert second != first and CheckpointManager(second).latest().name == "step_000001"
    monkeypatch.chdir(run)  # a run directory that holds the working directory is not emptied
    (run / "config.yaml").write_text("{}")
    with pytest.raises(UserError, match="holds the working directory"):
        manager.set_aside_earlier_run()
