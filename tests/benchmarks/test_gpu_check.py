"""benchmarks/gpu_check.py: its dry run (the same parts on the CPU at tiny sizes) measures every part and writes the
record a GPU run writes, so the check a GPU session runs in one command cannot rot; a crash or an overrun in one
part is recorded and the rest still run; parts run in spawned processes too; the random text embeddings have the real
encoders' shapes and dtypes; the carried wheels are the versions the suite runs."""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NUMBER = (int, float)
MODEL_KEYS = {"config", "architecture", "images_per_step", "transformer_params", "trainable_params", "build_s",
              "warmup_step_s", "step_s", "rollout_s", "update_s", "images_per_s", "mfu", "flops_per_step",
              "peak_allocated_gib", "peak_reserved_gib", "logp_diff_max", "estimate", "estimate_memory_rel_error",
              "estimate_time_rel_error", "efficiency_fit", "skipped_updates", "grad_norm"}  # fmt: skip


@pytest.fixture(scope="module")
def gpu_check(load_benchmark):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return load_benchmark("gpu_check")


def test_the_dry_run_measures_every_part_and_writes_the_record(tmp_path, gpu_check):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--out", str(tmp_path), "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["schema"] == gpu_check.SCHEMA and record["dry_run"] is True
    assert {"created", "argv", "budget_s", "total_s"} <= record.keys()
    parts = record["parts"]
    assert list(parts) == list(gpu_check.PARTS)
    failed = {name: part.get("error") or part.get("reason") for name, part in parts.items() if part["status"] != "ok"}
    assert not failed
    for part in parts.values():
        assert isinstance(part["seconds"], NUMBER) and part["seconds"] <= part["cap_s"] + 5
    assert parts["device"]["result"]["packages"]["torch"] == torch.__version__
    from gpu_check.summary import MODEL_PARTS

    assert set(MODEL_PARTS) <= set(parts)
    for name in MODEL_PARTS:
        result = parts[name]["result"]
        assert result.keys() >= MODEL_KEYS, name
        assert result["step_s"] > 0 and result["rollout_s"] > 0 and result["update_s"] > 0
        assert result["images_per_s"] > 0 and 0 < result["mfu"] < 1 and result["flops_per_step"] > 0
        assert result["estimate"]["step_s"] > 0 and isinstance(result["estimate_time_rel_error"], float)
        assert result["logp_diff_max"] == 0.0  # the CPU replays the rollout exactly
    assert parts["sd35_full"]["result"]["trainable_params"] == parts["sd35_full"]["result"]["transformer_params"]
    lora = parts["sd35_lora"]["result"]
    assert 0 < lora["trainable_params"] < lora["transformer_params"]
    replay = parts["replay"]["result"]["runs"]
    assert set(replay) == {f"{p}/{s}" for p in ("bf16_weights", "fp32_autocast_bf16", "fp32") for s in ("sde", "cps")}
    assert all(run["logp_diff_max"] == 0.0 for run in replay.values())
    compiled = parts["compile"]["result"]
    assert compiled["eager_step_s"] > 0 and compiled["compiled_step_s"] > 0 and len(compiled["step_times_s"]) == 2
    attention = parts["attention"]["result"]["runs"]
    assert "sdpa" in attention and len(attention) == 2 and all("step_s" in run for run in attention.values())
    fsdp = parts["fsdp2"]["result"]
    assert fsdp["backend"] == "gloo" and fsdp["world_size"] == 1 and fsdp["step_s"] > 0
    syncs = parts["host_syncs"]["result"]  # on the CPU: the calls that would wait on a GPU, none in the hot path
    assert syncs["how"].startswith("HostReads") and syncs["syncs"] > 0 and syncs["hot_path_syncs"] == 0
    assert syncs["hot_path_sites"] == [] and len(syncs["first_sites"]) == 10 and syncs["top_sites"][0][1] >= 1
    from gpu_check.cudnn_ab import DRY_MODELS

    ab = parts["cudnn_ab"]["result"]
    assert list(ab["runs"]) == list(DRY_MODELS) and "no-op" in ab["switch"]
    for runs in ab["runs"].values():
        off, on = runs["cudnn_off"]["result"], runs["cudnn_on"]["result"]
        assert (off["cudnn_sdp_enabled"], on["cudnn_sdp_enabled"]) == (False, True)  # each variant set the switch
        assert off["kernels"] == on["kernels"] and sum(off["kernels"].values()) > 0  # a no-op on the CPU
        assert off["update_s"] > 0 and on["update_s"] > 0 and off["logp_diff_max"] == on["logp_diff_max"] == 0.0
        assert off["skipped_updates"] == on["skipped_updates"] == 0 and off["grad_norm"] > 0  # gradients were finite
        assert runs["update_ratio"] == on["update_s"] / off["update_s"]
    from gpu_check.alloc_ab import DRY_MODELS as ALLOC_MODELS

    assert record["allocator"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # the CLI's default
    alloc = parts["alloc_ab"]["result"]
    assert list(alloc["runs"]) == list(ALLOC_MODELS) and "none on the CPU" in alloc["effect"]
    for runs in alloc["runs"].values():
        fixed, expandable = runs["fixed_blocks"]["result"], runs["expandable"]["result"]
        assert (fixed["allocator_settings"], expandable["allocator_settings"]) == (
            "expandable_segments:False",
            "expandable_segments:True",
        )  # each variant set it before building
        assert fixed["step_s"] > 0 and expandable["step_s"] > 0 and fixed["skipped_updates"] == 0
        assert runs["step_s_ratio"] == expandable["step_s"] / fixed["step_s"]
    from gpu_check.defaults_ab import MODELS as DEFAULTS_MODELS

    defaults = parts["defaults_ab"]["result"]
    assert {n: list(r) for n, r in defaults["runs"].items()} == {n: list(v) for n, v in DEFAULTS_MODELS.items()}
    settings = {"baseline": (False, False), "fused": (False, True), "compiled": (True, False),
                "compiled_cached": (True, False)}  # fmt: skip
    for name, runs in defaults["runs"].items():
        results = {label: run["result"] for label, run in runs.items()}
        # each variant ran with its own settings, whatever the device's auto would give
        assert {k: (r["compile_blocks"], r["fused_adamw"]) for k, r in results.items()} == {
            k: settings[k] for k in results
        }
        for r in results.values():
            assert r["logp_diff_max"] == 0.0 and r["skipped_updates"] == 0 and r["step_s"] > 0
        base, fused = results["baseline"], results["fused"]
        ratio = defaults["ratios"][name]["fused"]
        assert ratio["update_s_ratio"] == fused["update_s"] / base["update_s"]
        # the CPU's fused AdamW computes what its for-loop one does, up to float rounding
        assert ratio["weights_rel_diff"] == abs(fused["weights_l2"] - base["weights_l2"]) / base["weights_l2"] < 1e-5
    from gpu_check.checkpoint_ab import DRY_MODELS as CHECKPOINTED

    checkpointing = parts["checkpoint_ab"]["result"]
    assert {n: list(r) for n, r in checkpointing["runs"].items()} == {n: list(v) for n, v in CHECKPOINTED.items()}
    for name, runs in checkpointing["runs"].items():
        every, auto = runs["true"]["result"], runs["auto"]["result"]
        # the model marks the count asked: every block, and auto's on a pretend device strictly between none and all
        assert every["setting"] is True and every["checkpointed_blocks"] == every["blocks"] == every["planned_blocks"]
        assert auto["free_pretended"] and 0 < auto["setting"] == auto["checkpointed_blocks"] < auto["blocks"]
        assert f"{auto['setting']} of {auto['blocks']} blocks checkpointed" in auto["says"]
        assert every["logp_diff_max"] == auto["logp_diff_max"] == 0.0 and auto["skipped_updates"] == 0
        assert checkpointing["ratios"][name]["auto"]["update_s_ratio"] == auto["update_s"] / every["update_s"]
    fsdp_compiled = parts["fsdp2_compiled"]["result"]
    eager, compiled = (fsdp_compiled["runs"][k]["result"] for k in ("eager", "compiled"))
    assert (eager["compile_blocks"], compiled["compile_blocks"]) == (False, True)  # each its own setting, not PINNED
    assert eager["backend"] == compiled["backend"] == "gloo"
    assert eager["logp_diff_max"] == compiled["logp_diff_max"] == 0.0
    assert fsdp_compiled["ratios"]["step_s_ratio"] == compiled["step_s"] / eager["step_s"]
    encoders = parts["encoders"]["result"]
    from gpu_check.encoders import MODELS as ENCODED

    assert list(encoders) == list(ENCODED)
    for runs in encoders.values():
        held, offloaded = runs["held"], runs["offloaded"]
        assert held["encode_s"] > 0 and offloaded["encode_s"] > 0 and held["prompts"] == offloaded["prompts"] >= 1
        # the tiny encoders weigh what estimate counts for them, within its left-out pieces (the CLIP projections
        # and embeddings: a larger share at tiny sizes than the real ones' 1 %, tests/test_estimate_encoders.py)
        assert held["weights_gib"] == pytest.approx(runs["estimate"]["text_encoders_gib"], rel=0.1)
    profiles = parts["kernel_profile"]["result"]  # the CPU has no device timeline: phases timed, no kernels
    from gpu_check.kernel_profile import RUNS_PROFILED

    assert list(profiles) == list(RUNS_PROFILED)
    for run in profiles.values():
        assert run["step_s"] > 0 and run["top_kernels"] == [] and run["device_s"] == 0
        assert all(p["wall_s"] > 0 and p["busy_s"] == 0 for p in run["phases"].values())
    summary = (tmp_path / "gpu_check.md").read_text()
    assert summary.startswith("# GPU check: CPU (dry run) — CPU toy shapes, no measurement")  # in its title
    headings = ("# GPU check: CPU (dry run)", "## One Flow-GRPO step", "## Rollout replay", "## model.compile_blocks",
                "## model.attention_backend", "## FSDP2 worker", "## Host synchronisations of one step",
                "## torch's cuDNN attention kernel off vs on", "## CUDA's allocator: fixed blocks vs expandable",
                "## CUDA defaults: compiled blocks and fused AdamW", "## Text encoders at real size",
                "## Selective gradient checkpointing",
                "## FSDP2 worker at world size 1, eager vs compiled", "## Where the GPU time goes")  # fmt: skip
    for heading in headings:
        assert heading in summary


def test_a_crash_or_an_overrun_is_recorded_and_the_next_part_still_runs(tmp_path, gpu_check, monkeypatch):
    def boom(ctx):
        raise RuntimeError("no kernel for this")

    def killed(ctx):
        os.kill(os.getpid(), 9)  # as the kernel's out-of-memory killer would

    def endless(ctx):
        ctx.keep({"first_of_several": 1.5})
        time.sleep(60)

    def skipped(ctx):
        raise gpu_check.Skipped("memory says no")

    fine = lambda ctx: {"answer": 42}  # noqa: E731
    parts = {"boom": (boom, 30), "killed": (killed, 30), "skipped": (skipped, 30), "fine": (fine, 30),
             "endless": (endless, 60), "late": (lambda ctx: {}, 30)}  # fmt: skip
    monkeypatch.setattr(gpu_check, "PARTS", parts)
    monkeypatch.setattr(gpu_check, "warm_imports", lambda: None)
    monkeypatch.setattr(gpu_check, "warm_architectures", lambda ctx: None)
    monkeypatch.setattr(gpu_check, "MIN_PART_S", 1.0)
    gpu_check.main(["--out", str(tmp_path), "--dry-run", "--budget", "6"])
    record = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert record["boom"]["status"] == "failed" and "RuntimeError: no kernel for this" in record["boom"]["error"]
    assert record["killed"]["status"] == "failed" and "exit code -9" in record["killed"]["error"]
    # the endless part gets what is left of the budget as its cap (less than its own 60 s), then it is killed
    assert record["endless"]["status"] == "timeout" and record["endless"]["cap_s"] < 6
    assert record["endless"]["seconds"] < 10 and record["endless"]["result"] == {"first_of_several": 1.5}
    assert all(part["status"] in gpu_check.STATUSES for part in record.values())
    assert record["skipped"] == {**record["skipped"], "status": "skipped", "reason": "memory says no"}
    assert record["fine"]["status"] == "ok" and record["fine"]["result"] == {"answer": 42}
    assert record["late"]["status"] == "not_run" and "budget" in record["late"]["reason"]


def test_a_crashing_cudnn_variant_is_recorded_and_the_next_variant_still_runs(tmp_path, gpu_check, monkeypatch):
    from gpu_check import cudnn_ab
    from gpu_check.parts import Context
    from gpu_check.summary import markdown

    def variant(ctx, name, cudnn):  # stands in for a model's step in the variant's own process
        if cudnn and name == "wan21_lora":
            faulthandler.disable()  # pytest's would print this process's stack
            os.kill(os.getpid(), signal.SIGSEGV)  # as a crash inside a CUDA library would
        if cudnn and name == "sd35_lora":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"rollout_s": 1.0, "update_s": 4.0 if cudnn else 5.0, "step_s": 5.0 if cudnn else 6.0,
                "skipped_updates": 2 if cudnn else 0}  # fmt: skip

    monkeypatch.setattr(cudnn_ab, "variant", variant)
    monkeypatch.setattr(cudnn_ab, "DRY_MODELS", ("wan21_lora", "sd35_lora", "flux_lora"))
    ctx = Context(dry_run=True, work=tmp_path)
    ctx.deadline = time.monotonic() + 60
    runs = cudnn_ab.cudnn_ab_part(ctx)["runs"]
    assert runs["wan21_lora"]["cudnn_on"] == {**runs["wan21_lora"]["cudnn_on"], "status": "failed",
                                              "error": "the process died (exit code -11)"}  # fmt: skip
    assert runs["sd35_lora"]["cudnn_on"]["status"] == "failed"
    assert "illegal memory access" in runs["sd35_lora"]["cudnn_on"]["error"]
    assert all(runs[name]["cudnn_off"]["status"] == "ok" for name in runs) and runs["flux_lora"]["cudnn_on"]["result"]
    assert "update_ratio" not in runs["wan21_lora"] and runs["flux_lora"]["update_ratio"] == 4.0 / 5.0
    record = {"created": "now", "dry_run": True, "budget_s": 160, "parts": {"cudnn_ab": {"status": "ok", "result": {
        "runs": runs, "variants": {"cudnn_off": "off", "cudnn_on": "on"}, "switch": "no-op"}}}}  # fmt: skip
    table = markdown(record)
    assert "| flux_lora | tiny preset, 2 images | 1.00 | 5.00 | 1.00 | 4.00 | 0.800 |" in table
    assert "| 0 / 2 | no |" in table  # its cuDNN variant's NaN gradients (run 9's FLUX.1), in a column of their own
    assert "| failed: the process died (exit code -11) |" in table


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_variant_past_its_cap_is_killed_and_one_dies_with_its_part(tmp_path, gpu_check, monkeypatch):
    from gpu_check.cudnn_ab import isolated

    started = time.perf_counter()
    record = isolated(lambda: time.sleep(60), tmp_path / "slow.json", cap_s=1.0)
    assert record["status"] == "timeout" and 1.0 <= record["seconds"] < 5 and time.perf_counter() - started < 5

    pid_file = tmp_path / "variant.pid"

    def running():
        pid_file.write_text(str(os.getpid()))
        time.sleep(60)

    def part(ctx):  # a part killed at its cap while its variant runs (the variant's cap is longer)
        isolated(running, tmp_path / "v.json", cap_s=60)

    monkeypatch.setattr(gpu_check, "PARTS", {"part": (part, 3)})
    monkeypatch.setattr(gpu_check, "warm_imports", lambda: None)
    monkeypatch.setattr(gpu_check, "warm_architectures", lambda ctx: None)
    gpu_check.main(["--out", str(tmp_path), "--dry-run", "--budget", "25"])
    assert json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["part"]["status"] == "timeout"
    stat = Path(f"/proc/{pid_file.read_text()}/stat")
    for _ in range(50):  # the kernel's signal to the orphan is asynchronous
        if not stat.exists() or stat.read_text().rsplit(") ", 1)[1][0] in "ZX":  # gone, or dead and not yet reaped
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the variant outlived its part")


