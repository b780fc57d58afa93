"""A checkpoint's manifest (checkpoint/manifest.py): written with the checkpoint, checked before it is read, and no
symbolic link followed out of the run directory."""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess

import pytest

from diffusion_rl.checkpoint import manifest
from diffusion_rl.checkpoint.manifest import MANIFEST_FILE, verify_checkpoint
from diffusion_rl.checkpoint.paths import resolve_checkpoint
from diffusion_rl.checkpoint.store import CheckpointManager
from diffusion_rl.errors import UserError
from diffusion_rl.utils import digest


def _writer(text: str):
    def write(directory):
        (directory / "state.txt").write_text(text)
        (directory / "dcp").mkdir()
        (directory / "dcp" / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
        (directory / "dcp" / ".metadata").write_bytes(b"index")

    return write


def _saved(tmp_path, run="run", step=1):
    return CheckpointManager(tmp_path / run).save(step, _writer(f"{run} {step}"))


def test_save_publishes_a_manifest_of_every_file_that_sha256sum_accepts(tmp_path):
    path = _saved(tmp_path)
    lines = (path / MANIFEST_FILE).read_text().splitlines()
    expected = {
        name: hashlib.sha256((path / name).read_bytes()).hexdigest()
        for name in ("dcp/.metadata", "dcp/__0_0.distcp", "state.txt")
    }
    assert lines == [f"{digest}  {name}" for name, digest in expected.items()]
    if shutil.which("sha256sum"):  # the format of coreutils' tool: a copy can be checked by hand
        subprocess.run(["sha256sum", "--check", "--quiet", MANIFEST_FILE], cwd=path, check=True)
    verify_checkpoint(path)


@pytest.mark.parametrize(
    "damage, named, says",
    [
        (lambda p: _flip(p / "dcp" / "__0_0.distcp", 100), "dcp/__0_0.distcp", "sha256 differs"),
        (lambda p: (p / "dcp" / ".metadata").unlink(), "dcp/.metadata", "missing, though"),
        (lambda p: (p / "dcp" / "__1_0.distcp").write_bytes(b"x"), "dcp/__1_0.distcp", "not in the checkpoint's"),
        (lambda p: (p / "state.txt").write_text("run"), "state.txt", "sha256 differs"),  # truncated
    ],
)
def test_a_changed_missing_or_added_file_is_one_error_naming_it(tmp_path, damage, named, says):
    path = _saved(tmp_path)
    verify_checkpoint(path)  # verified once, unchanged: then damaged, it is checked again
    damage(path)
    with pytest.raises(UserError, match=says) as raised:
        verify_checkpoint(path)
    message = str(raised.value)
    assert message.startswith(f"{path / named}: ") and "\n" not in message


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = bytes(b ^ 0xFF for b in data[offset : offset + 4])
    path.write_bytes(bytes(data))


def test_a_damaged_manifest_names_its_line(tmp_path):
    path = _saved(tmp_path)
    with open(path / MANIFEST_FILE, "a") as file:
        file.write("0123  ../../etc/passwd\n")
    with pytest.raises(UserError, match=rf"{MANIFEST_FILE}, line 4: not '<sha256>  <file in the checkpoint>'"):
        verify_checkpoint(path)


@pytest.mark.parametrize("linked", ["state.txt", "dcp/.metadata", "dcp"])
def test_a_symbolic_link_inside_a_checkpoint_is_refused_without_reading_it(tmp_path, linked):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    path = _saved(tmp_path)
    target = path / linked
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    target.symlink_to(secret)
    with pytest.raises(UserError, match=f"{target} is a symbolic link") as raised:
        verify_checkpoint(path)
    assert "root:" not in str(raised.value)


def test_a_step_directory_linked_to_another_runs_is_refused(tmp_path):
    other = _saved(tmp_path, run="other", step=2)
    ours = _saved(tmp_path, run="run", step=1)
    linked = ours.parent / "step_000002"
    linked.symlink_to(other, target_is_directory=True)
    (ours.parent / "latest").write_text("step_000002\n")
    with pytest.raises(UserError, match="step_000002 is a symbolic link"):  # run.resume=auto
        verify_checkpoint(CheckpointManager(tmp_path / "run").resolve_resume("auto"))
    for spec in (tmp_path / "run", linked):  # --checkpoint RUN_DIR, --checkpoint RUN_DIR/checkpoints/step_000002
        with pytest.raises(UserError, match="step_000002 is a symbolic link"):
            resolve_checkpoint(spec)


def test_a_linked_checkpoints_folder_or_latest_pointer_is_not_followed(tmp_path, caplog):
    _saved(tmp_path, run="other", step=2)
    ours = _saved(tmp_path, run="run", step=1)
    (ours.parent / "latest").unlink()
    (ours.parent / "latest").symlink_to(tmp_path / "other" / "checkpoints" / "latest")
    with caplog.at_level(logging.WARNING):
        assert resolve_checkpoint(tmp_path / "run") == ours.resolve()  # the highest step of its own
    assert "latest is a symbolic link, not followed" in caplog.text
    (tmp_path / "third").mkdir()
    (tmp_path / "third" / "checkpoints").symlink_to(tmp_path / "other" / "checkpoints")
    with pytest.raises(UserError, match="checkpoints is a symbolic link"):
        resolve_checkpoint(tmp_path / "third")
    with pytest.raises(UserError, match="checkpoints is a symbolic link"):
        CheckpointManager(tmp_path / "third")  # a run would save checkpoints it could not read back


def test_a_checkpoint_without_a_manifest_loads_with_one_warning(tmp_path, caplog):
    path = _saved(tmp_path)
    (path / MANIFEST_FILE).unlink()  # as checkpoints were saved before manifests
    with caplog.at_level(logging.WARNING):
        verify_checkpoint(path)
        verify_checkpoint(path)  # the same load reading it again: no second warning
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    said = f"{path} has no {MANIFEST_FILE} (saved before checkpoints were verified): it is read unverified"
    assert warnings == [said]


def test_each_file_is_hashed_once_per_load_in_chunks(tmp_path, monkeypatch):
    path = _saved(tmp_path)
    hashed, reads = [], []
    real_hash, real_open = manifest.file_sha256, open

    class Reader:  # counts the reads of the streaming hash: one CHUNK at a time, never the whole file
        def __init__(self, file):
            self.file = file

        def read(self, size=-1):
            reads.append(size)
            return self.file.read(size)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(manifest, "file_sha256", lambda p: hashed.append(p.name) or real_hash(p))
    monkeypatch.setattr(digest, "open", lambda p, mode: Reader(real_open(p, mode)), raising=False)
    verify_checkpoint(path)
    verify_checkpoint(path)  # e.g. `sample`: the config, then the weights
    assert sorted(hashed) == [".metadata", "__0_0.distcp", "state.txt"]
    assert set(reads) == {digest.CHUNK}
    (path / "state.txt").write_text("run")  # changed since: hashed again, and found changed
    with pytest.raises(UserError, match="state.txt: its sha256 differs"):
        verify_checkpoint(path)
