"""What a config file may make the loader do is bounded: its size, and how far its aliases expand (a YAML bomb is
refused in one line, at once), for every reader of YAML (configs, overrides, checkpoints' config.yaml, pretraining)."""

from __future__ import annotations

import time

import pytest

from diffusion_rl.config import Config
from diffusion_rl.config.loading import (
    ALIAS_BUDGET,
    MAX_CONFIG_BYTES,
    apply_overrides,
    load_config,
    read_yaml_config,
)
from diffusion_rl.errors import UserError


def bomb(levels: int = 9, indent: str = "") -> str:
    """'Billion laughs': each anchor a list of nine aliases of the one before, 9^levels strings in all."""
    lines = [f'{indent}a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"{indent}a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def bombed_reward(levels: int = 9) -> str:
    """A config whose one reward's kwargs hold `bomb(levels)`."""
    return "rewards:\n  - name: jpeg_compressibility\n    kwargs:\n" + bomb(levels, indent=" " * 6)


def test_a_yaml_bomb_in_a_reward_kwargs_is_refused_at_once_naming_file_and_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(bombed_reward())
    started = time.perf_counter()
    with pytest.raises(UserError) as caught:
        load_config(Config, path)
    assert time.perf_counter() - started < 5
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and "at line" in message
    assert "YAML bomb" in message and f"{ALIAS_BUDGET:,}" in message


def test_a_yaml_bomb_in_an_override_is_refused_naming_the_override():
    value = "{" + bomb(5).replace("\n", ", ").rstrip(", ") + "}"
    with pytest.raises(UserError, match=r"command-line override 'rewards\.0\.kwargs=.*YAML bomb"):
        apply_overrides({"rewards": [{}]}, [f"rewards.0.kwargs={value}"])


def test_an_alias_inside_itself_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("rewards:\n  - name: jpeg_compressibility\n    kwargs: &k {again: *k}\n")
    with pytest.raises(UserError, match=r"loop\.yaml at line 3.*inside the node it names"):
        read_yaml_config(path)


def test_merge_keys_and_a_few_aliases_still_load(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text(
        "rewards:\n"
        "  - &jpeg {name: jpeg_compressibility, weight: 1.0}\n"
        "  - {<<: *jpeg, label: again, weight: 0.5}\n"
        "val: {rewards: [*jpeg]}\n"
    )
    cfg = load_config(Config, path)
    assert [r.weight for r in cfg.rewards] == [1.0, 0.5] and cfg.val.rewards[0].name == "jpeg_compressibility"


def test_lists_nested_past_the_recursion_limit_are_one_line_naming_the_file(tmp_path, capsys):
    """PyYAML raises RecursionError there, first in the CLI's engine look-up, before the command's own error."""
    from diffusion_rl.cli import main, requested_engine

    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * 20000 + "]" * 20000 + "\n")
    with pytest.raises(UserError, match=r"deep\.yaml: lists or mappings nested too deeply"):
        read_yaml_config(path)
    with pytest.raises(UserError, match=r"command-line override 'x=\[\[\[.*nested too deeply"):
        apply_overrides({}, ["x=" + "[" * 20000 + "]" * 20000])
    assert requested_engine(["config", "show", str(path)]) == {}
    assert main(["config", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"diffusion-rl: error: YAML syntax error in {path}: lists")


def test_a_config_file_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "huge.yaml"
    with open(path, "w") as f:
        f.write("run: {seed: 0}\n")
        f.write("# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    with pytest.raises(UserError, match=r"huge\.yaml: 1\.0 MiB is larger than a config file may be \(1 MiB"):
        read_yaml_config(path)
    path.write_text("run: {seed: 0}\n" + "# padding\n" * (MAX_CONFIG_BYTES // 20))  # under the limit: read
    assert read_yaml_config(path) == {"run": {"seed": 0}}


def test_every_yaml_reader_is_bounded(tmp_path):
    """The CLI's early engine look-up, a checkpoint's config.yaml and a pretraining config read through the same
    loader."""
    from diffusion_rl.checkpoint.weights import checkpoint_config
    from diffusion_rl.cli import requested_engine
    from diffusion_rl.pretrain.config import load_pretrain_config

    checkpoint = tmp_path / "step_000001"
    checkpoint.mkdir()
    (checkpoint / "config.yaml").write_text(bombed_reward(8))
    with pytest.raises(UserError, match=r"step_000001/config\.yaml at line .*YAML bomb"):
        checkpoint_config(checkpoint)
    assert requested_engine(["train", str(checkpoint / "config.yaml")]) == {}  # the command itself refuses it
    pretrain = tmp_path / "pretrain.yaml"
    pretrain.write_text("run: {out: x}\nlog:\n" + bomb(8, "  "))
    with pytest.raises(UserError, match=r"pretrain\.yaml at line .*YAML bomb"):
        load_pretrain_config(str(pretrain))


@pytest.mark.parametrize("command", ["train", "config"])
def test_the_cli_refuses_a_bomb_in_one_line_with_status_2(command, tmp_path, capsys):
    from diffusion_rl.cli import main

    path = tmp_path / "bomb.yaml"
    path.write_text(bombed_reward())
    argv = ["train", str(path)] if command == "train" else ["config", "show", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("diffusion-rl: error: YAML aliases in") and "bomb.yaml" in err
