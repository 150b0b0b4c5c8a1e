"""Adapter between cached latents and an unmodified Diffusers ``QwenImageTransformer2DModel`` (Qwen-Image).

The transformer sees what ``QwenImagePipeline.__call__`` gives it at inference time (diffusers 0.42):

* ``hidden_states``: the latents packed in 2x2 patches, [B, (H/2)*(W/2), 4C] (``_pack_latents``, the same
  packing as Flux's);
* ``timestep``: ``sigma`` (the pipeline passes ``t / 1000`` with ``t = 1000 * sigma`` from
  ``FlowMatchEulerDiscreteScheduler``; the model scales by 1000 inside its sinusoidal embedding);
* ``img_shapes``: ``[[(1, H/2, W/2)]] * B``, the packed grid of each sample (the image RoPE);
* ``encoder_hidden_states``: Qwen2.5-VL embeddings of the real tokens, zero-padded, with
  ``encoder_hidden_states_mask`` (True on real tokens): the loader's ``prompt_embeds`` and
  ``prompt_embeds_mask`` columns. The pipeline passes no mask when every token is real (batch size 1);
* ``guidance``: none (Qwen-Image has no guidance embedding; its CFG is ``true_cfg_scale`` at sampling).

How the transformer uses the mask (``transformer_qwenimage.py``): the text tokens' RoPE positions are
``max(H/2, W/2) + i`` for token ``i`` whatever the padding (``compute_text_seq_len_from_mask`` only returns
the padded length); the mask is the key mask of the joint [text, image] attention; text and image tokens
interact only through that attention (norms, MLPs and modulation are per token). So a padded, masked sample
gives the image tokens the same prediction as its real tokens alone (``tests/test_trainer_qwen_image.py``
shows it within float tolerance). The adapter still trims a batch to its longest caption: fewer tokens, and
a batch whose captions are all as long as that passes no mask, exactly the pipeline's call.

The velocity target is ``noise - x0``, as for Flux. ``QwenImageEditAdapter`` (Qwen-Image-Edit) subclasses
``QwenImageAdapter``: its :meth:`transformer_inputs` also return the ``reference_latents`` stream as
``reference_BCHW``, which :func:`qwen_image_forward` appends as the Edit pipeline does (its tokens after the
noisy ones, its shape in ``img_shapes``, the prediction cut to the noisy tokens).

Shape legend: B batch, C latent channels (16), H/W latent height/width (pixels / 8), N = (H/2)*(W/2) image
tokens, L text tokens, D text width (3584 for Qwen2.5-VL-7B).
"""

from __future__ import annotations

from typing import Any

import torch
from latentmill.trainer.adapter import ModelAdapter, mask_problems, padded
from latentmill.trainer.flux import pack_latents, unpack_latents
from torch import nn

# The Linear layers of every QwenImageTransformerBlock: what ai-toolkit and musubi-tuner Qwen-Image LoRAs
# train (attention of both streams, both MLPs, the AdaLN modulation). diffusers' own
# train_dreambooth_lora_qwen_image.py defaults to the first four (image-stream attention) only.
QWEN_IMAGE_LORA_TARGETS = (
    "to_q", "to_k", "to_v", "to_out.0",
    "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    "img_mod.1", "txt_mod.1",
)


def unused_modules(transformer: nn.Module) -> list[nn.Module]:
    """The modules whose output never reaches the prediction: the last block's text-stream attention output
    projection and text MLP (the model reads only the image stream after the last block). Their parameters
    (and LoRA layers on them) get no gradient; DDP refuses parameters unused in the loss, and training them
    would change nothing the model predicts."""
    last = transformer.transformer_blocks[-1]
    return [last.attn.to_add_out, last.txt_mlp]


