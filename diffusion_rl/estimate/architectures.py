"""A model's architecture as `estimate` needs it, without its weights: each component's class and config.

Read from a model directory (transformer/, vae/, text_encoder*/ config.json), from a tiny preset (built in memory:
a few MB), or from the architectures shipped in diffusion_rl/assets/architectures/ (the public config values of
the models the ready configs train), so a config estimates before its weights are downloaded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from diffusion_rl.errors import UserError
from diffusion_rl.models.hub import model_dir
from diffusion_rl.utils.hub_ids import names_hub_repo

QWEN_TEMPLATE_TOKENS = 34  # Qwen-Image's prompt template, dropped from the embeddings the transformer reads
CLIP_TOKENS = 77


@dataclass(frozen=True)
class Encoder:
    """A frozen encoder's shape — a text encoder, or Wan 2.1 I2V's CLIP image encoder: enough for its parameter count
    and its FLOPs per token (matmuls + attention)."""

    name: str
    kind: str  # clip, t5, qwen2_5_vl, qwen3, mistral3 (decoders alike: Qwen2 / 2.5-VL / 3, Mistral), clip_vision
    layers: int
    hidden: int
    ffn: int
    q_dim: int  # heads × head dim
    kv_dim: int
    gated: bool  # gated MLP: three ffn matrices instead of two
    vocab: int
    vision: dict | None = None  # Qwen2.5-VL's vision tower (edits read condition images through it)
    positions: int | None = None  # CLIP: the fixed length it encodes (77 in the real text ones; 257 patches of 224²)
    head: bool = False  # a language-model head of its own (a decoder whose config unties it from the embeddings)

    @property
    def params(self) -> int:
        """Parameters of the layers (not the embedding table: a lookup, no FLOPs)."""
        attention = 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim
        return self.layers * (attention + (3 if self.gated else 2) * self.hidden * self.ffn)

    @property
    def weight_params(self) -> int:
        """What the pipeline loads: the layers, the embedding table, an untied head, the vision tower's layers."""
        return self.params + (2 if self.head else 1) * self.vocab * self.hidden + self.vision_params

    @property
    def vision_params(self) -> int:
        if not self.vision:
            return 0
        v = self.vision
        return v["depth"] * (4 * v["hidden_size"] ** 2 + 3 * v["hidden_size"] * v["intermediate_size"])

    def forward_flops(self, tokens: int) -> float:
        """One sequence of `tokens`: 2·params·tokens for the matmuls, 2·2·tokens²·q_dim per layer for attention."""
        return 2.0 * self.params * tokens + self.layers * 4.0 * tokens * tokens * self.q_dim

    def vision_flops(self, height: int, width: int) -> tuple[float, int]:
        """(FLOPs, tokens handed to the language model) of one condition image through the vision tower."""
        v = self.vision
        patches = math.ceil(height / v["patch_size"]) * math.ceil(width / v["patch_size"])
        per_layer = 4 * v["hidden_size"] ** 2 + 3 * v["hidden_size"] * v["intermediate_size"]
        flops = 2.0 * v["depth"] * per_layer * patches + v["depth"] * 4.0 * patches * patches * v["hidden_size"]
        return flops, patches // v["spatial_merge_size"] ** 2


def text_encoder_of(name: str, config: dict) -> Encoder:
    """A text encoder's Encoder from its transformers config (CLIP text, T5 / UMT5, Qwen2.5-VL, Qwen3, Mistral-3)."""
    kind = config.get("model_type", "")
    if kind.startswith("clip"):
        h, positions = config["hidden_size"], config.get("max_position_embeddings", CLIP_TOKENS)
        return Encoder(name, "clip", config["num_hidden_layers"], h, config["intermediate_size"], h, h, False,
                       config["vocab_size"], positions=positions)  # fmt: skip
    if kind in ("t5", "umt5", "t5encoder"):
        q = config["num_heads"] * config["d_kv"]
        gated = str(config.get("feed_forward_proj", "")).startswith("gated")
        return Encoder(name, "t5", config["num_layers"], config["d_model"], config["d_ff"], q, q, gated,
                       config["vocab_size"])  # fmt: skip
    # Qwen3 (FLUX.2-klein, Z-Image) and Mistral-3 (FLUX.2-dev): the same gated decoder
    if kind.startswith("qwen2") or kind in ("qwen3", "mistral3"):
        text = config.get("text_config") or config
        h, heads = text["hidden_size"], text["num_attention_heads"]
        head_dim = text.get("head_dim") or h // heads
        kv = text.get("num_key_value_heads", heads) * head_dim
        vision = config.get("vision_config")
        if kind == "mistral3":  # its Pixtral tower's keys as the Qwen2.5-VL tower's
            vision = dict(depth=vision["num_hidden_layers"], hidden_size=vision["hidden_size"],
                          intermediate_size=vision["intermediate_size"], patch_size=vision["patch_size"],
                          spatial_merge_size=config.get("spatial_merge_size", 2))  # fmt: skip
        label = kind if kind in ("qwen3", "mistral3") else "qwen2_5_vl"
        # Qwen2.5-VL-7B and Mistral-Small keep a head of their own (8.29 B and 24.0 B in all), Qwen3-4B ties it;
        # where a config does not say, counted untied (the larger)
        tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return Encoder(name, label, text["num_hidden_layers"], h, text["intermediate_size"], heads * head_dim, kv,
                       True, text["vocab_size"], vision, head=not tied)  # fmt: skip
    raise UserError(f"estimate: text encoder '{name}' has model_type '{kind}', which the estimate does not know")


