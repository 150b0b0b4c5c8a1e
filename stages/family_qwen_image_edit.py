"""Qwen-Image-Edit (``QwenImageEditPipeline``): Qwen-Image's VAE and text encoder, where the text encoder also
sees the edit's source image, and the source image's latents are a stream of their own (diffusers 0.42).

* ``latents``: the target image, as Qwen-Image's (``(z - latents_mean) / latents_std``);
* ``reference_latents``: the source image through the same VAE path, the distribution's mean (the pipeline's
  ``_encode_vae_image`` with ``sample_mode="argmax"``). The pipeline resizes the source to
  ``calculate_dimensions(1024 * 1024, ratio)``; here the bucket stage crops and resizes it to the target's
  bucket (``docs/prep.md``, "Edit datasets"), so the reference and the target have one size, which is what the
  pipeline sees when it generates at the source's computed size (its default);
* ``prompt_embeds``: Qwen2.5-VL's last hidden layer over the Edit template, whose user turn holds the source
  image (resized as the pipeline resizes it for its processor, then by the ``Qwen2VLImageProcessor``), the
  64-token system prefix dropped: the image's tokens, the instruction and the template's end, every one kept
  (the pipeline cuts nothing: ``cache.max_sequence_length`` must cover them all, or the tail is cut).

The processor's one text step, each ``<|image_pad|>`` repeated once per merged image patch, is done here from
the tokenizer and the image processor the pipeline's ``processor`` folder holds: transformers 5 builds a
``Qwen2VLProcessor`` only beside torchvision (its video half).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from latentmill.stages.encoders import Stream
from latentmill.stages.family_qwen_image import QwenImageEncoders

from latentmill.models import ModelConfig

# QwenImageEditPipeline.prompt_template_encode / prompt_template_encode_start_idx
EDIT_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
EDIT_TEMPLATE_START_IDX = 64
IMAGE_PAD = "<|image_pad|>"
PIPELINE_AREA = 1024 * 1024  # the pixel area QwenImageEditPipeline resizes the source image to


class QwenImageEditEncoders(QwenImageEncoders):
    """Qwen-Image's encoders with the Edit template, the source image seen by the text encoder, and its latents."""

    name = "qwen-image-edit"
    PIPELINES = ("QwenImageEditPipeline",)
    STREAMS = (
        *QwenImageEncoders.STREAMS,
        Stream("reference_latents", "vae", "[C, H/8, W/8]", "(z - latents_mean) / latents_std", from_reference=True),
    )
    CLASS_IMPORTS = (*QwenImageEncoders.CLASS_IMPORTS, ("transformers", "Qwen2VLImageProcessor"))
    TEXT_SEES_REFERENCE = True
    PROMPT_TEMPLATE = EDIT_PROMPT_TEMPLATE
    TEMPLATE_START_IDX = EDIT_TEMPLATE_START_IDX
    TOKENIZER_MAX_LENGTH = None  # the Edit pipeline keeps every token

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from transformers import Qwen2VLImageProcessor

        self.image_processor = Qwen2VLImageProcessor.from_pretrained(model.pretrained, subfolder="processor")

    @classmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        shapes = super().sample_shapes(config, bucket, max_sequence_length)
        return {**shapes, "reference_latents": shapes["latents"]}

    def pipeline_image(self, image: Any) -> Any:
        """The source image as ``QwenImageEditPipeline.__call__`` hands it to its processor: resized to
        ``calculate_dimensions(1024 * 1024, width / height)`` by its ``VaeImageProcessor``."""
        from diffusers.image_processor import VaeImageProcessor
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        width, height, _ = calculate_dimensions(PIPELINE_AREA, image.size[0] / image.size[1])
        return VaeImageProcessor(vae_scale_factor=16).resize(image, height, width)

    def _hidden_states(self, captions: list[str], max_tokens: int,
                       images: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``QwenImageEditPipeline._get_qwen_prompt_embeds``'s text-encoder call: the Edit template, and with
        ``images`` each caption's source image through the image processor, its placeholder repeated once per
        merged patch (``Qwen2VLProcessor``'s expansion). Without images (the cached empty prompt) the
        placeholder stays one token, as the processor leaves it. Nothing is cut: ``max_tokens`` is unused."""
        texts = [self.PROMPT_TEMPLATE.format(c) for c in captions]
        vision: dict[str, torch.Tensor] = {}
        if images is not None:
            vision = dict(self.image_processor(images=[self.pipeline_image(i) for i in images], return_tensors="pt"))
            merged = vision["image_grid_thw"].prod(-1) // self.image_processor.merge_size ** 2
            texts = [t.replace(IMAGE_PAD, IMAGE_PAD * int(n), 1) for t, n in zip(texts, merged)]
        inputs = self.tokenizer(texts, padding=True, return_tensors="pt")
        with self.lock:
            out = self.text_encoder(input_ids=inputs.input_ids.to(self.device),
                                    attention_mask=inputs.attention_mask.to(self.device),
                                    pixel_values=vision["pixel_values"].to(self.device, self.compute_dtype) if vision else None,
                                    image_grid_thw=vision["image_grid_thw"].to(self.device) if vision else None,
                                    output_hidden_states=True)
        return out.hidden_states[-1], inputs.attention_mask
