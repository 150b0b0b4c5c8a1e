"""LTX-2 (``LTX2Pipeline``, diffusers 0.42): video with its sound.

Streams, each as ``LTX2Pipeline`` feeds its transformer:

* ``latents``: ``AutoencoderKLLTX2Video`` (128 channels, 32x spatial, 8x temporal: 8n+1 frames) means, normalised
  ``(z - latents_mean) * scaling_factor / latents_std`` per channel (``_normalize_latents``); the adapter packs
  them into tokens (``_pack_latents``).
* ``audio_latents``: the clip's sound (the same window as its frames, :mod:`latentmill.stages.audio`) as a
  16 kHz stereo log-mel spectrogram encoded by ``AutoencoderKLLTX2Audio``: means [C, L, M], normalised with the
  VAE's statistics over the packed (channel, mel bin) features, as ``prepare_audio_latents`` does after
  ``_pack_audio_latents``; ``L`` is the count ``LTX2Pipeline`` generates for the clip's duration
  (:func:`audio_latent_frames`).
* ``frame_rate``: the clip's frames per second (the transformer places video tokens in seconds).
* ``prompt_embeds``, ``audio_prompt_embeds``, ``prompt_attention_mask``: Gemma 3's hidden states of every layer,
  stacked as ``_get_gemma_prompt_embeds`` stacks them (left padding to ``max_sequence_length``), passed through
  the pipeline's ``connectors`` (``LTX2TextConnectors``): the video and audio text embeddings and the mask the
  transformer takes. The connectors are cached, not trained: in Diffusers they are a pipeline component beside
  the transformer, LTX-2 LoRAs hold the transformer's layers only (``LTX2Pipeline.save_lora_weights``), and a
  full fine-tune trains the transformer; their output (two [L, 3840] tensors at LTX-2's size) is also about 12x
  smaller than the 49 stacked Gemma layers they read. The text component's key covers both (``COMPONENTS``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from latentmill.stages.audio import log_mel
from latentmill.stages.encoders import Encoders, Stream

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig

NATIVE_FPS = 24  # LTX-2's frame rate: only for the byte estimate of a bucket's audio (a bucket has no rate)


def audio_latent_frames(duration_s: float, sample_rate: int, hop_length: int, compression: int = 4) -> int:
    """The audio latent frames ``LTX2Pipeline.__call__`` generates for ``duration_s`` seconds (``num_frames /
    frame_rate``): ``round(duration_s * sample_rate / hop_length / compression)``, its own expression."""
    return round(duration_s * (sample_rate / hop_length / float(compression)))


class LTX2Encoders(Encoders):
    """AutoencoderKLLTX2Video + AutoencoderKLLTX2Audio + Gemma 3 with the pipeline's connectors."""

    name = "ltx2"
    PIPELINES = ("LTX2Pipeline",)
    COMPONENTS = ("vae", "audio_vae", "text_encoder", "connectors")
    PIXEL_COMPONENTS = ("vae", "audio_vae")  # the vae member holds the clip's audio latents too
    PIXEL_MULTIPLE = 32  # 32x VAE, 1 x 1 patches
    FRAME_STEP = 8  # 8x temporal VAE: 8k + 1 frames
    # AutoencoderKLLTX2Video's defaults, set on it explicitly so that a Diffusers release with other defaults
    # cannot change the bytes under an unchanged key
    VAE_TEMPORAL_TILE = (16, 8)
    STREAMS = (
        Stream("latents", "vae", "[C, 1 + (F - 1)/8, H/32, W/32]", "(z - latents_mean) * scaling_factor / latents_std"),
        Stream("audio_latents", "vae", "[C_a, round(F / fps * sample_rate / hop / 4), mel_bins/4]",
               "(z - latents_mean) / latents_std over the packed (C_a, mel_bins/4) features", from_audio=True),
        # the clip's frame rate: the transformer's video positions are in seconds (LTX2Pipeline's frame_rate)
        Stream("frame_rate", "vae", "[1]", "frames per second of the clip", from_audio=True),
        Stream("prompt_embeds", "text", "[L, D]", "connectors(Gemma 3 hidden states, all layers).video", pad="keep"),
        Stream("audio_prompt_embeds", "text", "[L, D]", "connectors(Gemma 3 hidden states, all layers).audio",
               pad="keep"),
        Stream("prompt_attention_mask", "text", "[L]", "connectors(...).mask (1: attended)", pad="keep"),
    )
    CLASS_IMPORTS = (("diffusers", "AutoencoderKLLTX2Video"), ("diffusers", "AutoencoderKLLTX2Audio"),
                     ("diffusers.pipelines.ltx2", "LTX2TextConnectors"),
                     ("transformers", "Gemma3ForConditionalGeneration"), ("transformers", "AutoTokenizer"))

    @classmethod
    def describe_vae(cls, vae_config: dict[str, Any]) -> dict[str, Any]:
        # latents_mean / latents_std are weights of this VAE (buffers), covered by its fingerprint
        return {"scaling_factor": float(vae_config.get("scaling_factor", 1.0))}

    @classmethod
    def sample_shapes(cls, config: Callable[[str], dict[str, Any]], bucket: list[int],
                      max_sequence_length: int) -> dict[str, tuple[int, ...]]:
        vae, audio = config("vae"), config("audio_vae")
        spatial = int(vae.get("spatial_compression_ratio") or 32)
        temporal = int(vae.get("temporal_compression_ratio") or 8)
        frames = int(bucket[2]) if len(bucket) > 2 else 1
        audio_frames = audio_latent_frames(frames / NATIVE_FPS, int(audio.get("sample_rate", 16000)),
                                           int(audio.get("mel_hop_length", 160)))
        width = int(config("connectors").get("caption_channels", 3840))
        return {"latents": (int(vae.get("latent_channels", 128)), (frames - 1) // temporal + 1,
                            int(bucket[1]) // spatial, int(bucket[0]) // spatial),
                "audio_latents": (int(audio.get("latent_channels", 8)), audio_frames, int(audio.get("mel_bins", 64)) // 4),
                "frame_rate": (1,), "prompt_embeds": (max_sequence_length, width), "audio_prompt_embeds": (max_sequence_length, width),
                "prompt_attention_mask": (max_sequence_length,)}

    def __init__(self, model: ModelConfig, device: torch.device):
        super().__init__(model, device)
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
        from diffusers.pipelines.ltx2 import LTX2TextConnectors
        from transformers import Gemma3ForConditionalGeneration

        self.vae = self._load(AutoencoderKLLTX2Video, "vae", self.compute_dtypes(device)["vae"])
        self.audio_vae = self._load(AutoencoderKLLTX2Audio, "audio_vae", torch.float32)  # (a small model)
        self.text_encoder = self._load(Gemma3ForConditionalGeneration, "text_encoder")
        self.connectors = self._load(LTX2TextConnectors, "connectors")
        self.tokenizer = self._tokenizer("text_encoder")
        self.tokenizer.padding_side = "left"  # as _get_gemma_prompt_embeds sets it
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.latents_mean = self.vae.latents_mean.detach().float().cpu().view(1, -1, 1, 1, 1)
        self.latents_std = self.vae.latents_std.detach().float().cpu().view(1, -1, 1, 1, 1)
        self.scaling_factor = float(self.vae.config.scaling_factor)
        cfg = self.audio_vae.config
        self.audio_sample_rate = int(cfg.sample_rate)
        latent_bins = int(cfg.mel_bins) // self.audio_vae.mel_compression_ratio
        # the packed features are (channel, mel bin), channel-major: LTX2Pipeline._pack_audio_latents
        self.audio_mean = self.audio_vae.latents_mean.detach().float().cpu().view(1, -1, 1, latent_bins)
        self.audio_std = self.audio_vae.latents_std.detach().float().cpu().view(1, -1, 1, latent_bins)

    @torch.no_grad()
    def encode_pixels(self, pixels_BCFHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) [B, 128, F', H/32, W/32] of the normalised latent distribution of clips in [-1, 1], one clip
        on the device at a time (as the Wan family: each clip's latents are those of encoding it alone); a clip
        longer than one temporal tile in the VAE's tiles under ``vae_tiling`` (:meth:`tiles_clip`), so the VAE's
        activations stay those of one tile however long the clip."""
        means, stds = [], []
        tiled = self.tiles_clip(pixels_BCFHW.shape[2], self.vae_tiling)
        for clip_1CFHW in pixels_BCFHW.split(1):
            with self.lock:
                # (sic) Diffusers 0.42 gates AutoencoderKLLTX2Video's temporal encode tiles on its decoding flag
                self.vae.use_framewise_decoding = tiled
                self.vae.tile_sample_min_num_frames, self.vae.tile_sample_stride_num_frames = self.VAE_TEMPORAL_TILE
                dist = self.vae.encode(clip_1CFHW.to(self.device, self.vae.dtype)).latent_dist
            means.append(dist.mean.float().cpu())
            stds.append(dist.std.float().cpu())
            del dist
        scale = self.scaling_factor / self.latents_std
        return (torch.cat(means) - self.latents_mean) * scale, torch.cat(stds) * scale

    @torch.no_grad()
    def encode_audio(self, waveforms_BCN: torch.Tensor, frame_rates_B: torch.Tensor) -> dict[str, torch.Tensor]:
        """``audio_latents`` [B, C_a, L, M/4]: the normalised audio-VAE means of ``[B, 2, N]`` waveforms at
        ``audio_sample_rate`` (the log-mel spectrogram of :func:`latentmill.stages.audio.log_mel`), ``L`` the
        pipeline's count for ``N / audio_sample_rate`` seconds; and each clip's ``frame_rate`` [B, 1]."""
        cfg, ratio = self.audio_vae.config, self.audio_vae.temporal_compression_ratio
        frames = audio_latent_frames(waveforms_BCN.shape[-1] / self.audio_sample_rate, self.audio_sample_rate,
                                     int(cfg.mel_hop_length), ratio)
        mel_BCTM = log_mel(waveforms_BCN, self.audio_sample_rate, int(cfg.mel_hop_length), int(cfg.mel_bins))
        # the causal VAE makes 1 + (T - 1) / 4 latents of T mel frames (and its decoder gives L latents back as
        # 4 (L - 1) + 1), so these mel frames encode to the pipeline's L; the window's own 1 + N / hop give one
        # more latent for 9 frames at 24 fps
        mel_BCTM = mel_BCTM[:, :, : ratio * (frames - 1) + 1]
        with self.lock:
            mean = self.audio_vae.encode(mel_BCTM.to(self.device, torch.float32)).latent_dist.mean.float().cpu()
        return {"audio_latents": (mean - self.audio_mean) / self.audio_std,
                "frame_rate": frame_rates_B.float().view(-1, 1)}

    @torch.no_grad()
    def encode_text(self, captions: list[str], max_sequence_length: int) -> dict[str, Any]:
        """``prompt_embeds`` / ``audio_prompt_embeds`` [B, L, D] and ``prompt_attention_mask`` [B, L] at
        ``L = max_sequence_length``: ``LTX2Pipeline.encode_prompt`` then its ``connectors`` call."""
        for connector in (self.connectors.video_connector, self.connectors.audio_connector):
            registers = connector.num_learnable_registers
            if registers and max_sequence_length % registers:
                raise ConfigError(f"cache.max_sequence_length: {max_sequence_length} is not a multiple of the "
                                  f"connectors' {registers} learnable registers (LTX2TextConnectors); use "
                                  f"{-(-max_sequence_length // registers) * registers}")
        inputs = self.tokenizer([c.strip() for c in captions], padding="max_length", max_length=max_sequence_length,
                                truncation=True, add_special_tokens=True, return_tensors="pt")
        mask = inputs.attention_mask.to(self.device)
        with self.lock:
            hidden = self.text_encoder(input_ids=inputs.input_ids.to(self.device), attention_mask=mask,
                                       output_hidden_states=True).hidden_states
            stacked = torch.stack(hidden, dim=-1).flatten(2, 3).to(self.compute_dtype)
            video, audio, out_mask = self.connectors(stacked, mask, padding_side="left")
        return {"prompt_embeds": video.float().cpu(), "audio_prompt_embeds": audio.float().cpu(),
                "prompt_attention_mask": out_mask.float().cpu(), "lengths": [max_sequence_length] * len(captions)}
