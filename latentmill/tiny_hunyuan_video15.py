"""The tiny HunyuanVideo 1.5 model set: a complete, random-weight ``HunyuanVideo15Pipeline`` built offline.

The HunyuanVideo 1.5 tests and demo need the real structure (a Qwen2.5-VL text model read through the pipeline's
chat template, a ByT5 glyph encoder, the causal 3-D ``AutoencoderKLHunyuanVideo15`` with 16x spatial / 4x temporal
compression, a ``HunyuanVideo15Transformer3DModel``, the flow-match Euler scheduler and the CFG guider) small
enough to build and run in seconds on a CPU, without downloading anything. ``build_tiny_hunyuan_video15`` builds
one from ``data/tiny-hunyuanvideo1.5.yaml``, like the other tiny sets:

* every component is constructed from the recipe after ``torch.manual_seed(seed)`` (byte-identical builds);
* the Qwen tokenizer is ``latentmill.tiny_qwen_image.build_qwen_tokenizer``'s byte-level BPE, learned with the
  pipeline's system message so that the template's fixed prefix is the 108 tokens the pipeline crops, with a
  ChatML chat template (what Qwen2.5-VL's gives for text messages); the ByT5 tokenizer is byte-level and needs
  no vocabulary file;
* the pipeline is written to a hidden folder next to ``out_dir`` and renamed into place at the end.

The result loads like the real thing::

    pipe = diffusers.DiffusionPipeline.from_pretrained(out_dir)      # -> HunyuanVideo15Pipeline
    frames = pipe("a red ball", height=32, width=32, num_frames=5, num_inference_steps=2).frames

The image-to-video set (``data/tiny-hunyuanvideo1.5-i2v.yaml``) is built by the same code: its recipe adds a
SigLIP ``image_encoder`` (``SiglipVisionModel``) and its ``feature_extractor`` (``SiglipImageProcessor``), and it is
saved as a ``HunyuanVideo15ImageToVideoPipeline``. Its ``vae_residual_scale`` scales the VAE's residual branches
(``scale_vae_residuals``), so that what appears after a clip's first frame reaches the latents, and its text
encoder's ``initializer_range`` (0.3, not 0.02) makes a caption's tokens differ enough to reach the transformer's
blocks.

Command line: ``python -m latentmill.tiny_hunyuan_video15 OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from latentmill.core.config import ConfigError
from latentmill.tiny import read_sections
from latentmill.tinyio import pipeline_folder, tiny_cli

DEFAULT_RECIPE_PATH: Path = Path(__file__).resolve().parents[1] / "data" / "tiny-hunyuanvideo1.5.yaml"
"""The recipe shipped with the repository (``data/tiny-hunyuanvideo1.5.yaml``)."""
I2V_RECIPE_PATH: Path = DEFAULT_RECIPE_PATH.with_name("tiny-hunyuanvideo1.5-i2v.yaml")
"""The image-to-video recipe (``data/tiny-hunyuanvideo1.5-i2v.yaml``): SigLIP image conditioning."""

_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "scheduler", "guider")
_IMAGE_COMPONENTS = ("image_encoder", "feature_extractor")  # an image-to-video recipe's SigLIP side
_TOKENIZERS = ("tokenizer",)
# Qwen2.5-VL's chat template as it renders text-only messages
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def prompt_template() -> tuple[str, int]:
    """The pipeline's chat template as a format string of the caption, and the tokens it crops (108)."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    from latentmill.stages.family_hunyuanvideo1_5 import CROP_START

    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n<|im_start|>assistant\n",
            CROP_START)


