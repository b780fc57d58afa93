"""Several trained LoRA adapters (models/policies.py `add(trained=True)`), each in its own optimizer group with its
own lr and betas, clipped on its own gradient norm (algorithms/base.py `OptimizerGroup`, engine/optimizer.py)."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_rl.algorithms.base import Algorithm, OptimizerGroup
from diffusion_rl.algorithms.policy_gradient import PolicyGradient
from diffusion_rl.checkpoint.state import read_state, write_state
from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.config.train import EmaConfig, TrainConfig
from diffusion_rl.engine.optimizer import OptimizerStepper
from diffusion_rl.engine.parallel import SingleDevice
from diffusion_rl.models.loader import load_model
from diffusion_rl.models.policies import DEFAULT

FAKE = OptimizerGroup("fake", lr_scale=4.0, betas=(0.0, 0.99))


def _load(path, lora: bool = True):
    lora_cfg = LoraConfig(enabled=lora, rank=4, alpha=8)
    return load_model(ModelConfig(path=str(path), device="cpu", max_sequence_length=16, lora=lora_cfg))


@pytest.fixture
def model(tiny_model_dir):
    return _load(tiny_model_dir)


def _probe(model):
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn((2, *model.latent_shape(32, 32)), generator=generator)
    return latents, 0.6, model.encode_prompts(["a red cube", "a blue ball"])


def _velocity(model, probe) -> torch.Tensor:
    with torch.no_grad():
        return model.velocity(*probe, 1.0)


@torch.no_grad()
def _perturb(tensors, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in tensors:
        p.add_(0.1 * torch.randn(p.shape, generator=generator))


def _lora(model, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.policies.trained.named_parameters() if "lora_" in n and f".{adapter}." in n]


# -- policies ------------------------------------------------------------------------------------------------------
def test_a_fresh_adapter_starts_as_the_base_and_a_copy_as_default(model):
    probe = _probe(model)
    with model.reference():
        v_base = _velocity(model, probe)
    _perturb(model.policies.parameters_of(DEFAULT))  # default is no longer the base
    v_default = _velocity(model, probe)
    assert not torch.allclose(v_default, v_base, atol=1e-4)
    model.policies.add("fake", trained=True, start=None)
    model.policies.add("copy")
    with model.using("fake"):
        assert torch.equal(_velocity(model, probe), v_base)  # LoRA B = 0: no copy of default
    with model.using("copy"):
        assert torch.equal(_velocity(model, probe), v_default)
    assert torch.equal(_velocity(model, probe), v_default)


def test_trained_adapters_keep_their_gradients_and_frozen_ones_do_not(model):
    policies = model.policies
    policies.add("fake", trained=True, start=None)
    policies.add("old")
    policies.add("surrogate", trained=True, start=None)
    assert policies.trained_policies() == [DEFAULT, "fake", "surrogate"]
    for active in ("old", "fake", DEFAULT, "surrogate"):
        with model.using(active):
            flags = {n: p.requires_grad for n, p in policies.trained.named_parameters()}
            trained = {n for n in flags if "lora_" in n and any(f".{a}." in n for a in policies.trained_policies())}
            assert trained and {n for n, on in flags.items() if on} == trained, active
    # the trained policy (EMA, export, counts) is still default alone; each trained adapter has its own tensors
    assert [id(p) for p in policies.trainable_parameters()] == [id(p) for _, p in _lora(model, DEFAULT)]
    assert policies.trainable_names() == [n for n, _ in _lora(model, DEFAULT)]
    assert [id(p) for p in policies.parameters_of("fake")] == [id(p) for _, p in _lora(model, "fake")]
    with pytest.raises(KeyError, match="not trained"):
        policies.parameters_of("old")
    # a backward through an active trained adapter reaches it (and not default)
    with model.using("fake"):
        model.velocity(*_probe(model), 1.0).square().mean().backward()
    assert all(p.grad is not None for p in policies.parameters_of("fake"))
    assert all(p.grad is None for p in policies.parameters_of(DEFAULT))
    assert "fake" in policies.saved_names() and "surrogate" in policies.saved_names()


def test_a_reference_forward_between_an_adapters_forward_and_its_backward_keeps_the_gradient(model):
    """peft re-enables adapters after `disable_adapter` by marking the active one alone trainable; the other trained
    adapters must stay so, or their gradient is dropped at the backward (TDM-R1 runs the teacher between them)."""
    policies, probe = model.policies, _probe(model)
    policies.add("fake", trained=True, start=None)
    with model.using("fake"):
        v_fake = model.velocity(*probe, 1.0)
    with model.reference(), torch.no_grad():
        model.velocity(*probe, 1.0)
    assert all(p.requires_grad for p in policies.parameters_of("fake"))
    v_fake.square().mean().backward()
    assert all(p.grad is not None for p in policies.parameters_of("fake"))
    assert sum(float(p.grad.abs().sum()) for p in policies.parameters_of("fake")) > 0


def test_full_fine_tuning_refuses_a_second_trained_network(tiny_model_dir):
    full = _load(tiny_model_dir, lora=False)
    with pytest.raises(ValueError, match=r"a second trained network needs model\.lora"):
        full.policies.add("fake", trained=True)


# -- the optimizer step ----------------------------------------------------------------------------------------------
TRAIN = TrainConfig(lr=0.01, betas=(0.9, 0.999), weight_decay=0.1, adam_eps=0.5, grad_clip=1.0, warmup_steps=2)


def _adamw_first_step(w: list[float], g: list[float], lr: float, betas, train: TrainConfig) -> list[float]:
    """One AdamW step from zero moments, on gradients g clipped to train.grad_clip by their own norm (plain floats)."""
    norm = math.sqrt(sum(x * x for x in g))
    coef = min(1.0, train.grad_clip / (norm + 1e-6))  # torch's clip_grad_norm_
    out = []
    for wi, gi in zip(w, g):
        gi = gi * coef
        m_hat = (1 - betas[0]) * gi / (1 - betas[0])
        v_hat = (1 - betas[1]) * gi * gi / (1 - betas[1])
        out.append(wi * (1 - lr * train.weight_decay) - lr * m_hat / (math.sqrt(v_hat) + train.adam_eps))
    return out


def _two_groups(train: TrainConfig = TRAIN, fake_grad_scale: float = 1.0):
    a = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))
    b = torch.nn.Parameter(torch.tensor([1.5, 0.25], dtype=torch.float64))
    stepper = OptimizerStepper([(OptimizerGroup(), [a]), (FAKE, [b])], train, SingleDevice())
    a.grad = torch.tensor([0.3, -0.6, 0.2], dtype=torch.float64)
    b.grad = torch.tensor([0.4, 0.1], dtype=torch.float64) * fake_grad_scale
    return stepper, a, b


def test_each_group_steps_with_its_own_lr_betas_and_clip():
    stepper, a, b = _two_groups(fake_grad_scale=10.0)  # b's norm 4.1 is clipped to 1; a's 0.7 is not
    w_a, g_a, w_b, g_b = a.tolist(), a.grad.tolist(), b.tolist(), b.grad.tolist()
    stepper.step()
    warm = 1 / 2  # step 1 of a 2-step warm-up: every group's lr halved
    assert a.tolist() == pytest.approx(_adamw_first_step(w_a, g_a, 0.01 * warm, (0.9, 0.999), TRAIN), rel=1e-12)
    assert b.tolist() == pytest.approx(_adamw_first_step(w_b, g_b, 0.04 * warm, (0.0, 0.99), TRAIN), rel=1e-12)
    metrics = stepper.metrics()
    assert metrics["grad_norm"] == pytest.approx(math.sqrt(0.09 + 0.36 + 0.04), rel=1e-12)  # the first group's
    assert metrics["grad_norm/fake"] == pytest.approx(math.sqrt(16 + 1), rel=1e-12)
    assert metrics["lr"] == pytest.approx(0.01)  # the first group's, after the step: warm-up done
    assert stepper.optimizer.param_groups[1]["lr"] == pytest.approx(0.04)


def test_a_huge_gradient_in_one_group_leaves_the_others_update_as_it_was():
    calm, a_calm, _ = _two_groups()
    huge, a_huge, b_huge = _two_groups(fake_grad_scale=1e6)
    calm.step()
    huge.step()
    assert torch.equal(a_calm, a_huge)  # a shared clip would have scaled a's gradient by ~1e-6
    b_huge.grad = torch.tensor([float("inf"), 0.0], dtype=torch.float64)
    a_huge.grad = torch.ones(3, dtype=torch.float64)
    before = a_huge.detach().clone()
    huge.step()  # a non-finite norm in any group skips the whole step
    assert torch.equal(a_huge, before) and huge.skipped == 1 and a_huge.grad is None


def test_the_ema_averages_the_first_group_only():
    train = TrainConfig(lr=0.01, ema=EmaConfig(enabled=True, decay=0.5))
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    stepper = OptimizerStepper([(OptimizerGroup(), [a]), (FAKE, [b])], train, SingleDevice())
    assert stepper.ema.parameters == [a] and len(stepper.ema.shadow) == 1
    assert stepper.params == [a, b]  # the fingerprint and health checks see every group


def test_plain_parameters_are_one_default_group():
    weight = torch.nn.Parameter(torch.ones(3))
    stepper = OptimizerStepper([weight], TRAIN, SingleDevice())
    assert stepper.groups == (OptimizerGroup(),) and stepper.params == [weight]
    assert Algorithm.optimizer_groups(None) == (OptimizerGroup(),)


def _two_adapter_model(path):
    torch.manual_seed(0)  # peft draws LoRA's A from the global generator: the same adapters in every copy
    model = _load(path)
    model.policies.add("fake", trained=True, start=None)
    return model


def _step_both(model, stepper, parallel, probe) -> None:
    """A backward into each adapter, then one optimizer step, as the update loop runs them."""
    with parallel.training():
        parallel.sync_gradients(last_before_step=False)
        model.velocity(*probe, 1.0).square().mean().backward()
        parallel.sync_gradients(last_before_step=True)
        with model.using("fake"):
            (model.velocity(*probe, 1.0) - 1).square().mean().backward()
        stepper.step()
    parallel.settle()


def test_two_trained_adapters_step_alike_when_sharded(tiny_model_dir, one_rank_group):
    from torch.distributed.tensor import DTensor

    from diffusion_rl.engine.parallel import Fsdp2Sharded

    steppers = {}
    for kind, parallel in (("local", SingleDevice()), ("sharded", Fsdp2Sharded(torch.device("cpu")))):
        model = _two_adapter_model(tiny_model_dir)
        parallel.prepare(model)  # FSDP2: after every policy exists, before the optimizer takes the parameters
        groups = [(group, model.policies.parameters_of(group.policy)) for group in (OptimizerGroup(), FAKE)]
        stepper = OptimizerStepper(groups, TrainConfig(lr=1e-3), parallel)
        _step_both(model, stepper, parallel, _probe(model))
        lora = {n: p for n, p in model.policies.trained.named_parameters() if "lora_" in n}
        whole = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in lora.items()}
        steppers[kind] = stepper, {n: p.detach().clone() for n, p in whole.items()}
    (local, local_weights), (sharded, sharded_weights) = steppers["local"], steppers["sharded"]
    assert local_weights.keys() == sharded_weights.keys()
    for n, w in local_weights.items():
        torch.testing.assert_close(sharded_weights[n], w, rtol=1e-5, atol=1e-7, msg=n)
    ours, theirs = local.metrics(), sharded.metrics()
    assert ours["grad_norm/fake"] > 0 and theirs["grad_norm/fake"] == pytest.approx(ours["grad_norm/fake"], rel=1e-5)
    assert theirs["grad_norm"] == pytest.approx(ours["grad_norm"], rel=1e-5)


# -- a worker with two trained adapters: save, load, the next step is the same ------------------------------------
TWO_GROUPS = (OptimizerGroup(), FAKE)


def _two_adapter_algorithm(monkeypatch, groups=TWO_GROUPS) -> None:
    def attach(self, model):
        Algorithm.attach(self, model)
        model.policies.add("fake", trained=True, start=None)

    monkeypatch.setattr(PolicyGradient, "attach", attach)
    monkeypatch.setattr(PolicyGradient, "optimizer_groups", classmethod(lambda cls, settings: tuple(groups)))


def _step(worker, probe) -> None:
    """One optimizer step on both adapters: a backward into each."""
    model = worker.model
    model.velocity(*probe, 1.0).square().mean().backward()
    with model.using("fake"):
        (model.velocity(*probe, 1.0) - 1).square().mean().backward()
    worker.optimizer.step()


def test_a_resumed_worker_with_two_trained_adapters_takes_the_same_next_step(make_config, monkeypatch, tmp_path):
    from diffusion_rl.engine.worker import PolicyWorker
    from diffusion_rl.trainer.setup import worker_spec

    _two_adapter_algorithm(monkeypatch)
    cfg = make_config("model.lora.enabled=true", "train.ema.enabled=true", "train.lr=1e-3")
    saved = PolicyWorker(worker_spec(cfg))
    probe = _probe(saved.model)
    _step(saved, probe)
    assert saved.optimizer.metrics()["grad_norm/fake"] > 0
    state = saved.save(tmp_path / "ckpt")
    write_state(tmp_path / "ckpt", {"step": 1, "engine": state})  # as the trainer's checkpoint does
    assert all(".default." in n for n in saved.tensors()["ema"])  # the EMA entry stays default's

    resumed = PolicyWorker(worker_spec(cfg))
    resumed.load(tmp_path / "ckpt", read_state(tmp_path / "ckpt")["engine"])
    assert [(g["lr"], g["betas"]) for g in resumed.optimizer.optimizer.param_groups] == [
        (1e-3, (0.9, 0.999)),
        (4e-3, (0.0, 0.99)),
    ]
    _step(saved, probe)
    _step(resumed, probe)
    for name in ("default", "fake"):
        ours, theirs = saved.model.policies.tensors_of(name), resumed.model.policies.tensors_of(name)
        assert all(torch.equal(ours[n], theirs[n]) for n in ours), name
    assert all(torch.equal(s, r) for s, r in zip(saved.optimizer.ema.shadow, resumed.optimizer.ema.shadow))


def test_the_first_optimizer_group_must_be_the_default_policy(make_config, monkeypatch):
    from diffusion_rl.engine.worker import PolicyWorker
    from diffusion_rl.trainer.setup import worker_spec

    _two_adapter_algorithm(monkeypatch, groups=(FAKE, OptimizerGroup()))
    with pytest.raises(ValueError, match="the first must be the 'default' policy's"):
        PolicyWorker(worker_spec(make_config("model.lora.enabled=true")))
