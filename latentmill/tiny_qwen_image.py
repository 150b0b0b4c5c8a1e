"""The tiny Qwen-Image model set: a complete, random-weight ``QwenImagePipeline`` built offline.

The Qwen-Image tests and demo need the real structure (a Qwen2.5-VL text encoder read through the pipeline's
chat template, the Wan-style causal 3-D ``AutoencoderKLQwenImage`` with 16 latent channels and 8x spatial
compression, a ``QwenImageTransformer2DModel`` with 2x2 packing, the dynamic-shifting flow-match scheduler)
small enough to build and run in seconds on a CPU, without downloading anything. ``build_tiny_qwen_image``
builds one from ``data/tiny-qwen-image.yaml``, like ``latentmill.tiny.build_tiny_flux``:

* every component is constructed from the recipe after ``torch.manual_seed(seed)`` (byte-identical builds);
* the tokenizer is a byte-level BPE (``Qwen2Tokenizer``) learned from the fixed corpus of
  ``latentmill.tiny`` plus the words of the pipeline's prompt template, with the ChatML special tokens, so the
  template's fixed prefix is the 34 tokens the pipeline drops (``prompt_template_encode_start_idx``);
* the pipeline is written to a hidden folder next to ``out_dir`` and renamed into place at the end.

The result loads like the real thing::

    pipe = diffusers.DiffusionPipeline.from_pretrained(out_dir)      # -> QwenImagePipeline
    image = pipe("a red ball", height=32, width=32, num_inference_steps=2).images[0]

Command line: ``python -m latentmill.tiny_qwen_image OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from latentmill.core.config import ConfigError
from latentmill.tiny import CORPUS, bytes_to_unicode, learn_bpe, pretokenize, read_sections
from latentmill.tinyio import is_complete, pipeline_folder, save_folder, tiny_cli

DEFAULT_RECIPE_PATH: Path = Path(__file__).resolve().parents[1] / "data" / "tiny-qwen-image.yaml"
"""The recipe shipped with the repository (``data/tiny-qwen-image.yaml``)."""
EDIT_RECIPE_PATH: Path = DEFAULT_RECIPE_PATH.with_name("tiny-qwen-image-edit.yaml")
"""The tiny Qwen-Image-Edit recipe (``data/tiny-qwen-image-edit.yaml``): the same components, and a processor."""

_COMPONENTS = ("transformer", "vae", "text_encoder", "scheduler")
_TOKENIZERS = ("tokenizer",)
_EDIT_TOKENIZERS = ("tokenizer", "processor")  # processor: Qwen2VLImageProcessor arguments
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen2's pad, and the ChatML markers
# Qwen2.5-VL's vision markers (the Edit pipeline's template holds an image placeholder)
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def load_recipe(recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH, edit: bool = False) -> dict[str, Any]:
    """Read a tiny Qwen-Image recipe (``edit``: a Qwen-Image-Edit one, with ``tokenizers.processor``) and check
    that its parts fit together (ConfigError naming the keys)."""
    path = Path(recipe)
    data, comps, toks = read_sections(path, _COMPONENTS, _EDIT_TOKENIZERS if edit else _TOKENIZERS)
    tr, vae, te = comps["transformer"], comps["vae"], comps["text_encoder"]
    for key in ("text_config", "vision_config"):
        if not isinstance(te.get(key), dict):
            raise ConfigError(f"components.text_encoder.{key}: expected a mapping")
    text = te["text_config"]

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    z = vae["z_dim"]
    require(tr["in_channels"] == 4 * z and tr["out_channels"] == z,
            f"components.transformer.in_channels/out_channels: {tr['in_channels']}/{tr['out_channels']} != "
            f"4 * vae.z_dim / vae.z_dim ({4 * z}/{z})")
    require(tr["joint_attention_dim"] == text["hidden_size"],
            f"components.transformer.joint_attention_dim: {tr['joint_attention_dim']} != "
            f"components.text_encoder.text_config.hidden_size ({text['hidden_size']})")
    require(sum(tr["axes_dims_rope"]) == tr["attention_head_dim"],
            f"components.transformer.axes_dims_rope: sum {sum(tr['axes_dims_rope'])} != attention_head_dim "
            f"({tr['attention_head_dim']})")
    for key in ("latents_mean", "latents_std"):
        require(isinstance(vae[key], list) and len(vae[key]) == z,
                f"components.vae.{key}: expected a list of {z} numbers (vae.z_dim)")
    require(all(s > 0 for s in vae["latents_std"]), "components.vae.latents_std: every entry must be > 0")
    require(te["vision_config"].get("out_hidden_size") == text["hidden_size"],
            "components.text_encoder.vision_config.out_hidden_size: must equal text_config.hidden_size")
    if "model_max_length" not in toks["tokenizer"]:
        raise ConfigError("tokenizers.tokenizer.model_max_length: must be set")
    return data


def build_qwen_tokenizer(vocab_size: int, settings: dict[str, Any], corpus: Sequence[str] = CORPUS,
                         edit: bool = False, template: tuple[str, int] | None = None) -> Any:
    """A ``Qwen2Tokenizer`` of exactly ``vocab_size`` tokens: the 256 byte symbols, BPE merges learned from
    ``corpus`` and the prompt template's words (weighted so that each becomes one token, as in Qwen2.5-VL's
    vocabulary), then ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos); ``edit``: the Edit
    pipeline's template, and the vision markers after them; ``template``: another pipeline's (template, number of
    leading tokens it drops) instead of Qwen-Image's (HunyuanVideo 1.5's chat template)."""
    from transformers import Qwen2Tokenizer

    from latentmill.stages.family_qwen_image import QwenImageEncoders
    from latentmill.stages.family_qwen_image_edit import QwenImageEditEncoders

    # the templates and dropped prefixes the family modules cache with (the pipelines')
    family = QwenImageEditEncoders if edit else QwenImageEncoders
    template, start_idx = template or (family.PROMPT_TEMPLATE, family.TEMPLATE_START_IDX)
    specials = SPECIALS + (VISION_SPECIALS if edit else ())
    table = bytes_to_unicode()
    alphabet = [table[b] for b in range(256)]
    plain = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(alphabet)}, merges=[], unk_token=None)
    pieces = [p for p in re.split(r"<\|[a-z_]+\|>", template.format("")) if p]
    words = pretokenize(plain.backend_tokenizer, list(corpus))
    for word, count in pretokenize(plain.backend_tokenizer, pieces).items():
        words[word] += 1000 * count  # the template's words are merged first, into whole tokens
    n_new = vocab_size - len(alphabet) - len(specials)
    if n_new < 0:
        raise ConfigError(f"components.text_encoder.text_config.vocab_size: {vocab_size} < "
                          f"{len(alphabet) + len(SPECIALS)} (byte alphabet + special tokens)")
    merges, learned, _ = learn_bpe(Counter({tuple(w): c for w, c in words.items()}), set(alphabet), n_new,
                                    "components.text_encoder.text_config.vocab_size")
    vocab = {t: i for i, t in enumerate(alphabet + learned)}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               model_max_length=int(settings["model_max_length"]))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *specials[len(SPECIALS):]]})
    prefix = tokenizer(template.split("<|vision_start|>" if edit else "{}")[0]).input_ids
    if len(prefix) != start_idx:  # a bug here (or a too small vocab_size), not in the pipeline
        raise ConfigError(f"components.text_encoder.text_config.vocab_size: the prompt template's prefix is "
                          f"{len(prefix)} tokens, the pipeline drops {start_idx}")
    return tokenizer


def synthetic_images(generator: Any, n: int, size: int = 32) -> Any:
    """``n`` one-frame clips ``[n, 3, 1, size, size]`` in [-1, 1]: a solid shape on a solid background."""
    from latentmill.tiny_wan import synthetic_clips

    return synthetic_clips(generator, n, size=size, frames=1)


def measure_latent_stats(vae: Any, samples: int = 32, seed: int = 0) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of ``vae``'s latent means over ``synthetic_images``: how the recipe's
    ``vae.latents_mean`` / ``latents_std`` are set (rounded to 4 decimals, for the VAE of seed 0)."""
    import torch

    with torch.no_grad():
        z = vae.encode(synthetic_images(torch.Generator().manual_seed(seed), samples)).latent_dist.mean
    dims = (0, 2, 3, 4)
    return z.mean(dims).tolist(), z.std(dims).tolist()


