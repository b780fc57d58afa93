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

import functools
import inspect
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


def _check_kwargs(name: str, factory: Callable[..., RewardFn], kwargs: dict[str, Any]) -> None:
    """A typo in a reward's kwargs is a UserError listing the accepted ones, not a TypeError deep in a factory."""
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
