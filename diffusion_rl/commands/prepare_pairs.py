"""`diffusion-rl prepare pairs`: an offline Diffusion-DPO pair dataset sampled from the config's model.

Each prompt of data.train is sampled n times (the config's sampling settings; seeded by run.seed, prompt and
sample), scored with the config's rewards, and its best and worst samples become one pair, by the same rules as
online DPO (chosen: the highest reward, earliest on ties; rejected: the lowest, latest on ties; prompts whose
samples all tie or fail are skipped). Writes OUT/images/*.png and OUT/pairs.jsonl (paths relative to it), ready
for `data.sample_source: offline` with `data.pairs: OUT/pairs.jsonl`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from diffusion_rl.commands import prepare_subparsers
from diffusion_rl.errors import UserError

logger = logging.getLogger(__name__)

PAIRS_FILE = "pairs.jsonl"


def register(subparsers) -> None:
    p = prepare_subparsers(subparsers).add_parser(
        "pairs",
        help="offline DPO pairs: sample the config's model n times per prompt, keep the best and worst by reward",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--config", required=True, help="YAML config: model, sampling, data.train prompts and rewards")
    p.add_argument("--out", required=True, help="output directory (images/ and pairs.jsonl)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (≥ 2)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts of data.train")
    p.add_argument("overrides", nargs="*", default=[], help="optional dotted key=value config overrides")
    p.set_defaults(fn=cmd_prepare_pairs)


def cmd_prepare_pairs(args) -> None:
    from diffusion_rl.config import load

    if args.n < 2:
        raise UserError(f"--n must be ≥ 2 (a pair needs a best and a worst sample), got {args.n}")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be ≥ 1, got {args.limit}")
    out = Path(args.out)
    if (out / PAIRS_FILE).exists():
        raise UserError(f"{out / PAIRS_FILE} exists; choose another --out or remove it")
    cfg = load(args.config, args.overrides)
    if not cfg.rewards:
        raise UserError(f"{args.config}: prepare pairs scores samples with the config's rewards; it has none")
    written, skipped = prepare_pairs(cfg, out, args.n, args.limit)
    logger.info("wrote %d pairs to %s (%d prompts skipped: all samples tied or failed)", written, out, skipped)


def prepare_pairs(cfg, out: Path, n: int, limit: int | None = None) -> tuple[int, int]:
    """Sample, score and write the pairs; returns (pairs written, prompts skipped)."""
    import numpy as np
    import torch
    from PIL import Image

    from diffusion_rl.algorithms.preference.dpo import online_pairs
    from diffusion_rl.data.pairs import PreferencePair, write_pairs
    from diffusion_rl.data.prompts import load_prompts
    from diffusion_rl.models.loader import load_model
    from diffusion_rl.sampling.rollout import SamplerSettings, sample_images
    from diffusion_rl.sampling.window import default_window
    from diffusion_rl.trainer.trainer import build_rewards, ensure_model
    from diffusion_rl.utils.seeding import seed_for

    records = load_prompts(cfg.data.train)[:limit]
    rewards = build_rewards(cfg)
    ensure_model(cfg)
    model = load_model(cfg.model)
    s = cfg.sampling
    model.check_low_noise_guidance(s.guidance_low_noise, "sampling.guidance_low_noise")
    settings = SamplerSettings.of(s)
    window = None if s.sde_type == "ode" else default_window(s.num_steps)
    images_dir = out / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    per_chunk = max(1, cfg.train.micro_batch_size // n)  # prompts sampled together
    pairs, skipped = [], 0
    for start in range(0, len(records), per_chunk):
        chunk = records[start : start + per_chunk]
        instances = [(start + i, r, j) for i, r in enumerate(chunk) for j in range(n)]
        seeds = [seed_for(cfg.run.seed, "prepare_pairs", i, j) for i, _, j in instances]
        prompts, negative = [r.prompt for _, r, _ in instances], [r.negative_prompt for _, r, _ in instances]
        images = sample_images(model, prompts, negative, settings, init_seeds=seeds, window=window).numpy()
        metadata = [r.reward_metadata() for _, r, _ in instances]
        scored = rewards(images, [r.prompt for _, r, _ in instances], metadata)
        groups = torch.tensor([i for i, _, _ in instances])
        chosen = online_pairs(torch.from_numpy(np.asarray(scored.total, dtype=np.float64)), groups)
        skipped += int(chosen.metrics["pairs/skipped_groups"])
        for w, lo in zip(chosen.chosen.tolist(), chosen.rejected.tolist()):
            index, record, _ = instances[w]
            paths = images_dir / f"{index:05d}_chosen.png", images_dir / f"{index:05d}_rejected.png"
            Image.fromarray(images[w]).save(paths[0])
            Image.fromarray(images[lo]).save(paths[1])
            pairs.append(
                PreferencePair(
                    record.prompt,
                    paths[0],
                    paths[1],
                    record.negative_prompt,
                    float(scored.total[w]),
                    float(scored.total[lo]),
                )
            )
    if not pairs:
        raise UserError(f"no pairs: every prompt's {n} samples tied or failed under the rewards; raise --n")
    write_pairs(pairs, out / PAIRS_FILE)
    return len(pairs), skipped
