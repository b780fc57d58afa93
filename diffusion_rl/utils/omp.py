"""OpenMP's wait policy: idle threads spin where the cores are free, and sleep where they are shared (issue 26 item 12).

An idle OpenMP thread of torch (libgomp) spins about 300,000 iterations (a few ms) waiting for the next parallel region
before it sleeps. Alone that is fastest: OMP_WAIT_POLICY=PASSIVE (sleep at once) made the quickstart 15–40 % slower on
a quiet machine. But torch processes on the same cores spin-wait each other: beside the test suite, 62.7 s per
quickstart step with the spinning against 5.0 with PASSIVE (benchmarks/RESULTS.md). So the policy follows the machine:

- the user's own OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME always win;
- `engine.omp_wait_policy` = passive or spin forces one (spin = OpenMP's own default, the variable unset; not
  OMP_WAIT_POLICY=ACTIVE, which spins for minutes);
- auto: this process spins unless other work keeps its CPUs busy at start (`busy_cpus`), and the processes a run
  starts beside its own torch processes (Ray trainers, rollout and reward actors) sleep (`child_env`).

libgomp reads the variables once, when torch loads it, so the CLI decides before it imports torch (`decide`, `apply`);
a config loaded later can only reach the processes the run starts (`check_effective` says so when it asked for more).
Stdlib only: this module is imported before torch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

CHOICES = ("auto", "passive", "spin")
USER_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # libgomp's, and LLVM/Intel libomp's (macOS)
SET_BY_US = "DIFFUSION_RL_OMP_SET"  # the variables this module set: a later decision does not take them as the user's
BUSY_CPUS = 0.5  # other work on this process's CPUs from which auto sleeps: one busy thread on a core we spin on
WINDOW_S = 0.2  # how long busy_cpus watches the CPUs (20 ticks of /proc/stat per CPU)
OVERRIDE = "engine.omp_wait_policy=spin spins anyway (docs/distributed.md); OMP_WAIT_POLICY in the environment wins"


@dataclass(frozen=True)
class Decision:
    policy: str  # "passive" (threads sleep at once) or "spin" (OpenMP's default)
    reason: str
    env: dict[str, str] = field(default_factory=dict)  # what to set in the environment (nothing: leave it)
    announce: bool = False  # auto chose to sleep: the (-v) line says how to choose otherwise


def user_setting(environ: Mapping[str, str]) -> dict[str, str]:
    """The wait-policy variables the user set (not those this module set)."""
    ours = set(environ.get(SET_BY_US, "").split(","))
    return {k: environ[k] for k in USER_VARS if k in environ and k not in ours}


def policy_of(variables: Mapping[str, str]) -> str:
    """What OpenMP does with these variables: passive (sleep at once) or spin (for a while, or for good)."""
    passive = variables.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
    no_wait = any(variables.get(k, "").strip() == "0" for k in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME"))
    return "passive" if passive or no_wait else "spin"


def decide(requested: str, environ: Mapping[str, str], busy: float | None, cpus: int) -> Decision:
    """The policy of this process: the user's variables, else `requested` (engine.omp_wait_policy), else (auto)
    passive when `busy` (CPUs' worth of other work on the `cpus` this process may use; None: unknown) ≥ BUSY_CPUS."""
    if requested not in CHOICES:
        raise ValueError(f"omp_wait_policy={requested!r}: choose one of {', '.join(CHOICES)}")
    user = user_setting(environ)
    if user:
        shown = " ".join(f"{k}={v}" for k, v in user.items())
        return Decision(policy_of(user), f"{shown} set in the environment")
    if requested == "passive":
        return Decision("passive", "engine.omp_wait_policy=passive", {"OMP_WAIT_POLICY": "PASSIVE"})
    if requested == "spin":
        return Decision("spin", "engine.omp_wait_policy=spin")
    if busy is None:
        return Decision("spin", "the load of this machine is unknown")
    if busy >= BUSY_CPUS:
        reason = f"{busy:.1f} of the {cpus} CPUs this process may use were busy with other work at start"
        return Decision("passive", reason, {"OMP_WAIT_POLICY": "PASSIVE"}, announce=True)
    return Decision("spin", f"{busy:.1f} of the {cpus} CPUs this process may use were busy at start")


def apply(decision: Decision, environ: MutableMapping[str, str] | None = None) -> None:
    """Set the decision's variables (before torch loads: libgomp reads them once) and remember they are ours."""
    environ = os.environ if environ is None else environ
    for key in environ.pop(SET_BY_US, "").split(","):  # an earlier decision's (a parent CLI's), not the user's
        if key in USER_VARS and key not in decision.env:
            environ.pop(key, None)
    environ.update(decision.env)
    if decision.env:
        environ[SET_BY_US] = ",".join(sorted(decision.env))


def describe(decision: Decision) -> str:
    if decision.policy == "passive":
        what = "idle OpenMP threads sleep at once (OMP_WAIT_POLICY=PASSIVE)"
    else:
        what = "idle OpenMP threads spin a few ms before they sleep (OpenMP's default)"
    return f"{what}: {decision.reason}" + (f"; {OVERRIDE}" if decision.announce else "")


def child_env(requested: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of a process a run starts beside its own torch processes on the same node (Ray trainers, rollout
    and reward actors): the user's own (forwarded, so that a joined cluster's workers see them too), else none for
    engine.omp_wait_policy=spin, else PASSIVE: they share cores by construction."""
    environ = os.environ if environ is None else environ
    user = user_setting(environ)
    if user:
        return user
    return {} if requested == "spin" else {"OMP_WAIT_POLICY": "PASSIVE"}


def check_effective(requested: str, environ: Mapping[str, str] | None = None) -> None:
    """Warn when a config asks for a policy this process cannot have any more: torch (and libgomp) loaded before the
    config was read (the library used from Python, or a config the CLI could not see at start)."""
    environ = os.environ if environ is None else environ
    now = policy_of({k: environ[k] for k in USER_VARS if k in environ})
    if requested != "auto" and requested != now and not user_setting(environ):
        logger.warning(
            "engine.omp_wait_policy=%s reaches only the processes this run starts: this one loaded OpenMP with %s "
            "threads before the config was read (the CLI reads the key from the config file and overrides on its "
            "command line; from Python, set OMP_WAIT_POLICY before torch is imported)",
            requested,
            "sleeping" if now == "passive" else "spinning",
        )


def _cpu_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) jiffies of `cpus` so far, from /proc/stat; None where it cannot be read."""
    try:
        with open("/proc/stat") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    return (busy, total) if total else None


def busy_cpus(window_s: float = WINDOW_S) -> tuple[float | None, int]:
    """(CPUs' worth of work other processes do on the CPUs this process may use, over `window_s` while this one
    sleeps; the number of those CPUs). Elsewhere than Linux: the 1-minute load average over the machine's share."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    before = _cpu_ticks(cpus)
    if before is None:
        try:
            return os.getloadavg()[0] * len(cpus) / (os.cpu_count() or len(cpus)), len(cpus)
        except OSError:
            return None, len(cpus)
    time.sleep(window_s)
    after = _cpu_ticks(cpus)
    if after is None or after[1] <= before[1]:
        return None, len(cpus)
    return len(cpus) * (after[0] - before[0]) / (after[1] - before[1]), len(cpus)