def test_a_check_of_some_parts_still_names_its_device(tmp_path, gpu_check, monkeypatch):
    parts = {"device": (lambda ctx: {"gpu": "NVIDIA H200"}, 30), "fine": (lambda ctx: {}, 30),
             "other": (lambda ctx: {}, 30)}  # fmt: skip
    monkeypatch.setattr(gpu_check, "PARTS", parts)
    monkeypatch.setattr(gpu_check, "warm_imports", lambda: None)
    monkeypatch.setattr(gpu_check, "warm_architectures", lambda ctx: None)
    gpu_check.main(["--out", str(tmp_path), "--dry-run", "--only", "fine"])
    assert list(json.loads((tmp_path / "gpu_check.json").read_text())["parts"]) == ["device", "fine"]
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check: NVIDIA H200")


def test_the_parent_builds_each_architecture_and_tiny_lender_once_for_every_forked_part(
    tmp_path, gpu_check, monkeypatch
):
    from gpu_check import models, parts

    caches = (parts._architecture, models.lender)
    run = parts.RUNS["sd35_lora"]

    def part(ctx):
        before = [cache.cache_info().misses for cache in caches]
        parts.architecture(ctx, run)
        models.lender(run.family, run.preset)
        return {"built": [cache.cache_info().misses - b for cache, b in zip(caches, before)]}

    for cache in caches:
        cache.cache_clear()  # as in a fresh check
    monkeypatch.setattr(parts, "RUNS", {"sd35_lora": run})  # the tiny builds of one family, not of every one
    monkeypatch.setattr(gpu_check, "PARTS", {"device": (lambda ctx: {}, 30), "model": (part, 30)})
    monkeypatch.setattr(gpu_check, "warm_imports", lambda: None)
    gpu_check.main(["--out", str(tmp_path), "--dry-run"])
    assert json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["model"]["result"] == {"built": [0, 0]}
    assert [cache.cache_info().currsize for cache in caches] == [1, 1]


