"""The tiny LTX-2-class model set: a complete, random-weight video-with-audio Diffusers pipeline built offline.

``build_tiny_ltx2`` builds an ``LTX2Pipeline`` folder from ``data/tiny-ltx2.yaml`` the way
``latentmill.tiny_wan.build_tiny_wan`` builds the tiny Wan set: every component is constructed from the
recipe's config after ``torch.manual_seed(seed)`` (byte-identical safetensors for one seed), written beside
``out_dir`` and renamed into place. The tokenizer is a ``GemmaTokenizer`` (Gemma's byte-fallback BPE: spaces
become ``▁`` and end a word) of exactly ``text_config.vocab_size`` tokens, its merges learned from the fixed
corpus of ``latentmill.tiny``; it adds ``<bos>`` like Gemma 3's.

The result loads like the real thing::

    pipe = diffusers.LTX2Pipeline.from_pretrained(out_dir)
    video, audio = pipe("a red ball", height=64, width=64, num_frames=9, num_inference_steps=2,
                        max_sequence_length=64, output_type="np", return_dict=False)

Command line: ``python -m latentmill.tiny_ltx2 OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``.
"""

from __future__ import annotations

import math
import os
import string
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from latentmill.core.config import ConfigError
from latentmill.tiny import CORPUS, learn_bpe, pretokenize, read_sections
from latentmill.tinyio import pipeline_folder, tiny_cli

DEFAULT_RECIPE_PATH: Path = Path(__file__).resolve().parents[1] / "data" / "tiny-ltx2.yaml"
"""The recipe shipped with the repository (``data/tiny-ltx2.yaml``)."""

_COMPONENTS = ("transformer", "connectors", "vae", "audio_vae", "vocoder", "text_encoder", "scheduler")
_TOKENIZERS = ("tokenizer",)
# Gemma's special tokens, in its order (pad 0, eos 1, bos 2, unk 3, mask 4), then Gemma 3's image markers
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")


def load_recipe(recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH) -> dict[str, Any]:
    """Read a tiny-LTX-2 recipe YAML and check that its parts fit together (the rules in its header); a
    ConfigError naming the keys otherwise."""
    data, comps, toks = read_sections(Path(recipe), _COMPONENTS, _TOKENIZERS)
    tr, con, vae, audio, voc = (comps[k] for k in ("transformer", "connectors", "vae", "audio_vae", "vocoder"))
    text = comps["text_encoder"].get("text_config") or {}

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    require(tr.get("in_channels") == vae.get("latent_channels"),
            f"components.transformer.in_channels: {tr.get('in_channels')} != components.vae.latent_channels "
            f"({vae.get('latent_channels')})")
    inner = tr.get("num_attention_heads", 0) * tr.get("attention_head_dim", 0)
    require(inner >= tr.get("in_channels", 0),
            f"components.transformer.num_attention_heads x attention_head_dim: {inner} < in_channels "
            f"({tr.get('in_channels')}): the predicted velocity (noise - latents) needs every latent channel; "
            "widen the transformer")
    audio_width = audio.get("latent_channels", 8) * audio.get("mel_bins", 64) // 4
    require(tr.get("audio_in_channels") == audio_width,
            f"components.transformer.audio_in_channels: {tr.get('audio_in_channels')} != audio_vae.latent_channels "
            f"x mel_bins / 4 ({audio_width})")
    require(audio.get("base_channels") == audio_width,
            f"components.audio_vae.base_channels: {audio.get('base_channels')} != latent_channels x mel_bins / 4 "
            f"({audio_width}): the pipeline normalises packed audio latents with base_channels statistics")
    for key in ("latents_mean", "latents_std"):
        require(len(audio.get(key) or []) == audio_width,
                f"components.audio_vae.{key}: {len(audio.get(key) or [])} values, expected base_channels "
                f"({audio_width}): the VAE's own statistics (latentmill.tiny_ltx2.measure_audio_statistics)")
    width = text.get("hidden_size")
    require(tr.get("caption_channels") == con.get("caption_channels") == width,
            f"components.transformer.caption_channels / connectors.caption_channels: {tr.get('caption_channels')} / "
            f"{con.get('caption_channels')} != text_encoder.text_config.hidden_size ({width})")
    layers = text.get("num_hidden_layers", 0) + 1
    require(con.get("text_proj_in_factor") == layers,
            f"components.connectors.text_proj_in_factor: {con.get('text_proj_in_factor')} != "
            f"text_encoder.text_config.num_hidden_layers + 1 ({layers})")
    for side in ("video", "audio"):
        inner = con.get(f"{side}_connector_num_attention_heads", 0) * con.get(f"{side}_connector_attention_head_dim", 0)
        require(inner == width, f"components.connectors.{side}_connector_num_attention_heads x attention_head_dim: "
                                f"{inner} != caption_channels ({width})")
    mel_width = audio.get("output_channels", 2) * audio.get("mel_bins", 64)
    require(voc.get("in_channels") == mel_width,
            f"components.vocoder.in_channels: {voc.get('in_channels')} != audio_vae.output_channels x mel_bins "
            f"({mel_width})")
    require(text.get("vocab_size", 0) > len(SPECIALS) + 95,
            f"components.text_encoder.text_config.vocab_size: must be > {len(SPECIALS) + 95} (specials + characters)")
    require("model_max_length" in (toks["tokenizer"] or {}), "tokenizers.tokenizer.model_max_length: must be set")
    return data


