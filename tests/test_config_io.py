"""Strict YAML + command-line config loading into dataclasses (diffusion_rl.config.loading, config.convert)."""

from __future__ import annotations  # the schema's annotations are strings: the loader must resolve them

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
import yaml

from diffusion_rl.config.convert import from_dict, to_dict
from diffusion_rl.config.loading import apply_overrides, load_config, to_yaml
from diffusion_rl.config.reference import describe, field_help
from diffusion_rl.errors import UserError


@dataclass
class Reward:
    name: str = field(metadata={"help": "Registered reward name."})
    weight: float = field(default=1.0, metadata={"help": "Weight in the summed reward."})
    kwargs: dict[str, Any] = field(default_factory=dict, metadata={"help": "Extra arguments for the reward."})


@dataclass
class Train:
    lr: float = field(default=3e-4, metadata={"help": "Peak learning rate."})
    steps: int = field(default=100, metadata={"help": "Optimizer steps."})
    bf16: bool = field(default=True, metadata={"help": "Compute in bfloat16."})

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}; set train.lr to e.g. 1e-4")


@dataclass
class Lora:
    rank: int = field(default=32, metadata={"help": "LoRA rank."})
    targets: tuple[str, ...] = field(default=("to_q", "to_k"), metadata={"help": "Modules that get adapters."})


@dataclass
class Sample:
    model: str = field(metadata={"help": "Model path or hub id."})
    train: Train = field(default_factory=Train, metadata={"help": "Optimization."})
    rewards: list[Reward] = field(default_factory=lambda: [Reward("aesthetic")], metadata={"help": "Rewards."})
    sampler: Literal["sde", "ode", "cps"] = field(default="sde", metadata={"help": "Sampler kind."})
    lora: Lora | None = field(default=None, metadata={"help": "LoRA adapters; null trains all weights."})
    resolution: tuple[int, int] = field(default=(512, 512), metadata={"help": "Image height and width."})
    seed: int | None = field(default=None, metadata={"help": "Random seed."})
    tags: dict[str, str] = field(default_factory=dict, metadata={"help": "Free-form run tags."})
    extra: Any = None


def _write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def _error(fn, *args) -> str:
    with pytest.raises(UserError) as info:
        fn(*args)
    return str(info.value)


# --- defaults and loading ---------------------------------------------------------------------------------------


def test_missing_keys_take_field_defaults():
    cfg = from_dict(Sample, {"model": "tiny"})
    assert cfg == Sample(model="tiny")
    assert cfg.train.lr == 3e-4 and cfg.rewards == [Reward("aesthetic")] and cfg.lora is None


def test_load_config_builds_nested_sections_lists_and_tuples(tmp_path):
    path = _write(
        tmp_path,
        """
model: tiny
train: {steps: 7, bf16: false}
rewards:
  - name: clip
    weight: 2
  - {name: ocr, kwargs: {lang: en}}
sampler: cps
lora: {rank: 8, targets: [to_v]}
resolution: [256, 384]
tags: {owner: me}
""",
    )
    cfg = load_config(Sample, path)
    assert cfg.train == Train(lr=3e-4, steps=7, bf16=False)
    assert cfg.rewards == [Reward("clip", 2.0), Reward("ocr", kwargs={"lang": "en"})]
    assert isinstance(cfg.rewards[0].weight, float)
    assert cfg.sampler == "cps"
    assert cfg.lora == Lora(rank=8, targets=("to_v",))
    assert cfg.resolution == (256, 384)
    assert cfg.tags == {"owner": "me"}


def test_empty_file_and_no_file_give_defaults(tmp_path):
    assert load_config(Sample, _write(tmp_path, ""), ["model=m"]) == Sample(model="m")
    assert load_config(Sample, None, ["model=m"]) == Sample(model="m")


def test_exponent_floats_parse_as_floats_in_yaml_and_overrides(tmp_path):
    # PyYAML's YAML 1.1 rules read 1e-4 as a string; the loader must not.
    cfg = load_config(Sample, _write(tmp_path, "model: m\ntrain: {lr: 1e-4}\nextra: 3e-4\n"))
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.extra == 3e-4  # an Any field gets a float too, not the string '3e-4'
    cfg = load_config(Sample, None, ["model=m", "train.lr=3e-4", "extra=1E5"])
    assert cfg.train.lr == 3e-4 and cfg.extra == 1e5


def test_quoted_numeric_string_is_accepted_for_a_float_field():
    assert from_dict(Train, {"lr": "3e-4"}).lr == 3e-4
    assert from_dict(Train, {"lr": "2"}).lr == 2.0


