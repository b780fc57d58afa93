"""Policies of the tiny SD3 model: LoRA adapters vs the base, named policies, EMA, full fine-tuning copies."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.models.loader import load_model
from diffusion_rl.models.policies import DEFAULT


def _load(path, lora: bool):
    lora_cfg = LoraConfig(enabled=lora, rank=4, alpha=8)
    return load_model(ModelConfig(path=str(path), device="cpu", max_sequence_length=16, lora=lora_cfg))


@pytest.fixture
def lora_model(tiny_model_dir):
    return _load(tiny_model_dir, lora=True)


@pytest.fixture
def full_model(tiny_model_dir):
    return _load(tiny_model_dir, lora=False)


@pytest.fixture
def probe(lora_model):
    """(latents [2, C, h, w], σ, cond): a fixed input to compare velocities on."""
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn((2, *lora_model.latent_shape(32, 32)), generator=generator)
    return latents, 0.6, lora_model.encode_prompts(["a red cube", "a blue ball"])


def _velocity(model, probe, guidance: float = 1.0) -> torch.Tensor:
    latents, sigma, cond = probe
    with torch.no_grad():
        return model.velocity(latents, sigma, cond, guidance)


@torch.no_grad()
def _perturb(tensors, seed: int = 1, scale: float = 0.1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in tensors:
        p.add_(scale * torch.randn(p.shape, generator=generator))


def _lora_params(model, adapter: str) -> list[torch.nn.Parameter]:
    return [p for n, p in model.policies.trained.named_parameters() if "lora_" in n and f".{adapter}." in n]


def _trainable_names(model) -> list[str]:
    return [n for n, p in model.policies.trained.named_parameters() if p.requires_grad]


def test_lora_starts_as_the_base_model(tiny_model_dir, lora_model, probe):
    base = _load(tiny_model_dir, lora=False)
    v_base = _velocity(base, probe)
    assert torch.equal(_velocity(lora_model, probe), v_base)  # LoRA B = 0 at init
    assert torch.equal(_velocity(lora_model, probe, guidance=4.5), _velocity(base, probe, guidance=4.5))


def test_lora_reference_is_the_base_after_training(tiny_model_dir, lora_model, probe):
    v_base = _velocity(_load(tiny_model_dir, lora=False), probe)
    _perturb(_lora_params(lora_model, DEFAULT))
    v_trained = _velocity(lora_model, probe)
    assert not torch.allclose(v_trained, v_base, atol=1e-4)
    with lora_model.reference():
        assert torch.equal(_velocity(lora_model, probe), v_base)
    assert torch.equal(_velocity(lora_model, probe), v_trained)  # the adapter is back on after the block


def test_named_policy_keeps_the_weights_it_was_added_with(lora_model, probe):
    v_start = _velocity(lora_model, probe)
    _perturb(_lora_params(lora_model, DEFAULT), seed=1)
    v_old = _velocity(lora_model, probe)
    lora_model.policies.add("old")
    assert sorted(lora_model.policies.names()) == ["default", "old"]
    with lora_model.using("old"):
        assert torch.equal(_velocity(lora_model, probe), v_old)  # a copy of default as it was at add()
    _perturb(_lora_params(lora_model, DEFAULT), seed=2)
    v_new = _velocity(lora_model, probe)
    assert not torch.allclose(v_new, v_old, atol=1e-4) and not torch.allclose(v_new, v_start, atol=1e-4)
    with lora_model.using("old"):
        assert torch.equal(_velocity(lora_model, probe), v_old)
    assert torch.equal(_velocity(lora_model, probe), v_new)


def test_using_an_unknown_policy_lists_the_known_ones(lora_model):
    with pytest.raises(KeyError, match="default"), lora_model.using("ema"):
        pass


def test_only_default_lora_weights_are_trainable_whatever_the_active_adapter(lora_model):
    expected = _trainable_names(lora_model)
    assert expected and all(".default." in n and "lora_" in n for n in expected)
    lora_model.policies.add("old")
    assert _trainable_names(lora_model) == expected
    with lora_model.using("old"):
        assert _trainable_names(lora_model) == expected
        assert lora_model.policies.trained.active_adapter == "old"
    assert _trainable_names(lora_model) == expected
    assert lora_model.policies.trained.active_adapter == DEFAULT
    trainable_ids = {id(p) for p in lora_model.trainable_parameters()}
    assert trainable_ids == {id(p) for p in _lora_params(lora_model, DEFAULT)}


def test_ema_update_moves_the_target_towards_the_source(lora_model):
    policies = lora_model.policies
    policies.add("ema")
    default, ema = policies.state_dict_of(DEFAULT), policies.state_dict_of("ema")
    key = next(k for k in default if "lora_A" in k)
    source = torch.full_like(default[key], 2.0)
    target = torch.arange(default[key].numel(), dtype=torch.float32).reshape(default[key].shape)
    policies.load_state_dict_of(DEFAULT, {**default, key: source})
    policies.load_state_dict_of("ema", {**ema, key: target})
    policies.ema_update("ema", DEFAULT, decay=0.9)
    # target ← d·target + (1 − d)·source, element by element: 0.9·k + 0.1·2
    expected = torch.tensor([0.9 * k + 0.2 for k in range(target.numel())]).reshape(target.shape)
    assert torch.allclose(policies.state_dict_of("ema")[key], expected, atol=1e-6)
    assert torch.equal(policies.state_dict_of(DEFAULT)[key], source)  # the source is untouched


def test_copy_makes_the_target_equal_to_the_source(lora_model, probe):
    lora_model.policies.add("old")
    _perturb(_lora_params(lora_model, DEFAULT))
    lora_model.policies.copy("old", DEFAULT)
    with lora_model.using("old"):
        v_old = _velocity(lora_model, probe)
    assert torch.equal(v_old, _velocity(lora_model, probe))


def test_full_finetuning_reference_stays_fixed(full_model, probe):
    v_start = _velocity(full_model, probe)
    with pytest.raises(RuntimeError, match="keep_reference"), full_model.reference():
        pass
    full_model.policies.keep_reference()
    assert len(full_model.trainable_parameters()) == len(list(full_model.policies.trained.parameters()))
    _perturb(full_model.trainable_parameters(), scale=0.01)
    v_trained = _velocity(full_model, probe)
    assert not torch.allclose(v_trained, v_start, atol=1e-4)
    with full_model.reference():
        assert torch.equal(_velocity(full_model, probe), v_start)
    assert torch.equal(_velocity(full_model, probe), v_trained)


def test_full_finetuning_named_copy_and_ema(full_model, probe):
    policies = full_model.policies
    v_start = _velocity(full_model, probe)
    policies.add("old")
    _perturb(full_model.trainable_parameters(), scale=0.01)
    with full_model.using("old"):
        assert torch.equal(_velocity(full_model, probe), v_start)
        assert not any(p.requires_grad for p in policies.module.parameters())  # a frozen copy
    before = policies.state_dict_of("old")
    source = policies.state_dict_of(DEFAULT)
    policies.ema_update("old", DEFAULT, decay=0.75)
    after = policies.state_dict_of("old")
    for name, value in after.items():
        assert torch.allclose(value, 0.75 * before[name] + 0.25 * source[name], atol=1e-6), name


@pytest.mark.parametrize("lora", [True, False])
def test_trainable_state_dict_round_trip(tiny_model_dir, probe, lora):
    model = _load(tiny_model_dir, lora=lora)
    _perturb(model.trainable_parameters(), seed=3, scale=0.01)
    saved = model.policies.trainable_state_dict()
    assert all(".default." not in name for name in saved)  # names carry no adapter tag
    v_saved = _velocity(model, probe)
    _perturb(model.trainable_parameters(), seed=4, scale=0.01)
    assert not torch.allclose(_velocity(model, probe), v_saved, atol=1e-4)
    model.policies.load_state_dict_of(DEFAULT, saved)
    assert torch.equal(_velocity(model, probe), v_saved)
    current = model.policies.trainable_state_dict()
    assert current.keys() == saved.keys() and all(torch.equal(current[k], saved[k]) for k in saved)


def test_load_state_dict_of_rejects_mismatched_names(lora_model):
    saved = lora_model.policies.trainable_state_dict()
    key = next(iter(saved))
    with pytest.raises(ValueError, match="missing"):
        lora_model.policies.load_state_dict_of(DEFAULT, {k: v for k, v in saved.items() if k != key})
    with pytest.raises(ValueError, match="unexpected"):
        lora_model.policies.load_state_dict_of(DEFAULT, {**saved, "extra.weight": torch.zeros(1)})
