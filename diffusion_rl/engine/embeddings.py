"""The run's prompt-embedding cache (model.embedding_cache; models/embedding_cache.py): which texts a run encodes,
and where its cache lives. Every worker that loads the model (PolicyWorker, the Ray trainers and rollout actors)
attaches the same cache this way, and `diffusion-rl prepare embeddings` fills it up front."""

from __future__ import annotations

from pathlib import Path

from diffusion_rl.data.prompts import load_prompts
from diffusion_rl.models.embedding_cache import EmbeddingCache, use_embedding_cache

AUTO_FOLDER = "embedding_cache"  # model.embedding_cache=auto: <run.dir>/embedding_cache/


def cache_location(cfg) -> Path | None:
    """Where the config's cache lives (a folder, or a *.safetensors file); None when it has none."""
    where = cfg.model.embedding_cache
    if where is None:
        return None
    return Path(cfg.run.dir) / AUTO_FOLDER if where == "auto" else Path(where).expanduser()


def run_texts(cfg) -> list[str]:
    """Every text a run of `cfg` encodes, each once: its training prompts (data.train, or the pairs of
    data.pairs) and validation prompts (val.prompts, when something scores them), and their negative prompts (a
    missing one is the empty text, as the sampler gives it)."""
    if cfg.data.sample_source == "offline":
        from diffusion_rl.data.pairs import load_pairs

        records = [(p.prompt, p.negative_prompt) for p in load_pairs(cfg.data.pairs)]
    else:
        records = [(r.prompt, r.negative_prompt) for r in load_prompts(cfg.data.train)]
    if cfg.val.prompts and (cfg.rewards or cfg.val.rewards):  # the trainer's rule for loading them
        records += [(r.prompt, r.negative_prompt) for r in load_prompts(cfg.val.prompts)]
    return list(dict.fromkeys(text for prompt, negative in records for text in (prompt, negative or "")))


def attach_embedding_cache(model, cfg) -> EmbeddingCache | None:
    """Give `model` the config's cache, filled with every text of the run, and release its text encoders; nothing
    when model.embedding_cache is null."""
    location = cache_location(cfg)
    if location is None:
        return None
    return use_embedding_cache(model, model.directory, location, run_texts(cfg))  # a Hub id: its snapshot
