"""``latentmill plan``: per-rank memory of real-size runs from config files, on meta tensors, fake ranks.

The expected per-rank bytes are computed here independently of FSDP2, from the parameter shapes of an
unsharded meta model and the dim-0 chunking rule of ``Shard(0)`` (rank 0 gets ``ceil(dim0 / shards)`` rows),
so a plan that counted ``total / world`` (a formula) instead of the real local shards would fail the
uneven-shard and HSDP tests.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from latentmill.core.config import ConfigError
from latentmill.plan import GIB, format_plan, plan_config, shipped_models_dir, suggest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
FLUX_DEV_PARAMS = 11_901_408_320
WAN_14B_PARAMS = 14_288_491_584
NEMO_FLUX_PEAK_GIB = 63.9  # NeMo Automodel: FLUX.1-dev full fine-tune, 8 x H100, global batch 32 (peak)


def _meta(family: str, folder: str) -> torch.nn.Module:
    """The unmodified Diffusers transformer on meta, straight from the config (no latentmill code)."""
    import diffusers

    cls = {"flux": diffusers.FluxTransformer2DModel, "wan": diffusers.WanTransformer3DModel}[family]
    with torch.device("meta"):
        return cls.from_config(cls.load_config(str(shipped_models_dir() / folder), subfolder="transformer"))


def _rank0_elements(model: torch.nn.Module, shards: int) -> int:
    """Elements rank 0 holds when every parameter is chunked along dim 0 into ``shards`` pieces."""
    return sum(math.ceil(p.shape[0] / shards) * (p.numel() // p.shape[0]) for p in model.parameters())


@pytest.fixture(scope="module")
def wan_small() -> torch.nn.Module:
    return _meta("wan", "Wan2.1-T2V-1.3B-Diffusers")


def test_flux_dev_full_on_8_ranks_counts_the_real_shards():
    result = plan_config("configs/flux-dev-full.yaml", ["parallel.hsdp_replicate=1"], nproc=8, nnodes=1)
    assert not dist.is_initialized()  # the fake group is gone: plan can run again in this process
    r = result["per_rank"]
    assert result["total_params"] == result["trainable_params"] == FLUX_DEV_PARAMS
    assert (result["world_size"], result["mesh"]) == (8, [8])
    model = _meta("flux", "FLUX.1-dev")
    assert r["params_bytes"] == _rank0_elements(model, 8) * 4  # float32 masters
    assert FLUX_DEV_PARAMS * 4 / 8 <= r["params_bytes"] < FLUX_DEV_PARAMS * 4 / 8 * 1.001
    assert r["grads_bytes"] == r["params_bytes"]  # float32, sharded, whatever grad_accum_steps is
    assert r["optimizer_bytes"] == 2 * r["params_bytes"]  # AdamW exp_avg + exp_avg_sq, from a real step
    # root unit + 2 double-stream blocks (the largest units) in bf16
    assert r["gathered_bytes"] == (64_124_992 + 2 * 339_831_296) * 2
    assert r["static_bytes"] == sum(r[k] for k in ("params_bytes", "buffers_bytes", "grads_bytes",
                                                   "optimizer_bytes", "gathered_bytes"))
    assert r["static_bytes"] < 0.5 * NEMO_FLUX_PEAK_GIB * GIB  # the static part is well below the anchor
    assert r["host_load_peak_bytes"] == r["params_bytes"] // 2  # bf16 checkpoint rows of rank 0's shards
    largest = max(p.numel() for p in model.parameters())  # a norm's 3072 -> 6 x 3072 projection
    assert largest == 3072 * 6 * 3072
    # the file being written and the next one filling (5 GiB each), and the tensor just gathered, in fp32 at most
    assert r["host_export_peak_bytes"] == 2 * 5 * GIB + largest * 4
    assert result["config"]["shipped_configs"]
    # AdamW's foreach step: one float32 copy of the rank's trainable shards (the issue measured +5.5 GiB)
    assert r["optimizer_temp_bytes"] == r["params_bytes"] and 5.5 * GIB < r["optimizer_temp_bytes"] < 5.6 * GIB
    # the largest unit's gradients, unsharded in bf16 and as the float32 reduce-scatter input
    assert r["comm_buffer_bytes"] == 339_831_296 * (2 + 4)
    # FLUX.1-dev at 1024², batch 2: 4,096 latent + 512 text tokens, 57 blocks of 3072 x 12288
    a = result["activations"]
    assert (a["bucket"], a["latent_tokens"], a["text_tokens"], a["blocks"], a["hidden"], a["ffn"]) == (
        [1024, 1024], 4096, 512, 57, 3072, 12288)
    assert a["checkpointing"] and r["activation_bytes"] == r["activation_bytes_checkpointing"]
    assert r["activation_bytes_no_checkpointing"] > 10 * r["activation_bytes_checkpointing"]
    assert r["total_bytes"] == r["static_bytes"] + r["context_bytes"] + max(
        r["activation_bytes"] + r["comm_buffer_bytes"], r["optimizer_temp_bytes"])
    assert result["fits"] and result["margin_bytes"] == 80 * GIB - r["total_bytes"]
    text = format_plan(result)
    assert "shipped with latentmill" in text and "peak GPU total" in text
    # --suggest: the smallest cp first, checkpointing off before on; nothing fits below the static part
    fit = {gib: suggest({**result, "gpu_memory_bytes": gib * GIB}) for gib in (80, 31, 20)}
    assert (fit[80]["cp_size"], fit[80]["activation_checkpointing"]) == (1, True)  # batch 2 without: 104 GiB
    assert fit[80]["total_bytes"] == r["total_bytes"]  # the recipe's own setting
    # at 31 GiB cp 2 halves the activations; AdamW's 5.5 GiB step then sets the peak
    assert (fit[31]["cp_size"], fit[31]["activation_checkpointing"]) == (2, True)
    assert fit[31]["total_bytes"] == r["static_bytes"] + r["context_bytes"] + r["optimizer_temp_bytes"]
    assert fit[20]["cp_size"] is None and "more ranks" in fit[20]["line"] and "\n" not in fit[20]["line"]
    assert result["activations"]["cp_options"] == [1, 2, 4, 8]  # dividing the 8 ranks and the 24 heads


def test_flux_dev_lora_ddp_counts_the_real_lora_layers():
    result = plan_config("configs/flux-dev-lora.yaml", ["parallel.strategy=ddp"], nproc=8)
    assert not dist.is_initialized()
    model = _meta("flux", "FLUX.1-dev")
    targets = ("to_k", "to_q", "to_v", "to_out.0")
    lora = sum(32 * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.endswith(targets))
    assert result["trainable_params"] == lora == 37_355_520
    assert result["total_params"] == FLUX_DEV_PARAMS + lora
    r = result["per_rank"]
    assert result["world_size"] == 8 and result["config"]["strategy"] == "ddp"
    assert r["params_bytes"] == FLUX_DEV_PARAMS * 2 + lora * 4  # bf16 base replica + float32 LoRA
    assert r["grads_bytes"] == 2 * lora * 4  # .grad + DDP's bucket buffers
    assert r["optimizer_bytes"] == 2 * lora * 4
    assert r["gathered_bytes"] == 0
    assert r["host_export_peak_bytes"] == lora * 4  # a LoRA export holds only the LoRA weights
    # what DDP LoRA costs, stated beside FSDP2's share (the shipped recipe's: test_plan_states_what_ddp_lora_costs...)
    assert result["ddp_lora"] == {"gpu_base_bytes": FLUX_DEV_PARAMS * 2, "host_load_bytes": r["host_load_peak_bytes"],
                                  "node_host_load_bytes": 8 * r["host_load_peak_bytes"],
                                  "fsdp2_gpu_base_bytes": FLUX_DEV_PARAMS * 2 // 8}
    assert r["host_load_peak_bytes"] == FLUX_DEV_PARAMS * 2 + lora * 4
    assert "DDP LoRA: each rank holds the whole frozen base, 22.17 GiB of GPU memory" in format_plan(result)


@pytest.mark.heavy
def test_plan_states_what_ddp_lora_costs_beside_fsdp2():
    """Issue 34: DDP LoRA holds the whole bf16 base on every rank; the shipped recipe shards it (FSDP2). Two plans
    of FLUX.1-dev: make test checks the DDP figures in test_flux_dev_lora_ddp_counts_the_real_lora_layers."""
    ddp = plan_config("configs/flux-dev-lora.yaml", ["parallel.strategy=ddp"], nproc=8)
    fsdp = plan_config("configs/flux-dev-lora.yaml", nproc=8)  # the shipped recipe: fsdp2
    assert fsdp["config"]["strategy"] == "fsdp2" and fsdp["fits"] and "ddp_lora" not in fsdp
    cost = ddp["ddp_lora"]
    assert cost["gpu_base_bytes"] == FLUX_DEV_PARAMS * 2  # the bf16 base, whole, on each of the 8 GPUs
    assert cost["host_load_bytes"] == ddp["per_rank"]["host_load_peak_bytes"] == FLUX_DEV_PARAMS * 2 + 37_355_520 * 4
    assert cost["node_host_load_bytes"] == 8 * cost["host_load_bytes"]  # about 178 GB for one node of 8
    assert cost["fsdp2_gpu_base_bytes"] == -(-FLUX_DEV_PARAMS * 2 // 8)
    # what FSDP2 holds instead: rank 0's parameters are an eighth of the base (rows rounded up) plus its LoRA share
    assert cost["fsdp2_gpu_base_bytes"] < fsdp["per_rank"]["params_bytes"] < cost["fsdp2_gpu_base_bytes"] * 1.1
    assert ddp["per_rank"]["params_bytes"] > 7 * fsdp["per_rank"]["params_bytes"]
    assert fsdp["per_rank"]["host_load_peak_bytes"] < cost["host_load_bytes"] / 7
    line = next(x for x in format_plan(ddp).splitlines() if x.startswith("DDP LoRA:"))
    assert line == (f"DDP LoRA: each rank holds the whole frozen base, {cost['gpu_base_bytes'] / 2**30:.2f} GiB of GPU "
                    f"memory and {cost['host_load_bytes'] / 2**30:.2f} GiB of host RAM at load "
                    f"({cost['node_host_load_bytes'] / 2**30:.2f} GiB per node); parallel.strategy: fsdp2 holds "
                    f"{cost['fsdp2_gpu_base_bytes'] / 2**30:.2f} GiB of it per rank")


def test_hsdp_replicate_and_uneven_ranks_follow_the_sharding(wan_small):
    total = sum(p.numel() for p in wan_small.parameters())
    flat = plan_config("configs/wan2.1-1.3b.yaml", nproc=8)
    hsdp = plan_config("configs/wan2.1-1.3b.yaml", ["parallel.hsdp_replicate=2"], nproc=8, nnodes=1)
    odd = plan_config("configs/wan2.1-1.3b.yaml", nproc=7)
    assert (flat["mesh"], hsdp["mesh"], odd["mesh"]) == ([8], [2, 4], [7])
    assert flat["per_rank"]["params_bytes"] == _rank0_elements(wan_small, 8) * 4
    assert hsdp["per_rank"]["params_bytes"] == _rank0_elements(wan_small, 4) * 4  # sharded over 4, not 8
    assert odd["per_rank"]["params_bytes"] == _rank0_elements(wan_small, 7) * 4
    assert odd["per_rank"]["params_bytes"] > total * 4 / 7  # FSDP2 pads dim 0: rank 0 holds the most
    assert flat["per_rank"]["host_load_peak_bytes"] == flat["per_rank"]["params_bytes"]  # fp32 checkpoint
    # gathered: root-level units + 2 blocks, each parameter in bf16 except what Wan keeps in float32
    keep = set(wan_small._keep_in_fp32_modules)

    def gathered(module: torch.nn.Module, prefix: str, skip: str | None = None) -> int:
        return sum(p.numel() * (4 if keep & set(f"{prefix}{n}".split(".")) else 2)
                   for n, p in module.named_parameters() if not (skip and n.startswith(skip)))

    root = gathered(wan_small, "", skip="blocks.")
    block = gathered(wan_small.blocks[0], "blocks.0.")
    assert flat["per_rank"]["gathered_bytes"] == root + 2 * block
    assert root + 2 * block > (total - 28 * sum(p.numel() for p in wan_small.blocks[0].parameters())) * 2


def test_a_config_only_folder_is_enough(tmp_path, wan_small):
    folder = tmp_path / "wan-configs"
    shutil.copytree(shipped_models_dir() / "Wan2.1-T2V-1.3B-Diffusers", folder)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    result = plan_config("configs/wan2.1-1.3b.yaml", [f"model.pretrained={folder}", "model.family=auto"],
                         nproc=8, gpu_memory_gib=2)
    assert result["total_params"] == sum(p.numel() for p in wan_small.parameters()) == 1_418_996_800
    assert result["config"]["shipped_configs"] is False and result["config"]["family"] == "wan"
    r = result["per_rank"]
    assert r["host_load_peak_bytes"] == r["params_bytes"] // 2  # the config's torch_dtype: bf16 rows
    assert result["fits"] is False and result["margin_bytes"] == 2 * GIB - r["total_bytes"]


def test_a_config_only_folder_of_fp32_weights_loads_fp32_rows(tmp_path):
    """Wan2.1-T2V-14B is published in float32: a folder of its JSON files alone (no weights, no torch_dtype)
    took the bfloat16 assumption, half the host RAM at load. Its transformer config is the shipped entry's."""
    folder = tmp_path / "wan14b-configs"
    shutil.copytree(shipped_models_dir() / "Wan2.1-T2V-14B-Diffusers", folder)
    args = dict(nproc=8, nnodes=1)
    fp32 = plan_config("configs/wan2.1-14b.yaml", [f"model.pretrained={folder}", "parallel.hsdp_replicate=1"], **args)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    bf16 = plan_config("configs/wan2.1-14b.yaml", [f"model.pretrained={folder}", "parallel.hsdp_replicate=1"], **args)
    assert (fp32["checkpoint_dtype"], bf16["checkpoint_dtype"]) == ("float32", "bfloat16")
    assert "Wan-AI/Wan2.1-T2V-14B-Diffusers" in " ".join(fp32["notes"])
    host_load = fp32["per_rank"]["host_load_peak_bytes"]
    assert host_load == 2 * bf16["per_rank"]["host_load_peak_bytes"]
    # rank 0's rows of the float32 checkpoint: as many bytes as its shard of the float32 masters
    assert host_load == fp32["per_rank"]["params_bytes"] > WAN_14B_PARAMS * 4 // 8


