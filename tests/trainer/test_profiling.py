"""profile.steps: a torch.profiler trace for exactly the configured steps; profile.memory is GPU-only."""

from __future__ import annotations

import json
import logging

import pytest


def test_profiler_traces_exactly_the_configured_steps(make_trainer, caplog):
    trainer = make_trainer("train.total_steps=3", "profile.steps=[2]")
    with caplog.at_level(logging.INFO, logger="diffusion_rl.trainer.profiling"):
        trainer.train()
    profile = trainer.run_dir / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["step_000002.top_ops.txt", "step_000002.trace.json"]
    trace = json.loads((profile / "step_000002.trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"phase/generate", "phase/reward", "phase/update"} <= names
    assert any(name and name.startswith("aten::") for name in names)
    top = (profile / "step_000002.top_ops.txt").read_text()
    assert "Self CPU" in top and "aten::" in top
    assert "top operators by self time" in caplog.text


def test_memory_snapshot_is_skipped_on_cpu_with_a_log_line(make_trainer, caplog):
    with caplog.at_level(logging.INFO, logger="diffusion_rl.trainer.profiling"):
        trainer = make_trainer("train.total_steps=1", "profile.steps=[1]", "profile.memory=true")
        trainer.train()
    assert "no memory snapshot" in caplog.text
    assert not list((trainer.run_dir / "profile").glob("*.memory.pickle"))
    assert (trainer.run_dir / "profile" / "step_000001.trace.json").is_file()


@pytest.mark.parametrize("steps", ["[0]", "[2,2]"])
def test_profile_steps_must_be_distinct_training_steps(make_config, steps):
    with pytest.raises(Exception, match="profile.steps"):
        make_config(f"profile.steps={steps}")
