"""Each direct-preference mode, from its quickstart config at reduced size, moves the validation reward the right way.

Settings: the `learns` overrides (jpeg_compressibility, 16 steps of 4 prompts × 4, lr 1e-2, 32 px) on each mode's
config. Gains of the fixed-seed validation reward measured for run.seed 1, 2, 3 (Flow-GRPO at the same settings:
+5.3/+13.9/+7.0 %):
  dpo (online, ODE, CFG 4.5, 4 passes per step), on mean brightness: a run's brightness rises under either sign of
      the loss (β = 2000, seeds 1/2/3/4/6: +13.2/+23.9/+6.9/+18.7/+12.2 % as written, +9.3/+6.2/+5.6/+5.5/+6.8 % with
      chosen and rejected swapped, 2026-11-26), so its test takes the mean of a brightness run's and a darkness run's
      gains (the drift cancelled: conftest.py `reversal_signals`) at β = 5000: +0.031/+0.037 of brightness for
      seeds 1/2 (loss flipped: −0.038/−0.048). On JPEG size its gain sits in the validation noise (2026-11-23,
      seeds 1-3: −0.2/+0.6/−0.3 %).
  nft (ODE, CFG-free)                                  +9.6/+11.0/+6.2 %
  awm (ODE, CFG 4.5, 8 sampling steps for 6 strata)    +12.7/+7.3/+13.9 %
  dpo_offline (pairs from `prepare pairs --n 8`)       +4.9/+3.5/+2.1 %
  dgpo (ODE, CFG 4.5, 8 sampling steps), on JPEG size: a run rewarding JPEG size (the negated reward) gains too,
      so its test takes the mean of the two runs' gains (conftest.py `reversal_signals`), seeds 0/1/2:
      +12.6/+3.0/+4.4e-5 of reward (+5.1/+1.1/+1.3 % and +3.4/+0.9/+1.7 %; with the policy term's sign flipped
      −0.7/−9.5/−3.6e-5; 2026-11-28, AMD EPYC), 1–5 % where Flow-GRPO gains 5–14 %. On an AMX Xeon the same
      settings gave −0.3/+4.9/+7.0/+2.5/+11.9e-5 on seeds 0–4 (2026-11-29): seed 0 within the cross-CPU noise. The test
      runs at β 10 and clip range 0.05 (the config: 100, 0.01), +11.5/+10.0/+5.6/+6.2/+7.7e-5 there.
  crd (ODE, 8 sampling steps), the same way: at its recipe's KL to the start (kl_beta 0.1) +2.7/+5.8/+0.9/+1.0/−0.8e-5
      on seeds 0–4 of that AMX Xeon, within the noise; the test trains without it (kl_beta 0: the centred reward
      matching alone), +20.6/+8.4/+25.7/+20.7/+20.2e-5.
nft and awm train each step's 16 samples in one micro-batch (the same gradient up to float rounding, 0.63x and 0.77x
the CPU time of seed 1's run); re-measured so (2026-11-26, AMD EPYC without AMX): nft +3.6/+9.1/+12.9 %, awm
+10.1/+5.5/+9.0 % (+1.1e-4 and +3.0e-4 of reward at seed 1; in micro-batches of 4 on that CPU +5.2 and +11.4 %).
"""

from __future__ import annotations

from pathlib import Path
from tempfile import mkdtemp

import pytest

from diffusion_rl.cli import main
from diffusion_rl.config.loading import to_yaml

from .conftest import JPEG_SIZE, ONE_MICRO_BATCH, reversal_signals

ROOT = Path(__file__).resolve().parents[2]

# DPO at β = 2000 (the config default): at lr 1e-2 and 32 px it learns where the quickstart's 100 (tuned at 64 px,
# lr 1e-3) does not reliably
DPO_OFFLINE = ("algorithm.dpo.dpo_beta=2000",)
CRD = ("sampling.num_steps=8", ONE_MICRO_BATCH, "algorithm.crd.kl_beta=0")  # the docstring says why
DGPO = ("sampling.num_steps=8", ONE_MICRO_BATCH, "algorithm.dgpo.dpo_beta=10", "algorithm.dgpo.clip_range=0.05")
CRD_CONFIG = ROOT / "configs/quickstart_crd.yaml"
DGPO_CONFIG = ROOT / "configs/quickstart_dgpo.yaml"
MODES = {
    "nft": (ONE_MICRO_BATCH,),
    "awm": ("sampling.num_steps=8", ONE_MICRO_BATCH),
}
BRIGHTNESS = """
return images.reshape(len(images), -1).mean(axis=1).astype(np.float32) / 255
"""
DARKNESS = """
return -images.reshape(len(images), -1).mean(axis=1).astype(np.float32) / 255
"""


