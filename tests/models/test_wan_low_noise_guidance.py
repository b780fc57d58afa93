"""Wan 2.2 A14B's second guidance scale (diffusers' `guidance_scale_2`, ours `sampling.guidance_low_noise`): the
low-noise expert's steps are guided at their own scale as WanPipeline guides them, row by row in a mixed call, never
in the forward-process losses' conditional velocity; CFG is counted when either scale is > 1; a model with one
transformer and a scale below 1 are refused as one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusion_rl.cli import main
from diffusion_rl.models.guidance import Guidance
from diffusion_rl.models.tiny import save_tiny
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, initial_noise, rollout
from tests.helpers import euler_on

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs/quickstart_flow_grpo.yaml")
PROMPTS, NEGATIVE = ["a red ball bouncing", "a cat"], ["blurry", ""]


@pytest.fixture(scope="module")
def a14b_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_wan_a14b"), "wan", "a14b", seed=0)


def test_our_ode_with_a_low_noise_guidance_gives_wan_pipelines_guidance_scale_2_video(a14b_dir, load):
    """Same noise and prompts, 4 Euler steps on the shift-12 grid (t = 1000, 973, 923 on the high-noise expert, 801 on
    the low-noise one): ours at guidance 4 / low-noise 3 is WanPipeline's guidance_scale=4, guidance_scale_2=3 with
    diffusers' flow-matching Euler scheduler on our σ points (fp32 latents within atol 1e-5: the same operations, CFG
    batched here, two forwards there), and not its guidance_scale_2=4, which ours reproduces with the low-noise scale
    null."""
    model = load(a14b_dir)
    settings = SamplerSettings(num_steps=4, guidance=4.0, height=32, width=32, frames=5, guidance_low_noise=3.0)
    noise = initial_noise(model, settings, [3, 4])
    cond = model.encode_prompts(PROMPTS, NEGATIVE)

    def ours(s: SamplerSettings) -> torch.Tensor:
        return rollout(model, cond, s, None, init_seeds=[3, 4], noise_seeds=[3, 4],
                       ids=anonymous_ids(PROMPTS)).final_latents  # fmt: skip

    pipe = model.pipeline
    pipe.scheduler = euler_on(model.sigma_schedule(4, 32, 32, 5))

    def diffusers(guidance_scale_2: float | None) -> torch.Tensor:
        return pipe(prompt=PROMPTS, negative_prompt=NEGATIVE, height=32, width=32, num_frames=5, num_inference_steps=4,
                    guidance_scale=4.0, guidance_scale_2=guidance_scale_2, latents=noise.clone(),
                    max_sequence_length=16, output_type="latent").frames  # fmt: skip

    two, same = ours(settings), ours(SamplerSettings(4, 4.0, 32, 32, frames=5))
    assert torch.allclose(two, diffusers(3.0), atol=1e-5)
    assert torch.allclose(same, diffusers(None), atol=1e-5)  # guidance_scale_2 None: guidance_scale for both
    assert (two - diffusers(4.0)).abs().max() > 1e-2  # the low-noise scale changed the video


def test_image_to_video_a14b_gives_wan_image_to_video_pipelines_guidance_scale_2_video(tmp_path_factory, load):
    """Wan 2.2 I2V-A14B (boundary 900; shift 5, 4 steps: t = 1000, 938 high-noise, 834, 626 low-noise) at 4 / 2 against
    WanImageToVideoPipeline's guidance_scale=4, guidance_scale_2=2, one first frame per call (1e-4: the same
    operations but for the pixels' scaling and the timestep's rounding, as tests/models/test_wan_i2v.py)."""
    import numpy as np
    from PIL import Image

    model = load(save_tiny(tmp_path_factory.mktemp("tiny_wan_i2v_a14b"), "wan_i2v", "a14b", seed=0))
    first = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    settings = SamplerSettings(num_steps=4, guidance=4.0, height=32, width=32, frames=5, guidance_low_noise=2.0)
    cond = model.encode_prompts(PROMPTS, NEGATIVE, [[first[0]], [first[1]]])
    ours = rollout(model, cond, settings, None, init_seeds=[1, 2], noise_seeds=[1, 2], ids=anonymous_ids(PROMPTS))
    noise, pipe = initial_noise(model, settings, [1, 2]), model.pipeline
    pipe.scheduler = euler_on(model.sigma_schedule(4, 32, 32, 5))

    def diffusers(guidance_scale_2: float) -> torch.Tensor:
        rows = [slice(i, i + 1) for i in range(2)]  # the pipeline takes one image per call
        return torch.cat([pipe(image=Image.fromarray(first[r][0]), prompt_embeds=cond["prompt_embeds"][r],
                               negative_prompt_embeds=cond["negative_prompt_embeds"][r], latents=noise[r],
                               height=32, width=32, num_frames=5, num_inference_steps=4, guidance_scale=4.0,
                               guidance_scale_2=guidance_scale_2, output_type="latent").frames
                          for r in rows])  # fmt: skip

    with torch.no_grad():
        assert (ours.final_latents - diffusers(2.0)).abs().max() <= 1e-4
        assert (ours.final_latents - diffusers(4.0)).abs().max() > 1e-2


def test_each_row_of_a_mixed_call_is_guided_at_its_experts_scale_and_the_conditional_velocity_at_neither(
    a14b_dir, load
):
    model = load(a14b_dir)
    pipeline = model.pipeline
    cond = model.encode_prompts(PROMPTS, NEGATIVE)
    x = torch.randn(2, *model.latent_shape(32, 32, 5), generator=torch.Generator().manual_seed(0))

    def guided(transformer, t: float, row: int, scale: float):  # the pipeline's CFG step of one row
        kw = dict(hidden_states=x[row : row + 1], timestep=torch.tensor([t]), return_dict=False)
        v_cond = transformer(**kw, encoder_hidden_states=cond["prompt_embeds"][row : row + 1])[0]
        v_uncond = transformer(**kw, encoder_hidden_states=cond["negative_prompt_embeds"][row : row + 1])[0]
        return v_uncond + scale * (v_cond - v_uncond)

    with torch.no_grad():
        # a forward-process loss's rows: one at t = 950 (high-noise expert, scale 4), one at 300 (low-noise, 3)
        mixed = model.velocity(x, torch.tensor([0.95, 0.3]), cond, Guidance(4.0, 3.0))
        assert torch.allclose(mixed[:1], guided(pipeline.transformer, 950.0, 0, 4.0), atol=1e-5)
        assert torch.allclose(mixed[1:], guided(pipeline.transformer_2, 300.0, 1, 3.0), atol=1e-5)
        assert not torch.allclose(mixed[1:], guided(pipeline.transformer_2, 300.0, 1, 4.0), atol=1e-3)
        # what DiffusionNFT / AWM / DPO train: the conditional velocity, at guidance 1 for both experts
        conditional = model.conditional_guidance(Guidance(4.0, 3.0))
        assert conditional == 1.0 and getattr(conditional, "low_noise", None) is None
        plain = model.velocity(x, torch.tensor([0.95, 0.3]), cond, conditional)
        t = torch.tensor([950.0, 300.0])
        expected = torch.cat([pipeline.transformer(hidden_states=x[:1], timestep=t[:1],
                                                   encoder_hidden_states=cond["prompt_embeds"][:1])[0],
                              pipeline.transformer_2(hidden_states=x[1:], timestep=t[1:],
                                                     encoder_hidden_states=cond["prompt_embeds"][1:])[0]])  # fmt: skip
        assert torch.allclose(plain, expected, atol=1e-5)


def test_cfg_runs_and_is_counted_when_either_experts_scale_is_above_one(a14b_dir, load, make_config):
    from diffusion_rl.estimate.architectures import from_model_dir
    from diffusion_rl.estimate.devices import device_named
    from diffusion_rl.estimate.estimator import estimate

    model = load(a14b_dir)
    counts = [model.forwards_per_evaluation(g) for g in (1.0, Guidance(1.0), Guidance(1.0, 3.0), Guidance(4.0, 1.0))]
    assert counts == [1, 1, 2, 2]
    cond = model.encode_prompts(PROMPTS, NEGATIVE)
    x = torch.randn(2, *model.latent_shape(32, 32, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # guidance 1 on the high-noise row: its conditional velocity; the low-noise row guided
        low_only = model.velocity(x, torch.tensor([0.95, 0.3]), cond, Guidance(1.0, 3.0))
        assert torch.allclose(low_only[:1], model.velocity(x[:1], 0.95, cond[:1], 1.0), atol=1e-5)
        assert torch.allclose(low_only[1:], model.velocity(x[1:], 0.3, cond[1:], 3.0), atol=1e-5)
    arch, h100 = from_model_dir(a14b_dir), device_named("h100")

    def step_flops(*overrides: str) -> float:
        cfg = make_config(f"model.path={a14b_dir}", "sampling.num_frames=5", *overrides)
        return estimate(cfg, arch, h100, 1).flops_per_step

    cfg_free, low_only, both = (step_flops("sampling.guidance=1"), step_flops("sampling.guidance=1",
                                "sampling.guidance_low_noise=3"), step_flops("sampling.guidance=3"))  # fmt: skip
    assert low_only == both > cfg_free  # the doubled batch of CFG, counted as for one scale > 1


def test_rollouts_validation_and_eval_sample_at_both_scales(a14b_dir, train_model):
    from diffusion_rl.evaluation import EvalSettings

    trainer = train_model(a14b_dir, "sampling.guidance=4", "sampling.guidance_low_noise=3", "val.guidance_low_noise=2")
    worker = trainer.engine  # local: the PolicyWorker that samples the training rollouts
    assert (worker.settings.scales, worker.settings.scales.low_noise) == (4.0, 3.0)
    seen, sample = [], worker.sample_images
    worker.sample_images = lambda *args, **kw: (seen.append(args[3]), sample(*args, **kw))[1]
    trainer.validate()
    assert (seen[0].scales, seen[0].scales.low_noise) == (4.0, 2.0)
    flags = EvalSettings(guidance=4.0, guidance_low_noise=3.0).sampler().scales  # eval and sample
    assert (flags, flags.low_noise) == (4.0, 3.0)


def test_validation_falls_back_key_by_key(make_config):
    cfg = make_config("sampling.guidance=4", "sampling.guidance_low_noise=3")
    assert cfg.val.guidance_scales(cfg.sampling) == (4.0, 3.0)
    own = make_config("sampling.guidance=4", "val.guidance=5", "val.guidance_low_noise=2")
    assert own.val.guidance_scales(own.sampling) == (5.0, 2.0)
    neither = make_config("val.guidance=5")
    assert neither.val.guidance_scales(neither.sampling) == (5.0, None)  # null: validation's guidance for both


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sampling.guidance_low_noise=0.5", "'sampling.guidance_low_noise' must be in [1, 100], got 0.5"),
        ("val.guidance_low_noise=0", "'val.guidance_low_noise' must be in [1, 100], got 0.0"),
    ],
)
def test_a_low_noise_guidance_below_one_is_refused_when_the_config_loads(override, message, capsys):
    assert main(["config", "show", QUICKSTART, override]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("key", ["sampling.guidance_low_noise", "val.guidance_low_noise"])
def test_a_low_noise_guidance_for_a_model_with_one_transformer_is_refused_before_any_step(
    key, train_argv, tmp_path, capsys
):
    run = tmp_path / "run"
    assert main(train_argv(f"{key}=3")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffusion-rl: error: "), lines
    assert f"{key}=3 sets the guidance of a low-noise expert, but this sd3 model has one transformer" in lines[0]
    assert not (run / "metrics.jsonl").exists()


def test_sample_and_eval_refuse_a_low_noise_guidance_the_model_cannot_use(tiny_model_dir, tmp_path, capsys):
    common = ["--model", str(tiny_model_dir), "--steps", "2", "--height", "32", "--width", "32"]
    assert main(["sample", *common, "--prompt", "a cat", "--guidance-low-noise", "3", "--out",
                 str(tmp_path / "grid")]) == 2  # fmt: skip
    assert "--guidance-low-noise=3 sets the guidance of a low-noise expert" in capsys.readouterr().err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    assert main(["eval", *common, "--prompts", str(prompts), "--reward", "jpeg_compressibility", "--n", "1",
                 "--guidance-low-noise", "0.5", "--out", str(tmp_path / "eval")]) == 2  # fmt: skip
    assert "--guidance-low-noise must be ≥ 1" in capsys.readouterr().err


def test_eval_samples_an_a14b_model_at_both_scales_and_says_so(a14b_dir, tmp_path):
    import json

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    out = tmp_path / "eval"
    assert main(["eval", "--model", str(a14b_dir), "--prompts", str(prompts), "--reward", "jpeg_compressibility",
                 "--n", "1", "--steps", "2", "--height", "32", "--width", "32", "--frames", "5",
                 "--max-sequence-length", "16", "--guidance", "4", "--guidance-low-noise", "3",
                 "--out", str(out)]) == 0  # fmt: skip
    settings = json.loads((out / "metrics.json").read_text())["settings"]
    assert (settings["guidance"], settings["guidance_low_noise"]) == (4.0, 3.0)
    assert "guidance 4.0 (low-noise expert 3.0)" in (out / "compare.md").read_text()


def test_guided_combines_by_hand_with_one_scale_or_one_per_row():
    from diffusion_rl.models.guidance import guided

    u, c = torch.tensor([[1.0, 2.0], [0.0, -1.0]]), torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    assert guided(u, c, 3.0).tolist() == [[4.0, -4.0], [3.0, 5.0]]  # u + 3 (c − u)
    assert guided(u, c, torch.tensor([3.0, 0.5])).tolist() == [[4.0, -4.0], [0.5, 0.0]]  # row 2: u + ½ (c − u)
