import textwrap

import numpy as np
import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.rewards import make_reward

USER_CODE = textwrap.dedent(
    """
    import numpy as np

    def brightness(images, prompts, metadata, scale=1.0):
        return (images.reshape(len(images), -1).mean(axis=1) * scale).astype(np.float32)

    NOT_CALLABLE = 3
    """
)


def _images() -> np.ndarray:
    images = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    images[0] = 10
    images[1] = 200
    return images


def test_user_function_from_file_path(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_CODE)
    reward = make_reward(f"{path}:brightness")
    np.testing.assert_allclose(reward(_images(), ["", ""], [{}, {}]), [10.0, 200.0])


def test_user_function_kwargs_are_bound(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_CODE)
    reward = make_reward(f"{path}:brightness", scale=0.5)
    np.testing.assert_allclose(reward(_images(), ["", ""], [{}, {}]), [5.0, 100.0])


def test_user_function_from_module(tmp_path, monkeypatch):
    (tmp_path / "user_reward_module_for_test.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = make_reward("user_reward_module_for_test:brightness")
    np.testing.assert_allclose(reward(_images(), ["", ""], [{}, {}]), [10.0, 200.0])


def test_missing_file_is_user_error_naming_it(tmp_path):
    with pytest.raises(UserError, match="nope.py"):
        make_reward(f"{tmp_path}/nope.py:brightness")


def test_missing_module_is_user_error_naming_it():
    with pytest.raises(UserError, match="no_such_module_xyz"):
        make_reward("no_such_module_xyz.rewards:brightness")


def test_missing_attribute_is_user_error_with_suggestion(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_CODE)
    with pytest.raises(UserError, match="no attribute 'brightnes'.*did you mean 'brightness'"):
        make_reward(f"{path}:brightnes")


def test_non_callable_attribute_is_user_error(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_CODE)
    with pytest.raises(UserError, match="NOT_CALLABLE"):
        make_reward(f"{path}:NOT_CALLABLE")


def test_unknown_registered_name_lists_known_rewards():
    with pytest.raises(UserError, match="jpeg_compressibility"):
        make_reward("jpeg_compresibility")


def test_unexpected_kwarg_for_builtin_is_user_error():
    with pytest.raises(UserError, match="jpeg_incompressibility.*quality"):
        make_reward("jpeg_incompressibility", quality=80)


def test_a_missing_or_unknown_reward_kwarg_is_named_as_such():
    with pytest.raises(UserError) as missing:
        make_reward("clip_score")  # `path` is required
    assert str(missing.value).startswith("reward 'clip_score' needs kwargs path (in the config: kwargs: {path: ...})")
    with pytest.raises(UserError) as unknown:
        make_reward("clip_score", pth="models/clip")
    assert str(unknown.value).startswith("reward 'clip_score': unknown kwargs pth (did you mean 'path'?); accepted: ")
    with pytest.raises(UserError, match=r"^reward 'jpeg_compressibility': unknown kwargs quality, scale; accepted: "):
        make_reward("jpeg_compressibility", scale=2, quality=1)


SIGNATURES = textwrap.dedent(
    """
    def two(images, prompts):
        return images.mean(axis=(1, 2, 3))

    def any_extra(images, prompts, metadata=None, **options):
        return images.mean(axis=(1, 2, 3))

    class Group:
        group = True

        def score_group(self, images):
            return images.mean(axis=(1, 2, 3))

        def __call__(self, images, prompts, metadata):
            return images.mean(axis=(1, 2, 3))

    group = Group()
    """
)


@pytest.mark.parametrize(
    ("fn", "kwargs", "message"),
    [
        ("two", {}, r"cannot be called as two\(images, prompts, metadata\) \(too many positional arguments\); "
                    r"it takes \(images, prompts\)"),
        ("brightness", {"scael": 2}, r"cannot be called as brightness\(images, prompts, metadata, scael=…\) "
                                     r"\(got an unexpected keyword argument 'scael'\); it takes \(images, prompts, "
                                     r"metadata, scale=1.0\)"),
        ("group", {}, r"cannot be called as group.score_group\(images, prompts, metadata\)"),
    ],
)  # fmt: skip
def test_a_user_function_that_cannot_take_a_rewards_arguments_is_refused_when_built(tmp_path, fn, kwargs, message):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_CODE + SIGNATURES)
    with pytest.raises(UserError, match=f"^user reward '{path}:{fn}' {message}"):
        make_reward(f"{path}:{fn}", **kwargs)


