"""Figure 32: ``latentmill plan``'s activation estimate against a measured peak (issue 34).

For FLUX.1-dev's and Wan2.1-T2V-14B's real block widths (the shipped configs; 3072 hidden, 24 heads, FFN 12288;
5120 hidden, 40 heads, FFN 13824) at a reduced depth (FLUX: 1 double + 2 single blocks; Wan: 2 blocks: each
block adds a fixed term, so depth changes nothing the check needs), two token counts each (FLUX 512² and 1024²
with 512 text tokens; Wan 832×480 at 17 and 33 frames), and the whole FLUX.1-dev at 1024² (about 3 minutes a
point: the tracker's cost grows with the modules), with and without activation checkpointing, batch 1:

* measured: the peak of one forward and backward of the real Diffusers class in bf16, through the adapter's
  training forward, tracked by torch's ``MemTracker`` under ``FakeTensorMode`` (nothing is allocated: real
  sizes run on a CPU), minus parameters and buffers; each gradient is dropped once accumulated, as FSDP2's
  reduce-scatter frees it (``latentmill.activations.measured_activation_bytes``);
* estimate: ``latentmill.activations.activation_bytes`` for the same shape.

Then Qwen-Image (a family the constants were not set on) and FLUX.2 [dev] (whose SwiGLU width its adapter declares
from this point) at 1024²; Z-Image-Turbo at 1024² without its refiners (which see only the image or the caption
tokens; its adapter declares its SwiGLU width and its float32 norms and RoPE from this point; the text mask's values
are known to the fake tensors, so its real-token count is too) and LTX-2 at 1024 x 768 x 25 frames (its float32 RoPE
and its audio tokens, declared from this point). HunyuanVideo 1.5's Diffusers class branches on its inputs' values
(``torch.all(image_embeds == 0)``) and selects each caption's tokens by a boolean mask, shapes that ``FakeTensorMode``
cannot run: it is measured on real tensors on the CPU, at its real width with 2 blocks and 512 and 1,536 latent
tokens (its adapter declares its glyph and image tokens and the bf16 attention mask each block saves from these
points). The figure is ``|estimate / measured - 1|``, goal ≤ 0.15 for every point. Run alone: ``python -m bench.actplan``
(``--quick``: the smaller size of each family only).
"""

from __future__ import annotations

import time

from bench.common import figure, log, run_benchmark, setup_env

setup_env()

POINTS = [  # family, shipped config folder, depth, bucket [W, H, F]
    ("flux", "FLUX.1-dev", {"num_layers": 1, "num_single_layers": 2}, [512, 512, 1]),
    ("flux", "FLUX.1-dev", {"num_layers": 1, "num_single_layers": 2}, [1024, 1024, 1]),
    ("wan", "Wan2.1-T2V-14B-Diffusers", {"num_layers": 2}, [832, 480, 17]),
    ("wan", "Wan2.1-T2V-14B-Diffusers", {"num_layers": 2}, [832, 480, 33]),
    # the whole FLUX.1-dev (19 double + 38 single blocks) at 1024²
    ("flux", "FLUX.1-dev", {}, [1024, 1024, 1]),
    # a family the constants were not set on (3072 hidden, GELU 4 x, joint attention)
    ("qwen-image", "Qwen-Image", {"num_layers": 2}, [1024, 1024, 1]),
    # FLUX.2 [dev] (6144 hidden, SwiGLU): its adapter declares the feed-forward width this point measured
    ("flux2", "FLUX.2-dev", {"num_layers": 1, "num_single_layers": 2}, [1024, 1024, 1]),
    # Z-Image-Turbo (3840 hidden, SwiGLU, sandwich RMSNorms in float32), its main layers only
    ("z-image", "Z-Image-Turbo", {"n_layers": 2, "n_refiner_layers": 0}, [1024, 1024, 1]),
    # LTX-2 (4096 video and 2048 audio hidden, float32 RoPE): 3,072 video and 26 audio tokens
    ("ltx2", "LTX-2", {"num_layers": 2}, [1024, 768, 25]),
    # HunyuanVideo 1.5 (2048 hidden, glyph and image tokens in the sequence, a dense mask per block), real tensors
    ("hunyuanvideo1.5", "HunyuanVideo-1.5-480p_t2v", {"num_layers": 2}, [256, 256, 5]),
    ("hunyuanvideo1.5", "HunyuanVideo-1.5-480p_t2v", {"num_layers": 2}, [512, 256, 9]),
]
REAL_TENSORS = ("hunyuanvideo1.5",)  # forward branches on its inputs' values: measured on real tensors on the CPU
TEXT_TOKENS = 512


def run(args) -> list:
    from latentmill.activations import activation_bytes, measured_activation_bytes, shipped_point

    figures = []
    # quick: the smaller size of FLUX.1 and Wan, and Qwen-Image (the whole FLUX.1-dev takes minutes)
    points = [POINTS[0], POINTS[2], POINTS[5]] if args.quick else POINTS
    for family, folder, depth, bucket in points:
        config, shape = shipped_point(family, folder, depth, bucket, TEXT_TOKENS)
        assert list(shape.bucket) == (bucket if bucket[2] > 1 else bucket[:2]), (shape.bucket, bucket)
        for checkpointing in (True, False):
            start = time.perf_counter()
            measured = measured_activation_bytes(family, config, bucket, TEXT_TOKENS, checkpointing=checkpointing,
                                                 fake=family not in REAL_TENSORS)
            estimate = activation_bytes(shape, checkpointing=checkpointing)
            error = abs(estimate / measured - 1)
            log(f"actplan {family} {bucket} checkpointing {checkpointing}: estimate {estimate / 2**30:.3f} GiB, "
                f"measured {measured / 2**30:.3f} GiB, error {error:.3f} ({time.perf_counter() - start:.0f} s)")
            inputs = {"family": family, "config": f"configs/models/{folder} with {depth}", "bucket": bucket,
                      "tokens": shape.tokens, "text_tokens": TEXT_TOKENS, "batch": 1, "blocks": shape.blocks,
                      "checkpointing": checkpointing}
            figures.append(figure(f"32. plan's activation estimate vs MemTracker, {family} {'x'.join(map(str, bucket))}, "
                                  f"checkpointing {'on' if checkpointing else 'off'} (|estimate/measured - 1|)",
                                  [estimate / 2**30], [measured / 2**30], "GiB", "<= 0.15", inputs,
                                  f"MemTracker peak {'on real CPU tensors' if family in REAL_TENSORS else 'under FakeTensorMode'} "
                                  "minus parameters and buffers, bf16, one "
                                  "forward and backward through the adapter", ratios=[error]))
    return figures


def main(argv=None) -> None:
    run_benchmark("actplan", __doc__, run, argv)


if __name__ == "__main__":
    main()
