"""Sharded weights, as every real checkpoint has them (`diffusion_pytorch_model-0000i-of-0000n.safetensors` and
`model-…` with their `*.safetensors.index.json`) and no tiny model does (save_pretrained shards only past 10 GB):
the tiny SD3 saved in 100 KB shards loads to the same weights and embeddings, and a missing shard is named."""

from __future__ import annotations

import shutil

import pytest
import torch

from diffusion_rl.errors import UserError

INDEX = {  # component → its shards' index
    "transformer": "diffusion_pytorch_model.safetensors.index.json",
    "text_encoder_3": "model.safetensors.index.json",
}


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    from diffusion_rl.models.tiny import build_tiny

    directory = tmp_path_factory.mktemp("tiny_sharded")
    build_tiny("sd3", "small", seed=0).save_pretrained(directory, max_shard_size="100KB")
    for component, index in INDEX.items():
        assert (directory / component / index).is_file() and len(list((directory / component).glob("*-of-*"))) > 1
    return directory


def test_a_sharded_checkpoint_loads_the_same_weights_and_embeddings(sharded_dir, tiny_model_dir, load):
    sharded, whole = load(sharded_dir), load(tiny_model_dir)
    expected = whole.pipeline.transformer.state_dict()
    actual = sharded.pipeline.transformer.state_dict()
    assert actual.keys() == expected.keys() and all(torch.equal(actual[k], v) for k, v in expected.items())
    prompts = ["a red cube", "a lighthouse at dusk"]
    ours, theirs = sharded.encode_prompts(prompts), whole.encode_prompts(prompts)
    assert all(torch.equal(ours[key], theirs[key]) for key in sorted(theirs.keys()))  # a TensorDict iterates rows


@pytest.mark.parametrize("component", sorted(INDEX))
def test_a_missing_shard_is_named_with_its_index(sharded_dir, tmp_path, load, component):
    damaged = tmp_path / "damaged"
    shutil.copytree(sharded_dir, damaged)
    shard = sorted((damaged / component).glob("*-of-*"))[1]
    shard.unlink()
    with pytest.raises(UserError, match=rf"{shard.name}: missing \(listed in {INDEX[component]}\)"):
        load(damaged)
