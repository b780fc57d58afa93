"""model.offload_frozen: the text encoders and the VAE live on the CPU and move to model.device only for the calls
that use them, with outputs bit-identical to keeping them on the device.

On a CPU-only machine the move is no move; the tests load the model with device "cpu:0" (the CPU under another
name) so that a move to the device and a move back read differently in the recorded `.to` calls."""

from __future__ import annotations

import numpy as np
import torch

HOME, DEVICE = "cpu", "cpu:0"


def _record(model, monkeypatch) -> list[tuple[str, str]]:
    """Events on the model's frozen components, in order: ("to <device>", name) for each move (models/offload.py's
    HostResident; "to cpu": back to the host copy) and ("forward", name)."""
    from diffusion_rl.models.offload import HostResident

    events = []
    names = {id(getattr(model.pipeline, n)): n for n in model.frozen_components if getattr(model.pipeline, n, None)}
    to_device, to_host = HostResident.to_device, HostResident.to_host

    def record_to_device(resident, device):
        events.append((f"to {torch.device(device)}", names[id(resident.module)]))
        to_device(resident, device)

    def record_to_host(resident):
        events.append((f"to {HOME}", names[id(resident.module)]))
        to_host(resident)

    monkeypatch.setattr(HostResident, "to_device", record_to_device)
    monkeypatch.setattr(HostResident, "to_host", record_to_host)
    for name in model.frozen_components:
        module = getattr(model.pipeline, name, None)
        if module is None:
            continue
        forward = "encoder" if name == "vae" else None  # the VAE's encoder and decoder are called, not the VAE
        hooked = [module.encoder, module.decoder] if forward else [module]
        for part in hooked:
            part.register_forward_pre_hook(lambda *_, _name=name: events.append(("forward", _name)))
    return events


def _trace(events, name):
    """The events of one component, consecutive forwards collapsed into one."""
    out = []
    for event, who in events:
        if who == name and not (event == "forward" and out and out[-1] == "forward"):
            out.append(event)
    return out


def test_each_call_holds_only_its_components_on_the_device(tiny_model_dir, load, monkeypatch):
    model = load(tiny_model_dir, device=DEVICE, offload_frozen=True)
    assert all(p.device.type == "cpu" for p in model.vae.parameters())
    events = _record(model, monkeypatch)
    texts = [n for n in model.frozen_components if n != "vae"]

    cond = model.encode_prompts(["a red cube", "a blue ball"], ["", "blurry"])
    for name in texts:
        assert _trace(events, name) == [f"to {DEVICE}", "forward", f"to {HOME}"], name
    assert _trace(events, "vae") == []

    events.clear()
    images = model.decode(torch.randn(2, *model.latent_shape(32, 32)))
    latents = model.encode(images)
    assert _trace(events, "vae") == [f"to {DEVICE}", "forward", f"to {HOME}"] * 2
    assert all(_trace(events, name) == [] for name in texts)
    assert cond.batch_size == torch.Size([2]) and latents.shape[0] == 2


def test_an_editing_familys_nested_vae_call_moves_it_once(flux_kontext_model_dir, load, monkeypatch):
    # FLUX.1 Kontext's encode_prompts encodes the condition images through `encode` (nested in the text call)
    model = load(flux_kontext_model_dir, device=DEVICE, offload_frozen=True)
    events = _record(model, monkeypatch)
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    model.encode_prompts(["make it red"], None, [[image]])
    assert _trace(events, "vae") == [f"to {DEVICE}", "forward", f"to {HOME}"]
    assert _trace(events, "text_encoder") == [f"to {DEVICE}", "forward", f"to {HOME}"]


def test_without_offload_nothing_moves(tiny_model_dir, load, monkeypatch):
    model = load(tiny_model_dir)
    events = _record(model, monkeypatch)
    model.decode(torch.randn(1, *model.latent_shape(32, 32)))
    model.encode_prompts(["a red cube"])
    assert [e for e, _ in events if e != "forward"] == []


