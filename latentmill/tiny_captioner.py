"""Tiny captioning models with random weights, built offline from a recipe, for the caption stage's tests.

Two families, one recipe each, both loaded through the same ``AutoProcessor.from_pretrained`` and
model-class ``from_pretrained`` calls a hub id takes:

* ``data/tiny-blip.yaml`` (``family: blip``): the ``Salesforce/blip-image-captioning-base`` structure (a
  ViT vision encoder, a BERT decoder with cross-attention, ``BlipProcessor`` with a WordPiece tokenizer
  whose bos is ``[DEC]``) — the captioning-model path (prompt as a caption prefix);
* ``data/tiny-llava.yaml`` (``family: llava``): a LLaVA-class chat VLM (CLIP vision tower, Qwen2 decoder,
  ChatML chat template, byte-level BPE tokenizer) — the chat path (prompt as a user turn, left padding).

For both:

* the model is constructed from the recipe after ``torch.manual_seed(seed)``: same recipe and seed give a
  byte-identical ``model.safetensors`` (and identical tokenizer and processor files);
* the tokenizer is built in code from fixed symbols (the tiny Flux corpus words, characters), so nothing
  is downloaded;
* the folder is written next to ``out_dir`` and renamed into place when complete.

Generation with random weights gives word salad, deterministically (greedy decoding)::

    processor = AutoProcessor.from_pretrained(out_dir)
    model = BlipForConditionalGeneration.from_pretrained(out_dir)
    ids = model.generate(**processor(images=image, return_tensors="pt"), max_new_tokens=8, min_new_tokens=4)

Command line: ``python -m latentmill.tiny_captioner OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from latentmill.core.config import ConfigError
from latentmill.tinyio import is_complete, save_folder, tiny_cli

DEFAULT_RECIPE_PATH: Path = Path(__file__).resolve().parents[1] / "data" / "tiny-blip.yaml"
"""The BLIP recipe shipped with the repository (``data/tiny-blip.yaml``)."""
LLAVA_RECIPE_PATH: Path = DEFAULT_RECIPE_PATH.with_name("tiny-llava.yaml")
"""A chat VLM (LLaVA class, ChatML template) for the chat path of the captioner (``data/tiny-llava.yaml``)."""

# Files whose presence means a build finished (written last by save_pretrained, renamed as a whole).
_COMPLETE = ("config.json", "model.safetensors", "processor_config.json")
_SECTIONS = {"blip": ("model", "image_processor", "tokenizer"),
             "llava": ("model", "image_processor", "processor", "tokenizer")}
_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,:;!?'-()"
# Words captions use that the Flux corpus lacks; changing this list changes the tokenizer (not the weights).
CAPTION_WORDS = ("image", "picture", "photo", "photograph", "video", "shows", "showing", "depicts", "frame",
                 "scene", "person", "people", "dark", "light", "bright", "colorful", "striped", "stripes",
                 "triangle", "square", "circle", "background", "portrait", "landscape", "gradient")


def load_recipe(recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH) -> dict[str, Any]:
    """Read a tiny-captioner recipe (``family: blip`` or ``family: llava``) and check that its parts fit."""
    path = Path(recipe)
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("family") not in _SECTIONS:
        raise ConfigError(f"{path}: family: must be one of {', '.join(map(repr, _SECTIONS))}")
    expected = ("family", *_SECTIONS[data["family"]])
    if sorted(data) != sorted(expected):
        raise ConfigError(f"{path}: expected exactly the sections {list(expected)}, got {sorted(data)}")
    model = data["model"]
    vision, text = model.get("vision_config") or {}, model.get("text_config") or {}
    blip = data["family"] == "blip"
    required = [("model.vision_config", vision, k) for k in ("hidden_size", "image_size", "patch_size")]
    required += [("model.text_config", text, "max_position_embeddings"),
                 ("tokenizer", data["tokenizer"], "model_max_length")]
    if blip:
        size = data["image_processor"].get("size") or {}
        required += [("model.text_config", text, "encoder_hidden_size"),
                     ("image_processor.size", size, "height"), ("image_processor.size", size, "width")]
    else:
        size = data["image_processor"].get("crop_size") or {}
        required += [("image_processor.crop_size", size, "height"), ("image_processor.crop_size", size, "width")]
    for where, section, key in required:
        if key not in section:
            raise ConfigError(f"{where}.{key}: must be set")
    for key in ("vocab_size", "bos_token_id", "pad_token_id", "sep_token_id", "eos_token_id"):
        if key in text:
            raise ConfigError(f"model.text_config.{key}: set from the tokenizer, leave it out of the recipe")
    where = "image_processor.size" if blip else "image_processor.crop_size"
    checks = [
        (size["height"] == size["width"] == vision["image_size"],
         f"{where}: {size['height']}x{size['width']} != model.vision_config.image_size "
         f"({vision['image_size']}) on both sides"),
        (vision["image_size"] % vision["patch_size"] == 0,
         f"model.vision_config.image_size: {vision['image_size']} is not a multiple of patch_size "
         f"({vision['patch_size']})"),
        (text["max_position_embeddings"] >= data["tokenizer"]["model_max_length"],
         f"model.text_config.max_position_embeddings: {text['max_position_embeddings']} < "
         f"tokenizer.model_max_length ({data['tokenizer']['model_max_length']})"),
    ]
    if blip:
        checks.append((text["encoder_hidden_size"] == vision["hidden_size"],
                       f"model.text_config.encoder_hidden_size: {text['encoder_hidden_size']} != "
                       f"model.vision_config.hidden_size ({vision['hidden_size']})"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    return data


def build_tokenizer(settings: dict[str, Any]) -> Any:
    """A lower-case WordPiece ``BertTokenizer`` over a fixed vocabulary, with ``[DEC]`` as bos like BLIP's."""
    from transformers import BertTokenizer

    from latentmill.tiny import CORPUS

    words = sorted({w for line in CORPUS for w in re.findall(r"[a-z]+", line.lower())} | set(CAPTION_WORDS))
    chars = list(_CHARS)
    vocab = list(_SPECIALS) + chars + [f"##{c}" for c in chars if c.isalnum()]
    vocab += [w for w in words if w not in set(chars)]
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(vocab)},
                              model_max_length=int(settings["model_max_length"]))
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    return tokenizer


