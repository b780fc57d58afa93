"""A run with model.embedding_cache trains as one without (its text encoders released after the start), and
`diffusion-rl prepare embeddings` makes the file a run then only reads."""

from __future__ import annotations

import pytest

from diffusion_rl.cli import main
from diffusion_rl.errors import UserError
from diffusion_rl.trainer import make_trainer

SKIP = ("timing/", "perf/")  # durations differ run to run
ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
RUN = ("val.before_train=true", "val.every=1")  # validation prompts go through the cache too


def _metrics(rows):
    return [{k: v for k, v in row.items() if not k.startswith(SKIP) and k != "images_per_second"} for row in rows]


def test_a_run_with_the_cache_trains_as_one_without(make_config, tmp_path):
    plain = make_trainer(make_config(*RUN, f"run.dir={tmp_path / 'plain'}"))
    plain_rows = plain.train()
    cached = make_trainer(make_config(*RUN, f"run.dir={tmp_path / 'cached'}", "model.embedding_cache=auto"))
    model = cached.engine.model
    assert all(getattr(model.pipeline, name) is None for name in ENCODERS)  # released before the first step
    rows = cached.train()
    assert len(list((tmp_path / "cached" / "embedding_cache").glob("sd3-*.safetensors"))) == 1
    # Rewards score uint8 images: identical. The rest agrees to float32 rounding at worst: the encoders batch texts
    # differently (the run's texts at the start, not a step's), and a batched matmul (CLIP's pooled projection) need
    # not give a row the same last bit in every batch size (here every number is identical).
    expected, got = _metrics(plain_rows), _metrics(rows)
    assert [r.keys() for r in got] == [r.keys() for r in expected]
    for want, have in zip(expected, got):
        for key, value in want.items():
            if "reward" in key:
                assert have[key] == value, key
            assert have[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert "val/reward/mean" in got[0] and "loss" in got[1]


def test_prepare_embeddings_writes_the_file_a_run_reads(train_argv, make_config, tmp_path):
    file = tmp_path / "prompts.safetensors"
    config, *overrides = train_argv(*RUN)[1:]
    assert main(["prepare", "embeddings", "--out", str(file), config, *overrides]) == 0
    assert file.is_file()
    # without --out: model.embedding_cache, or auto (<run.dir>/embedding_cache/) when the config has none
    assert main(["prepare", "embeddings", config, *overrides]) == 0
    assert len(list((tmp_path / "run" / "embedding_cache").glob("sd3-*.safetensors"))) == 1
    trainer = make_trainer(make_config(*RUN, f"model.embedding_cache={file}"))
    trainer.engine.model._encode_texts = lambda texts: pytest.fail(f"encoded {texts}")
    trainer.train()
    assert all(getattr(trainer.engine.model.pipeline, name) is None for name in ENCODERS)
    # a prompt file the cache was not made for: the run says so before any work
    other = tmp_path / "other.txt"
    other.write_text("a prompt nobody cached\n")
    with pytest.raises(UserError, match=rf"{file} lacks 1 of the run's"):
        make_trainer(make_config(*RUN, f"model.embedding_cache={file}", f"data.train={other}"))


def test_the_run_texts_are_its_prompts_validation_prompts_and_negatives(make_config, tmp_path):
    from diffusion_rl.trainer.setup import load_run_prompts

    def run_texts(cfg):
        return load_run_prompts(cfg).texts()

    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "a cat", "negative_prompt": "blurry"}\n{"prompt": "a dog"}\n{"prompt": "a cat"}\n')
    val = tmp_path / "val.txt"
    val.write_text("a bird\n")
    assert run_texts(make_config(f"data.train={train}", f"val.prompts={val}")) == ["a cat", "blurry", "a dog", "",
                                                                                  "a bird"]  # fmt: skip
    assert "a bird" not in run_texts(make_config(f"data.train={train}", "val.prompts=null"))


def test_a_worker_caches_the_texts_its_spec_names_and_reads_no_dataset(make_config, tmp_path):
    from diffusion_rl.engine.worker import PolicyWorker
    from diffusion_rl.trainer.setup import worker_spec

    # the trainer reads the prompts once and hands the worker their texts: the worker never opens data.train
    cfg = make_config("model.embedding_cache=auto", f"data.train={tmp_path / 'absent.txt'}")
    worker = PolicyWorker(worker_spec(cfg, ["a red square", ""]))
    assert worker.model.embedding_cache.missing(["a red square", ""]) == []
    assert worker.model.embedding_cache.missing(["a blue circle"]) == ["a blue circle"]