def _gain(rows: list[dict]) -> tuple[float, str]:
    before, after = rows[0]["val/reward/mean"], rows[-1]["val/reward/mean"]
    return after - before, f"val/reward/mean {before:.6g} -> {after:.6g}"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_online_mode_improves_the_validation_reward(make_trainer, learns, mode):
    config = ROOT / f"configs/quickstart_{mode}.yaml"
    # `learns` sets guidance 4.5; DiffusionNFT's config samples CFG-free, which is part of what it tests
    guidance = ("sampling.guidance=1",) if mode == "nft" else ()
    trainer = make_trainer(*learns, "run.seed=1", *guidance, *MODES[mode], config=config)
    rows = trainer.train()
    gain, text = _gain(rows)
    # one byte of JPEG is 2e-6 of reward: ask for more than a few bytes of the ~1.5 kB
    assert gain > 1e-5, f"{mode}: {text}"


def test_online_dpo_follows_the_reward_against_the_drift(make_trainer, learns, user_reward, tmp_path):
    """Online DPO brightens the images under any sign of its loss on this model (with chosen and rejected swapped, the
    validation brightness still rose 5.5–9.3 % at β = 2000, seeds 1–6): its test compares a run rewarding brightness
    with one rewarding darkness (conftest.py `reversal_signals`), at β = 5000, where it learns more per step."""

    def train(seed: int, reward: str) -> list[dict]:
        return make_trainer(*learns, f"run.seed={seed}", "algorithm.dpo.dpo_beta=5000", f"rewards.0.name={reward}",
                            f"run.dir={mkdtemp(dir=tmp_path)}",
                            config=ROOT / "configs/quickstart_dpo.yaml").train()  # fmt: skip

    signals = reversal_signals(train, (1, 2), (user_reward(BRIGHTNESS), user_reward(DARKNESS)))
    # brightness in [0, 1], ~0.42 untrained: ask for 1 % of the range (2.5 of 255 levels) after the drift
    assert sum(signals) / 2 > 0.01, f"dpo: drift-free brightness gains per seed {signals}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dgpo_follows_the_reward_against_the_drift(make_trainer, learns, user_reward, tmp_path, seed):
    """DGPO raises JPEG compressibility, and JPEG size when rewarded for it: the mean of the two runs' gains (the
    drift cancelled) is positive on every seed; with its policy term's sign flipped it was negative on every seed."""

    def train(seed: int, reward: str) -> list[dict]:
        return make_trainer(*learns, f"run.seed={seed}", *DGPO, f"rewards.0.name={reward}",
                            f"run.dir={mkdtemp(dir=tmp_path)}", config=DGPO_CONFIG).train()  # fmt: skip

    (signal,) = reversal_signals(train, (seed,), ("jpeg_compressibility", user_reward(JPEG_SIZE)))
    # one byte of JPEG is 2e-6 of reward: ask for more than a few bytes after the drift
    assert signal > 1e-5, f"dgpo seed {seed}: drift-free gain {signal:.3g}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_crd_follows_the_reward_against_the_drift(make_trainer, learns, user_reward, tmp_path, seed):
    """CRD raises JPEG compressibility, and JPEG size when rewarded for it: the mean of the two runs' gains (the
    drift cancelled) is positive on every seed."""

    def train(seed: int, reward: str) -> list[dict]:
        return make_trainer(*learns, f"run.seed={seed}", *CRD, f"rewards.0.name={reward}",
                            f"run.dir={mkdtemp(dir=tmp_path)}", config=CRD_CONFIG).train()  # fmt: skip

    (signal,) = reversal_signals(train, (seed,), ("jpeg_compressibility", user_reward(JPEG_SIZE)))
    # one byte of JPEG is 2e-6 of reward: ask for more than a few bytes after the drift
    assert signal > 1e-5, f"crd seed {seed}: drift-free gain {signal:.3g}"


def test_offline_dpo_on_prepared_pairs_improves_the_validation_reward(make_config, make_trainer, learns, tmp_path):
    # the pairs: the same reduced model and settings, 8 samples per training prompt, best vs worst by JPEG size
    source = make_config(*learns, "run.seed=1", config=ROOT / "configs/quickstart_dpo.yaml")
    (tmp_path / "source.yaml").write_text(to_yaml(source))
    out = tmp_path / "pairs"
    assert main(["prepare", "pairs", "--config", str(tmp_path / "source.yaml"), "--out", str(out), "--n", "8"]) == 0
    lines = (out / "pairs.jsonl").read_text().splitlines()
    assert len(lines) == 24  # one pair per training prompt (no prompt's 8 samples tied)

    trainer = make_trainer(
        *learns,
        "run.seed=1",
        *DPO_OFFLINE,
        f"data.pairs={out / 'pairs.jsonl'}",
        config=ROOT / "configs/quickstart_dpo_offline.yaml",
    )
    rows = trainer.train()
    assert all("reward/mean" not in r for r in rows)  # nothing sampled or scored for training
    assert rows[-1]["data/cached_pairs"] == 24  # 16 steps × 4 pairs went round the 24 pairs: each encoded once
    gain, text = _gain(rows)
    assert gain > 1e-5, f"offline dpo: {text}"


def test_prepare_pairs_rejects_too_few_samples(make_config, tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(to_yaml(make_config()))
    assert main(["prepare", "pairs", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path), "--n", "1"]) == 2
    assert "--n must be ≥ 2" in capsys.readouterr().err
