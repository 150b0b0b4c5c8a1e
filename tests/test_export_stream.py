"""The export writes the artefact without a second model or a gathered frozen base (issue 16, item 3).

Unit tests (one process) pin the format: a full export is Diffusers' sharded layout in ``export_dtype`` and
loads with ``DiffusionPipeline.from_pretrained``; a LoRA export is byte for byte what ``export_pipeline``
writes. The 2-rank gloo test shards a Flux-class transformer of 240 MiB (float32) with the trainer's FSDP2
path and measures each rank's resident-memory peak during ``export_trained`` (``VmHWM`` of
``/proc/self/status``, reset by writing 5 to ``/proc/self/clear_refs`` just before); on a slow disk (one
process, a ``write_file`` that sleeps) rank 0's peak stays under plan's host-export figure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from latentmill.trainer.export import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, export_trained
from latentmill.trainer.flux import FluxAdapter
from latentmill.trainer.parallel import DistContext
from safetensors import safe_open
from safetensors.torch import load_file

from tests.trainer_helpers import torch_threads

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
MiB = 1024 * 1024

# A Flux-class transformer of 240 MiB in float32 (62.8M parameters; the largest tensor 9.4 MiB).
BIG_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=2,
    num_single_layers=5,
    attention_head_dim=64,
    num_attention_heads=10,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(16, 24, 24),
)


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _trained(pretrained: Path, mode: str) -> torch.nn.Module:
    """The transformer as training leaves it: loaded, made trainable, its trained weights moved off the base."""
    torch.manual_seed(0)
    model = FluxAdapter().load(str(pretrained), mode=mode, device="cpu", lora_rank=4, lora_alpha=8.0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=gen) * 0.01)
    return model


def _file_dtypes(folder: Path) -> set[str]:
    dtypes = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as fh:
            dtypes |= {fh.get_slice(key).get_dtype() for key in fh.keys()}
    return dtypes


def test_full_export_streams_bf16_files_that_load_as_a_pipeline(tiny_flux, tmp_path):
    from diffusers import DiffusionPipeline, FluxPipeline

    model = _trained(tiny_flux, "full")
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    out = export_trained(FluxAdapter(), model, mode="full", pretrained=str(tiny_flux), export_dir=tmp_path / "export",
                         ctx=DistContext(), export_dtype="bfloat16", max_shard_bytes=512 * 1024)
    assert out == tmp_path / "export" and not (tmp_path / "export.tmp").exists()

    folder = out / "transformer"
    index = json.loads((folder / WEIGHTS_INDEX_NAME).read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    n = len(files)
    assert n >= 3 and files == [f"diffusion_pytorch_model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(trained) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in trained.values())  # all bf16
    assert all((folder / f).stat().st_size <= 512 * 1024 + 64 * 1024 for f in files)  # + the JSON header
    assert _file_dtypes(folder) == {"BF16"}

    # the config is what save_config writes; the other components are the pretrained files, unchanged
    reference = tmp_path / "reference"
    model.save_config(reference)
    assert (folder / "config.json").read_text() == (reference / "config.json").read_text()
    for src in tiny_flux.rglob("*"):
        rel = src.relative_to(tiny_flux)
        if src.is_file() and rel.parts[0] != "transformer":
            assert (out / rel).read_bytes() == src.read_bytes(), rel
    assert json.loads((out / "model_index.json").read_text()) == json.loads((tiny_flux / "model_index.json").read_text())

    pipe = DiffusionPipeline.from_pretrained(out)
    assert isinstance(pipe, FluxPipeline)
    loaded = pipe.transformer.state_dict()
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[k].to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in trained.items())


def test_full_export_in_float32_is_one_file_equal_to_the_trained_weights(tiny_flux, tmp_path):
    model = _trained(tiny_flux, "full")
    out = export_trained(FluxAdapter(), model, mode="full", pretrained=str(tiny_flux), export_dir=tmp_path / "export",
                         ctx=DistContext(), export_dtype="float32")
    folder = out / "transformer"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", WEIGHTS_NAME]
    weights = load_file(folder / WEIGHTS_NAME)
    trained = model.state_dict()
    assert weights.keys() == trained.keys() and all(torch.equal(weights[k], v) for k, v in trained.items())
    # a second export replaces the first (a previous export is recognised by its model_index.json)
    again = export_trained(FluxAdapter(), model, mode="full", pretrained=str(tiny_flux), export_dir=out,
                           ctx=DistContext(), export_dtype="float32")
    assert again == out and (out / "model_index.json").is_file()


def test_wan_full_export_keeps_the_float32_modules_and_loads(tiny_wan, tmp_path):
    from diffusers import DiffusionPipeline, WanPipeline
    from latentmill.trainer.wan import WanAdapter

    torch.manual_seed(0)
    model = WanAdapter().load(str(tiny_wan), mode="full")
    out = export_trained(WanAdapter(), model, mode="full", pretrained=str(tiny_wan), export_dir=tmp_path / "export",
                         ctx=DistContext())
    with safe_open(out / "transformer" / WEIGHTS_NAME, "pt") as fh:
        dtypes = {key: fh.get_slice(key).get_dtype() for key in fh.keys()}
    kept = {k for k in dtypes if {"rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"}
            & set(k.split("."))}
    assert kept and {dtypes[k] for k in kept} == {"F32"}  # Wan's _keep_in_fp32_modules
    assert {v for k, v in dtypes.items() if k not in kept} == {"BF16"}
    pipe = DiffusionPipeline.from_pretrained(out)
    assert isinstance(pipe, WanPipeline)
    trained, loaded = model.state_dict(), pipe.transformer.state_dict()
    assert all(torch.equal(loaded[k].float(), v if k in kept else v.to(torch.bfloat16).float())
               for k, v in trained.items())


def test_lora_export_writes_what_export_pipeline_writes(tiny_flux, tmp_path):
    from latentmill.trainer.adapter import export_pipeline

    model = _trained(tiny_flux, "lora")
    new = export_trained(FluxAdapter(), model, mode="lora", pretrained=str(tiny_flux), export_dir=tmp_path / "new",
                         ctx=DistContext())
    from diffusers import FluxPipeline

    old = export_pipeline(FluxPipeline, model, mode="lora", pretrained=str(tiny_flux), export_dir=tmp_path / "old")
    assert sorted(p.name for p in new.iterdir()) == sorted(p.name for p in old.iterdir())
    name = "pytorch_lora_weights.safetensors"
    got, want = load_file(new / name), load_file(old / name)
    assert got and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert all(".default." not in k and "lora_" in k for k in got)
    with safe_open(new / name, "pt") as a, safe_open(old / name, "pt") as b:
        assert a.metadata() == b.metadata()  # the adapter config (rank 4, alpha 8) travels with the weights


def test_ddp_ranks_above_zero_write_nothing(tiny_flux, tmp_path):
    ctx = DistContext(rank=1, world_size=2, initialized=True, strategy="ddp")  # no collective is called
    model = FluxAdapter().load(str(tiny_flux), mode="full")
    assert export_trained(FluxAdapter(), model, mode="full", pretrained=str(tiny_flux), export_dir=tmp_path / "x",
                          ctx=ctx) is None
    assert not any(tmp_path.iterdir())


def test_process_group_timeout_is_the_recipe_key():
    import torch.distributed as dist
    from latentmill.trainer.config import ParallelConfig
    from latentmill.trainer.parallel import init_distributed, shutdown

    ctx = init_distributed(ParallelConfig(strategy="fsdp2", timeout_minutes=7))  # a group of one, gloo
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == 7 * 60  # not gloo's 30 or NCCL's 10 minutes
    finally:
        shutdown(ctx)
    assert ParallelConfig().timeout_minutes == 120


def test_export_and_timeout_keys_are_checked():
    from latentmill.trainer.config import ParallelConfig, TrainerConfig

    from latentmill.core.config import ConfigError, from_dict

    assert from_dict(TrainerConfig, {"export_dtype": "float16"}).export_dtype == "float16"
    assert TrainerConfig().export_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="export_dtype"):
        from_dict(TrainerConfig, {"export_dtype": "int8"}, prefix="trainer")
    with pytest.raises(ConfigError, match="parallel.timeout_minutes: must be >= 1, got 0"):
        from_dict(ParallelConfig, {"timeout_minutes": 0}, prefix="parallel")


WORKER = """
import gc, json, os, sys
import torch
import diffusers, peft.utils  # imports warmed before measuring: a fixed cost, not the model's
from latentmill.trainer.config import ParallelConfig, TrainerConfig
from latentmill.trainer.export import export_trained
from latentmill.trainer.flux import FluxAdapter
from latentmill.trainer.parallel import init_distributed, parallelize, shutdown

