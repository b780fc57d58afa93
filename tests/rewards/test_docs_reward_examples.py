"""The `rewards:` examples in the docs are entries the config accepts, with every kwarg their reward requires."""

import inspect
import re
from pathlib import Path

import pytest
import yaml

from diffusion_rl.config.convert import from_dict
from diffusion_rl.config.data import RewardSpec
from diffusion_rl.rewards import REWARDS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _reward_entries(doc: str) -> list[tuple[int, dict]]:
    """(index of the yaml block, reward entry) for every entry of a `rewards:` list in the doc's yaml blocks."""
    blocks = re.findall(r"```yaml\n(.*?)```", (DOCS / doc).read_text(encoding="utf-8"), flags=re.S)
    return [(i, entry) for i, block in enumerate(blocks) for entry in (yaml.safe_load(block) or {}).get("rewards", [])]


@pytest.mark.parametrize("doc", ["distributed.md", "rewards.md"])
def test_reward_examples_have_their_required_kwargs(doc):
    entries = _reward_entries(doc)
    assert entries, f"docs/{doc} has no rewards example"
    for block, entry in entries:
        spec = from_dict(RewardSpec, entry, f"docs/{doc} yaml block {block}: rewards entry")
        if ":" in spec.name:  # a user function: nothing registered to check against
            continue
        signature = inspect.signature(REWARDS.get(spec.name))
        try:
            signature.bind(**spec.kwargs)
        except TypeError as e:
            pytest.fail(f"docs/{doc} yaml block {block}: reward '{spec.name}' with kwargs {spec.kwargs}: {e}")
