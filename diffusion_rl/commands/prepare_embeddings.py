"""`diffusion-rl prepare embeddings`: the config's prompt-embedding cache, filled up front.

Every distinct prompt and negative prompt a run of CONFIG encodes (data.train or data.pairs, val.prompts) goes
through the model's text encoders once and into model.embedding_cache (a folder, auto = <run.dir>/embedding_cache/,
or --out FILE.safetensors to name the file, which a run then reads with model.embedding_cache=FILE). A training run
with a complete cache never loads the text encoders (docs/models.md).
"""

from __future__ import annotations

import logging

from diffusion_rl.commands import prepare_subparsers
from diffusion_rl.errors import UserError

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = prepare_subparsers(subparsers).add_parser(
        "embeddings",
        help="the prompt-embedding cache of a config: every prompt through the text encoders once",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("config", help="YAML config: model, data.train (or data.pairs), val.prompts")
    p.add_argument(
        "--out", default=None, help="the cache file (*.safetensors) to write (default: model.embedding_cache, or auto)"
    )
    p.add_argument("overrides", nargs="*", default=[], help="optional dotted key=value config overrides")
    p.set_defaults(fn=cmd_prepare_embeddings)


def cmd_prepare_embeddings(args) -> None:
    from diffusion_rl.config import load

    cfg = load(args.config, args.overrides)
    cache = prepare_embeddings(cfg, args.out)
    logger.info("prompt-embedding cache: %d texts in %s", len(cache), cache.path)


def prepare_embeddings(cfg, out: str | None = None):
    """Fill (or complete) the config's cache (model.embedding_cache, auto when null) and write it; returns it.
    `out`: a *.safetensors file to write instead."""
    import dataclasses

    from diffusion_rl.models.embedding_cache import SUFFIX, open_cache
    from diffusion_rl.models.loader import load_model
    from diffusion_rl.trainer.setup import cache_location, load_run_prompts
    from diffusion_rl.trainer.trainer import ensure_model

    if out is not None and not out.endswith(SUFFIX):
        raise UserError(f"--out names the cache file: a path ending in {SUFFIX}, got {out}")
    if out is None and cfg.model.embedding_cache is None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, embedding_cache="auto"))
    location = out or cache_location(cfg)
    texts = load_run_prompts(cfg).texts()
    ensure_model(cfg)
    model = load_model(cfg.model)
    cache = open_cache(model, model.directory, location, writing=True)
    added = cache.fill(texts, model.encode_texts)
    cache.save()
    logger.info("encoded %d of %d texts (the others were cached)", added, len(texts))
    return cache