def trim_to_longest(prompt_embeds_BLD: torch.Tensor, mask_BL: torch.Tensor | None):
    """Drop the token positions no sample of the batch uses; the mask becomes None when every position left is
    real (what ``QwenImagePipeline.encode_prompt`` passes for one caption, or for captions of equal length)."""
    if mask_BL is None:
        return prompt_embeds_BLD, None
    mask_BL = mask_BL.to(device=prompt_embeds_BLD.device, dtype=torch.bool)
    used = mask_BL.any(0).nonzero()
    longest = int(used.max()) + 1 if len(used) else prompt_embeds_BLD.shape[1]
    prompt_embeds_BLD, mask_BL = prompt_embeds_BLD[:, :longest], mask_BL[:, :longest]
    return prompt_embeds_BLD, (None if bool(mask_BL.all()) else mask_BL)


def qwen_image_forward(
    transformer: nn.Module,
    noisy_latents_BCHW: torch.Tensor,
    sigmas_B: torch.Tensor,
    prompt_embeds_BLD: torch.Tensor,
    prompt_embeds_mask_BL: torch.Tensor | None = None,
    reference_BCHW: torch.Tensor | None = None,
) -> torch.Tensor:
    """Predict the flow velocity [B, C, H, W], calling the transformer like ``QwenImagePipeline.__call__``
    (the batch trimmed to its longest caption first). ``transformer`` may be wrapped in DDP.

    ``reference_BCHW`` (for the Qwen-Image-Edit family, not used by Qwen-Image): clean latents of a reference
    image, packed and appended after the noisy tokens with their own ``img_shapes`` entry, the prediction cut
    to the noisy tokens, as ``QwenImageEditPipeline.__call__`` does.
    """
    B, _, H, W = noisy_latents_BCHW.shape
    device, dtype = noisy_latents_BCHW.device, noisy_latents_BCHW.dtype
    embeds, mask = trim_to_longest(prompt_embeds_BLD.to(device=device, dtype=dtype), prompt_embeds_mask_BL)
    tokens, shapes = pack_latents(noisy_latents_BCHW), [(1, H // 2, W // 2)]
    if reference_BCHW is not None:
        tokens = torch.cat([tokens, pack_latents(reference_BCHW.to(device=device, dtype=dtype))], dim=1)
        shapes.append((1, reference_BCHW.shape[2] // 2, reference_BCHW.shape[3] // 2))
    pred_BNK = transformer(
        hidden_states=tokens,
        timestep=sigmas_B.to(device=device, dtype=dtype),
        guidance=None,
        encoder_hidden_states_mask=mask,
        encoder_hidden_states=embeds,
        img_shapes=[shapes] * B,
        return_dict=False,
    )[0]
    return unpack_latents(pred_BNK[:, : (H // 2) * (W // 2)], H, W)


def check_qwen_batch_fits(transformer: nn.Module, latents_BCHW: torch.Tensor, prompt_embeds_BLD: torch.Tensor,
                          mask_BL: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` saying what differs when cached tensors do not fit a ``QwenImageTransformer2DModel``
    (with ``mask_BL``: also a cache stored padded, whose zeros the mask would take for real tokens)."""
    cfg = getattr(transformer, "module", transformer).config
    problems = []
    if latents_BCHW.ndim != 4:
        problems.append(f"latents have shape {tuple(latents_BCHW.shape)}, expected [B, C, H, W] (images)")
    else:
        if latents_BCHW.shape[1] * 4 != cfg.in_channels:
            problems.append(f"latents have {latents_BCHW.shape[1]} channels -> {latents_BCHW.shape[1] * 4} packed "
                            f"features, transformer in_channels is {cfg.in_channels}")
        if latents_BCHW.shape[2] % 2 or latents_BCHW.shape[3] % 2:
            problems.append(f"latent size {tuple(latents_BCHW.shape[2:])} is not a multiple of the 2x2 packing")
    if prompt_embeds_BLD.shape[-1] != cfg.joint_attention_dim:
        problems.append(f"prompt_embeds width is {prompt_embeds_BLD.shape[-1]}, transformer joint_attention_dim "
                        f"is {cfg.joint_attention_dim}")
    if mask_BL is not None:
        problems += mask_problems(prompt_embeds_BLD, mask_BL, "QwenImagePipeline's template alone gives 5")
    if problems:
        raise ValueError("cached latents do not match the transformer: " + "; ".join(problems))


class QwenImageAdapter(ModelAdapter):
    """Qwen-Image (Qwen/Qwen-Image and fine-tunes): ``QwenImageTransformer2DModel``, ``QwenImagePipeline``."""

    family = "qwen-image"
    transformer_class = "QwenImageTransformer2DModel"
    pipeline_class = "QwenImagePipeline"
    streams = ("latents", "prompt_embeds")  # and the loader's prompt_embeds_mask column (a "mask" stream)
    latent_ndim = 3
    lora_targets = QWEN_IMAGE_LORA_TARGETS

    def unused_modules(self, transformer: nn.Module) -> list[nn.Module]:
        return unused_modules(transformer)

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def check_batch(self, transformer: nn.Module, batch: dict) -> None:
        check_qwen_batch_fits(transformer, batch["latents"], batch["prompt_embeds"], batch.get("prompt_embeds_mask"))

    def seq_len(self, latents: torch.Tensor) -> int:
        return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)  # packed 2x2 tokens

    def transformer_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """What the transformer reads besides the noisy latents: ``prompt_embeds`` and its mask (None when the
        cache has none); an Edit adapter adds ``reference_BCHW`` (its reference-latent stream)."""
        return {"prompt_embeds_BLD": batch["prompt_embeds"], "prompt_embeds_mask_BL": batch.get("prompt_embeds_mask")}

    def forward(self, model: nn.Module, noisy, sigmas_B, batch: dict, cfg) -> torch.Tensor:
        return qwen_image_forward(model, noisy, sigmas_B, **self.transformer_inputs(batch))

    negative_prompt = " "  # the Qwen-Image model card's

    def pipeline_prompt_kwargs(self, prompts, pad_to):
        # the pipeline pads a batch of prompts to its longest, with a mask
        embeds_BLD, mask_BL = padded([p["prompt_embeds"] for p in prompts])
        return {"prompt_embeds": embeds_BLD, "prompt_embeds_mask": mask_BL}

    def validation_images(self, pipe, text, negative, *, size, steps, generator, max_sequence_length, guidance_scale):
        """Sampled as the Qwen-Image model card does: true CFG at ``guidance_scale`` (``true_cfg_scale``)
        against the negative prompt " " when it is above 1, none otherwise."""
        width, height = size[0], size[1]
        cfg = {**negative, "true_cfg_scale": guidance_scale} if guidance_scale > 1 else {"true_cfg_scale": 1.0}
        out = pipe(**text, height=height, width=width, num_inference_steps=steps, generator=generator,
                   max_sequence_length=max_sequence_length, **cfg)
        return [[image] for image in out.images]


class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit (Qwen/Qwen-Image-Edit): the same ``QwenImageTransformer2DModel``, called as
    ``QwenImageEditPipeline`` calls it: the edit's source latents (``reference_latents``) appended after the
    noisy tokens with their grid in ``img_shapes``; the prediction, and so the loss, covers the target's tokens
    only. LoRA targets: Qwen-Image's (the community's Edit LoRAs train the same layers)."""

    family = "qwen-image-edit"
    pipeline_class = "QwenImageEditPipeline"
    streams = ("latents", "prompt_embeds", "reference_latents")

    def check_batch(self, transformer: nn.Module, batch: dict) -> None:
        super().check_batch(transformer, batch)
        latents, reference = batch["latents"], batch["reference_latents"]
        if reference.shape[:2] != latents.shape[:2] or reference.ndim != latents.ndim:
            raise ValueError(f"cached latents do not match the transformer: reference_latents have shape "
                             f"{tuple(reference.shape)}, latents {tuple(latents.shape)} (expected [B, C, H, W] both)")

    def transformer_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {**super().transformer_inputs(batch), "reference_BCHW": batch["reference_latents"]}

    validates_from_prompts = False  # its pipeline samples from a source image (check_validation)

    def validation_images(self, pipe, text, negative, *, size, steps, generator, max_sequence_length, guidance_scale):
        raise ValueError("trainer.validate_every: the qwen-image-edit family samples from a source image (see "
                         "latentmill.trainer.adapters.check_validation)")