def test_bad_keys_fail_naming_the_key(tmp_path, capsys):
    from latentmill.cli import main

    with pytest.raises(ConfigError, match=r"model\.pretrained"):
        plan_config("configs/wan2.1-1.3b.yaml", ["model.pretrained=nobody/no-such-model"])
    with pytest.raises(ConfigError, match=r"model\.pretrained"):
        plan_config("configs/wan2.1-1.3b.yaml", [f"model.pretrained={tmp_path}"])  # no transformer/config.json
    with pytest.raises(ConfigError, match=r"parallel\.hsdp_replicate"):
        plan_config("configs/wan2.1-1.3b.yaml", ["parallel.hsdp_replicate=3"], nproc=8, nnodes=1)
    assert main(["plan", "configs/wan2.1-1.3b.yaml", "trainer.no_such_key=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_such_key" in err and err.startswith("latentmill: error:")
    assert not dist.is_initialized()


def test_cli_plans_wan_14b_at_its_recipe_world_size(tmp_path, wan_small):
    out = tmp_path / "plan.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "latentmill.cli", "plan", "configs/wan2.1-14b.yaml",
                           "--gpu-memory", "10", "--suggest", "--json", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "fits: NO" in proc.stdout
    result = json.loads(out.read_text())
    assert {"total_params", "trainable_params", "world_size", "per_rank", "fits"} <= set(result)
    assert {"params_bytes", "grads_bytes", "optimizer_bytes", "host_load_peak_bytes",
            "host_export_peak_bytes"} <= set(result["per_rank"])
    assert result["total_params"] == WAN_14B_PARAMS
    assert (result["world_size"], result["nnodes"], result["mesh"]) == (32, 4, [4, 8])  # HSDP: 4 nodes x 8
    assert result["per_rank"]["params_bytes"] == _rank0_elements(_meta("wan", "Wan2.1-T2V-14B-Diffusers"), 8) * 4
    assert result["fits"] is False and result["per_rank"]["static_bytes"] > 10 * GIB
    # 720p, 81 frames: 21 x 45 x 80 = 75,600 tokens; checkpointing keeps 40 block inputs of 75,600 x 5120, at
    # least 28.8 GiB in bf16 (Wan's float32 residuals double it): the static-only plan left "51.6 GiB" of 80. The
    # recipe splits each clip over cp 2, half of them per rank, and so fits 80 GiB
    a, r = result["activations"], result["per_rank"]
    assert (a["bucket"], a["latent_tokens"], a["text_in_blocks"]) == ([1280, 720, 81], 75_600, False)
    assert (result["config"]["cp_size"], a["tokens_per_rank"]) == (2, 37_800)
    assert r["activation_bytes"] > 40 * 37_800 * 5120 * 2 > 14.4 * GIB
    assert r["static_bytes"] + r["activation_bytes"] < r["total_bytes"] < 80 * GIB
    # --suggest at 10 GiB: nothing fits, in one line; at 80 GiB: cp 2 (it divides the 40 heads and the 8 ranks
    # of a shard group) with checkpointing
    line = next(x for x in proc.stdout.splitlines() if x.startswith("suggest:"))
    assert "nothing fits 10 GiB" in line and "more ranks" in line and result["suggest"]["cp_size"] is None
    at_80 = suggest({**result, "gpu_memory_bytes": 80 * GIB})
    assert (at_80["cp_size"], at_80["activation_checkpointing"]) == (2, True) and at_80["total_bytes"] < 80 * GIB


def test_one_process_plan_of_a_folder_with_weights(tiny_flux):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(tiny_flux, subfolder="transformer")
    result = plan_config("demo", [f"model.pretrained={tiny_flux}"])
    n = sum(p.numel() for p in model.parameters())
    assert (result["world_size"], result["total_params"], result["checkpoint_dtype"]) == (1, n, "float32")
    assert "safetensors headers" in " ".join(result["notes"])  # the dtype came from the weights themselves
    r = result["per_rank"]
    assert r["params_bytes"] == r["grads_bytes"] == r["host_load_peak_bytes"] == n * 4
    assert r["optimizer_bytes"] == 2 * n * 4 and r["gathered_bytes"] == 0
    assert not dist.is_initialized()


# FLUX.2: the transformer sizes BFL publishes (dev 32B, klein 4B and 9B), from the shipped configs on meta.
FLUX2_PARAMS = {"FLUX.2-dev": 32_223_281_152, "FLUX.2-klein-base-4B": 3_875_544_576,
                "FLUX.2-klein-base-9B": 9_078_581_248}


@pytest.mark.parametrize(("recipe", "folder", "published"), [
    ("configs/flux2-dev-full.yaml", "FLUX.2-dev", 32e9), ("configs/flux2-klein-4b-full.yaml", "FLUX.2-klein-base-4B", 4e9),
    ("configs/flux2-klein-9b-full.yaml", "FLUX.2-klein-base-9B", 9e9)])
def test_flux2_full_plans_count_the_published_sizes(recipe, folder, published):
    import diffusers

    cls = diffusers.Flux2Transformer2DModel
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(str(shipped_models_dir() / folder), subfolder="transformer"))
    total = sum(p.numel() for p in model.parameters())
    assert total == FLUX2_PARAMS[folder] and abs(total - published) / published < 0.05
    nnodes = 2 if "dev" in recipe else 1  # FLUX.2 [dev]'s recipe states its 2 nodes (parallel.nnodes): no --nnodes
    result = plan_config(recipe, gpu_memory_gib=80)
    assert not dist.is_initialized()
    assert (result["nproc"], result["nnodes"], result["world_size"]) == (8, nnodes, 8 * nnodes)
    assert result["total_params"] == result["trainable_params"] == total
    assert result["config"]["family"] == ("flux2" if "dev" in recipe else "flux2-klein")
    assert result["per_rank"]["params_bytes"] == _rank0_elements(model, 8 * nnodes) * 4  # float32 shards
    assert result["fits"] and result["config"]["shipped_configs"]


def test_a_recipe_states_its_nodes_for_plan_and_train():
    """``parallel.nnodes``: plan's layout and train's default ``--nnodes``; ``--nnodes`` overrides it; without it,
    plan counts an HSDP recipe's hsdp_replicate nodes, train one node."""
    from latentmill.pipelines.flows import Launch, check_launch

    from latentmill.plan import layout
    from latentmill.recipe import load_recipe

    flux2 = load_recipe("configs/flux2-dev-full.yaml")
    lay = layout(flux2, None, None)
    assert (lay.nproc, lay.nnodes, lay.note) == (8, 2, "8 GPUs per node (default), 2 nodes (parallel.nnodes)")
    assert layout(flux2, None, 1).nnodes == 1 and flux2.parallel.launch_nodes(1) == 1
    assert flux2.parallel.launch_nodes(None) == 2
    with pytest.raises(ConfigError, match=r"^--nnodes > 1 needs --rdzv-endpoint"):  # 2 nodes, as the recipe says
        check_launch(flux2, Launch(8, flux2.parallel.launch_nodes(None)))
    qwen = load_recipe("configs/qwen-image-full.yaml")  # 2 HSDP replicas over 4 nodes
    assert (qwen.parallel.hsdp_replicate, layout(qwen, None, None).nnodes) == (2, 4)
    wan = load_recipe("configs/wan2.1-14b.yaml")  # no key: HSDP's replicas are plan's nodes; train's default is 1
    assert (layout(wan, None, None).nnodes, wan.parallel.launch_nodes(None)) == (4, 1)
    assert layout(load_recipe("configs/flux2-klein-4b-full.yaml"), None, None).nnodes == 1  # no key, no HSDP


def test_a_bad_node_count_is_refused_naming_the_key(capsys):
    from latentmill.cli import main
    from latentmill.recipe import load_recipe

    with pytest.raises(ConfigError, match=r"^parallel.nnodes: must be >= 1 \(or null: one node\), got 0$"):
        load_recipe("configs/flux2-dev-full.yaml", ["parallel.nnodes=0"])
    with pytest.raises(ConfigError, match=r"^parallel.nnodes: 3 nodes cannot hold parallel.hsdp_replicate: 2 replicas "
                                          r"along node boundaries; set nnodes to a multiple or a divisor"):
        load_recipe("configs/qwen-image-full.yaml", ["parallel.nnodes=3"])
    load_recipe("configs/qwen-image-full.yaml", ["parallel.nnodes=1"])  # 2 replicas of 4 GPUs in one node
    with pytest.raises(ConfigError, match=r"^parallel.nnodes: 2 nodes need parallel.strategy 'ddp' or 'fsdp2'"):
        load_recipe("demo", ["parallel.nnodes=2"])
    assert main(["plan", "configs/flux2-dev-full.yaml", "parallel.nnodes=-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("latentmill: error: parallel.nnodes: must be >= 1")


@pytest.mark.heavy  # make test: the targets on the tiny FLUX.2 (test_flux2.py), plan's LoRA count on FLUX.1 dev (above)
def test_flux2_klein_lora_reaches_the_single_blocks():
    from latentmill.trainer.flux2 import LORA_TARGETS

    result = plan_config("configs/flux2-klein-4b-lora.yaml", nproc=8)
    import diffusers

    cls = diffusers.Flux2Transformer2DModel
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(str(shipped_models_dir() / "FLUX.2-klein-base-4B"),
                                                subfolder="transformer"))
    modules = dict(model.named_modules())
    wrapped = [m for name, m in modules.items() if isinstance(m, torch.nn.Linear)
               and any(name.endswith("." + t) for t in LORA_TARGETS)]
    assert len(wrapped) == 5 * 12 + 20 * 2  # 12 Linear layers per double block, 2 per single block
    lora = sum(32 * (m.in_features + m.out_features) for m in wrapped)
    assert result["trainable_params"] == lora
    assert result["total_params"] == FLUX2_PARAMS["FLUX.2-klein-base-4B"] + lora
    assert result["config"]["strategy"] == "fsdp2" and result["fits"]  # the shipped recipe shards the base
