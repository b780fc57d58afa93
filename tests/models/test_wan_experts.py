"""Wan 2.2 A14B: two transformers switched by the timestep, trained as one network (models/experts.py) — each row
goes to the expert the pipeline would call, gradients reach only the expert that ran, the LoRA of both loads in
diffusers, and sharded ranks join the same experts' collectives."""

from __future__ import annotations

import json

import pytest
import torch

from diffusion_rl.cli import main
from diffusion_rl.errors import UserError
from diffusion_rl.models.experts import TimestepExperts, high_noise_rows
from diffusion_rl.models.export import LORA_FILES
from diffusion_rl.models.tiny import build_tiny, save_tiny
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, rollout

PROMPTS = ["a red ball bouncing", "a cat"]


@pytest.fixture(scope="module")
def a14b_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_wan_a14b"), "wan", "a14b", seed=0)


@pytest.fixture(scope="module")
def i2v_a14b_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_wan_i2v_a14b"), "wan_i2v", "a14b", seed=0)


def network_of(model) -> TimestepExperts:
    trained = model.policies.trained
    return trained.base_model.model if model.policies.lora is not None else trained


def test_both_experts_load_with_the_pipelines_boundary(a14b_dir, i2v_a14b_dir, load):
    index = json.loads((a14b_dir / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    model = load(a14b_dir, lora=True)
    experts = network_of(model)
    assert isinstance(experts, TimestepExperts) and experts.boundary == 875.0
    assert experts.high is model.pipeline.transformer and experts.low is model.pipeline.transformer_2
    names = [n for n, p in model.policies.trained.named_parameters() if p.requires_grad]
    assert any(".high." in n for n in names) and any(".low." in n for n in names)  # LoRA on both experts
    assert len([n for n in names if ".high." in n]) == len([n for n in names if ".low." in n])
    i2v = load(i2v_a14b_dir, lora=True)  # Wan 2.2 I2V-A14B: first-frame channels, no CLIP, switched at 900
    assert i2v.family == "wan_i2v" and network_of(i2v).boundary == 900.0 and not i2v.reads_image_tokens


def test_each_row_goes_to_the_expert_the_pipeline_calls_at_its_timestep(a14b_dir, load):
    model = load(a14b_dir)
    pipeline = model.pipeline
    cond = model.encode_prompts(PROMPTS, ["blurry", ""])
    x = torch.randn(2, *model.latent_shape(32, 32, 5), generator=torch.Generator().manual_seed(0))

    def guided(transformer, t: float, rows=slice(None)):  # the pipeline's CFG step with one transformer
        timestep = torch.full((x[rows].shape[0],), t)
        kw = dict(hidden_states=x[rows], timestep=timestep, return_dict=False)
        v_cond = transformer(**kw, encoder_hidden_states=cond["prompt_embeds"][rows])[0]
        v_uncond = transformer(**kw, encoder_hidden_states=cond["negative_prompt_embeds"][rows])[0]
        return v_uncond + 4.0 * (v_cond - v_uncond)

    with torch.no_grad():
        # WanPipeline: `transformer` while t ≥ boundary_ratio · 1000 = 875, `transformer_2` below
        high, low = model.velocity(x, 0.875, cond, 4.0), model.velocity(x, 0.874, cond, 4.0)
        assert torch.allclose(high, guided(pipeline.transformer, 875.0), atol=1e-5)
        assert torch.allclose(low, guided(pipeline.transformer_2, 874.0), atol=1e-5)
        assert not torch.allclose(low, guided(pipeline.transformer, 874.0), atol=1e-3)  # the experts differ
        # a batch whose rows sit on both sides (a forward-process loss draws a time per sample): row by row
        mixed = model.velocity(x, torch.tensor([0.95, 0.3]), cond, 4.0)
        assert torch.allclose(mixed[:1], guided(pipeline.transformer, 950.0, slice(0, 1)), atol=1e-5)
        assert torch.allclose(mixed[1:], guided(pipeline.transformer_2, 300.0, slice(1, 2)), atol=1e-5)


def test_a_step_trains_only_the_expert_that_made_it(a14b_dir, load):
    model = load(a14b_dir, lora=True)
    cond = model.encode_prompts(PROMPTS)
    x = torch.randn(2, *model.latent_shape(32, 32, 5), generator=torch.Generator().manual_seed(1))
    for sigma, trained, untouched in ((0.9, ".high.", ".low."), (0.5, ".low.", ".high.")):
        model.policies.trained.zero_grad(set_to_none=True)
        model.velocity(x, sigma, cond, 1.0).square().mean().backward()
        grads = {n: p.grad for n, p in model.policies.trained.named_parameters() if p.requires_grad}
        assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if trained in n), sigma
        assert all(g is None or not g.any() for n, g in grads.items() if untouched in n), sigma


def test_a_second_transformer_without_its_boundary_is_refused(tmp_path, load):
    pipeline = build_tiny("wan", "a14b", seed=0)
    pipeline.register_to_config(boundary_ratio=None)
    pipeline.save_pretrained(tmp_path / "no_boundary")
    with pytest.raises(UserError, match="no boundary_ratio"):
        load(tmp_path / "no_boundary")


def test_lora_export_loads_into_both_diffusers_transformers_and_samples_identical_videos(
    a14b_dir, load, train_model, tmp_path
):
    # 6 steps: the SDE steps train t = 1000, 984, 960, 923 on the high-noise expert and 857 on the low-noise one
    trainer = train_model(a14b_dir, f"run.dir={tmp_path / 'run'}", "model.lora.enabled=true", "model.lora.rank=4",
                          "model.lora.alpha=8", "train.total_steps=1", "train.lr=1e-2", "sampling.num_frames=5",
                          "sampling.num_steps=6")  # fmt: skip
    trainer.train()
    trained = trainer.engine.model
    out = tmp_path / "lora"
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert all((out / name).is_file() for name in LORA_FILES.values())
    card = (out / "README.md").read_text()  # the model card's snippet loads both files, as below
    assert f'weight_name="{LORA_FILES["transformer_2"]}", load_into_transformer_2=True' in card
    settings = SamplerSettings(num_steps=4, guidance=4.0, height=32, width=32, frames=5)  # σ 1 … 0: both experts

    def videos(model):
        cond = model.encode_prompts(PROMPTS, ["", ""])
        return rollout(model, cond, settings, None, init_seeds=[1, 2], noise_seeds=[1, 2],
                       ids=anonymous_ids(PROMPTS)).images  # fmt: skip

    fresh = load(a14b_dir, max_sequence_length=trained.max_sequence_length)
    before = videos(fresh)
    fresh.pipeline.load_lora_weights(out)  # diffusers' own loader: the high-noise expert's LoRA
    high_only = videos(fresh)
    fresh.pipeline.load_lora_weights(out, weight_name=LORA_FILES["transformer_2"], load_into_transformer_2=True)
    after, wanted = videos(fresh), videos(trained)
    assert not torch.equal(before, wanted) and not torch.equal(high_only, wanted)  # the update moved both experts
    assert torch.equal(after, wanted)
    merged = tmp_path / "merged"  # --merge: both transformers with their LoRA merged in, in the base's layout
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(merged), "--merge"]) == 0
    merged_model = load(merged, max_sequence_length=trained.max_sequence_length)
    assert isinstance(network_of(merged_model), TimestepExperts)
    assert (videos(merged_model).int() - wanted.int()).abs().max() <= 1  # merging rounds differently than LoRA