@pytest.mark.parametrize("family", ["sd3", "z_image"])  # pooled embeddings; a mask (every family: test_text_shapes.py)
def test_random_text_embeddings_are_what_the_real_encoders_give_in_shape_and_dtype(family, gpu_check):
    from gpu_check.models import TINY_PRESET, RandomTexts

    from diffusion_rl.config import ModelConfig
    from diffusion_rl.estimate.architectures import from_tiny
    from diffusion_rl.models.loader import model_of_pipeline
    from diffusion_rl.models.registry import family_named
    from diffusion_rl.models.tiny import build_tiny

    cfg = ModelConfig(path="unused", device="cpu", max_sequence_length=24)
    model = model_of_pipeline(build_tiny(family, TINY_PRESET), family_named(family), cfg, torch.device("cpu"),
                              torch.float32, "tiny")  # fmt: skip
    real = model.encode_texts(["a red cube", ""])
    shapes = family_named(family).adapter.text_shapes(from_tiny(family, TINY_PRESET), 24, prompt_tokens=5)
    random = RandomTexts(shapes, torch.float32, prompt_tokens=5).lookup(["a red cube", ""], torch.device("cpu"))
    assert {k: (v.shape, v.dtype) for k, v in random.items()} == {k: (v.shape, v.dtype) for k, v in real.items()}
    again = RandomTexts(shapes, torch.float32, prompt_tokens=5).lookup(["a red cube"], torch.device("cpu"))
    assert all(torch.equal(again[k][0], random[k][0]) for k in shapes)  # a text gets the same embeddings every time