def load_recipe(recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH) -> dict[str, Any]:
    """Read a tiny HunyuanVideo 1.5 recipe (text- or image-to-video: with an ``image_encoder``) and check that its
    parts fit together (ConfigError naming the keys)."""
    import yaml

    raw = yaml.safe_load(Path(recipe).read_text(encoding="utf-8"))
    image = isinstance(raw, dict) and "image_encoder" in (raw.get("components") or {})
    data, comps, toks = read_sections(Path(recipe), _COMPONENTS + (_IMAGE_COMPONENTS if image else ()), _TOKENIZERS,
                                      optional=("vae_residual_scale",))
    tr, vae = comps["transformer"], comps["vae"]

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    z = vae["latent_channels"]
    # the noisy latents, the condition latents (zeros for text-to-video) and a 1-channel mask, on channels
    require(tr["in_channels"] == 2 * z + 1 and tr["out_channels"] == z,
            f"components.transformer.in_channels/out_channels: {tr['in_channels']}/{tr['out_channels']} != "
            f"2 * vae.latent_channels + 1 / vae.latent_channels ({2 * z + 1}/{z})")
    require(tr["text_embed_dim"] == comps["text_encoder"]["hidden_size"],
            f"components.transformer.text_embed_dim: {tr['text_embed_dim']} != components.text_encoder.hidden_size "
            f"({comps['text_encoder']['hidden_size']})")
    require(tr["text_embed_2_dim"] == comps["text_encoder_2"]["d_model"],
            f"components.transformer.text_embed_2_dim: {tr['text_embed_2_dim']} != components.text_encoder_2.d_model "
            f"({comps['text_encoder_2']['d_model']})")
    require(sum(tr["rope_axes_dim"]) == tr["attention_head_dim"],
            f"components.transformer.rope_axes_dim: sum {sum(tr['rope_axes_dim'])} != attention_head_dim "
            f"({tr['attention_head_dim']})")
    if image:
        require(tr["image_embed_dim"] == comps["image_encoder"]["hidden_size"],
                f"components.transformer.image_embed_dim: {tr['image_embed_dim']} != "
                f"components.image_encoder.hidden_size ({comps['image_encoder']['hidden_size']})")
    require(comps["text_encoder"]["num_hidden_layers"] >= 3,
            "components.text_encoder.num_hidden_layers: must be >= 3 (the pipeline reads hidden_states[-3])")
    require(len(vae["block_out_channels"]) == 5,
            "components.vae.block_out_channels: 5 entries (4 spatial downsamplings: 16x)")
    if "model_max_length" not in toks["tokenizer"]:
        raise ConfigError("tokenizers.tokenizer.model_max_length: must be set")
    scale = data.get("vae_residual_scale", 1.0)
    require(isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale <= 1,
            f"vae_residual_scale: {scale!r} is not a number in (0, 1]; 1 keeps the VAE's random init")
    return data


def scale_vae_residuals(vae: Any, scale: float) -> None:
    """Multiply, in place, the layer of every residual branch of ``vae`` (an ``AutoencoderKLHunyuanVideo15``) whose
    output is added to its shortcut by ``scale``: the resnets' ``conv2``, the attention's ``proj_out``, the down- and
    upsamplers' convolutions (beside their space-to-channel shortcuts), the encoder's ``conv_out`` and the decoder's
    ``conv_in``.

    At full scale the random branches bury what the shortcuts carry of the frames after a clip's first (each
    temporal downsampling averages it with random channels), so a mark that appears after frame 0 barely moves the
    latents, unlike a trained VAE's; scaled down (Fixup-style), the shortcuts carry it (docs/training.md,
    "HunyuanVideo 1.5 (image-to-video)").
    """
    import torch
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hv

    last = {hv.HunyuanVideo15ResnetBlock: "conv2", hv.HunyuanVideo15AttnBlock: "proj_out",
            hv.HunyuanVideo15Downsample: "conv", hv.HunyuanVideo15Upsample: "conv"}
    layers = [getattr(m, last[type(m)]) for m in vae.modules() if type(m) in last]
    with torch.no_grad():
        for layer in [*layers, vae.encoder.conv_out, vae.decoder.conv_in]:
            for param in layer.parameters():
                param.mul_(scale)


