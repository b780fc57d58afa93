"""The Ray engine on CPU (gloo): the same numbers as the local engine, resharding resume, and failures that surface.

Ray starts once for the module; each test starts its own workers (a failure test leaves its engine stopped).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from diffusion_rl.algorithms.credit import Targets  # noqa: E402
from diffusion_rl.checkpoint.state import read_saved_tensors  # noqa: E402
from diffusion_rl.checkpoint.store import CheckpointManager  # noqa: E402
from diffusion_rl.data.sampler import make_step_prompts  # noqa: E402
from diffusion_rl.engine.ray import RayEngine  # noqa: E402
from diffusion_rl.engine.ray_cluster import WorkerDied  # noqa: E402
from diffusion_rl.engine.reward_actors import ActorReward, RewardActorDied  # noqa: E402
from diffusion_rl.engine.sharded_worker import WorkerError  # noqa: E402
from diffusion_rl.sampling.window import default_window  # noqa: E402
from diffusion_rl.trainer.setup import worker_spec  # noqa: E402
from diffusion_rl.trainer.trainer import Trainer  # noqa: E402
from tests.helpers import random_pair_file  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_session")


def test_two_workers_take_the_same_step_as_the_local_engine(
    make_config, tmp_path, run_trainer, rows_close, max_difference, ray_overrides, equal_overrides
):
    local, local_rows = run_trainer(
        make_config(*equal_overrides, "train.total_steps=1", f"run.dir={tmp_path / 'local'}")
    )
    # the Ray run also scores its reward in a reward actor of its own
    cfg = make_config(
        *equal_overrides, *ray_overrides, "engine.num_workers=2", "rewards.0.actors=1", "train.total_steps=1"
    )
    sharded, ray_rows = run_trainer(cfg)
    try:
        weights = sharded.engine.trainable_state_dict()
    finally:
        sharded.engine.close()

    assert isinstance(sharded.rewards.rewards[0].fn, ActorReward)
    # rollouts are per-sample seeded: the same images, so the same rewards and advantages, exactly
    for key in ("reward/mean", "reward/std", "advantage/abs_mean"):
        assert ray_rows[0][key] == local_rows[0][key], key
    rows_close(local_rows[0], ray_rows[0])  # loss, grad norm, …: up to float reduction order
    assert max_difference(local.engine.model.policies.trainable_state_dict(), weights) <= 1e-5


def test_resume_on_one_worker_continues_like_two(
    make_config, tmp_path, run_trainer, rows_close, max_difference, ray_overrides, equal_overrides
):
    options = (
        *equal_overrides,
        *ray_overrides,
        "model.lora.enabled=true",
        "train.ema.enabled=true",
        "train.warmup_steps=2",
    )
    # straight: 3 steps on 2 workers, with a checkpoint after step 2
    straight_cfg = make_config(*options, "engine.num_workers=2", "train.total_steps=3", "train.save_every=2")
    straight, straight_rows = run_trainer(straight_cfg)
    try:
        straight_weights = straight.engine.trainable_state_dict()
    finally:
        straight.engine.close()
    checkpoints = CheckpointManager(straight_cfg.run.dir)
    step2, step3 = (path for _, path in checkpoints.list())
    # the one checkpoint format: sharded in dcp/ (what resumes, on any engine), and the gathered LoRA export
    assert {"dcp", "adapter", "state.pt", "config.yaml"} <= {p.name for p in step2.iterdir()}
    # its manifest, written once both workers had written their shards, lists each worker's file
    listed = {line.split("  ", 1)[1] for line in (step2 / "manifest.sha256").read_text().splitlines()}
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata", "state.pt"} <= listed
    assert max_difference(read_saved_tensors(step3, "policies.default."), straight_weights) == 0.0
    adapter = load_file(step3 / "adapter" / "adapter_model.safetensors")  # the LoRA in peft format
    assert max_difference(adapter, straight_weights) == 0.0

    resumed_cfg = make_config(
        *options, "engine.num_workers=1", "train.total_steps=3", f"run.dir={tmp_path / 'one'}", f"run.resume={step2}"
    )
    resumed = Trainer(resumed_cfg)
    ran = []
    train_step = resumed.train_step
    resumed.train_step = lambda step: ran.append(step) or train_step(step)
    try:
        resumed_rows = resumed.train()
        resumed_weights = resumed.engine.trainable_state_dict()
    finally:
        resumed.engine.close()

    assert ran == [2]  # it continued from step 2, now on one worker (DCP resharded the 2-worker checkpoint)
    rows_close(straight_rows[-1], resumed_rows[-1])
    assert max_difference(straight_weights, resumed_weights) <= 1e-5


def test_a_local_checkpoint_resumes_on_two_workers_and_theirs_back_on_the_local_engine(
    make_config, tmp_path, run_trainer, max_difference, ray_overrides, equal_overrides
):
    options = (*equal_overrides, "train.save_every=1", "train.keep_last=0")
    straight, _ = run_trainer(make_config(*options, "train.total_steps=3", f"run.dir={tmp_path / 'straight'}"))
    mixed = f"run.dir={tmp_path / 'mixed'}"
    run_trainer(make_config(*options, "train.total_steps=1", mixed))  # step 1 on the local engine
    on_ray, _ = run_trainer(make_config(*options, *ray_overrides, "engine.num_workers=2", "train.total_steps=2", mixed))
    on_ray.engine.close()
    back, rows = run_trainer(make_config(*options, "train.total_steps=3", mixed))  # step 3 local again
    assert [r["step"] for r in rows] == [1, 2, 3]  # each resumed where the other left; one metrics file
    checkpoints = CheckpointManager(tmp_path / "mixed")
    assert [step for step, _ in checkpoints.list()] == [1, 2, 3]
    expected = straight.engine.model.policies.trainable_state_dict()
    assert max_difference(expected, back.engine.model.policies.trainable_state_dict()) <= 1e-5
    step2 = read_saved_tensors(checkpoints.dir / "step_000002", "policies.default.")  # written by the 2 workers
    assert max_difference(read_saved_tensors(tmp_path / "straight/checkpoints/step_000002", "policies.default."),
                           step2) <= 1e-5  # fmt: skip


ROOT = Path(__file__).resolve().parents[2]
# EQUAL (conftest.py) but its window: the direct-preference losses train on final latents (no window), Flash-GRPO
# keeps its quickstart's (one step per rollout); one thread, 2 chunks of 2 rows as the workers
EQUAL_PREFERENCE = ("train.lr=1e-4", "engine.num_threads=1", "sampling.score_chunks=2", "train.total_steps=3")
LOSS_OPTIONS = {"dpo": ("algorithm.dpo.dpo_beta=2000",), "nft": (), "awm": ("algorithm.awm.train_timesteps=2",),
                "dgpo": ("algorithm.dgpo.train_timesteps=2",), "crd": ("algorithm.crd.train_timesteps=2",)}  # fmt: skip


@pytest.mark.parametrize("loss", sorted(LOSS_OPTIONS))
def test_every_direct_preference_loss_takes_the_same_steps_on_two_workers(
    loss, local_and_two_workers, rows_close, max_difference
):
    config = ROOT / f"configs/quickstart_{loss}.yaml"
    options = (*EQUAL_PREFERENCE, *LOSS_OPTIONS[loss])
    local, local_rows, ray_rows, weights = local_and_two_workers(*options, config=config)
    for local_row, ray_row in zip(local_rows, ray_rows):
        assert ray_row["reward/mean"] == local_row["reward/mean"]  # the same samples, bit for bit
        # DPO's margin is β = 2000 times a difference of per-row errors of ~1: their float-reduction noise (~1e-7,
        # different on the two engines and from one CPU's kernels to another's) is ~1e-4 in it (6e-5 measured);
        # DGPO's is β/G = 50 times a sum of them (6e-6 measured); CRD's implicit reward is a difference of two
        # normalised errors of ~1, each carrying that noise (1.2e-7 measured)
        rows_close(local_row, ray_row, rel=1e-4, abs={"dpo": 5e-4, "dgpo": 5e-4, "crd": 1e-6}.get(loss, 1e-7))
        if ray_row["step"] > 1:  # step 1 also carries the actors' setup (the run's config, ~2 KB per actor)
            assert ray_row["driver/bytes_out"] < 10_000  # prompts and targets, never a trajectory
    difference = max_difference(local.engine.model.policies.trainable_state_dict(), weights)
    print(f"{loss}: max parameter difference after 3 steps, local vs 2 workers: {difference:.3g}")
    assert difference <= 1e-5


def test_flash_grpo_takes_the_same_steps_on_two_workers(local_and_two_workers, rows_close):
    """configs/quickstart_flash_grpo.yaml: each step's one SDE step k, drawn from (seed, step), is the same on both
    engines, and so is its rectification weight; the first step, from the same weights, is Flow-GRPO's update at
    its tolerance (test_two_workers_take_the_same_step_as_the_local_engine). Later steps are not compared row by
    row: from step 2 the weights differ by float reduction order (≤ 1e-5), which can flip one pixel's rounding and
    so one JPEG's size by a byte, and the group-normalised advantages magnify that (measured: step 2's reward/mean
    −0.0029525 against −0.0029530, step 3's grad norm 0.107 against 0.091)."""
    config = ROOT / "configs/quickstart_flash_grpo.yaml"
    first_half = "sampling.window.hi=2"  # of the tests' 4 sampling steps, as the quickstart's 5 of 10
    _, local_rows, ray_rows, _ = local_and_two_workers(*EQUAL_PREFERENCE, first_half, config=config)
    weights = [row["flash/rectify_weight"] for row in local_rows]
    assert len(weights) == 3 and len(set(weights)) > 1  # these steps train more than one k
    assert [row["flash/rectify_weight"] for row in ray_rows] == weights  # the same k at every step, bit for bit
    assert ray_rows[0]["reward/mean"] == local_rows[0]["reward/mean"]  # the same samples, bit for bit
    rows_close(local_rows[0], ray_rows[0])