def test_yes_and_no_stay_strings():
    # YAML 1.1 would turn these into booleans (the "Norway problem").
    assert apply_overrides({}, ["a=yes", "b=no", "c=on", "d=true"]) == {"a": "yes", "b": "no", "c": "on", "d": True}


# --- overrides --------------------------------------------------------------------------------------------------


def test_overrides_set_scalars_nested_keys_and_list_entries(tmp_path):
    path = _write(tmp_path, "model: tiny\nrewards: [{name: clip}, {name: ocr}]\n")
    cfg = load_config(Sample, path, ["model=other", "train.steps=5", "rewards.1.weight=2", "seed=null"])
    assert cfg.model == "other"
    assert cfg.train.steps == 5
    assert cfg.rewards[1] == Reward("ocr", 2.0)
    assert cfg.seed is None


def test_overrides_create_missing_sections():
    assert apply_overrides({"model": "m"}, ["lora.rank=4"]) == {"model": "m", "lora": {"rank": 4}}
    assert load_config(Sample, None, ["model=m", "lora.rank=4"]).lora == Lora(rank=4)
    # a section written as null in YAML (`lora:`) is filled the same way
    assert apply_overrides({"lora": None}, ["lora.rank=4"]) == {"lora": {"rank": 4}}


def test_override_values_are_yaml():
    data = apply_overrides({}, ["a=[1, 2]", "b={k: v}", "c=null", "d=hello world", "e=x=y"])
    assert data == {"a": [1, 2], "b": {"k": "v"}, "c": None, "d": "hello world", "e": "x=y"}


def test_apply_overrides_leaves_its_input_unchanged():
    data = {"train": {"lr": 1.0}}
    apply_overrides(data, ["train.lr=2"])
    assert data == {"train": {"lr": 1.0}}


@pytest.mark.parametrize("bad", ["train.lr", "=3", "train..lr=1", "train.=1"])
def test_malformed_override_shows_argument_and_expected_form(bad):
    message = _error(apply_overrides, {}, [bad])
    assert repr(bad) in message and "dotted.key=value" in message


def test_override_list_index_out_of_range():
    message = _error(apply_overrides, {"rewards": [{"name": "clip"}]}, ["rewards.3.weight=2"])
    assert "'rewards' is a list of 1 entries" in message and "'3'" in message


def test_override_of_unlisted_list_entry_explains_what_to_do():
    # rewards is not written in the file, so rewards.0 cannot index the default list
    message = _error(load_config, Sample, None, ["model=m", "rewards.0.weight=2"])
    assert "must be written out in the config file" in message


def test_override_typo_gets_suggestion_and_names_the_override():
    message = _error(load_config, Sample, None, ["model=m", "train.lr_rate=1e-4"])
    assert "command-line override 'train.lr_rate=1e-4'" in message
    assert "unknown config key 'train.lr_rate' (did you mean 'train.lr'?)" in message


def test_an_override_whose_value_is_not_yaml_is_one_line_naming_where():
    message = _error(apply_overrides, {"rewards": [{"name": "clip"}]}, ["rewards.0.kwargs={bad"])
    assert message == (
        "command-line override 'rewards.0.kwargs={bad': YAML syntax error in the value at line 1, column 5: "
        "expected ',' or '}', but got '<stream end>' (while parsing a flow mapping)"
    )


# --- errors -----------------------------------------------------------------------------------------------------


def test_unknown_key_names_full_key_suggests_and_lists_valid_keys():
    message = _error(from_dict, Sample, {"model": "m", "train": {"stpes": 3}})
    assert message == (
        "unknown config key 'train.stpes' (did you mean 'train.steps'?); valid keys in 'train': lr, steps, bf16"
    )


def test_unknown_key_in_the_wrong_section_points_to_where_it_lives():
    message = _error(from_dict, Sample, {"model": "m", "rank": 3})
    assert "unknown config key 'rank' (did you mean 'lora.rank'?)" in message