torch.set_num_threads(1)
pretrained, out, path = sys.argv[1], sys.argv[2], sys.argv[3]  # path: new (export_trained) | old (before it)
parallel = ParallelConfig(strategy="fsdp2")
ctx = init_distributed(parallel)
adapter = FluxAdapter()
diffusers.FluxPipeline


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


def nbytes(t):
    return t.numel() * t.element_size()


result = {}
for mode in ("lora", "full"):
    torch.manual_seed(0)
    model = adapter.load(pretrained, mode=mode, device="cpu", lora_rank=4, lora_alpha=8.0, base_dtype=torch.float32)
    with torch.no_grad():  # trained LoRA weights (B starts at zero)
        for p in model.parameters():
            if mode == "lora" and p.requires_grad:
                p.add_(0.01)
    if mode == "lora" and ctx.is_main and path == "new":  # what PEFT names and holds on the unsharded model
        from safetensors.torch import save_file
        want = {k: v.clone() for k, v in peft.utils.get_peft_model_state_dict(model).items()}
        save_file(want, f"{out}/lora-expected.safetensors")
        del want
    parallelize(model, parallel, ctx, blocks=adapter.blocks(model))
    local = [p.to_local() for p in model.parameters()]
    sd = model.state_dict()
    info = {"model_bytes": sum(nbytes(v) for v in sd.values()), "shard_bytes": sum(nbytes(t) for t in local),
            "trainable_bytes": sum(nbytes(p) for p in model.parameters() if p.requires_grad),
            "largest_bytes": max(nbytes(v) for v in sd.values())}
    del sd, local
    gc.collect()
    base = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    export_dir = f"{out}/{mode}-{path}"
    export_trained(adapter, model, mode=mode, pretrained=pretrained, export_dir=export_dir, ctx=ctx,
                   export_dtype="bfloat16", max_shard_bytes=32 * 2**20)
    info["export_peak_increment"] = status("VmHWM") - base
    result[mode] = info
    del model
    gc.collect()
    ctx.barrier()  # rank 0 has finished writing before the next model is sharded (the test's order only)