FORK_AFTER_THREADS = """
import importlib.util, json, sys, torch
sys.path.insert(0, sys.argv[1] + "/benchmarks")
spec = importlib.util.spec_from_file_location("gpu_check_script", sys.argv[1] + "/benchmarks/gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec); spec.loader.exec_module(gpu_check)
from gpu_check.cudnn_ab import run_variant

def parallel_work():  # big enough for torch to run it in an OpenMP parallel region on every thread
    product = torch.mm(torch.randn(512, 512), torch.randn(512, 512))
    return float((torch.randn(4_000_000) * 2).sum()) + float(product[0, 0])

def computes(ctx):
    parallel_work()
    return {"threads": torch.get_num_threads()}

def forks(ctx):
    return run_variant(ctx, "variant", lambda: computes(ctx), 20)

gpu_check.PARTS = {"computes": (computes, 20), "forks": (forks, 30)}
gpu_check.warm_imports = lambda: None
gpu_check.warm_architectures = lambda ctx: parallel_work()  # as the real warm-up may, in the parent
gpu_check.main(["--out", sys.argv[2], "--dry-run", "--budget", "60"])
"""


def test_checkpoint_ab_pretends_a_device_on_which_auto_picks_the_count_asked(gpu_check):
    from gpu_check.checkpoint_ab import pretend_free

    from diffusion_rl.models.checkpointing import CheckpointPlan

    # 4 blocks, 8 bytes of activations (2 each), inputs of 1: with n checkpointed 8, 7, 6, 5, 6 bytes (n = 0 … 4)
    plan = CheckpointPlan(fixed=10.0, blocks=4, saved=8.0, block_input=1.0)
    assert pretend_free(plan, 2) == pytest.approx((10 + 6.5) / 0.95)  # halfway between 6 (two) and 7 (one)
    assert [plan.choose(pretend_free(plan, n)) for n in (1, 2, 3)] == [1, 2, 3]


