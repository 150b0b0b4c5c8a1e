"""The latentmill command: prep, train, run, demo, inspect, verify, plan, gc, compact, pin, unpin, doctor, sample, push,
init, serve, compare.

    latentmill prep CONFIG [key.path=value ...] [--summary-json PATH]
    latentmill train CONFIG [key.path=value ...] [--nproc N] [--nnodes M --rdzv-endpoint HOST:PORT]
                     [--summary-json PATH]
    latentmill run CONFIG [key.path=value ...] [--nproc N] [--nnodes M --rdzv-endpoint HOST:PORT]
                   [--summary-json PATH]
    latentmill demo [key.path=value ...] [--summary-json PATH]
    latentmill inspect PATH [key.path=value ...]   (a recipe with its defaults, an output_dir, a snapshot or a stage)
    latentmill inspect --plots OUT PATH   (PNG score and bucket histograms, quarantine contact sheets, index.md)
    latentmill verify PATH         (re-hash shards against their manifests; exit 1 on any mismatch)
    latentmill plan CONFIG [key.path=value ...] [--nproc N] [--nnodes M] [--gpu-memory GiB] [--suggest] [--json PATH]
                   (per-rank memory of the run, from its config files on the meta device)
    latentmill gc OUTPUT --keep N [--dry-run] [--json PATH]
                   (remove what neither the newest N snapshots nor a pinned one references)
    latentmill pin OUTPUT [SNAPSHOT] / latentmill unpin OUTPUT SNAPSHOT   (gc keeps a pinned snapshot)
    latentmill compact OUTPUT [--small-below F] [--dry-run] [--json PATH]
                   (merge the cache's small shards byte for byte, publish the result as a snapshot)
    latentmill init DIR [--images FOLDER]   (DIR/recipe.yaml: a starter recipe for your images; and the examples)
    latentmill doctor [CONFIG] [--device auto|cuda|cpu] [--json PATH]   (exit 0 good, 1 blocking, 2 warnings)
    latentmill sample EXPORT_OR_CHECKPOINT --prompt TEXT [--prompts FILE] [--batch N] [--steps S]
                   [--size WxH[xF]] [--repeat K] [--compile] [--base PIPELINE] [--out DIR]
    latentmill serve start|stop [--port N] [--home DIR]   (local Prefect server + UI, worker, deployments)
    latentmill compare RUN_A RUN_B [--plot FILE]   (settings, snapshot and loss curves of two runs side by side)

CONFIG is a recipe file, or the name of a shipped example recipe (``demo``, ``demo-video``, ...).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

DEMO_CONFIG = "demo"  # the shipped example recipe (latentmill.resources): writes ./outputs/demo
DESCRIPTION = "Prepare latent caches of images and videos (Prefect flows) and train flow-matching models on them."
EPILOG = ("CONFIG is a recipe file, or the name of a shipped example recipe (demo, demo-video, ...). "
          "Every command has its own help: latentmill COMMAND --help.")


def version() -> str:
    """The installed distribution's version; in a checkout that is not installed, pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("latentmill")
    except PackageNotFoundError:
        import re

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return found.group(1) if found else "unknown"


