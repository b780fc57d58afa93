"""Which sampler steps are stochastic: a contiguous window of SDE steps; every other step is a plain ODE step.

Only the window's steps draw noise and carry a log-prob, so only they are trained. A short window that moves
from one training step to the next (as in Flow-GRPO's windowed / "fast" variants) cuts the training cost; the
default window makes every step but the last stochastic.
"""

from dataclasses import dataclass

import torch

from diffusion_rl.config.plugins import STEP_TYPES
from diffusion_rl.utils.seeding import make_generator

_WINDOW_STREAM = "sde_window"  # names the random stream, so it differs from others drawn from (seed, step)


@dataclass(frozen=True)
class SdeWindow:
    """Steps start, ..., start + size - 1 are SDE steps."""

    start: int  # index of the first SDE step (0 = the step from pure noise)
    size: int  # number of consecutive SDE steps

    def __post_init__(self):
        if self.start < 0:
            raise ValueError(f"SdeWindow.start must be >= 0, got {self.start}")
        if self.size < 1:
            raise ValueError(f"SdeWindow.size must be >= 1, got {self.size}")

    @property
    def steps(self) -> range:
        return range(self.start, self.start + self.size)

    def contains(self, step: int) -> bool:
        return self.start <= step < self.start + self.size


def default_window(num_steps: int) -> SdeWindow:
    """Every step but the last is SDE.

    The last step is ODE so the final image carries no injected noise. (flow_grpo draws that step with the SDE too
    but never trains on it; making it deterministic gives a cleaner image for the reward at no cost.)
    """
    if num_steps < 2:
        raise ValueError(
            f"the default SDE window needs num_steps >= 2 (one SDE step + a final ODE step), got {num_steps}"
        )
    return SdeWindow(start=0, size=num_steps - 1)


def random_window(num_steps: int, size: int, lo: int, hi: int, generator: torch.Generator) -> SdeWindow:
    """A window of `size` steps inside [lo, hi); its start is uniform over the integers lo, ..., hi - size."""
    if size < 1:
        raise ValueError(f"the SDE window size must be >= 1, got {size}")
    if lo < 0:
        raise ValueError(f"the SDE window range must start at step >= 0, got lo={lo}")
    if hi > num_steps:
        raise ValueError(f"the SDE window range must end at or before num_steps={num_steps}, got hi={hi}")
    if lo > hi - size:
        raise ValueError(
            f"an SDE window of size {size} does not fit in steps [lo, hi)=[{lo}, {hi}): need hi - lo >= size"
        )
    start = int(torch.randint(lo, hi - size + 1, (1,), generator=generator).item())
    return SdeWindow(start=start, size=size)


def window_generator(seed: int, step: int) -> torch.Generator:
    """The generator for the window drawn at training step `step` of a run seeded with `seed`.

    Seeded from a hash of (seed, step, "sde_window"), so every worker draws the same window at a given step,
    however the batch is split, and a resumed run draws the same windows as a straight one.
    """
    return make_generator(seed, step, _WINDOW_STREAM)


def step_types(num_steps: int, window: SdeWindow | None, sde_type: str) -> list[str]:
    """The step type name of each of the `num_steps` steps: `sde_type` inside the window, "ode" outside it.

    window None means no SDE step (e.g. for evaluation).
    """
    STEP_TYPES.get(sde_type)  # unknown names fail here, with the list of valid ones
    if window is not None and window.start + window.size > num_steps:
        raise ValueError(
            f"SDE window steps {window.start}..{window.start + window.size - 1} go past the last step "
            f"{num_steps - 1} (num_steps={num_steps})"
        )
    return [sde_type if window is not None and window.contains(j) else "ode" for j in range(num_steps)]


def sliding_window(
    step: int,
    num_steps: int,
    size: int,
    *,
    iters_per_window: int,
    stride: int,
    strategy: str,
    generator: torch.Generator | None = None,
) -> SdeWindow:
    """MixGRPO's sliding window of `size` steps inside [0, num_steps − 2): the SDE part moves along the trajectory.

    `progressive`: the start s begins at 0, stays for `iters_per_window` training steps, then s += `stride`;
    once s would pass max_start = num_steps − 2 − size it returns to 0. `random`: s is uniform over
    [0, max_start] at every training step (from `generator`). A pure function of `step`, so a resumed run
    continues exactly where it left. (MixGRPO's code truncates windows near the end; ours always hold `size`.)
    """
    max_start = num_steps - 2 - size
    if size < 1 or max_start < 0:
        raise ValueError(
            f"a sliding SDE window of size {size} needs num_steps ≥ size + 2 (it stays inside "
            f"[0, num_steps − 2)); got num_steps={num_steps}"
        )
    if iters_per_window < 1 or stride < 1:
        raise ValueError(f"iters_per_window and stride must be ≥ 1, got {iters_per_window} and {stride}")
    if strategy == "progressive":
        positions = max_start // stride + 1  # 0, stride, 2·stride, … ≤ max_start
        return SdeWindow(start=stride * ((step // iters_per_window) % positions), size=size)
    if strategy == "random":
        if generator is None:
            raise ValueError("the random sliding-window strategy needs a generator")
        return SdeWindow(start=int(torch.randint(0, max_start + 1, (1,), generator=generator).item()), size=size)
    raise ValueError(f"unknown sliding-window strategy '{strategy}'; use progressive or random")


def window_for_step(sampling, seed: int, step: int) -> SdeWindow | None:
    """The SDE window of training step `step` under the `sampling` config section: a pure function of (config,
    seed, step), so a resumed run and every worker draw the same one. None for `sde_type: ode` (no SDE step)."""
    if sampling.sde_type == "ode":
        return None
    w = sampling.window
    generator = window_generator(seed, step)
    if w.kind == "random":
        hi = sampling.num_steps - 1 if w.hi is None else w.hi
        return random_window(sampling.num_steps, w.size, w.lo, hi, generator)
    if w.kind == "sliding":
        return sliding_window(
            step,
            sampling.num_steps,
            w.size,
            iters_per_window=w.iters_per_window,
            stride=w.stride,
            strategy=w.strategy,
            generator=generator,
        )
    return default_window(sampling.num_steps)
