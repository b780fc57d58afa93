"""A tiny Mistral-3 text encoder and its tokenizer, as FLUX.2-dev's `text_encoder/` and `tokenizer/` hold them.

FLUX.2-dev encodes prompts with Mistral-Small-3.x (`Mistral3ForConditionalGeneration`: a Mistral decoder and a
Pixtral vision tower; the pipeline reads the hidden states of layers 10, 20 and 30) through a `PixtralProcessor`'s
chat template. transformers builds that processor only with torchvision installed, and the pipeline uses only its
tokenizer's `apply_chat_template` (text, no images), so the `flux2` family loads the tokenizer of the `tokenizer/`
folder and writes the processor's own files back beside it (`processor_files`): the same path with and without
torchvision. The tokenizer here is a byte-level BPE learned offline from the
pipeline's system message, with Mistral's special tokens and a chat template that renders system and user turns
as Mistral-Small-3's does ([SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST]).
"""

from __future__ import annotations

import json

from diffusion_rl.models.tiny.parts import byte_level_alphabet

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                  "[IMG_BREAK]", "[IMG_END]")  # fmt: skip
# Mistral-Small-3's template, reduced to what the pipeline asks of it: a system turn and user turns of text parts
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]{% endif %}{% endfor %}"
)
TEXT_LAYERS = 30  # hidden_states[30] is the deepest layer Flux2Pipeline reads
PATCH_SIZE = 16  # the tiny vision tower's (Pixtral's: 14)


def build_tokenizer():
    """A fast tokenizer (byte-level BPE) from an in-memory vocabulary: no files, no download."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, min_frequency=1, initial_alphabet=byte_level_alphabet(),
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False)  # fmt: skip
    bpe.train_from_iterator([SYSTEM_MESSAGE], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", extra_special_tokens=list(SPECIAL_TOKENS[4:]),
                                        model_max_length=2048)  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.processor_files = processor_files()
    return tokenizer


def build_text_encoder(tokenizer, hidden: int):
    """A Mistral3ForConditionalGeneration of TEXT_LAYERS decoder layers of width `hidden` and a one-layer Pixtral."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    text = MistralConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=hidden // 2, max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    vision = PixtralVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                                 num_attention_heads=2, head_dim=hidden // 2, patch_size=PATCH_SIZE,
                                 image_size=64)  # fmt: skip
    config = Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), spatial_merge_size=2,
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
                            multimodal_projector_bias=False)  # fmt: skip
    return Mistral3ForConditionalGeneration(config)


def processor_files() -> dict[str, str]:
    """The files a PixtralProcessor's save_pretrained adds to the tokenizer's: its image processor's config and its
    own (the family writes them back beside the tokenizer: models/families/flux2.py)."""
    from transformers.models.pixtral import PixtralImageProcessorPil

    image = json.loads(PixtralImageProcessorPil(patch_size=PATCH_SIZE, size={"longest_edge": 64}).to_json_string())
    image.update(image_processor_type="PixtralImageProcessor", processor_class="PixtralProcessor")
    processor = dict(processor_class="PixtralProcessor", patch_size=PATCH_SIZE, spatial_merge_size=2,
                     image_token="[IMG]", image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]")  # fmt: skip
    files = {"preprocessor_config.json": image, "processor_config.json": processor}
    return {name: json.dumps(config, indent=2, sort_keys=True) + "\n" for name, config in files.items()}
