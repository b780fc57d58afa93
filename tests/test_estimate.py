"""`diffusion-rl estimate`: the FLOP count of a small SD3 transformer on the meta device against a count derived by
hand, the text-encoder and memory formulas, the roofline, the JSON contract, every ready config without weights,
and the errors."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from diffusion_rl.cli import main
from diffusion_rl.config import load
from diffusion_rl.errors import UserError
from diffusion_rl.estimate.architectures import Architecture, Encoder, architecture_for, from_shipped, shipped
from diffusion_rl.estimate.counting import (
    PeakLive,
    Shapes,
    VaeCost,
    counting_traffic,
    transformer_cost,
    vae_decode_cost,
)
from diffusion_rl.estimate.devices import DEVICES, device_of_name, peak_flops_of
from diffusion_rl.estimate.estimator import estimate, lora_params
from diffusion_rl.models.doctor import count_saved_tensors

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/quickstart_flow_grpo.yaml")

# a small SD3 transformer: 2 joint blocks (the last one context-pre-only), inner dim D = 4 heads × 16 = 64
D, C, P, J, POOLED, LAYERS = 64, 4, 2, 32, 32, 2
SMALL_SD3 = dict(sample_size=32, patch_size=P, in_channels=C, num_layers=LAYERS, attention_head_dim=16,
                 num_attention_heads=4, joint_attention_dim=J, caption_projection_dim=D, pooled_projection_dim=POOLED,
                 out_channels=C, pos_embed_max_size=32)  # fmt: skip


def sd3_forward_flops_by_hand(B: int, height_latent: int, width_latent: int, L: int) -> int:
    """Forward FLOPs of SMALL_SD3, a matmul m×k by k×n counted 2·m·n·k, written out layer by layer."""
    N = (height_latent // P) * (width_latent // P)  # image tokens
    T = N + L  # joint attention runs over image and text tokens
    per_row = 0
    per_row += 2 * N * D * (C * P * P)  # patch embedding: a P×P convolution, stride P
    per_row += 2 * (256 * D + D * D)  # timestep embedding: sinusoid(256) → D → D
    per_row += 2 * (POOLED * D + D * D)  # pooled text → D → D
    per_row += 2 * L * J * D  # context embedder
    for i in range(LAYERS):
        last = i == LAYERS - 1  # context_pre_only: the text stream stops after this block's attention
        per_row += 2 * D * 6 * D  # AdaLN-zero of the image stream (scale, shift, gate for attention and MLP)
        per_row += 2 * D * (2 * D if last else 6 * D)  # the text stream's: continuous AdaLN in the last block
        per_row += 3 * 2 * N * D * D + 3 * 2 * L * D * D  # q, k, v of both streams
        per_row += 2 * T * T * D + 2 * T * T * D  # softmax(QKᵀ)·V over all heads: two T×T×D products
        per_row += 2 * N * D * D + (0 if last else 2 * L * D * D)  # output projections
        per_row += 2 * (2 * N * D * 4 * D)  # image MLP D → 4D → D
        per_row += 0 if last else 2 * (2 * L * D * 4 * D)  # text MLP
    per_row += 2 * D * 2 * D  # final AdaLN
    per_row += 2 * N * D * (P * P * C)  # unpatchify projection
    return B * per_row


def small_sd3_arch() -> Architecture:
    vae = {"in_channels": 3, "out_channels": 3, "latent_channels": C, "down_block_types": ["DownEncoderBlock2D"] * 2,
           "up_block_types": ["UpDecoderBlock2D"] * 2, "block_out_channels": [8, 16], "layers_per_block": 1,
           "norm_num_groups": 8}  # fmt: skip
    return Architecture("small sd3", "sd3", "SD3Transformer2DModel", SMALL_SD3, "AutoencoderKL", vae, [])


def test_forward_flops_of_a_small_sd3_transformer_match_the_count_by_hand():
    arch = small_sd3_arch()  # VAE 2× down: 32 px → a 16 × 16 latent
    cost = transformer_cost(arch, Shapes(batch=2, height=32, width=32, frames=1, text=10), full_finetune=True,
                            dtype=torch.float32)  # fmt: skip
    assert cost.forward_flops == sd3_forward_flops_by_hand(2, 16, 16, 10)
    # full fine-tuning: every matmul's backward is two matmuls of its size (grad of input and of weight), except
    # where no gradient is needed (the patch embedding's input): between 2× and 3× the forward, never outside
    assert 2.5 * cost.forward_flops < cost.train_flops <= 3 * cost.forward_flops
    assert cost.params == sum(p.numel() for p in _real_small_sd3().parameters())


def _real_small_sd3():
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(**SMALL_SD3)


def test_lora_backward_costs_about_one_forward_full_backward_two():
    arch = small_sd3_arch()
    shapes = Shapes(batch=2, height=32, width=32, frames=1, text=10)
    lora = transformer_cost(arch, shapes, full_finetune=False, dtype=torch.float32)
    full = transformer_cost(arch, shapes, full_finetune=True, dtype=torch.float32)
    assert lora.forward_flops == full.forward_flops
    # LoRA: only the activations' gradients (≈ 1 forward; attention's backward is 4 T×T products to its forward's 2,
    # a large share at this width); full: the weights' too (≈ 2 forwards)
    assert 1.9 * lora.forward_flops < lora.train_flops < 2.3 * lora.forward_flops
    assert full.train_flops - lora.train_flops > 0.8 * full.forward_flops


def test_saved_bytes_on_meta_count_each_storage_once_and_skip_attention_matrices():
    x = torch.empty(3, 5, device="meta", requires_grad=True)
    with count_saved_tensors() as saved:
        y = x * x  # saves x (one storage, twice)
    assert saved[0] == 3 * 5 * 4
    scores = torch.empty(2, 7, 7, device="meta", requires_grad=True)
    with count_saved_tensors(sequence=7) as saved:
        torch.softmax(scores, -1) * 2.0  # softmax saves its [2, 7, 7] output: an attention matrix, not counted
    assert saved[0] == 0
    del y


def test_traffic_counts_the_bytes_of_the_memory_bound_ops_only():
    bf16 = dict(device="meta", dtype=torch.bfloat16)
    x, w, big = torch.empty(4, 8, **bf16), torch.empty(8, 8, **bf16), torch.empty(512, 512, **bf16)
    with counting_traffic() as traffic:
        y = x * 2  # reads x (64 B), writes y (64 B)
        x.t()  # a view: moves nothing
        y @ w  # 2·4·8·8 = 512 FLOPs over 64 + 128 + 64 B: 2 FLOP/B, memory-bound
        big @ big  # 2·512³ FLOPs over 3·512²·2 B: 171 FLOP/B, compute-bound (its FLOPs are the first term)
    assert traffic.bytes == 128 + 256


def test_attention_moves_what_a_fused_kernel_moves_and_keeps_the_math_paths_flops():
    from torch.utils.flop_counter import FlopCounterMode

    def run(traffic: bool):
        q, k, v = (torch.empty(1, 2, 16, 8, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
        grad = torch.empty(1, 2, 16, 8, device="meta", dtype=torch.bfloat16)  # each of the five: 256 numbers, 512 B
        with FlopCounterMode(display=False) as flops, counting_traffic() if traffic else contextlib.nullcontext() as t:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            forward = t.bytes if traffic else None
            torch.autograd.backward(out, grad)
        return flops.get_total_flops(), forward, t.bytes if traffic else None

    plain, fused = run(False), run(True)
    assert fused[0] == plain[0] == 3 * 2 * (2 * 2 * 16 * 16 * 8)  # 2 products forward, 4 backward, 2·16·16·8 each
    assert fused[1] == 4 * 512  # q, k, v read, the output written
    assert fused[2] == 4 * 512 + 5 * 512 + 3 * 512  # + q, k, v, the output and its gradient read, 3 gradients written


def test_peak_live_bytes_count_each_storage_while_a_tensor_holds_it():
    x = torch.empty(1024, device="meta")  # 4 KiB, made before: not counted
    with PeakLive() as live:
        a = x * 2  # 4 KiB live
        b = a * 2  # 8 KiB: the peak
        del a  # 4 KiB
        c = b.view(-1)  # a view of b's storage: nothing new
        del b  # c still holds the storage
        d = c[:512] + 1  # 2 KiB more: 6 KiB
    assert live.peak == 8192 and live.now == 6144
    del c, d


def test_text_encoder_flops_per_token_are_matmuls_plus_attention():
    enc = Encoder("t", "t5", layers=2, hidden=8, ffn=16, q_dim=8, kv_dim=4, gated=True, vocab=100)
    per_layer = 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16  # q and o, k and v (grouped), three MLP matrices
    assert enc.params == 2 * per_layer
    tokens = 5
    loop = 0
    for _ in range(2):
        loop += 2 * per_layer * tokens + 2 * tokens * tokens * 8 * 2
    assert enc.forward_flops(tokens) == loop
    assert enc.weight_params == enc.params + 100 * 8


def test_lora_params_count_rank_times_in_plus_out_of_each_target():
    net = torch.nn.Sequential()
    net.add_module("attn", torch.nn.Module())
    net.attn.to_q = torch.nn.Linear(10, 20)
    net.attn.to_k = torch.nn.Linear(10, 30)
    net.add_module("other", torch.nn.Linear(10, 10))
    assert lora_params(net, ("to_q", "to_k"), rank=4) == 4 * (10 + 20) + 4 * (10 + 30)


def test_device_table_matches_reported_names_and_reads_overrides():
    assert device_of_name("NVIDIA H100 80GB HBM3").key == "h100"
    assert device_of_name("NVIDIA H100 PCIe").key == "h100-pcie"
    assert device_of_name("NVIDIA A100-SXM4-40GB").key == "a100-40gb"
    assert device_of_name("NVIDIA H200").key == "h200"
    assert device_of_name("Some CPU") is None and peak_flops_of("Some CPU") is None
    assert peak_flops_of("Some CPU", 2.0) == 2e12
    assert peak_flops_of("NVIDIA H800") == pytest.approx(989.4e12)


def test_roofline_time_is_flops_at_peak_plus_memory_bound_bytes_at_bandwidth():
    cfg = load(QUICKSTART)
    arch = architecture_for(cfg.model)
    fast = DEVICES["cpu"].with_overrides(peak_tflops=1.0, bandwidth_gbs=1e9)  # compute-bound
    slow_memory = DEVICES["cpu"].with_overrides(peak_tflops=1e9, bandwidth_gbs=1.0)  # memory-bound
    a = estimate(cfg, arch, fast, 1, efficiency=0.5)
    b = estimate(cfg, arch, slow_memory, 1, efficiency=0.5)
    # compute-bound: the rollout phase takes its FLOPs at half of 1 TFLOP/s
    rollout_flops = a.flops_rollout
    assert a.phase_seconds["rollout"] + a.phase_seconds["encode_prompts"] + a.phase_seconds["decode"] == pytest.approx(
        rollout_flops / 0.5e12, rel=1e-4
    )
    assert a.step_seconds == pytest.approx(a.flops_per_step / 0.5e12, rel=0.01)
    # memory-bound: the rollout streams the transformer's weights once per sampling step, and its memory-bound ops
    # move their bytes: 8 images × 10 steps × CFG's 2 rows, each row's share of one call's traffic (full fine-tuning)
    transformer = _tiny_transformer(cfg)
    weights = sum(p.numel() for p in transformer.parameters()) * 4
    text = 77 + cfg.model.max_sequence_length
    cost = transformer_cost(arch, Shapes(16, 64, 64, 1, text), full_finetune=True, dtype=torch.float32)
    traffic = 8 * 10 * 2 * cost.forward_traffic / 16
    assert traffic > 0
    assert b.phase_seconds["rollout"] == pytest.approx((10 * weights + traffic) / 1e9 / 0.5, rel=1e-6)
    assert a.images_per_gpu_second == pytest.approx(a.images_per_step / a.step_seconds)
    assert a.gpu_hours == pytest.approx(cfg.train.total_steps * a.step_seconds / 3600)


def _tiny_transformer(cfg):
    from diffusion_rl.models.tiny import build_tiny

    return build_tiny("sd3", cfg.model.create_tiny_if_missing).transformer


def test_estimate_json_contract(capsys):
    assert main(["estimate", QUICKSTART, "--gpu", "h100", "--gpus", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("peak_memory_gib_per_gpu", "step_seconds", "images_per_gpu_second", "gpu_hours"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert out["fits"] is True and out["gpu"] == "h100" and out["gpus"] == 1
    assert out["flops_per_step"] == pytest.approx(out["flops_rollout"] + out["flops_update"])


def test_fits_is_about_the_config_as_it_runs_and_both_peaks_are_reported(capsys):
    # qwen_image_ocr_lora checkpoints: it fits 4 H800s only because of it (125.7 GiB without, 59.6 with)
    qwen = str(Path(__file__).resolve().parents[1] / "configs" / "qwen_image_ocr_lora.yaml")
    runs = {}
    for checkpointing in ("true", "false"):
        argv = [
            "estimate",
            qwen,
            f"model.gradient_checkpointing={checkpointing}",
            "--gpu",
            "h800",
            "--gpus",
            "4",
            "--json",
        ]
        assert main(argv) == 0
        runs[checkpointing] = json.loads(capsys.readouterr().out)
    on, off = runs["true"], runs["false"]
    assert on["peak_memory_gib_per_gpu"] == on["peak_memory_gib_per_gpu_checkpointed"] < 74.5
    assert off["peak_memory_gib_per_gpu"] == off["peak_memory_gib_per_gpu_unchecked"] > 74.5
    assert on["fits"] is True and off["fits"] is False
    for run in (on, off):
        assert run["fits_with_checkpointing"] is True and run["fits_without_checkpointing"] is False
    assert on["step_seconds"] > off["step_seconds"]  # the checkpointed update recomputes its forward


def test_unknown_gpu_is_an_error_listing_the_known_ones(capsys):
    assert main(["estimate", QUICKSTART, "--gpu", "h1000", "--json"]) == 2
    err = capsys.readouterr().err
    assert "unknown device 'h1000'" in err and "did you mean 'h100'" in err
    assert all(key in err for key in DEVICES)


def test_a_low_noise_guidance_for_a_one_transformer_architecture_is_refused(capsys):
    # Wan 2.2 A14B's second expert's guidance: the quickstart's SD3 has one transformer
    assert main(["estimate", QUICKSTART, "--gpu", "h100", "sampling.guidance_low_noise=3"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "sampling.guidance_low_noise=3 sets the guidance of a low-noise expert" in lines[0]
    assert "sd3 model has one transformer" in lines[0]


def test_cpu_needs_a_peak(capsys):
    assert main(["estimate", QUICKSTART, "--gpu", "cpu"]) == 2
    assert "--peak-tflops" in capsys.readouterr().err


# the training configs (shapes_pretrain.yaml is `diffusion-rl pretrain`'s)
TRAINING_CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if p.name != "shapes_pretrain.yaml")


def test_shipped_architectures_name_the_ready_configs_models():
    names = set(shipped())
    configs = [load(str(ROOT / "configs" / c)) for c in TRAINING_CONFIGS]
    real = {Path(c.model.path).name for c in configs if not c.model.create_tiny_if_missing}  # tiny or shipped: not real
    assert real <= names, real - names


@pytest.mark.parametrize("config", TRAINING_CONFIGS)
def test_every_ready_config_estimates_without_weights(config, monkeypatch, tmp_path):
    """Each ready config, its model directory absent: the shipped architecture (or the tiny preset) is used. The
    big transformers are cut to one block of each kind to keep this fast; the counting itself is exact above."""
    from diffusion_rl.estimate import estimator

    monkeypatch.chdir(tmp_path)  # no models/ here
    cfg = load(str(ROOT / "configs" / config))
    arch = architecture_for(cfg.model)
    if arch.name in shipped():
        for key in ("num_layers", "num_single_layers", "n_layers"):
            if key in arch.transformer_config:
                arch.transformer_config[key] = 1
        arch.transformer_config.pop("dual_attention_layers", None)
    monkeypatch.setattr(estimator, "vae_decode_cost", lambda *a, **k: VaeCost(1.0, 1.0, 1))  # video VAEs: slow
    r = estimate(cfg, arch, DEVICES["h100"], cfg.engine.num_workers if cfg.engine.kind == "ray" else 1)
    assert r.step_seconds > 0 and r.peak_memory_gib_per_gpu > 0 and r.flops_update > 0


def test_a_full_size_shipped_transformer_builds_on_meta_without_memory():
    arch = from_shipped("Qwen-Image")
    from diffusion_rl.estimate.counting import build_on_meta

    module = build_on_meta(arch.transformer_class, arch.transformer_config)
    params = sum(p.numel() for p in module.parameters())
    assert 20.3e9 < params < 20.6e9  # Qwen-Image's 20B transformer
    assert all(p.device.type == "meta" for p in module.parameters())


def test_shipped_z_image_turbo_is_its_6b_transformer_and_qwen3_4b():
    from diffusion_rl.estimate.counting import Shapes, build_on_meta, transformer_inputs

    arch = from_shipped("Z-Image-Turbo")
    module = build_on_meta(arch.transformer_class, arch.transformer_config)
    assert 6.1e9 < sum(p.numel() for p in module.parameters()) < 6.2e9  # the model card's 6B
    (qwen3,) = arch.text_encoders  # Qwen3-4B's card: 4.0B parameters, 3.6B without the embeddings
    assert 3.6e9 < qwen3.params < 3.65e9 and 4.0e9 < qwen3.weight_params < 4.05e9
    inputs = transformer_inputs(arch, Shapes(batch=2, height=512, width=512, frames=1, text=100), torch.bfloat16)
    assert len(inputs["x"]) == 2 and inputs["x"][0].shape == (16, 1, 64, 64)  # one [C, F, H/8, W/8] per row
    assert inputs["cap_feats"][0].shape == (100, 2560)


def test_a_model_directory_gives_the_same_architecture_as_its_tiny_preset(tiny_model_dir):
    from diffusion_rl.estimate.architectures import from_tiny

    on_disk = architecture_for(load(QUICKSTART, [f"model.path={tiny_model_dir}"]).model)
    built = from_tiny("sd3", "small")
    assert on_disk.family == "sd3" and on_disk.transformer_class == built.transformer_class
    assert len(on_disk.transformer_config) >= 10
    as_saved = json.loads(json.dumps(built.transformer_config))  # tuples become lists in config.json
    assert on_disk.transformer_config == {k: v for k, v in as_saved.items() if k in on_disk.transformer_config}
    assert [e.params for e in on_disk.text_encoders] == [e.params for e in built.text_encoders]
    from diffusion_rl.models.tiny import build_tiny

    # the shipped ShapesWorld preset is read from its files, not built: the same architecture as the pipeline's
    shipped, pipeline = from_tiny("sd3", "shapes"), build_tiny("sd3", "shapes")
    as_built = json.loads(json.dumps(dict(pipeline.transformer.config)))
    assert shipped.transformer_config == {k: v for k, v in as_built.items() if not k.startswith("_")}
    assert shipped.vae_config["block_out_channels"] == list(pipeline.vae.config.block_out_channels)


def test_text_report_and_bad_numbers(capsys):
    assert main(["estimate", QUICKSTART, "--gpu", "a100", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "2× a100" in out and "GPU-hours" in out and "images/GPU/s" in out and "fits" in out
    assert main(["estimate", QUICKSTART, "--gpus", "0"]) == 2
    assert "--gpus must be ≥ 1" in capsys.readouterr().err


def test_memory_parts_by_hand():
    """Full fine-tuning on one device (fp32): weights P·4, gradients P·4, two moments 2·P·4; the trajectories of the
    8 rows: latents before and after each of the 9 SDE steps, the step means, the final latents (fp32), and the
    prompt and negative embeddings. LoRA on 4 Ray workers: 16 bytes per adapter parameter, sharded 4 ways."""
    cfg = load(QUICKSTART)
    arch = architecture_for(cfg.model)
    transformer = _tiny_transformer(cfg)
    P = sum(p.numel() for p in transformer.parameters())
    r = estimate(cfg, arch, DEVICES["h100"], 1)
    gib = 2**30
    assert r.memory_gib["transformer"] == pytest.approx(P * 4 / gib)
    assert r.memory_gib["trainable_state"] == pytest.approx(3 * P * 4 / gib)
    c = transformer.config
    latent = c.in_channels * (64 // arch.vae_scale) ** 2
    text = 77 + cfg.model.max_sequence_length
    per_row = (9 + 1 + 9 + 1) * latent * 4 + 2 * text * c.joint_attention_dim * 4
    assert r.memory_gib["trajectories"] == pytest.approx(8 * per_row / gib)

    lora = load(QUICKSTART, lora_overrides())
    r4 = estimate(lora, arch, DEVICES["h100"], 4)
    adapters = 0  # the SD3 preset: both streams' attention projections
    ends = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    for name, m in transformer.named_modules():
        if isinstance(m, torch.nn.Linear) and any(name.endswith(f"attn.{e}") for e in ends):
            adapters += 4 * (m.in_features + m.out_features)
    assert adapters > 0
    assert r4.memory_gib["trainable_state"] == pytest.approx(16 * adapters / 4 / gib)
    assert r4.images_per_step == 8 and r4.gpus == 4

    # the EMA's fp32 copy of the trained parameters (sharded like them); the VAE decodes a generate call's rows at
    # once: 8 rows, or 4 per call in 2 score chunks, each its working set
    assert r.memory_gib["ema"] == 0
    with_ema = ["train.ema.enabled=true"]
    ema = estimate(load(QUICKSTART, with_ema), arch, DEVICES["h100"], 1)
    assert ema.memory_gib["ema"] == pytest.approx(P * 4 / gib)
    ema4 = estimate(load(QUICKSTART, [*lora_overrides(), *with_ema]), arch, DEVICES["h100"], 4)
    assert ema4.memory_gib["ema"] == pytest.approx(adapters * 4 / 4 / gib)
    one = vae_decode_cost(arch, 64, 64, 1, torch.float32).peak_bytes
    assert r.memory_gib["vae_working_set"] == pytest.approx(8 * one / gib)
    chunked = estimate(load(QUICKSTART, ["sampling.score_chunks=2"]), arch, DEVICES["h100"], 1)
    assert chunked.memory_gib["vae_working_set"] == pytest.approx(4 * one / gib)
    many = estimate(load(QUICKSTART, ["data.group_size=20"]), arch, DEVICES["h100"], 1)  # 40 rows, 16 at a time
    assert many.memory_gib["vae_working_set"] == pytest.approx(16 * one / gib)


def test_the_rollout_decodes_its_rows_sixteen_at_a_time_in_order():
    from diffusion_rl.models.condition import VAE_ROWS
    from diffusion_rl.sampling.rollout import decode_in_chunks

    class Model:
        calls: ClassVar[list[int]] = []

        def decode(self, latents):
            self.calls.append(len(latents))
            return latents * 2

    latents = torch.arange(40.0)[:, None]
    assert VAE_ROWS == 16
    assert torch.equal(decode_in_chunks(Model(), latents), latents * 2) and Model.calls == [16, 16, 8]


def test_condition_images_are_encoded_once_each_sixteen_at_a_time_and_found_by_their_rows():
    from diffusion_rl.models.condition import condition_latents

    calls = []

    def encode(pixels):  # uint8 [N, H, W, 3] → one number per image: its first pixel
        calls.append(len(pixels))
        return pixels[:, 0, 0, 0].float()

    images = [np.full((2, 2, 3), i, dtype=np.uint8) for i in range(40)]
    rows = [[images[i % 40], images[(7 * i) % 40]] for i in range(80)]  # 80 rows of 2, 40 distinct images
    latents = condition_latents(encode, rows)
    assert calls == [16, 16, 8]  # each distinct image once
    expected = torch.tensor([[i % 40, (7 * i) % 40] for i in range(80)], dtype=torch.float32)
    assert torch.equal(latents, expected)


def test_the_estimate_counts_the_condition_images_encode_once_per_prompt(monkeypatch):
    """An edit's source image through the VAE encoder once per prompt, whatever the group size (a group shares its
    prompt's images): 4 prompts × 4 and 2 prompts × 8 sample the same 16 rows, so their rollouts differ by two prompts'
    encoding (text and, with images, the source), and by the encode of two sources more with images than without."""
    from diffusion_rl.estimate.counting import vae_encode_cost

    monkeypatch.chdir(ROOT)  # the quickstart names its data relative to the repository

    def two_prompts_more(*overrides):
        def rollout(prompts, group):
            cfg = load(ROOT / "configs/quickstart_edit.yaml", [f"data.prompts_per_step={prompts}",
                                                               f"data.group_size={group}", *overrides])  # fmt: skip
            return estimate(cfg, architecture_for(cfg.model), DEVICES["h100"], 1).flops_rollout

        return rollout(4, 4) - rollout(2, 8)

    arch = architecture_for(load(ROOT / "configs/quickstart_edit.yaml").model)
    one = vae_encode_cost(arch, 32, 32, 1).flops  # the model reads its sources at the output size, 32²
    assert one > 0
    with_images, without = two_prompts_more(), two_prompts_more("data.train=prompts.txt")  # a .txt holds no images
    assert with_images - without == pytest.approx(2 * one, rel=1e-9)


def lora_overrides() -> list[str]:
    return ["model.lora.enabled=true", "model.lora.rank=4", "engine.kind=ray", "engine.num_workers=4"]


def test_the_memory_savers_take_their_parts_off():
    cfg = load(QUICKSTART, ["algorithm.flow_grpo.kl_beta=0.04"])
    arch = architecture_for(cfg.model)
    P = sum(p.numel() for p in _tiny_transformer(cfg).parameters())
    base = estimate(cfg, arch, DEVICES["h100"], 1).memory_gib
    savers = ["algorithm.flow_grpo.kl_beta=0.04", "sampling.latents_dtype=bf16", "model.offload_frozen=true",
              "model.offload_reference=true"]  # fmt: skip
    saved = estimate(load(QUICKSTART, savers), arch, DEVICES["h100"], 1).memory_gib
    assert base["reference_copy"] > 0 and saved["reference_copy"] == 0
    assert base["text_encoders"] > 0 and base["vae"] > 0 and saved["text_encoders"] == saved["vae"] == 0
    # 9 SDE steps: 19 window latents and means at 2 bytes instead of 4, the final latents still fp32
    latent = arch.vae_config["latent_channels"] * (64 // arch.vae_scale) ** 2
    assert base["trajectories"] - saved["trajectories"] == pytest.approx(8 * 19 * 2 * latent / 2**30)

    ray = ["engine.kind=ray", "engine.num_workers=2"]
    on_ray = estimate(load(QUICKSTART, ray), arch, DEVICES["h100"], 2).memory_gib
    offloaded = estimate(load(QUICKSTART, [*ray, "engine.fsdp_cpu_offload=true"]), arch, DEVICES["h100"], 2).memory_gib
    assert on_ray["trainable_state"] == pytest.approx((2 * P * 4 / 2 + P * 4) / 2**30)  # moments sharded, gradients
    assert offloaded["trainable_state"] == pytest.approx(P * 4 / 2**30)  # the gradients until they are reduced


def test_every_shipped_vae_decodes_on_meta():
    for name in shipped():
        arch = from_shipped(name)
        cost = vae_decode_cost(arch, 4 * arch.vae_scale, 4 * arch.vae_scale, 1)
        assert cost.flops > 0 and cost.traffic > 0 and cost.peak_bytes > 0, name


def test_estimate_takes_overrides_anywhere(capsys):
    outputs = []
    for argv in (
        [QUICKSTART, "algorithm.loss=nft", "sampling.sde_type=ode", "--gpu", "h100", "--gpus", "8", "--json"],
        [QUICKSTART, "--gpu", "h100", "--gpus", "8", "algorithm.loss=nft", "--json", "sampling.sde_type=ode"],
    ):
        assert main(["estimate", *argv]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1]
    assert main(["estimate", QUICKSTART, "--gpu", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["flops_update"] != outputs[0]["flops_update"] * 8  # nft was applied
    with pytest.raises(SystemExit):  # anything else after the flags is still an error
        main(["estimate", QUICKSTART, "--gpu", "h100", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_tree_rollout_costs_its_evaluations_per_image():
    """configs/quickstart_tree.yaml: splits in two at steps 2 and 5 of 10, so a tree of 4 leaves takes
    3·1 + 3·2 + 4·4 = 25 evaluations, 6.25 per image instead of 10 (the update is the same)."""
    tree_config = str(ROOT / "configs/quickstart_tree.yaml")
    tree = load(tree_config)
    flat = load(tree_config, ["sampling.tree=null"])
    arch = architecture_for(tree.model)
    r_tree, r_flat = (estimate(c, arch, DEVICES["h100"], 1) for c in (tree, flat))
    one_row = transformer_cost(arch, Shapes(1, 64, 64, 1, 77 + 32), full_finetune=True, dtype=torch.float32)
    saved = 8 * (10 - 6.25) * 2 * one_row.forward_flops  # 8 images, CFG's two rows
    assert r_flat.flops_rollout - r_tree.flops_rollout == pytest.approx(saved, rel=1e-9)
    assert r_tree.flops_update == r_flat.flops_update


def test_capacity_is_shown_as_it_is_with_the_headroom_and_a_warning_when_tight(capsys):
    assert main(["estimate", QUICKSTART, "--gpu", "h100", "--json"]) == 0
    peak = json.loads(capsys.readouterr().out)["peak_memory_gib_per_gpu"]
    outputs = {}
    for name, capacity in (("over", peak - 0.004), ("tight", peak * 1.03), ("roomy", peak * 1.5)):
        assert main(["estimate", QUICKSTART, "--gpu", "h100", "--memory-gib", str(capacity)]) == 0
        outputs[name] = capsys.readouterr().out
    # 0.004 GiB short: not rounded up into a capacity the peak fits
    assert f"{peak:.2f} of {peak - 0.004:.2f} GiB: does NOT fit" in outputs["over"]
    assert "headroom" not in outputs["over"]
    assert f"{peak:.2f} of {peak * 1.03:.2f} GiB: fits" in outputs["tight"]
    assert f"headroom           {peak * 0.03:8.2f} (2.9% of the device)" in outputs["tight"]
    assert "WARNING       under 5% of the device's memory is left free" in outputs["tight"]
    assert "(33.3% of the device)" in outputs["roomy"] and "WARNING" not in outputs["roomy"]


def test_a_shipped_architecture_is_read_as_model_family_reads_its_checkpoint():
    """--arch, or a model.path named like a shipped architecture, follows a model directory's rule: Wan 2.2 TI2V under
    model.family wan_i2v is counted as image-to-video; a family that cannot read it is one line."""
    cfg = load(str(ROOT / "configs/wan22_ti2v_5b_dance_lora.yaml")).model
    assert architecture_for(cfg).family == "wan"
    as_i2v = dataclasses.replace(cfg, family="wan_i2v")
    assert architecture_for(as_i2v).family == "wan_i2v"
    assert architecture_for(as_i2v, "Wan2.2-TI2V-5B-Diffusers").family == "wan_i2v"
    with pytest.raises(UserError, match="model.family=flux but the shipped architecture Wan2.2-TI2V-5B-Diffusers holds "
                       "a wan pipeline"):  # fmt: skip
        architecture_for(dataclasses.replace(cfg, family="flux"))


def test_two_experts_hold_and_train_twice_the_weights_at_one_experts_flops():
    """Wan 2.2 A14B: both experts are held and trained (LoRA on each), a transformer call runs one of them."""
    cfg = load(str(ROOT / "configs/wan22_i2v_a14b_lora.yaml"))
    a14b = from_shipped("Wan2.2-I2V-A14B-Diffusers")
    assert a14b.experts == 2 and a14b.family == "wan_i2v" and a14b.transformer_config["in_channels"] == 36
    a14b.transformer_config["num_layers"] = 1  # one block, to keep this fast
    one = dataclasses.replace(a14b, experts=1)
    pair, single = (estimate(cfg, arch, DEVICES["h100"], 8) for arch in (a14b, one))
    assert pair.flops_per_step == single.flops_per_step and pair.step_seconds == pytest.approx(single.step_seconds)
    from diffusion_rl.estimate.counting import build_on_meta

    params = sum(p.numel() for p in build_on_meta(a14b.transformer_class, a14b.transformer_config).parameters())
    # the second expert's bf16 weights, sharded over 8 (the gathered blocks are one expert's either way)
    assert pair.memory_gib["transformer"] - single.memory_gib["transformer"] == pytest.approx(params * 2 / 8 / 2**30)
    for key in ("trainable_state", "ema"):
        assert pair.memory_gib[key] == pytest.approx(2 * single.memory_gib[key]), key
