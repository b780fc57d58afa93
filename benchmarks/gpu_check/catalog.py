"""The GPU check's parts by name: what runs, in which order, under which time cap (benchmarks/gpu_check.py runs them).

A table of its own, above every part's module (parts.py and the A/B parts built on its helpers), so no part imports
another's module back.
"""

from __future__ import annotations

from .alloc_ab import alloc_ab_part
from .checkpoint_ab import checkpoint_ab_part
from .cudnn_ab import cudnn_ab_part
from .defaults_ab import defaults_ab_part
from .encoders import encoders_part
from .fsdp2_compiled import fsdp2_compiled_part
from .host_syncs import host_syncs_part
from .kernel_profile import kernel_profile_part
from .parts import attention_part, compile_part, device_part, fsdp2_part, model_part, replay_part

# name → (function, time cap in seconds), in the order they run: what matters most first (cudnn_ab, alloc_ab,
# defaults_ab, checkpoint_ab, fsdp2_compiled, encoders, kernel_profile and wan22_a14b_lora, past the default budget,
# run with --only)
PARTS = {
    "device": (device_part, 30),
    "sd35_lora": (model_part("sd35_lora"), 80),
    "replay": (replay_part, 70),
    "flux_lora": (model_part("flux_lora"), 70),
    "wan21_lora": (model_part("wan21_lora"), 100),
    "sd35_full": (model_part("sd35_full"), 80),
    "compile": (compile_part, 120),
    "qwen_image_lora": (model_part("qwen_image_lora"), 80),
    "attention": (attention_part, 60),
    "fsdp2": (fsdp2_part, 45),
    "host_syncs": (host_syncs_part, 45),
    "flux2_klein_lora": (model_part("flux2_klein_lora"), 60),
    "z_image_lora": (model_part("z_image_lora"), 60),
    "wan22_ti2v_lora": (model_part("wan22_ti2v_lora"), 80),
    "cudnn_ab": (cudnn_ab_part, 150),
    "alloc_ab": (alloc_ab_part, 170),
    "defaults_ab": (defaults_ab_part, 260),
    "checkpoint_ab": (checkpoint_ab_part, 170),
    "fsdp2_compiled": (fsdp2_compiled_part, 180),
    "encoders": (encoders_part, 90),
    "kernel_profile": (kernel_profile_part, 200),
    "wan22_a14b_lora": (model_part("wan22_a14b_lora"), 150),
}
