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