class _Version(argparse.Action):
    """``--version``: the version is looked up only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"latentmill {version()}")
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="latentmill", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in [("prep", "prepare the latent cache"), ("train", "train on a prepared latent cache"),
                       ("run", "prep, then train"), ("demo", "run the embedded default end to end")]:
        p = sub.add_parser(name, help=text)
        if name != "demo":
            p.add_argument("config", help="YAML recipe, e.g. configs/demo.yaml")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_steps=200")
        p.add_argument("--summary-json", type=Path, help="write the run summary here as JSON")
        if name in ("train", "run"):
            p.add_argument("--nproc", type=int, default=1, help="processes on this node (torchrun when > 1)")
        if name in ("train", "run"):
            p.add_argument("--nnodes", type=int, help="nodes, each running this same command (default: "
                                                       "parallel.nnodes, else 1)")
            p.add_argument("--rdzv-endpoint", help="HOST:PORT of the first node, for --nnodes > 1")
    for name, text in [("inspect", "show a recipe with its defaults, or a snapshot's or stages' report"),
                       ("verify", "re-hash shards against their manifests")]:
        p = sub.add_parser(name, help=text)
        p.add_argument("path", help="a recipe (.yaml, or a shipped name such as demo), an output_dir (a folder "
                                    "or an object-store URL), a snapshot or stage folder")
        if name == "inspect":
            p.add_argument("overrides", nargs="*", help="dotted overrides of a recipe, e.g. trainer.max_steps=200")
            p.add_argument("--plots", type=Path, metavar="OUT",
                           help="write PNG pictures of the prep into OUT (needs matplotlib: latentmill[plots])")
    p = sub.add_parser("plan", help="per-rank memory of a run from its config files (meta device, fake ranks)")
    p.add_argument("config", help="YAML recipe, e.g. configs/flux-dev-full.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.hsdp_replicate=1")
    p.add_argument("--nproc", type=int, help="processes (GPUs) per node (default: 8; 1 for strategy none)")
    p.add_argument("--nnodes", type=int, help="nodes (default: parallel.nnodes, else parallel.hsdp_replicate for "
                                              "HSDP, else 1)")
    p.add_argument("--gpu-memory", type=float, help="GiB per GPU for the fits check (default 80)")
    p.add_argument("--suggest", action="store_true",
                   help="name the smallest parallel.cp_size and the activation checkpointing setting that fit "
                        "--gpu-memory")
    p.add_argument("--json", type=Path, help="write the plan here as JSON")
    p = sub.add_parser("gc", help="remove snapshots, unit records and shards no kept or pinned snapshot uses")
    p.add_argument("output", help="an output_dir (a folder or an object-store URL)")
    p.add_argument("--keep", type=int, required=True, help="keep the newest N snapshots (and pinned ones)")
    p.add_argument("--dry-run", action="store_true", help="report what would be freed; delete nothing")
    p.add_argument("--json", type=Path, help="write the report here as JSON")
    p = sub.add_parser("compact", help="merge the cache's small shards into full-size ones (nothing re-encoded)")
    p.add_argument("output", help="an output_dir (a folder or an object-store URL)")
    p.add_argument("--small-below", type=float, default=0.5,
                   help="a unit is small under this fraction of cache.shard_bytes (default 0.5)")
    p.add_argument("--dry-run", action="store_true", help="report what would be merged; write nothing")
    p.add_argument("--json", type=Path, help="write the report here as JSON")
    for name, text in [("pin", "keep a snapshot through every gc (no SNAPSHOT: list the pins)"),
                       ("unpin", "let gc remove a snapshot again")]:
        p = sub.add_parser(name, help=text)
        p.add_argument("output", help="an output_dir (a folder or an object-store URL)")
        p.add_argument("snapshot", nargs="?" if name == "pin" else None, help="a snapshot name, or latest")
    p = sub.add_parser("doctor", help="check this machine for a run: torch/CUDA/driver, GPUs, disk, decoders, APIs")
    p.add_argument("config", nargs="?", help="a recipe: also check disk and volume at its output_dir")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA is requested when nvidia-smi shows a GPU (default)")
    p.add_argument("--json", type=Path, help="write every check here as JSON")
    p = sub.add_parser("sample", help="generate from an export or a training checkpoint, timed honestly")
    p.add_argument("source", type=Path, help="a pipeline export, a LoRA export, or a checkpoint <run>/checkpoints/step-N")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts", type=Path, help="a file of prompts, one per line")
    p.add_argument("--base", help="the base pipeline (folder or hub id) of a LoRA export or checkpoint")
    p.add_argument("--batch", type=int, help="images per pipeline call (default: the number of prompts)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps (default 8)")
    p.add_argument("--size", help="WxH, or WxHxF for video (default 512x512; video 512x512x33)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first call; call c uses seed + c")
    p.add_argument("--repeat", type=int, default=3, help="timed calls after the warm-up call (default 3)")
    p.add_argument("--compile", action="store_true", help="torch.compile the transformer; report compile time")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--device", default="auto", help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--max-sequence-length", type=int, help="text tokens (default: the pipeline's)")
    p.add_argument("--guidance-scale", type=float, help="guidance (default: the pipeline's)")
    p.add_argument("--out", type=Path, default=Path("samples"), help="output folder (default ./samples)")
    p = sub.add_parser("push", help="upload an export (model repo, with its card) or a snapshot (dataset repo) to the Hub")
    p.add_argument("path", type=Path, help="an export folder (<output_dir>/export) or a snapshot folder "
                                           "(<output_dir>/snapshots/<name>)")
    p.add_argument("--repo-id", required=True, help="OWNER/NAME on the Hub (made if missing)")
    p.add_argument("--private", action="store_true", help="make a new repository private")
    p = sub.add_parser("compare", help="two training runs side by side: settings, snapshots, losses at equal steps")
    p.add_argument("run_a", type=Path, help="a run folder (<output_dir>/train/runs/<run>) or an output_dir")
    p.add_argument("run_b", type=Path, help="the other run")
    p.add_argument("--plot", type=Path, help="also draw both runs' loss curves into this PNG")
    p = sub.add_parser("init", help="write a starter recipe for your images, with the example recipes and demo data")
    p.add_argument("folder", type=Path, help="where to write them (made if missing; no file is overwritten)")
    p.add_argument("--images", type=Path, help="your images (a folder); default: FOLDER/images, made empty")
    p = sub.add_parser("serve", help="a local Prefect server and UI, a process worker and the deployments")
    p.add_argument("action", choices=["start", "stop"])
    p.add_argument("--port", type=int, help="API and UI port on 127.0.0.1 (default 4200)")
    p.add_argument("--home", type=Path, help="PREFECT_HOME: the server's state, logs and PIDs (default ./.prefect)")
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true",
                       help="on an error, show the traceback and Prefect's log (also: LATENTMILL_DEBUG=1)")
    return parser


def _print_summary(summary: dict[str, Any], recipe_output: str | None) -> None:
    if summary.get("unchanged_since"):
        print(f"\nnothing changed since the prep that finished {summary['unchanged_since']} (recipe, inputs, "
              "models): no stage ran, its outcome stands")
    stages = summary.get("stages") or {}
    if stages:
        print("\nstage      in   out  quar  processed  reused   seconds")
        for name, s in stages.items():
            print(f"{name:<8} {s['in']:>4} {s['out']:>5} {s['quarantined']:>5} {s['processed']:>10} "
                  f"{s['reused']:>7} {s['seconds']:>9.1f}")
        curated = stages.get("curate") or {}
        if "scored" in curated:
            reasons = "; ".join(f"{n} × {r}" for r, n in (curated.get("quarantined_by_reason") or {}).items())
            table = f", table {curated['scores_table']}" if curated.get("scores_table") else ""
            print(f"curate: {curated['scored']} scored, {curated['scores_reused']} scores reused{table}"
                  + (f"; quarantined: {reasons}" if reasons else ""))
            if "clips_scored" in curated:  # videos scored per clip; bucket quarantines the failed clips
                print(f"curate clips: {curated['clips_scored']} scored, {curated['clip_scores_reused']} reused, "
                      f"{curated['clips_below_threshold']} beyond a threshold")
            near = curated.get("near_duplicates")
            if near:  # decided by the index here, quarantined by the bucket stage
                print(f"near duplicates (cosine >= {near['threshold']:g}, {near['search']} search over "
                      f"{near['indexed']} embeddings): {near['new_near_duplicates']} new, "
                      f"{near['near_duplicates']} in all")
        rewritten = (stages.get("caption") or {}).get("rewritten_by_rule")
        if rewritten:  # post-processing rules that changed captions, e.g. strip_prefixes on model captions
            print("caption: rewritten by rule: " + ", ".join(f"{k} {v}" for k, v in rewritten.items()))
        buckets = (stages.get("bucket") or {}).get("buckets")
        if buckets:
            print("buckets (WxHxF: samples): " + ", ".join(f"{k}: {v}" for k, v in buckets.items()))
        merged = (stages.get("cache") or {}).get("compaction")
        if merged:
            print(f"compacted: {merged['merged_units']} small cache units ({merged['shards_before']} shards, "
                  f"{merged['samples']} samples) into {merged['shards_after']} shards, byte for byte")
        for name, s in stages.items():
            if s.get("warning"):
                print(f"WARNING {name}: {s['warning']}")
    snapshot = summary.get("snapshot")
    if snapshot:
        print(f"snapshot: {snapshot['name']} ({'new' if snapshot['new'] else 'unchanged'}) at {snapshot['path']}")
    if summary.get("plots"):
        print(f"pictures: {summary['plots']} (scores, buckets, quarantined samples)")
    train = summary.get("train")
    if train and train.get("steps") is None:
        print(f"train: {train.get('note', 'no summary on this node')}")
    elif train:
        again = " (already trained on this snapshot with this recipe: nothing redone)" if train.get(
            "already_trained") else ""
        print(f"train: {train['steps']} steps, final loss {train['final_loss']:.4f}, "
              f"{train['samples_per_s']:.1f} samples/s, data wait {100 * train['data_wait_fraction']:.1f}%, "
              f"peak RSS {train['peak_rss_mb']:.0f} MB{again}")
        if train.get("run_dir"):
            print(f"training run: {train['run_dir']} (snapshot {train.get('snapshot', '?')})")
        if train.get("export_dir"):
            what = "LoRA adapter" if train.get("mode") == "lora" else "pipeline"
            print(f"exported {what}: {train['export_dir']}")
    if summary.get("sample"):
        print(f"sample image: {summary['sample']}")
    if recipe_output:
        print(f"outputs under: {recipe_output}")


def _sample_image(train: dict[str, Any], output_dir: Path) -> Path:
    """One image from the run's export, loaded as a user would (a pipeline, or the base pipeline with the LoRA
    adapter); saved in the run's folder, ``<output_dir>/sample.png`` links to it."""
    import torch
    from diffusers import DiffusionPipeline

    from latentmill.pipelines.runs import relink

    path = Path(train["run_dir"]) / "sample.png"
    if not path.is_file():  # a run trained before: its sample is there already
        export = Path(train["export_dir"])
        if (export / "model_index.json").is_file():
            pipe = DiffusionPipeline.from_pretrained(export)
        else:
            base = json.loads((Path(train["run_dir"]) / "run.json").read_text())["summary"]["pretrained"]
            pipe = DiffusionPipeline.from_pretrained(base)
            pipe.load_lora_weights(export)
        # prompt by keyword: Flux2KleinPipeline's first argument is a reference image. FLUX.2 [dev]'s system
        # message alone fills 32 tokens (of the tiny tokenizer; ~40 of the real one): 64 leave room for the prompt.
        tokens = 64 if type(pipe).__name__ == "Flux2Pipeline" else 32
        image = pipe(prompt="a red circle on a blue background", height=128, width=128, num_inference_steps=8,
                     generator=torch.Generator().manual_seed(0), max_sequence_length=tokens).images[0]
        image.save(path)
    relink(output_dir / "sample.png", path)
    return output_dir / "sample.png"