def _build_pipeline(data: dict[str, Any], seed: int, edit: bool = False) -> Any:
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    comps, toks = data["components"], data["tokenizers"]
    te = comps["text_encoder"]
    vocab_size = te["text_config"]["vocab_size"]
    tokenizer = build_qwen_tokenizer(vocab_size, toks["tokenizer"], edit=edit)
    if len(tokenizer) != vocab_size:  # a bug here, not in the recipe
        raise AssertionError(f"tokenizer: {len(tokenizer)} tokens, text encoder expects {vocab_size}")
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIALS + (VISION_SPECIALS if edit else ())}
    vision_ids = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                  "vision_start_token_id": ids["<|vision_start|>"],
                  "vision_end_token_id": ids["<|vision_end|>"]} if edit else {}
    text_config = dict(te["text_config"], bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                       pad_token_id=ids["<|endoftext|>"])

    def seeded(make: Any) -> Any:
        torch.manual_seed(seed)
        with torch.no_grad():
            return make()

    tr_kwargs = dict(comps["transformer"], axes_dims_rope=tuple(comps["transformer"]["axes_dims_rope"]))
    transformer = seeded(lambda: QwenImageTransformer2DModel(**tr_kwargs))
    vae = seeded(lambda: AutoencoderKLQwenImage(**comps["vae"]))
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=te["vision_config"],
                              bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                              pad_token_id=ids["<|endoftext|>"], **vision_ids)
    text_encoder = seeded(lambda: Qwen2_5_VLForConditionalGeneration(config))
    scheduler = FlowMatchEulerDiscreteScheduler(**comps["scheduler"])
    parts = dict(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(), scheduler=scheduler,
                 transformer=transformer.eval())
    # processor=None: transformers 5 builds a Qwen2VLProcessor only beside torchvision (its video half), which
    # the CPU install lacks; its two halves are written by write_processor, the layout a real one saves
    return (QwenImageEditPipeline if edit else QwenImagePipeline)(**parts, **({"processor": None} if edit else {}))


