"""`estimate`'s host memory: what the memory savers keep on the CPU, per worker and per node, and a warning when a
node's workers need more than its RAM (--node-ram-gib)."""

from __future__ import annotations

from pathlib import Path

from diffusion_rl.cli import main
from diffusion_rl.config import load
from diffusion_rl.estimate.architectures import from_shipped
from diffusion_rl.estimate.devices import DEVICES
from diffusion_rl.estimate.estimator import estimate

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
FLUX2_DEV = str(ROOT / "configs/flux2_dev_pickscore_lora.yaml")


def test_flux2_devs_offloaded_text_encoder_is_47_gb_on_the_cpu_for_each_worker_and_eight_times_that_per_node():
    cfg = load(FLUX2_DEV)
    assert cfg.model.offload_frozen and cfg.engine.num_workers == 8
    r = estimate(cfg, from_shipped("FLUX.2-dev"), DEVICES["h100"], 8)
    # Mistral-Small-3.1-24B as the pipeline loads it (LM head untied: 24.0 B parameters, tests/test_estimate_encoders)
    # in bf16: 2 bytes each
    assert abs(r.host_memory_gib["text_encoders"] * GIB - 24.0e9 * 2) / (24.0e9 * 2) < 0.01
    assert r.host_memory_gib["text_encoders"] * GIB > 47e9  # "~47 GB for each worker"
    assert r.workers_per_node == 8
    assert r.host_memory_gib_per_node == 8 * r.host_memory_gib_per_worker
    assert r.host_memory_gib_per_worker == sum(r.host_memory_gib.values())
    assert r.host_fits  # 8 × 44.8 GiB = 358 GiB within the default 1024 GiB
    assert estimate(cfg, from_shipped("FLUX.2-dev"), DEVICES["h100"], 8, gpus_per_node=4).host_memory_gib_per_node == (
        4 * r.host_memory_gib_per_worker
    )  # fmt: skip
    on_gpu = estimate(load(FLUX2_DEV, ["model.offload_frozen=false"]), from_shipped("FLUX.2-dev"), DEVICES["h100"], 8)
    assert on_gpu.host_memory_gib_per_worker == 0 and on_gpu.memory_gib["text_encoders"] > 44


def test_fsdp_cpu_offload_keeps_the_shards_and_the_adapters_optimizer_state_on_the_host():
    cfg = load(FLUX2_DEV, ["engine.fsdp_cpu_offload=true"])
    r = estimate(cfg, from_shipped("FLUX.2-dev"), DEVICES["h100"], 8)
    assert abs(r.host_memory_gib["shards"] * GIB - 32.2e9 * 2 / 8) / (32.2e9 * 2 / 8) < 0.01  # 32.2 B bf16 over 8
    base = estimate(load(FLUX2_DEV), from_shipped("FLUX.2-dev"), DEVICES["h100"], 8)
    lora = 308.3e6  # the trainable parameters the estimate assumes (see its `assumes` line): r 64 on the flux2 preset
    assert abs(r.host_memory_gib["optimizer_state"] * GIB - 3 * lora * 4 / 8) / (3 * lora * 4 / 8) < 0.01
    # on the device: the adapters' gradients only, a quarter of the fp32 weights, gradients and two moments
    assert abs(r.memory_gib["trainable_state"] - base.memory_gib["trainable_state"] / 4) < 1e-9


def test_the_report_warns_when_a_node_needs_more_ram_than_it_has(capsys):
    assert main(["estimate", FLUX2_DEV, "--gpu", "h100", "--node-ram-gib", "256"]) == 0
    out = capsys.readouterr().out
    assert "GiB per worker (text_encoders 44." in out and "per node of 8 worker(s)" in out
    assert "WARNING       a node's 8 worker(s) keep 358." in out and "more than its 256 GiB of RAM" in out
    assert main(["estimate", FLUX2_DEV, "--gpu", "h100"]) == 0
    assert "WARNING" not in capsys.readouterr().out.split("host memory")[1].split("time per step")[0]
    assert main(["estimate", FLUX2_DEV, "--gpus-per-node", "0"]) == 2
    assert main(["estimate", FLUX2_DEV, "--node-ram-gib", "-1"]) == 2
