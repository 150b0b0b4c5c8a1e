"""Adapter between cached FLUX.2 latents and an unmodified Diffusers ``Flux2Transformer2DModel``.

One module for both FLUX.2 families: ``flux2`` (FLUX.2 [dev], ``Flux2Pipeline``, guidance-distilled: a guidance
embedding) and ``flux2-klein`` (FLUX.2 [klein] 4B / 9B, ``Flux2KleinPipeline``, no guidance embedding). The
transformer sees what the pipelines give it at inference time:

* ``hidden_states``: the cached latents are already 2x2-patchified and normalised ([B, 4C, H/16, W/16], see
  ``latentmill.stages.family_flux2``); packing is a plain reshape to [B, H*W, 4C] (``_pack_latents``);
* ``img_ids`` [B, H*W, 4] = (t=0, h, w, l=0) per token and ``txt_ids`` [B, L, 4] = (0, 0, 0, l) per text token
  (``_prepare_latent_ids`` / ``_prepare_text_ids``, integer coordinates);
* ``timestep``: sigma (the pipelines pass the scheduler's ``t / 1000``, and ``t = 1000 * sigma``);
* ``guidance``: ``trainer.guidance_scale`` per sample when the model has a guidance embedding (dev), else None
  (klein: the pipeline passes ``guidance=None`` and does classifier-free guidance instead);
* ``encoder_hidden_states``: every cached position of the prompt embedding, padding included, no mask.

The resolution-dependent shift is FLUX.2's ``compute_empirical_mu(image_seq_len, num_steps)``: it depends on the
number of inference steps too. Training has no such number; it takes the pipelines' default
``num_inference_steps`` (50, ``SHIFT_NUM_STEPS``), so ``trainer.shift_mode: resolution`` trains the noise levels a
default 50-step sample visits at that resolution.

Shape legend: B batch, C = 4 x VAE latent channels (128 for FLUX.2), H/W latent height/width (pixels / 16),
N = H*W image tokens, L text tokens, D text width (3 x the text encoder's hidden size).
"""

from __future__ import annotations

import functools

import torch
from latentmill.trainer.adapter import ModelAdapter
from torch import nn

# The pipelines' default num_inference_steps (Flux2Pipeline / Flux2KleinPipeline.__call__), for the mu of training.
SHIFT_NUM_STEPS = 50

# The layers community FLUX.2 LoRAs train (ai-toolkit's BFL-format keys, as diffusers' Flux2 LoRA loader maps them):
# double blocks' image and text attention (qkv, proj) and MLPs, single blocks' fused qkv+MLP input (linear1) and
# output (linear2, ``single_transformer_blocks.N.attn.to_out``). ``to_out`` reaches the single blocks' output
# projections only: in the double blocks it names the ModuleList whose Linear is ``to_out.0``.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out", "to_qkv_mlp_proj",
                "to_out")


def pack_latents(latents_BCHW: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H*W, C] (``Flux2Pipeline._pack_latents``: one token per patchified latent pixel)."""
    B, C, H, W = latents_BCHW.shape
    return latents_BCHW.reshape(B, C, H * W).permute(0, 2, 1)


def unpack_latents(tokens_BNC: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of ``pack_latents``: [B, H*W, C] -> [B, C, H, W]."""
    B, N, C = tokens_BNC.shape
    if N != height * width:
        raise ValueError(f"{N} tokens do not tile a {height}x{width} latent")
    return tokens_BNC.permute(0, 2, 1).reshape(B, C, height, width)


@functools.lru_cache(maxsize=64)
def _coordinates(sizes: tuple[int, int, int, int], device) -> torch.Tensor:
    """[prod(sizes), 4] integer coordinates of the (t, h, w, l) grid of ``sizes``, built on ``device`` once per grid
    and shared (callers must not change it in place)."""
    return torch.cartesian_prod(*(torch.arange(n, device=device) for n in sizes))


def latent_ids(batch: int, height: int, width: int, device=None) -> torch.Tensor:
    """[B, H*W, 4] integer coordinates (t=0, h, w, l=0), as ``Flux2Pipeline._prepare_latent_ids``."""
    return _coordinates((1, height, width, 1), device).unsqueeze(0).expand(batch, -1, -1)


def text_ids(batch: int, seq_len: int, device=None) -> torch.Tensor:
    """[B, L, 4] integer coordinates (0, 0, 0, l), as ``Flux2Pipeline._prepare_text_ids``."""
    return _coordinates((1, 1, 1, seq_len), device).unsqueeze(0).expand(batch, -1, -1)