def _import_encoders(recipe: Any) -> None:
    """Import the model family's encoder classes (``stages.families.import_encoder_classes``); a problem is
    left to the cache stage, which reports it in context."""
    from latentmill.stages.families import detect_family, import_encoder_classes

    try:
        import_encoder_classes(detect_family(recipe.model))
    except Exception:  # noqa: BLE001 (a family that cannot be told, a broken install: the stage says it)
        pass


def _checked_recipe(command: str, config: str | Path, overrides: list[str]) -> Any:
    """The recipe, validated (keys, values) and checked (paths, models, source, snapshot) before torch, Prefect
    or the flows are imported: a wrong key or path fails in about a second."""
    from latentmill.preflight import check_recipe
    from latentmill.recipe import load_recipe

    recipe = load_recipe(config, overrides)
    check_recipe(recipe, command)
    return recipe


def _run_flow(command: str, config: str | Path, overrides: list[str], recipe: Any, nproc: int = 1, nnodes: int = 1,
              rdzv_endpoint: str | None = None, source: str | None = None) -> tuple[dict, str]:
    """Run the flow of ``prep``, ``train`` or ``run`` on a checked recipe (``latentmill.prefect_env.run_command``);
    the summary and the recipe's output_dir. ``source``: the unchanged check's source signature (``prep``)."""
    from latentmill.prefect_env import run_command

    def prepare():
        from latentmill.pipelines.flows import Launch, check_launch, prep, prep_then_train, train

        if command != "prep":
            check_launch(recipe, Launch(nproc, nnodes, rdzv_endpoint))
        if command != "train" and recipe.prep.on_busy == "fail":  # fail before Prefect starts, naming the writer
            from latentmill.core.store import is_url
            from latentmill.pipelines import objectstore, retention

            (objectstore.check_not_busy if is_url(recipe.output_dir) else retention.check_not_busy)(recipe.output_dir)
        if command == "prep":
            return functools.partial(prep, str(config), overrides, source)
        if command == "train":
            return functools.partial(train, str(config), overrides, nproc, nnodes, rdzv_endpoint)
        return functools.partial(prep_then_train, str(config), overrides, nproc, nnodes, rdzv_endpoint)

    # the cache stage needs the encoder classes (a refresh's too): imported while the temporary server boots
    while_booting = None if command == "train" else functools.partial(_import_encoders, recipe)
    summary = run_command(prepare, while_booting=while_booting)
    return summary, recipe.output_dir


