"""model.attention_backend: the transformer's attention through one of diffusers' dispatcher backends, the same
velocity as the default within float tolerance; unusable choices refused with the key and what is installed."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.config.model import ModelConfig
from diffusion_rl.errors import UserError
from diffusion_rl.models.attention import installed_backends
from diffusion_rl.models.policies import REFERENCE

DISPATCHED = ["flux", "qwen_image", "wan"]  # families whose attention processors go through the dispatcher


def _backends(model) -> set:
    from diffusers.models.attention_dispatch import AttentionBackendName

    values = {getattr(m.processor, "_attention_backend", None) for m in model.policies.trained.modules()
              if getattr(m, "processor", None) is not None}  # fmt: skip
    return {v.value if isinstance(v, AttentionBackendName) else v for v in values}


@pytest.mark.parametrize("family", DISPATCHED)
@pytest.mark.parametrize("backend", ["native", "_native_math"])
def test_a_cpu_backend_gives_the_default_velocity(family_dirs, load, velocity_of, family, backend):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    default, chosen = load(family_dirs[family]), load(family_dirs[family], attention_backend=backend)
    assert _backends(default) == {None} and _backends(chosen) == {backend}
    assert _AttentionBackendRegistry._active_backend == active  # the process's default is left alone
    v_default, v_chosen = velocity_of(default, guidance=4.5), velocity_of(chosen, guidance=4.5)
    assert torch.allclose(v_chosen, v_default, atol=1e-5, rtol=1e-5), (v_chosen - v_default).abs().max()


def test_full_fine_tunings_frozen_copies_keep_the_backend(family_dirs, load):
    model = load(family_dirs["flux"], attention_backend="_native_math")
    model.policies.keep_reference()
    copy = model.policies.frozen_copies()[REFERENCE]
    assert {getattr(m.processor, "_attention_backend", None).value for m in copy.modules()
            if getattr(m, "processor", None) is not None} == {"_native_math"}  # fmt: skip


@pytest.mark.skipif("flash" in installed_backends(), reason="flash-attn is installed here")
def test_a_backend_without_its_package_is_refused_naming_the_installed_ones(family_dirs, load):
    with pytest.raises(UserError, match=r"model.attention_backend=flash is not usable here .*flash-attn.*installed: "
                                        r"sdpa, .*native"):  # fmt: skip
        load(family_dirs["flux"], attention_backend="flash")


def test_a_family_outside_the_dispatcher_refuses_a_backend(tiny_model_dir, load):
    with pytest.raises(UserError, match="the sd3 transformer's attention .* does not go through diffusers' attention "
                                        "dispatcher; use model.attention_backend=sdpa"):  # fmt: skip
        load(tiny_model_dir, attention_backend="native")


def test_an_unknown_backend_is_refused_with_a_suggestion():
    with pytest.raises(ValueError, match="model.attention_backend 'flsh' is not an attention backend .*did you "
                                         "mean 'flash'.*known: sdpa, "):  # fmt: skip
        ModelConfig(attention_backend="flsh")
    with pytest.raises(ValueError, match="'flash_hub' is not an attention backend"):
        ModelConfig(attention_backend="flash_hub")  # downloads its kernel from the Hub: not offered


@pytest.mark.parametrize("device, cudnn_after", [("cuda", False), ("cpu", True)])
def test_sdpa_on_cuda_leaves_torchs_cudnn_kernel_off(device, cudnn_after):
    # On an H200 the cuDNN kernel's backward failed on FLUX.1-dev's LoRA step (benchmarks/RESULTS.md, GPU check):
    # the default backend keeps torch from choosing it on CUDA and leaves the CPU's settings alone.
    from torch import nn

    from diffusion_rl.models.attention import set_attention_backend

    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        set_attention_backend(nn.Linear(2, 2), "sdpa", "flux", torch.device(device))
        assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn_after
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("device, warned", [("cuda", True), ("cpu", False)])
def test_torchs_cudnn_kernel_asked_for_on_cuda_is_warned_about(family_dirs, load, caplog, device, warned):
    # run 9 of the GPU check: FLUX.1-dev's LoRA got non-finite gradients from it (runs 3-5: an illegal memory access)
    from diffusion_rl.models.attention import set_attention_backend

    transformer = load(family_dirs["flux"]).policies.trained
    with caplog.at_level("WARNING", logger="diffusion_rl.models.attention"):
        set_attention_backend(transformer, "_native_cudnn", "flux", torch.device(device))
    assert ("non-finite gradients" in caplog.text and "train/skipped_updates" in caplog.text) is warned
