"""Training LTX-2 (family ``ltx2``): the adapter calls the transformer as LTX2Pipeline does, the loss is flow
matching on video and audio at one noise level per sample with a weighted audio term, a cache without the audio
stream is refused before training, and the exports load into LTX2Pipeline and generate a clip with sound."""

from __future__ import annotations

import pytest
import torch
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.loader import CacheFamilyError, LatentLoader, check_streams
from latentmill.trainer.ltx2 import LTX2Adapter, ltx2_forward
from latentmill.trainer.objective import flow_matching_loss, interpolate, sample_sigmas
from latentmill.trainer.train import derive_seed

from latentmill.core.config import ConfigError
from tests.trainer_helpers import read_metrics, torch_threads


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def test_audio_loss_weight_is_checked_before_work():
    assert TrainerConfig().audio_loss_weight == 1.0
    with pytest.raises(ConfigError, match=r"trainer.audio_loss_weight: must be a finite number >= 0, got -0.5"):
        TrainerConfig(audio_loss_weight=-0.5).validate()


def test_a_cache_without_audio_fails_before_training():
    adapter = get_adapter("ltx2")
    assert isinstance(adapter, LTX2Adapter) and adapter.noised_streams == ("audio_latents",)
    streams = [{"name": n, "component": "vae"} for n in ("latents", "frame_rate")] + [
        {"name": n, "component": "text"} for n in ("prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask")]
    manifest = {"family": "ltx2", "streams": streams}
    with pytest.raises(CacheFamilyError, match=r"the 'ltx2' model reads .*: audio_latents missing; re-run "
                                               r"latentmill prep"):
        check_streams(manifest, "ltx2", adapter.streams, "m.json")


# one transformer call a step: no classifier-free, spatio-temporal or modality guidance (the defaults add up to 5)
NO_GUIDANCE = dict(guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
                   modality_scale=1.0, audio_modality_scale=1.0)


@pytest.fixture(scope="module")
def snapshot(ltx2_prep):
    """The demo videos with sound prepped with the tiny LTX-2 set: 8 clips of 64 x 64 px x 17 frames."""
    (path,) = (ltx2_prep / "snapshots").glob("0001-*")
    return path


def test_adapter_prediction_equals_the_pipelines_transformer_call(tiny_ltx2):
    """The transformer's inputs and outputs inside LTX2Pipeline.__call__, captured, against ltx2_forward on the
    same (unpacked) latents, noise level and text embeddings."""
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(tiny_ltx2)
    seen = []
    hook = pipe.transformer.register_forward_hook(lambda m, args, kwargs, out: seen.append((kwargs, out)),
                                                  with_kwargs=True)
    pipe(["a red square moving right", "a yellow square falling"], height=64, width=96, num_frames=17,
         frame_rate=24.0, num_inference_steps=2, max_sequence_length=64, output_type="latent",
         generator=torch.Generator().manual_seed(0), **NO_GUIDANCE)
    hook.remove()
    assert len(seen) == 2  # one call a step without guidance
    kwargs, (video_out, audio_out) = seen[1]  # the second step: a noise level below 1
    assert 0 < float(kwargs["timestep"][0]) < 1000
    assert kwargs["use_cross_timestep"] is True and kwargs["audio_num_frames"] == 18
    noisy = pipe._unpack_latents(kwargs["hidden_states"], 3, 2, 3)
    noisy_audio = pipe._unpack_audio_latents(kwargs["audio_hidden_states"], 18, num_mel_bins=16)
    batch = {"prompt_embeds": kwargs["encoder_hidden_states"], "audio_prompt_embeds":
             kwargs["audio_encoder_hidden_states"], "prompt_attention_mask": kwargs["encoder_attention_mask"],
             "frame_rate": torch.tensor([[24.0], [24.0]])}
    with torch.no_grad():
        video, audio = ltx2_forward(pipe.transformer, noisy, noisy_audio, kwargs["timestep"] / 1000.0, batch)
    assert video.shape == (2, 128, 3, 2, 3) and audio.shape == (2, 2, 18, 16)
    torch.testing.assert_close(pipe._pack_latents(video), video_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pipe._pack_audio_latents(audio), audio_out, rtol=1e-5, atol=1e-5)
    # another clip rate places the frames elsewhere in time: the prediction changes
    with torch.no_grad():
        slower, _ = ltx2_forward(pipe.transformer, noisy, noisy_audio, kwargs["timestep"] / 1000.0,
                                 {**batch, "frame_rate": torch.tensor([[12.0], [24.0]])})
    assert not torch.allclose(slower[0], video[0]) and torch.allclose(slower[1], video[1], atol=1e-6)


