"""The ready configs' settings as each GPU-check part ran (benchmarks/results/gpu_check_h200.json), where a config has
moved since: part → the overrides that give back the config it measured (the part's own overrides apply on top).
tests/test_estimate_calibration.py estimates what was measured; scripts/throughput_table.py scales each row as
measured and names these overrides in its row, so no figure is read as the moved config's. A part measured again
at today's config leaves this map."""

AS_MEASURED: dict[str, list[str]] = {
    # run 6 (2abb2af): T5 text of 256 (SD3.5) and 512 (FLUX.1) tokens, FLUX.1's LoRA r 32 α 64 on the family preset;
    # the configs follow flow_grpo's since (128 tokens; r 64 α 128 without proj_mlp)
    "sd35_lora": ["model.max_sequence_length=256"],
    "sd35_full": ["model.max_sequence_length=256"],
    "flux_lora": [
        "model.max_sequence_length=512", "model.lora.rank=32", "model.lora.alpha=64", "model.lora.target_modules=[]"
    ],
    # run 6: the rollout's log-probs as the PPO anchor and ddof 0; the config recomputes them before the update as
    # verl-omni does since (decoupled, no IS weights: one no-grad forward per trained step more), ddof 1
    "qwen_image_lora": [
        "algorithm.rollout_correction.mode=bypass", "algorithm.rollout_correction.is_kind=tis",
        "algorithm.advantage.std_ddof=0",
    ],
    # Wan 2.1's LoRA on the family preset (attention and feed-forward); flow_grpo's, today's, on attention alone
    "wan21_lora": ["model.lora.target_modules=[]"],
    # run 10: wan22_ti2v_5b_dance_lora.yaml before it moved onto verl-omni's DanceGRPO recipe (2026-11-29)
    "wan22_ti2v_lora": [
        "sampling.num_frames=17", "sampling.height=352", "sampling.width=640", "sampling.num_steps=20",
        "sampling.noise_level=0.3",
        "sampling.window.kind=all", "sampling.score_chunks=1", "algorithm.timestep_fraction=0.6",
        "algorithm.flow_grpo.kl_beta=0.04", "algorithm.rollout_correction.mode=bypass",
        "algorithm.rollout_correction.is_kind=tis", "model.max_sequence_length=512", "model.offload_frozen=false",
        "train.micro_batch_size=1", "train.num_minibatches=1", "data.prompts_per_step=16",
    ],
}  # fmt: skip
