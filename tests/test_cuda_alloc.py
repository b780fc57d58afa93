"""CUDA's allocator with expandable segments (utils/cuda_alloc.py): the CLI sets it before torch reads it, the Ray
actors a run starts inherit it, and the user's own variables always win."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_rl.utils import cuda_alloc

ROOT = Path(__file__).resolve().parents[1]
EXPANDABLE = "expandable_segments:True"
SPLIT, OFF = "max_split_size_mb:128", "expandable_segments:False"  # settings a user might have


@pytest.mark.parametrize(
    "environ, expandable, expected",
    [
        ({}, True, {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}),
        ({}, False, {}),
        ({"PYTORCH_CUDA_ALLOC_CONF": SPLIT}, True, {"PYTORCH_CUDA_ALLOC_CONF": SPLIT}),
        ({"PYTORCH_ALLOC_CONF": OFF}, True, {"PYTORCH_ALLOC_CONF": OFF}),
        # set by an earlier decision (a parent CLI's), not by the user: this one's config decides
        ({"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE, cuda_alloc.SET_BY_US: "1"}, False, {}),
    ],
)
def test_the_users_variables_win_else_the_setting_decides(environ, expandable, expected):
    assert cuda_alloc.child_env(expandable, dict(environ)) == expected
    process = dict(environ)
    assert cuda_alloc.apply(expandable, process) == expected
    assert {k: v for k, v in process.items() if k in cuda_alloc.USER_VARS} == expected
    assert cuda_alloc.user_setting(process) == {k: v for k, v in expected.items() if k in environ}


def _allocator_settings(args: list[str], environ: dict[str, str]) -> str:
    """What torch's allocator configuration reads in a fresh process after the CLI ran `args`."""
    probe = (f"from diffusion_rl.cli import main; main({args!r}); import torch; "
             "print('SETTINGS', repr(torch._C._accelerator_getAllocatorSettings()))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in (*cuda_alloc.USER_VARS, cuda_alloc.SET_BY_US)}
    env |= environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.rsplit("SETTINGS ", 1)[1].strip()


@pytest.mark.parametrize(
    "args, environ, settings",
    [
        (["config", "reference"], {}, repr(EXPANDABLE)),  # the default
        (["config", "reference", "engine.cuda_expandable_segments=false"], {}, "''"),
        (["config", "reference"], {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, "'max_split_size_mb:64'"),
    ],
)
def test_the_cli_sets_the_allocator_before_torch_reads_it(args, environ, settings):
    assert _allocator_settings(args, environ) == settings


def test_ray_actors_get_the_allocator_setting_with_the_openmp_policy(monkeypatch):
    from diffusion_rl.config.engine import EngineConfig
    from diffusion_rl.engine.ray_cluster import actor_env

    for key in (*cuda_alloc.USER_VARS, cuda_alloc.SET_BY_US, "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.delenv(key, raising=False)
    assert actor_env(EngineConfig()) == {"OMP_WAIT_POLICY": "PASSIVE", "PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}
    assert actor_env(EngineConfig(omp_wait_policy="spin", cuda_expandable_segments=False)) == {}
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.8")
    assert actor_env(EngineConfig())["PYTORCH_ALLOC_CONF"] == "garbage_collection_threshold:0.8"
