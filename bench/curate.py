"""Figure 18 (issue 18): the curate stage's scoring throughput against a bare loop, and what a threshold
change on a prepared dataset costs.

Models: the tiny CLIP of ``latentmill.tiny_clip`` (``CLIPModel``, 2+2 layers of width 32, 32 px input, patch
8, projection 16, random weights, seed 0) and a LAION v2 layout aesthetic head for it (seed 1, safetensors),
built offline under ``bench/.work/models/`` and loaded by folder through ``from_pretrained``, as a hub id is.

18a. Scoring throughput. Inputs: N generated photo-like 256x256 JPEGs (q90, ``bench.common.make_images``)
     with sidecar captions of 10-40 words, ingested and captioned (sidecar) by the real stages into shards
     of 64. Scorers: ``sharpness`` and ``exposure`` (the stage's default, numpy) plus ``aesthetic`` and
     ``clip_score`` (tiny CLIP + head), ``curate.batch_size`` 16. torch runs on one thread (``THREADS``).
     - ours: the whole curate stage, as ``pipelines.prep.run_stages_in_process`` runs it: plan (the
       exact-duplicate index), ``StageDir.run_unit`` with ``curate.process`` for every unit (decode,
       scores, thresholds, output shards, unit records), the manifest and ``prep/scores.parquet``. Before
       each run the curate folder is deleted and the process forgets its loaded scorer models and its score
       index, so every run decodes and scores everything and loads the models (weight digests stay in the
       on-disk store, as for a user's second prep). The time in the output writer (``UnitOutput.add`` and
       ``commit``) is measured too: ``details.ratio_without_writes``.
     - baseline: what a user writes by hand over the same upstream shards (``bench.bare.read_tar_samples``)
       and the same models: ``CLIPModel`` / ``CLIPProcessor.from_pretrained``, the LAION MLP as its
       repository writes it with the head's state dict; per batch of 16: PIL decode, grey image, the
       Laplacian variance and clipped share in numpy, one image forward, the head, one text forward, the
       cosine. Models are loaded inside the timing on both sides. Nothing is written.
     The runs alternate (which goes first flips every repetition); one untimed run of each first. The
     baseline's scores are checked against the stage's (``details.max_abs_diff_relative``): the same work.
     An informational row repeats this with a small CLIP (``SMALL_CLIP``: 224 px, patch 32, width 256,
     4 + 4 layers, random weights) on 256 images, where the forwards are real work on a CPU (no goal).
18b. A threshold change on a prepared dataset. ``run_stages_in_process`` (ingest, caption, curate, bucket,
     cache, the tiny Flux set) on M generated photos with the four scorers on and no threshold; then the
     same recipe with only ``curate.min_aesthetic`` set between two measured scores so that a known quarter
     of the samples is quarantined; then without it again. Counted in this process: scorer-model forwards
     (``curate_models.FORWARDS``, image and text), calls of the model-free score functions (wrapped, not
     replaced), cache components encoded (the cache report's ``components.{vae,text}.processed``) and cache
     encoder loads (``cache._load_encoders``, wrapped). ours: the calls of the run after the change;
     baseline: those of the first prep (goal: none).

Run alone: ``python -m bench.curate [--quick]`` (quick: 128 images for 18a, 24 for 18b).
"""

from __future__ import annotations

import io
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import (
    TINY_RECIPE,
    WORK,
    figure,
    fresh_dir,
    log,
    make_images,
    model_dir,
    reps_of,
    run_benchmark,
    setup_env,
    sync,
)

setup_env()

SIDE = 256  # 18a: square photos of this side
BATCH = 16  # curate.batch_size: images (captions) per scorer-model forward, both sides
SCORERS = ["sharpness", "exposure", "aesthetic", "clip_score"]
QUARANTINE_SHARE = 0.25  # 18b: the share of samples the new threshold drops
# 18a runs torch on one thread, both sides (one process): on this shared 2-core machine, two OpenMP threads
# under load made the tiny model's forwards 10-300 ms at random (the bare loop's model share went from
# ~0.6 s to 7-10 s per 512 images), a noise that buried the pipeline's own cost.
THREADS = 1


def scorer_models() -> tuple[Path, Path]:
    """The tiny CLIP folder (seed 0) and its LAION-layout head (seed 1), built once in bench/.work/models."""
    from latentmill.tiny_clip import TINY_CLIP, build_tiny_clip, save_head

    folder = build_tiny_clip(WORK / "models" / "tiny-clip", seed=0, replace=False)
    head = WORK / "models" / "tiny-clip-aesthetic.safetensors"
    if not head.is_file():
        save_head(head, TINY_CLIP["projection_dim"], seed=1)
    return folder, head