def _retention_command(args: argparse.Namespace) -> int:
    """``compact``, ``gc``, ``pin`` and ``unpin`` (``latentmill.pipelines.retention``, ``.compaction``; on an
    object store ``latentmill.pipelines.objectstore``): no Prefect, no models."""
    from latentmill.core.config import ConfigError
    from latentmill.core.store import check_store, is_url
    from latentmill.pipelines import retention

    if args.command == "gc" and args.keep < 1:
        raise ConfigError(f"--keep: must be >= 1 (the newest snapshot is always kept), got {args.keep}")
    if args.command == "compact" and not 0 < args.small_below <= 1:
        raise ConfigError(f"--small-below: a fraction of cache.shard_bytes in (0, 1], got {args.small_below}")
    if is_url(args.output):  # an output on an object store: the same commands, the store's way
        from latentmill.pipelines import objectstore

        check_store(args.output)
        gc, compact = objectstore.gc_store, objectstore.compact_store
        list_pins, pin, unpin = objectstore.store_pins, objectstore.pin_store, objectstore.unpin_store
    else:
        from latentmill.pipelines.compaction import compact

        args.output = Path(args.output)
        if not args.output.is_dir():
            raise FileNotFoundError(f"{args.output} does not exist")
        gc, list_pins, pin, unpin = retention.gc, retention.list_pins, retention.pin, retention.unpin
    report = None
    if args.command == "compact":
        from latentmill.pipelines.compaction import format_report

        report = compact(args.output, args.small_below, dry_run=args.dry_run)
        print(format_report(report))
    elif args.command == "gc":
        report = gc(args.output, args.keep, dry_run=args.dry_run)
        print(retention.format_report(report))
    elif args.command == "pin" and args.snapshot is None:
        pins = list_pins(args.output)
        for name, holders in sorted(pins.items()):
            print(f"{name}: " + ", ".join("pinned by user" if h.get("pid") is None
                                          else f"training PID {h['pid']} on {h['host']}" for h in holders))
        if not pins:
            print(f"no pinned snapshot in {args.output}")
    elif args.command == "pin":
        name = pin(args.output, args.snapshot)
        print(f"pinned {name}: gc keeps it until `latentmill unpin {args.output} {name}`")
    elif unpin(args.output, args.snapshot):
        print(f"unpinned {args.snapshot}: the next gc may remove it unless it is among the newest kept")
    else:
        raise FileNotFoundError(f"{args.snapshot} is not pinned in {args.output} (`latentmill pin "
                                f"{args.output}` lists the pins)")
    if report is not None and "store" in report:
        store = report["store"]
        print(f"deleted {store['deleted']} objects from {args.output}" if "deleted" in store else
              f"downloaded {store['downloaded']} objects ({store['bytes_downloaded'] / 1e6:.3f} MB), uploaded "
              f"{store['uploaded']} objects ({store['bytes_uploaded'] / 1e6:.3f} MB) to {args.output}")
    if report is not None and args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