def synthetic_sounds(generator: Any, n: int, seconds: float = 1.0, sample_rate: int = 16000) -> Any:
    """``n`` stereo sounds ``[n, 2, seconds * sample_rate]``: three tones each (100 Hz to 6.4 kHz, log-uniform, at
    0.003 to 0.3 of full scale, random phases), panned between the channels; a pure function of ``generator``'s
    seed (a ``torch.Generator``)."""
    import torch

    t = torch.arange(round(seconds * sample_rate)) / sample_rate
    freq = 100.0 * 2 ** (6 * torch.rand(n, 3, 1, generator=generator))
    amplitude = 0.3 * 10 ** (-2 * torch.rand(n, 3, 1, generator=generator))
    phase = 2 * math.pi * torch.rand(n, 3, 1, generator=generator)
    mono = (amplitude * torch.sin(2 * math.pi * freq * t + phase)).sum(1)
    pan = torch.rand(n, 1, generator=generator)
    return torch.stack([mono * (1 - pan), mono * pan], 1) * math.sqrt(2)


def measure_audio_statistics(audio_vae: Any, samples: int = 32, seed: int = 0) -> tuple[list[float], list[float]]:
    """Mean and standard deviation of ``audio_vae``'s latent means over ``synthetic_sounds``, per packed feature
    (channel, then mel bin: ``LTX2Pipeline._pack_audio_latents``'s order).

    This is how the recipe's ``audio_vae.latents_mean`` / ``latents_std`` are set (rounded to 4 decimals, for
    the VAE of seed 0): the pipeline normalises audio latents with these buffers, which LTX-2's VAE carries as its
    own statistics, and at their defaults (0 / 1) the tiny VAE's audio latents (std 0.15) lay under unit noise.
    """
    import torch

    from latentmill.stages.audio import log_mel

    cfg = audio_vae.config
    with torch.no_grad():
        sounds = synthetic_sounds(torch.Generator().manual_seed(seed), samples, sample_rate=cfg.sample_rate)
        z_BCLM = audio_vae.encode(log_mel(sounds, cfg.sample_rate, cfg.mel_hop_length, cfg.mel_bins)).latent_dist.mean
    return z_BCLM.mean((0, 2)).flatten().tolist(), z_BCLM.std((0, 2)).flatten().tolist()