open(f"{out}/rss-{path}-{ctx.rank}.json", "w").write(json.dumps(result))
shutdown(ctx)
"""


def run_worker(tmp_path: Path, pretrained: Path, path: str) -> list[dict]:
    """Launch the worker on 2 gloo ranks; return each rank's measurements."""
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
           # a fixed mmap threshold: every tensor's memory goes back to the system when it is freed, so the
           # resident set follows the live tensors (glibc's adaptive threshold would keep freed blocks)
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    with open(tmp_path / f"stderr-{path}.txt", "w") as err:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               str(tmp_path / "worker.py"), str(pretrained), str(tmp_path), path],
                              cwd=REPO_ROOT, env=env, stdout=err, stderr=err, timeout=600)
    assert done.returncode == 0, (tmp_path / f"stderr-{path}.txt").read_text()[-3000:]
    return [json.loads((tmp_path / f"rss-{path}-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def big_flux(tiny_flux, tmp_path_factory) -> Path:
    """The tiny pipeline with a 240 MiB Flux-class transformer (seed 0) in place of its own."""
    from diffusers import FluxTransformer2DModel

    root = tmp_path_factory.mktemp("big") / "big-flux"
    shutil.copytree(tiny_flux, root, ignore=shutil.ignore_patterns("transformer"))
    torch.manual_seed(0)
    FluxTransformer2DModel(**BIG_TRANSFORMER).save_pretrained(root / "transformer")
    return root


def test_fsdp2_exports_gather_no_frozen_base_and_one_bf16_copy(big_flux, tmp_path):
    ranks = run_worker(tmp_path, big_flux, "new")
    lora, full = [r["lora"] for r in ranks], [r["full"] for r in ranks]
    model_bytes = full[0]["model_bytes"]
    assert model_bytes == 251_163_904  # 240 MiB float32
    bf16_bytes, overhead = model_bytes // 2, 16 * MiB

    # LoRA: no rank holds more than its own share; the adapter (0.4 MiB) is all that is gathered
    for rank in lora:
        assert rank["export_peak_increment"] <= rank["trainable_bytes"] * 2 + overhead, lora
        assert rank["export_peak_increment"] < rank["shard_bytes"] // 8, lora
    # full: rank 0 holds at most the bf16 copy it writes plus one shard; rank 1 one tensor at a time
    shard = full[0]["shard_bytes"]
    assert full[0]["export_peak_increment"] <= bf16_bytes + shard + overhead, full
    assert full[1]["export_peak_increment"] <= 2 * full[1]["largest_bytes"] + overhead, full

    # what was written: bf16 files of at most 32 MiB + the index, equal to the trained weights cast to bf16
    folder = tmp_path / "full-new" / "transformer"
    index = json.loads((folder / WEIGHTS_INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) == 4 and _file_dtypes(folder) == {"BF16"}
    assert json.loads((folder / "config.json").read_text())["_class_name"] == "FluxTransformer2DModel"
    source = load_file(big_flux / "transformer" / WEIGHTS_NAME)
    written = {}
    for name in set(index["weight_map"].values()):
        written.update(load_file(folder / name))
    assert written.keys() == source.keys()
    assert all(torch.equal(written[k], v.to(torch.bfloat16)) for k, v in source.items())
    assert (tmp_path / "full-new" / "vae").is_dir() and (tmp_path / "full-new" / "model_index.json").is_file()

    # the LoRA file: the trained adapter as PEFT names it on the unsharded model (saved before sharding)
    want = {f"transformer.{k}": v for k, v in load_file(tmp_path / "lora-expected.safetensors").items()}
    got = load_file(tmp_path / "lora-new" / "pytorch_lora_weights.safetensors")
    assert got and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


SLOW_DISK_WORKER = """
import gc, json, sys, time
import torch
import diffusers, peft.utils  # imports warmed before measuring: a fixed cost, not the model's
from safetensors.torch import save_file
from latentmill.trainer.export import export_peak_bytes, export_trained
from latentmill.trainer.flux import FluxAdapter
from latentmill.trainer.parallel import DistContext

torch.set_num_threads(1)
pretrained, out = sys.argv[1], sys.argv[2]
adapter = FluxAdapter()
diffusers.FluxPipeline
written = []


def slow_disk(tensors, path):  # a disk far slower than the gathers: 0.2 s a file
    time.sleep(0.2)
    save_file(tensors, path)
    written.append(sum(t.numel() * t.element_size() for t in tensors.values()))


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


model = adapter.load(pretrained, mode="full", device="cpu", base_dtype=torch.float32)
params = list(model.parameters())
for p in params:  # in memory of its own, as training leaves it (not pages of the mmapped file, read at export)
    p.data = p.data.clone()
# plan's figure: the model in bf16, its largest tensor in float32 (what plan counts)
figure = export_peak_bytes(sum(p.numel() for p in params) * 2, max(p.numel() for p in params) * 4, 8 * 2**20)
del params
gc.collect()
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
export_trained(adapter, model, mode="full", pretrained=pretrained, export_dir=out + "/export", ctx=DistContext(),
               export_dtype="bfloat16", max_shard_bytes=8 * 2**20, write_file=slow_disk)
print(json.dumps({"increment": status("VmHWM") - base, "figure": figure, "files": len(written),
                  "written_bytes": sum(written)}))
"""


@pytest.mark.heavy  # a memory measurement; make test: the FSDP2 export above
def test_a_slow_disk_holds_at_most_plans_export_figure(big_flux, tmp_path):
    """On a disk slower than the gathers, an unbounded writer queue held the whole bf16 copy on rank 0 (1,296 MiB
    for a 1.28 GiB slice where plan said 472 MiB): a file is now handed over once the one before it is written.
    One process (rank 0's path), 8 MiB files written at 0.2 s each through ``export_trained(write_file=)``."""
    (tmp_path / "worker.py").write_text(SLOW_DISK_WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, str(tmp_path / "worker.py"), str(big_flux), str(tmp_path)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["written_bytes"] == 251_163_904 // 2 and result["files"] >= 12, result  # the bf16 copy
    assert result["figure"] < result["written_bytes"] // 4, result  # so holding the whole copy would fail
    assert result["increment"] <= result["figure"], result
