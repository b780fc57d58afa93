"""OpenMP's wait policy (utils/omp.py, issue 26 item 12): spin alone, sleep where torch processes share cores; the
user's variables win; the CLI decides before torch loads OpenMP, which reads the variables once."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_rl.cli import requested_engine
from diffusion_rl.utils import omp

ROOT = Path(__file__).resolve().parents[1]
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
SHOW = ["config", "show", str(ROOT / "configs/quickstart_flow_grpo.yaml")]

# requested, environment, busy CPUs (None: unknown), CPUs → policy, variables set, announced
DECISIONS = [
    ("auto", {}, 0.0, 2, "spin", {}, False),  # a quiet machine: OpenMP's default, cost 0 by construction
    ("auto", {}, 0.4, 2, "spin", {}, False),  # below half a CPU of other work
    ("auto", {}, 0.5, 2, "passive", PASSIVE, True),
    ("auto", {}, 1.9, 2, "passive", PASSIVE, True),  # another run on the cores
    ("auto", {}, 0.6, 64, "passive", PASSIVE, True),  # one busy thread on a core we would spin on
    ("auto", {}, None, 2, "spin", {}, False),  # load unknown (no /proc, no load average)
    ("passive", {}, 0.0, 2, "passive", PASSIVE, False),  # forced: no measurement needed
    ("spin", {}, 1.9, 2, "spin", {}, False),
    ("auto", {"OMP_WAIT_POLICY": "ACTIVE"}, 1.9, 2, "spin", {}, False),  # the user's own variables win
    ("passive", {"OMP_WAIT_POLICY": "active"}, 0.0, 2, "spin", {}, False),
    ("spin", {"OMP_WAIT_POLICY": "passive"}, 0.0, 2, "passive", {}, False),
    ("passive", {"GOMP_SPINCOUNT": "10000"}, 1.9, 2, "spin", {}, False),
    ("auto", {"GOMP_SPINCOUNT": "0"}, 0.0, 2, "passive", {}, False),
    ("spin", {"KMP_BLOCKTIME": "0"}, 0.0, 2, "passive", {}, False),  # LLVM's libomp (macOS)
    # a variable this module set earlier in the process (or its parent) is not the user's: decided again
    ("spin", {"OMP_WAIT_POLICY": "PASSIVE", omp.SET_BY_US: "OMP_WAIT_POLICY"}, 0.0, 2, "spin", {}, False),
    ("auto", {"OMP_WAIT_POLICY": "PASSIVE", omp.SET_BY_US: "OMP_WAIT_POLICY"}, 1.0, 2, "passive", PASSIVE, True),
]


@pytest.mark.parametrize("requested, environ, busy, cpus, policy, env, announce", DECISIONS)
def test_the_policy_follows_the_users_variables_then_the_config_then_the_load(
    requested, environ, busy, cpus, policy, env, announce
):
    decision = omp.decide(requested, environ, busy, cpus)
    assert (decision.policy, decision.env, decision.announce) == (policy, env, announce)


def test_the_announced_decision_says_why_and_how_to_choose_otherwise():
    text = omp.describe(omp.decide("auto", {}, 1.26, 2))
    assert "OMP_WAIT_POLICY=PASSIVE" in text and "1.3 of the 2 CPUs" in text
    assert "engine.omp_wait_policy=spin" in text and "OMP_WAIT_POLICY in the environment" in text


def test_apply_marks_what_it_set_so_a_later_decision_is_not_taken_for_the_users():
    environ: dict[str, str] = {}
    omp.apply(omp.decide("passive", environ, None, 2), environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE", omp.SET_BY_US: "OMP_WAIT_POLICY"}
    assert omp.user_setting(environ) == {}
    environ["GOMP_SPINCOUNT"] = "5"
    assert omp.user_setting(environ) == {"GOMP_SPINCOUNT": "5"}
    omp.apply(omp.decide("spin", {k: v for k, v in environ.items() if k != "GOMP_SPINCOUNT"}, None, 2), environ)
    assert environ == {"GOMP_SPINCOUNT": "5"}  # the earlier PASSIVE was ours: gone; the user's stays


# requested, environment → what a process the run starts beside its torch processes gets
CHILDREN = [
    ("auto", {}, PASSIVE),  # Ray trainers, rollout and reward actors share the node's cores by construction
    ("passive", {}, PASSIVE),
    ("spin", {}, {}),
    ("auto", {"GOMP_SPINCOUNT": "12345"}, {"GOMP_SPINCOUNT": "12345"}),  # forwarded: a joined cluster's too
    (
        "spin",
        {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"},
        {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"},
    ),
    ("auto", {"OMP_WAIT_POLICY": "PASSIVE", omp.SET_BY_US: "OMP_WAIT_POLICY"}, PASSIVE),  # the driver's auto choice
    ("spin", {"OMP_WAIT_POLICY": "PASSIVE", omp.SET_BY_US: "OMP_WAIT_POLICY"}, {}),
]


@pytest.mark.parametrize("requested, environ, expected", CHILDREN)
def test_processes_a_run_starts_beside_its_own_sleep_unless_told_otherwise(requested, environ, expected):
    assert omp.child_env(requested, environ) == expected


def test_a_forced_policy_the_process_can_no_longer_take_is_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="diffusion_rl.utils.omp"):
        omp.check_effective("auto", {})
        omp.check_effective("spin", {})
        omp.check_effective("passive", {"OMP_WAIT_POLICY": "PASSIVE"})
        omp.check_effective("passive", {"OMP_WAIT_POLICY": "ACTIVE"})  # the user's: theirs wins, nothing to say
        assert not caplog.records
        omp.check_effective("passive", {})
        omp.check_effective("spin", {"OMP_WAIT_POLICY": "PASSIVE", omp.SET_BY_US: "OMP_WAIT_POLICY"})
    assert len(caplog.records) == 2 and "reaches only the processes this run starts" in caplog.records[0].message


def test_busy_cpus_counts_the_cpus_this_process_may_use():
    busy, cpus = omp.busy_cpus(window_s=0.05)
    assert cpus == len(os.sched_getaffinity(0))
    assert busy is None or 0.0 <= busy <= cpus + 1e-9


def test_the_cli_reads_engine_settings_from_the_command_line_before_torch(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("engine:\n  omp_wait_policy: passive\n  cuda_expandable_segments: false\n")
    child = tmp_path / "run.yaml"
    child.write_text("base: base.yaml\ntrain:\n  lr: 1.0e-4\n")

    def policy(*argv):
        return requested_engine(list(argv)).get("omp_wait_policy")

    assert policy("train", str(child)) == "passive"  # through the base file
    assert policy("train", str(child), "engine.omp_wait_policy=spin") == "spin"  # the override wins
    assert requested_engine(["train", str(child)])["cuda_expandable_segments"] is False  # both keys from one read
    assert requested_engine(["train", "engine.cuda_expandable_segments=true"]) == {"cuda_expandable_segments": True}
    assert policy("config", "reference") is None  # unsaid: the CLI takes the default
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: [unclosed\n")
    assert policy("train", str(bad)) is None  # the command itself reports the file
    assert policy("train", "engine.omp_wait_policy=sometimes") == "sometimes"  # refused later, by the config's check


def _libgomp_spincount(args: list[str], environ: dict[str, str]) -> tuple[int, str]:
    """(the spin count libgomp read when the CLI imported torch, the CLI's -v log), in a fresh process."""
    probe = f"from diffusion_rl.cli import main; main({['-v', *args]!r})"
    env = {k: v for k, v in os.environ.items() if k not in (*omp.USER_VARS, omp.SET_BY_US)}
    env |= environ | {"PYTHONPATH": str(ROOT), "OMP_DISPLAY_ENV": "VERBOSE"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(re.search(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr).group(1)), done.stderr


@pytest.mark.parametrize(
    "args, environ, spincount",
    [
        ([*SHOW, "engine.omp_wait_policy=passive"], {}, 0),  # sleep at once
        ([*SHOW, "engine.omp_wait_policy=spin"], {}, 300_000),  # libgomp's default, not ACTIVE's 3e10 spins
        ([*SHOW, "engine.omp_wait_policy=passive"], {"GOMP_SPINCOUNT": "1234"}, 1234),  # the user's wins
    ],
)
def test_the_cli_sets_the_policy_before_torch_loads_openmp(args, environ, spincount):
    assert _libgomp_spincount(args, environ)[0] == spincount


def test_the_cli_logs_the_policy_libgomp_then_reads():
    """auto on whatever load this machine has now: the logged decision is the one OpenMP got."""
    spincount, log = _libgomp_spincount(["config", "reference"], {})
    decided = re.search(r"idle OpenMP threads (sleep at once|spin a few ms)", log)
    assert decided is not None, log[-2000:]
    assert (decided.group(1) == "sleep at once") == (spincount == 0)


def test_a_busy_machines_decision_is_no_line_before_the_commands_own():
    """auto chose to sleep (the load forced here): without -v the console's first line is the command's."""
    probe = ("import diffusion_rl.utils.omp as omp; omp.busy_cpus = lambda *a: (2.0, 2); "
             f"from diffusion_rl.cli import main; main({[*SHOW]!r})")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in (*omp.USER_VARS, omp.SET_BY_US)} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "OpenMP" not in done.stderr, done.stderr[-2000:]
    verbose = subprocess.run([sys.executable, "-c", probe.replace("main([", "main(['-v', ")], env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "idle OpenMP threads sleep at once" in verbose.stderr and "engine.omp_wait_policy=spin" in verbose.stderr