def test_outputs_are_bit_identical_with_and_without_offload(tiny_model_dir, load):
    kept, offloaded = load(tiny_model_dir), load(tiny_model_dir, offload_frozen=True)
    prompts, negative = ["a red cube", "green grass"], ["", "blurry"]
    a, b = kept.encode_prompts(prompts, negative), offloaded.encode_prompts(prompts, negative)
    assert all(torch.equal(a[k], b[k]) for k in list(a.keys()))  # a TensorDict iterates over its rows
    latents = torch.randn(2, *kept.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    images = kept.decode(latents)
    assert torch.equal(images, offloaded.decode(latents))
    assert torch.equal(kept.encode(images), offloaded.encode(images))


def test_a_training_run_with_offload_gets_identical_rewards(make_config, tmp_path):
    from diffusion_rl.trainer import make_trainer

    def rows(offload: bool):
        cfg = make_config(f"model.offload_frozen={str(offload).lower()}", f"run.dir={tmp_path / str(offload)}")
        return make_trainer(cfg).train()

    for plain, offloaded in zip(rows(False), rows(True), strict=True):
        assert offloaded["reward/mean"] == plain["reward/mean"]
        assert offloaded["loss"] == plain["loss"]
        assert offloaded["grad_norm"] == plain["grad_norm"]


def test_text_encoders_loaded_late_for_the_embedding_cache_also_live_on_the_cpu(tiny_model_dir, monkeypatch):
    from diffusion_rl.config.model import ModelConfig
    from diffusion_rl.models.loader import load_model, load_text_encoders

    cfg = ModelConfig(path=str(tiny_model_dir), device=DEVICE, max_sequence_length=16, offload_frozen=True)
    model = load_model(cfg, text_encoders=False)  # as a run with an embedding cache starts
    moves, move = [], torch.nn.Module.to

    def to(module, *args, **kwargs):
        moves.append(str(torch.device(args[0] if args else kwargs["device"])))
        return move(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    load_text_encoders(model, tiny_model_dir)  # the cache lacks a text
    assert moves and set(moves) == {HOME}
    monkeypatch.undo()
    events = _record(model, monkeypatch)
    model.encode_prompts(["a red cube"])
    for name in (n for n in model.frozen_components if n != "vae"):
        assert _trace(events, name) == [f"to {DEVICE}", "forward", f"to {HOME}"], name


def test_filling_the_embedding_cache_brings_the_text_encoders_to_the_device(
    tiny_model_dir, load, tmp_path, monkeypatch
):
    from diffusion_rl.models.embedding_cache import use_embedding_cache

    model = load(tiny_model_dir, device=DEVICE, offload_frozen=True)
    texts = [n for n in model.frozen_components if n != "vae"]
    events = _record(model, monkeypatch)
    use_embedding_cache(model, tiny_model_dir, tmp_path / "cache", ["a red cube", ""])
    for name in texts:
        assert _trace(events, name) == [f"to {DEVICE}", "forward", f"to {HOME}"], name


def test_going_out_copies_the_host_copy_and_coming_back_copies_nothing():
    # the device copies are spoiled before coming back: the weights come back intact, in the same storage as before
    # (nothing copied back); a tied weight stays tied and a Parameter; buffers travel too
    from diffusion_rl.models.offload import HostResident

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4))
    module[2].weight = module[0].weight
    before = {k: v.clone() for k, v in module.state_dict().items()}
    resident = HostResident(module)
    resident.to_host()
    host_pointers = {k: v.data_ptr() for k, v in module.state_dict().items()}
    resident.to_device(torch.device(DEVICE))
    out = module.state_dict()
    assert all(torch.equal(out[k], before[k]) and out[k].data_ptr() != host_pointers[k] for k in before)
    assert module[2].weight is module[0].weight
    for tensor in out.values():
        tensor.zero_()
    resident.to_host()
    back = module.state_dict()
    assert all(torch.equal(back[k], before[k]) for k in before)
    assert {k: v.data_ptr() for k, v in back.items()} == host_pointers
    assert isinstance(module[0].weight, torch.nn.Parameter) and module[2].weight is module[0].weight
