"""The prompt-embedding cache (models/embedding_cache.py): cached embeddings are the encoders' own, bit for bit, in
every text-only family; once the cache holds the run's texts the encoders are gone; a stale, corrupt or missing file
is refused with its path, never used."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.errors import UserError
from diffusion_rl.models import embedding_cache
from diffusion_rl.models.embedding_cache import EmbeddingCache, cache_key, use_embedding_cache
from diffusion_rl.models.loader import load_model
from diffusion_rl.models.tiny import save_tiny

PROMPTS = ["a red cube", "a blue ball on a table", "a red cube", "a green hat"]
NEGATIVE = ["", "blurry", "", "blurry"]
TEXTS = list(dict.fromkeys(PROMPTS + NEGATIVE))  # the order encode_prompts encodes them in (distinct_texts)


def _load(path, length=16, text_encoders=True):
    return load_model(ModelConfig(path=str(path), device="cpu", max_sequence_length=length,
                                  lora=LoraConfig(enabled=False)), text_encoders=text_encoders)  # fmt: skip


@pytest.fixture
def sd3(tiny_model_dir):
    return _load(tiny_model_dir)


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image", "z_image", "wan"])
def test_cached_conditioning_equals_the_fresh_one_bit_for_bit(family, request, tmp_path):
    fixture = {"sd3": "tiny_model_dir", "flux": "flux_model_dir", "qwen_image": "qwen_image_model_dir",
               "z_image": "z_image_model_dir", "wan": "wan_model_dir"}[family]  # fmt: skip
    path = request.getfixturevalue(fixture)
    fresh, cached = _load(path), _load(path, text_encoders=False)
    assert cached.pipeline.text_encoder is None  # loaded when the empty cache needs them, released after
    use_embedding_cache(cached, path, tmp_path / "cache", TEXTS)
    assert cached.pipeline.text_encoder is None
    expected, got = fresh.encode_prompts(PROMPTS, NEGATIVE), cached.encode_prompts(PROMPTS, NEGATIVE)
    assert sorted(got.keys()) == sorted(expected.keys())
    for name in expected.keys():  # noqa: SIM118 (iterating a TensorDict walks its batch)
        assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name]), name
    # and read back from the file by another process's model: the same bits
    (file,) = (tmp_path / "cache").iterdir()
    again = EmbeddingCache.read(file, cache_key(fresh, path))
    direct = fresh._encode_texts(TEXTS)
    for i, text in enumerate(TEXTS):
        assert all(torch.equal(again.get(text)[name], direct[name][i]) for name in direct)


def test_a_complete_cache_releases_the_text_encoders_and_never_calls_them(sd3, tiny_model_dir, tmp_path):
    assert sd3.pipeline.text_encoder_3 is not None
    use_embedding_cache(sd3, tiny_model_dir, tmp_path / "cache", TEXTS)
    assert all(getattr(sd3.pipeline, n) is None for n in ("text_encoder", "text_encoder_2", "text_encoder_3"))
    assert sd3.pipeline.vae is not None

    def refuse(texts):
        raise AssertionError(f"the text encoders were called for {texts}")

    sd3._encode_texts = refuse
    cond = sd3.encode_prompts(PROMPTS, NEGATIVE)
    assert cond.batch_size == torch.Size([4])
    with pytest.raises(UserError, match=r"'a purple tree' is not in the prompt-embedding cache .*cache"):
        sd3.encode_prompts(["a purple tree"], [""])


def test_a_second_start_reads_the_cache_and_never_loads_the_encoders(tiny_model_dir, tmp_path, monkeypatch):
    use_embedding_cache(_load(tiny_model_dir), tiny_model_dir, tmp_path / "cache", TEXTS)
    model = _load(tiny_model_dir, text_encoders=False)
    assert all(getattr(model.pipeline, n) is None for n in ("text_encoder", "text_encoder_2", "text_encoder_3"))
    monkeypatch.setattr(embedding_cache, "load_text_encoders", lambda *a: pytest.fail("loaded the text encoders"))
    model._encode_texts = lambda texts: pytest.fail(f"encoded {texts} although they were cached")
    cache = use_embedding_cache(model, tiny_model_dir, tmp_path / "cache", TEXTS[:3])
    assert len(cache) == len(TEXTS)
    assert model.encode_prompts(PROMPTS, NEGATIVE).batch_size == torch.Size([4])


def test_a_stale_cache_is_never_used(tiny_model_dir, tmp_path):
    folder = tmp_path / "cache"
    first = use_embedding_cache(_load(tiny_model_dir), tiny_model_dir, folder, TEXTS)
    # another max_sequence_length, another model: another key, so another file, encoded afresh
    longer = use_embedding_cache(_load(tiny_model_dir, length=32), tiny_model_dir, folder, TEXTS)
    other_dir = save_tiny(tmp_path / "other", "sd3", "small", seed=1)
    other = use_embedding_cache(_load(other_dir), other_dir, folder, TEXTS)
    assert len({first.path, longer.path, other.path}) == 3
    assert longer.key["max_sequence_length"] == "32" and first.key["text_files"] != other.key["text_files"]
    # a file named as the cache of one setting but made for another is refused, naming what differs
    first.path.rename(longer.path)
    with pytest.raises(UserError, match=r"holds embeddings of another model .*max_sequence_length: cached '16'"):
        use_embedding_cache(_load(tiny_model_dir, length=32), tiny_model_dir, folder, TEXTS)
    with pytest.raises(UserError, match="holds embeddings of another model"):
        use_embedding_cache(_load(other_dir), other_dir, longer.path, TEXTS)  # a given file, read only


def test_a_corrupt_or_missing_cache_file_is_an_error_naming_its_path(tiny_model_dir, tmp_path):
    missing = tmp_path / "nowhere.safetensors"
    with pytest.raises(UserError, match=f"cache file {missing} does not exist.*prepare embeddings"):
        use_embedding_cache(_load(tiny_model_dir), tiny_model_dir, missing, TEXTS)
    cache = use_embedding_cache(_load(tiny_model_dir), tiny_model_dir, tmp_path / "cache", TEXTS)
    cache.path.write_bytes(cache.path.read_bytes()[:100])  # truncated
    with pytest.raises(UserError, match=f"cannot read the prompt-embedding cache {cache.path}"):
        use_embedding_cache(_load(tiny_model_dir), tiny_model_dir, tmp_path / "cache", TEXTS)
    with pytest.raises(UserError, match=f"cannot read the prompt-embedding cache {cache.path}"):
        use_embedding_cache(_load(tiny_model_dir), tiny_model_dir, cache.path, TEXTS)


def test_a_given_file_lacking_a_run_text_is_refused(tiny_model_dir, tmp_path):
    cache = use_embedding_cache(_load(tiny_model_dir), tiny_model_dir, tmp_path / "cache", TEXTS[:2])
    with pytest.raises(UserError, match=rf"{cache.path} lacks 3 of the run's 5 texts"):
        use_embedding_cache(_load(tiny_model_dir), tiny_model_dir, cache.path, TEXTS)


def test_an_edit_family_whose_text_reads_the_images_refuses_a_cache(tmp_path):
    model = SimpleNamespace(family="qwen_image_edit", caches_text=False)
    with pytest.raises(UserError, match=r"depend on the condition images.*model.embedding_cache=null"):
        use_embedding_cache(model, tmp_path, tmp_path / "cache", TEXTS)


def test_flux_kontext_caches_its_text_and_still_encodes_each_condition_image(flux_kontext_model_dir, tmp_path):
    fresh, cached = _load(flux_kontext_model_dir), _load(flux_kontext_model_dir, text_encoders=False)
    use_embedding_cache(cached, flux_kontext_model_dir, tmp_path / "cache", TEXTS)
    rng = np.random.default_rng(0)
    images = [[rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)] for _ in PROMPTS]
    expected = fresh.encode_prompts(PROMPTS, NEGATIVE, images)
    got = cached.encode_prompts(PROMPTS, NEGATIVE, images)
    assert "image_latents" in got.keys() and sorted(got.keys()) == sorted(expected.keys())  # noqa: SIM118
    assert all(torch.equal(got[name], expected[name]) for name in expected.keys())  # noqa: SIM118


def _tamper(path, change) -> None:
    """Rewrite the cache file at `path` after change(tensors, texts) edits its tensors and texts in place."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    texts = json.loads(meta["texts"])
    change(tensors, texts)
    save_file(tensors, str(path), metadata={**meta, "texts": json.dumps(texts)})


