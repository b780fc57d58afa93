"""The reward contract, the reward registry, and `make_reward` (built-in name or user function).

A reward is a callable

    reward(images, prompts, metadata) -> scores

- `images`: np.ndarray uint8 [B, H, W, 3] (RGB), or videos uint8 [B, F, H, W, 3] from a video model; a reward
  that scores whole videos has the attribute `video = True`, any other is applied frame by frame (rewards/video.py);
- `prompts`: list[str] of length B;
- `metadata`: list[dict] of length B (the dataset row's extra fields, e.g. "data_source"); for an edit, its
  "condition_images": the row's source images, each uint8 [H, W, 3] at the output size, as the model saw them;
- `scores`: float array [B] (float32 preferred; any float dtype is accepted and cast), NaN for a sample the
  reward could not score. A failed sample is counted and left out of training, never scored 0.

`REWARDS` holds factories: a function or class registered by name that takes the config's `kwargs` as keyword
arguments and returns the reward callable.

A *group reward* scores all the samples of one prompt together (a rank, a pairwise win rate): it has the attribute
`group = True` and a method

    reward.score_group(images_G, prompts_G, metadata_G) -> scores [G]

called once per group (the samples of one prompt in a training step; in validation, the `val.n` samples of one
prompt), with the same dtypes and NaN rule as above. The combiner never splits a group: with
`sampling.score_chunks > 1` the trainer scores group rewards on the whole batch after the last chunk.
"""

import contextlib
import functools
import inspect
import numbers
import os
import types
import typing
from collections.abc import Callable
from typing import Any

import numpy as np

from diffusion_rl.errors import RunStopped, UserError, did_you_mean
from diffusion_rl.registry import Registry
from diffusion_rl.rewards.user_fn import check_user_call, is_user_function_spec, load_user_function

RewardFn = Callable[[np.ndarray, list[str], list[dict[str, Any]]], Any]
REWARD_ARGUMENTS = ("images", "prompts", "metadata")  # how every scoring call calls a reward (and score_group)

REWARDS: Registry[Callable[..., RewardFn]] = Registry("reward", plugins=("diffusion_rl.rewards",))


def is_group_reward(fn: Any) -> bool:
    """Whether `fn` follows the group-reward form (`group = True` and a `score_group` method)."""
    return getattr(fn, "group", False) is True and callable(getattr(fn, "score_group", None))


class RewardOutputError(RunStopped):
    """A reward returned something that breaks the contract (wrong type, dtype or shape). A bug, not a failed sample:
    it stops the run (the CLI prints one line; a training run adds its last healthy checkpoint)."""


def make_reward(name: str, **kwargs: Any) -> RewardFn:
    """The reward callable for `name`.

    `name` is a registered reward ("jpeg_incompressibility"), or a user function "package.module:function" or
    "path/to/file.py:function". A user function is the reward callable itself; `kwargs` given for it are bound
    with functools.partial. A registered name's factory is called with `kwargs`.
    """
    if is_user_function_spec(name):
        fn = load_user_function(name)
        if is_group_reward(fn):  # an instance: its score_group is what is called, with no kwargs bound
            check_user_call(name, fn.score_group, REWARD_ARGUMENTS, {}, f"{name.rpartition(':')[2]}.score_group")
        else:
            check_user_call(name, fn, REWARD_ARGUMENTS, kwargs)
        return functools.partial(fn, **kwargs) if kwargs else fn
    factory = REWARDS.get(name)
    _check_kwargs(name, factory, kwargs)
    return factory(**kwargs)


def check_reward_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """make_reward's checks of a registered reward's kwargs, with nothing built: every entry of a config is checked
    before the first one loads a model (or starts its actors). A user function's are checked when it is loaded."""
    if not is_user_function_spec(name):
        _check_kwargs(name, REWARDS.get(name), kwargs)


