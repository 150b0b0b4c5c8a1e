"""The baselines' own code: a bare Flux training step and bare encoder calls, written against Diffusers and
Transformers directly (nothing from ``trainer/`` or ``stages/``), the way a minimal script would.

Shape legend: B batch, C latent channels, H/W latent height/width, L text tokens, D text width.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def load_transformer(pretrained: Path, device: str = "cpu"):
    """``FluxTransformer2DModel.from_pretrained(pretrained, subfolder="transformer")`` in float32, training."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(pretrained, subfolder="transformer")
    return model.requires_grad_(True).to(device).train()


class BareStep:
    """One flow-matching step: logit-normal sigma, x_t = (1-σ)x0 + σε, MSE to ε - x0, AdamW, clip 1.0.

    On CUDA the forward runs under bf16 autocast, as the trainer's does."""

    def __init__(self, model, lr: float = 1e-4, seed: int = 0, guidance: float = 3.5):
        from contextlib import nullcontext

        self.model = model
        device = next(model.parameters()).device
        self.device = device
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr)
        self.gen = torch.Generator().manual_seed(seed)
        self.guidance = guidance if model.config.guidance_embeds else None
        self._ids: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _position_ids(self, H: int, W: int, L: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (H, W, L)
        if key not in self._ids:
            img = torch.zeros(H // 2, W // 2, 3)
            img[..., 1] = torch.arange(H // 2)[:, None]
            img[..., 2] = torch.arange(W // 2)[None, :]
            self._ids[key] = (img.reshape(-1, 3).to(device), torch.zeros(L, 3, device=device))
        return self._ids[key]

    def __call__(self, latents_BCHW: torch.Tensor, embeds_BLD: torch.Tensor, pooled_BD: torch.Tensor) -> float:
        device = self.device
        latents_BCHW, embeds_BLD, pooled_BD = (t.to(device) for t in (latents_BCHW, embeds_BLD, pooled_BD))
        B, C, H, W = latents_BCHW.shape
        sigma = torch.sigmoid(torch.randn(B, generator=self.gen)).to(device)
        noise = torch.randn(latents_BCHW.shape, generator=self.gen).to(device)
        s = sigma.view(B, 1, 1, 1)
        noisy = (1 - s) * latents_BCHW + s * noise
        tokens = noisy.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * 4)
        img_ids, txt_ids = self._position_ids(H, W, embeds_BLD.shape[1], device)
        guidance = torch.full((B,), self.guidance, device=device) if self.guidance is not None else None
        with self.autocast:
            out = self.model(hidden_states=tokens, encoder_hidden_states=embeds_BLD, pooled_projections=pooled_BD,
                             timestep=sigma, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                             return_dict=False)[0]
        pred = out.view(B, H // 2, W // 2, C, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)
        loss = F.mse_loss(pred.float(), noise - latents_BCHW)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


class BareEncoders:
    """VAE + CLIP + T5 of a Flux pipeline folder, called as FluxPipeline does (no masks, pooled CLIP).

    float32 on the CPU, bf16 weights on CUDA (as the cache stage runs them)."""

    def __init__(self, pretrained: Path, device: str = "cpu"):
        from diffusers import AutoencoderKL
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        self.device = device
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        kw = {"torch_dtype": self.dtype} if device == "cuda" else {}
        self.vae = AutoencoderKL.from_pretrained(pretrained, subfolder="vae", **kw).to(device).eval()
        self.clip = CLIPTextModel.from_pretrained(pretrained, subfolder="text_encoder", **kw).to(device).eval()
        self.t5 = T5EncoderModel.from_pretrained(pretrained, subfolder="text_encoder_2", **kw).to(device).eval()
        self.tok = AutoTokenizer.from_pretrained(pretrained, subfolder="tokenizer")
        self.tok2 = AutoTokenizer.from_pretrained(pretrained, subfolder="tokenizer_2")
        self.scale = float(self.vae.config.scaling_factor)
        self.shift = float(self.vae.config.shift_factor or 0.0)

    @staticmethod
    def pixels(data: bytes, crop: dict[str, int], width: int, height: int) -> torch.Tensor:
        """Decode, resize (Lanczos) and crop one image: [3, H, W] in [-1, 1]."""
        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            img = img.convert("RGB").resize((crop["resize_width"], crop["resize_height"]), Image.Resampling.LANCZOS)
            img = img.crop((crop["left"], crop["top"], crop["left"] + width, crop["top"] + height))
            arr = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(height, width, 3)
        return arr.permute(2, 0, 1).float().div(127.5).sub(1.0)

    @torch.no_grad()
    def latents(self, pixels_BCHW: torch.Tensor, sample: bool = False) -> torch.Tensor:
        dist = self.vae.encode(pixels_BCHW.to(self.device, self.dtype)).latent_dist
        z = dist.sample() if sample else dist.mean
        return (z.float() - self.shift) * self.scale

    @torch.no_grad()
    def text(self, captions: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.tok(captions, padding="max_length", max_length=self.tok.model_max_length, truncation=True,
                       return_tensors="pt").input_ids
        ids2 = self.tok2(captions, padding="max_length", max_length=max_sequence_length, truncation=True,
                         return_tensors="pt").input_ids
        pooled_BD = self.clip(ids.to(self.device), output_hidden_states=False).pooler_output
        embeds_BLD = self.t5(ids2.to(self.device), output_hidden_states=False)[0]
        return embeds_BLD.float(), pooled_BD.float()


def read_tar_samples(path: Path) -> list[dict[str, Any]]:
    """The samples of a webdataset tar as ``{"__key__", ext: bytes}`` dicts, with the standard library only."""
    import tarfile

    samples: dict[str, dict[str, Any]] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, ext = member.name.partition(".")
            samples.setdefault(key, {"__key__": key})[ext] = tar.extractfile(member).read()
    return list(samples.values())
