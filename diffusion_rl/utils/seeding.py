"""Seeds derived from named parts, so every random draw can be replayed from (seed, step, sample index, ...).

A seed is a hash of its parts rather than e.g. `seed + step`, so that nearby part tuples ((1, 2) and (2, 1),
or (seed, step) and (seed + 1, step - 1)) give unrelated streams. The hash is blake2b, which is stable across
Python processes and versions (Python's own `hash` is salted per process for strings).
"""

import hashlib
import operator

import torch

_SEED_BITS = 63  # fits a signed int64, which is what torch.Generator.manual_seed accepts without wrapping


def _encode(part: int | str) -> bytes:
    # Each part carries a type tag and a terminator so that ("ab",) and ("a", "b"), or 1 and "1", differ.
    if isinstance(part, str):
        return b"s" + str(len(part)).encode() + b":" + part.encode() + b";"
    try:
        value = operator.index(part)  # accepts python, numpy and integer-tensor ints; rejects floats
    except TypeError:
        raise TypeError(f"seed parts must be ints or strings, got {type(part).__name__}: {part!r}") from None
    return b"i" + str(value).encode() + b";"


def seed_for(*parts: int | str) -> int:
    """A stable seed in [0, 2**63) from the given parts (ints, or strings naming a random stream)."""
    digest = hashlib.blake2b(b"".join(_encode(p) for p in parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << _SEED_BITS) - 1)


def make_generator(*parts: int | str) -> torch.Generator:
    """A CPU torch.Generator seeded with `seed_for(*parts)`."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed_for(*parts))
    return generator


def generator_of(seed: int | tuple, *more: int | str) -> torch.Generator:
    """The generator of a seed (an int, hashed again) or of a seed's parts (a tuple), extended by `more` parts (e.g.
    a tree node's depth and index)."""
    return make_generator(*(seed if isinstance(seed, tuple) else (seed,)), *more)
