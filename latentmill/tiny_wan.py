"""The tiny Wan-class model set: a complete, random-weight text-to-video Diffusers pipeline built offline.

The video tests need a model with the real Wan2.1 structure (a UMT5 text encoder, the causal 3D
``AutoencoderKLWan`` with 8x spatial / 4x temporal compression and 16 latent channels, a
``WanTransformer3DModel``, a flow-prediction scheduler) but small enough to build, load and run in seconds on a
laptop CPU, without downloading anything. ``build_tiny_wan`` builds one from ``data/tiny-wan.yaml``, the same
way ``latentmill.tiny.build_tiny_flux`` builds the tiny Flux set:

* every component is constructed from the config in the recipe, after ``torch.manual_seed(seed)``, so two
  builds with the same seed give byte-identical ``*.safetensors`` files;
* the tokenizer is the deterministic offline T5 Unigram tokenizer of ``latentmill.tiny.build_t5_tokenizer``
  (Wan uses the T5-style ``google/umt5-xxl`` tokenizer);
* the pipeline is written to a hidden temporary folder next to ``out_dir`` and renamed into place at the end;
* a recipe with a ``pipeline: {boundary_ratio: r}`` section (``data/tiny-wan2.2.yaml``) builds the Wan 2.2
  A14B layout: a second expert ``transformer_2`` of the same architecture (seeded ``seed + 1``, so the two
  differ) and ``boundary_ratio`` in ``model_index.json``.

The result loads like the real thing::

    pipe = diffusers.DiffusionPipeline.from_pretrained(out_dir)      # -> WanPipeline
    frames = pipe("a red ball", height=32, width=48, num_frames=9, num_inference_steps=2,
                  output_type="np").frames                            # (1, 9, 32, 48, 3)

The Wan 2.2 TI2V-5B-class set (``data/tiny-wan2.2-ti2v.yaml``) is built by the same code: its recipe adds a
``pipeline`` section (``expand_timesteps: true``) and the Wan 2.2 VAE's options (``is_residual``, ``patch_size``).
The Wan 2.1 I2V-class set (``data/tiny-wan2.1-i2v.yaml``) adds an ``image_encoder`` (``CLIPVisionModel``) and its
``image_processor`` (``CLIPImageProcessor``) and is saved as a ``WanImageToVideoPipeline``; the Wan 2.2 I2V
A14B-class set (``data/tiny-wan2.2-i2v.yaml``) is one without them (``pipeline.image_to_video``), with two experts.

Command line: ``python -m latentmill.tiny_wan OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from latentmill.core.config import ConfigError
from latentmill.tiny import build_t5_tokenizer, read_sections
from latentmill.tinyio import pipeline_folder, tiny_cli

DEFAULT_RECIPE_PATH: Path = Path(__file__).resolve().parents[1] / "data" / "tiny-wan.yaml"
"""The recipe shipped with the repository (``data/tiny-wan.yaml``)."""
TI2V_RECIPE_PATH: Path = DEFAULT_RECIPE_PATH.with_name("tiny-wan2.2-ti2v.yaml")
"""The Wan 2.2 TI2V-5B-class recipe (``data/tiny-wan2.2-ti2v.yaml``)."""
I2V_RECIPE_PATH: Path = DEFAULT_RECIPE_PATH.with_name("tiny-wan2.1-i2v.yaml")
"""The Wan 2.1 I2V-class recipe (``data/tiny-wan2.1-i2v.yaml``): CLIP image conditioning, 36 input channels."""
I2V_A14B_RECIPE_PATH: Path = DEFAULT_RECIPE_PATH.with_name("tiny-wan2.2-i2v.yaml")
"""The Wan 2.2 I2V A14B-class recipe (``data/tiny-wan2.2-i2v.yaml``): two experts, 36 input channels, no image
encoder."""

_COMPONENTS = ("transformer", "vae", "text_encoder", "scheduler")
_IMAGE_COMPONENTS = ("image_encoder", "image_processor")  # a Wan 2.1 I2V recipe's CLIP image side
_TOKENIZERS = ("tokenizer",)
# the WanPipeline config keys a recipe's ``pipeline`` section may set (boundary_ratio: also a second expert), and
# image_to_video: a WanImageToVideoPipeline without an image encoder (Wan 2.2 I2V A14B)
_PIPELINE_OPTIONS = ("expand_timesteps", "boundary_ratio", "image_to_video")


def load_recipe(recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH) -> dict[str, Any]:
    """Read a tiny-Wan recipe YAML and check that its parts fit together.

    Returns:
        ``{"components": {name: constructor kwargs}, "tokenizers": {"tokenizer": settings}}`` with the four
        components ``transformer``, ``vae``, ``text_encoder``, ``scheduler``.

    Raises:
        ConfigError: a section is missing or unknown, or two components disagree on a shared size (for example
            ``transformer.text_dim`` != ``text_encoder.d_model``). The message names the keys.
    """
    import yaml

    path = Path(recipe)
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    image = isinstance(raw, dict) and "image_encoder" in (raw.get("components") or {})
    names = _COMPONENTS + _IMAGE_COMPONENTS if image else _COMPONENTS
    data, comps, toks = read_sections(path, names, _TOKENIZERS, optional=("pipeline",))
    options = data.get("pipeline") or {}
    if not isinstance(options, dict) or set(options) - set(_PIPELINE_OPTIONS):
        raise ConfigError(f"pipeline: expected a mapping of {', '.join(_PIPELINE_OPTIONS)}; got {options!r}")
    if "boundary_ratio" in options and not 0.0 < float(options["boundary_ratio"]) < 1.0:
        raise ConfigError(f"pipeline.boundary_ratio: must be in (0, 1), got {options['boundary_ratio']}")
    if not isinstance(toks["tokenizer"], dict):
        raise ConfigError("tokenizers.tokenizer: expected a mapping of tokenizer settings")

    required = {
        "transformer": ("in_channels", "out_channels", "text_dim", "attention_head_dim", "patch_size"),
        "vae": (
            "z_dim",
            "dim_mult",
            "temperal_downsample",
            "latents_mean",
            "latents_std",
            "scale_factor_spatial",
            "scale_factor_temporal",
        ),
        "text_encoder": ("vocab_size", "d_model"),
    }
    for name, keys in required.items():
        for key in keys:
            if key not in comps[name]:
                raise ConfigError(f"components.{name}.{key}: must be set")
    if "model_max_length" not in toks["tokenizer"]:
        raise ConfigError("tokenizers.tokenizer.model_max_length: must be set")

    tr, vae, te = comps["transformer"], comps["vae"], comps["text_encoder"]

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    z = vae["z_dim"]
    # I2V: the noisy latents, a 4-channel first-frame mask and the condition latents, stacked on channels
    i2v = image or bool(options.get("image_to_video"))
    z_in = 2 * z + 4 if i2v else z
    why = ", in: 2 x z_dim + 4 with an image_encoder" if image else \
        ", in: 2 x z_dim + 4 with pipeline.image_to_video" if i2v else ""
    require(
        tr["in_channels"] == z_in and tr["out_channels"] == z,
        f"components.transformer.in_channels/out_channels: {tr['in_channels']}/{tr['out_channels']} != "
        f"{z_in}/{z} (vae.z_dim {z}{why})",
    )
    if image:
        width = comps["image_encoder"].get("hidden_size")
        require(tr.get("image_dim") == width,
                f"components.transformer.image_dim: {tr.get('image_dim')} != components.image_encoder.hidden_size "
                f"({width})")
    require(
        tr["text_dim"] == te["d_model"],
        f"components.transformer.text_dim: {tr['text_dim']} != components.text_encoder.d_model ({te['d_model']})",
    )
    for key in ("latents_mean", "latents_std"):
        require(
            isinstance(vae[key], list) and len(vae[key]) == z,
            f"components.vae.{key}: expected a list of {z} numbers (vae.z_dim)",
        )
    require(all(s > 0 for s in vae["latents_std"]), "components.vae.latents_std: every entry must be > 0")
    down = vae["temperal_downsample"]
    require(
        len(down) == len(vae["dim_mult"]) - 1,
        f"components.vae.temperal_downsample: {len(down)} entries, expected len(dim_mult) - 1 "
        f"({len(vae['dim_mult']) - 1})",
    )
    patch = vae.get("patch_size") or 1  # the Wan 2.2 VAE patchifies pixels (2 x 2) before its encoder
    require(
        vae["scale_factor_spatial"] == 2 ** len(down) * patch,
        f"components.vae.scale_factor_spatial: {vae['scale_factor_spatial']} != 2 ** {len(down)} x {patch} "
        "(one spatial downsampling per temperal_downsample entry, times vae.patch_size)",
    )
    require(
        vae.get("in_channels", 3) == vae.get("out_channels", 3) == 3 * patch**2,
        f"components.vae.in_channels/out_channels: expected 3 x patch_size ** 2 = {3 * patch**2}",
    )
    require(
        vae["scale_factor_temporal"] == 2 ** sum(bool(d) for d in down),
        f"components.vae.scale_factor_temporal: {vae['scale_factor_temporal']} != 2 ** "
        f"{sum(bool(d) for d in down)} (true entries of temperal_downsample)",
    )
    require(
        len(tr["patch_size"]) == 3,
        f"components.transformer.patch_size: {tr['patch_size']} is not (frames, height, width)",
    )
    require(
        tr["attention_head_dim"] >= 6,
        "components.transformer.attention_head_dim: must be >= 6 (RoPE splits it over t/h/w)",
    )
    if "pad_token_id" in te or "eos_token_id" in te:
        require(
            (te.get("pad_token_id", 0), te.get("eos_token_id", 1)) == (0, 1),
            "components.text_encoder.pad_token_id/eos_token_id: the T5 tokenizer uses pad=0, eos=1",
        )
    return data


def synthetic_clips(generator: Any, n: int, size: int = 32, frames: int = 5) -> Any:
    """``n`` still clips ``[n, 3, frames, size, size]`` in [-1, 1]: a solid shape on a solid background.

    The shape (rectangle, disc, stripes or triangle), its place, size and both colours are drawn from
    ``generator`` (a ``torch.Generator``), so the clips are a pure function of its seed.
    """
    import torch

    yy, xx = torch.meshgrid((torch.arange(size) + 0.5) / size, (torch.arange(size) + 0.5) / size, indexing="ij")
    background, foreground = torch.rand(n, 3, 1, 1, generator=generator), torch.rand(n, 3, 1, 1, generator=generator)
    p = torch.rand(n, 6, 1, 1, generator=generator)
    kind = torch.randint(0, 4, (n,), generator=generator)
    cx, cy, r = p[:, 0], p[:, 1], 0.15 + 0.3 * p[:, 2]
    rect = ((xx - cx).abs() < r) & ((yy - cy).abs() < r * (0.5 + p[:, 3]))
    disc = (xx - cx) ** 2 + (yy - cy) ** 2 < r**2
    stripes = torch.where(p[:, 5] < 0.5, xx, yy) / (0.15 + 0.35 * p[:, 4]) % 1 < 0.5
    triangle = (yy > cy - r) & (yy < cy + r) & ((xx - cx).abs() < (yy - cy + r) * 0.6)
    mask = torch.stack([rect, disc, stripes, triangle], 1)[torch.arange(n), kind]
    images = torch.where(mask[:, None], foreground, background) * 2 - 1
    return images[:, :, None].expand(n, 3, frames, size, size).contiguous()


def measure_latent_stats(vae: Any, samples: int = 32, seed: int = 0) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation of ``vae``'s latent means over ``synthetic_clips``.

    This is how the recipe's ``vae.latents_mean`` / ``vae.latents_std`` are set (rounded to 4 decimals, for the
    VAE of seed 0): the pipeline normalises latents to ``(z - mean) / std``, and Wan2.1's own statistics would
    squash the tiny random VAE's latents (raw std ~0.1) to a near-constant that hides what an image shows.
    """
    import torch

    with torch.no_grad():
        clips = synthetic_clips(torch.Generator().manual_seed(seed), samples)
        z = vae.encode(clips).latent_dist.mean
    dims = (0, 2, 3, 4)
    return z.mean(dims).tolist(), z.std(dims).tolist()


