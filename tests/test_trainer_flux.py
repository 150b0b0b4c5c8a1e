"""The Flux adapter packs and calls the transformer exactly like Diffusers' FluxPipeline."""

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from latentmill.trainer.flux import (
    check_batch_fits,
    flux_forward,
    latent_image_ids,
    load_flux_transformer,
    pack_latents,
    text_ids,
    unpack_latents,
)

from tests.trainer_helpers import TINY_TRANSFORMER, build_tiny_transformer


@pytest.mark.parametrize("shape", [(2, 16, 8, 6), (1, 16, 4, 8), (3, 4, 2, 2)])
def test_pack_matches_pipeline_and_round_trips(shape):
    B, C, H, W = shape
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    packed = pack_latents(latents)
    assert packed.shape == (B, (H // 2) * (W // 2), C * 4)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, B, C, H, W))
    assert torch.equal(unpack_latents(packed, H, W), latents)
    # the pipeline's unpack takes the *pixel* size and the VAE scale factor
    assert torch.equal(FluxPipeline._unpack_latents(packed, H * 8, W * 8, 8), latents)


def test_pack_rejects_odd_latent_sizes():
    with pytest.raises(ValueError, match="must be even"):
        pack_latents(torch.zeros(1, 16, 5, 6))


def test_ids_match_pipeline():
    expected = FluxPipeline._prepare_latent_image_ids(1, 4, 3, "cpu", torch.float32)
    assert torch.equal(latent_image_ids(8, 6), expected)
    assert latent_image_ids(8, 6)[5].tolist() == [0.0, 1.0, 2.0]  # row 1, column 2 of a 4x3 token grid
    assert torch.equal(text_ids(7), torch.zeros(7, 3))


def _inputs(B=2, H=8, W=6, L=5):
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(B, 16, H, W, generator=gen),
        torch.rand(B, generator=gen),
        torch.randn(B, L, 32, generator=gen),
        torch.randn(B, 32, generator=gen),
    )


def test_forward_calls_transformer_like_the_pipeline():
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**TINY_TRANSFORMER).eval()
    noisy, sigmas, prompt, pooled = _inputs()
    with torch.no_grad():
        pred = flux_forward(model, noisy, sigmas, prompt, pooled, guidance_scale=3.5)
        # what FluxPipeline.__call__ does for one denoising step, with t = 1000 * sigma
        reference = model(
            hidden_states=FluxPipeline._pack_latents(noisy, 2, 16, 8, 6),
            timestep=(sigmas * 1000) / 1000,
            guidance=torch.full([1], 3.5, dtype=torch.float32).expand(2),
            pooled_projections=pooled,
            encoder_hidden_states=prompt,
            txt_ids=torch.zeros(5, 3),
            img_ids=FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32),
            return_dict=False,
        )[0]
        other_guidance = flux_forward(model, noisy, sigmas, prompt, pooled, guidance_scale=1.0)
    assert pred.shape == noisy.shape
    torch.testing.assert_close(pred, FluxPipeline._unpack_latents(reference, 64, 48, 8))
    assert not torch.allclose(pred, other_guidance)  # the guidance scale reaches the model


def test_forward_without_guidance_embedding():
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**{**TINY_TRANSFORMER, "guidance_embeds": False}).eval()
    noisy, sigmas, prompt, pooled = _inputs(B=1)
    with torch.no_grad():
        assert flux_forward(model, noisy, sigmas, prompt, pooled).shape == noisy.shape


def test_mismatched_cache_is_refused_with_the_difference():
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**TINY_TRANSFORMER)
    noisy, _, prompt, pooled = _inputs()
    check_batch_fits(model, noisy, prompt, pooled)
    with pytest.raises(ValueError, match="joint_attention_dim is 32"):
        check_batch_fits(model, noisy, torch.zeros(2, 5, 24), pooled)
    with pytest.raises(ValueError, match="in_channels is 64"):
        check_batch_fits(model, torch.zeros(2, 4, 8, 6), prompt, pooled)
    with pytest.raises(ValueError, match="pooled_projection_dim is 32"):
        check_batch_fits(model, noisy, prompt, torch.zeros(2, 16))


def test_load_modes_set_what_trains(tmp_path):
    root = build_tiny_transformer(tmp_path / "pretrained")
    full = load_flux_transformer(str(root), mode="full")
    assert full.training and all(p.requires_grad and p.dtype == torch.float32 for p in full.parameters())
    lora = load_flux_transformer(
        str(root), mode="lora", lora_rank=4, lora_alpha=8, lora_target_modules=["to_q", "to_v"]
    )
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"to_q", "to_v"}
    assert lora.peft_config["default"].lora_alpha == 8
