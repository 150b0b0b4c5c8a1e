"""Figure 9: bytes per cached sample with the T5 embeddings trimmed to their real tokens vs padded.

Flux-class 512² samples (latent 16×64×64, pooled 768, T5 width 4096, all bf16) written with the cache
stage's shard writer, once with ``prompt_embeds`` of each caption's real token count (trimmed, as
``cache.trim_text: always`` stores them) and once padded to 512 tokens (FLUX.1-dev's
``max_sequence_length``; what ``trim_text: auto`` stores for Flux, see docs/cache-format.md). Bytes are
whole shard files (tar headers, JSON metadata included) divided by the sample count. Token counts: the
benchmark's generated captions (10–40 words) through the tiny set's T5 tokenizer (~1.5 tokens a word,
close to the real T5 tokenizer's rate), EOS included.

``details.cache_stage_tiny``: the same comparison through the real cache stage (tiny Flux set, 32
generated images, ``trim_text: always`` vs ``never``), its summary's ``bytes_per_sample``.

Sizes are deterministic, so one repetition. Run alone: ``python -m bench.disk --quick``.
"""

from __future__ import annotations

import random
import shutil
import statistics

from bench.common import (
    FLUX_512,
    TINY_RECIPE,
    WORK,
    figure,
    fresh_dir,
    log,
    make_caption,
    make_images,
    model_dir,
    run_benchmark,
    setup_env,
    shard_paths,
    write_latent_cache,
)

setup_env()

PAD_TO = 512


def run(args) -> list:
    from latentmill.stages.cache import component_report
    from latentmill.stages.shardio import StageDir
    from transformers import AutoTokenizer

    from bench.onthefly import prep_with_stages
    from bench.prep import recipe_for

    num = 32 if args.quick else 256
    work = fresh_dir("disk")
    pretrained = model_dir(TINY_RECIPE)
    tok = AutoTokenizer.from_pretrained(pretrained, subfolder="tokenizer_2")
    captions = [make_caption(random.Random(f"disk:{i}")) for i in range(num)]
    lengths = [min(PAD_TO, len(tok(c).input_ids)) for c in captions]
    spec = FLUX_512 | {"text_len": PAD_TO}

    sizes = {}
    for name, kwargs in (("trimmed", {"trimmed": True, "text_lengths": lengths}), ("padded", {})):
        manifest = write_latent_cache(work / name, num, spec, shard_samples=64, pad_to=PAD_TO, **kwargs)
        sizes[name] = sum(p.stat().st_size for p in shard_paths(work / name, manifest)) / num
        log(f"disk {name}: {sizes[name] / 1024:.0f} KiB per sample")

    # the real cache stage on the tiny set, trim_text always vs never
    make_images(work / "images", 32, seed=3)
    stage_bytes = {}
    for trim in ("always", "never"):
        recipe = recipe_for(work / "images", work / f"stage-{trim}", pretrained, cache={"trim_text": trim})
        prep_with_stages(recipe)

        stage_dir = StageDir(recipe.stage_dir("cache"), "cache")
        records = [stage_dir.load_record(u) for u in stage_dir.read_manifest()["units"]]
        stage_bytes[trim] = component_report(records)["bytes_per_sample"]

    inputs = {"samples": num, "sample": spec | {"dtype": "bfloat16"}, "pad_to": PAD_TO,
              "tokens_per_caption": {"mean": round(statistics.fmean(lengths), 1), "min": min(lengths),
                                     "max": max(lengths)},
              "tokenizer": "tiny set's T5 tokenizer (bench/.work/models/tiny-flux/tokenizer_2)"}
    return [figure("9. disk bytes per cached sample, T5 embeddings trimmed vs padded to 512", [sizes["trimmed"]],
                   [sizes["padded"]], "bytes/sample", None, inputs,
                   "no goal in the issue; Flux's default trim_text: auto stores the padded form (the pipeline "
                   "feeds T5 pad-token embeddings to the transformer), trim_text: always the trimmed one",
                   details={"cache_stage_tiny": stage_bytes})]


def run_and_clean(args) -> list:
    figures = run(args)
    if not args.keep:
        shutil.rmtree(WORK / "disk", ignore_errors=True)
    return figures


def main(argv=None) -> None:
    run_benchmark("disk", __doc__, run_and_clean, argv)


if __name__ == "__main__":
    main()
