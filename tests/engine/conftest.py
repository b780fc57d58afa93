"""Helpers for the engine tests: one local Ray cluster the modules share, trainer runs whose engines are closed
afterwards, and comparisons of metrics rows and weights between engines."""

from __future__ import annotations

import os
import time

import pytest
import torch

from diffusion_rl.trainer.trainer import Trainer

# Ray settings of every Ray test run: one CPU per worker, short timeouts, and the batch sampled in one chunk: each
# chunk is spread over every sampling worker (engine/ray.py `sampling_chunks`), so 2 workers sample their 2 rows
# each in one call, as the local engine's 2 chunks of 2 rows (EQUAL); a test of one rollout actor asks for 2 chunks
RAY = ("engine.kind=ray", "engine.cpus_per_worker=1", "engine.collective_timeout_s=60", "engine.start_timeout_s=120",
       "sampling.score_chunks=1")  # fmt: skip
# separate rollout actors: one, sampling the 4 rows in 2 chunks of 2, as 2 colocated workers (RAY) and the local
# engine (EQUAL) do
SEPARATE = ("engine.rollout=separate", "engine.rollout_workers=1", "engine.cpus_per_rollout_worker=1",
            "sampling.score_chunks=2")  # fmt: skip
# lr 1e-4: Adam's first step moves a weight by ~lr whatever its gradient, so a gradient within float noise of 0
# (summed in another order over 2 workers) can move by up to lr·(its relative noise); 1e-4 keeps that below 1e-5.
# The same arithmetic as 2 workers with cpus_per_worker=1, so that the images (and the JPEG rewards, which one
# pixel off by 1 moves by bytes) are bit-identical: one torch thread (two split matmuls differently), and the
# local engine sampling in 2 chunks of 2 rows, the rows each worker samples in one call (RAY) (a matmul over 2 rows
# may round differently from one over 4). The update's gradients then differ only by float reduction order.
EQUAL = (
    "train.lr=1e-4",
    "sampling.window.kind=random",
    "sampling.window.size=2",
    "engine.num_threads=1",
    "sampling.score_chunks=2",
)


@pytest.fixture
def ray_overrides() -> tuple[str, ...]:
    return RAY


@pytest.fixture
def equal_overrides() -> tuple[str, ...]:
    """Settings under which a Ray run and a local one compute the same numbers (see EQUAL)."""
    return EQUAL


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone (FSDP2 needs one to shard over), met through a file."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the local runs set 1 (EQUAL)


@pytest.fixture(scope="session")
def _local_ray():
    """Shuts down at the end of the session the local Ray that `ray_session` started and left running."""
    yield
    import ray

    ray.shutdown()


@pytest.fixture(scope="module")
def ray_session(_local_ray):
    """Ray for a test module. Logical CPUs: two engines of 2 trainers and a rollout or reward actor each; the tiny
    model needs no more than the 2 real cores (each actor runs one torch thread). Loopback only: the engine's
    LOCAL_CLUSTER_ENV, which tests/conftest.py sets before Ray is first imported.

    One local cluster serves every module that asks for it (a start and a shutdown cost ~5-10 s on 2 loaded cores):
    started by the first, left running for the next (a module that needs another cluster shuts it down first, and a
    later one here starts it again). Each module must leave no actor or placement group behind: it checks that it
    finds and leaves every logical CPU free."""
    ray = pytest.importorskip("ray")
    from diffusion_rl.engine.ray_cluster import LOCAL_CLUSTER_ENV

    assert all(os.environ.get(k) == v for k, v in LOCAL_CLUSTER_ENV.items())
    if ray.is_initialized() and ray.cluster_resources().get("CPU") != 8:
        ray.shutdown()  # not this one: a cluster some other test connected to
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING")
    _all_cpus_free(ray)
    yield
    _all_cpus_free(ray)


def _all_cpus_free(ray, wait_s: float = 30.0) -> None:
    """Every logical CPU of the local cluster free (a killed actor's CPU comes back within moments)."""
    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, f"Ray CPUs still held: {ray.available_resources()}"
        time.sleep(0.2)


@pytest.fixture
def run_trainer():
    """run_trainer(cfg, prepare=None) → (trainer, rows) of a whole run (`prepare(trainer)` first); every Ray engine
    it started is closed after the test."""
    started = []

    def run(cfg, prepare=None) -> tuple[Trainer, list[dict]]:
        trainer = Trainer(cfg)
        started.append(trainer)
        if prepare is not None:
            prepare(trainer)
        return trainer, trainer.train()

    yield run
    for trainer in started:
        if hasattr(trainer.engine, "close"):
            trainer.engine.close()


@pytest.fixture
def local_and_two_workers(make_config, run_trainer, ray_overrides, tmp_path):
    """local_and_two_workers(*overrides, config=…) → (local trainer, its rows, the Ray run's rows, the Ray run's
    trained weights): the same config run on the local engine and on 2 Ray workers (whose engine is closed)."""

    def run(*options: str, config):
        local, local_rows = run_trainer(make_config(*options, f"run.dir={tmp_path / 'local'}", config=config))
        sharded, ray_rows = run_trainer(make_config(*options, *ray_overrides, "engine.num_workers=2", config=config))
        try:
            weights = sharded.engine.trainable_state_dict()
        finally:
            sharded.engine.close()
        return local, local_rows, ray_rows, weights

    return run


def _comparable(row: dict) -> dict:
    # durations, the Ray driver's traffic (the local engine has none), the weight pushes of rollout actors
    skip = ("timing/", "perf/", "driver/", "sync/", "rollout/weights_version")
    return {k: v for k, v in row.items() if not k.startswith(skip) and k != "images_per_second"}


@pytest.fixture
def rows_close():
    """rows_close(a, b, rel, abs) asserts two metrics rows have the same keys and values within `rel` or `abs`
    (durations and traffic aside)."""

    def check(a: dict, b: dict, rel: float = 1e-5, abs: float = 1e-7) -> None:
        assert _comparable(a).keys() == _comparable(b).keys()
        for key, value in _comparable(a).items():
            assert b[key] == pytest.approx(value, rel=rel, abs=abs), key

    return check


@pytest.fixture
def max_difference():
    """max_difference(a, b): the largest |a − b| over two dicts of tensors with the same names."""

    def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        assert a.keys() == b.keys()
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    return difference
