"""The combiner of a config's reward entries (`rewards:` or `val.rewards:`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS, RewardFn, check_reward_kwargs
from diffusion_rl.rewards.combine import RewardCombiner, WeightedReward
from diffusion_rl.rewards.user_fn import is_user_function_spec


def console_rewards(specs: Sequence[Any]) -> list[tuple[str, str]]:
    """(metric key, label) of the training rewards a console line shows: the weighted total — unless every weighted
    reward is relative to its group (a rank or a win rate averages the same every step), then the rewards of weight 0
    scored beside it (e.g. the absolute score a judge stands in for), or none."""

    def relative(spec) -> bool:
        return not is_user_function_spec(spec.name) and getattr(REWARDS.get(spec.name), "relative", False)

    weighted = [s for s in specs if s.weight > 0]
    if weighted and all(relative(s) for s in weighted):
        return [(f"reward/{s.metric_name}/mean", s.metric_name) for s in specs if s.weight == 0 and not relative(s)]
    return [("reward/mean", "reward")]


def build_combiner(specs: Sequence[Any], make_fn: Callable[[Any], RewardFn], where: str = "rewards") -> RewardCombiner:
    """A RewardCombiner of the entries (config RewardSpecs), each keyed by its label (else its name) and built by
    `make_fn(spec)` (in this process, or in Ray actors); an image reward scores videos frame by frame, its frame
    scores reduced as the entry's `frames` says (WeightedReward.scorer_of). Every entry's kwargs are checked before
    any is built."""
    for i, spec in enumerate(specs):
        group = not is_user_function_spec(spec.name) and getattr(REWARDS.get(spec.name), "group", False)
        if group and spec.actors:
            raise UserError(
                f"{where}.{i}: '{spec.name}' is a group reward and runs in the trainer process (it sees whole groups); "
                "set actors: 0, and give the reward it wraps its own server (`remote`) if it is heavy"
            )
        check_reward_kwargs(spec.name, spec.kwargs)  # every entry's, before the first builds (loads a model, actors)
    rewards = [WeightedReward(s.metric_name, s.weight, make_fn(s), s.required, s.timeout_s, s.frames) for s in specs]
    return RewardCombiner(rewards)
