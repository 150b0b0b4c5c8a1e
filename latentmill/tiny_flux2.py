"""The tiny FLUX.2 model sets (``flux2``: FLUX.2 [dev], ``flux2-klein``: FLUX.2 [klein]), built offline from a recipe.

The FLUX.2 tests and demos need a pipeline with the real structure (an ``AutoencoderKLFlux2`` whose latents are
2x2-patchified and normalised by its batch-norm running statistics, a ``Flux2Transformer2DModel``, a
flow-matching scheduler with dynamic shifting, and the family's text side) but small enough to build, load and
run in seconds on a CPU, with nothing downloaded. ``build_tiny_flux2`` builds one from a recipe:

* ``data/tiny-flux2-klein.yaml`` (``variant: klein``): ``Flux2KleinPipeline`` with a ``Qwen3ForCausalLM`` text
  encoder and a ``Qwen2Tokenizer`` (byte-level BPE learned on the tiny Flux corpus, Qwen3's chat template);
* ``data/tiny-flux2.yaml`` (``variant: dev``): ``Flux2Pipeline`` with a ``Mistral3ForConditionalGeneration``
  text encoder (Mistral text model + Pixtral vision tower) and a byte-level BPE tokenizer with Mistral Small 3's
  chat template and its ``[SYSTEM_PROMPT]`` / ``[INST]`` tokens (the real repo's ``PixtralProcessor`` wraps such a
  tokenizer; transformers builds that processor only with torchvision installed).

Every component is constructed after ``torch.manual_seed(seed)``: the same recipe and seed give byte-identical
weight files. The folder is written beside ``out_dir`` and renamed into place when complete. The result loads
like the real thing::

    pipe = diffusers.DiffusionPipeline.from_pretrained(out_dir)      # -> Flux2KleinPipeline / Flux2Pipeline
    image = pipe("a red square", height=64, width=64, num_inference_steps=2, max_sequence_length=64).images[0]

Command line: ``python -m latentmill.tiny_flux2 OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from latentmill.core.config import ConfigError
from latentmill.resources import resource_root
from latentmill.tiny import CORPUS, bytes_to_unicode, check_keys, learn_bpe, pretokenize
from latentmill.tinyio import pipeline_folder, tiny_cli

KLEIN_RECIPE_PATH: Path = resource_root() / "data" / "tiny-flux2-klein.yaml"
"""The FLUX.2 [klein] recipe shipped with the package (``data/tiny-flux2-klein.yaml``)."""
DEV_RECIPE_PATH: Path = resource_root() / "data" / "tiny-flux2.yaml"
"""The FLUX.2 [dev] recipe shipped with the package (``data/tiny-flux2.yaml``)."""
DEFAULT_RECIPE_PATH = KLEIN_RECIPE_PATH

_COMPONENTS = ("transformer", "vae", "text_encoder", "scheduler")
# The hidden layers each pipeline stacks by default (Flux2Pipeline / Flux2KleinPipeline.encode_prompt).
OUT_LAYERS = {"dev": (10, 20, 30), "klein": (9, 18, 27)}

# Qwen3's chat template for text turns: ChatML, and with enable_thinking=False an empty think block after the
# assistant header (what Qwen3's own template writes; Flux2KleinPipeline passes enable_thinking=False).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
QWEN3_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")

# Mistral Small 3.x's chat template for text parts (images as [IMG] placeholders the processor expands).
MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- set ns = namespace(text='') %}"
    "{%- if message['content'] is string %}{%- set ns.text = message['content'] %}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{%- set ns.text = ns.text + part['text'] %}"
    "{%- elif part['type'] == 'image' %}{%- set ns.text = ns.text + '[IMG]' %}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + ns.text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + ns.text + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- ns.text + eos_token }}{%- endif %}{%- endfor %}"
)
MISTRAL3_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                     "[IMG_BREAK]", "[IMG_END]", "<pad>")


def load_recipe(recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH) -> dict[str, Any]:
    """Read a tiny FLUX.2 recipe (``variant: klein`` or ``dev``) and check that its parts fit together.

    Raises:
        ConfigError: a section is missing or unknown, or two components disagree on a shared size (for example
            ``transformer.joint_attention_dim`` != 3 x the text encoder's hidden size). The message names the keys.
    """
    path = Path(recipe)
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with 'variant', 'components' and 'tokenizers'")
    check_keys(data, ("variant", "components", "tokenizers"), f"{path}")
    variant = data["variant"]
    if variant not in OUT_LAYERS:
        raise ConfigError(f"{path}: variant: must be one of {', '.join(map(repr, OUT_LAYERS))}, got {variant!r}")
    comps = data["components"]
    check_keys(comps, _COMPONENTS, f"{path}: components")
    check_keys(data["tokenizers"], ("tokenizer",), f"{path}: tokenizers")
    tr, vae, te = comps["transformer"], comps["vae"], comps["text_encoder"]
    text = te.get("text_config", {}) if variant == "dev" else te
    where = "components.text_encoder" + (".text_config" if variant == "dev" else "")
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if key not in text:
            raise ConfigError(f"{where}.{key}: must be set")
    checks = [
        (tr["in_channels"] == 4 * vae["latent_channels"],
         f"components.transformer.in_channels: {tr['in_channels']} != 4 x components.vae.latent_channels "
         f"({vae['latent_channels']}); FLUX.2 patchifies 2x2 latent patches"),
        (tr["joint_attention_dim"] == 3 * text["hidden_size"],
         f"components.transformer.joint_attention_dim: {tr['joint_attention_dim']} != 3 x {where}.hidden_size "
         f"({text['hidden_size']}); the pipeline stacks three hidden layers"),
        (len(tr["axes_dims_rope"]) == 4 and sum(tr["axes_dims_rope"]) == tr["attention_head_dim"],
         f"components.transformer.axes_dims_rope: {tr['axes_dims_rope']} must be 4 axes (t, h, w, l) summing "
         f"to attention_head_dim ({tr['attention_head_dim']})"),
        (text["num_hidden_layers"] >= max(OUT_LAYERS[variant]),
         f"{where}.num_hidden_layers: {text['num_hidden_layers']} < {max(OUT_LAYERS[variant])}; the pipeline "
         f"reads hidden layers {OUT_LAYERS[variant]}"),
        (tr.get("guidance_embeds", True) == (variant == "dev"),
         "components.transformer.guidance_embeds: FLUX.2 [dev] has a guidance embedding, [klein] has none"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    return data


# --------------------------------------------------------------------------------------------------------------
# Tokenizers


def _byte_bpe(empty: Any, vocab_size: int, specials: Sequence[str], what: str,
              corpus: Sequence[str] = CORPUS) -> tuple[dict[str, int], list]:
    """(vocab, merges) of a byte-level BPE of exactly ``vocab_size`` tokens learned on ``corpus``, words split by
    ``empty``'s pre-tokenizer; the special tokens take the last ids."""
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    n_new = vocab_size - len(alphabet) - len(specials)
    if n_new < 0:
        raise ConfigError(f"{what}: {vocab_size} < {len(alphabet) + len(specials)} (bytes + special tokens)")
    words = pretokenize(empty.backend_tokenizer, corpus)
    merges, learned, _ = learn_bpe(Counter({tuple(w): c for w, c in words.items()}), set(alphabet), n_new, what)
    return {t: i for i, t in enumerate(alphabet + learned + list(specials))}, merges


def build_qwen3_tokenizer(vocab_size: int, settings: dict[str, Any]) -> Any:
    """A Qwen3-style ``Qwen2Tokenizer`` of exactly ``vocab_size`` tokens, with Qwen3's text chat template."""
    from transformers import Qwen2Tokenizer

    alphabet = {bytes_to_unicode()[b]: b for b in range(256)}
    empty = Qwen2Tokenizer(vocab=alphabet, merges=[], unk_token=None, bos_token=None)
    vocab, merges = _byte_bpe(empty, vocab_size, QWEN3_SPECIALS, "components.text_encoder.vocab_size")
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", model_max_length=int(settings["model_max_length"]))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<think>", "</think>"]})
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def build_mistral3_tokenizer(data: dict[str, Any]) -> Any:
    """A byte-level BPE tokenizer with Mistral's special tokens and Mistral Small 3's chat template.

    FLUX.2 [dev] ships a ``PixtralProcessor`` (this tokenizer + a Pixtral image processor) in ``tokenizer/``; the
    pipeline only uses its ``apply_chat_template`` on text, which a tokenizer with the same template does alike
    (the processor renders the template and calls the tokenizer). transformers' ``PixtralProcessor`` requires
    torchvision, which a CPU-only install of latentmill does not have, so the tiny set ships the tokenizer alone.
    """
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    settings = data["tokenizers"]["tokenizer"]

    def tokenizer_of(vocab: dict[str, int], merges: list) -> Any:
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                       unk_token="<unk>", pad_token="<pad>",
                                       model_max_length=int(settings["model_max_length"]))

    alphabet = {bytes_to_unicode()[b]: b for b in range(256)}
    vocab, merges = _byte_bpe(tokenizer_of(alphabet, []), data["components"]["text_encoder"]["text_config"]["vocab_size"],
                              MISTRAL3_SPECIALS, "components.text_encoder.text_config.vocab_size",
                              # the pipeline's system message, weighted, is learned too: fewer tokens in every prompt
                              corpus=(*CORPUS, *[SYSTEM_MESSAGE] * 8))
    tokenizer = tokenizer_of(vocab, merges)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in MISTRAL3_SPECIALS
                                                                if t not in ("<unk>", "<s>", "</s>", "<pad>")]})
    tokenizer.chat_template = MISTRAL3_CHAT_TEMPLATE
    return tokenizer