def write_processor(folder: Path, tokenizer: Any, settings: dict[str, Any]) -> None:
    """Write a ``Qwen2VLProcessor`` folder (``processor/`` of a Qwen-Image-Edit pipeline): the tokenizer and a
    ``Qwen2VLImageProcessor`` of ``settings``, and name it in the pipeline's ``model_index.json``."""
    import json

    from transformers import Qwen2VLImageProcessor

    tokenizer.save_pretrained(folder / "processor")
    Qwen2VLImageProcessor(**settings).save_pretrained(folder / "processor")
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _edit_folder(out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str], seed: int, replace: bool) -> Path:
    path = Path(out_dir).expanduser().absolute()
    if not replace and is_complete(path):
        return path
    data = load_recipe(recipe, edit=True)

    def save(tmp: Path) -> None:
        pipe = _build_pipeline(data, seed, edit=True)
        pipe.save_pretrained(tmp, safe_serialization=True)
        write_processor(tmp, pipe.tokenizer, data["tokenizers"]["processor"])

    return save_folder(path, save, replace=replace)


def build_tiny_qwen_image(
    out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH, seed: int = 0
) -> Path:
    """Build the tiny Qwen-Image pipeline folder from ``recipe`` into ``out_dir`` (replacing a previous build);
    same contract as ``latentmill.tiny.build_tiny_flux``. Loads with ``QwenImagePipeline.from_pretrained``."""
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=True)


def ensure_tiny_qwen_image(
    out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH, seed: int = 0
) -> Path:
    """Return ``out_dir``, building the tiny Qwen-Image pipeline there first only if it is missing."""
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=False)


def build_tiny_qwen_image_edit(
    out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = EDIT_RECIPE_PATH, seed: int = 0
) -> Path:
    """Build the tiny Qwen-Image-Edit pipeline folder (``QwenImageEditPipeline``: the Qwen-Image components, the
    Edit template's tokenizer, a ``Qwen2VLProcessor``) from ``recipe`` into ``out_dir``, replacing a previous build."""
    return _edit_folder(out_dir, recipe, seed, replace=True)


def ensure_tiny_qwen_image_edit(
    out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = EDIT_RECIPE_PATH, seed: int = 0
) -> Path:
    """Return ``out_dir``, building the tiny Qwen-Image-Edit pipeline there first only if it is missing."""
    return _edit_folder(out_dir, recipe, seed, replace=False)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m latentmill.tiny_qwen_image OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``."""
    return tiny_cli(argv, "python -m latentmill.tiny_qwen_image", __doc__.splitlines()[0],
                    build_tiny_qwen_image, ensure_tiny_qwen_image, DEFAULT_RECIPE_PATH)


if __name__ == "__main__":
    raise SystemExit(main())
