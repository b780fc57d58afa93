"""The tiny family: a real StableDiffusion3Pipeline with a few million random weights, for CPUs and tests.

`build_tiny_pipeline` makes it from configs (no download: the tokenizers are built from a byte-level vocabulary
in memory) and `save_tiny_model` writes it with `save_pretrained`. Everything else then loads it from that
directory through the same SD3 adapter a real Stable Diffusion 3.5 checkpoint goes through.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TinySpec:
    """Sizes of the tiny model. The defaults give a ~2.3M-parameter transformer at 64 px (learns in minutes on CPU)."""

    layers: int = 4
    head_dim: int = 32
    heads: int = 4
    patch_size: int = 2
    latent_channels: int = 4
    vae_channels: tuple[int, ...] = (32, 32, 32)  # 3 blocks: 4× down-sampling
    clip_hidden: int = 32
    t5_hidden: int = 64  # ≥ the two CLIP hidden sizes together: the pipeline pads CLIP up to T5's width
    text_layers: int = 2
    max_sequence_length: int = 32  # text length dominates cost at toy sizes
    sample_size: int = 64  # default image size in pixels


TINY_PRESETS = {
    "base": TinySpec(),  # 2.3M-parameter transformer: the quickstart's model
    "small": TinySpec(layers=2, heads=2),  # 0.3M: fast enough for the test suite
}


def _byte_level_alphabet() -> list[str]:
    """The 256 printable stand-ins that byte-level BPE uses for the 256 byte values."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_tokenizers(spec: TinySpec):
    from transformers import CLIPTokenizer, T5Tokenizer

    alphabet = _byte_level_alphabet()
    clip_vocab = {c: i for i, c in enumerate(alphabet)}
    clip_vocab.update({c + "</w>": 256 + i for i, c in enumerate(alphabet)})
    clip_vocab["<|startoftext|>"] = 512
    clip_vocab["<|endoftext|>"] = 513
    clip = CLIPTokenizer(vocab=clip_vocab, merges=[], model_max_length=77)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(chr(c), -2.0) for c in range(ord(" ") + 1, ord("~") + 1)]
    pieces += [("▁" + chr(c), -1.5) for c in range(ord("a"), ord("z") + 1)]
    t5 = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=spec.max_sequence_length)
    return clip, t5


def build_seeded(build, spec, seed: int):
    """build(spec) with the global torch RNG seeded by `seed` inside a fork: module constructors draw from the
    global RNG, and creating a model (e.g. on a run's first start only) must not change the stream the rest of
    the run draws from. Every tiny family builds through this."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build(spec)


def tiny_clip_config(spec, vocab_size: int, bos: int, eos: int, **extra):
    """The tiny CLIP text encoder's config (SD3 adds a projection, FLUX.1 uses none)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=spec.clip_hidden,
        intermediate_size=spec.clip_hidden * 2,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=2,
        **extra,
        max_position_embeddings=77,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def tiny_t5(spec, vocab_size: int):
    """The tiny T5 text encoder (random weights from the global RNG)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=vocab_size,
            d_model=spec.t5_hidden,
            d_ff=spec.t5_hidden * 2,
            d_kv=16,
            num_layers=spec.text_layers,
            num_heads=2,
            relative_attention_num_buckets=8,
        )
    )


def tiny_autoencoder(spec, *, shift_factor: float, scaling_factor: float, **extra):
    """The tiny AutoencoderKL (SD3 and FLUX.1 differ only in their latent factors and quant convs)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(spec.vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(spec.vae_channels),
        block_out_channels=spec.vae_channels,
        layers_per_block=1,
        latent_channels=spec.latent_channels,
        norm_num_groups=8,
        sample_size=spec.sample_size,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
        **extra,
    )


def build_tiny_pipeline(spec: TinySpec = TinySpec(), seed: int = 0):
    """A StableDiffusion3Pipeline with random weights drawn from `seed`; the caller's global RNG is left as it was."""
    return build_seeded(_build_from_global_rng, spec, seed)


def _build_from_global_rng(spec: TinySpec):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    clip_tok, t5_tok = build_tokenizers(spec)
    vocab = len(clip_tok)

    def clip_encoder():
        return CLIPTextModelWithProjection(tiny_clip_config(spec, vocab, 512, 513, projection_dim=spec.clip_hidden))

    t5 = tiny_t5(spec, len(t5_tok))
    inner = spec.head_dim * spec.heads
    transformer = SD3Transformer2DModel(
        sample_size=spec.sample_size // 2 ** (len(spec.vae_channels) - 1),
        patch_size=spec.patch_size,
        in_channels=spec.latent_channels,
        out_channels=spec.latent_channels,
        num_layers=spec.layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads,
        joint_attention_dim=spec.t5_hidden,
        caption_projection_dim=inner,
        pooled_projection_dim=2 * spec.clip_hidden,
        pos_embed_max_size=32,
    )
    vae = tiny_autoencoder(spec, shift_factor=0.0, scaling_factor=1.0)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip_encoder(),
        tokenizer=clip_tok,
        text_encoder_2=clip_encoder(),
        tokenizer_2=clip_tok,
        text_encoder_3=t5,
        tokenizer_3=t5_tok,
    )


def save_tiny_model(directory: str | Path, spec: TinySpec = TinySpec(), seed: int = 0) -> Path:
    """Write the tiny model in diffusers format to `directory` and return it."""
    directory = Path(directory)
    pipe = build_tiny_pipeline(spec, seed)
    pipe.save_pretrained(directory)
    return directory
