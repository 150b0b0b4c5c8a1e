"""Figure 22: per video family, the peak memory of caching one long clip against a short one (issue 33).

For each video family with a tiny set (Wan 2.1, Wan 2.2 TI2V, HunyuanVideo 1.5, LTX-2; built from
``data/tiny-<family>.yaml`` with seed 0 under ``bench/.work/models``), one clip of 129 frames (4× 32 + 1: a
length all four take, 4× the frames of the short clip) against one of 33, at 64×64 pixels, float32, CPU,
through the cache stage's encoder call (``latentmill.stages.families.get_encoders(...).encode_pixels``, as the
cache stage hands it a batch of ``cache.batch_size`` 1). Each measurement runs in a fresh child process
(``python -m bench.longclip --child FAMILY FRAMES``) that loads the encoders, encodes a one-latent-frame clip
(the first call's one-time costs: weight layouts, thread pools), makes the clip's pixels, resets its peak
resident set to the current one (``/proc/self/clear_refs``: the floor), encodes, and reports its peak
resident set (``VmHWM``) and the peak of the
Python heap traced during the encode (``tracemalloc``: torch's tensors live outside it, so it stays near 0
whatever the clip; it shows that nothing on the Python side grows with the clip).

The figure per family is the harsher reading of figure 8's long-clip row: the peak's increment over the
floor, long against short (the clip's own pixels, 4× larger, are in the floor). Goal ≤ 1.3×: the VAE's
activations must not grow with the clip. Wan's VAEs encode causally a few frames at a time with a feature
cache; HunyuanVideo 1.5's encodes the whole clip at once (Diffusers 0.42's ``AutoencoderKLHunyuanVideo15`` tiles
space only); LTX-2's ``AutoencoderKLLTX2Video`` encodes a clip longer than 17 frames in 16-frame tiles with 8 frames
of overlap, blended, as the cache stage runs it (``cache.vae_tiling: auto``, docs/cache-format.md "Long clips").
``details.untiled`` gives LTX-2's increments with ``cache.vae_tiling: never`` (the whole clip in one call), for
comparison.

Run alone: ``python -m bench.longclip --quick`` (17 against 65 frames).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from bench.common import REPO_ROOT, WORK, figure, log, peak_rss_mb, reps_of, rss_mb, run_benchmark, setup_env

setup_env()

FAMILIES = {"wan": "tiny-wan.yaml", "wan2.2-ti2v": "tiny-wan2.2-ti2v.yaml",
            "hunyuanvideo1.5": "tiny-hunyuanvideo1.5.yaml", "ltx2": "tiny-ltx2.yaml"}
SIDE = 64  # pixels: a multiple of every family's PIXEL_MULTIPLE (32 at most)


def tiny_set(family: str):
    """The family's tiny pipeline folder (built once, seed 0)."""
    from latentmill.tinyio import ensure_tiny

    return ensure_tiny(family, WORK / "models" / FAMILIES[family].removesuffix(".yaml"),
                       REPO_ROOT / "data" / FAMILIES[family])


def child(family: str, frames: str, vae_tiling: str = "auto") -> dict:
    import gc
    import tracemalloc

    import torch
    from latentmill.stages.families import get_encoders

    from latentmill.models import ModelConfig

    encoders = get_encoders(ModelConfig(pretrained=str(tiny_set(family)), family=family), family,
                            torch.device("cpu"))
    encoders.vae_tiling = vae_tiling  # as the cache stage sets it from cache.vae_tiling
    gen = torch.Generator().manual_seed(0)
    step = encoders.FRAME_STEP
    encoders.encode_pixels(torch.rand(1, 3, step + 1, SIDE, SIDE, generator=gen) * 2 - 1)  # one-time costs
    pixels_BCFHW = torch.rand(1, 3, int(frames), SIDE, SIDE, generator=gen) * 2 - 1
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current resident set, so the peak below is this encode's
    floor = rss_mb()  # models loaded, one short clip encoded, pixels made
    tracemalloc.start()
    start = time.perf_counter()
    mean, _ = encoders.encode_pixels(pixels_BCFHW)
    seconds = time.perf_counter() - start
    traced = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return {"peak_rss_mb": peak_rss_mb(), "floor_rss_mb": floor, "traced_peak_mb": traced, "seconds": seconds,
            "latent_shape": list(mean.shape)}


def spawn(*argv: str) -> dict:
    """Run ``python -m bench.longclip --child ...`` and return the JSON it prints last."""
    done = subprocess.run([sys.executable, "-m", "bench.longclip", "--child", *argv], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"child {argv} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args) -> list:
    short, long = (17, 65) if args.quick else (33, 129)
    reps = reps_of(args, full=1, quick=1)  # one, as figure 8's long clip: the peak hardly varies
    figures = []
    for family in FAMILIES:
        tiny_set(family)  # built once, before the children load it
        res: dict[int, list[dict]] = {short: [], long: []}
        for rep in range(reps):
            for frames in ([short, long] if rep % 2 == 0 else [long, short]):
                res[frames].append(spawn(family, str(frames)))
                r = res[frames][-1]
                log(f"longclip {family} {frames} frames rep {rep + 1}/{reps}: peak {r['peak_rss_mb']:.0f} MiB "
                    f"(floor {r['floor_rss_mb']:.0f}, traced {r['traced_peak_mb']:.2f}, {r['seconds']:.1f} s)")
        growth = {k: [r["peak_rss_mb"] - r["floor_rss_mb"] for r in v] for k, v in res.items()}
        untiled = {}
        if family == "ltx2":
            for frames in (short, long):
                r = spawn(family, str(frames), "never")
                untiled[f"increment_mib_{frames}"] = round(r["peak_rss_mb"] - r["floor_rss_mb"], 1)
            untiled["ratio"] = round(untiled[f"increment_mib_{long}"] / untiled[f"increment_mib_{short}"], 3)
        inputs = {"family": family, "models": f"data/{FAMILIES[family]} (tiny, seed 0)",
                  "clip": f"1 x 3 x F x {SIDE} x {SIDE} float32 in [-1, 1], CPU; F = {short} and {long}",
                  "encode": "stages.families.get_encoders(...).encode_pixels (the cache stage's call)",
                  "latent_shape": {str(k): v[0]["latent_shape"] for k, v in res.items()},
                  "floor_rss_mb": {str(k): round(v[0]["floor_rss_mb"]) for k, v in res.items()}}
        details = {"peak_rss_ratio": round(sorted(a["peak_rss_mb"] / b["peak_rss_mb"]
                                                  for a, b in zip(res[long], res[short]))[reps // 2], 3),
                   "traced_peak_mb": {str(k): round(max(r["traced_peak_mb"] for r in v), 3) for k, v in res.items()},
                   "seconds": {str(k): round(min(r["seconds"] for r in v), 2) for k, v in res.items()}}
        if untiled:
            details["untiled"] = untiled
        figures.append(figure(f"22. peak RSS of caching one {long}-frame clip vs {short} frames, {family} "
                              "(increment over floor)", growth[long], growth[short], "MiB", "<= 1.3", inputs,
                              "fresh process per measurement; peak RSS (VmHWM, reset by clear_refs) minus the floor "
                              "(encoders loaded, a short clip encoded, pixels made)", details=details))
    return figures


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:])))
        return
    run_benchmark("longclip", __doc__, run, argv)


if __name__ == "__main__":
    main()
