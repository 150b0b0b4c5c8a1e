"""Test helpers for the trainer room: tiny Flux / Wan transformers saved like a pipeline, and fake latent caches.

The fake cache is written as the cache stage writes it (docs/cache-format.md, format 3), through the stages'
own shard writer (``latentmill.stages.shardio.StageDir`` / ``UnitOutput``): unit records, webdataset tars with
``k.vae.safetensors``, ``k.text.safetensors``, ``k.json`` and an index beside each, a manifest with ``family``,
``latents``, ``text``, ``empty_prompt`` and each shard's ``index``; so the trainer is tested through its real
reading path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

TINY_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(4, 6, 6),
    guidance_embeds=True,
)
TEXT_DIM, POOLED_DIM, SEQ_LEN = 32, 32, 8

# The transformer of data/tiny-wan.yaml (WanTransformer3DModel), for trainer tests that need no VAE.
TINY_WAN_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    num_layers=1,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
)


def build_tiny_transformer(root: str | Path, seed: int = 0) -> Path:
    """Save a random tiny ``FluxTransformer2DModel`` to ``<root>/transformer``; return ``root``."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    FluxTransformer2DModel(**TINY_TRANSFORMER).save_pretrained(Path(root) / "transformer")
    return Path(root)


def build_tiny_wan_transformer(root: str | Path, seed: int = 0) -> Path:
    """Save a random tiny ``WanTransformer3DModel`` to ``<root>/transformer``; return ``root``."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    WanTransformer3DModel(**TINY_WAN_TRANSFORMER).save_pretrained(Path(root) / "transformer")
    return Path(root)


def _text_tensors(family: str, n_tokens: int, text_dim: int, pooled_dim: int, dtype, gen) -> dict:
    tensors = {"prompt_embeds": torch.randn(n_tokens, text_dim, generator=gen).to(dtype).contiguous()}
    if family == "flux":
        tensors["pooled_prompt_embeds"] = torch.randn(pooled_dim, generator=gen).to(dtype).contiguous()
    if family.startswith("hunyuanvideo1.5"):  # ByT5 glyph tokens: none (no quoted text) to 3
        glyphs = int(torch.randint(0, 4, (1,), generator=gen))
        tensors["prompt_embeds_2"] = torch.randn(glyphs, text_dim, generator=gen).to(dtype).contiguous()
    return tensors


def write_fake_cache(
    cache_dir: str | Path,
    buckets: dict[tuple[int, int, int], int],
    *,
    seed: int = 0,
    shards_per_bucket: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    seq_len: int = SEQ_LEN,
    text_dim: int = TEXT_DIM,
    pooled_dim: int = POOLED_DIM,
    channels: int = 16,
    smooth: bool = False,
    family: str = "flux",
    trimmed: bool = False,
    latents: str = "mean",
    same: bool = False,
    streams: list[dict] | None = None,
    reference: bool = False,
) -> dict:
    """Write a cache-stage output: ``buckets`` maps [width, height, frames] -> sample count. Returns the manifest.

    Latents are random normal, [channels, H/8, W/8] for ``family`` flux and [channels, (F-1)/4+1, H/8, W/8]
    for wan (H/16, W/16 for wan2.2-ti2v; ``smooth``: one random value per channel, constant over space and time, which a tiny model can
    memorise in a few dozen steps); ``latents="distribution"`` adds a ``latents_std`` in [0.05, 0.15).
    Text embeddings are random normal; ``trimmed``: each sample holds 2..seq_len real tokens and the
    manifest says ``text: {trimmed: true, pad_to: seq_len}``. ``empty_prompt.safetensors`` holds the empty
    caption's tensors (one token). Keys ``s00000``... are unique over the whole cache. Each shard holds one
    bucket; shards are one unit each, named in the order they are written (so the manifest lists them in
    that order). ``same``: every sample of a bucket holds the same tensors (its first sample's), so any
    batching of the bucket has the same content. ``streams``: the manifest's streams (none by default: the
    family's, as a manifest written before streams were recorded). ``reference``: each sample also holds
``reference_latents`` (an edit pair's source, random, of the latents' shape). ``old_cache`` turns the result into a format 1 or 2 cache.
    """
    from latentmill.stages.shardio import StageDir, WorkUnit

    cache_dir = Path(cache_dir)
    stage = StageDir(cache_dir, "cache").ensure()
    gen = torch.Generator().manual_seed(seed)
    records, n = [], 0
    for bucket, count in buckets.items():
        width, height, frames = bucket
        bucket_start = gen.get_state()
        per_shard = -(-count // shards_per_bucket)
        for start in range(0, count, per_shard):
            in_shard = min(per_shard, count - start)
            samples = []
            for _ in range(in_shard):
                if same:
                    gen.set_state(bucket_start)
                key = f"s{n:05d}"
                down = 16 if family == "wan2.2-ti2v" or family.startswith("hunyuanvideo1.5") else 8  # 16x VAEs
                space = (height // down, width // down)
                if family.startswith(("wan", "hunyuanvideo1.5")):
                    space = ((frames - 1) // 4 + 1, *space)
                if smooth:
                    x = torch.randn(channels, *[1] * len(space), generator=gen).expand(-1, *space)
                else:
                    x = torch.randn(channels, *space, generator=gen)
                vae = {"latents": x.to(dtype).contiguous()}
                if family in ("wan2.1-i2v", "wan2.2-i2v"):  # the first-frame conditioning
                    vae["condition_latents"] = torch.randn(x.shape, generator=gen).to(dtype).contiguous()
                if family == "wan2.1-i2v":  # the tiny CLIP's image embedding: 17 tokens of 32
                    vae["image_embeds"] = torch.randn(17, 32, generator=gen).to(dtype).contiguous()
                if family == "hunyuanvideo1.5-i2v":  # the first frame's latent and the tiny SigLIP's 16 tokens of 16
                    vae["image_latents"] = torch.randn(x.shape[0], 1, *x.shape[2:], generator=gen).to(dtype).contiguous()
                    vae["image_embeds"] = torch.randn(16, 16, generator=gen).to(dtype).contiguous()
                if reference:
                    vae["reference_latents"] = torch.randn(x.shape, generator=gen).to(dtype)
                if latents == "distribution":
                    std = 0.05 + 0.1 * torch.rand(channels, *space, generator=gen)
                    vae["latents_std"] = std.to(dtype).contiguous()
                n_tokens = int(torch.randint(2, seq_len + 1, (1,), generator=gen)) if trimmed else seq_len
                text = _text_tensors(family, n_tokens, text_dim, pooled_dim, dtype, gen)
                meta = {"key": key, "bucket": list(bucket), "caption": f"caption {n}"}
                samples.append(
                    {
                        "__key__": key,
                        "vae.safetensors": save_safetensors(vae),
                        "text.safetensors": save_safetensors(text),
                        "json": json.dumps(meta).encode(),
                    }
                )
                n += 1
            # the unit id leads with the shard's number: shard names sort in the order they were written
            content = hashlib.sha256(b"".join(v for s in samples for k, v in sorted(s.items()) if k[0] != "_"))
            unit = WorkUnit(f"{len(records):016x}{content.hexdigest()[16:]}", [], {}, in_shard)

            def process(unit, out, samples=samples, bucket=bucket):
                for sample in samples:
                    out.add(sample, bucket=list(bucket))

            records.append(stage.run_unit(unit, process))
    if family.startswith("wan"):
        models = {
            "vae": {
                "class": "AutoencoderKLWan",
                "fingerprint": "0" * 64,
                "latents_mean": [0.0] * channels,
                "latents_std": [1.0] * channels,
            },
            "text_encoder": {"class": "UMT5EncoderModel", "fingerprint": "1" * 64},
        }
    else:
        models = {
            "vae": {
                "class": "AutoencoderKL",
                "fingerprint": "0" * 64,
                "scaling_factor": 0.3611,
                "shift_factor": 0.1159,
            },
            "text_encoder": {"class": "CLIPTextModel", "fingerprint": "1" * 64},
            "text_encoder_2": {"class": "T5EncoderModel", "fingerprint": "2" * 64},
        }
    empty = save_safetensors(_text_tensors(family, 1 if trimmed else seq_len, text_dim, pooled_dim, dtype, gen))
    (cache_dir / "empty_prompt.safetensors").write_bytes(empty)
    digests = [shard.sha256 for record in records for shard in record.shards]
    header = {
        "format_version": 3,
        "family": family,
        "fingerprint": hashlib.sha256(json.dumps(digests).encode()).hexdigest(),
        "models": models,
        "dtype": str(dtype).removeprefix("torch."),
        "latents": latents,
        "max_sequence_length": seq_len,
        "text": {"trimmed": trimmed, "pad_to": seq_len},
        "empty_prompt": {"path": "empty_prompt.safetensors", "sha256": hashlib.sha256(empty).hexdigest()},
        **({"streams": streams} if streams is not None else {}),
    }
    return stage.write_manifest(records, header)


def add_validation_prompts(cache_dir: str | Path, pretrained: str, prompts: list[str], *,
                           max_sequence_length: int, family: str | None = None, dtype: str = "float32") -> dict:
    """Encode ``prompts`` (and the family's negative prompt) with ``pretrained``'s text encoders, as the prep's
    cache stage does (``latentmill.stages.cache.ensure_prompts``), into a fake cache, stored in ``dtype``; its
    manifest names them. Returns the manifest."""
    from latentmill.stages.cache import ensure_prompts
    from latentmill.stages.cache_config import CacheConfig
    from latentmill.stages.shardio import StageDir
    from latentmill.trainer.adapters import get_adapter

    from latentmill.models import ModelConfig

    cache_dir = Path(cache_dir)
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    negative = get_adapter(family or manifest.get("family") or "flux").negative_prompt
    cfg = CacheConfig(dtype=dtype, max_sequence_length=max_sequence_length, device="cpu",
                      trim_text="always" if (manifest.get("text") or {}).get("trimmed") else "never")
    model = ModelConfig(pretrained=pretrained, **({"family": family} if family else {}))
    manifest["validation_prompts"] = ensure_prompts(cfg, model, StageDir(cache_dir, "cache"), [*prompts, negative])
    (cache_dir / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def reindex(cache_dir: str | Path) -> dict:
    """After a test changed a cache's tars: each tar's index and sha256 written again, as a prep re-run
    would (the index from the tar's bytes alone). Returns the manifest."""
    from latentmill.stages.shardindex import write_index_file

    from latentmill.core.hashing import sha256_file

    cache_dir = Path(cache_dir)
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    for entry in manifest["shards"]:
        entry["index"] = write_index_file(cache_dir / entry["path"])
        entry["sha256"] = sha256_file(cache_dir / entry["path"])
    (cache_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def old_cache(cache_dir: str | Path, version: int | None = 2) -> dict:
    """Turn a cache into what a prep of cache format ``version`` (1 or 2) left: no index beside any tar, none
    named in the manifest or the unit records (format 1: nor family, latents, text layout, empty prompt).
    The tars are the very bytes those formats wrote. ``version=None``: another stage's folder, whose
    manifest keeps its version. Returns the manifest."""
    cache_dir = Path(cache_dir)
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    for entry in manifest["shards"]:
        index = entry.pop("index", None)
        if index:
            (cache_dir / entry["path"]).with_name(index["name"]).unlink(missing_ok=True)
    for path in (cache_dir / "units").glob("*.json"):
        record = json.loads(path.read_text())
        for shard in record["shards"]:
            shard["index"] = None
        path.write_text(json.dumps(record))
    if version is not None:
        manifest["format_version"] = version
    if version == 1:
        for field in ("family", "latents", "text", "empty_prompt"):
            manifest.pop(field, None)
    (cache_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def read_metrics(train_dir: str | Path) -> list[dict]:
    """The per-step records of ``<train_dir>/metrics.jsonl``."""
    text = (Path(train_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line]


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Run torch on ``n`` intra-op threads (tiny models are faster and steadier so on a shared CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_train(setup: tuple[str, Path], train_dir: Path, max_steps: int, batch_size: int, **overrides):
    """``latentmill.trainer.train`` on ``setup`` = (pretrained folder, cache folder): lr 3e-3, no checkpoints, no export,
    seed 0, no progress bar; ``overrides`` are further ``TrainerConfig`` fields."""
    from latentmill.trainer import TrainerConfig, train

    pretrained, cache = setup
    cfg = TrainerConfig(**{"max_steps": max_steps, "batch_size": batch_size, "learning_rate": 3e-3,
                           "save_every": 0, "export": False, **overrides})
    return train(cfg, cache_dir=cache, pretrained=pretrained, train_dir=train_dir, seed=0, progress=False)


# One 2-rank launch runs several trainings in turn (interpreter start-up and imports dominate a launch on CPU).
JOBS_WORKER = """
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from latentmill.core.config import ConfigError
from latentmill.trainer import ParallelConfig, TrainerConfig, train

torch.set_num_threads(1)
dist.init_process_group("gloo")  # one group for all jobs (train() uses it and leaves it open)
for job in json.loads(sys.argv[1]):
    try:
        summary = train(TrainerConfig(**job["cfg"]), cache_dir=job["cache"], pretrained=job["pretrained"],
                        train_dir=job["train_dir"], seed=0, progress=False,
                        parallel=ParallelConfig(**job["parallel"]))
    except ConfigError as err:  # a job refused before any work: its one line is the job's result
        summary = {"config_error": str(err)}
    Path(job["train_dir"]).mkdir(parents=True, exist_ok=True)
    Path(job["train_dir"], f"summary-{os.environ['RANK']}.json").write_text(json.dumps(summary))
from latentmill.trainer.parallel import end_process_group
end_process_group()  # a barrier, then every group (the meshes' too) released
"""


def launch_jobs(root: str | Path, jobs: list[dict], timeout: float = 600, nproc: int = 2) -> list[list[dict]]:
    """Run ``jobs`` (each ``{"cfg", "cache", "pretrained", "train_dir", "parallel"}``) one after the other in one
    ``nproc``-rank torchrun launch (gloo, ``root/worker.py``); per job, the ranks' summaries (a job refused with a
    ``ConfigError``: ``{"config_error": its message}``)."""
    import os
    import subprocess
    import sys

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "worker.py").write_text(JOBS_WORKER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(root / "worker.py"), json.dumps(jobs)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return [[json.loads(Path(job["train_dir"], f"summary-{r}.json").read_text()) for r in range(nproc)]
            for job in jobs]


def run_and_resume(root: str | Path, cache: str | Path, pretrained: str | Path, parallel: dict, steps: int,
                   **cfg) -> tuple[dict, list[float]]:
    """One 2-rank launch: a run of ``steps`` steps (checkpoints at half and at the end, export) in ``root/run``
    and its resume from the half in ``root/resumed``. Checks that the ranks stay in step, and that the resume
    replays the second half bit for bit; returns rank 0's summary of the run and its losses."""
    from latentmill.trainer.checkpoint import list_checkpoints, step_dir_name

    root, half = Path(root), steps // 2
    base = {"max_steps": steps, "batch_size": 2, "learning_rate": 3e-3, "save_every": half, "keep_latest_k": 0,
            "export": True, **cfg}
    resume = {"export": False, "resume": str(root / "run" / "checkpoints" / step_dir_name(half))}
    jobs = [{"cfg": {**base, **extra}, "cache": str(cache), "pretrained": str(pretrained),
             "train_dir": str(root / name), "parallel": parallel}
            for name, extra in (("run", {}), ("resumed", resume))]
    (rank0, rank1), (resumed, _) = launch_jobs(root, jobs)
    assert rank0["world_size"] == 2 and rank0["steps"] == rank1["steps"] == steps
    assert rank0["final_loss"] == rank1["final_loss"] and rank1["export_dir"] is None  # rank 0 alone exports
    losses = [r["loss"] for r in read_metrics(root / "run")]
    assert len(losses) == steps and all(0 < x < 1e3 for x in losses)
    assert [s for s, _ in list_checkpoints(root / "run" / "checkpoints")] == [half, steps]
    assert resumed["resumed_from"].endswith(step_dir_name(half))
    assert [r["loss"] for r in read_metrics(root / "resumed")] == losses[half:]  # bit for bit
    return rank0, losses
