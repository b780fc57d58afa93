"""A two-node Ray cluster simulated on this machine (ray.cluster_utils.Cluster, every node on loopback): trainers
pinned to one node and rollout actors to the other by custom resources, joined at an address as a real cluster is,
with TCP rendezvous for the trainers' process group and the weight broadcast."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from diffusion_rl.trainer.trainer import Trainer  # noqa: E402


@pytest.fixture(scope="module")
def two_nodes():
    ray.shutdown()  # the local cluster other modules share (tests/engine/conftest.py ray_session), if it runs
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"trainer_node": 2}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"rollout_node": 2})
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_trainers_and_rollout_actors_on_two_nodes_train(make_config, two_nodes, ray_overrides):
    cfg = make_config(
        *ray_overrides,
        f"engine.address={two_nodes.address}",
        "engine.num_workers=2",
        "engine.trainer_resources={trainer_node: 1}",
        "engine.rollout=separate",
        "engine.rollout_workers=1",
        "engine.rollout_resources={rollout_node: 1}",
        "engine.weight_sync=broadcast",
        "train.total_steps=2",
    )
    trainer = Trainer(cfg)
    try:
        rows = trainer.train()
        trainers, rollouts = trainer.engine.trainers.nodes, trainer.engine.rollouts.nodes
    finally:
        trainer.engine.close()
    head = two_nodes.head_node.node_id
    (other,) = [node.node_id for node in two_nodes.worker_nodes]
    assert trainers == [head, head] and rollouts == [other]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["rollout/weights_version"] == 2
    assert all(node["NodeManagerAddress"] == "127.0.0.1" for node in ray.nodes())  # loopback only