def _interrupted_line(err: BaseException) -> str:
    """The one line a stopped command prints: what was kept, and how to go on."""
    return f"interrupted; {getattr(err, 'detail', '') or 'run the same command again to resume'}"


def _quiet_when_stdout_closes(command: Any) -> Any:
    """Run ``command``; when the reader of stdout goes away (``latentmill inspect ... | head -3``), exit 1
    without a traceback, as the Python documentation's SIGPIPE note does, instead of ``BrokenPipeError``."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> int:
        try:
            code = command(*args, **kwargs)
            sys.stdout.flush()  # here, where it is caught, not in the interpreter's exit
            return code
        except BrokenPipeError:
            # the interpreter flushes stdout again at exit: point it at /dev/null so that flush is silent
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1

    return run


@_quiet_when_stdout_closes
def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``latentmill`` console script."""
    parser = _parser()
    # Overrides may come after options (`run cfg --nproc 1 trainer.max_steps=5`): collect them all.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    debug = args.debug or os.environ.get("LATENTMILL_DEBUG", "") not in ("", "0")
    # The pod's persistent volume (recipe key `volume`, else $LATENTMILL_VOLUME): HF_HOME, the weight-hash
    # store and PREFECT_HOME go under it before Hugging Face or Prefect reads them (latentmill.volume).
    from latentmill.volume import apply_volume, peek_recipe_volume

    config = DEMO_CONFIG if args.command == "demo" else getattr(args, "config", None)
    try:
        layout = apply_volume(peek_recipe_volume(config, getattr(args, "overrides", None)))
    except Exception as err:  # a ConfigError naming the key or the variable
        print(f"latentmill: error: {err}", file=sys.stderr)
        return 2
    if args.command == "serve" and args.home is None and layout.root is not None:
        args.home = Path(os.environ["PREFECT_HOME"])
    # Progress bars, the summary and one error line are the CLI's output: Prefect's INFO lines would drown
    # them, and its ERROR lines repeat a failure's traceback (shown with --debug). Not for `serve`: its server,
    # worker and flow runs inherit this environment, and their INFO lines are the runs' Logs tab.
    if args.command != "serve":
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING" if debug else "CRITICAL")
    from latentmill.prefect_env import set_command_environment

    set_command_environment()  # no telemetry, a longer start-up for the temporary API (latentmill.prefect_env)
    if getattr(args, "summary_json", None):
        args.summary_json = args.summary_json.resolve()
    from latentmill.core.config import ConfigError
    from latentmill.core.store import StoreError
    from latentmill.interrupt import Interrupted
    from latentmill.models import CacheMismatchError
    from latentmill.pipelines.retention import OutputBusyError
    from latentmill.pipelines.snapshot import EmptySnapshotError
    from latentmill.plots import MissingExtra

    try:
        if args.command in ("inspect", "verify"):
            from latentmill.core.store import check_store, is_url
            from latentmill.inspect import inspect_path, plot_path, verify_path

            if is_url(args.path):  # an output on an object store (latentmill.pipelines.objectstore)
                from latentmill.pipelines import objectstore

                check_store(args.path)
                if args.command == "verify":
                    return objectstore.verify_store(args.path)
                args.path = objectstore.local_view(args.path)
            args.path = Path(args.path)
            if args.command == "inspect" and args.plots is not None:
                return plot_path(args.path, args.plots)
            return inspect_path(args.path, args.overrides) if args.command == "inspect" else verify_path(args.path)
        if args.command == "plan":
            from latentmill.plan import format_plan, plan_config

            result = plan_config(args.config, args.overrides, nproc=args.nproc, nnodes=args.nnodes,
                                 gpu_memory_gib=args.gpu_memory, with_suggestion=args.suggest)
            print(format_plan(result))
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(result, indent=2))
            return 0
        if args.command in ("compact", "gc", "pin", "unpin"):
            return _retention_command(args)
        if args.command == "doctor":
            from latentmill.doctor import doctor

            return doctor(args.config, getattr(args, "overrides", None), device=args.device, json_path=args.json)
        if args.command == "sample":
            from latentmill.sample import format_report, parse_size, read_prompts, sample

            report = sample(args.source, read_prompts(args.prompt, args.prompts), out=args.out, base=args.base,
                            batch=args.batch, steps=args.steps, size=parse_size(args.size) if args.size else None,
                            seed=args.seed, repeat=args.repeat, compile=args.compile,
                            compile_backend=args.compile_backend, device=args.device,
                            max_sequence_length=args.max_sequence_length, guidance_scale=args.guidance_scale)
            print(format_report(report))
            return 0
        if args.command == "push":
            from latentmill.push import push

            pushed = push(args.path, args.repo_id, private=args.private)
            print(f"pushed {len(pushed['files'])} files to {pushed['url']} ({pushed['repo_type']} repo, commit "
                  f"{pushed['commit'][:12]})")
            return 0
        if args.command == "compare":
            from latentmill.compare import compare_runs, format_comparison, plot_comparison

            result = compare_runs(args.run_a, args.run_b)
            print(format_comparison(result))
            if args.plot:
                print(f"\nplot: {plot_comparison(result, args.plot)}")
            return 0
        if args.command == "init":
            from latentmill.resources import init_folder, write_starter_recipe

            recipe, images = write_starter_recipe(args.folder, args.images)
            copied = init_folder(args.folder)
            print(f"wrote {recipe}: a starter recipe for the images in {images} (tiny models for a CPU trial; "
                  "the comment under model: says what to change for a real model)")
            print(f"copied {len(copied)} example files into {args.folder} (example recipes in configs/, tiny-model "
                  "recipes and demo data in data/)")
            print(f"next: latentmill prep {recipe}" + ("" if args.images else f"  (after putting images in {images})"))
            return 0
        if args.command == "serve":
            from latentmill.pipelines.serve import main as serve_main

            return serve_main([args.action, *(["--port", str(args.port)] if args.port else []),
                               *(["--home", str(args.home)] if args.home else [])])
        recipe = _checked_recipe("run" if args.command == "demo" else args.command,
                                 DEMO_CONFIG if args.command == "demo" else args.config, args.overrides)
        from latentmill.interrupt import stop_on_signals

        # Ctrl-C and SIGTERM stop the work at its next safe point (latentmill.interrupt), not where they land
        with stop_on_signals():
            summary, out, source = None, recipe.output_dir, None
            if args.command == "prep":  # nothing changed since the last prep: its outcome, without Prefect
                from latentmill.pipelines.unchanged import check

                summary, source = check(recipe)
            if summary is None and args.command == "demo":
                summary, out = _run_flow("run", DEMO_CONFIG, args.overrides, recipe)
                if summary["train"].get("export_dir"):
                    summary["sample"] = str(_sample_image(summary["train"], Path(out)))
            elif summary is None:
                summary, out = _run_flow(args.command, args.config, args.overrides, recipe, getattr(args, "nproc", 1),
                                         recipe.parallel.launch_nodes(getattr(args, "nnodes", None)),
                                         getattr(args, "rdzv_endpoint", None), source)
    except (ConfigError, CacheMismatchError, FileNotFoundError, FileExistsError, EmptySnapshotError,
            MissingExtra, StoreError) as err:
        if debug:
            traceback.print_exc()
        print(f"latentmill: error: {err}", file=sys.stderr)
        return 2
    except (Interrupted, KeyboardInterrupt) as err:
        if debug:
            traceback.print_exc()
        print(f"latentmill: {_interrupted_line(err)}", file=sys.stderr)
        return err.exit_code if isinstance(err, Interrupted) else 130
    except OutputBusyError as err:  # another prep, gc or compaction writes the output_dir (prep.on_busy=fail)
        print(f"latentmill: error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader of stdout is gone (| head): _quiet_when_stdout_closes ends quietly
        raise
    except Exception as err:  # a failure we did not foresee: one line, the traceback on request
        if debug:
            raise
        print(f"latentmill: error: {type(err).__name__}: {err} (run again with --debug, or LATENTMILL_DEBUG=1, "
              "for the traceback)", file=sys.stderr)
        return 1
    except BaseException as err:  # SIGTERM while Prefect's own handler was in place: its TerminationSignal
        from prefect.exceptions import TerminationSignal

        if not isinstance(err, TerminationSignal):
            raise
        if debug:
            traceback.print_exc()
        print(f"latentmill: {_interrupted_line(err)}", file=sys.stderr)
        return 128 + err.signal
    _print_summary(summary, out)
    if args.summary_json:
        args.summary_json.parent.mkdir(parents=True, exist_ok=True)
        args.summary_json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
