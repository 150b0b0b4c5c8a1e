"""A z-image recipe that mixes components of different families stops before any work, with one line naming
it (``latentmill.preflight.check_components``)."""

from __future__ import annotations

import pytest

from latentmill.cli import main
from latentmill.core.config import ConfigError
from latentmill.models import ModelConfig
from latentmill.preflight import check_components
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow
DEMO = str(REPO_ROOT / "configs" / "demo-z-image.yaml")


def test_a_wan_vae_under_z_image_is_refused_before_any_work(tiny_zimage, tiny_wan, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["prep", DEMO, f"output_dir={out}", f"model.pretrained={tiny_zimage}",
                 f"model.vae={tiny_wan / 'vae'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.vae: {tiny_wan / 'vae'} is a AutoencoderKLWan" in err[0]
    assert "the ZImagePipeline" in err[0] and "takes a AutoencoderKL" in err[0]
    assert "cannot mix components of different model families" in err[0]
    assert not out.exists()


def test_other_mixes_name_the_component(tiny_zimage, tiny_wan, tiny_flux):
    with pytest.raises(ConfigError, match="model.text_encoder: .* is a UMT5EncoderModel; the ZImagePipeline .* "
                                          "takes a Qwen3Model"):
        check_components(ModelConfig(pretrained=str(tiny_zimage), text_encoder=str(tiny_wan)))
    with pytest.raises(ConfigError, match="model.text_encoder_2: the ZImagePipeline .* has no text_encoder_2"):
        check_components(ModelConfig(pretrained=str(tiny_zimage), text_encoder_2=str(tiny_flux)))
    with pytest.raises(ConfigError, match="model.family: 'z-image', but .* is a FluxPipeline"):
        check_components(ModelConfig(pretrained=str(tiny_flux), family="z-image"))
    with pytest.raises(ConfigError, match="model.vae: .* is a AutoencoderKL; the WanPipeline"):
        check_components(ModelConfig(pretrained=str(tiny_wan), vae=str(tiny_zimage / "vae")))
    # the same kind passes: a FLUX.1 VAE under Z-Image (the same AutoencoderKL), its own encoder, its family
    check_components(ModelConfig(pretrained=str(tiny_zimage), family="z-image", vae=str(tiny_flux / "vae"),
                                 text_encoder=str(tiny_zimage)))