def test_unknown_key_in_a_file_names_the_file(tmp_path):
    path = _write(tmp_path, "model: m\nsampelr: sde\n")
    message = _error(load_config, Sample, path)
    assert message.startswith(f"{path}: unknown config key 'sampelr' (did you mean 'sampler'?)")


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"train": {"lr": "abc"}}, "config key 'train.lr' expects float, got str 'abc'"),
        ({"train": {"steps": True}}, "config key 'train.steps' expects int, got bool True"),
        ({"train": {"steps": 1.5}}, "config key 'train.steps' expects int, got float 1.5"),
        ({"train": {"bf16": 1}}, "config key 'train.bf16' expects bool, got int 1"),
        ({"train": {"lr": False}}, "config key 'train.lr' expects float, got bool False"),
        ({"model": 3}, "config key 'model' expects str, got int 3"),
        ({"train": None}, "config key 'train' expects a mapping (the Train section), got null"),
        ({"train": [1]}, "config key 'train' expects a mapping (the Train section), got list [1]"),
        ({"rewards": {"name": "clip"}}, "config key 'rewards' expects list[Reward], got dict"),
        ({"rewards": [{"name": "a", "weight": "x"}]}, "config key 'rewards.0.weight' expects float, got str 'x'"),
        ({"resolution": [1, 2, 3]}, "config key 'resolution' expects tuple[int, int] (2 entries), got 3"),
        ({"lora": {"targets": [1]}}, "config key 'lora.targets.0' expects str, got int 1"),
        ({"seed": "x"}, "config key 'seed' expects int | null, got str 'x'"),
        ({"tags": {"a": 1}}, "config key 'tags.a' expects str, got int 1"),
    ],
)
def test_wrong_type_names_key_expected_and_actual(data, expected):
    assert expected in _error(from_dict, Sample, {"model": "m", **data})


def test_int_is_accepted_for_float():
    lr = from_dict(Train, {"lr": 1}).lr
    assert lr == 1.0 and isinstance(lr, float)


def test_literal_error_lists_allowed_values():
    message = _error(from_dict, Sample, {"model": "m", "sampler": "sdee"})
    assert message == "config key 'sampler' must be one of 'sde', 'ode', 'cps'; got str 'sdee' (did you mean 'sde'?)"


def test_missing_required_key_is_named_with_its_path():
    assert _error(from_dict, Sample, {}).startswith("missing required key 'model'")
    assert _error(from_dict, Sample, {"model": "m", "rewards": [{"weight": 2}]}).startswith(
        "missing required key 'rewards.0.name'"
    )


def test_post_init_value_error_becomes_user_error_with_section():
    message = _error(from_dict, Sample, {"model": "m", "train": {"lr": -1}})
    assert message == "invalid config in 'train': lr must be positive, got -1.0; set train.lr to e.g. 1e-4"


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.yaml"
    assert _error(load_config, Sample, path) == f"config file not found: {path}"


def test_a_missing_base_file_names_the_config_that_names_it_and_where_it_looked(tmp_path):
    (tmp_path / "sub").mkdir()
    path = _write(tmp_path / "sub", "base: quickstart.yaml\nmodel: m\n")
    assert _error(load_config, Sample, path) == (
        f"{path}: 'base: quickstart.yaml' names a config file that does not exist: {tmp_path / 'sub/quickstart.yaml'} "
        "(a base path is relative to the folder of the file that names it)"
    )


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = _write(tmp_path, "model: m\ntrain:\n  lr: [1, 2\n  steps: 3\n")
    message = _error(load_config, Sample, path)
    assert str(path) in message and "line 4" in message


def test_duplicate_yaml_key_is_an_error(tmp_path):
    path = _write(tmp_path, "model: m\ntrain:\n  lr: 1\n  lr: 2\n")
    message = _error(load_config, Sample, path)
    assert "duplicate key 'lr'" in message and "line 4" in message


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("train:\n  lr: !!float abc\n", "line 2, column 7: 'abc' is not a valid !!float"),
        ("train:\n  bf16: !!bool maybe\n", "line 2, column 9: 'maybe' is not a valid !!bool"),
        ("tags: !!set [a]\n", "line 1, column 7: expected a mapping node, but found sequence"),
        ("tags: {[a]: 1}\n", "line 1, column 8: found unhashable key"),
    ],
)
def test_a_value_pyyaml_fails_to_build_names_file_and_line(tmp_path, text, problem):
    path = _write(tmp_path, text)
    assert _error(load_config, Sample, path).startswith(f"YAML syntax error in {path} at {problem}")


def test_top_level_must_be_a_mapping(tmp_path):
    message = _error(load_config, Sample, _write(tmp_path, "- a\n- b\n"))
    assert "top level of a config file must be a mapping" in message


# --- writing and documenting ------------------------------------------------------------------------------------


def _full_sample() -> Sample:
    return Sample(
        model="tiny",
        train=Train(lr=1e-5, steps=3, bf16=False),
        rewards=[Reward("clip", 0.5, {"k": [1, 2]}), Reward("1e-4")],
        sampler="ode",
        lora=Lora(rank=4, targets=("a", "b")),
        resolution=(64, 32),
        seed=7,
        tags={"yes": "no"},
        extra={"nested": [1.5, None]},
    )


