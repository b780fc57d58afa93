"""Real-size models with random weights for the GPU check, and the one place it reaches into the engine.

A model is the family's diffusers pipeline with the transformer and the VAE built from an architecture's configs
(diffusion_rl/assets/architectures: the public configs of the checkpoints the ready configs train; in the dry run a
tiny preset's), born on the run's device in the run's dtype with random weights (never on the CPU in fp32 first:
FLUX.1-dev's 12B would need 48 GB of host memory for nothing), and without text encoders: `RandomTexts` stands in
for the prompt-embedding cache, handing each text random embeddings of the shapes the real encoders give (the
family adapter's `text_shapes`). The scheduler, the tokenizers and the pipeline's own settings come from the family's
tiny pipeline at a preset shaped like the checkpoint (the tiny builders carry the real checkpoints' scheduler
configs; Wan 2.2 TI2V's `ti2v` preset its flow shift and per-token timesteps). `model_of_pipeline`
(models/loader.py) turns it into the FlowModel a run trains, as `load_model` does for a directory.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import sys
from collections.abc import Iterator

import torch

from diffusion_rl.estimate.architectures import Architecture
from diffusion_rl.estimate.counting import in_dtype
from diffusion_rl.models.base import FlowModel
from diffusion_rl.models.loader import model_of_pipeline, resolve_device
from diffusion_rl.models.registry import family_named
from diffusion_rl.models.tiny import build_tiny
from diffusion_rl.utils.dtypes import DTYPES

TINY_PRESET = "small"  # the tiny pipeline that lends its scheduler, tokenizers and settings (and the dry run's sizes)


class RandomTexts:
    """Stands in for the prompt-embedding cache (models/embedding_cache.py: `lookup` is what a model calls): each
    text's embeddings are random, of the real encoders' shapes, drawn from a generator seeded by the text, so a text
    gets the same ones every time. A mask marks the first `prompt_tokens` tokens valid."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, prompt_tokens: int):
        self.shapes, self.dtype, self.prompt_tokens = shapes, dtype, prompt_tokens

    def embed(self, text: str) -> dict[str, torch.Tensor]:
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") % 2**63
        generator = torch.Generator().manual_seed(seed)
        out = {}
        for name, shape in self.shapes.items():
            if name.endswith("_mask"):
                out[name] = torch.arange(shape[0]) < self.prompt_tokens
            else:
                out[name] = torch.randn(shape, generator=generator).to(self.dtype)
        return out

    def lookup(self, texts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        rows = [self.embed(t) for t in texts]
        return {name: torch.stack([row[name] for row in rows]).to(device) for name in self.shapes}


def transformer_params(arch: Architecture) -> int:
    """The transformer's parameter count, from a build on the meta device (no memory)."""
    from diffusion_rl.estimate.counting import build_on_meta

    return sum(p.numel() for p in build_on_meta(arch.transformer_class, arch.transformer_config).parameters())


def _born(class_name: str, config: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A diffusers module built directly on `device` in `dtype`, random weights (its constructors' own init)."""
    import diffusers

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            module = getattr(diffusers, class_name).from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return in_dtype(module, dtype)  # what from_pretrained(dtype=…) keeps in fp32 (Wan: rope, norms, time embedding)


@functools.cache
def lender(family: str, preset: str = TINY_PRESET):
    """The family's tiny pipeline at `preset`, built once per process (a forked part finds the parent's): it lends
    only its scheduler (read for its config: a model samples with fresh ones), tokenizers and settings."""
    return build_tiny(family, preset)


def random_pipeline(arch: Architecture, device: torch.device, dtype: torch.dtype, seed: int = 0,
                    preset: str = TINY_PRESET):  # fmt: skip
    """The family's diffusers pipeline: transformer and VAE of `arch` with random weights on `device`, no text
    encoders; scheduler, tokenizers and pipeline settings from the family's tiny pipeline at `preset`."""
    tiny = lender(arch.family, preset)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        components = dict(tiny.components)
        for name in ("transformer", "transformer_2")[: arch.experts]:  # Wan 2.2 A14B: two experts, one config
            components[name] = _born(arch.transformer_class, arch.transformer_config, device, dtype)
        components["vae"] = _born(arch.vae_class, arch.vae_config, device, dtype)
    for name in components:
        if name.startswith("text_encoder"):
            components[name] = None
    settings = {k: v for k, v in tiny.config.items() if not k.startswith("_") and k not in components}
    return type(tiny)(**components, **settings)


def random_model(arch: Architecture, model_cfg, prompt_tokens: int = 64, seed: int = 0,
                 preset: str = TINY_PRESET) -> FlowModel:  # fmt: skip
    """The FlowModel a run of `model_cfg` trains, on `arch` with random weights and random text embeddings (the
    pipeline's settings from the tiny `preset`)."""
    device, dtype = resolve_device(model_cfg.device), DTYPES[model_cfg.dtype]
    pipeline = random_pipeline(arch, device, dtype, seed, preset)
    family = family_named(arch.family)
    model = model_of_pipeline(pipeline, family, model_cfg, device, dtype, f"random {arch.name}")
    shapes = family.adapter.text_shapes(arch, model_cfg.max_sequence_length, prompt_tokens)
    model.embedding_cache = RandomTexts(shapes, dtype, prompt_tokens)
    return model


# -- the coupling with the engine: the only code here that knows how a trainer gets its model and its engine ---------
@contextlib.contextmanager
def replaced(original, replacement) -> Iterator[None]:
    """Within the block, every loaded diffusion_rl module that imported `original` by name sees `replacement`."""
    holders = [m for name, m in list(sys.modules.items()) if name.startswith("diffusion_rl") and m is not None
               and any(v is original for v in vars(m).values())]  # fmt: skip
    names = [(m, k) for m in holders for k, v in list(vars(m).items()) if v is original]
    for module, key in names:
        setattr(module, key, replacement)
    try:
        yield
    finally:
        for module, key in names:
            setattr(module, key, original)


def trainer_with(cfg, model: FlowModel, engine_factory=None):
    """The trainer a user's `diffusion-rl train` builds for `cfg` (engine, algorithm, rewards, data), whose worker
    takes `model` instead of loading one from model.path; `engine_factory(engine, spec)`: another engine (FSDP2
    part)."""
    import diffusion_rl.engine as engine
    from diffusion_rl.models import loader
    from diffusion_rl.trainer import make_trainer

    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced(loader.load_model, lambda *args, **kwargs: model))
        if engine_factory is not None:
            stack.enter_context(replaced(engine.make_engine, engine_factory))
        return make_trainer(cfg)


def one_rank_engine(engine, spec, init_method: str):
    """The Ray engine's trainer (engine/sharded_worker.py: `ShardedWorker.setup` joins the process group and makes
    the PolicyWorker with its transformer sharded by FSDP2) at world size 1 in this process, without Ray: the
    worker is the engine, as on the local engine; its `update` skips the Ray object references a world of one has
    none of."""
    from diffusion_rl.engine.sharded_worker import ShardedWorker
    from diffusion_rl.engine.worker import PolicyWorker

    class OneRank(ShardedWorker):
        def update(self, targets, step, plan=None):
            return PolicyWorker.update(self, targets, step, plan)

    rank = OneRank(0, 1, torch.get_num_threads())
    rank.setup(spec, engine, init_method)
    return rank