def test_tdm_r1_takes_the_same_first_step_on_two_workers(local_and_two_workers, rows_close, max_difference):
    """configs/quickstart_tdm_r1.yaml (its three LoRA adapters): its first step, from the same weights, samples the
    same rows bit for bit and takes the same gradients: the rows' grad_norm/fake and grad_norm/surrogate (the
    generator's gradient is 0 at the first step, its pulls being the other two's differences from the teacher).
    Later steps are not compared row by row, as Flash-GRPO's: the float reduction order of two workers' summed
    gradients moves the weights apart by ~1e-7 and can move one JPEG's size by a byte at step 2."""
    config = ROOT / "configs/quickstart_tdm_r1.yaml"
    local, local_rows, ray_rows, weights = local_and_two_workers(
        *EQUAL_PREFERENCE, "train.total_steps=1", "model.lora.enabled=true", config=config
    )
    assert ray_rows[0]["reward/mean"] == local_rows[0]["reward/mean"]  # the same samples, bit for bit
    rows_close(local_rows[0], ray_rows[0], rel=1e-4, abs=1e-6)
    assert local_rows[0]["grad_norm/fake"] > 0 and local_rows[0]["grad_norm/surrogate"] > 0
    assert max_difference(local.engine.model.policies.trainable_state_dict(), weights) <= 1e-5