def empirical_mu(image_seq_len: int, num_steps: int = SHIFT_NUM_STEPS) -> float:
    """FLUX.2's ``compute_empirical_mu`` (the pipelines' own function): mu of the shift for ``image_seq_len`` tokens
    sampled in ``num_steps`` steps."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    return compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps)


def check_flux2_batch_fits(transformer: nn.Module, latents_BCHW: torch.Tensor, prompt_embeds_BLD: torch.Tensor) -> None:
    """Raise ``ValueError`` saying what differs when cached tensors do not fit a ``Flux2Transformer2DModel``."""
    cfg = transformer.config
    problems = []
    if latents_BCHW.ndim != 4:
        problems.append(f"latents have shape {tuple(latents_BCHW.shape)}, expected [B, C, H, W] (images)")
    elif latents_BCHW.shape[1] != cfg.in_channels:
        problems.append(f"latents have {latents_BCHW.shape[1]} channels (2x2-patchified), transformer in_channels "
                        f"is {cfg.in_channels}")
    if prompt_embeds_BLD.shape[-1] != cfg.joint_attention_dim:
        problems.append(f"prompt_embeds width is {prompt_embeds_BLD.shape[-1]}, transformer joint_attention_dim is "
                        f"{cfg.joint_attention_dim}")
    if problems:
        raise ValueError("cached latents do not match the transformer: " + "; ".join(problems))


def flux2_forward(
    transformer: nn.Module,
    noisy_BCHW: torch.Tensor,
    sigmas_B: torch.Tensor,
    prompt_embeds_BLD: torch.Tensor,
    guidance_scale: float = 4.0,
) -> torch.Tensor:
    """Predict the flow velocity [B, C, H, W], calling the transformer exactly like ``Flux2Pipeline.__call__``
    (``guidance`` only when the model has a guidance embedding). ``transformer`` may be wrapped (DDP)."""
    B, _, H, W = noisy_BCHW.shape
    device, dtype = noisy_BCHW.device, noisy_BCHW.dtype
    config = getattr(transformer, "module", transformer).config
    guidance = None
    if getattr(config, "guidance_embeds", False):
        guidance = torch.full((B,), float(guidance_scale), device=device, dtype=torch.float32)
    pred_BNC = transformer(
        hidden_states=pack_latents(noisy_BCHW),
        timestep=sigmas_B.to(device=device, dtype=dtype),
        guidance=guidance,
        encoder_hidden_states=prompt_embeds_BLD.to(dtype),
        txt_ids=text_ids(B, prompt_embeds_BLD.shape[1], device=device),
        img_ids=latent_ids(B, H, W, device=device),
        return_dict=False,
    )[0]
    return unpack_latents(pred_BNC, H, W)


class Flux2Adapter(ModelAdapter):
    """FLUX.2 [dev] (and its fine-tunes): ``Flux2Transformer2DModel`` with a guidance embedding, ``Flux2Pipeline``."""

    family = "flux2"
    transformer_class = "Flux2Transformer2DModel"
    pipeline_class = "Flux2Pipeline"
    streams = ("latents", "prompt_embeds")
    latent_ndim = 3
    lora_targets = LORA_TARGETS
    negative_embeds = False  # its guidance is embedded: the pipeline takes no negative prompt

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    def check_batch(self, transformer: nn.Module, batch: dict) -> None:
        check_flux2_batch_fits(transformer, batch["latents"], batch["prompt_embeds"])

    def seq_len(self, latents: torch.Tensor) -> int:
        return latents.shape[-2] * latents.shape[-1]  # one token per patchified latent pixel

    def resolution_mu(self, image_seq_len: int, cfg) -> float:
        """FLUX.2's ``compute_empirical_mu`` at the pipelines' default 50 steps (``SHIFT_NUM_STEPS``)."""
        return empirical_mu(image_seq_len, SHIFT_NUM_STEPS)

    def forward(self, model: nn.Module, noisy, sigmas_B, batch: dict, cfg) -> torch.Tensor:
        return flux2_forward(model, noisy, sigmas_B, batch["prompt_embeds"], cfg.guidance_scale)

    def validation_images(self, pipe, text, negative, *, size, steps, generator, max_sequence_length, guidance_scale):
        width, height = size[0], size[1]
        # [klein] takes the negative's embeddings only (it encodes its own "" from text)
        negative = {k: v for k, v in negative.items() if self.negative_embeds and k != "negative_prompt"}
        out = pipe(**text, **negative, height=height, width=width, num_inference_steps=steps,
                   guidance_scale=guidance_scale, max_sequence_length=max_sequence_length, generator=generator)
        return [[image] for image in out.images]


class Flux2KleinAdapter(Flux2Adapter):
    """FLUX.2 [klein] 4B / 9B: ``Flux2Transformer2DModel`` without a guidance embedding, ``Flux2KleinPipeline``
    (validation samples use its classifier-free guidance, ``trainer.guidance_scale``)."""

    family = "flux2-klein"
    pipeline_class = "Flux2KleinPipeline"
    negative_embeds = True  # classifier-free guidance (guidance_scale > 1) against them
