"""A tiny CLIP with random weights and a LAION-layout aesthetic head, built offline, for the curate scorers.

The folder is what ``openai/clip-vit-large-patch14`` is, shrunk: a ``CLIPModel`` (``config.json``,
``model.safetensors``) and a ``CLIPProcessor`` (PIL image processor, byte-level BPE tokenizer), loaded by
the curate stage through the same ``from_pretrained`` calls a hub id takes. The tokenizer is built in code
(characters only, no merges), so nothing is downloaded. The head is the LAION "improved aesthetic predictor"
v2 MLP (``layers.0`` ... ``layers.7``) with the tiny model's projection size as input, in a safetensors file
of its own (outside the model folder, so that it is not part of the model's fingerprint).

Same seed, same bytes::

    python -m latentmill.tiny_clip data/models/tiny-clip   # + data/models/tiny-clip-aesthetic.safetensors
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from latentmill.tinyio import is_complete, save_folder

_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,:;!?'-()"
_COMPLETE = ("config.json", "model.safetensors", "processor_config.json")
# The LAION v2 predictor's layers: Linear(d,1024)-Dropout-Linear(1024,128)-Dropout-Linear(128,64)-Dropout-
# Linear(64,16)-Linear(16,1); the Sequential indices of the Linear layers.
LAION_LAYERS = ((0, 1024), (2, 128), (4, 64), (6, 16), (7, 1))

TINY_CLIP: dict[str, Any] = {
    "projection_dim": 16,
    "text_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "max_position_embeddings": 32},
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
}


def build_clip_tokenizer(max_length: int) -> Any:
    """A lower-case CLIP BPE tokenizer over single characters (``</w>`` marks a word's last one)."""
    from transformers import CLIPTokenizer

    chars = list(_CHARS)
    vocab = ["<|startoftext|>", "<|endoftext|>"] + chars + [c + "</w>" for c in chars]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[], model_max_length=max_length)


def laion_head_state(input_dim: int, seed: int = 0) -> dict[str, Any]:
    """A state dict in the LAION v2 predictor's layout (``layers.{0,2,4,6,7}.{weight,bias}``), seeded."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    state, width = {}, input_dim
    for index, out in LAION_LAYERS:
        bound = width ** -0.5  # nn.Linear's default init range
        state[f"layers.{index}.weight"] = (torch.rand(out, width, generator=gen) * 2 - 1) * bound
        state[f"layers.{index}.bias"] = (torch.rand(out, generator=gen) * 2 - 1) * bound
        width = out
    return state


def save_head(path: str | os.PathLike[str], input_dim: int, seed: int = 0) -> Path:
    """Write a seeded LAION-layout head of ``input_dim`` inputs to ``path`` (safetensors)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in laion_head_state(input_dim, seed).items()}, str(path))
    return Path(path)


def build_tiny_clip(out_dir: str | os.PathLike[str], seed: int = 0, replace: bool = True,
                    sizes: dict[str, Any] | None = None) -> Path:
    """Build the tiny CLIP folder (model and processor) into ``out_dir``; return its absolute path.
    ``sizes``: another config of ``TINY_CLIP``'s shape (the benchmarks' larger CLIP)."""
    sizes = sizes or TINY_CLIP

    def save(tmp: Path) -> None:
        import torch
        from transformers import CLIPConfig, CLIPModel, CLIPProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        text = sizes["text_config"]
        tokenizer = build_clip_tokenizer(text["max_position_embeddings"])
        side = sizes["vision_config"]["image_size"]
        images = CLIPImageProcessorPil(size={"shortest_edge": side},
                                       crop_size={"height": side, "width": side})
        processor = CLIPProcessor(image_processor=images, tokenizer=tokenizer)
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id, "vocab_size": len(tokenizer)}
        config = CLIPConfig(text_config={**text, **ids}, vision_config=sizes["vision_config"],
                            projection_dim=sizes["projection_dim"])
        torch.manual_seed(seed)
        model = CLIPModel(config).eval()
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)

    out = Path(out_dir)
    if not replace and is_complete(out, _COMPLETE):
        return out.expanduser().absolute()
    return save_folder(out_dir, save, replace=replace, markers=_COMPLETE)


def build_tiny_siglip(out_dir: str | os.PathLike[str], seed: int = 0, replace: bool = True) -> Path:
    """A tiny ``SiglipModel`` folder (the SigLIP path: ``AutoModel``, pooled vision output as the embedding,
    text padded to the tokenizer's length) with the same sizes and character tokenizer as the tiny CLIP."""

    def save(tmp: Path) -> None:
        import torch
        from transformers import SiglipConfig, SiglipModel, SiglipProcessor
        from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

        text = TINY_CLIP["text_config"]
        tokenizer = build_clip_tokenizer(text["max_position_embeddings"])
        side = TINY_CLIP["vision_config"]["image_size"]
        processor = SiglipProcessor(image_processor=SiglipImageProcessorPil(size={"height": side, "width": side}),
                                    tokenizer=tokenizer)
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id, "vocab_size": len(tokenizer)}
        config = SiglipConfig(text_config={**text, **ids}, vision_config=TINY_CLIP["vision_config"])
        torch.manual_seed(seed)
        SiglipModel(config).eval().save_pretrained(tmp)
        processor.save_pretrained(tmp)

    return save_folder(out_dir, save, replace=replace, markers=_COMPLETE)


def head_path(out_dir: str | os.PathLike[str]) -> Path:
    """Where the command line writes the head for the model in ``out_dir``: beside it, with the suffix
    ``-aesthetic.safetensors``."""
    out = Path(out_dir).expanduser().absolute()
    return out.with_name(out.name + "-aesthetic.safetensors")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--if-missing", action="store_true", help="keep a complete folder that exists")
    args = parser.parse_args(argv)
    print(build_tiny_clip(args.out_dir, seed=args.seed, replace=not args.if_missing))
    head = head_path(args.out_dir)
    if not (args.if_missing and head.is_file()):
        print(save_head(head, TINY_CLIP["projection_dim"], args.seed))


if __name__ == "__main__":
    main()
