"""Without rapidocr or onnxruntime the `ocr` reward fails when it is made (start-up), naming the package to install."""

import re
import sys
from pathlib import Path

import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.rewards import make_reward
from diffusion_rl.rewards.ocr import INSTALL_COMMAND, REQUIRED_PACKAGES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("package", ["rapidocr", "onnxruntime"])
def test_a_missing_package_fails_when_the_reward_is_made(monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` now raises ImportError
    with pytest.raises(UserError) as info:
        make_reward("ocr")
    message = str(info.value)
    assert message.startswith(f"the 'ocr' reward needs the {package} package, which cannot be imported (")
    assert message.endswith("); install it with pip install 'diffusion-rl[ocr]'")
    assert f"import of {package} halted" in message  # the ImportError's own text


def test_the_install_command_names_the_extra_holding_the_packages():
    extra = re.search(r"^ocr = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), flags=re.M)  # no tomllib on 3.10
    assert extra is not None, "pyproject.toml has no `ocr` extra"
    packages = re.findall(r'"([A-Za-z0-9_.-]+)', extra.group(1))
    assert INSTALL_COMMAND == "pip install 'diffusion-rl[ocr]'"
    assert sorted(packages) == sorted(REQUIRED_PACKAGES) == ["onnxruntime", "rapidocr"]