def test_a_model_part_with_skipped_updates_is_named_under_its_table():
    from gpu_check.summary import markdown

    step = {"images_per_step": 2, "step_s": 1.0, "rollout_s": 0.5, "update_s": 0.5, "images_per_s": 2.0,
            "mfu": 0.2, "peak_allocated_gib": 1.0, "peak_reserved_gib": 1.5}  # fmt: skip
    parts = {"sd35_lora": {**step, "skipped_updates": 0}, "flux_lora": {**step, "skipped_updates": 2}}
    record = {"created": "now", "dry_run": False, "budget_s": 100,
              "parts": {name: {"status": "ok", "result": result} for name, result in parts.items()}}  # fmt: skip
    table = markdown(record)
    assert "**Updates skipped for a non-finite gradient** (the step's numbers do not compare): flux_lora 2" in table
    parts["flux_lora"]["skipped_updates"] = 0
    assert "Updates skipped" not in markdown(record)


@pytest.mark.parametrize("family, arch, published", [
    ("sd3", "stable-diffusion-3.5-medium", {"text_encoder": 123_650_304, "text_encoder_2": 694_659_840,
                                             "text_encoder_3": 4_762_310_656}),
    ("wan", "Wan2.1-T2V-1.3B-Diffusers", {"text_encoder": 5_680_910_336}),
])  # fmt: skip
def test_the_encoders_part_builds_the_real_size_encoders(gpu_check, family, arch, published):
    """On the meta device: each text encoder the part builds from the tiny pipeline's class and the shipped config
    has the checkpoint's parameter count (CLIP-L and bigG with their projections, T5-XXL's and UMT5-XXL's encoders)."""
    from gpu_check.encoders import born_text_encoder, shipped_text_configs

    from diffusion_rl.models.tiny import build_tiny

    tiny = build_tiny(family, "small")
    built = {name: born_text_encoder(tiny.components[name], config, torch.device("meta"), torch.bfloat16)
             for name, config in shipped_text_configs(arch).items()}  # fmt: skip
    assert {name: sum(p.numel() for p in m.parameters()) for name, m in built.items()} == published
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for m in built.values() for p in m.parameters())


