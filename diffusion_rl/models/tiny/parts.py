"""What the tiny models of every family are built from: offline tokenizers, small text encoders and VAEs.

No file is downloaded: the tokenizers come from a byte-level vocabulary made in memory. Module constructors draw
their random weights from the global torch RNG, so every tiny model is built through `build_seeded`.
"""

from __future__ import annotations

import torch


def byte_level_alphabet() -> list[str]:
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


def build_tokenizers(max_sequence_length: int):
    from transformers import CLIPTokenizer, T5Tokenizer

    alphabet = byte_level_alphabet()
    clip_vocab = {c: i for i, c in enumerate(alphabet)}
    clip_vocab.update({c + "</w>": 256 + i for i, c in enumerate(alphabet)})
    clip_vocab["<|startoftext|>"] = 512
    clip_vocab["<|endoftext|>"] = 513
    clip = CLIPTokenizer(vocab=clip_vocab, merges=[], model_max_length=77)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(chr(c), -2.0) for c in range(ord(" ") + 1, ord("~") + 1)]
    pieces += [("▁" + chr(c), -1.5) for c in range(ord("a"), ord("z") + 1)]
    t5 = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_sequence_length)
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


def tiny_t5(spec, vocab_size: int, umt5: bool = False):
    """The tiny T5 text encoder (`umt5`: Wan's UMT5 of the same sizes; random weights from the global RNG)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    model, config = (UMT5EncoderModel, UMT5Config) if umt5 else (T5EncoderModel, T5Config)
    return model(
        config(
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
