"""A recipe that mixes components of different families stops before any work, with one line naming it."""

from __future__ import annotations

import pytest

from latentmill.cli import main
from latentmill.core.config import ConfigError
from latentmill.family_check import check_family_components
from latentmill.models import ModelConfig
from tests.conftest import REPO_ROOT

DEMO = str(REPO_ROOT / "configs" / "demo-z-image.yaml")


@pytest.mark.slow
def test_a_wan_vae_under_z_image_is_refused_before_any_work(tiny_zimage, tiny_wan, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["prep", DEMO, f"output_dir={out}", f"model.pretrained={tiny_zimage}",
                 f"model.vae={tiny_wan / 'vae'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.vae: {tiny_wan / 'vae'} (AutoencoderKLWan) does not match" in err[0]
    assert "the ZImagePipeline's vae (AutoencoderKL)" in err[0] and "different model families" in err[0]
    assert not out.exists()


@pytest.mark.slow
def test_other_mixes_name_the_component(tiny_zimage, tiny_wan, tiny_flux):
    with pytest.raises(ConfigError, match="model.text_encoder: .* \\(UMT5EncoderModel\\) does not match the "
                                          "ZImagePipeline's text_encoder \\(Qwen3Model\\)"):
        check_family_components(ModelConfig(pretrained=str(tiny_zimage), text_encoder=str(tiny_wan)))
    with pytest.raises(ConfigError, match="model.text_encoder_2: .* \\(Qwen3Model\\) does not match the "
                                          "FluxPipeline's text_encoder_2 \\(T5EncoderModel\\)"):
        check_family_components(ModelConfig(pretrained=str(tiny_flux), text_encoder_2=str(tiny_zimage / "text_encoder")))
    with pytest.raises(ConfigError, match="model.family: 'z-image', but model.pretrained .* is a FluxPipeline "
                                          "\\(family 'flux'\\)"):
        check_family_components(ModelConfig(pretrained=str(tiny_flux), family="z-image"))
    check_family_components(ModelConfig(pretrained=str(tiny_zimage), family="z-image"))
    # the same kind passes: a FLUX.1 VAE under Z-Image (the same AutoencoderKL), a pipeline's own encoders
    check_family_components(ModelConfig(pretrained=str(tiny_zimage), vae=str(tiny_flux / "vae"),
                                        text_encoder=str(tiny_zimage)))
    check_family_components(ModelConfig(pretrained=str(tiny_flux), text_encoder_2=str(tiny_flux)))


@pytest.mark.slow
def test_a_hub_pipeline_is_checked_by_its_published_model_index(tiny_wan, tiny_flux):
    """Tongyi-MAI/Z-Image-Turbo is not on this machine: its shipped model_index.json names the classes."""
    with pytest.raises(ConfigError, match="\\(AutoencoderKLWan\\) does not match the ZImagePipeline's vae "
                                          "\\(AutoencoderKL\\) of model.pretrained Tongyi-MAI/Z-Image-Turbo"):
        check_family_components(ModelConfig(pretrained="Tongyi-MAI/Z-Image-Turbo", vae=str(tiny_wan / "vae")))
    check_family_components(ModelConfig(pretrained="Tongyi-MAI/Z-Image-Turbo", vae=str(tiny_flux / "vae")))
    with pytest.raises(ConfigError, match="\\(UMT5EncoderModel\\) does not match the FluxPipeline's "
                                          "text_encoder_2 \\(T5EncoderModel\\)"):
        check_family_components(ModelConfig(pretrained="black-forest-labs/FLUX.1-dev",
                                            text_encoder_2=str(tiny_wan / "text_encoder")))


def test_architecture_stems():
    from latentmill.family_check import _stem

    assert _stem("T5EncoderModel") == _stem("T5ForConditionalGeneration") == "T5"
    assert _stem("Qwen3Model") == _stem("Qwen3ForCausalLM") == "Qwen3"
    assert _stem("UMT5EncoderModel") == "UMT5" and _stem("CLIPTextModel") == _stem("CLIPModel") == "CLIP"