def test_the_allocator_reading_survives_a_torch_without_the_settings_getter(gpu_check, monkeypatch):
    """torch 2.11 (the H200 image's) has the setter but not the getter: run 9 lost both variants' numbers to it."""
    from gpu_check.alloc_ab import allocator_reading

    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    assert allocator_reading() == {"allocator_settings": f"no getter in torch {torch.__version__}"}


def test_parts_forked_after_the_parent_worked_on_several_threads_do_not_hang(tmp_path):
    """torch's CPU threads are GNU OpenMP's, which do not survive a fork: a child forked after its parent ran a
    parallel region hangs in its first one (run 8 on the H200 lost every part to it). The parent and the A/B parts
    that only fork keep one thread; each computing process gets torch's count back."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", FORK_AFTER_THREADS, str(ROOT), str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert parts["computes"]["status"] == "ok" and parts["computes"]["result"] == {"threads": 2}, parts["computes"]
    variant = parts["forks"]["result"]
    assert variant["status"] == "ok" and variant["result"] == {"threads": 2}, parts["forks"]


def test_parts_also_run_in_spawned_processes(tmp_path):
    """The fallback when CUDA was initialised before the parts start: each part's process imports everything anew."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--out", str(tmp_path), "--dry-run", "--only",
               "device", "--start-method", "spawn"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["start_method"] == "spawn" and record["parts"]["device"]["status"] == "ok"