# 18a's informational row: a CLIP whose forward is real work on a CPU (ViT-B/32's input and patch, a
# third of its width and of its depth), so that the stage's fixed per-sample cost meets a model cost
SMALL_CLIP: dict[str, Any] = {
    "projection_dim": 128,
    "text_config": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "max_position_embeddings": 77},
    "vision_config": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                      "num_attention_heads": 4, "image_size": 224, "patch_size": 32},
}


def small_clip_models() -> tuple[Path, Path]:
    """The ``SMALL_CLIP`` folder (``CLIPModel`` + ``CLIPProcessor``, the tiny CLIP's character tokenizer,
    random weights, seed 0) and a LAION-layout head for it (seed 1), built once in bench/.work/models."""
    from latentmill.tiny_clip import build_tiny_clip, save_head

    folder = build_tiny_clip(WORK / "models" / "small-clip", seed=0, replace=False, sizes=SMALL_CLIP)
    head = WORK / "models" / "small-clip-aesthetic.safetensors"
    if not head.is_file():
        save_head(head, SMALL_CLIP["projection_dim"], seed=1)
    return folder, head


def recipe_for(source: Path, output_dir: Path, clip: Path, head: Path, **curate: Any):
    """The recipe of both figures: tiny Flux set, sidecar captions, the four scorers; ``curate`` adds keys."""
    from latentmill.recipe import recipe_from_dict

    return recipe_from_dict({
        "output_dir": str(output_dir), "seed": 0, "model": {"pretrained": str(model_dir(TINY_RECIPE))},
        "runner": {"kind": "threads", "workers": 1},
        "ingest": {"source": str(source), "shard_size": 64},
        "bucket": {"resolution": 128},
        "cache": {"batch_size": 8, "max_sequence_length": 32},
        "curate": {"scorers": SCORERS, "aesthetic_model": str(clip), "aesthetic_head": str(head),
                   "batch_size": BATCH, **curate},
    })


def run_stage(recipe, stage: str):
    """One stage in this process, as ``run_stages_in_process`` runs it: plan, every unit, the manifest (and
    for curate the scores table). Returns ``(manifest, records, plan seconds)``."""
    from latentmill.pipelines.prep import manifest_header, plan_stage, stage_dir_for, stage_processor
    from latentmill.stages import curate

    stage_dir = stage_dir_for(recipe, stage).ensure()
    start = time.perf_counter()
    units = list(plan_stage(stage, recipe))  # ingest's plan streams: time all of it
    planned = time.perf_counter() - start
    process = stage_processor(stage, recipe)
    records = [stage_dir.run_unit(u, process) for u in units]
    manifest = stage_dir.write_manifest(records, manifest_header(stage, recipe, records))
    if stage == "curate":
        curate.write_scores_table(records, recipe.prep_dir, recipe.curate.active_scorers())
    return manifest, records, planned


# ---------------------------------------------------------------------------------------------------------
# 18a: the bare loop
# ---------------------------------------------------------------------------------------------------------


class LaionMLP:
    """The LAION improved-aesthetic-predictor v2 module as its repository writes it (a torch Sequential)."""

    @staticmethod
    def build(head: Path):
        import torch
        from safetensors.torch import load_file

        state = load_file(str(head))
        mlp = torch.nn.Sequential(
            torch.nn.Linear(state["layers.0.weight"].shape[1], 1024), torch.nn.Dropout(0.2),
            torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2), torch.nn.Linear(128, 64),
            torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))
        mlp.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
        return mlp.eval()