def build_gemma_tokenizer(vocab_size: int, settings: dict[str, Any], corpus: Sequence[str] = CORPUS) -> Any:
    """A ``GemmaTokenizer`` of exactly ``vocab_size`` tokens: ``SPECIALS``, ``▁`` and the printable ASCII
    characters, then BPE merges learned from ``corpus`` (ties broken by the pair, so a pure function of it)."""
    from transformers import GemmaTokenizer

    chars = ["▁"] + [c for c in string.printable if not c.isspace()]
    base = list(SPECIALS) + chars
    plain = GemmaTokenizer(vocab={t: i for i, t in enumerate(base)}, merges=[])
    words = pretokenize(plain.backend_tokenizer, list(corpus))
    merges, learned, _ = learn_bpe(Counter({tuple(w): c for w, c in words.items()}), set(chars),
                                   vocab_size - len(base), "components.text_encoder.text_config.vocab_size")
    return GemmaTokenizer(vocab={t: i for i, t in enumerate(base + learned)}, merges=merges, add_bos_token=True,
                          model_max_length=int(settings["model_max_length"]))


def _build_pipeline(data: dict[str, Any], seed: int) -> Any:
    import torch
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    comps = data["components"]
    text = dict(comps["text_encoder"])
    tokenizer = build_gemma_tokenizer(text["text_config"]["vocab_size"], data["tokenizers"]["tokenizer"])
    if len(tokenizer) != text["text_config"]["vocab_size"]:  # a bug here, not in the recipe
        raise AssertionError(f"tokenizer: {len(tokenizer)} tokens, the text encoder expects a different size")
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIALS}
    config = Gemma3Config(**text, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                          image_token_index=ids["<image_soft_token>"])
    config.text_config.update({"pad_token_id": ids["<pad>"], "eos_token_id": ids["<eos>"],
                               "bos_token_id": ids["<bos>"]})

    def seeded(make: Any) -> Any:
        torch.manual_seed(seed)
        with torch.no_grad():
            return make().eval()

    def tuples(kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}

    def audio_vae() -> Any:
        kwargs = dict(comps["audio_vae"])
        stats = {key: torch.tensor(kwargs.pop(key), dtype=torch.float32) for key in ("latents_mean", "latents_std")}
        vae = AutoencoderKLLTX2Audio(**tuples(kwargs))
        vae.latents_mean.copy_(stats["latents_mean"])
        vae.latents_std.copy_(stats["latents_std"])
        return vae

    return LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**comps["scheduler"]),
        vae=seeded(lambda: AutoencoderKLLTX2Video(**tuples(comps["vae"]))),
        audio_vae=seeded(audio_vae),
        text_encoder=seeded(lambda: Gemma3ForConditionalGeneration(config)),
        tokenizer=tokenizer,
        connectors=seeded(lambda: LTX2TextConnectors(**comps["connectors"])),
        transformer=seeded(lambda: LTX2VideoTransformer3DModel(**tuples(comps["transformer"]))),
        vocoder=seeded(lambda: LTX2Vocoder(**comps["vocoder"])),
    )


def build_tiny_ltx2(out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH,
                    seed: int = 0) -> Path:
    """Build the tiny LTX-2 pipeline folder from ``recipe`` into ``out_dir`` (replacing a previous build); the
    contract of ``latentmill.tiny.build_tiny_flux``. Returns the absolute path, loadable with
    ``LTX2Pipeline.from_pretrained``."""
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=True)


def ensure_tiny_ltx2(out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH,
                     seed: int = 0) -> Path:
    """Return ``out_dir``, building the tiny LTX-2 pipeline there first only if ``model_index.json`` is missing."""
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=False)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m latentmill.tiny_ltx2 OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``; prints the path."""
    return tiny_cli(argv, "python -m latentmill.tiny_ltx2", __doc__.splitlines()[0], build_tiny_ltx2,
                    ensure_tiny_ltx2, DEFAULT_RECIPE_PATH)


if __name__ == "__main__":
    raise SystemExit(main())
