"""The tiny Flux-class model set: a complete, random-weight Diffusers pipeline built offline from a recipe.

The demo and the tests need a model with the real FLUX.1-dev structure (CLIP + T5 text encoders, a 16-channel
VAE, an MM-DiT transformer with guidance embedding, a flow-matching scheduler) but small enough to build,
load and run in seconds on a laptop CPU, without downloading anything. ``build_tiny_flux`` builds one from
``data/tiny-flux.yaml``:

* every component is constructed from the config in the recipe, after ``torch.manual_seed(seed)``, so two
  builds with the same seed give byte-identical ``*.safetensors`` files;
* the two tokenizers are learned from a fixed in-code English corpus with a small, deterministic, pure-Python
  BPE learner (the trainers of the ``tokenizers`` library are multi-threaded and not reproducible), then
  wrapped in the transformers classes the FluxPipeline expects (``CLIPTokenizer`` and ``T5Tokenizer``; in
  transformers 5 ``CLIPTokenizerFast``/``T5TokenizerFast`` are the same classes);
* the pipeline is written to a hidden temporary folder next to ``out_dir`` and renamed into place at the end,
  so a killed build never leaves a folder with a ``model_index.json`` that is not complete.

The result loads like the real thing::

    pipe = diffusers.DiffusionPipeline.from_pretrained(out_dir)      # -> FluxPipeline
    image = pipe("a red square", height=64, width=48, num_inference_steps=2,
                 guidance_scale=3.5, max_sequence_length=64).images[0]

Command line: ``python -m latentmill.tiny OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``.
"""

from __future__ import annotations

import math
import os
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from latentmill.core.config import ConfigError
from latentmill.resources import resource_root
from latentmill.tinyio import pipeline_folder, tiny_cli

DEFAULT_RECIPE_PATH: Path = resource_root() / "data" / "tiny-flux.yaml"
"""The recipe shipped with the package (``data/tiny-flux.yaml``; ``latentmill/data/`` in a wheel)."""


_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "scheduler")
_TOKENIZERS = ("tokenizer", "tokenizer_2")