def bare_scores(shards: list[Path], clip: Path, head: Path, device: str,
                split: dict[str, float]) -> dict[str, dict[str, float]]:
    """Score every sample of ``shards`` by hand: PIL, numpy, transformers. Returns key -> scores; adds the
    seconds spent decoding, on the numpy scores and in the models (processor included) to ``split``."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    from bench.bare import read_tar_samples

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = CLIPModel.from_pretrained(clip, dtype=dtype).to(device).eval()
    processor = CLIPProcessor.from_pretrained(clip)
    mlp = LaionMLP.build(head)

    def pooled(out):
        return out if torch.is_tensor(out) else out.pooler_output

    scores: dict[str, dict[str, float]] = {}
    clock = time.perf_counter
    for shard in shards:
        samples = read_tar_samples(shard)
        for start in range(0, len(samples), BATCH):
            group = samples[start:start + BATCH]
            t0 = clock()
            images = [Image.open(io.BytesIO(s["image"])).convert("RGB") for s in group]
            captions = [s["txt"].decode() for s in group]
            t1 = clock()
            for sample, img in zip(group, images):
                g = np.asarray(img.convert("L"), np.float64)
                lap = g[:-2, 1:-1] + g[2:, 1:-1] + g[1:-1, :-2] + g[1:-1, 2:] - 4.0 * g[1:-1, 1:-1]
                scores[sample["__key__"]] = {"sharpness": float(lap.var()),
                                             "exposure": float(np.mean((g <= 0) | (g >= 255)))}
            t2 = clock()
            split["decode_s"] += t1 - t0
            split["model_free_s"] += t2 - t1
            with torch.inference_mode():
                pixels = processor(images=images, return_tensors="pt")["pixel_values"].to(device, dtype)
                image_ND = torch.nn.functional.normalize(
                    pooled(model.get_image_features(pixel_values=pixels)).float(), dim=-1).cpu()
                aesthetic = mlp(image_ND)[:, 0]
                tokens = processor.tokenizer(captions, padding=True, truncation=True, return_tensors="pt")
                text_ND = torch.nn.functional.normalize(pooled(model.get_text_features(
                    input_ids=tokens["input_ids"].to(device),
                    attention_mask=tokens["attention_mask"].to(device))).float(), dim=-1).cpu()
                clip_score = 100.0 * (image_ND * text_ND).sum(-1)
            for j, sample in enumerate(group):
                scores[sample["__key__"]].update(aesthetic=float(aesthetic[j]),
                                                 clip_score=float(clip_score[j]))
            split["models_s"] += clock() - t2
    sync(device)
    return scores


class WriteClock:
    """Seconds spent in the stage's output writer (``UnitOutput.add`` and ``commit``: the curate shards, their
    indexes and the unit record) while in the ``with`` block: the share of ours the bare loop has no part of.
    The real methods are wrapped, not replaced, and restored on exit."""

    def __enter__(self) -> "WriteClock":
        from latentmill.stages.shardio import UnitOutput

        self.seconds = 0.0
        self.saved = {name: getattr(UnitOutput, name) for name in ("add", "commit")}
        for name, fn in self.saved.items():
            setattr(UnitOutput, name, self._timed(fn))
        return self

    def _timed(self, fn):
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def __exit__(self, *exc) -> None:
        from latentmill.stages.shardio import UnitOutput

        for name, fn in self.saved.items():
            setattr(UnitOutput, name, fn)


def throughput(args, work: Path, clip: Path, head: Path, n: int, reps: int, model: dict[str, Any],
               name: str, goal: str | None) -> Any:
    """Figure 18a: the curate stage vs the bare loop over the same captioned shards and models (``model``:
    the scorer model's config, for the figure's inputs)."""
    import pyarrow.parquet as pq
    import torch
    from latentmill.stages import curate, curate_models
    from latentmill.stages.shardio import StageDir

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    src = work / f"images-18a-{n}"
    t0 = time.perf_counter()
    if not src.is_dir():
        make_images(src, n, seed=18, sizes=[(SIDE, SIDE)])
    out = work / f"out-18a-{n}"
    recipe = recipe_for(src, out, clip, head)
    for stage in ("ingest", "caption"):
        run_stage(recipe, stage)
    caption_dir = recipe.stage_dir("caption")
    caption_manifest = StageDir(caption_dir, "caption").read_manifest()
    shards = [caption_dir / s["path"] for s in caption_manifest["shards"]]
    log(f"18a: {n} images generated, ingested and captioned in {time.perf_counter() - t0:.0f} s "
        f"({len(shards)} caption shards)")
    curate_root = recipe.stage_dir("curate")
    splits: list[dict[str, float]] = []
    bare_splits: list[dict[str, float]] = []
    bare_out: dict[str, dict[str, float]] = {}

    def ours(rep: int) -> float:
        shutil.rmtree(curate_root, ignore_errors=True)
        curate_models.release_models()
        forwards = dict(curate_models.FORWARDS)
        with WriteClock() as writes:
            start = time.perf_counter()
            manifest, records, planned = run_stage(recipe, "curate")
            sync(args.device)
            seconds = time.perf_counter() - start
        report = curate.report(records)
        assert report["scored"] == n and manifest["counts"]["out"] == n, (report, manifest["counts"])
        splits.append({"plan_s": round(planned, 3), "write_s": round(writes.seconds, 3),
                       "total_s": round(seconds, 3),
                       "image_forwards": curate_models.FORWARDS["image"] - forwards["image"],
                       "text_forwards": curate_models.FORWARDS["text"] - forwards["text"]})
        return seconds

    def bare(rep: int) -> float:
        split = {"decode_s": 0.0, "model_free_s": 0.0, "models_s": 0.0}
        start = time.perf_counter()
        bare_out.clear()
        bare_out.update(bare_scores(shards, clip, head, args.device, split))
        seconds = time.perf_counter() - start
        bare_splits.append({k: round(v, 3) for k, v in split.items()} | {"total_s": round(seconds, 3)})
        assert len(bare_out) == n
        return seconds

    ours(-1)  # untimed warm-up of both: first calls pay one-off set-up
    bare(-1)
    o, b = [], []
    for rep in range(reps):
        order = [("ours", ours, o), ("baseline", bare, b)]
        for who, fn, acc in (order if rep % 2 == 0 else order[::-1]):
            acc.append(fn(rep))
            log(f"curate 18a ({Path(clip).name}) rep {rep + 1}/{reps} {who}: {acc[-1]:.2f} s")
    torch.set_num_threads(threads)
    # the same work: the bare loop's scores are the stage's
    table = {r["key"]: r for r in pq.read_table(out / "prep" / "scores.parquet").to_pylist()}
    assert set(table) == set(bare_out), "the stage and the bare loop scored different samples"
    diff = {name: max(abs(table[k][name] - bare_out[k][name]) / max(1.0, abs(bare_out[k][name]))
                      for k in bare_out) for name in SCORERS}
    # float32 on the CPU: equal to rounding; bf16 on a GPU: the same kernels, but allow bf16's precision
    assert max(diff.values()) < (1e-4 if args.device == "cpu" else 2e-2), diff
    inputs = {"images": n, "image_size": f"{SIDE}x{SIDE} JPEG q90 (photo-like: shapes over a noisy gradient)",
              "captions": "sidecar .txt, 10-40 words", "caption_shards": len(shards), "ingest_shard_size": 64,
              "scorers": SCORERS, "batch_size": BATCH, "score_side": 256, "model_side": 448,
              "model": {"class": "CLIPModel", **model, "weights": "random, seed 0",
                        "loaded": "from_pretrained (folder)"},
              "head": "LAION v2 layout (1024-128-64-16-1), random, seed 1, safetensors",
              "device": args.device, "dtype": "bfloat16" if args.device == "cuda" else "float32",
              "torch_threads": THREADS}
    no_writes = [(run["total_s"] - run["write_s"]) / bare_run["total_s"] for run, bare_run in
                 zip(splits[1:], bare_splits[1:])]
    details = {"stage_runs": splits[1:], "bare_runs": bare_splits[1:],
               "ratio_without_writes": round(statistics.median(no_writes), 4),
               "max_abs_diff_relative": {k: float(f"{v:.3g}") for k, v in diff.items()},
               "per_image_ms_ours": round(1000 * min(o) / n, 3),
               "per_image_ms_bare": round(1000 * min(b) / n, 3)}
    return figure(name, o, b, "s", goal, inputs,
                  "ours: the whole curate stage (plan with the exact-duplicate index, run_unit per unit, "
                  "manifest, scores.parquet), scorer models loaded inside the timing; baseline: a hand-written "
                  "PIL + numpy + transformers loop over the same shards and models, nothing written; its "
                  "scores equal the stage's (details.max_abs_diff_relative); details.ratio_without_writes "
                  "leaves out the stage's output writer (curate shards, indexes, unit record), which the bare "
                  "loop has no part of", details=details)


# ---------------------------------------------------------------------------------------------------------
# 18b: a threshold change
# ---------------------------------------------------------------------------------------------------------


class Calls:
    """Counts, in this process, the calls that cost: scorer-model forwards, model-free score functions,
    cache encoder loads (the real functions wrapped, not replaced)."""

    def __init__(self):
        from latentmill.stages import cache, curate_scores

        self.free = 0
        self.loads = 0
        for name, fn in dict(curate_scores.SCORE_FUNCTIONS).items():
            curate_scores.SCORE_FUNCTIONS[name] = self._count(fn, "free")
        cache._load_encoders = self._count(cache._load_encoders, "loads")

    def _count(self, fn, attr: str):
        def counted(*a, **k):
            setattr(self, attr, getattr(self, attr) + 1)
            return fn(*a, **k)
        return counted

    def snapshot(self) -> dict[str, int]:
        from latentmill.stages import curate_models

        return {"model_forwards_image": curate_models.FORWARDS["image"],
                "model_forwards_text": curate_models.FORWARDS["text"], "model_free_scores": self.free,
                "encoder_loads": self.loads}


def prep_counts(recipe, calls: Calls) -> dict[str, Any]:
    """``run_stages_in_process(recipe)`` and what it cost: calls counted, samples cached and quarantined."""
    import contextlib

    from latentmill.pipelines.prep import run_stages_in_process
    from latentmill.stages import cache, curate

    before = calls.snapshot()
    with contextlib.redirect_stderr(io.StringIO()):
        result = run_stages_in_process(recipe)
    after = calls.snapshot()
    components = cache.component_report(result["cache"][2])["components"]
    counts = {k: after[k] - before[k] for k in after}
    counts.update(vae_encoded=components["vae"]["processed"], text_encoded=components["text"]["processed"])
    report = curate.report(result["curate"][2])
    counts.update(scored=report["scored"], scores_reused=report["scores_reused"],
                  curate_quarantined=result["curate"][1]["counts"]["quarantined"],
                  cached=result["cache"][1]["counts"]["out"])
    return counts


SCORER_CALLS = ("model_forwards_image", "model_forwards_text", "model_free_scores")
ENCODER_CALLS = ("vae_encoded", "text_encoded", "encoder_loads")


def threshold_change(args, work: Path, clip: Path, head: Path) -> Any:
    """Figure 18b: calls of a prep after only a threshold changed, against the first prep's."""
    import pyarrow.parquet as pq

    n = 24 if args.quick else 96
    src = work / "images-18b"
    make_images(src, n, seed=180)
    out = work / "out-18b"
    calls = Calls()
    t0 = time.perf_counter()
    first = prep_counts(recipe_for(src, out, clip, head), calls)
    assert first["cached"] == n and first["scored"] == n, first
    values = sorted(r["aesthetic"] for r in pq.read_table(out / "prep" / "scores.parquet").to_pylist())
    k = round(n * QUARANTINE_SHARE)
    assert values[k - 1] < values[k], "two samples share the aesthetic score at the cut"
    bound = (values[k - 1] + values[k]) / 2
    changed = prep_counts(recipe_for(src, out, clip, head, min_aesthetic=bound), calls)
    assert changed["curate_quarantined"] == k and changed["cached"] == n - k, changed
    back = prep_counts(recipe_for(src, out, clip, head), calls)  # the threshold removed: all come back
    assert back["cached"] == n, back
    log(f"18b: first {first}; after the change {changed}; back {back} ({time.perf_counter() - t0:.0f} s)")
    ours = sum(changed[c] for c in SCORER_CALLS + ENCODER_CALLS)
    base = sum(first[c] for c in SCORER_CALLS + ENCODER_CALLS)
    inputs = {"images": n, "image_sizes": "640x480, 480x640, 512x512, 768x432, 432x768, 600x600, 720x540, "
              "540x720 JPEG q90", "scorers": SCORERS, "batch_size": BATCH, "models": "tiny CLIP + LAION head "
              "(18a), tiny Flux set (data/tiny-flux.yaml)", "bucket_resolution": 128,
              "change": f"curate.min_aesthetic={bound:.6g} (between the {k}th and {k + 1}th lowest score: "
                        f"{k} of {n} quarantined)", "runner": "run_stages_in_process (no Prefect)"}
    details = {"first_prep": first, "after_threshold_change": changed, "threshold_removed_again": back,
               "ours_counts": list(SCORER_CALLS + ENCODER_CALLS)}
    return figure("18. threshold change on a prepared dataset: scorer calls and encoder calls", [ours],
                  [base], "calls", "<= 0", inputs, "ours: scorer-model forwards + model-free score calls + "
                  "cache components encoded + encoder loads in the prep after only curate.min_aesthetic "
                  "changed (a known quarter quarantined); baseline: the same counts of the first prep. "
                  "details: each count, and a third prep with the threshold removed (the quarantined samples "
                  "come back without being encoded again)", details=details)


def run(args) -> list:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per model load would drown the log
    work = fresh_dir("curate")
    from latentmill.tiny_clip import TINY_CLIP

    clip, head = scorer_models()
    reps = reps_of(args, full=5, quick=2)
    try:
        tiny = "18. curate scoring throughput, tiny scorers vs the bare model loop"
        figures = [throughput(args, work, clip, head, 128 if args.quick else 1024, reps, TINY_CLIP, tiny,
                              "<= 1.15")]
        small, small_head = small_clip_models()
        name = ("18. curate scoring throughput, a small CLIP (224 px, width 256, 4 layers) vs the bare "
                "model loop")
        figures.append(throughput(args, work, small, small_head, 64 if args.quick else 256, min(reps, 3),
                                  SMALL_CLIP, name, None))
        figures.append(threshold_change(args, work, clip, head))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return figures


def main(argv=None) -> None:
    run_benchmark("curate", __doc__, run, argv)


if __name__ == "__main__":
    main()