class _Expert(torch.nn.Module):
    """A stand-in transformer: hidden_states · w + timestep, counting its calls."""

    def __init__(self, scale: float):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(scale))
        self.calls = 0

    def forward(self, *, hidden_states, timestep, return_dict=False):
        self.calls += 1
        return (hidden_states * self.w + timestep.view(-1, 1),)


def _rank(rank: int, init: str, times: list[list[float]], results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    experts = TimestepExperts(_Expert(2.0), _Expert(3.0), boundary=500.0)
    experts.agree_over_ranks = True  # what engine/parallel.py sets on a lazily gathered FSDP2 network
    x = torch.ones(len(times[rank]), 1, requires_grad=True)
    out = experts(hidden_states=x, timestep=torch.tensor(times[rank]))[0]
    out.sum().backward()
    results.put((rank, out.detach().tolist(), experts.high.calls, experts.low.calls,
                 float(experts.high.w.grad), float(experts.low.w.grad)))  # fmt: skip
    dist.destroy_process_group()


def test_sharded_ranks_run_every_expert_any_rank_needs_without_changing_their_numbers(tmp_path):
    # rank 0's rows are all high-noise, rank 1's all low-noise: FSDP2 would gather (and reduce) each expert's
    # weights on every rank, so both ranks must call both experts, the extra call adding nothing
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    times = [[900.0, 700.0], [100.0]]
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank, args=(r, init, times, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r[0], r[1:]) for r in (results.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    out0, high0, low0, dhigh0, dlow0 = got[0]
    out1, high1, low1, dhigh1, dlow1 = got[1]
    assert (high0, low0) == (high1, low1) == (1, 1)  # each rank called each expert once
    assert out0 == [[2 + 900.0], [2 + 700.0]] and out1 == [[3 + 100.0]]  # x·w + t by its own expert only
    assert (dhigh0, dlow0) == (2.0, 0.0) and (dhigh1, dlow1) == (0.0, 1.0)  # d(sum)/dw = Σ x of the rows it ran


def test_per_token_timesteps_route_by_the_steps_t_not_a_clean_condition_frames_zero():
    # expanded timesteps (per token): a clean first frame's tokens at 0, the noisy ones at the step's t
    timestep = torch.tensor([[0.0, 900.0, 900.0], [0.0, 300.0, 300.0]])
    assert high_noise_rows(timestep, 2, 875.0).tolist() == [True, False]
    assert high_noise_rows(torch.tensor(900.0), 3, 875.0).tolist() == [True, True, True]