# The tokenizers are learned from this text. Changing it changes the tokenizer files (not the weights).
# ASCII only: the T5 vocabulary is built over printable ASCII characters.
CORPUS: tuple[str, ...] = (
    "a red square on a white background",
    "a blue circle and a green triangle on a black background",
    "a photo of a cat sitting on a wooden table next to a window",
    "two dogs running through a green field at sunset",
    "a close-up portrait of an old man with a grey beard and glasses",
    "a bowl of fresh fruit: apples, oranges, bananas and grapes",
    "an astronaut riding a horse on the moon, digital art",
    "the city skyline at night with bright lights reflected in the river",
    "a small yellow house with a red door in the middle of a forest",
    "a woman wearing a long blue dress walking on the beach",
    "a child playing with a kite in a park on a windy day",
    "a bird standing on a branch covered in snow",
    "a mountain lake surrounded by pine trees under a clear sky",
    "a plate of spaghetti with tomato sauce and fresh basil",
    "a vintage car driving down an empty desert road",
    "a watercolor painting of flowers in a glass vase",
    "a cup of hot coffee on a desk beside an open laptop",
    "a group of people sitting around a campfire telling stories",
    "a black and white photograph of a busy train station",
    "a cartoon drawing of a smiling robot holding a balloon",
    "an aerial view of a green island in the middle of the ocean",
    "a medieval castle on top of a hill, fantasy illustration",
    "a young girl reading a book under a large oak tree",
    "a street market full of colorful vegetables and spices",
    "a sleeping puppy curled up on a soft blanket",
    "a bicycle leaning against a brick wall in the rain",
    "a modern kitchen with white cabinets and a marble counter",
    "a sailboat floating on calm water during the golden hour",
    "a macro shot of a butterfly resting on a purple flower",
    "a snowy village with warm lights glowing in every window",
    "an oil painting of a stormy sea with huge waves",
    "a pair of red shoes on a wooden floor",
    "a tall glass building reflecting the clouds",
    "a horse grazing in a meadow of wild flowers",
    "a bright neon sign that says open in a dark alley",
    "a slice of chocolate cake with strawberries on top",
    "a fox hiding in tall grass, looking at the camera",
    "a crowded beach with umbrellas and people swimming",
    "a quiet library with rows of old books and a reading lamp",
    "a futuristic city with flying cars and glowing towers",
    "a pencil sketch of a cat's face",
    "a man riding a motorcycle on a winding mountain road",
    "a frozen waterfall in the middle of winter",
    "three ducks swimming in a pond near a small bridge",
    "a portrait photo of a smiling woman with curly brown hair",
    "a bowl of ramen with an egg, noodles and green onions",
    "an abstract pattern of orange and blue shapes",
    "a tiny green frog sitting on a large leaf",
    "a lighthouse on a rocky coast at dawn",
    "a farmer driving a tractor across a wheat field",
    "a baby elephant walking behind its mother",
    "a jar of honey next to a piece of bread",
    "a cozy living room with a fireplace and a grey sofa",
    "a hot air balloon floating over green hills",
    "a police car parked outside a coffee shop",
    "a teddy bear sitting on a chair in an empty room",
    "a close-up of raindrops on a window pane",
    "a skier jumping over a snowy slope",
    "a wooden boat tied to a dock on a foggy morning",
    "a dragon flying over a burning village, concept art",
    "a person holding an umbrella in a heavy snowstorm",
    "a train crossing a bridge over a deep canyon",
    "a colorful parrot perched on a tree branch in the jungle",
    "a glass of orange juice on a breakfast table",
    "a soccer player kicking a ball in a stadium",
    "a 3d render of a shiny metal sphere on a checkered floor",
    "a 1920s street scene with people in hats and coats",
    "a pixel art landscape with 8 trees and 2 clouds",
    "the letter a written in gold on black paper",
    "a map of an imaginary country with rivers and roads",
    "a white cat and a black dog sleeping together",
    "a yellow school bus driving through a small town",
    "a knight in shiny armor holding a sword and a shield",
    "a field of sunflowers under a bright blue sky",
    "a plate of sushi with chopsticks on the side",
    "an empty parking lot at night lit by street lamps",
    "a monkey eating a banana in a tall tree",
    "a ceramic teapot with a floral pattern",
    "a waterfall flowing into a clear green pool",
    "a man in a suit waiting for a bus in the rain",
    "a green apple, a red apple and a pear on a table",
    "it's a sunny day and we're going to the beach, they'll swim and i'd read",
    "high quality, detailed, sharp focus, 4k, studio lighting, soft shadows",
)


# --------------------------------------------------------------------------------------------------------------
# Recipe