def image_encoder_of(config: dict) -> Encoder:
    """Wan 2.1 I2V / FLF2V's CLIPVisionModel (ViT-H/14: 632 M parameters; its patch and position embeddings, 0.2 %,
    left out): one 224² image, 257 tokens, per sample."""
    if config.get("model_type") != "clip_vision_model":
        raise UserError(f"estimate: image_encoder has model_type '{config.get('model_type')}', which it does not know")
    h, patches = config["hidden_size"], (config["image_size"] // config["patch_size"]) ** 2
    return Encoder("image_encoder", "clip_vision", config["num_hidden_layers"], h, config["intermediate_size"], h, h,
                   False, vocab=0, positions=patches + 1)  # fmt: skip


@dataclass
class Architecture:
    name: str
    family: str
    transformer_class: str
    transformer_config: dict
    vae_class: str
    vae_config: dict
    text_encoders: list[Encoder] = field(default_factory=list)
    source: str = ""
    experts: int = 1  # transformers of this architecture the model holds (Wan 2.2 A14B: 2, one per call)
    image_encoder: Encoder | None = None  # Wan 2.1 I2V / FLF2V: CLIP reads each sample's frame
    pipeline_config: dict = field(default_factory=dict)  # model_index.json's settings (FLUX.2-klein: is_distilled)

    @property
    def vae_scale(self) -> int:
        """Pixels per latent cell along height and width."""
        c = self.vae_config
        if "temperal_downsample" in c:  # the Wan / Qwen-Image video VAE; Wan 2.2's patchifies 2×2 more
            return 2 ** len(c["temperal_downsample"]) * (c.get("patch_size") or 1)
        return 2 ** (len(c.get("block_out_channels", [1])) - 1)

    @property
    def temporal_scale(self) -> int:
        c = self.vae_config
        return 2 ** sum(bool(d) for d in c["temperal_downsample"]) if "temperal_downsample" in c else 1


def image_sizes_of(arch: Architecture):
    """The sizes the architecture's model makes (models/image_size.py's ImageSizes), from its configs alone: what
    `size_problem` checks a config's size against before anything is loaded."""
    from diffusion_rl.models.image_size import sizes_from_configs
    from diffusion_rl.models.registry import family_named

    adapter, config = family_named(arch.family).adapter, arch.transformer_config
    step = adapter.size_step(arch.vae_scale, config)
    return sizes_from_configs(config, arch.vae_config, arch.vae_scale, step, None, adapter.native_size)


def guidance_cost_of(arch: Architecture):
    """What the architecture's model does with a guidance scale (models/guidance.py's GuidanceCost)."""
    from diffusion_rl.models.guidance import GuidanceCost
    from diffusion_rl.models.registry import family_named

    ignored = family_named(arch.family).adapter.ignores_guidance_of(arch.pipeline_config)
    return GuidanceCost(embedded=bool(arch.transformer_config.get("guidance_embeds")), ignored=ignored)


def _class_name(config: dict, fallback: str) -> str:
    return config.get("_class_name") or fallback


def from_components(name: str, family: str, components: dict[str, dict], source: str,
                    pipeline: dict | None = None) -> Architecture:  # fmt: skip
    """An Architecture from {component: config dict} (diffusers configs carry `_class_name`) and the pipeline's own
    settings (`pipeline`: model_index.json without its components)."""
    missing = [c for c in ("transformer", "vae") if c not in components]
    if missing:
        raise UserError(f"estimate: {source} has no {' or '.join(missing)} config")
    texts = [text_encoder_of(k, v) for k, v in sorted(components.items()) if k.startswith("text_encoder")]
    strip = lambda c: {k: v for k, v in c.items() if not k.startswith("_")}  # noqa: E731
    tr, vae = components["transformer"], components["vae"]
    experts = 2 if "transformer_2" in components else 1
    image = image_encoder_of(components["image_encoder"]) if "image_encoder" in components else None
    return Architecture(name, family, _class_name(tr, ""), strip(tr), _class_name(vae, ""), strip(vae), texts, source,
                        experts, image, strip(pipeline or {}))  # fmt: skip


def from_model_dir(path: Path, name: str | None = None, family: str = "auto") -> Architecture:
    """The architecture in a diffusers model directory (its model_index.json and components' config.json), named
    `name` (default: the directory's), as model.family `family` loads it (Wan 2.2 TI2V: wan_i2v reads it too)."""
    from diffusion_rl.models.loader import resolve_pipeline

    family = resolve_pipeline(path, family)[0]
    components = {}
    for sub in sorted(p for p in path.iterdir() if (p / "config.json").is_file()):
        components[sub.name] = json.loads((sub / "config.json").read_text())
    index = json.loads((path / "model_index.json").read_text())  # resolve_pipeline read it
    settings = {k: v for k, v in index.items() if not isinstance(v, list)}  # a component is [library, class]
    return from_components(name or path.name, family, components, str(path), settings)


def from_tiny(family: str, preset: str) -> Architecture:
    """The architecture of a tiny preset (what `create_tiny_if_missing` would write): a shipped one's configs as the
    package holds them (nothing built), another's built in memory."""
    from diffusion_rl.models.tiny import build_tiny
    from diffusion_rl.models.tiny.shipped import shipped_dir

    shipped = shipped_dir(family, preset)
    if shipped is not None:
        return from_model_dir(shipped, f"tiny {family} ({preset})", family)
    pipeline = build_tiny(family, preset)
    components = {}
    for name, module in pipeline.components.items():
        config = getattr(module, "config", None)
        if config is None or not hasattr(module, "parameters"):
            continue
        as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        components[name] = {"_class_name": type(module).__name__, **as_dict}
    settings = {k: v for k, v in pipeline.config.items() if not isinstance(v, (list, tuple))}
    return from_components(f"tiny {family} ({preset})", family, components, f"the tiny {family} preset '{preset}'",
                           settings)  # fmt: skip


def shipped() -> dict[str, Path]:
    """The architectures shipped with the package, by model name (the directory name of its checkpoint)."""
    folder = resources.files("diffusion_rl") / "assets" / "architectures"
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith(".json")}


