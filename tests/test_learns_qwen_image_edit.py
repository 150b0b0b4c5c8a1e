"""Qwen-Image-Edit learns the edit it is shown, through the whole path (prep, cache, train, export, sample), on
pairs that differ in fine detail: a grey square with a blue mark in one corner (the source) and the instruction
"add a red mark in the <corner> corner"; the target is the source with that red mark. Every instruction comes
with three sources (the blue mark in each other corner), so a pair's target depends on both: the instruction
(where the red mark goes) and the source image (where the blue mark is).

``latentmill run`` on the demo recipe with the tiny models of data/tiny-qwen-image-edit.yaml; then the exported
``QwenImageEditPipeline``'s transformer and scheduler sample each pair from noise, given the pair's cached
instruction embeddings (which saw the source) and source latents, called as the pipeline calls them
(``qwen_image_forward``, shown equal to the pipeline's call in tests/test_trainer_qwen_image_edit.py) with the
pipeline's sigmas and dynamic shift. (``__call__`` itself always encodes the source at ~1024 x 1024, which a
64 px tiny training cannot match.) Each sample must lie nearest its own pair's target, clearly nearer than any
other's. Trained at shift 1.0 and at Qwen-Image's own (the resolution-dependent shift of its scheduler).
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.learning import CORNERS, assert_loss_fell, assert_nearest_own, losses, run

pytestmark = pytest.mark.slow

SIZE, MARK = 64, 16  # a 16 px mark = 2 x 2 of the 8 x 8 latent positions
STEPS = 8


def _pairs(folder: Path) -> None:
    from PIL import Image

    folder.mkdir()

    def marked(marks: dict[str, tuple[int, int, int]]) -> Image.Image:
        pixels = np.full((SIZE, SIZE, 3), 128, np.uint8)
        for corner, colour in marks.items():
            row, col = CORNERS[corner]
            pixels[row * (SIZE - MARK): row * (SIZE - MARK) + MARK, col * (SIZE - MARK): col * (SIZE - MARK) + MARK] = colour
        return Image.fromarray(pixels)

    for target in CORNERS:
        for source in CORNERS:
            if source != target:
                name = f"{target.replace(' ', '_')}-from-{source.replace(' ', '_')}"
                marked({source: (40, 80, 220)}).save(folder / f"{name}.src.png")
                marked({source: (40, 80, 220), target: (220, 40, 40)}).save(folder / f"{name}.png")
                (folder / f"{name}.txt").write_text(f"add a red mark in the {target} corner")


def _cached_pairs(cache_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each pair's cached target latents, source latents and instruction embeddings, by the pair's source file."""
    from safetensors.torch import load

    pairs = {}
    for shard in sorted((cache_dir / "shards").glob("*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: m for m in tar.getmembers()}
            for name, member in members.items():
                if name.endswith(".json"):
                    key = name[: -len(".json")]
                    source = json.loads(tar.extractfile(member).read())["source"]
                    vae = load(tar.extractfile(members[f"{key}.vae.safetensors"]).read())
                    text = load(tar.extractfile(members[f"{key}.text.safetensors"]).read())
                    pairs[source] = {**vae, **text}
    return pairs


@pytest.mark.heavy  # make test-all: about 2 minutes a shift on 2 cores (measured 225 s for both)
@pytest.mark.parametrize("shift", ["1.0", "qwen-image"])
def test_qwen_image_edit_makes_the_edit_it_was_shown(tiny_qwen_image_edit, tmp_path, shift):
    from diffusers import DiffusionPipeline, QwenImageEditPipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_shift
    from latentmill.trainer.qwen_image import qwen_image_forward

    _pairs(tmp_path / "pairs")
    out = tmp_path / "run"
    overrides = ["trainer.shift_mode=fixed", "trainer.shift=1.0"] if shift == "1.0" else []
    run("demo-qwen-image-edit.yaml", out, tiny_qwen_image_edit, tmp_path / "pairs", f"bucket.resolution={SIZE}",
        "bucket.aspect_ratios=[1.0]", "trainer.max_steps=1000", "trainer.learning_rate=2.0e-3", *overrides)
    assert_loss_fell(losses(out / "train"), 40, 0.1)

    pairs = _cached_pairs(out / "prep" / "cache")
    assert len(pairs) == 12 and all(p["reference_latents"].shape == p["latents"].shape == (16, 8, 8)
                                    for p in pairs.values())
    pipe = DiffusionPipeline.from_pretrained(out / "export", processor=None)
    assert isinstance(pipe, QwenImageEditPipeline)
    config = pipe.scheduler.config
    # the pipeline's sigmas and its dynamic shift for the 16 tokens of a 64 x 64 target
    mu = calculate_shift(16, config["base_image_seq_len"], config["max_image_seq_len"], config["base_shift"],
                         config["max_shift"])
    generated = {}
    with torch.no_grad():
        for name, pair in pairs.items():
            pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / STEPS, STEPS), mu=mu)
            x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
            for t in pipe.scheduler.timesteps:
                v = qwen_image_forward(pipe.transformer, x, t.expand(1) / 1000, pair["prompt_embeds"][None],
                                       reference_BCHW=pair["reference_latents"][None])
                x = pipe.scheduler.step(v, t, x).prev_sample
            generated[name] = x[0]
    # the targets lie 0.017-0.06 apart (mean squared); the nearest other target shares the instruction or the
    # source. Measured at 1000 steps, seed 0 (own / nearest other): Qwen-Image's shift 0.0058-0.0080 /
    # 0.0170-0.0201 (ratios 0.33-0.40); shift 1.0 up to 0.0100 / 0.0190 (0.525). 1500 steps did not help
    # (worst ratios 0.51 and 0.55, final losses 0.07 against 0.02-0.04)
    distances = assert_nearest_own(generated, {name: pair["latents"] for name, pair in pairs.items()}, margin=0.6)
    print(json.dumps({p: {"own": d[p], "nearest_other": min(v for q, v in d.items() if q != p)}
                      for p, d in distances.items()}, indent=1))
