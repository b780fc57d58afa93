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


def euler_on(sigmas):
    """diffusers' flow-matching Euler scheduler stepping on the σ points `sigmas` (σ_0 … σ_{N−1}, 0) whatever step count
    a pipeline asks for: FlowMatchEulerDiscreteScheduler at shift 1 (no shift) given them as `sigmas=`, as WanPipeline
    calls set_timesteps(N) without. A pipeline with it runs our sampler's Euler steps on the points we give."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    points = [float(s) for s in sigmas]
    if points[-1] != 0.0:
        raise ValueError(f"the σ points must end at 0, got {points[-1]}")

    class EulerOnPoints(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, **_):
            if num_inference_steps not in (None, len(points) - 1):
                raise ValueError(f"{num_inference_steps} steps asked of {len(points) - 1} σ points")
            super().set_timesteps(len(points) - 1, device=device, sigmas=points[:-1])

    return EulerOnPoints(num_train_timesteps=1000, shift=1.0)