def _check_kwargs(name: str, factory: Callable[..., RewardFn], kwargs: dict[str, Any]) -> None:
    """A typo in a reward's kwargs is a UserError listing the accepted ones, not a TypeError deep in a factory; so is
    a value of the wrong type for a parameter the factory declares int, float, bool or str (by annotation, else by
    its default)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins without a signature: let the call itself complain
        return
    params = signature.parameters.values()
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    accepted = ", ".join(p.name for p in named) or "none"
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    unknown = [] if takes_any else sorted(set(kwargs) - {p.name for p in named})
    if unknown:
        hints = "".join(did_you_mean(k, [p.name for p in named]) for k in unknown[:1])
        raise UserError(f"reward '{name}': unknown kwargs {', '.join(unknown)}{hints}; accepted: {accepted}")
    missing = [p.name for p in named if p.default is p.empty and p.name not in kwargs]
    if missing:
        raise UserError(
            f"reward '{name}' needs kwargs {', '.join(missing)} (in the config: kwargs: {{{missing[0]}: ...}}); "
            f"accepted: {accepted}"
        )
    try:
        signature.bind(**kwargs)
    except TypeError as e:  # anything the two checks above do not catch
        raise UserError(f"reward '{name}': kwargs {sorted(kwargs)} do not fit ({e}); accepted: {accepted}") from None
    with contextlib.suppress(Exception):  # the annotations as types, also under `from __future__ import annotations`
        signature = inspect.signature(factory, eval_str=True)
    for key, value in kwargs.items():
        p = signature.parameters.get(key)  # None: taken by **kwargs, left to the factory
        allowed = _declared_types(p) if p is not None else None
        if allowed is not None and not _fits(value, allowed):
            default = "" if p.default is p.empty else f" (default {p.default!r})"
            raise UserError(
                f"reward '{name}': kwargs {key}={value!r} must be {' or '.join(_TYPE_WORDS[t] for t in allowed)}"
                f"{default}"
            )


_TYPE_WORDS = {int: "an int", float: "a number", bool: "true or false", str: "a string", type(None): "null"}


def _declared_types(p: inspect.Parameter) -> tuple[type, ...] | None:
    """The scalar types (int, float, bool, str, None) a factory's parameter takes, or None when it declares no such
    type (Any, a list, a mapping, an annotation left a string): that value is left to the factory."""
    annotation = p.annotation
    if annotation is p.empty:
        default = p.default
        return (type(default),) if type(default) in _TYPE_WORDS and default is not None else None
    if annotation in _TYPE_WORDS:
        return (annotation,)
    if annotation is None:
        return (type(None),)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        parts = [_declared_types(p.replace(annotation=a)) for a in typing.get_args(annotation)]
        return None if any(t is None for t in parts) else tuple(t for ts in parts for t in ts)
    return None


def _fits(value: Any, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # not an int here: `retries: true` is a mistake
        return bool in allowed
    return (
        (int in allowed and isinstance(value, numbers.Integral))
        or (float in allowed and isinstance(value, numbers.Real))  # an int is a fine number
        or (str in allowed and isinstance(value, (str, os.PathLike)))  # a path from Python code
        or (value is None and type(None) in allowed)
    )


def check_reward_output(name: str, scores: Any, batch_size: int) -> np.ndarray:
    """`scores` as float32 [batch_size], or RewardOutputError naming the reward and what it returned."""
    if not isinstance(scores, (np.ndarray, list, tuple)):
        raise RewardOutputError(
            f"reward '{name}' returned {type(scores).__name__}; a reward must return a float np.ndarray of shape "
            f"[B] (NaN for a sample it failed on)"
        )
    array = np.asarray(scores)
    if not np.issubdtype(array.dtype, np.floating):
        raise RewardOutputError(
            f"reward '{name}' returned dtype {array.dtype}; a reward must return floats (float32), NaN for a "
            f"sample it failed on"
        )
    if array.shape != (batch_size,):
        raise RewardOutputError(
            f"reward '{name}' returned shape {array.shape} for a batch of {batch_size}; a reward must return one "
            f"score per image, shape ({batch_size},)"
        )
    return array.astype(np.float32, copy=False)


def check_reward_inputs(images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> int:
    """The batch size, after checking the inputs follow the contract (a caller bug otherwise: ValueError)."""
    ok = isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.ndim in (4, 5)
    if not ok or images.shape[-1] != 3:
        desc = f"{images.dtype} {images.shape}" if isinstance(images, np.ndarray) else type(images).__name__
        raise ValueError(f"reward images must be np.ndarray uint8 [B, H, W, 3] (videos [B, F, H, W, 3]); got {desc}")
    batch_size = images.shape[0]
    if len(prompts) != batch_size or len(metadata) != batch_size:
        raise ValueError(
            f"reward inputs disagree on the batch size: {batch_size} images, {len(prompts)} prompts, "
            f"{len(metadata)} metadata"
        )
    return batch_size