def shipped_doc(name: str) -> dict:
    """Shipped architecture `name`'s file: name, family, source and each component's config."""
    doc = json.loads(shipped()[name].read_text())
    # another checkpoint of a shipped architecture (Qwen-Image-2512: Qwen-Image's), with the config keys it `changes`
    # (FLUX.1-schnell: FLUX.1-dev's without the guidance embedding)
    if "same_as" in doc:
        base = json.loads(shipped()[doc["same_as"]].read_text())
        changes = doc.get("changes", {})
        components = {part: {**config, **changes.get(part, {})} for part, config in base["components"].items()}
        doc = {**base, "name": doc["name"], "source": doc["source"], "components": components}
    return doc


def from_shipped(name: str, family: str = "auto") -> Architecture:
    """Shipped architecture `name` as model.family `family` loads it (the rule a model directory follows)."""
    from diffusion_rl.models.loader import family_for
    from diffusion_rl.models.registry import family_named

    doc = shipped_doc(name)
    pipeline = family_named(doc["family"]).pipeline
    family = family_for(doc["family"], pipeline, family, f"the shipped architecture {name}")[0]
    return from_components(doc["name"], family, doc["components"], doc["source"], doc.get("pipeline"))


def architecture_for(model_cfg, arch: str | None = None) -> Architecture:
    """The architecture a config trains: `arch` (a shipped name) when given; else the model directory when it exists
    (a Hub id's snapshot when huggingface_hub's cache holds it: estimate downloads nothing); else the tiny preset it
    would create; else the shipped architecture named like the directory."""
    known = shipped()
    if arch is not None:
        if arch not in known:
            raise UserError(f"--arch: no shipped architecture '{arch}'; shipped: {', '.join(sorted(known))}")
        return from_shipped(arch, model_cfg.family)
    path, uncached = Path(model_cfg.path).expanduser(), None
    if names_hub_repo(model_cfg.path) and not path.exists():  # a Hub id: its snapshot when cached (no download)
        try:
            snapshot = model_dir(model_cfg.path, model_cfg.revision, download=False)
        except UserError as e:
            uncached = e
        else:
            return from_model_dir(snapshot, model_cfg.path, model_cfg.family)
    if (path / "model_index.json").is_file():
        return from_model_dir(path, family=model_cfg.family)
    if model_cfg.tiny_to_create:
        return from_tiny(model_cfg.tiny_family, model_cfg.tiny_to_create)
    by_lower = {k.lower(): k for k in known}
    if path.name.lower() in by_lower:
        return from_shipped(by_lower[path.name.lower()], model_cfg.family)
    why = uncached or f"model.path '{path}' is not a model directory here"
    raise UserError(f"estimate: {why}; and it names no shipped architecture: pass --arch NAME (shipped: "
                    f"{', '.join(sorted(known))})")  # fmt: skip
