"""model.embedding_cache under engine.kind=ray: the trainer actors and the rollout actors read the one cache file."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from diffusion_rl.commands.prepare_embeddings import prepare_embeddings  # noqa: E402
from diffusion_rl.errors import UserError  # noqa: E402
from diffusion_rl.trainer.trainer import Trainer  # noqa: E402
from tests.engine.conftest import SEPARATE  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_session")


def test_trainers_and_rollout_actors_share_one_read_only_cache_file(
    make_config, tmp_path, run_trainer, rows_close, ray_overrides, equal_overrides
):
    file = tmp_path / "prompts.safetensors"
    prepare_embeddings(make_config(), str(file))
    cached = f"model.embedding_cache={file}"
    local, local_rows = run_trainer(make_config(*equal_overrides, cached, "train.total_steps=1",
                                                f"run.dir={tmp_path / 'local'}"))  # fmt: skip
    cfg = make_config(*equal_overrides, *ray_overrides, *SEPARATE, cached, "engine.num_workers=2",
                      "train.total_steps=1")  # fmt: skip
    _, ray_rows = run_trainer(cfg)
    assert ray_rows[0]["reward/mean"] == local_rows[0]["reward/mean"]  # the same embeddings: the same images
    rows_close(local_rows[0], ray_rows[0], rel=1e-4)


def test_a_cache_file_lacking_a_prompt_stops_the_ray_run_at_its_start(make_config, tmp_path, ray_overrides):
    # the actors read the file when they start: one that lacks a prompt of the run stops it there, naming the file
    # (one trainer shows it: each reads the whole file, and a second only costs another process start)
    file = tmp_path / "prompts.safetensors"
    prepare_embeddings(make_config(), str(file))
    cached = f"model.embedding_cache={file}"
    other = tmp_path / "other.txt"
    other.write_text("a prompt nobody cached\n")
    with pytest.raises(UserError, match=rf"{file} lacks 1 of the run's"):
        Trainer(make_config(*ray_overrides, cached, "engine.num_workers=1", f"data.train={other}"))