def _build_pipeline(data: dict[str, Any], seed: int) -> Any:
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    comps, toks = data["components"], data["tokenizers"]
    tokenizer = build_t5_tokenizer(comps["text_encoder"]["vocab_size"], toks["tokenizer"])
    if len(tokenizer) != comps["text_encoder"]["vocab_size"]:  # a bug here, not in the recipe
        raise AssertionError(f"tokenizer: {len(tokenizer)} tokens, text encoder expects a different size")

    def seeded(make: Any) -> Any:
        torch.manual_seed(seed)
        with torch.no_grad():
            return make()

    tr_kwargs = dict(comps["transformer"])
    tr_kwargs["patch_size"] = tuple(tr_kwargs["patch_size"])
    transformer = seeded(lambda: WanTransformer3DModel(**tr_kwargs))
    vae = seeded(lambda: AutoencoderKLWan(**comps["vae"]))
    text_encoder = seeded(lambda: UMT5EncoderModel(UMT5Config(**comps["text_encoder"])))
    scheduler = UniPCMultistepScheduler(**comps["scheduler"])
    options = dict(data.get("pipeline") or {})
    image_to_video = bool(options.pop("image_to_video", False))
    experts = {}
    if options.get("boundary_ratio") is not None:  # Wan 2.2 A14B: the low-noise expert
        torch.manual_seed(seed + 1)  # other weights than the high-noise one
        with torch.no_grad():
            experts = {"transformer_2": WanTransformer3DModel(**tr_kwargs).eval()}
    common = dict(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(), scheduler=scheduler,
                  transformer=transformer.eval(), **options, **experts)
    if "image_encoder" in comps:
        from diffusers import WanImageToVideoPipeline
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        image_encoder = seeded(lambda: CLIPVisionModel(CLIPVisionConfig(**comps["image_encoder"])))
        return WanImageToVideoPipeline(image_processor=CLIPImageProcessor(**comps["image_processor"]),
                                       image_encoder=image_encoder.eval(), **common)
    if image_to_video:  # Wan 2.2 I2V A14B: no image encoder, the image enters through the condition channels
        from diffusers import WanImageToVideoPipeline

        return WanImageToVideoPipeline(**common)
    return WanPipeline(**common)