def test_to_dict_is_plain_data_and_round_trips():
    cfg = _full_sample()
    data = to_dict(cfg)
    assert data["resolution"] == [64, 32] and data["lora"]["targets"] == ["a", "b"]
    assert from_dict(Sample, data) == cfg


def test_to_yaml_round_trips_through_load_config(tmp_path):
    cfg = _full_sample()
    text = to_yaml(cfg)
    assert text.startswith("model: tiny\ntrain:\n")  # field order, not sorted
    assert load_config(Sample, _write(tmp_path, text)) == cfg
    # strings that look like other types are quoted, so plain yaml.safe_load reads them back as strings too
    assert yaml.safe_load(text)["tags"] == {"yes": "no"}
    assert yaml.safe_load(text)["rewards"][1]["name"] == "1e-4"


def test_field_help_maps_every_dotted_key_to_its_help():
    helps = field_help(Sample)
    assert helps["train.lr"] == "Peak learning rate."
    assert helps["rewards.*.weight"] == "Weight in the summed reward."
    assert helps["lora.rank"] == "LoRA rank."
    assert helps["extra"] == ""
    expected = {"model", "train", "rewards", "sampler", "lora", "resolution", "seed", "tags", "extra"}
    assert {k for k in helps if "." not in k} == expected


def test_describe_lists_every_key_with_type_default_and_help():
    text = describe(Sample)
    for key in field_help(Sample):
        assert f"\n{key}: " in "\n" + text
    assert "train.lr: float = 0.0003\n    Peak learning rate.\n" in text
    assert "model: str = (required)\n" in text
    assert "sampler: one of 'sde', 'ode', 'cps' = sde\n" in text
    assert "train: section Train\n" in text


def test_init_false_fields_are_not_config_keys():
    @dataclass
    class WithDerived:
        a: int = 1
        b: int = dataclasses.field(init=False, default=0)

    assert to_dict(WithDerived()) == {"a": 1}
    assert "unknown config key 'b'" in _error(from_dict, WithDerived, {"b": 2})