def build_chat_tokenizer(settings: dict[str, Any]) -> Any:
    """A byte-level BPE tokenizer (the Qwen2 class) over printable ASCII, with ChatML special tokens.

    No merges: every character is a token. Generated text is then always printable, whatever random
    weights pick; prompts must be ASCII.
    """
    from transformers import Qwen2Tokenizer

    from latentmill.tiny import bytes_to_unicode

    table = bytes_to_unicode()
    symbols = [table[b] for b in range(32, 127)] + [table[ord("\n")]]
    tokenizer = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(symbols)}, merges=[], unk_token=None,
                               bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               model_max_length=int(settings["model_max_length"]))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<image>"]})
    return tokenizer


# ChatML, as Qwen models write it; images become one <image> placeholder the processor expands.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _build_blip(data: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import BlipConfig, BlipForConditionalGeneration, BlipProcessor
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    tokenizer = build_tokenizer(data["tokenizer"])
    # The PIL backend: same pixels on machines with and without torchvision.
    processor = BlipProcessor(image_processor=BlipImageProcessorPil(**data["image_processor"]), tokenizer=tokenizer)
    text = {**data["model"]["text_config"], "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "sep_token_id": tokenizer.sep_token_id,
            "eos_token_id": tokenizer.sep_token_id}
    config = BlipConfig(**{**data["model"], "text_config": text})
    return (lambda: BlipForConditionalGeneration(config)), processor


def _build_llava(data: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = build_chat_tokenizer(data["tokenizer"])
    vision = data["model"]["vision_config"]
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(**data["image_processor"]),
                               tokenizer=tokenizer, patch_size=vision["patch_size"], chat_template=CHAT_TEMPLATE,
                               **data["processor"])
    ids = dict(zip(("pad", "eos", "image"), tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>",
                                                                             "<image>"])))
    text = {**data["model"]["text_config"], "vocab_size": len(tokenizer), "bos_token_id": ids["pad"],
            "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}
    config = LlavaConfig(**{**data["model"], "text_config": text, "image_token_index": ids["image"],
                            "vision_feature_select_strategy": data["processor"]["vision_feature_select_strategy"]})
    return (lambda: LlavaForConditionalGeneration(config)), processor


def _build(data: dict[str, Any], seed: int) -> tuple[Any, Any]:
    import torch

    make_model, processor = (_build_blip if data["family"] == "blip" else _build_llava)(data)
    torch.manual_seed(seed)
    with torch.no_grad():
        model = make_model().eval()
    return model, processor


def build_tiny_captioner(out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH,
                    seed: int = 0, replace: bool = True) -> Path:
    """Build the tiny BLIP captioner folder from ``recipe`` into ``out_dir``; return its absolute path.

    Raises:
        ConfigError: the recipe is inconsistent (see ``load_recipe``).
        FileExistsError: ``out_dir`` holds something that is not a tiny captioner folder.
    """
    model, processor = _build(load_recipe(recipe), seed)

    def save(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)

    return save_folder(out_dir, save, replace=replace, markers=_COMPLETE)


def ensure_tiny_captioner(out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH,
                     seed: int = 0) -> Path:
    """Return ``out_dir``, building the tiny captioner there first only if it is not complete."""
    path = Path(out_dir).expanduser().absolute()
    if is_complete(path, _COMPLETE):
        return path
    return build_tiny_captioner(path, recipe, seed, replace=False)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m latentmill.tiny_captioner OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``."""
    return tiny_cli(argv, "python -m latentmill.tiny_captioner", __doc__.splitlines()[0],
                    build_tiny_captioner, ensure_tiny_captioner, DEFAULT_RECIPE_PATH)


if __name__ == "__main__":
    raise SystemExit(main())
