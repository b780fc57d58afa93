"""Plain helpers several test modules share (imported as `tests.helpers`; fixtures live in conftest.py)."""

from __future__ import annotations

from pathlib import Path


def random_pair_file(folder: Path, n: int) -> Path:
    """A pair dataset of n pairs of random 32 × 32 images (seed 0), written under `folder`: its pairs.jsonl."""
    import numpy as np
    from PIL import Image

    from diffusion_rl.data.pairs import PreferencePair, write_pairs

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pairs = []
    for i in range(n):
        paths = folder / f"{i}_chosen.png", folder / f"{i}_rejected.png"
        for path in paths:
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
        pairs.append(PreferencePair(f"prompt {i}", *paths))
    write_pairs(pairs, folder / "pairs.jsonl")
    return folder / "pairs.jsonl"


def check_generated(path: Path, text: str, command: str) -> None:
    """A generated file kept in the repository (docs/config.md) is `text`. Where it is stale, a developer's run
    writes it and passes with a warning: adding a loss regenerates its docs with no step to remember, and the diff
    is committed with the code. In CI (the environment sets CI, as .ci/run and CI services do) a stale file fails
    and is left as it is: a commit without its regenerated file cannot land. (insta's and expect-test's way.)"""
    import os
    import warnings

    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        raise AssertionError(f"{path.name} is stale: run the tests outside CI, or {command}, and commit it")
    path.write_text(text, encoding="utf-8")
    warnings.warn(f"{path} was stale and is regenerated: commit it", stacklevel=2)
