"""The tiny Z-Image model set: a complete, random-weight ``ZImagePipeline`` built offline from a recipe.

The z-image tests and demo need a model with the real Z-Image structure (a Qwen3 text encoder read at its
second-to-last hidden state through a ChatML prompt template, the 16-channel FLUX.1-style ``AutoencoderKL``, a
single-stream ``ZImageTransformer2DModel`` with noise / context refiners, a flow-matching scheduler with a static
shift) but small enough to build, load and run in seconds on a CPU, without downloading anything.
``build_tiny_zimage`` builds one from ``data/tiny-z-image.yaml``, as ``latentmill.tiny.build_tiny_flux`` does:

* every component is constructed from the recipe after ``torch.manual_seed(seed)``: byte-reproducible builds;
* the tokenizer is a ``Qwen2Tokenizer`` (the class Qwen3 uses): byte-level BPE learned by the deterministic
  learner of ``latentmill.tiny`` on its fixed corpus, the 256 byte symbols first (any text encodes), then the
  learned merges, then ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos), and a Qwen3-style chat
  template (``enable_thinking`` as Qwen3's: an empty think block only when it is false);
* the pipeline is written to a hidden folder next to ``out_dir`` and renamed into place at the end.

The result loads like the real thing::

    pipe = diffusers.DiffusionPipeline.from_pretrained(out_dir)      # -> ZImagePipeline
    image = pipe("a red square", height=64, width=48, num_inference_steps=2, guidance_scale=0.0).images[0]

Command line: ``python -m latentmill.tiny_zimage OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from latentmill.core.config import ConfigError
from latentmill.resources import resource_root
from latentmill.tiny import CORPUS, bytes_to_unicode, learn_bpe, pretokenize, read_sections
from latentmill.tinyio import pipeline_folder, tiny_cli

DEFAULT_RECIPE_PATH: Path = resource_root() / "data" / "tiny-z-image.yaml"
"""The recipe shipped with the package (``data/tiny-z-image.yaml``)."""

_COMPONENTS = ("transformer", "vae", "text_encoder", "scheduler")
_TOKENIZERS = ("tokenizer",)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen3's chat template, reduced to what a text-only prompt uses: ChatML turns, the assistant prefix, and the
# empty think block Qwen3 writes when ``enable_thinking`` is false (ZImagePipeline passes it true: none).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def load_recipe(recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH) -> dict[str, Any]:
    """Read a tiny Z-Image recipe and check that its parts fit together (``ConfigError`` naming the keys)."""
    path = Path(recipe)
    data, comps, toks = read_sections(path, _COMPONENTS, _TOKENIZERS)
    tr, vae, te = comps["transformer"], comps["vae"], comps["text_encoder"]
    for section, name, keys in (
        (tr, "transformer", ("in_channels", "dim", "n_heads", "cap_feat_dim", "axes_dims")),
        (vae, "vae", ("latent_channels", "block_out_channels", "scaling_factor", "shift_factor")),
        (te, "text_encoder", ("vocab_size", "hidden_size", "num_hidden_layers")),
        (toks["tokenizer"], "tokenizer", ("model_max_length",)),
    ):
        for key in keys:
            if key not in section:
                raise ConfigError(f"{'tokenizers' if name == 'tokenizer' else 'components'}.{name}.{key}: must be set")
    checks = (
        (tr["in_channels"] == vae["latent_channels"],
         f"components.transformer.in_channels: {tr['in_channels']} != components.vae.latent_channels "
         f"({vae['latent_channels']})"),
        (tr["cap_feat_dim"] == te["hidden_size"],
         f"components.transformer.cap_feat_dim: {tr['cap_feat_dim']} != components.text_encoder.hidden_size "
         f"({te['hidden_size']})"),
        (tr["dim"] % tr["n_heads"] == 0 and sum(tr["axes_dims"]) == tr["dim"] // tr["n_heads"],
         f"components.transformer.axes_dims: sum {sum(tr['axes_dims'])} != dim / n_heads "
         f"({tr['dim']} / {tr['n_heads']})"),
        (all(d % 2 == 0 for d in tr["axes_dims"]), "components.transformer.axes_dims: every entry must be even"),
        (te["num_hidden_layers"] >= 2,
         "components.text_encoder.num_hidden_layers: must be >= 2 (the pipeline reads hidden_states[-2])"),
    )
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    return data


def build_qwen_tokenizer(vocab_size: int, settings: dict[str, Any], corpus: Sequence[str] = CORPUS) -> Any:
    """Learn a byte-level BPE ``Qwen2Tokenizer`` of exactly ``vocab_size`` tokens from ``corpus``, with Qwen's
    special tokens (pad ``<|endoftext|>``, eos ``<|im_end|>``, ``<|im_start|>``) as the last three ids and a
    Qwen3-style chat template."""
    from transformers import Qwen2Tokenizer

    words = pretokenize(Qwen2Tokenizer().backend_tokenizer, corpus)
    base = list(bytes_to_unicode().values())
    n_new = vocab_size - len(base) - len(SPECIAL_TOKENS)
    if n_new < 0:
        raise ConfigError(f"components.text_encoder.vocab_size: {vocab_size} < {len(base) + len(SPECIAL_TOKENS)} "
                          "(byte-level alphabet + special tokens)")
    merges, learned, _ = learn_bpe(Counter({tuple(w): c for w, c in words.items()}), set(base), n_new,
                                    "components.text_encoder.vocab_size")
    vocab = {token: i for i, token in enumerate(base + learned + list(SPECIAL_TOKENS))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", model_max_length=int(settings["model_max_length"]))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_pipeline(data: dict[str, Any], seed: int) -> Any:
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3Model

    comps, toks = data["components"], data["tokenizers"]
    tokenizer = build_qwen_tokenizer(comps["text_encoder"]["vocab_size"], toks["tokenizer"])
    if len(tokenizer) != comps["text_encoder"]["vocab_size"]:  # a bug here, not in the recipe
        raise AssertionError(f"tokenizer: {len(tokenizer)} tokens, text encoder expects a different size")
    te_cfg = dict(comps["text_encoder"], pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)

    def seeded(make: Any) -> Any:
        torch.manual_seed(seed)
        with torch.no_grad():
            return make()

    tr_kwargs = dict(comps["transformer"])
    for key in ("all_patch_size", "all_f_patch_size"):
        tr_kwargs[key] = tuple(tr_kwargs.get(key, (2,) if key == "all_patch_size" else (1,)))
    transformer = seeded(lambda: ZImageTransformer2DModel(**tr_kwargs))
    vae = seeded(lambda: AutoencoderKL(**comps["vae"]))
    text_encoder = seeded(lambda: Qwen3Model(Qwen3Config(**te_cfg)))
    scheduler = FlowMatchEulerDiscreteScheduler(**comps["scheduler"])
    return ZImagePipeline(scheduler=scheduler, vae=vae.eval(), text_encoder=text_encoder.eval(),
                          tokenizer=tokenizer, transformer=transformer.eval())


def build_tiny_zimage(out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH,
                      seed: int = 0) -> Path:
    """Build the tiny Z-Image pipeline folder from ``recipe`` into ``out_dir`` (replacing a previous build);
    same contract as ``latentmill.tiny.build_tiny_flux``. Loads with ``ZImagePipeline.from_pretrained``."""
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=True)


def ensure_tiny_zimage(out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH,
                       seed: int = 0) -> Path:
    """Return ``out_dir``, building the tiny Z-Image pipeline there first only if ``model_index.json`` is missing."""
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=False)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m latentmill.tiny_zimage OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``; prints the path."""
    return tiny_cli(argv, "python -m latentmill.tiny_zimage", __doc__.splitlines()[0], build_tiny_zimage,
                    ensure_tiny_zimage, DEFAULT_RECIPE_PATH)


if __name__ == "__main__":
    raise SystemExit(main())
