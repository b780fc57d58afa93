"""Pretrained tiny models shipped inside the package, as presets of their family: (family, preset) → a directory
under diffusion_rl/assets/models/.

- `shapes` (sd3): the ShapesWorld model that `diffusion-rl pretrain configs/shapes_pretrain.yaml` writes (the 2.3M
  transformer of the `base` preset at 32 px, its VAE and prompt split, `shapes.json`): the quickstart's and the
  learning benchmarks' base model, so a new user starts from a model that draws shapes instead of 7.5 minutes of
  pretraining. The command rebuilds it bit for bit on the CPU it was made on (an AMD EPYC with AVX-512 and without
  AMX, 2 torch threads; other CPUs round differently); its transformer is the ranking's base model (sha256
  c57700ac2d82ea83…).

Every file of a shipped model is listed with its sha256 in `SHA256SUMS` beside it, checked when the model is copied
out (`save_tiny`, `init-tiny`, `model.create_tiny_if_missing`): a changed or missing file is one line naming it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from diffusion_rl.errors import UserError
from diffusion_rl.utils.digest import file_sha256

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "models"
MANIFEST = "SHA256SUMS"
SHIPPED = {("sd3", "shapes"): "shapes"}  # (family, preset) → its directory under ASSETS


def shipped_presets(family: str) -> list[str]:
    return [preset for (f, preset) in SHIPPED if f == family]


def shipped_dir(family: str, preset: str) -> Path | None:
    name = SHIPPED.get((family, preset))
    return None if name is None else ASSETS / name


def write_manifest(directory: Path) -> Path:
    """SHA256SUMS of every file under `directory` (sorted relative paths), as `sha256sum` writes it."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    lines = [f"{file_sha256(p)}  {p.relative_to(directory).as_posix()}" for p in files]
    (directory / MANIFEST).write_text("\n".join(lines) + "\n")
    return directory / MANIFEST


def verify(directory: Path) -> None:
    """Every file SHA256SUMS lists is there with its hash, and no other file is (UserError naming the first that
    is not)."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise UserError(f"{directory}: the shipped model has no {MANIFEST}; reinstall diffusion-rl")
    listed = {}
    for line in manifest.read_text().splitlines():
        digest, _, name = line.partition("  ")
        listed[name] = digest
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()} - {MANIFEST}
    for name in sorted(set(listed) | present):
        if name not in listed:
            raise UserError(f"{directory / name}: a file the shipped model's {MANIFEST} does not list; reinstall")
        if name not in present or file_sha256(directory / name) != listed[name]:
            what = "is missing" if name not in present else "does not match its sha256 in " + MANIFEST
            raise UserError(f"{directory / name} {what}: the shipped model is damaged; reinstall diffusion-rl")


def copy_shipped(family: str, preset: str, directory: Path) -> Path:
    """Copy the shipped model of (family, preset) to `directory` (verified first; the copy is written beside it and
    renamed into place, so an interrupted copy leaves nothing at `directory`)."""
    source = shipped_dir(family, preset)
    verify(source)
    if directory.is_dir():  # `init-tiny --force` over an existing directory: its files are overwritten
        shutil.copytree(source, directory, ignore=shutil.ignore_patterns(MANIFEST), dirs_exist_ok=True)
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.copy-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns(MANIFEST))
    os.replace(tmp, directory)
    return directory


def load_shipped(family: str, preset: str):
    """The shipped model's diffusers pipeline (verified), e.g. for `estimate`'s architecture."""
    import diffusers

    from diffusion_rl.models.registry import family_named

    source = shipped_dir(family, preset)
    verify(source)
    return getattr(diffusers, family_named(family).pipeline).from_pretrained(source)