def _swap_texts(tensors, texts):
    texts[0], texts[1] = texts[1], texts[0]


def _nan(tensors, texts):
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))


def _drop(tensors, texts):
    del tensors[sorted(tensors)[0]]


def _reshape(tensors, texts):
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].flatten()[:-1].clone()


@pytest.mark.parametrize(
    "change, says",
    [(_swap_texts, "do not match their digest"), (_nan, "NaN/inf"), (_drop, "lacks the tensor"),
     (_reshape, "shape")],
)  # fmt: skip
def test_a_tampered_cache_is_refused_in_one_line_naming_the_file_and_the_text(change, says, tiny_model_dir, tmp_path):
    cache = use_embedding_cache(_load(tiny_model_dir), tiny_model_dir, tmp_path / "cache", TEXTS)
    healthy = cache.lookup(TEXTS, torch.device("cpu"))
    _tamper(cache.path, change)
    cache = use_embedding_cache(_load(tiny_model_dir), tiny_model_dir, cache.path, TEXTS)  # a given file: read only
    with pytest.raises(UserError) as error:
        cache.lookup(TEXTS, torch.device("cpu"))
    message = str(error.value)
    assert "\n" not in message and str(cache.path) in message and says in message, message
    assert repr(TEXTS[0])[:40] in message or repr(TEXTS[1])[:40] in message, message
    # an untouched text of the same file still reads as written
    assert torch.equal(cache.lookup(TEXTS[2:], torch.device("cpu"))["prompt_embeds"], healthy["prompt_embeds"][2:])


def test_a_text_encoder_file_over_a_mib_is_fingerprinted_by_its_size_head_and_tail(tmp_path):
    """Real text-encoder weights (GBs) are hashed by their size, first and last MiB; no tiny model's file is that large,
    so that branch is checked here on a 2.5 MiB file against the digest computed by hand."""
    import hashlib

    mib = embedding_cache.WHOLE_FILE_BYTES
    assert mib == 1 << 20
    data = bytearray(np.random.default_rng(0).integers(0, 256, 5 * mib // 2, dtype=np.uint8).tobytes())
    path = tmp_path / "model.safetensors"

    def digest(content: bytes) -> str:
        path.write_bytes(content)
        return embedding_cache._file_digest(path)

    by_hand = hashlib.sha256(str(len(data)).encode() + bytes(data[:mib]) + bytes(data[-mib:])).hexdigest()
    assert digest(bytes(data)) == by_hand
    for where, changes in ((10, True), (len(data) - 10, True), (len(data) // 2, False)):  # head, tail, middle
        edited = bytearray(data)
        edited[where] ^= 0xFF
        assert (digest(bytes(edited)) != by_hand) == changes
    assert digest(bytes(data[:mib])) == hashlib.sha256(str(mib).encode() + bytes(data[:mib])).hexdigest()  # whole