def test_a_user_function_with_defaults_and_keyword_catch_alls_builds(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_CODE + SIGNATURES)
    reward = make_reward(f"{path}:any_extra", anything=1)
    np.testing.assert_allclose(reward(_images(), ["", ""], [{}, {}]), [10.0, 200.0])


@pytest.mark.parametrize(
    ("code", "line", "cause"),
    [
        ("def fn(images, prompts, metadata:\n", 1, "SyntaxError: '(' was never closed); fix the code"),
        ("import numpy\nimport no_such_package_xyz\n", 2, "ModuleNotFoundError: No module named "
                                                          "'no_such_package_xyz'); install 'no_such_package_xyz' or "
                                                          "fix the import"),
        ("\n\nraise RuntimeError('no GPU here')\n", 3, "RuntimeError: no GPU here); fix the code"),
    ],
)  # fmt: skip
def test_a_user_file_or_module_that_fails_to_import_is_one_line_naming_the_file_line_and_cause(
    tmp_path, monkeypatch, code, line, cause
):
    path = tmp_path / "broken_reward_module_for_test.py"
    path.write_text(code)
    with pytest.raises(UserError) as by_file:
        make_reward(f"{path}:fn")
    assert str(by_file.value) == f"user reward file '{path}' failed to import ({path}, line {line}: {cause}"
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as by_module:
        make_reward("broken_reward_module_for_test:fn")
    assert str(by_module.value) == (
        f"user reward module 'broken_reward_module_for_test' failed to import ({path}, line {line}: {cause}"
    )


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("remote", {"url": "http://127.0.0.1:9", "timeout": "abc"}, "kwargs timeout='abc' must be a number (default "
                                                                    "120.0)"),
        ("remote", {"url": "http://127.0.0.1:9", "retries": "x"}, "kwargs retries='x' must be an int (default 3)"),
        ("remote", {"url": "http://127.0.0.1:9", "retries": True}, "kwargs retries=True must be an int (default 3)"),
        ("remote", {"url": "http://127.0.0.1:9", "check_health": 1}, "kwargs check_health=1 must be true or false "
                                                                     "(default True)"),
        ("remote", {"url": 9}, "kwargs url=9 must be a string"),
        ("remote", {"url": "http://127.0.0.1:9", "max_failed_batches": 2.5}, "kwargs max_failed_batches=2.5 must be "
                                                                             "an int or null (default 3)"),
        ("shapes_geneval", {"shape_weight": "x"}, "kwargs shape_weight='x' must be a number (default 0.0)"),
        ("motion", {"target": "x"}, "kwargs target='x' must be a number (default 0.05)"),
        ("imagereward", {"checkpoint": "c", "tokenizer_path": "t", "batch_size": "8"},  # future annotations
         "kwargs batch_size='8' must be an int (default 16)"),
    ],
)  # fmt: skip
def test_a_reward_kwarg_of_the_wrong_type_is_one_line_naming_the_reward_key_value_and_type(name, kwargs, message):
    with pytest.raises(UserError) as e:
        make_reward(name, **kwargs)
    assert str(e.value) == f"reward '{name}': {message}"


def test_a_reward_kwarg_of_a_declared_type_is_accepted_an_int_as_a_number_and_null_where_allowed():
    assert make_reward("motion", target=1) is not None
    assert make_reward("shapes_geneval", shape_weight=2, min_area_fraction=0.01) is not None
    assert make_reward("rank", reward={"name": "motion", "kwargs": {"target": 0.5}}) is not None  # Any: not checked
    with pytest.raises(UserError, match=r"^reward 'motion': kwargs target=None must be a number"):
        make_reward("rank", reward={"name": "motion", "kwargs": {"target": None}})  # a nested entry is checked too


def test_every_entrys_kwargs_are_checked_before_any_reward_is_built():
    from diffusion_rl.config.data import RewardSpec
    from diffusion_rl.rewards.build import build_combiner

    specs = [RewardSpec(name="jpeg_compressibility"), RewardSpec(name="remote", kwargs={"url": "x", "timeout": "1"})]
    with pytest.raises(UserError, match=r"^reward 'remote': kwargs timeout='1' must be a number"):
        build_combiner(specs, lambda s: pytest.fail("a reward was built"))
