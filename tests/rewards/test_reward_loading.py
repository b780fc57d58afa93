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