def test_the_carried_wheels_are_the_versions_this_environment_tests():
    """scripts/device_wheels.sh pins what the GPU machine lacks to the versions installed here (the suite's)."""
    script = (ROOT / "scripts/device_wheels.sh").read_text()
    pins = dict(re.findall(r"([a-z]+)==([0-9.]+)", script.split("WHEELS=(")[1].split(")")[0]))
    assert set(pins) == {"diffusers", "tensordict", "pyvers"}
    assert pins == {name: metadata.version(name) for name in pins}


def test_shipped_image_vaes_carry_the_checkpoints_latent_scaling():
    # the GPU check builds VAEs from these configs and the families decode with vae.config's scaling and shift;
    # without them AutoencoderKL's defaults (SD1's 0.18215, no shift) stood in and SD3's decode failed on the GPU
    from diffusion_rl.estimate.architectures import from_shipped, shipped

    real = {"stable-diffusion-3.5-medium": (1.5305, 0.0609), "FLUX.1-dev": (0.3611, 0.1159),
            "FLUX.1-Kontext-dev": (0.3611, 0.1159), "FLUX.1-schnell": (0.3611, 0.1159),
            "Z-Image-Turbo": (0.3611, 0.1159)}  # fmt: skip
    kl = {name: from_shipped(name).vae_config for name in shipped() if from_shipped(name).vae_class == "AutoencoderKL"}
    assert sorted(kl) == sorted(real)
    for name, config in kl.items():
        assert (config.get("scaling_factor"), config.get("shift_factor")) == real[name], name


def test_shipped_video_vaes_carry_a_latent_mean_and_std_per_latent_channel():
    # AutoencoderKLWan's defaults are Wan 2.1's 16 channels' statistics; Wan 2.2's VAE has 48 latent channels, and
    # the GPU check's Wan 2.2 step failed in the decode (`view` of 16 values as 48) until its architecture carried them
    from diffusion_rl.estimate.architectures import from_shipped, shipped

    archs = [from_shipped(name) for name in shipped()]
    wan = {a.name: a.vae_config for a in archs if a.vae_class == "AutoencoderKLWan"}
    assert {config["z_dim"] for config in wan.values()} == {16, 48}
    for name, config in wan.items():
        assert len(config["latents_mean"]) == len(config["latents_std"]) == config["z_dim"], name
        assert min(config["latents_std"]) > 0, name


def test_a_two_expert_architecture_gets_both_transformers_at_its_size(gpu_check):
    """Wan 2.2 A14B: the tiny `a14b` pipeline lends its settings (boundary_ratio); both experts are built from the
    architecture's config, not kept at the tiny preset's size."""
    import dataclasses

    from gpu_check.models import random_pipeline

    from diffusion_rl.estimate.architectures import from_tiny

    arch = from_tiny("wan", "a14b")
    assert arch.experts == 2
    arch = dataclasses.replace(arch, transformer_config={**arch.transformer_config, "num_layers": 2})
    pipeline = random_pipeline(arch, torch.device("cpu"), torch.float32, preset="a14b")
    assert len(pipeline.transformer.blocks) == len(pipeline.transformer_2.blocks) == 2
    assert pipeline.transformer is not pipeline.transformer_2 and pipeline.config.boundary_ratio == 0.875


def test_the_users_gpu_page_holds_no_maintainers_notes_and_those_are_plain_shell_commands():
    page = (ROOT / "docs/gpu.md").read_text(encoding="utf-8")
    notes_only = (
        "run(command",
        "carry=",
        "give_back",
        "15 minutes",
        ".device_wheels",
        "next GPU session",
        "~8 minutes",
    )
    for note in notes_only:
        assert note not in page, f"docs/gpu.md speaks to users: {note!r} belongs in benchmarks/gpu_check/MAINTAINERS.md"
    assert "python benchmarks/gpu_check.py --out" in page and "## What the check measures" in page
    notes = (ROOT / "benchmarks/gpu_check/MAINTAINERS.md").read_text(encoding="utf-8")
    assert "bash scripts/gpu_check.sh --only" in notes and "bash scripts/device_wheels.sh" in notes
    assert "run(command" not in notes and "carry=" not in notes