@pytest.mark.parametrize("weight", [1.0, 0.25])
def test_first_step_loss_is_video_plus_weighted_audio(tiny_ltx2, snapshot, tmp_path, weight):
    """Step 1's logged loss recomputed from the run's own draws: video and audio noised at the sample's one sigma
    (drawn in the order sigma, video noise, audio noise), the audio MSE weighted by trainer.audio_loss_weight."""
    from diffusers import LTX2VideoTransformer3DModel

    cfg = TrainerConfig(mode="full", max_steps=1, batch_size=1, save_every=0, export=False, shift=1.0,
                        audio_loss_weight=weight)
    train(cfg, cache_dir=snapshot, pretrained=str(tiny_ltx2), train_dir=tmp_path, progress=False, seed=3)
    (record,) = read_metrics(tmp_path)

    batch = next(iter(LatentLoader(snapshot, 1, 3)))
    x0, a0 = batch["latents"], batch["audio_latents"]
    # the sample's own generator: keyed by (seed, epoch, its epoch ordinal), as the run drew it
    gen = torch.Generator().manual_seed(derive_seed(3, f"sample:{batch['epoch']}:{batch['ordinals'][0]}"))
    sigma = sample_sigmas(1, cfg, gen, shift=1.0)
    noise = torch.randn(x0.shape[1:], generator=gen)[None]
    audio_noise = torch.randn(a0.shape[1:], generator=gen)[None]
    transformer = LTX2VideoTransformer3DModel.from_pretrained(tiny_ltx2, subfolder="transformer")
    with torch.no_grad():
        video, audio = ltx2_forward(transformer, interpolate(x0, noise, sigma), interpolate(a0, audio_noise, sigma),
                                    sigma, batch)
    video_loss = flow_matching_loss(video, noise - x0)
    audio_loss = flow_matching_loss(audio, audio_noise - a0)
    assert float(audio_loss) > 0.01
    assert record["loss"] == pytest.approx(float(video_loss + weight * audio_loss), rel=1e-5)


def test_full_export_generates_a_clip_with_sound(tiny_ltx2, snapshot, tmp_path):
    from diffusers import DiffusionPipeline, LTX2Pipeline

    cfg = TrainerConfig(mode="full", max_steps=2, batch_size=2, learning_rate=1e-3, save_every=0)
    summary = train(cfg, cache_dir=snapshot, pretrained=str(tiny_ltx2), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "export", progress=False)
    assert summary["family"] == "ltx2"
    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    assert isinstance(pipe, LTX2Pipeline)
    base = LTX2Pipeline.from_pretrained(tiny_ltx2).transformer.state_dict()
    exported = pipe.transformer.state_dict()
    assert any(not torch.equal(base[k], v) for k, v in exported.items() if k.startswith("audio_"))
    video, audio = pipe("a red square moving right on blue, with a low hum", height=64, width=64, num_frames=17,
                        frame_rate=24.0, num_inference_steps=2, max_sequence_length=64, output_type="np",
                        return_dict=False, generator=torch.Generator().manual_seed(0))
    assert video.shape == (1, 17, 64, 64, 3) and video.std() > 0
    # the vocoder's 16 kHz stereo waveform of the 18 generated audio latent frames (72 mel frames x 160 samples)
    assert audio.shape[:2] == (1, 2) and audio.shape[2] >= 11000 and float(audio.float().std()) > 0


@pytest.mark.heavy
def test_lora_export_loads_into_the_pipeline(tiny_ltx2, snapshot, tmp_path):
    from diffusers import LTX2Pipeline

    cfg = TrainerConfig(mode="lora", max_steps=2, batch_size=2, learning_rate=1e-2, lora_rank=4, save_every=0)
    summary = train(cfg, cache_dir=snapshot, pretrained=str(tiny_ltx2), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "lora", progress=False)
    pipe = LTX2Pipeline.from_pretrained(tiny_ltx2)
    pipe.load_lora_weights(summary["export_dir"])
    (name,) = pipe.get_active_adapters()
    lora_b = [v for k, v in pipe.transformer.state_dict().items() if "lora_B" in k]
    assert pipe.transformer.peft_config[name].r == 4 and lora_b and all(bool(v.abs().sum() > 0) for v in lora_b)
    video, audio = pipe("a yellow square falling", height=64, width=64, num_frames=9, frame_rate=24.0,
                        num_inference_steps=2, max_sequence_length=64, output_type="np", return_dict=False)
    assert video.shape == (1, 9, 64, 64, 3) and audio.shape[:2] == (1, 2)
