"""Decay schedules for the slowly-updated adapters of the preference losses.

After each completed trainer step the caller applies target <- d * target + (1 - d) * policy
(PolicySet.ema_update(target=..., decay=d)); d = 0 copies the policy.
"""

OLD_DECAY_KINDS: dict[str, tuple[int, float, float]] = {
    # kind: (flat steps w, rate per step, cap); d(step) = 0 if step < w else min((step - w) * rate, cap)
    "copy": (0, 0.0, 0.0),
    "linear_to_0_5": (0, 0.001, 0.5),
    "delayed_linear_to_0_999": (75, 0.0075, 0.999),
}

AWM_EMA_RATE = 0.001
AWM_EMA_CAP = 0.3


def old_decay(step: int, kind: str, fixed: float | None = None) -> float:
    """DiffusionNFT's decay d of the "old" adapter after `step` completed trainer steps.

    kind is one of OLD_DECAY_KINDS, or "fixed" with `fixed` the constant d in [0, 1]. DiffusionNFT's reference
    recipes use "delayed_linear_to_0_999": the old adapter tracks the policy exactly for the first 75 steps,
    then lags more and more (d = 0.1875 at step 100, 0.9375 at step 200, 0.999 from step 209 on).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if kind == "fixed":
        if fixed is None or not 0.0 <= fixed <= 1.0:
            raise ValueError(f"old decay kind 'fixed' needs a constant decay in [0, 1]; got {fixed}")
        return float(fixed)
    if fixed is not None:
        raise ValueError(f"a fixed old decay ({fixed}) only goes with kind 'fixed', not '{kind}'")
    if kind not in OLD_DECAY_KINDS:
        raise ValueError(f"unknown old decay kind '{kind}'; known: {', '.join([*OLD_DECAY_KINDS, 'fixed'])}")
    flat, rate, cap = OLD_DECAY_KINDS[kind]
    return 0.0 if step < flat else min((step - flat) * rate, cap)


def ema_decay_awm(step: int) -> float:
    """AWM's decay of the EMA adapter its ema_beta term pulls toward: min(0.3, 0.001 * step)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return min(AWM_EMA_CAP, AWM_EMA_RATE * step)