def test_a_config_file_extends_its_base_file(tmp_path):
    from diffusion_rl.config.loading import read_yaml_config

    (tmp_path / "base.yaml").write_text("a: 1\nsection:\n  x: 1\n  y: 2\nitems: [1, 2]\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "child.yaml").write_text("base: ../base.yaml\nsection:\n  y: 3\nitems: [9]\n")
    assert read_yaml_config(tmp_path / "sub" / "child.yaml") == {"a": 1, "section": {"x": 1, "y": 3}, "items": [9]}


def test_a_cycle_of_base_files_is_an_error(tmp_path):
    from diffusion_rl.config.loading import read_yaml_config

    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(UserError, match="cycle"):
        read_yaml_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(UserError, match="missing.yaml"):
        read_yaml_config(tmp_path / "c.yaml")


def test_redact_secrets_replaces_secret_named_values_at_any_depth():
    from diffusion_rl.config.secrets import REDACTED, redact_secrets, without_redacted

    kwargs = {
        "api_key": "sk-1",
        "API_KEY_ENV": "VLM_KEY",  # names the variable: not a secret
        "headers": {"Authorization": "Bearer sk-1", "x-api-key": "sk-2", "Accept": "json"},
        "hf_token": "hf_abc",
        "password": None,  # nothing to hide
        "max_tokens": 256,
        "tokenizer": "path/to/tok",
        "list": [{"client_secret": "s"}],
    }
    assert redact_secrets({"rewards": [{"name": "vlm", "kwargs": kwargs}]}) == {
        "rewards": [
            {
                "name": "vlm",
                "kwargs": {
                    "api_key": REDACTED,
                    "API_KEY_ENV": "VLM_KEY",
                    "headers": {"Authorization": REDACTED, "x-api-key": REDACTED, "Accept": "json"},
                    "hf_token": REDACTED,
                    "password": None,
                    "max_tokens": 256,
                    "tokenizer": "path/to/tok",
                    "list": [{"client_secret": REDACTED}],
                },
            }
        ]
    }
    assert kwargs["api_key"] == "sk-1"  # the input is left as it was
    kept, dropped = without_redacted(redact_secrets(kwargs))
    assert dropped == ["api_key", "headers.Authorization", "headers.x-api-key", "hf_token", "list"]
    assert kept["headers"] == {"Accept": "json"} and kept["API_KEY_ENV"] == "VLM_KEY" and "api_key" not in kept


SECRET_KEYS = ["api_key", "x-api-key", "apiKey", "HF_TOKEN", "auth_token", "private_key", "privateKey", "openai_key",
               "aws_secret_access_key", "client_secret", "Authorization", "password", "db_passwd", "credentials",
               "private", "key", "token", "basic_auth"]  # fmt: skip
HARMLESS_KEYS = ["max_tokens", "text_tokens", "tokenizer", "tokenizer_path", "pad_token", "eos_token_id",
                 "image_key", "sort_key", "api_key_env", "TOKEN_ENV", "keys", "num_key_value_heads", "keyword",
                 "bypass", "url"]  # fmt: skip


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_a_key_named_for_a_secret_is_redacted(key):
    from diffusion_rl.config.secrets import REDACTED, redact_secrets

    assert redact_secrets({"kwargs": {key: "s3cr3t", "n": 1}}) == {"kwargs": {key: REDACTED, "n": 1}}


@pytest.mark.parametrize("key", HARMLESS_KEYS)
def test_a_key_that_only_contains_a_secret_word_is_kept(key):
    from diffusion_rl.config.secrets import redact_secrets

    assert redact_secrets({"kwargs": {key: "value"}}) == {"kwargs": {key: "value"}}


def test_a_flag_under_a_secret_looking_name_is_kept():
    from diffusion_rl.config.secrets import redact_secrets

    assert redact_secrets({"private": True, "token": None}) == {"private": True, "token": None}


def test_the_credentials_in_a_url_are_redacted_anywhere_and_count_as_redacted():
    from diffusion_rl.config.secrets import REDACTED, redact_secrets, redact_text, without_redacted

    kwargs = {"url": "http://user:SECRET@host:8000/v1", "mirrors": ["https://tok@h.example"], "mail": "a@b.c",
              "plain": "http://host/x@y"}  # fmt: skip
    redacted = redact_secrets(kwargs)
    assert redacted == {"url": f"http://{REDACTED}@host:8000/v1", "mirrors": [f"https://{REDACTED}@h.example"],
                        "mail": "a@b.c", "plain": "http://host/x@y"}  # fmt: skip
    assert without_redacted(redacted) == ({"mail": "a@b.c", "plain": "http://host/x@y"}, ["url", "mirrors"])
    assert redact_text("no answer from http://u:p@h/score") == f"no answer from http://{REDACTED}@h/score"


def test_a_redacted_config_loads_back(tmp_path):
    from diffusion_rl.config import Config
    from diffusion_rl.config.secrets import REDACTED, redact_secrets

    cfg = load_config(Config, None, ["rewards=[{name: vlm, kwargs: {base_url: 'http://x', api_key: sk-1}}]"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(redact_secrets(cfg)))
    back = load_config(Config, path)
    assert back.rewards[0].kwargs == {"base_url": "http://x", "api_key": REDACTED}
    assert back.model == cfg.model and back.sampling == cfg.sampling


def test_changed_settings_lists_each_differing_leaf_in_the_new_trees_order():
    from diffusion_rl.config.convert import changed_settings

    before = {"model": {"lora": {"enabled": False, "rank": 32}}, "rewards": [{"name": "a"}], "gone": 1}
    after = {"rewards": [{"name": "b"}], "model": {"lora": {"enabled": True, "rank": 32}, "new": "x"}}
    assert changed_settings(before, after) == [
        'rewards ([{"name": "a"}] → [{"name": "b"}])',
        "model.lora.enabled (false → true)",
        'model.new (null → "x")',
        "gone (1 → null)",
    ]
    assert changed_settings(before, before) == []


def test_a_config_without_run_dir_runs_in_a_directory_named_after_it(tmp_path):
    """Not in the default's (another config's run, which run.resume=auto would resume): runs/<the file's name>; a
    run.dir of its own, of its base or on the command line wins."""
    from diffusion_rl.config import Config, load

    mine = tmp_path / "my_run.yaml"
    mine.write_text("train: {lr: 0.001}\n")
    assert load(str(mine)).run.dir == "runs/my_run"
    assert load(str(mine), ["run.dir=elsewhere"]).run.dir == "elsewhere"
    (tmp_path / "empty.yaml").write_text("")
    assert load(str(tmp_path / "empty.yaml")).run.dir == "runs/empty"
    (tmp_path / "base.yaml").write_text("run: {dir: runs/base_dir}\n")
    (tmp_path / "derived.yaml").write_text("base: base.yaml\ntrain: {lr: 0.001}\n")
    assert load(str(tmp_path / "derived.yaml")).run.dir == "runs/base_dir"
    assert load(None).run.dir == Config().run.dir == "runs/default"