def _of_samples(row: dict) -> dict:
    """A row's numbers computed from the step's images alone (rewards, advantages, image statistics)."""
    return {k: v for k, v in row.items() if k.startswith(("reward/", "advantage/", "guard/"))}


def test_nft_with_lora_samples_the_same_rows_as_two_workers_from_the_same_weights(
    make_config, tmp_path, run_trainer, rows_close, max_difference, ray_overrides
):
    # LoRA starts with B = 0, so Adam's first step moves each B entry by lr·g/(|g| + eps): the ~100 entries whose
    # gradient is below eps move by up to lr/eps = 1e4 times its float noise, which differs here because 2 workers
    # sum the gradients of rows 0-1 and 2-3 while the local engine takes all 4 rows in one pass (measured: gradients
    # ≤ 4.7e-10 apart, weights after step 1 3.1e-8; bound 1e4 · 4.7e-10 < 1e-5). From step 2 on, that can round one
    # pixel in ~10^4 the other way and a JPEG reward by a byte (1.7e-4 of reward/mean): later steps cannot be compared
    # bit for bit run against run, so step 2 is taken from the same weights, the local engine resuming the Ray run's
    # checkpoint. old_decay 0.5: `old`, which samples, lags the policy after step 1, so step 2's images also tell
    # whether both engines sample with `old`.
    options = ("train.lr=1e-4", "engine.num_threads=1", "sampling.score_chunks=2", "model.lora.enabled=true",
               "algorithm.nft.old_decay=fixed", "algorithm.nft.old_decay_value=0.5", "train.save_every=1")  # fmt: skip
    config = ROOT / "configs/quickstart_nft.yaml"
    sharded, ray_rows = run_trainer(
        make_config(*options, *ray_overrides, "engine.num_workers=2", "train.total_steps=2", config=config)
    )
    try:
        ray_weights = sharded.engine.trainable_state_dict()
    finally:
        sharded.engine.close()
    step1 = CheckpointManager(sharded.cfg.run.dir).dir / "step_000001"
    local, (local_row,) = run_trainer(
        make_config(*options, "train.total_steps=1", f"run.dir={tmp_path / 'local'}", config=config)
    )
    # step 1, before any update: the same rows, bit for bit; the update's numbers up to float reduction order
    assert _of_samples(local_row) == _of_samples(ray_rows[0]) and local_row["reward/mean"] == ray_rows[0]["reward/mean"]
    rows_close(local_row, ray_rows[0])
    local_step1 = local.engine.model.policies.trainable_state_dict()
    assert max_difference(local_step1, read_saved_tensors(step1, "policies.default.")) <= 1e-5
    # step 2 from the Ray run's weights after step 1 (policy and `old`): the same rows again, bit for bit
    resumed, (resumed_row,) = run_trainer(make_config(*options, "train.total_steps=2", f"run.resume={step1}",
                                                      f"run.dir={tmp_path / 'resumed'}", config=config))  # fmt: skip
    assert resumed_row["step"] == 2 and _of_samples(resumed_row) == _of_samples(ray_rows[1])
    rows_close(resumed_row, ray_rows[1])
    assert max_difference(resumed.engine.model.policies.trainable_state_dict(), ray_weights) <= 1e-5