def build_tiny_wan(
    out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH, seed: int = 0
) -> Path:
    """Build the tiny Wan pipeline folder from ``recipe`` into ``out_dir`` (replacing a previous build).

    Same contract as ``latentmill.tiny.build_tiny_flux``: byte-deterministic for a recipe and seed, written
    beside ``out_dir`` and renamed into place; an existing ``out_dir`` is replaced only if it is empty or a
    pipeline folder, anything else raises ``FileExistsError``.

    Returns:
        The absolute path of the folder, loadable with ``WanPipeline.from_pretrained`` and
        ``diffusers.DiffusionPipeline.from_pretrained``.
    """
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=True)


def ensure_tiny_wan(
    out_dir: str | os.PathLike[str], recipe: str | os.PathLike[str] = DEFAULT_RECIPE_PATH, seed: int = 0
) -> Path:
    """Return ``out_dir``, building the tiny Wan pipeline there first only if ``model_index.json`` is missing."""
    return pipeline_folder(out_dir, lambda: _build_pipeline(load_recipe(recipe), seed), replace=False)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m latentmill.tiny_wan OUT_DIR [--seed N] [--recipe PATH] [--if-missing]``; prints the path."""
    return tiny_cli(argv, "python -m latentmill.tiny_wan", __doc__.splitlines()[0], build_tiny_wan,
                    ensure_tiny_wan, DEFAULT_RECIPE_PATH)


if __name__ == "__main__":
    raise SystemExit(main())