# --------------------------------------------------------------------------------------------------------------
# Pipeline


def _build_pipeline(data: dict[str, Any], seed: int) -> Any:
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    comps = data["components"]

    def seeded(make: Any) -> Any:
        torch.manual_seed(seed)
        with torch.no_grad():
            return make()

    def make_vae() -> Any:
        vae = AutoencoderKLFlux2(**comps["vae"])
        # non-trivial running statistics (a fresh BatchNorm2d has mean 0, variance 1): the normalisation shows
        vae.bn.running_mean.copy_(0.2 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))
        return vae.eval()

    transformer = seeded(lambda: Flux2Transformer2DModel(**comps["transformer"]).eval())
    vae = seeded(make_vae)
    scheduler = FlowMatchEulerDiscreteScheduler(**comps["scheduler"])
    te = comps["text_encoder"]
    if data["variant"] == "klein":
        from diffusers import Flux2KleinPipeline
        from transformers import Qwen3Config, Qwen3ForCausalLM

        tokenizer = build_qwen3_tokenizer(te["vocab_size"], data["tokenizers"]["tokenizer"])
        if len(tokenizer) != te["vocab_size"]:  # a bug here, not in the recipe
            raise AssertionError(f"tokenizer: {len(tokenizer)} tokens, text encoder expects {te['vocab_size']}")
        ids = dict(zip(("pad", "eos"), tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])))
        config = Qwen3Config(**te, pad_token_id=ids["pad"], bos_token_id=ids["pad"], eos_token_id=ids["eos"])
        text_encoder = seeded(lambda: Qwen3ForCausalLM(config).eval())
        return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                  transformer=transformer)
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = build_mistral3_tokenizer(data)
    if len(tokenizer) != te["text_config"]["vocab_size"]:
        raise AssertionError(f"tokenizer: {len(tokenizer)} tokens, text encoder expects "
                             f"{te['text_config']['vocab_size']}")
    ids = dict(zip(("bos", "eos", "pad", "image"), tokenizer.convert_tokens_to_ids(["<s>", "</s>", "<pad>", "[IMG]"])))
    text = {**te["text_config"], "model_type": "mistral", "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
            "pad_token_id": ids["pad"]}
    config = Mistral3Config(**{**te, "text_config": text, "vision_config": {**te["vision_config"],
                                                                            "model_type": "pixtral"},
                               "image_token_index": ids["image"]})
    text_encoder = seeded(lambda: Mistral3ForConditionalGeneration(config).eval())
    return Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)


def build_tiny_flux2(out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH,
                     seed: int = 0) -> Path:
    """Build the tiny FLUX.2 pipeline of ``recipe`` into ``out_dir`` (replacing a previous build); return its path.

    Raises:
        ConfigError: the recipe is inconsistent (see ``load_recipe``).
        FileExistsError: ``out_dir`` holds something that is not a pipeline folder.
    """
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=True)


def ensure_tiny_flux2(out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH,
                      seed: int = 0) -> Path:
    """Return ``out_dir``, building the tiny FLUX.2 pipeline there first only if ``model_index.json`` is missing."""
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=False)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m latentmill.tiny_flux2 OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``."""
    return tiny_cli(argv, "python -m latentmill.tiny_flux2", __doc__.splitlines()[0], build_tiny_flux2,
                    ensure_tiny_flux2, DEFAULT_RECIPE_PATH)


if __name__ == "__main__":
    raise SystemExit(main())
