"""The step's tensors are made on the batch's device: per-sample draws from generators on that device, and position
ids built there once per shape. A default device of ``meta`` stands in for "not the batch's device" on a CPU host:
any tensor made without naming the device lands there and the step's arithmetic with the CPU batch fails. The
count of host-to-device copies of a real step is ``make gpu-check``'s ``step_copies`` phase (CUDA only); that a
sample's draws do not depend on how its batch is cut is ``tests/test_trainer_steps.py``."""

from __future__ import annotations

import torch
from latentmill.trainer import TrainerConfig
from latentmill.trainer.adapter import ONE_EXPERT
from latentmill.trainer.flux import latent_image_ids
from latentmill.trainer.flux2 import latent_ids, text_ids
from latentmill.trainer.objective import derive_seed, sample_sigmas
from latentmill.trainer.train import draw_micro_batch

CPU = torch.device("cpu")
SHAPE = torch.Size([4, 16, 2, 6, 8])  # B, C, F, H, W
EXTRA = [torch.Size([4, 8, 5, 4])]  # one noised stream (LTX-2's audio latents)
CFG = TrainerConfig(i2v_probability=0.5)


def _draw(ordinals: list[int], epoch: int = 3):
    return draw_micro_batch(CFG, 7, torch.Size([len(ordinals), *SHAPE[1:]]), epoch=epoch, ordinals=ordinals,
                            device=CPU, posterior=True, shift=3.0, expert=ONE_EXPERT[0],
                            extra_shapes=[torch.Size([len(ordinals), *EXTRA[0][1:]])])


def test_draws_name_the_batch_device():
    with torch.device("meta"):  # what the code does not place explicitly would land here
        eps, sigmas, noise, clean, extra = _draw([0, 1, 2, 3])
    for t in (eps, sigmas, noise, clean, *extra):
        assert t.device == CPU
    assert (eps.shape, sigmas.shape, noise.shape, clean.shape, extra[0].shape) == (SHAPE, (4,), SHAPE, (4,), EXTRA[0])
    assert clean.dtype == torch.bool and 0 < float(sigmas.min()) and float(sigmas.max()) < 1


def test_cpu_draws_are_the_reference_stream():
    """On the CPU a sample's draws are a CPU generator's, in the order eps, sigma, noise, extra, i2v flag: the
    numbers every run drew before the draws moved to the batch's device (pinned losses and resumes rely on it)."""
    eps, sigmas, noise, clean, extra = _draw([5, 9])
    for row, ordinal in enumerate([5, 9]):
        gen = torch.Generator().manual_seed(derive_seed(7, f"sample:3:{ordinal}"))
        assert torch.equal(eps[row], torch.randn(SHAPE[1:], generator=gen))
        assert torch.equal(sigmas[row:row + 1], sample_sigmas(1, CFG, gen, shift=3.0))
        assert torch.equal(noise[row], torch.randn(SHAPE[1:], generator=gen))
        assert torch.equal(extra[0][row], torch.randn(EXTRA[0][1:], generator=gen))
        assert bool(clean[row]) == bool(torch.rand(1, generator=gen) < 0.5)


def test_position_ids_are_built_on_the_device_once_per_shape():
    with torch.device("meta"):
        flux = latent_image_ids(6, 8, device=CPU, dtype=torch.float32)
        klein_img, klein_txt = latent_ids(2, 3, 4, device=CPU), text_ids(2, 5, device=CPU)
    assert flux.device == klein_img.device == klein_txt.device == CPU
    # FluxPipeline._prepare_latent_image_ids: (0, row, col) per packed token, rows first
    assert flux.tolist() == [[0.0, r, c] for r in range(3) for c in range(4)]
    assert klein_img.shape == (2, 12, 4) and klein_img[1].tolist() == [[0, h, w, 0] for h in range(3) for w in range(4)]
    assert klein_txt[0].tolist() == [[0, 0, 0, n] for n in range(5)]
    assert latent_image_ids(6, 8, device=CPU, dtype=torch.float32) is flux  # a bucket's steps share one tensor
    assert latent_image_ids(6, 10, device=CPU, dtype=torch.float32).shape == (15, 3)