def measure_scaling_factor(vae: Any, samples: int = 8, seed: int = 0, size: int = 32, frames: int = 5) -> float:
    """1 / the standard deviation of ``vae``'s latent means over ``synthetic_clips`` (``size`` px, ``frames``):
    how the recipe's ``vae.scaling_factor`` is set (rounded to 4 decimals, for the VAE of seed 0), as the real one
    (1.03682) makes the real VAE's latents about unit variance; the tiny LTX-2 set's too (64 px, 9 frames). Clips
    are encoded one at a time (the VAE takes no batch)."""
    import torch

    from latentmill.tiny_wan import synthetic_clips

    with torch.no_grad():
        clips = synthetic_clips(torch.Generator().manual_seed(seed), samples, size=size, frames=frames)
        z = torch.cat([vae.encode(c[None]).latent_dist.mean for c in clips])
    return 1.0 / float(z.std())


def _build_pipeline(data: dict[str, Any], seed: int) -> Any:
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    from latentmill.tiny_qwen_image import build_qwen_tokenizer

    comps, toks = data["components"], data["tokenizers"]
    te = comps["text_encoder"]
    tokenizer = build_qwen_tokenizer(te["vocab_size"], toks["tokenizer"], template=prompt_template())
    if len(tokenizer) != te["vocab_size"]:  # a bug here, not in the recipe
        raise AssertionError(f"tokenizer: {len(tokenizer)} tokens, text encoder expects {te['vocab_size']}")
    tokenizer.chat_template = CHAT_TEMPLATE
    specials = {"bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
                "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>")}

    def seeded(make: Any) -> Any:
        torch.manual_seed(seed)
        with torch.no_grad():
            return make().eval()

    tr_kwargs = dict(comps["transformer"], rope_axes_dim=tuple(comps["transformer"]["rope_axes_dim"]))
    vae_kwargs = dict(comps["vae"], block_out_channels=tuple(comps["vae"]["block_out_channels"]))
    vae = seeded(lambda: AutoencoderKLHunyuanVideo15(**vae_kwargs))
    scale_vae_residuals(vae, data.get("vae_residual_scale", 1.0))
    common = dict(
        transformer=seeded(lambda: HunyuanVideo15Transformer3DModel(**tr_kwargs)),
        vae=vae,
        text_encoder=seeded(lambda: Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**te, **specials))),
        tokenizer=tokenizer,
        text_encoder_2=seeded(lambda: T5EncoderModel(T5Config(**comps["text_encoder_2"]))),
        tokenizer_2=ByT5Tokenizer(),
        scheduler=FlowMatchEulerDiscreteScheduler(**comps["scheduler"]),
        guider=ClassifierFreeGuidance(**comps["guider"]),
    )
    if "image_encoder" in comps:
        from diffusers import HunyuanVideo15ImageToVideoPipeline
        from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

        image_encoder = seeded(lambda: SiglipVisionModel(SiglipVisionConfig(**comps["image_encoder"])))
        return HunyuanVideo15ImageToVideoPipeline(image_encoder=image_encoder,
                                                  feature_extractor=SiglipImageProcessor(**comps["feature_extractor"]),
                                                  **common)
    return HunyuanVideo15Pipeline(**common)


def build_tiny_hunyuan_video15(
    out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH, seed: int = 0
) -> Path:
    """Build the tiny HunyuanVideo 1.5 pipeline folder from ``recipe`` into ``out_dir`` (replacing a previous
    build); same contract as ``latentmill.tiny.build_tiny_flux``. Loads with ``HunyuanVideo15Pipeline`` (with
    ``I2V_RECIPE_PATH``: ``HunyuanVideo15ImageToVideoPipeline``)."""
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=True)


def ensure_tiny_hunyuan_video15(
    out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH, seed: int = 0
) -> Path:
    """Return ``out_dir``, building the tiny HunyuanVideo 1.5 pipeline there first only if it is missing."""
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=False)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m latentmill.tiny_hunyuan_video15 OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``."""
    return tiny_cli(argv, "python -m latentmill.tiny_hunyuan_video15", __doc__.splitlines()[0],
                    build_tiny_hunyuan_video15, ensure_tiny_hunyuan_video15, DEFAULT_RECIPE_PATH)


if __name__ == "__main__":
    raise SystemExit(main())
