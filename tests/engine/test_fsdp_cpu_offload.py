"""engine.fsdp_cpu_offload: FSDP2's CPUOffloadPolicy on every sharded network of a trainer (the trained one and the
full fine-tuning copies), and a Ray run with it taking the same step as the local engine.

On a CPU-only machine FSDP2 cannot pin host memory, so the policy is built with pin_memory off there; the shards
are on the CPU either way, so the unit test checks the policy each FSDP unit holds."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.engine.parallel import Fsdp2Sharded
from diffusion_rl.errors import UserError
from diffusion_rl.models.loader import load_model
from diffusion_rl.models.policies import DEFAULT, REFERENCE


def _offload_policies(root) -> list:
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    return [unit._get_fsdp_state()._fsdp_param_group.offload_policy for unit in units]


@pytest.mark.parametrize("offload", [True, False])
def test_every_sharded_network_gets_the_offload_policy_and_trains(tiny_model_dir, one_rank_group, offload):
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = load_model(ModelConfig(path=str(tiny_model_dir), device="cpu", max_sequence_length=16,
                                   lora=LoraConfig(enabled=False)))  # fmt: skip
    model.policies.keep_reference()  # full fine-tuning's frozen copy is sharded too
    parallel = Fsdp2Sharded(torch.device("cpu"), cpu_offload=offload)
    parallel.prepare(model)
    assert set(parallel.roots) == {DEFAULT, REFERENCE}
    for root in parallel.roots.values():
        policies = _offload_policies(root)
        assert len(policies) > 1  # the blocks and the root
        if offload:
            assert all(isinstance(p, CPUOffloadPolicy) and not p.pin_memory for p in policies)
        else:
            assert not any(isinstance(p, CPUOffloadPolicy) for p in policies)
    # a forward, backward and optimizer step run on the offloaded shards
    latents = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["a red cube", "a blue ball"])
    params = model.trainable_parameters()
    before = [p.detach().to_local().clone() for p in params]
    model.velocity(latents, 0.6, cond, 1.0).square().mean().backward()
    assert parallel.clip_grad_norm(params, 1.0) > 0
    torch.optim.AdamW(params, lr=1e-3).step()
    assert any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, params))


def test_the_offload_needs_the_ray_engine(make_config):
    with pytest.raises(UserError, match="engine.fsdp_cpu_offload .* needs engine.kind=ray"):
        make_config("engine.fsdp_cpu_offload=true")


@pytest.mark.usefixtures("ray_session")
def test_two_offloading_workers_with_every_saver_take_the_same_step_as_the_local_engine(
    make_config, tmp_path, run_trainer, rows_close, ray_overrides, equal_overrides
):
    pytest.importorskip("ray")
    # the memory savers together: half-stored trajectories kept on the workers (and moved between them), the frozen
    # components offloaded between uses, and the FSDP2 shards offloaded on the Ray side
    savers = (*equal_overrides, "train.total_steps=1", "sampling.latents_dtype=bf16", "model.offload_frozen=true")
    _, local_rows = run_trainer(make_config(*savers, f"run.dir={tmp_path / 'local'}"))
    cfg = make_config(*savers, *ray_overrides, "engine.num_workers=2", "engine.fsdp_cpu_offload=true")
    _, ray_rows = run_trainer(cfg)
    for key in ("reward/mean", "reward/std", "advantage/abs_mean"):
        assert ray_rows[0][key] == local_rows[0][key], key
    assert ray_rows[0]["train/logp_diff_max"] == 0.0
    rows_close(local_rows[0], ray_rows[0])  # loss, grad norm, …: up to float reduction order
