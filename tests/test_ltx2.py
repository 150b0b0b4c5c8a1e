"""LTX-2 (family ``ltx2``): the clip's sound at ingest (PyAV, resampled, cut to the clip's window, log-mel), the tiny
model set, and caching equal to ``LTX2Pipeline``'s own encode path (video latents, audio latents, text)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from latentmill.stages.audio import clip_sounds, clip_span, log_mel, read_audio, slaney_mel_filters
from latentmill.stages.families import FAMILIES, LTX2Encoders

from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig
from latentmill.tiny_ltx2 import DEFAULT_RECIPE_PATH, load_recipe
from tests.conftest import REPO_ROOT
from tests.helpers import assert_recipe_refused
from tests.trainer_helpers import torch_threads

AUDIO_DEMO = REPO_ROOT / "data" / "demo" / "videos-audio"
TONES = {"low_tone": 220.0, "mid_tone": 660.0, "high_tone": 1760.0}


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def peak_hz(wave: torch.Tensor, rate: int) -> float:
    """The strongest frequency of a mono waveform."""
    spectrum = np.abs(np.fft.rfft(wave.numpy()))
    return float(np.fft.rfftfreq(len(wave), 1 / rate)[spectrum.argmax()])


def test_family_is_registered_with_its_streams():
    assert FAMILIES["ltx2"] is LTX2Encoders
    names = [s.name for s in LTX2Encoders.STREAMS]
    assert names == ["latents", "audio_latents", "frame_rate", "prompt_embeds", "audio_prompt_embeds",
                     "prompt_attention_mask"]
    assert LTX2Encoders.needs_audio() and not FAMILIES["wan"].needs_audio()
    assert [s.name for s in LTX2Encoders.STREAMS if s.from_audio] == ["audio_latents", "frame_rate"]
    configs = {"vae": {"latent_channels": 128}, "audio_vae": {"latent_channels": 8, "mel_bins": 64},
               "connectors": {"caption_channels": 3840}}
    shapes = LTX2Encoders.sample_shapes(lambda name: configs.get(name, {}), [768, 512, 121], 1024)
    # 121 frames at 24 fps: 5.04 s, the pipeline's round(25 * 5.04) = 126 audio latent frames
    assert shapes == {"latents": (128, 16, 16, 24), "audio_latents": (8, 126, 16), "frame_rate": (1,),
                      "prompt_embeds": (1024, 3840),
                      "audio_prompt_embeds": (1024, 3840), "prompt_attention_mask": (1024,)}


def test_bucket_sizes_clip_lengths_and_one_rate_are_checked_before_work():
    from latentmill.stages.bucket import BucketConfig

    from latentmill.preflight import check_bucket

    check_bucket("ltx2", BucketConfig(step=32, frame_counts=[1, 9, 17, 121], max_frames=121, exact_fps=True,
                                      target_fps=24))
    check_bucket("wan", BucketConfig(step=16, frame_counts=[5, 9]))  # a family without sound: no rate rule
    with pytest.raises(ConfigError, match=r"bucket.step: 16 px, but ltx2 needs sizes in multiples of 32 px"):
        check_bucket("ltx2", BucketConfig(step=16, frame_step=8, exact_fps=True))
    with pytest.raises(ConfigError, match=r"bucket.frame_counts: clips of \[5, 13\] frames, but ltx2 takes clips of "
                                          r"8k\+1 frames .*set bucket.frame_step: 8"):
        check_bucket("ltx2", BucketConfig(step=32, frame_counts=[5, 9, 13, 17], exact_fps=True))
    with pytest.raises(ConfigError, match=r"bucket.exact_fps: false, but a ltx2 batch stacks its clips' sound"):
        check_bucket("ltx2", BucketConfig(step=32, frame_step=8))


def test_recipe_rules_name_the_key(tmp_path):
    assert_recipe_refused(tmp_path, load_recipe, DEFAULT_RECIPE_PATH,
                          lambda data: data["components"]["audio_vae"].update(base_channels=8),
                          r"components.audio_vae.base_channels: 8 != latent_channels x mel_bins / 4 \(32\)")
    assert_recipe_refused(tmp_path, load_recipe, DEFAULT_RECIPE_PATH,
                          lambda data: data["components"]["audio_vae"].pop("latents_std"),
                          r"components.audio_vae.latents_std: 0 values, expected base_channels \(32\): the VAE's own "
                          r"statistics")
    assert_recipe_refused(tmp_path, load_recipe, DEFAULT_RECIPE_PATH,
                          lambda data: data["components"]["connectors"].update(text_proj_in_factor=2),
                          r"connectors.text_proj_in_factor: 2 != text_encoder.text_config.num_hidden_layers \+ 1 "
                          r"\(3\)")
    assert_recipe_refused(tmp_path, load_recipe, DEFAULT_RECIPE_PATH,  # 64 wide, the width that could not learn
                          lambda data: data["components"]["transformer"].update(num_attention_heads=4),
                          r"transformer.num_attention_heads x attention_head_dim: 64 < in_channels \(128\)")


def test_log_mel_puts_a_tone_in_its_mel_bin():
    rate, hop, bins = 16000, 160, 64
    filters = slaney_mel_filters(rate, 1024, bins)
    assert filters.shape == (bins, 513) and (filters >= 0).all() and (filters.sum(1) > 0).all()
    centres = (filters * torch.linspace(0, rate / 2, 513)).sum(1) / filters.sum(1)
    assert (centres.diff() > 0).all()  # filters ordered by frequency
    n = 8000
    t = torch.arange(n) / rate
    waves = torch.stack([torch.sin(2 * math.pi * f * t) for f in (220.0, 1760.0)])[:, None].expand(2, 2, n)
    mel = log_mel(waves.contiguous(), rate, hop, bins)
    assert mel.shape == (2, 2, 1 + n // hop, bins)
    for k, f in enumerate((220.0, 1760.0)):
        peak = int(mel[k, 0, 10:-10].mean(0).argmax())
        assert abs(float(centres[peak]) - f) < 0.1 * f + 40  # the bin whose filter is centred near the tone
    silence = log_mel(torch.zeros(1, 2, n), rate, hop, bins)
    assert torch.equal(silence, torch.full_like(silence, math.log(1e-5)))  # what the VAE sees for no sound


def test_read_audio_cuts_the_window_and_resamples():
    # 48 kHz stereo, 44.1 kHz mono and 22.05 kHz stereo sources, all read as 16 kHz stereo
    for name, tone in TONES.items():
        (head, later), track = read_audio(AUDIO_DEMO / f"{name}.mp4", [(0.0, 0.5), (0.5, 0.75)], 16000)
        assert track and head.shape == (2, 8000) and later.shape == (2, 12000) and head.dtype == torch.float32
        # a mono source is duplicated to both channels; a stereo one's channels hold the same tone (AAC's joint
        # stereo rounds them apart)
        torch.testing.assert_close(head[0], head[1], rtol=0, atol=0 if name == "high_tone" else 0.01)
        assert abs(peak_hz(later[0], 16000) - tone) <= 2.0  # the pitch survives AAC and resampling
        assert 0.05 < float(later.abs().max()) < 0.15  # a tenth of full scale
    (past,), _ = read_audio(AUDIO_DEMO / "low_tone.mp4", [(1.25, 0.5)], 16000)  # the track ends at 33/24 s
    assert float(past[:, :1000].abs().max()) > 0.05 and torch.equal(past[:, 3000:], torch.zeros(2, 5000))
    (silent,), track = read_audio(AUDIO_DEMO / "silent.mp4", [(0.0, 0.5)], 16000)
    assert not track and torch.equal(silent, torch.zeros(2, 8000))


def test_clip_sounds_follow_the_clip_window():
    meta = {"kind": "video", "source_uri": str(AUDIO_DEMO / "mid_tone.mp4"), "fps": 24.0,
            "clip": {"frame_indices": list(range(12, 29)), "num_frames": 17, "fps": 24.0}}
    assert clip_span(meta) == (0.5, 17 / 24)
    image = {"kind": "image"}
    sounds = clip_sounds({0: meta, 1: image, 2: {**meta, "source_uri": str(AUDIO_DEMO / "missing.mp4")}}, 16000)
    wave, track = sounds[0]
    (direct,), _ = read_audio(AUDIO_DEMO / "mid_tone.mp4", [(0.5, 17 / 24)], 16000)
    assert track and torch.equal(wave, direct) and wave.shape == (2, round(17 / 24 * 16000))
    assert isinstance(sounds[1], ValueError) and "an image has no sound" in str(sounds[1])
    assert isinstance(sounds[2], Exception)


@pytest.fixture(scope="module")
def pipe(tiny_ltx2):
    from diffusers import LTX2Pipeline

    return LTX2Pipeline.from_pretrained(tiny_ltx2)


@pytest.fixture(scope="module")
def encoders(tiny_ltx2):
    return LTX2Encoders(ModelConfig(pretrained=str(tiny_ltx2), family="ltx2"), torch.device("cpu"))


def test_scaling_factor_is_the_vaes_own(pipe, encoders):
    """The recipe's vae.scaling_factor is 1 / the std of this VAE's (seed 0) latents, so cached latents are about
    unit variance: at 1.0 (the VAE's latents_mean / latents_std buffers are 0 / 1) a clip's detail lay under the
    training noise (tests/test_learns_ltx2.py)."""
    from latentmill.tiny_hunyuan_video15 import measure_scaling_factor

    assert pipe.vae.config.scaling_factor == pytest.approx(measure_scaling_factor(pipe.vae, size=64, frames=9),
                                                           rel=2e-3)
    assert torch.equal(pipe.vae.latents_mean, torch.zeros(128)) and torch.equal(pipe.vae.latents_std, torch.ones(128))
    from latentmill.tiny_wan import synthetic_clips

    clips = synthetic_clips(torch.Generator().manual_seed(1), 4, size=64, frames=9)  # other clips than measured
    mean, _ = encoders.encode_pixels(clips)
    assert 0.7 < float(mean.std()) < 1.3


def test_cached_streams_equal_the_pipelines_encode_path(pipe, encoders):
    gen = torch.Generator().manual_seed(0)
    clips = torch.rand(2, 3, 17, 64, 96, generator=gen) * 2 - 1
    mean, std = encoders.encode_pixels(clips)
    with torch.no_grad():
        dist = pipe.vae.encode(clips).latent_dist
    expected = pipe._normalize_latents(dist.mean, pipe.vae.latents_mean, pipe.vae.latents_std,
                                       pipe.vae.config.scaling_factor)
    assert mean.shape == (2, 128, 3, 2, 3)
    torch.testing.assert_close(mean, expected, rtol=1e-5, atol=1e-5)
    # the posterior's std in the normalised space: scaled like the mean (at scaling_factor 1.0 this could not show)
    scale = pipe.vae.config.scaling_factor / pipe.vae.latents_std.view(1, -1, 1, 1, 1)
    torch.testing.assert_close(std, dist.std * scale, rtol=1e-5, atol=1e-5)

    # audio: the pipeline's path for given audio latents packs, then normalises (prepare_audio_latents, no noise),
    # with the VAE's own statistics (not 0 / 1: test_audio_statistics_are_the_vaes_own)
    assert not torch.equal(pipe.audio_vae.latents_std, torch.ones(32))
    waves = torch.rand(2, 2, 11333, generator=gen) * 0.2 - 0.1
    encoded = encoders.encode_audio(waves, torch.tensor([24.0, 12.0]))
    audio = encoded["audio_latents"]
    assert torch.equal(encoded["frame_rate"], torch.tensor([[24.0], [12.0]]))
    with torch.no_grad():
        raw = pipe.audio_vae.encode(log_mel(waves, 16000, 160, 64)).latent_dist.mean
    packed = pipe.prepare_audio_latents(2, latents=raw, noise_scale=0.0, dtype=torch.float32)
    assert audio.shape == (2, 2, 18, 16)  # 17 frames at 24 fps: the pipeline's round(25 * 17 / 24) latent frames
    torch.testing.assert_close(pipe._pack_audio_latents(audio), packed, rtol=1e-5, atol=1e-5)

    captions = ["a red square moving right on blue, with a low hum", "a white square crossing black, in silence"]
    text = encoders.encode_text(captions, 64)
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=64,
                                                device=torch.device("cpu"))
        video, audio_text, out_mask = pipe.connectors(embeds, mask, padding_side="left")
    assert text["prompt_embeds"].shape == (2, 64, 32) and text["lengths"] == [64, 64]
    assert int(mask[0].sum()) < 64  # left padding on the real captions ...
    assert torch.equal(text["prompt_attention_mask"], out_mask.float())  # ... which the registers fill
    torch.testing.assert_close(text["prompt_embeds"], video, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(text["audio_prompt_embeds"], audio_text, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="cache.max_sequence_length: 40 is not a multiple of the connectors' 16 "
                                          "learnable registers"):
        encoders.encode_text(captions, 40)


@pytest.mark.parametrize("frames", [9, 17, 25])
def test_cached_audio_is_as_long_as_the_pipelines(pipe, encoders, frames):
    """A clip's audio latents have as many frames as LTX2Pipeline generates beside its video (24 fps): the mel
    frames of its window, 1 + N / 160, gave one more at 9 and 25 frames (10 and 27 for the pipeline's 9 and 26);
    the causal VAE's first latents are the same either way."""
    seconds = frames / 24
    waves = torch.rand(1, 2, round(seconds * 16000), generator=torch.Generator().manual_seed(frames)) * 0.2 - 0.1
    audio = encoders.encode_audio(waves, torch.tensor([24.0]))["audio_latents"]
    _, generated = pipe("a tone", height=32, width=32, num_frames=frames, frame_rate=24.0, num_inference_steps=2,
                        guidance_scale=1.0, max_sequence_length=64, output_type="latent", return_dict=False)
    assert audio.shape[2] == generated.shape[2] == {9: 9, 17: 18, 25: 26}[frames]
    with torch.no_grad():
        raw = pipe.audio_vae.encode(log_mel(waves, 16000, 160, 64)).latent_dist.mean
    assert raw.shape[2] == {9: 10, 17: 18, 25: 27}[frames]  # the whole window's mel frames
    expected = pipe.prepare_audio_latents(1, latents=raw[:, :, : audio.shape[2]], noise_scale=0.0, dtype=torch.float32)
    torch.testing.assert_close(pipe._pack_audio_latents(audio), expected, rtol=1e-5, atol=1e-5)


def test_audio_statistics_are_the_vaes_own(pipe, encoders):
    """The audio VAE's latents_mean / latents_std buffers are the recipe's, which are this VAE's (seed 0) own
    statistics, so cached audio latents are about unit variance, as the pipeline's normalisation makes the real
    VAE's: at the buffers' defaults 0 / 1 they had std 0.15 under unit training noise."""
    from latentmill.tiny_ltx2 import measure_audio_statistics, synthetic_sounds

    recipe = load_recipe()["components"]["audio_vae"]
    assert pipe.audio_vae.latents_mean.tolist() == pytest.approx(recipe["latents_mean"], abs=1e-7)
    assert pipe.audio_vae.latents_std.tolist() == pytest.approx(recipe["latents_std"], abs=1e-7)
    mean, std = measure_audio_statistics(pipe.audio_vae)
    assert mean == pytest.approx(recipe["latents_mean"], abs=6e-5) and std == pytest.approx(recipe["latents_std"],
                                                                                             abs=6e-5)
    sounds = synthetic_sounds(torch.Generator().manual_seed(1), 8)  # other sounds than measured
    audio = encoders.encode_audio(sounds, torch.full((8,), 24.0))["audio_latents"]
    assert audio.shape == (8, 2, 25, 16) and abs(float(audio.mean())) < 0.2 and 0.7 < float(audio.std()) < 1.3
    with torch.no_grad():
        raw = pipe.audio_vae.encode(log_mel(sounds, 16000, 160, 64)).latent_dist.mean
    assert float(raw.std()) < 0.25  # what the cache held before


def test_audio_rule_keys_the_cached_latents(tiny_ltx2, monkeypatch):
    """A change to how a clip's sound is encoded (its declared rule) re-encodes its vae member, not its text."""
    import dataclasses

    from latentmill.stages.cache import CachePlan
    from latentmill.stages.cache_config import CacheConfig

    model = ModelConfig(pretrained=str(tiny_ltx2), family="ltx2")
    before = CachePlan.of(CacheConfig(), model)
    streams = tuple(dataclasses.replace(s, shape=s.shape + " (changed)") if s.from_audio else s
                    for s in LTX2Encoders.STREAMS)
    monkeypatch.setattr(LTX2Encoders, "STREAMS", streams)
    after = CachePlan.of(CacheConfig(), model)
    assert after.vae_fp != before.vae_fp and after.text_fp == before.text_fp


def test_prep_caches_each_clips_sound_beside_its_latents(ltx2_prep, encoders):
    """The demo set with sound through prep: every clip has its audio latents; the video without a track gets the
    encoded silence; counts conserve."""
    from latentmill.stages.tarshard import read_shard
    from safetensors.torch import load

    out = ltx2_prep
    stages = json.loads((out / "summary.json").read_text())["stages"]
    assert (stages["bucket"]["in"], stages["bucket"]["out"]) == (4, 8)  # two 17-frame clips per video
    assert (stages["cache"]["in"], stages["cache"]["out"], stages["cache"]["quarantined"]) == (8, 8, 0)
    samples = [s for path in sorted((out / "prep" / "cache").rglob("*.tar")) for s in read_shard(str(path))]
    silent = encoders.encode_audio(torch.zeros(1, 2, round(17 / 24 * 16000)), torch.tensor([24.0]))["audio_latents"][0]
    by_source = {}
    for sample in samples:
        meta = json.loads(sample["json"])
        vae = load(sample["vae.safetensors"])
        assert vae["latents"].shape == (128, 3, 2, 2) and vae["audio_latents"].shape == (2, 18, 16)
        assert torch.equal(vae["frame_rate"], torch.tensor([24.0])) and meta["clip"]["fps"] == 24.0
        by_source.setdefault(meta["source"], []).append(vae["audio_latents"])
    assert sorted(by_source) == ["high_tone.mp4", "low_tone.mp4", "mid_tone.mp4", "silent.mp4"]
    for audio in by_source["silent.mp4"]:  # (the statistics' 1 / std, up to 16, scale float rounding)
        torch.testing.assert_close(audio, silent, rtol=0, atol=2e-5)
    for source in ("low_tone.mp4", "mid_tone.mp4", "high_tone.mp4"):
        assert (by_source[source][0] - silent).abs().max() > 0.1  # a sound track is not silence
    assert (by_source["low_tone.mp4"][0] - by_source["high_tone.mp4"][0]).abs().max() > 0.1  # pitch is in it
    records = [json.loads(p.read_text()) for p in (out / "prep" / "cache").rglob("*.json")]
    audio_counts = [r["extra"]["audio"] for r in records if "audio" in r.get("extra", {})]
    assert sum(c["silent"] for c in audio_counts) == 2 and sum(c["with_track"] for c in audio_counts) == 6


def test_recipes_train_video_with_sound():
    from latentmill.stages.bucket import bucket_sizes

    from latentmill.recipe import load_recipe

    configs = REPO_ROOT / "configs"
    for name, mode in (("ltx2-lora.yaml", "lora"), ("ltx2-full.yaml", "full")):
        recipe = load_recipe(configs / name)
        assert (recipe.model.pretrained, recipe.model.family) == ("Lightricks/LTX-2", "ltx2")
        assert (recipe.trainer.mode, recipe.parallel.strategy, recipe.trainer.audio_loss_weight) == (mode, "fsdp2", 1.0)
        assert (recipe.bucket.frame_step, recipe.bucket.max_frames, recipe.bucket.target_fps) == (8, 121, 24.0)
        assert recipe.cache.max_sequence_length % 128 == 0  # the connectors' registers
        assert (recipe.trainer.shift_mode, recipe.trainer.base_shift, recipe.trainer.max_shift) == ("resolution", 0.95,
                                                                                                    2.05)
        sizes = bucket_sizes(recipe.bucket)
        assert sizes[1.5] == (768, 512) and all(w % 32 == 0 and h % 32 == 0 for w, h in sizes.values())
    demo = load_recipe(configs / "demo-ltx2.yaml")
    assert demo.model.family == "ltx2" and demo.model.tiny_recipe.endswith("data/tiny-ltx2.yaml")
    assert demo.bucket.step == 32 and demo.bucket.frame_counts == [9, 17] and demo.cache.max_sequence_length == 64
    assert (demo.trainer.shift_mode, demo.trainer.base_shift, demo.trainer.max_shift, demo.trainer.base_image_seq_len,
            demo.trainer.max_image_seq_len) == ("resolution", 0.95, 2.05, 1024, 4096)  # LTX-2's own, as the recipes'


@pytest.mark.slow
@pytest.mark.heavy  # 100 s on 2 busy cores (48 blocks on meta, two plans); plan's path is tested on every family
def test_plan_counts_the_published_19b():
    from diffusers import LTX2VideoTransformer3DModel as cls

    from latentmill.plan import plan_config, shipped_models_dir

    with torch.device("meta"):
        model = cls.from_config(cls.load_config(str(shipped_models_dir() / "LTX-2"), subfolder="transformer"))
    total = sum(p.numel() for p in model.parameters())
    assert total == 18_876_174_592 and len(model.transformer_blocks) == 48  # "19B"
    full = plan_config(str(REPO_ROOT / "configs" / "ltx2-full.yaml"), nproc=8)
    assert full["total_params"] == full["trainable_params"] == total and full["config"]["shipped_configs"]
    assert full["per_rank"]["optimizer_bytes"] == 2 * full["per_rank"]["params_bytes"]
    lora = plan_config(str(REPO_ROOT / "configs" / "ltx2-lora.yaml"), nproc=8)
    # rank 32 on every to_q/k/v/out.0 of the video, audio and audio-video attentions
    targets = [m for name, m in model.named_modules() if name.endswith(("to_q", "to_k", "to_v", "to_out.0"))]
    assert lora["trainable_params"] == sum(32 * (m.in_features + m.out_features) for m in targets) == 213_909_504
    assert lora["total_params"] == total + lora["trainable_params"]


def test_audio_demo_videos_match_their_recipe(tmp_path):
    """The committed videos with sound have the frames, rates and tracks ``make_demo_videos.py --audio`` asks for;
    regenerating gives files with the same facts (the bytes depend on the FFmpeg build, so they are not compared)."""
    import importlib.util

    import av
    from latentmill.stages.video import probe_video

    spec = importlib.util.spec_from_file_location("make_demo_videos", REPO_ROOT / "data" / "make_demo_videos.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    make.generate_audio(tmp_path)
    for name, (frames, *_colours, tone, rate, channels, caption) in make.AUDIO_VIDEOS.items():
        for folder in (AUDIO_DEMO, tmp_path):
            path = folder / f"{name}.mp4"
            assert probe_video(str(path)) == {"width": 64, "height": 64, "frames": frames, "fps": 24.0,
                                              "duration": round(frames / 24, 6), "codec": "h264"}
            with av.open(str(path)) as container:
                tracks = [(s.codec_context.name, s.rate, s.channels) for s in container.streams.audio]
            assert tracks == ([] if tone is None else [("aac", rate, channels)])
            assert (folder / f"{name}.txt").read_text() == caption + "\n"
    assert sum(p.stat().st_size for p in AUDIO_DEMO.iterdir()) < 100_000


def test_tiny_set_is_a_pure_function_of_its_seed(tiny_ltx2, tmp_path):
    """Rebuilt with the same seed, the tiny LTX-2 set has the same weight and tokenizer bytes; it loads as an
    LTX2Pipeline whose tokenizer adds Gemma's <bos>, and is registered for recipes' model.tiny_recipe."""
    import hashlib

    from latentmill.tiny_ltx2 import build_tiny_ltx2
    from latentmill.tinyio import TINY_BUILDERS

    def digests(folder):
        return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*")) if p.suffix in (".safetensors", ".json") and p.is_file()}

    again = build_tiny_ltx2(tmp_path / "again", seed=0)
    assert digests(again) == digests(tiny_ltx2) and "transformer/diffusion_pytorch_model.safetensors" in digests(again)
    assert TINY_BUILDERS["ltx2"] == "latentmill.tiny_ltx2:ensure_tiny_ltx2"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_ltx2 / "tokenizer")
    ids = tokenizer("a red ball").input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<bos>") == 2 and len(tokenizer) == 320


@pytest.mark.slow
def test_long_clips_are_encoded_in_the_vaes_own_temporal_tiles(pipe, encoders):
    """cache.vae_tiling: auto leaves a clip of one tile (17 frames) byte for byte as the whole-clip encode; a
    longer clip is the VAE's own tiled encode (use_framewise_decoding): the whole clip's latents up to float
    rounding where a tile lacks no context, different where it does."""
    from latentmill.tiny_wan import synthetic_clips

    gen = torch.Generator().manual_seed(3)
    short = torch.rand(1, 3, 17, 64, 64, generator=gen) * 2 - 1
    noise = torch.rand(1, 3, 33, 64, 64, generator=gen) * 2 - 1  # every frame unrelated to the one before
    still = synthetic_clips(gen, 1, size=64, frames=33)
    assert encoders.vae_tiling == "auto" and not LTX2Encoders.tiles_clip(17, "auto")
    assert LTX2Encoders.tiles_clip(25, "auto") and not LTX2Encoders.tiles_clip(25, "never")
    assert not any(FAMILIES[f].tiles_clip(129, "auto") for f in ("wan", "wan2.2-ti2v", "hunyuanvideo1.5"))
    tiled = [encoders.encode_pixels(clip) for clip in (short, noise, still)]
    try:
        encoders.vae_tiling = "never"
        whole = [encoders.encode_pixels(clip) for clip in (short, noise, still)]
    finally:
        encoders.vae_tiling = "auto"
    assert torch.equal(tiled[0][0], whole[0][0]) and torch.equal(tiled[0][1], whole[0][1])
    assert tiled[1][0].shape == whole[1][0].shape == (1, 128, 5, 2, 2)
    # The tiles start at frames 0, 8, 16, 24; the blend (one latent frame wide) keeps each tile's last latent
    # frame, so latent frame 3 comes from the tile of frames 8-24 and 4 from that of 16-32. A tile's causal
    # encoder pads before its first frame with copies of it: a still clip loses nothing (equal up to float
    # rounding), a clip whose frames are unrelated loses all context (as different as two latents).
    diff = (tiled[1][0] - whole[1][0]).abs().amax(dim=(0, 1, 3, 4))
    assert float(diff[:3].max()) < 1e-5 and float(diff[3:].min()) > 0.5  # measured: 6e-6; 2.5 and 2.7
    torch.testing.assert_close(tiled[2][0], whole[2][0], rtol=1e-5, atol=1e-5)  # measured: 4e-6
    pipe.vae.use_framewise_decoding = True  # (sic) Diffusers 0.42 gates its temporal encode tiles on this flag
    try:
        with torch.no_grad():
            dist = pipe.vae.encode(noise).latent_dist
    finally:
        pipe.vae.use_framewise_decoding = False
    expected = pipe._normalize_latents(dist.mean, pipe.vae.latents_mean, pipe.vae.latents_std,
                                       pipe.vae.config.scaling_factor)
    torch.testing.assert_close(tiled[1][0], expected, rtol=1e-5, atol=1e-5)


def test_vae_tiling_keys_only_the_clips_it_changes(tiny_ltx2, ltx2_prep, monkeypatch):
    """The demo's clips (at most one tile) keep their latents' keys and their units' ids under the default
    (those of cache.vae_tiling: never, i.e. of caches made before the key); a clip the tiles change has them in
    its key and its unit's id."""
    from latentmill.stages.cache import CachePlan, plan
    from latentmill.stages.cache_config import CacheConfig
    from latentmill.stages.shardio import StageDir

    from latentmill.recipe import load_recipe as load_full_recipe

    model = ModelConfig(pretrained=str(tiny_ltx2), family="ltx2")
    cfg = load_full_recipe(REPO_ROOT / "configs" / "demo-ltx2.yaml").cache
    never = CacheConfig(**{**cfg.__dict__, "vae_tiling": "never"})
    auto, whole = CachePlan.of(cfg, model), CachePlan.of(never, model)
    assert cfg.vae_tiling == "auto" and auto.fingerprint() == whole.fingerprint()
    meta = {"sha256": "0" * 64, "clip": {"start_frame": 0}, "crop": None}
    assert auto.vae_key({**meta, "bucket": [64, 64, 17]}) == whole.vae_key({**meta, "bucket": [64, 64, 17]})
    assert auto.vae_key({**meta, "bucket": [64, 64, 25]}) != whole.vae_key({**meta, "bucket": [64, 64, 25]})
    upstream = StageDir(ltx2_prep / "prep" / "bucket", "bucket")
    committed = json.loads((ltx2_prep / "prep" / "cache" / "manifest.json").read_text())["units"]
    ids = [u.unit_id for u in plan(cfg, model, upstream)]
    assert sorted(ids) == sorted(committed) == sorted(u.unit_id for u in plan(never, model, upstream))
    monkeypatch.setattr(LTX2Encoders, "VAE_TEMPORAL_TILE", (8, 8))  # the demo's 17 frames: longer than a tile
    tiled = [u.unit_id for u in plan(cfg, model, upstream)]
    assert len(tiled) == len(ids) and not set(tiled) & set(ids)


def latents(out):
    """Each cached sample's ``latents``, from the shards the cache's manifest names (a re-encoded unit's old tar
    stays until a gc)."""
    from latentmill.stages.tarshard import read_shard
    from safetensors.torch import load

    cache = out / "prep" / "cache"
    manifest = json.loads((cache / "manifest.json").read_text())
    return {s["__key__"]: load(s["vae.safetensors"])["latents"]
            for shard in manifest["shards"] for s in read_shard(str(cache / shard["path"]))}


@pytest.mark.slow
def test_prep_encodes_clips_longer_than_a_tile_in_tiles(tiny_ltx2, ltx2_prep, tmp_path, monkeypatch):
    """Through prep, with the VAE's tiles shrunk to 8 frames so that the demo's 17-frame clips are longer than one:
    the cache re-encodes the latents only (the text is reused), under the units' tiled ids, and the moving
    clips' latents are no longer the whole clips'."""
    import shutil

    from latentmill.cli import main

    out = tmp_path / "prep"
    shutil.copytree(ltx2_prep, out)
    monkeypatch.setattr(LTX2Encoders, "VAE_TEMPORAL_TILE", (8, 8))
    assert main(["prep", str(REPO_ROOT / "configs" / "demo-ltx2.yaml"), f"output_dir={out}",
                 f"model.pretrained={tiny_ltx2}", "runner.workers=1", "--summary-json", str(out / "tiled.json")]) == 0
    cache = json.loads((out / "tiled.json").read_text())["stages"]["cache"]
    assert (cache["components"]["vae"]["processed"], cache["components"]["text"]["processed"]) == (8, 0)
    before, after = latents(ltx2_prep), latents(out)
    assert sorted(before) == sorted(after) and all(after[k].shape == before[k].shape for k in before)
    moved = [k for k in before if (after[k] - before[k]).abs().max() > 1e-3]
    assert len(moved) >= 6, moved  # the demo's shapes move: a tile after the first misses the frames before it


@pytest.mark.slow
def test_a_compacted_unit_of_tiled_clips_is_the_unit_the_next_plan_asks_for(tiny_ltx2, ltx2_prep, tmp_path,
                                                                             monkeypatch):
    """Two cache units of clips encoded in tiles (tiles shrunk to 8 frames, a cache shard size that gives each
    bucket shard its own unit), compacted into one: its id has the tiles in it, as the planner's does, so the next
    prep reuses it whole (before, the next plan asked for another unit and copied the samples once more)."""
    import shutil

    from latentmill.pipelines.compaction import compact
    from latentmill.stages.cache import plan
    from latentmill.stages.shardio import ID_KEY, StageDir

    from latentmill.cli import main
    from latentmill.recipe import load_recipe as load_full_recipe

    out = tmp_path / "prep"
    shutil.copytree(ltx2_prep, out, ignore=shutil.ignore_patterns("cache"))
    monkeypatch.setattr(LTX2Encoders, "VAE_TEMPORAL_TILE", (8, 8))
    overrides = [f"output_dir={out}", f"model.pretrained={tiny_ltx2}", "runner.workers=1", "cache.shard_bytes=65536"]
    assert main(["prep", str(REPO_ROOT / "configs" / "demo-ltx2.yaml"), *overrides]) == 0
    cache = StageDir(out / "prep" / "cache", "cache")
    units = cache.read_manifest()["units"]
    assert len(units) == 2 and all(cache.load_record(u).extra[ID_KEY] == {"vae_tiling": [8, 8]} for u in units)
    # the next prep at the demo's shard size keeps the two units (a prep never regroups old inputs) and lets
    # them be merged: together they fit its shard size
    assert main(["prep", str(REPO_ROOT / "configs" / "demo-ltx2.yaml"), *overrides[:-1]]) == 0
    assert cache.read_manifest()["units"] == units
    report = compact(out, small_below=1.0)
    (merged,) = report["units_written"]
    assert cache.load_record(merged).extra[ID_KEY] == {"vae_tiling": [8, 8]}
    cfg = load_full_recipe(REPO_ROOT / "configs" / "demo-ltx2.yaml").cache
    model = ModelConfig(pretrained=str(tiny_ltx2), family="ltx2")
    # the next prep's plan: the compacted unit, whose record is there (it runs nothing; before, another unit id)
    assert [u.unit_id for u in plan(cfg, model, StageDir(out / "prep" / "bucket", "bucket"))] == [merged]


@pytest.mark.heavy
def test_prep_with_vae_tiling_never_encodes_long_clips_whole(tiny_ltx2, ltx2_prep, tmp_path, monkeypatch):
    """cache.vae_tiling: never through prep, with the VAE's tiles shrunk to 8 frames so that the demo's 17-frame
    clips are longer than one: the cache, made again from its bucket shards, encodes them whole (the latents of
    the demo's prep, bit for bit) under the units' ids from before tiling existed."""
    import shutil

    from latentmill.cli import main

    out = tmp_path / "prep"
    shutil.copytree(ltx2_prep, out)
    shutil.rmtree(out / "prep" / "cache")  # the earlier stages stay: only the cache is made again
    monkeypatch.setattr(LTX2Encoders, "VAE_TEMPORAL_TILE", (8, 8))
    assert LTX2Encoders.tiles_clip(17, "auto") and not LTX2Encoders.tiles_clip(17, "never")
    assert main(["prep", str(REPO_ROOT / "configs" / "demo-ltx2.yaml"), f"output_dir={out}",
                 f"model.pretrained={tiny_ltx2}", "runner.workers=1", "cache.vae_tiling=never",
                 "--summary-json", str(out / "never.json")]) == 0
    cache = json.loads((out / "never.json").read_text())["stages"]["cache"]
    assert cache["components"]["vae"]["processed"] == cache["out"] == 8
    units = [json.loads((p / "prep" / "cache" / "manifest.json").read_text())["units"] for p in (ltx2_prep, out)]
    assert sorted(units[1]) == sorted(units[0])
    before, after = latents(ltx2_prep), latents(out)
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
