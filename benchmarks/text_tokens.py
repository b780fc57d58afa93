"""What the text context costs the shipped ShapesWorld transformer: one forward of 16 rows at 96 text tokens (its
CLIP and T5 stand-ins padded to 48 each, as it runs), 48 and 24, with the same random inputs otherwise; one torch
thread, fp32, in one process, as times and ratios against the 96-token forward.

    python benchmarks/text_tokens.py [--rows 16] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from diffusers import SD3Transformer2DModel

    from diffusion_rl.models.tiny import save_tiny

    torch.set_num_threads(1)
    path = ROOT / "models/shapes"
    if not (path / "transformer").is_dir():
        save_tiny(path, "sd3", "shapes")
    model = SD3Transformer2DModel.from_pretrained(path / "transformer").eval()
    config, rows = model.config, args.rows
    side = config.sample_size
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, config.in_channels, side, side, generator=generator)
    pooled = torch.randn(rows, config.pooled_projection_dim, generator=generator)
    t = torch.rand(rows, generator=generator) * 1000
    print(f"load {os.getloadavg()[0]:.2f}; {rows} rows, {(side // config.patch_size) ** 2} image tokens")
    base = None
    for tokens in (96, 48, 24):
        text = torch.randn(rows, tokens, config.joint_attention_dim, generator=generator)
        with torch.no_grad():
            for repeat in range(3 + args.repeats):
                if repeat == 3:
                    start = time.perf_counter()
                model(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t)
        ms = (time.perf_counter() - start) / args.repeats * 1000
        base = base or ms
        print(f"{tokens:>3} text tokens: {ms:6.2f} ms per forward ({base / ms:.2f}× the 96-token forward's speed)")


if __name__ == "__main__":
    main()
