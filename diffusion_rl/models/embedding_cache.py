"""The prompt-embedding cache: each distinct text of a finite prompt set through the text encoders once.

What is cached is the level below `encode_prompts`: a family's `_encode_texts(texts)`, the embeddings of each text
on its own (T5/CLIP/UMT5/Qwen2.5-VL outputs, batch [N], in the encoders' dtype). `encode_prompts` builds every
row's conditioning from them (FlowModel.text_conditioning), so SD3, FLUX.1, FLUX.1 Kontext (its text part),
Qwen-Image and Wan share this one mechanism. Qwen-Image-Edit's text embeddings depend on the condition images: it
has no per-text encoding and refuses a cache.

On disk: one safetensors file per key (`<family>-<digest>.safetensors`); tensor `<i>/<name>` is text i's `name`,
the texts, the key and, per text, its tensors' names, dtypes and shapes and a sha256 of the text with its tensors
are in the header's metadata. Each text is checked when first read (its tensors as the header lists them, finite,
and matching its digest: a swapped or altered entry is refused, one line naming the file and the text).

The key names everything the embeddings depend on: the family, the text encoders' and tokenizers' files (names,
sizes, contents; large weight files by their first and last MiB), max_sequence_length and the dtype; a file whose
key differs is refused, never used. Files are written to a temp name
and renamed, so a reader sees a whole file or none (Ray workers may share one).

Once the cache holds every text a run will encode (train and validation prompts, negatives), the text encoders are
released (`release_text_encoders`): they take no device memory for the rest of the run, and a text the cache lacks
is a UserError naming it and the file (policy: no silent re-load; `diffusion-rl prepare embeddings` fills it).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from diffusion_rl.errors import UserError
from diffusion_rl.models.loader import load_text_encoders, text_encoder_names
from diffusion_rl.utils.digest import weights_digest

logger = logging.getLogger(__name__)

FORMAT = 2  # bump when what is stored changes meaning (2: per-text layouts and digests)
SUFFIX = ".safetensors"
ENCODE_CHUNK = 16  # texts through the encoders at once when filling the cache
WHOLE_FILE_BYTES = 1 << 20  # files up to this size are hashed whole; larger ones by their first and last MiB
CONFIG_KEY = "model.embedding_cache"


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= WHOLE_FILE_BYTES:
            digest.update(f.read())
        else:
            digest.update(f.read(WHOLE_FILE_BYTES))
            f.seek(size - WHOLE_FILE_BYTES)
            digest.update(f.read())
    return digest.hexdigest()


def text_files_fingerprint(model_path: Path) -> str:
    """A digest of the model directory's text encoders and tokenizers (every file under text_encoder*/ and
    tokenizer*/): another checkpoint, another tokenizer or other weights give another fingerprint."""
    digest = hashlib.sha256()
    folders = sorted(p for p in model_path.iterdir() if p.is_dir() and p.name.startswith(("text_encoder", "tokenizer")))
    for folder in folders:
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(f"{file.relative_to(model_path)}:{_file_digest(file)};".encode())
    return digest.hexdigest()


def cache_key(model, model_path: str | Path) -> dict[str, str]:
    """What a model's text embeddings depend on (see the module's docstring), as strings."""
    path = Path(model_path).expanduser()
    return {
        "format": str(FORMAT),
        "family": model.family,
        "text_files": text_files_fingerprint(path),
        "max_sequence_length": str(model.max_sequence_length),
        "dtype": str(model.dtype).removeprefix("torch."),
    }


def key_file_name(key: dict[str, str]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return f"{key['family']}-{digest}{SUFFIX}"


class EmbeddingCache:
    """Each cached text's embeddings (name → tensor without the batch dimension, on the CPU) for one key.

    The file is memory-mapped (safe_open): a text's tensors are read when it is looked up, so a cache of many
    thousand prompts (SD3: ~2.7 MB a text in bf16 at 256 tokens) costs no host memory until used.
    """

    def __init__(self, path: Path, key: dict[str, str]):
        self.path, self.key = path, key
        self._reader = None  # the open file, once there is one
        self._stored: dict[str, dict[str, str]] = {}  # text → its names → tensor names in the file
        self._layouts: dict[str, dict[str, list]] = {}  # text → its names → [dtype, shape] as written
        self._digests: dict[str, str] = {}  # text → text_digest as written
        self._checked: set[str] = set()  # texts of the file read and found as written
        self._added: dict[str, dict[str, torch.Tensor]] = {}  # encoded here and not written yet

    @classmethod
    def read(cls, path: Path, key: dict[str, str]) -> EmbeddingCache:
        """The cache in `path`; a UserError naming the file when it is missing, unreadable or of another key."""
        if not path.is_file():
            raise UserError(
                f"{CONFIG_KEY}: the cache file {path} does not exist; make it with `diffusion-rl prepare embeddings "
                "CONFIG` (or point the key at a directory to have it filled on first use)"
            )
        cache = cls(path, key)
        try:
            stored_key = cache._open()
        except Exception as e:  # a truncated file, another format, a header without our metadata
            raise UserError(
                f"{CONFIG_KEY}: cannot read the prompt-embedding cache {path} ({type(e).__name__}: {e}); delete it "
                "and run `diffusion-rl prepare embeddings CONFIG` again"
            ) from None
        if stored_key != key:
            differ = sorted(k for k in {*key, *stored_key} if key.get(k) != stored_key.get(k))
            shown = ", ".join(f"{k}: cached {stored_key.get(k)!r:.40}, model {key.get(k)!r:.40}" for k in differ)
            raise UserError(
                f"{CONFIG_KEY}: {path} holds embeddings of another model or text setting ({shown}); it is not used. "
                "Delete it, point the key elsewhere, or run `diffusion-rl prepare embeddings CONFIG`"
            )
        return cache

    def _open(self) -> dict[str, str]:
        """Map the file and index its texts; returns the key it was written for."""
        from safetensors import safe_open

        reader = safe_open(str(self.path), framework="pt")
        meta = reader.metadata() or {}
        stored_key, texts = json.loads(meta["key"]), json.loads(meta["texts"])
        layouts, digests = json.loads(meta["layouts"]), json.loads(meta["digests"])
        if not len(texts) == len(layouts) == len(digests):
            raise ValueError(f"{len(texts)} texts, {len(layouts)} layouts and {len(digests)} digests")
        stored: dict[str, dict[str, str]] = {text: {} for text in texts}
        for tensor_name in reader.keys():  # noqa: SIM118 (safe_open is not iterable)
            index, name = tensor_name.split("/", 1)
            stored[texts[int(index)]][name] = tensor_name
        self._reader, self._stored = reader, stored
        self._layouts, self._digests = dict(zip(texts, layouts)), dict(zip(texts, digests))
        self._checked = set()
        return stored_key

    def __len__(self) -> int:
        return len(self._stored.keys() | self._added.keys())

    def __contains__(self, text: str) -> bool:
        return text in self._added or text in self._stored

    def get(self, text: str) -> dict[str, torch.Tensor]:
        """One text's tensors (it must be cached); a text of the file is checked when first read."""
        if text in self._added:
            return self._added[text]
        tensors = {name: self._reader.get_tensor(tensor_name) for name, tensor_name in self._stored[text].items()}
        if text not in self._checked:
            problem = _problem(text, tensors, self._layouts[text], self._digests[text])
            if problem:
                raise UserError(
                    f"{CONFIG_KEY}: the prompt-embedding cache {self.path} is damaged at the text {text!r:.80}: "
                    f"{problem}; delete it and run `diffusion-rl prepare embeddings CONFIG` again"
                )
            self._checked.add(text)
        return tensors

    def missing(self, texts: list[str]) -> list[str]:
        return [t for t in dict.fromkeys(texts) if t not in self]

    def fill(self, texts: list[str], encode) -> int:
        """Encode the texts not cached yet (`encode(texts) -> {name: [N, …]}`), a chunk at a time; how many."""
        todo = self.missing(texts)
        for start in range(0, len(todo), ENCODE_CHUNK):
            chunk = todo[start : start + ENCODE_CHUNK]
            with torch.no_grad():
                out = encode(chunk)
            for i, text in enumerate(chunk):
                self._added[text] = {name: t[i].detach().cpu().clone() for name, t in out.items()}
        return len(todo)

    def save(self) -> None:
        """Write the file atomically (a temp file in the same folder, then a rename) and map it again."""
        from safetensors.torch import save_file

        texts = [*self._stored, *(t for t in self._added if t not in self._stored)]
        rows = [self.get(text) for text in texts]
        tensors = {f"{i}/{name}": t.contiguous() for i, row in enumerate(rows) for name, t in row.items()}
        metadata = {
            "key": json.dumps(self.key, sort_keys=True),
            "texts": json.dumps(texts),
            "layouts": json.dumps([_layout(row) for row in rows]),
            "digests": json.dumps([text_digest(text, row) for text, row in zip(texts, rows)]),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, self.path)
        self._open()
        self._added = {}

    def lookup(self, texts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """The texts' embeddings stacked, batch [N], on `device`; a UserError naming a text the cache lacks."""
        absent = self.missing(texts)
        if absent:
            raise UserError(
                f"{CONFIG_KEY}: the text {absent[0]!r:.80} is not in the prompt-embedding cache {self.path} "
                f"({len(absent)} such), and the text encoders were released; the cache must hold every prompt and "
                "negative prompt the run uses: run `diffusion-rl prepare embeddings CONFIG` for this config"
            )
        rows = [self.get(t) for t in texts]
        return {name: torch.stack([row[name] for row in rows]).to(device) for name in rows[0]}


def text_digest(text: str, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of a text with its tensors (names, dtypes, shapes, bytes): binds each entry of the file to its text."""
    return hashlib.sha256(f"{text}\0{weights_digest(tensors)}".encode()).hexdigest()


def _layout(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    return {name: [str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in sorted(tensors.items())}


def _problem(text: str, tensors: dict[str, torch.Tensor], layout: dict[str, list], digest: str) -> str | None:
    """What is wrong with a text's tensors as read, against what the header says was written; None if nothing."""
    if layout.keys() - tensors.keys():
        return f"it lacks the tensor {min(layout.keys() - tensors.keys())!r}"
    if tensors.keys() - layout.keys():
        return f"it has a tensor {min(tensors.keys() - layout.keys())!r} the header does not list"
    found = _layout(tensors)
    for name, (dtype, shape) in layout.items():
        if found[name] != [dtype, shape]:
            return f"{name!r} is {found[name][0]} of shape {found[name][1]}, the header says {dtype} of shape {shape}"
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            return f"{name!r} holds NaN/inf"
    if text_digest(text, tensors) != digest:
        return "its tensors do not match their digest (an entry swapped with another text's, or altered)"
    return None


def cache_file(location: str | Path, key: dict[str, str]) -> tuple[Path, bool]:
    """(the cache file, whether it must exist already): a *.safetensors path is a given file, read only; any other
    path is a folder holding one file per key, filled on first use."""
    location = Path(location).expanduser()
    if location.suffix == SUFFIX:
        return location, True
    return location / key_file_name(key), False


def release_text_encoders(model) -> list[str]:
    """Drop the pipeline's text encoders (every frozen component named text_encoder*): they take no device memory
    from here on. Returns their names."""
    names = [n for n in model.frozen_components if n.startswith("text_encoder") and getattr(model.pipeline, n, None)]
    for name in names:
        setattr(model.pipeline, name, None)
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return names


def open_cache(model, model_path: str | Path, location: str | Path, *, writing: bool = False) -> EmbeddingCache:
    """The cache of `model` at `location` (see cache_file): read when its file exists, else empty. A given
    *.safetensors file must exist unless `writing` (`prepare embeddings --out`)."""
    if not model.caches_text:
        raise UserError(
            f"{CONFIG_KEY}: the {model.family} family's text embeddings depend on the condition images, so they "
            f"cannot be cached by text; set {CONFIG_KEY}=null"
        )
    key = cache_key(model, model_path)
    path, given = cache_file(location, key)
    if (given and not writing) or path.exists():
        return EmbeddingCache.read(path, key)
    return EmbeddingCache(path, key)


def use_embedding_cache(model, model_path: str | Path, location: str | Path, texts: list[str]) -> EmbeddingCache:
    """Attach a cache holding every one of `texts` to `model` and release its text encoders.

    A folder `location`: its file for this model's key is read when it exists, the texts it lacks are encoded and
    the file rewritten. A *.safetensors `location`: read only; it must exist and hold them all. A model loaded
    without its text encoders (`load_model(..., text_encoders=False)`) gets them only when some text must be
    encoded, so a run whose cache is complete never has them on its device.
    """
    cache = open_cache(model, model_path, location)
    texts = list(dict.fromkeys(texts))
    absent = cache.missing(texts)
    if absent and cache_file(location, cache.key)[1]:
        raise UserError(
            f"{CONFIG_KEY}: {cache.path} lacks {len(absent)} of the run's {len(texts)} texts (e.g. {absent[0]!r:.80}); "
            "run `diffusion-rl prepare embeddings CONFIG` for this config"
        )
    if absent and not any(getattr(model.pipeline, n, None) is not None for n in text_encoder_names(model_path)):
        load_text_encoders(model, model_path)  # loaded without them (the cache might have held every text)
    added = cache.fill(texts, model.encode_texts)
    if added:
        cache.save()
    logger.info("prompt-embedding cache %s: %d texts (%d encoded now)", cache.path, len(cache), added)
    model.embedding_cache = cache
    released = release_text_encoders(model)
    logger.info("released the text encoders (%s): every prompt of the run is cached", ", ".join(released) or "none")
    return cache
