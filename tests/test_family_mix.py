"""A recipe that mixes components of different families stops before any work, with one line naming it."""

from __future__ import annotations

import pytest

from latentmill.cli import main
from latentmill.core.config import ConfigError
from latentmill.family_check import check_family_components
from latentmill.models import ModelConfig
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow
DEMO = str(REPO_ROOT / "configs" / "demo-z-image.yaml")


def test_a_wan_vae_under_z_image_is_refused_before_any_work(tiny_zimage, tiny_wan, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["prep", DEMO, f"output_dir={out}", f"model.pretrained={tiny_zimage}",
                 f"model.vae={tiny_wan / 'vae'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.vae: {tiny_wan / 'vae'} (AutoencoderKLWan) does not match" in err[0]
    assert "the z-image pipeline's vae (AutoencoderKL)" in err[0] and "different model families" in err[0]
    assert not out.exists()


def test_other_mixes_name_the_component(tiny_zimage, tiny_wan, tiny_flux):
    with pytest.raises(ConfigError, match="model.text_encoder: .* \\(UMT5EncoderModel\\) does not match the "
                                          "z-image pipeline's text_encoder \\(Qwen3Model\\)"):
        check_family_components(ModelConfig(pretrained=str(tiny_zimage), text_encoder=str(tiny_wan)))
    with pytest.raises(ConfigError, match="model.family: 'z-image', but model.pretrained .* is a FluxPipeline "
                                          "\\(family 'flux'\\)"):
        check_family_components(ModelConfig(pretrained=str(tiny_flux), family="z-image"))
    # a tiny model still to build (no folder yet): the family's declared classes decide
    with pytest.raises(ConfigError, match="is not a z-image vae \\(AutoencoderKL\\)"):
        check_family_components(ModelConfig(pretrained=str(tiny_zimage / "missing"), family="z-image",
                                            vae=str(tiny_wan / "vae")))
    # the same family's components pass: a FLUX.1 VAE under Z-Image (the same AutoencoderKL), its own encoder
    check_family_components(ModelConfig(pretrained=str(tiny_zimage), vae=str(tiny_flux / "vae"),
                                        text_encoder=str(tiny_zimage)))
    check_family_components(ModelConfig(pretrained=str(tiny_flux), text_encoder_2=str(tiny_flux)))