def test_host_syncs_names_each_cuda_sync_warnings_site_and_whether_it_is_in_the_hot_path(gpu_check, monkeypatch):
    import warnings

    from gpu_check import host_syncs

    from diffusion_rl.utils.host_sync import Region

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)  # the CPU has none: its warnings are played

    def loss():  # a hot region that waits once
        warnings.warn("called a synchronizing CUDA operation (function item)", UserWarning, stacklevel=1)

    def around():  # outside the hot path: waits twice, and warns of something else
        warnings.warn("called a synchronizing CUDA operation (function copy_)", UserWarning, stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation (function copy_)", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)

    monkeypatch.setattr(host_syncs, "hot_path", lambda: (Region.of(loss),))
    how, seen, hot = host_syncs.cuda_syncs(lambda: (around(), loss()))
    assert modes == ["warn", "default"] and "set_sync_debug_mode" in how
    sites = [s.site for s in seen]
    assert len(seen) == 3 and all("test_gpu_check.py" in s for s in sites)
    assert "(around)" in sites[0] and sites[0] != sites[1] and "(loss)" in sites[2]
    assert [s.site for s in hot] == [sites[2]] and seen[0].call.startswith("called a synchronizing")


def test_a_profiles_phases_count_the_device_busy_once_and_rank_its_kernels(gpu_check):
    from gpu_check.kernel_profile import Span, kernel_class, summarize

    ms = 1_000_000
    spans = [
        Span("phase/generate", False, 0, 100 * ms), Span("phase/update", False, 100 * ms, 300 * ms),
        # generate: two overlapping kernels (10–40 and 30–50 ms: 40 ms busy) and one running past the phase's end
        Span("ampere_bf16_gemm_128x64", True, 10 * ms, 40 * ms), Span("flash_fwd_kernel", True, 30 * ms, 50 * ms),
        Span("ampere_bf16_gemm_128x64", True, 90 * ms, 110 * ms),  # 10 ms in each phase
        # update: a copy and an elementwise kernel, 60 ms busy with the gemm's 10
        Span("Memcpy HtoD (Pinned -> Device)", True, 150 * ms, 190 * ms),
        Span("vectorized_elementwise_kernel<mul>", True, 200 * ms, 210 * ms),
        Span("aten::mm", False, 10 * ms, 40 * ms),  # host ranges other than phases count for nothing
    ]  # fmt: skip
    out = summarize(spans)
    generate, update = out["phases"]["generate"], out["phases"]["update"]
    assert (generate["wall_s"], generate["busy_s"]) == pytest.approx((0.1, 0.05))  # 10–50 and 90–100 ms
    assert generate["idle_s"] == pytest.approx(0.05) and generate["busy_fraction"] == pytest.approx(0.5)
    assert (update["wall_s"], update["busy_s"], update["busy_fraction"]) == pytest.approx((0.2, 0.06, 0.3))
    assert out["device_s"] == pytest.approx(0.12)  # 30 + 20 + 20 + 40 + 10 ms of device spans
    first = out["top_kernels"][0]
    assert (first["name"], first["count"], first["class"]) == ("ampere_bf16_gemm_128x64", 2, "matmul")
    assert first["s"] == pytest.approx(0.05) and first["share"] == pytest.approx(0.05 / 0.12)
    assert out["class_shares"] == pytest.approx({"matmul": 5 / 12, "copies and casts": 4 / 12, "attention": 2 / 12,
                                                 "elementwise": 1 / 12})  # fmt: skip
    names = ("implicit_convolve_sgemm", "unrolled_elementwise_kernel<direct_copy_kernel_cuda>", "triton_poi_fused_add",
             "mystery")  # fmt: skip
    assert [kernel_class(n) for n in names] == ["convolution", "copies and casts", "elementwise", "other"]