def test_offline_dpo_on_two_workers_moves_pair_rows_between_them_and_matches_the_local_engine(
    tmp_path, local_and_two_workers, max_difference
):
    # 2 pairs a step: rows 0-1 chosen, 2-3 rejected; worker 0 holds rows 0-1, worker 1 rows 2-3, so every pair has
    # one row on each worker and one of them must move
    pairs = random_pair_file(tmp_path, 3)
    # the workers encode the prompts of their 2 rows, the local engine of all 4: embeddings equal up to float noise,
    # which Adam's eps of 1e-8 would turn into ~lr moves of weights whose gradient is ~0; 1e-4 keeps it proportional
    options = (*EQUAL_PREFERENCE, f"data.pairs={pairs}", "data.prompts_per_step=2", "rewards=[]", "train.adam_eps=1e-4")
    config = ROOT / "configs/quickstart_dpo_offline.yaml"
    local, local_rows, ray_rows, weights = local_and_two_workers(*options, config=config)
    assert [r["train/units"] for r in ray_rows] == [2.0, 2.0, 2.0]
    assert max_difference(local.engine.model.policies.trainable_state_dict(), weights) <= 1e-5


def _listening_off_loopback(pids: set[int]) -> list[str]:
    """`ss -ltnp` lines of sockets that processes `pids` listen on at an address other than loopback."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    lines = []
    for line in out.splitlines():
        local = line.split()[3]
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids and not local.startswith(("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:")):
            lines.append(line)
    return lines


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2) to list listening sockets")
def test_a_local_cluster_and_its_workers_listen_on_loopback_only(make_config, ray_overrides):
    cfg = make_config(*ray_overrides, "engine.num_workers=2")
    engine = RayEngine(cfg.engine, worker_spec(cfg))
    try:
        ray_processes = subprocess.run(["pgrep", "-f", "ray|gcs_server|raylet"], capture_output=True, text=True)
        pids = {int(p) for p in ray_processes.stdout.split()} | set(engine.trainers.pids) | {os.getpid()}
        assert len(pids) > 3  # GCS, raylet, the workers, this driver
        assert _listening_off_loopback(pids) == []
    finally:
        engine.close()


def _batch(engine, cfg, step: int = 0):
    from diffusion_rl.data.prompts import load_prompts
    from diffusion_rl.data.sampler import PromptSampler

    records = load_prompts(cfg.data.train)
    sampler = PromptSampler(len(records), cfg.data.prompts_per_step, cfg.run.seed)
    prompts = make_step_prompts(records, sampler, step, cfg.data.group_size)
    return engine.generate(prompts, step, default_window(cfg.sampling.num_steps)).images


def test_an_exception_in_a_worker_reaches_the_driver_and_no_checkpoint_is_written(make_config, tmp_path, ray_overrides):
    cfg = make_config(*ray_overrides, "engine.num_workers=2")
    engine = RayEngine(cfg.engine, worker_spec(cfg))
    try:
        _batch(engine, cfg)
        with pytest.raises(WorkerError) as caught:  # no advantages: the update fails in every worker (a TypeError
            engine.update(Targets(batch_size=[4]), 0)  # where the credit reads them: targets are not re-checked there)
        message = str(caught.value)
        assert "worker rank" in message and f"on {os.uname().nodename}" in message
        assert "TypeError" in message and "not subscriptable" in message
        assert "credit.py" in message and "policy_gradient.py" in message  # the worker's traceback
        # the engine stopped its workers: a checkpoint now fails and leaves nothing behind
        manager = CheckpointManager(tmp_path / "run")
        with pytest.raises(RuntimeError, match="trainer actors stopped after a failure"):
            manager.save(1, engine.save)
        assert list(manager.dir.iterdir()) == []
    finally:
        engine.close()


def test_a_killed_worker_is_detected_within_a_bounded_time(make_config, ray_overrides):
    cfg = make_config(*ray_overrides, "engine.num_workers=2")
    engine = RayEngine(cfg.engine, worker_spec(cfg))
    try:
        images = _batch(engine, cfg)
        assert images.shape[0] == 4 and images.dtype == torch.uint8
        threading.Timer(0.5, os.kill, (engine.trainers.pids[1], signal.SIGKILL)).start()
        start = time.perf_counter()
        with pytest.raises(WorkerDied, match="rank 1") as caught:
            for step in range(1, 100):  # mid-step, whichever call the kill lands in
                _batch(engine, cfg, step)
        assert time.perf_counter() - start < 60, "detected by Ray, not by the collective timeout"
        assert str(engine.trainers.pids[1]) in str(caught.value)
    finally:
        engine.close()


def test_a_reward_actor_that_dies_is_restarted_then_reported(user_reward_file):
    import numpy as np

    images = np.arange(4 * 8 * 8 * 3, dtype=np.uint8).reshape(4, 8, 8, 3)
    expected = images.reshape(4, -1).mean(axis=1)
    reward = ActorReward(user_reward_file, {}, num_actors=1, num_cpus=1, max_restarts=1)
    try:
        np.testing.assert_allclose(reward(images, ["p"] * 4, [{}] * 4), expected)
        os.kill(reward.pids()[0], signal.SIGKILL)
        np.testing.assert_allclose(reward(images, ["p"] * 4, [{}] * 4), expected)  # restarted, scored again
        os.kill(reward.pids()[0], signal.SIGKILL)
        with pytest.raises(RewardActorDied, match="reward '.*:mean_pixel'"):
            reward(images, ["p"] * 4, [{}] * 4)
    finally:
        reward.close()


@pytest.fixture
def user_reward_file(tmp_path) -> str:
    path = tmp_path / "pixel_reward.py"
    path.write_text(
        "def mean_pixel(images, prompts, metadata):\n    return images.reshape(len(images), -1).mean(axis=1)\n"
    )
    return f"{path}:mean_pixel"


def test_gardo_takes_the_same_first_step_and_resets_alike_on_two_workers(
    local_and_two_workers, rows_close, equal_overrides
):
    """GARDO's gate is the driver's; its reset is decided on each worker from the gated KL summed over the workers
    (a collective in `end`), here also by the period (reset_every 1: after the second update). The first step is
    the same on both engines; later steps' images differ in the last bits (the weights' float noise), which the
    gate's ranks over a batch of 4 can amplify into another gate, so later rows are not compared."""
    options = (*equal_overrides, "train.total_steps=2", "algorithm.gardo.reset_every=1")
    _, local_rows, ray_rows, _ = local_and_two_workers(*options, config=ROOT / "configs/quickstart_gardo.yaml")
    assert [r["gardo/reset"] for r in ray_rows] == [r["gardo/reset"] for r in local_rows] == [0.0, 1.0]
    rows_close(local_rows[0], ray_rows[0], rel=1e-4, abs=1e-7)
