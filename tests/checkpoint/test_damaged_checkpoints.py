"""A LoRA run's latest checkpoint damaged as a fault audit found it (issue 46, item 7): `sample --checkpoint` and a
resume each exit with status 2 and one line naming the file, reading nothing outside the run; a checkpoint saved
before manifests loads with one warning."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from diffusion_rl.checkpoint import manifest
from diffusion_rl.checkpoint.manifest import MANIFEST_FILE
from diffusion_rl.checkpoint.state import SafeReader, read_saved_tensors
from diffusion_rl.cli import main
from tests.conftest import ROOT, fast_overrides

STEP = Path("checkpoints") / "step_000002"
SECRET = "root:x:0:0:root:/root:/bin/bash\n"  # what a link to /etc/passwd would show
RAN = []


class _Payload:
    def __reduce__(self):
        return (RAN.append, ("code ran",))


def _train(model_dir: Path, run: Path, *overrides: str) -> list[str]:
    lora = ["model.lora.enabled=true", "train.save_every=1"]
    return [
        "train",
        str(ROOT / "configs/quickstart_flow_grpo.yaml"),
        *fast_overrides(model_dir, run),
        *lora,
        *overrides,
    ]


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A 2-step LoRA run with a checkpoint after each step (trained once for the module)."""
    run = tmp_path_factory.mktemp("lora") / "run"
    assert main(_train(tiny_model_dir, run)) == 0
    return run


def _copy(lora_run: Path, tmp_path: Path) -> Path:
    shutil.copytree(lora_run, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _sample(run: Path, tiny_model_dir, tmp_path) -> list[str]:
    return ["sample", "--checkpoint", str(run), "--model", str(tiny_model_dir), "--prompt", "a", "--steps", "2",
            "--device", "cpu", "--out", str(tmp_path / "sample.png")]  # fmt: skip


def _resume(run: Path, model_dir: Path) -> list[str]:
    return _train(model_dir, run, "train.total_steps=3")  # run.resume=auto: from step_000002


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffusion-rl: error: ") and "Traceback" not in err, err
    return lines[0]


def _link_to_secret(name: str):
    def damage(step: Path, tmp_path: Path) -> None:
        (tmp_path / "passwd").write_text(SECRET)
        (step / name).unlink()
        (step / name).symlink_to(tmp_path / "passwd")

    return damage


def _link_to_another_run(step: Path, tmp_path: Path) -> None:
    other = tmp_path / "other" / STEP  # another run's checkpoint of the same step
    shutil.copytree(step, other)
    shutil.rmtree(step)
    step.symlink_to(other, target_is_directory=True)


def _flip_a_lora_weight(step: Path, tmp_path: Path) -> None:
    """4 bytes changed in the middle of a LoRA weight's values inside dcp/__0_0.distcp."""
    name, weight = next((k, v) for k, v in read_saved_tensors(step, "policies.default.").items() if "lora_A" in k)
    info = SafeReader(step / "dcp").read_metadata().storage_data
    stored = next(s for index, s in info.items() if index.fqn == f"policies.default.{name}")
    file = step / "dcp" / stored.relative_path
    data = bytearray(file.read_bytes())
    at = data.index(weight.numpy().tobytes(), stored.offset, stored.offset + stored.length) + weight.nbytes // 2
    data[at : at + 4] = bytes(b ^ 0x55 for b in data[at : at + 4])
    file.write_bytes(bytes(data))


def _code_in_state(step: Path, tmp_path: Path) -> None:
    torch.save({"format": 2, "step": 2, "payload": _Payload()}, step / "state.pt")


def _edited_state(step: Path, tmp_path: Path) -> None:
    """state.pt rewritten by hand without its RNG states (its manifest entry then rewritten to match, or gone)."""
    state = torch.load(step / "state.pt", weights_only=True)
    del state["rng"]
    torch.save(state, step / "state.pt")


def _cut_a_weights_file(step: Path, tmp_path: Path) -> None:
    file = step / "dcp" / "__0_0.distcp"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _no_dcp_metadata(step: Path, tmp_path: Path) -> None:
    (step / "dcp" / ".metadata").unlink()


@pytest.mark.parametrize(
    "damage, says",
    [
        (_link_to_secret("config.yaml"), "config.yaml is a symbolic link"),
        (_link_to_secret("state.pt"), "state.pt is a symbolic link"),
        (_link_to_another_run, "step_000002 is a symbolic link"),
        (_flip_a_lora_weight, "__0_0.distcp: its sha256 differs from the checkpoint's manifest.sha256"),
        (_code_in_state, "state.pt: its sha256 differs"),
        (_no_dcp_metadata, "dcp/.metadata: missing, though the checkpoint's manifest.sha256 lists it"),
    ],
)
def test_a_damaged_checkpoint_is_one_line_and_status_2_for_sample_and_resume(
    damage, says, lora_run, tiny_model_dir, tmp_path, capsys
):
    run = _copy(lora_run, tmp_path)
    damage(run / STEP, tmp_path)
    capsys.readouterr()
    for argv in (_sample(run, tiny_model_dir, tmp_path), _resume(run, tiny_model_dir)):
        assert main(argv) == 2, argv[0]
        line = _one_error_line(capsys)
        assert says in line and "root:" not in line, line
    assert RAN == [] and not (tmp_path / "sample.png").exists()
    assert not (run / "checkpoints" / "step_000003").exists()  # the resume stopped before its first step


@pytest.mark.parametrize(
    "damage, says",
    [
        (_code_in_state, "state.pt: refused to load (it holds more than plain data: "),
        (_no_dcp_metadata, "is not a complete checkpoint: it has no dcp/.metadata"),
        (_edited_state, "state.pt: its entries do not read back (KeyError: 'rng'); the file was changed after it"),
        (_cut_a_weights_file, "is damaged or not ours: dcp/__0_0.distcp shorter than dcp/.metadata says (cut short)"),
    ],
)
def test_a_damaged_checkpoint_without_manifest_is_still_one_line(
    damage, says, lora_run, tiny_model_dir, tmp_path, capsys
):
    run = _copy(lora_run, tmp_path)
    (run / STEP / MANIFEST_FILE).unlink(missing_ok=True)  # (none before manifests existed)
    damage(run / STEP, tmp_path)
    capsys.readouterr()
    assert main(_resume(run, tiny_model_dir)) == 2
    assert says in _one_error_line(capsys)
    assert RAN == []


def test_a_checkpoint_saved_before_manifests_samples_and_resumes_with_one_warning(
    lora_run, tiny_model_dir, tmp_path, caplog, monkeypatch
):
    run = _copy(lora_run, tmp_path)
    (run / STEP / MANIFEST_FILE).unlink(missing_ok=True)  # (none before manifests existed)
    unverified = f"{run / STEP} has no {MANIFEST_FILE} (saved before checkpoints were verified): it is read unverified"
    for argv in (_sample(run, tiny_model_dir, tmp_path), _resume(run, tiny_model_dir)):
        caplog.clear()
        monkeypatch.setattr(manifest, "_verified", {})  # each command its own process: nothing verified yet
        with caplog.at_level(logging.WARNING):
            assert main(argv) == 0, argv[0]
        assert [r.getMessage() for r in caplog.records].count(unverified) == 1, argv[0]
    assert (run / "checkpoints" / "step_000003" / MANIFEST_FILE).is_file()  # what the resumed run saves is verified