def load_recipe(recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH) -> dict[str, Any]:
    """Read a tiny-model recipe YAML and check that its parts fit together.

    Args:
        recipe: Path of the YAML file (default: ``data/tiny-flux.yaml`` of this repository).

    Returns:
        ``{"components": {name: constructor kwargs}, "tokenizers": {name: settings}}`` with the five components
        ``transformer``, ``vae``, ``text_encoder``, ``text_encoder_2``, ``scheduler`` and the two tokenizers
        ``tokenizer``, ``tokenizer_2``.

    Raises:
        ConfigError: a section is missing or unknown, or two components disagree on a shared size (for example
            ``transformer.joint_attention_dim`` != ``text_encoder_2.d_model``). The message names the keys.
    """
    path = Path(recipe)
    with path.open(encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    where = f"{path}"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping with 'components' and 'tokenizers'")
    check_keys(data, ("components", "tokenizers"), where)
    comps, toks = data["components"], data["tokenizers"]
    check_keys(comps, _COMPONENTS, f"{where}: components")
    check_keys(toks, _TOKENIZERS, f"{where}: tokenizers")
    for name in _COMPONENTS:
        if not isinstance(comps[name], dict):
            raise ConfigError(f"components.{name}: expected a mapping of constructor arguments")
    for name in _TOKENIZERS:
        if not isinstance(toks[name], dict):
            raise ConfigError(f"tokenizers.{name}: expected a mapping of tokenizer settings")

    tr, vae, clip, t5 = comps["transformer"], comps["vae"], comps["text_encoder"], comps["text_encoder_2"]
    required = {
        "transformer": (
            "in_channels",
            "joint_attention_dim",
            "pooled_projection_dim",
            "attention_head_dim",
            "axes_dims_rope",
        ),
        "vae": ("latent_channels", "block_out_channels", "norm_num_groups"),
        "text_encoder": (
            "vocab_size",
            "hidden_size",
            "max_position_embeddings",
            "bos_token_id",
            "eos_token_id",
        ),
        "text_encoder_2": ("vocab_size", "d_model"),
    }
    for name, keys in required.items():
        for key in keys:
            if key not in comps[name]:
                raise ConfigError(f"components.{name}.{key}: must be set")
    for name, key in (("tokenizer", "model_max_length"), ("tokenizer_2", "model_max_length")):
        if key not in toks[name]:
            raise ConfigError(f"tokenizers.{name}.{key}: must be set")

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    require(
        tr["in_channels"] == vae["latent_channels"] * 4,
        f"components.transformer.in_channels: {tr['in_channels']} != 4 x components.vae.latent_channels "
        f"({vae['latent_channels']}); Flux packs 2x2 latent patches",
    )
    require(
        tr["joint_attention_dim"] == t5["d_model"],
        f"components.transformer.joint_attention_dim: {tr['joint_attention_dim']} != "
        f"components.text_encoder_2.d_model ({t5['d_model']})",
    )
    require(
        tr["pooled_projection_dim"] == clip["hidden_size"],
        f"components.transformer.pooled_projection_dim: {tr['pooled_projection_dim']} != "
        f"components.text_encoder.hidden_size ({clip['hidden_size']})",
    )
    require(
        sum(tr["axes_dims_rope"]) == tr["attention_head_dim"],
        f"components.transformer.axes_dims_rope: {tr['axes_dims_rope']} sums to {sum(tr['axes_dims_rope'])}, "
        f"not attention_head_dim ({tr['attention_head_dim']})",
    )
    bad = [c for c in vae["block_out_channels"] if c % vae["norm_num_groups"]]
    require(
        not bad,
        f"components.vae.block_out_channels: {bad} not divisible by norm_num_groups ({vae['norm_num_groups']})",
    )
    require(
        clip["max_position_embeddings"] >= toks["tokenizer"]["model_max_length"],
        f"components.text_encoder.max_position_embeddings: {clip['max_position_embeddings']} < "
        f"tokenizers.tokenizer.model_max_length ({toks['tokenizer']['model_max_length']})",
    )
    # The CLIP vocabulary puts bos/eos on the last two ids (like openai/clip-vit-large-patch14).
    vocab = clip["vocab_size"]
    require(
        (clip["bos_token_id"], clip["eos_token_id"]) == (vocab - 2, vocab - 1),
        f"components.text_encoder.bos_token_id/eos_token_id: expected {vocab - 2}/{vocab - 1} "
        f"(the last two ids of vocab_size {vocab}), got {clip['bos_token_id']}/{clip['eos_token_id']}",
    )
    if "pad_token_id" in t5 or "eos_token_id" in t5:
        require(
            (t5.get("pad_token_id", 0), t5.get("eos_token_id", 1)) == (0, 1),
            "components.text_encoder_2.pad_token_id/eos_token_id: the T5 tokenizer uses pad=0, eos=1",
        )
    return data


def read_sections(path: Path, components: Sequence[str], tokenizers: Sequence[str], optional: Sequence[str] = ()
                  ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A tiny-model recipe's YAML as ``(data, components, tokenizers)``: exactly the named components, each
    a mapping of constructor arguments, and the named tokenizers (a ConfigError naming the key otherwise).
    ``optional``: further top-level sections the recipe may have (left in ``data``)."""
    with Path(path).open(encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with 'components' and 'tokenizers'")
    check_keys(data, ("components", "tokenizers", *(k for k in optional if k in data)), f"{path}")
    comps, toks = data["components"], data["tokenizers"]
    check_keys(comps, components, f"{path}: components")
    check_keys(toks, tokenizers, f"{path}: tokenizers")
    for name in components:
        if not isinstance(comps[name], dict):
            raise ConfigError(f"components.{name}: expected a mapping of constructor arguments")
    return data, comps, toks


def check_keys(section: dict[str, Any], expected: Sequence[str], where: str) -> None:
    """Raise ``ConfigError`` naming ``where`` if ``section`` has a key not in ``expected`` or lacks one of them."""
    unknown = sorted(set(section) - set(expected))
    missing = [k for k in expected if k not in section]
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {list(expected)}")
    if missing:
        raise ConfigError(f"{where}: missing key(s) {missing}")


# --------------------------------------------------------------------------------------------------------------
# Tokenizers


def _learn_bpe(
    words: Counter[tuple[str, ...]], known: set[str], n_new: int, what: str
) -> tuple[list[tuple[str, str]], list[str], Counter[str]]:
    """Greedy BPE: merge the most frequent adjacent pair until ``n_new`` new symbols exist.

    Ties are broken by the pair itself (lexicographic), so the result depends on the corpus only.
    Returns the merges in rank order, the new symbols in creation order and how often each symbol occurs in
    the final segmentation of ``words``.
    """
    entries = [(list(symbols), count) for symbols, count in sorted(words.items())]
    pairs: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for index, (symbols, count) in enumerate(entries):
        for pair in zip(symbols, symbols[1:]):
            pairs[pair] += count
            where.setdefault(pair, set()).add(index)
    merges: list[tuple[str, str]] = []
    new_tokens: list[str] = []
    while len(new_tokens) < n_new:
        if not pairs:
            raise ConfigError(
                f"{what}: the built-in corpus only supports {len(new_tokens)} learned tokens, "
                f"{n_new} are needed; lower the vocab_size"
            )
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        merges.append(best)
        if merged not in known:
            known.add(merged)
            new_tokens.append(merged)
        for index in where.pop(best):
            symbols, count = entries[index]
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] -= count
                if pairs[pair] <= 0:
                    del pairs[pair]
            symbols[:] = _apply_merge(tuple(symbols), best, merged)
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += count
                where.setdefault(pair, set()).add(index)
    usage: Counter[str] = Counter()
    for symbols, count in entries:
        for symbol in symbols:
            usage[symbol] += count
    return merges, new_tokens, usage


def _apply_merge(symbols: tuple[str, ...], pair: tuple[str, str], merged: str) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == pair[0] and symbols[i + 1] == pair[1]:
            out.append(merged)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte -> printable unicode character table (the byte-level BPE alphabet, in CLIP's order)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _pretokenize(backend: Any, texts: Iterable[str]) -> Counter[str]:
    """Split texts into words exactly like ``backend`` (a ``tokenizers.Tokenizer``) does at encode time."""
    words: Counter[str] = Counter()
    for text in texts:
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        for word, _ in backend.pre_tokenizer.pre_tokenize_str(text):
            words[word] += 1
    return words


# The BPE learner and pre-tokenizer walk, for the tokenizers of the other tiny model sets (latentmill.tiny_zimage,
# latentmill.tiny_qwen_image, latentmill.tiny_flux2).
learn_bpe, pretokenize = _learn_bpe, _pretokenize


def build_clip_tokenizer(vocab_size: int, settings: dict[str, Any], corpus: Sequence[str] = CORPUS) -> Any:
    """Learn a byte-level BPE CLIP tokenizer of exactly ``vocab_size`` tokens from ``corpus``.

    The vocabulary follows openai/clip-vit-large-patch14: the 256 byte symbols, the same 256 with the
    end-of-word marker ``</w>``, the learned merges, then ``<|startoftext|>`` and ``<|endoftext|>`` as the last
    two ids. Any text can be encoded (every byte is in the vocabulary).

    Args:
        vocab_size: Total number of tokens; must equal the CLIP text encoder's ``vocab_size``.
        settings: ``tokenizers.tokenizer`` of the recipe (``model_max_length`` and the special tokens).
        corpus: Training sentences.

    Returns:
        A ``transformers.CLIPTokenizer``.
    """
    from transformers import CLIPTokenizer

    special = {
        key: settings.get(key, default)
        for key, default in (
            ("bos_token", "<|startoftext|>"),
            ("eos_token", "<|endoftext|>"),
            ("pad_token", "<|endoftext|>"),
            ("unk_token", "<|endoftext|>"),
        )
    }
    # An empty CLIPTokenizer carries CLIP's normalizer and pre-tokenizer: learn on the words it produces.
    words = _pretokenize(CLIPTokenizer(**special).backend_tokenizer, corpus)
    alphabet = list(bytes_to_unicode().values())
    base = alphabet + [c + "</w>" for c in alphabet]
    specials = list(dict.fromkeys([special["bos_token"], special["eos_token"]]))
    n_new = vocab_size - len(base) - len(specials)
    if n_new < 0:
        raise ConfigError(
            f"components.text_encoder.vocab_size: {vocab_size} < {len(base) + len(specials)} "
            "(byte-level alphabet + special tokens)"
        )
    symbol_words = Counter({tuple(w[:-1]) + (w[-1] + "</w>",): c for w, c in words.items()})
    merges, learned, _ = _learn_bpe(symbol_words, set(base), n_new, "components.text_encoder.vocab_size")
    vocab = {token: i for i, token in enumerate(base + learned + specials)}
    tokenizer = CLIPTokenizer(
        vocab=vocab, merges=merges, model_max_length=int(settings["model_max_length"]), **special
    )
    return tokenizer


def build_t5_tokenizer(vocab_size: int, settings: dict[str, Any], corpus: Sequence[str] = CORPUS) -> Any:
    """Build a SentencePiece-style Unigram T5 tokenizer of exactly ``vocab_size`` tokens from ``corpus``.

    Ids 0, 1, 2 are ``<pad>``, ``</s>``, ``<unk>`` like in T5; then the word-start marker ``▁``, the printable
    ASCII characters and pieces learned by BPE on ``▁``-prefixed words, scored by their log frequency. Every
    sequence ends with ``</s>``; characters outside the vocabulary (non-ASCII) become ``<unk>``. No sentinel
    (``<extra_id_N>``) tokens, so the tokenizer length equals ``vocab_size``.

    Args:
        vocab_size: Total number of tokens; must equal the T5 encoder's ``vocab_size``.
        settings: ``tokenizers.tokenizer_2`` of the recipe (``model_max_length`` and the special tokens).
        corpus: Training sentences (printable ASCII).

    Returns:
        A ``transformers.T5Tokenizer`` (the class ``T5TokenizerFast`` resolves to in transformers 5).
    """
    from transformers import T5Tokenizer

    pad, eos, unk = (
        settings.get("pad_token", "<pad>"),
        settings.get("eos_token", "</s>"),
        settings.get("unk_token", "<unk>"),
    )
    empty = T5Tokenizer(pad_token=pad, eos_token=eos, unk_token=unk, extra_ids=0)
    words = _pretokenize(empty.backend_tokenizer, corpus)
    chars = [c for c in string.printable if not c.isspace()]
    base = ["▁"] + chars
    outside = sorted({c for w in words for c in w} - set(base))
    if outside:
        raise ConfigError(f"tokenizer corpus: characters outside printable ASCII: {outside}")
    n_new = vocab_size - 3 - len(base)
    if n_new < 0:
        raise ConfigError(
            f"components.text_encoder_2.vocab_size: {vocab_size} < {3 + len(base)} "
            "(special tokens + characters)"
        )
    symbol_words = Counter({tuple(w): c for w, c in words.items()})
    _, learned, counts = _learn_bpe(symbol_words, set(base), n_new, "components.text_encoder_2.vocab_size")

    # Unigram scores: log frequency of each piece in the BPE segmentation of the corpus (add-half smoothing).
    pieces = base + learned
    total = sum(counts[p] + 0.5 for p in pieces)
    scored = [(p, round(math.log((counts[p] + 0.5) / total), 6)) for p in pieces]
    vocab = [(pad, 0.0), (eos, 0.0), (unk, 0.0)] + scored
    return T5Tokenizer(
        vocab=vocab,
        pad_token=pad,
        eos_token=eos,
        unk_token=unk,
        extra_ids=0,
        model_max_length=int(settings["model_max_length"]),
    )


# --------------------------------------------------------------------------------------------------------------
# Pipeline


def _build_pipeline(data: dict[str, Any], seed: int) -> Any:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    comps, toks = data["components"], data["tokenizers"]
    tokenizer = build_clip_tokenizer(comps["text_encoder"]["vocab_size"], toks["tokenizer"])
    tokenizer_2 = build_t5_tokenizer(comps["text_encoder_2"]["vocab_size"], toks["tokenizer_2"])
    for name, tok, cfg in (
        ("tokenizer", tokenizer, comps["text_encoder"]),
        ("tokenizer_2", tokenizer_2, comps["text_encoder_2"]),
    ):
        if len(tok) != cfg["vocab_size"]:  # a bug here, not in the recipe
            raise AssertionError(f"{name}: {len(tok)} tokens, text encoder expects {cfg['vocab_size']}")
    if (tokenizer.bos_token_id, tokenizer.eos_token_id) != (
        comps["text_encoder"]["bos_token_id"],
        comps["text_encoder"]["eos_token_id"],
    ):
        raise AssertionError("CLIP tokenizer bos/eos ids do not match the text encoder config")

    def seeded(make: Any) -> Any:
        torch.manual_seed(seed)
        with torch.no_grad():
            return make()

    transformer = seeded(lambda: FluxTransformer2DModel(**comps["transformer"]))
    vae = seeded(lambda: AutoencoderKL(**comps["vae"]))
    text_encoder = seeded(lambda: CLIPTextModel(CLIPTextConfig(**comps["text_encoder"])))
    text_encoder_2 = seeded(lambda: T5EncoderModel(T5Config(**comps["text_encoder_2"])))
    scheduler = FlowMatchEulerDiscreteScheduler(**comps["scheduler"])
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=tokenizer_2,
        transformer=transformer.eval(),
    )


def build_tiny_flux(
    out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH, seed: int = 0
) -> Path:
    """Build the tiny Flux pipeline folder from ``recipe`` into ``out_dir`` (replacing a previous build).

    Every component is created from the recipe after ``torch.manual_seed(seed)``; the same recipe and seed
    give byte-identical weight files. The folder is written next to ``out_dir`` and renamed into place when
    complete. An existing ``out_dir`` is replaced if it is empty or a pipeline folder (has
    ``model_index.json``); anything else raises ``FileExistsError``.

    Args:
        out_dir: Destination folder; its parent is created if needed.
        recipe: Recipe YAML (default: ``data/tiny-flux.yaml``).
        seed: Seed for the random weights.

    Returns:
        The absolute path of the pipeline folder, loadable with ``FluxPipeline.from_pretrained`` and
        ``diffusers.DiffusionPipeline.from_pretrained``.

    Raises:
        ConfigError: the recipe is inconsistent (see ``load_recipe``).
        FileExistsError: ``out_dir`` holds something that is not a pipeline folder.
    """
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=True)


def ensure_tiny_flux(
    out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH, seed: int = 0
) -> Path:
    """Return ``out_dir``, building the tiny Flux pipeline there first only if ``model_index.json`` is missing.

    An existing folder is not checked against ``recipe``/``seed``; call ``build_tiny_flux`` to rebuild. If two
    processes build at once, the first to finish wins and the other keeps its result.

    Args:
        out_dir: Pipeline folder.
        recipe: Recipe YAML used when a build is needed.
        seed: Seed used when a build is needed.

    Returns:
        The absolute path of the pipeline folder.
    """
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=False)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m latentmill.tiny OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``; prints the folder path."""
    return tiny_cli(argv, "python -m latentmill.tiny", __doc__.splitlines()[0], build_tiny_flux,
                    ensure_tiny_flux, DEFAULT_RECIPE_PATH)


if __name__ == "__main__":
    raise SystemExit(main())
