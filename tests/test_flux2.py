"""FLUX.2 families (flux2-klein, flux2): the cache equals the pipelines' own encoding, the adapter calls the
transformer like the pipelines, the shift is FLUX.2's, training (full, LoRA) exports what the pipelines load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from latentmill.stages.bucket import BucketConfig
from latentmill.stages.cache import CacheConfig, load_pixels
from latentmill.stages.curate import CurateConfig
from latentmill.stages.families import FAMILIES, PIPELINE_FAMILIES
from latentmill.stages.family_flux2 import Flux2Encoders
from latentmill.stages.family_flux2_klein import Flux2KleinEncoders
from latentmill.stages.ingest import IngestConfig
from latentmill.stages.shardio import StageDir
from latentmill.stages.tarshard import read_shard
from latentmill.trainer import TrainerConfig, train
from latentmill.trainer.adapters import get_adapter
from latentmill.trainer.flux2 import (
    LORA_TARGETS,
    SHIFT_NUM_STEPS,
    Flux2Adapter,
    Flux2KleinAdapter,
    check_flux2_batch_fits,
    flux2_forward,
)
from latentmill.trainer.objective import shift_sigmas
from safetensors.torch import load as load_tensors

from latentmill.models import ModelConfig
from latentmill.recipe import Recipe
from tests.helpers import prep_in_process
from tests.trainer_helpers import add_validation_prompts, read_metrics, torch_threads

SEQ = 32  # klein's cache.max_sequence_length in these tests (its chat template alone is 15 tokens)
DEV_SEQ = 64  # dev's (its system message and template are 32 tokens of the tiny tokenizer)


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def test_registries_name_both_families():
    assert FAMILIES["flux2-klein"] is Flux2KleinEncoders and FAMILIES["flux2"] is Flux2Encoders
    assert PIPELINE_FAMILIES["Flux2KleinPipeline"] == "flux2-klein" and PIPELINE_FAMILIES["Flux2Pipeline"] == "flux2"
    assert isinstance(get_adapter("flux2-klein"), Flux2KleinAdapter)
    assert type(get_adapter("flux2")) is Flux2Adapter
    assert Flux2KleinEncoders.OUT_LAYERS == (9, 18, 27) and Flux2Encoders.OUT_LAYERS == (10, 20, 30)
    assert [s.name for s in Flux2KleinEncoders.STREAMS] == ["latents", "prompt_embeds"]
    assert Flux2KleinEncoders.text_pad() == "keep"  # the transformer sees the padded positions
    shapes = Flux2KleinEncoders.sample_shapes(lambda name: {}, [1024, 768, 1], 512)
    assert shapes == {"latents": (128, 48, 64), "prompt_embeds": (512, 3 * 2560)}
    assert Flux2Encoders.sample_shapes(lambda name: {}, [512, 512, 1], 512)["prompt_embeds"] == (512, 15360)


# ---------------------------------------------------------------------------------------------------- cache


def _prep(root, pretrained, cache_cfg):
    from tests.conftest import DEMO_IMAGES

    recipe = Recipe(output_dir=str(root), model=ModelConfig(pretrained=str(pretrained)),
                    ingest=IngestConfig(source=str(DEMO_IMAGES), shard_size=8), curate=CurateConfig(max_exposure=0.5),
                    bucket=BucketConfig(resolution=64, aspect_ratios=[0.75, 1.0, 1.3333]), cache=cache_cfg)
    return prep_in_process(recipe)["cache"]


def _first_samples(sd, manifest, n):
    out = []
    for shard in manifest["shards"]:
        for sample in read_shard(sd.root / shard["path"]):
            out.append(sample)
            if len(out) == n:
                return out
    return out


def _pixels_of(sd, sample):
    meta = json.loads(sample["json"])
    src = StageDir(sd.root.parent / "bucket", "bucket")
    raw = next(s for b in src.read_manifest()["shards"] for s in read_shard(src.root / b["path"])
               if s["__key__"] == sample["__key__"])
    return load_pixels(raw["image"], meta["crop"], meta["bucket"])


@pytest.fixture(scope="module")
def klein_cache(tiny_flux2_klein, tmp_path_factory):
    root = tmp_path_factory.mktemp("klein-prep")
    cfg = CacheConfig(dtype="float32", batch_size=4, max_sequence_length=SEQ, shard_bytes=1 << 20)
    return _prep(root, tiny_flux2_klein, cfg)


@pytest.fixture(scope="module")
def dev_cache(tiny_flux2_dev, tmp_path_factory):
    root = tmp_path_factory.mktemp("dev-prep")
    cfg = CacheConfig(dtype="float32", batch_size=4, max_sequence_length=DEV_SEQ, shard_bytes=1 << 20)
    return _prep(root, tiny_flux2_dev, cfg)


@pytest.mark.slow  # builds the tiny models through request.getfixturevalue
@pytest.mark.parametrize(("variant", "family", "text_class", "seq"),
                         [("klein", "flux2-klein", "Qwen3ForCausalLM", SEQ),
                          ("dev", "flux2", "Mistral3ForConditionalGeneration", DEV_SEQ)])
def test_cache_equals_the_pipeline_encoding(request, variant, family, text_class, seq):
    from diffusers import DiffusionPipeline

    pretrained = request.getfixturevalue(f"tiny_flux2_{variant}")
    sd, manifest, _ = request.getfixturevalue(f"{variant}_cache")
    assert manifest["counts"] == {"in": 24, "out": 24, "quarantined": 0}
    assert manifest["family"] == family and manifest["text"] == {"trimmed": False, "pad_to": seq}
    assert [s["name"] for s in manifest["streams"]] == ["latents", "prompt_embeds"]
    assert manifest["models"]["vae"]["class"] == "AutoencoderKLFlux2"
    assert manifest["models"]["text_encoder"]["class"] == text_class
    pipe = DiffusionPipeline.from_pretrained(pretrained)
    assert pipe.vae.bn.running_mean.abs().max() > 0.05  # the tiny VAE's normalisation is not the identity
    samples = _first_samples(sd, manifest, 3)
    for sample in samples:
        width, height, _ = json.loads(sample["json"])["bucket"]
        latents = load_tensors(sample["vae.safetensors"])["latents"]
        text = load_tensors(sample["text.safetensors"])
        assert latents.shape == (64, height // 16, width // 16) and set(text) == {"prompt_embeds"}
        with torch.no_grad():  # the pipeline's own VAE path (mode, patchify, batch-norm statistics) and encode_prompt
            expected = pipe._encode_vae_image(_pixels_of(sd, sample)[None], generator=None)[0]
            embeds, _ = pipe.encode_prompt(json.loads(sample["json"])["caption"], max_sequence_length=seq)
        torch.testing.assert_close(latents, expected, atol=1e-5, rtol=1e-5)
        assert text["prompt_embeds"].shape == (seq, 48)
        torch.testing.assert_close(text["prompt_embeds"], embeds[0], atol=1e-5, rtol=1e-5)
    # two captions, two embeddings: the cached text is each caption's own
    a, b = (load_tensors(s["text.safetensors"])["prompt_embeds"] for s in samples[:2])
    assert not torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------- adapter


def _tiny_transformer(guidance: bool):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=[4, 4, 4, 4],
                                   guidance_embeds=guidance).eval()


@pytest.mark.parametrize(("adapter", "pipeline"), [(Flux2KleinAdapter, "Flux2KleinPipeline"),
                                                   (Flux2Adapter, "Flux2Pipeline")])
def test_forward_calls_the_transformer_like_the_pipeline(adapter, pipeline):
    import diffusers

    pipe_cls = getattr(diffusers, pipeline)
    guidance = adapter is Flux2Adapter
    model = _tiny_transformer(guidance)
    gen = torch.Generator().manual_seed(1)
    B, H, W, L = 2, 3, 5, 7
    noisy = torch.randn(B, 64, H, W, generator=gen)
    sigmas = torch.rand(B, generator=gen)
    prompt = torch.randn(B, L, 24, generator=gen)
    cfg = TrainerConfig(guidance_scale=4.0)
    with torch.no_grad():
        pred = adapter().forward(model, noisy, sigmas, {"latents": noisy, "prompt_embeds": prompt}, cfg)
        # the pipeline's __call__: packed latents with their ids, timestep = t / 1000 for t = 1000 sigma
        ids = pipe_cls._prepare_latent_ids(noisy)
        reference = model(
            hidden_states=pipe_cls._pack_latents(noisy),
            timestep=(sigmas * 1000) / 1000,
            guidance=torch.full([1], 4.0).expand(B) if guidance else None,
            encoder_hidden_states=prompt,
            txt_ids=pipe_cls._prepare_text_ids(prompt),
            img_ids=ids,
            return_dict=False,
        )[0]
        reference = pipe_cls._unpack_latents_with_ids(reference, ids, H, W) if pipeline == "Flux2KleinPipeline" \
            else pipe_cls._unpack_latents_with_ids(reference, ids)
    assert pred.shape == noisy.shape
    torch.testing.assert_close(pred, reference)
    if guidance:  # the guidance value reaches the model
        other = flux2_forward(model, noisy, sigmas, prompt, guidance_scale=1.0)
        assert not torch.allclose(other, pred)
    assert adapter().seq_len(noisy) == H * W


def test_resolution_shift_is_the_pipelines_empirical_mu_at_50_steps():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    adapter = Flux2KleinAdapter()
    for seq in (16, 1024, 4096, 6000):
        assert adapter.resolution_mu(seq, TrainerConfig()) == compute_empirical_mu(seq, SHIFT_NUM_STEPS)
    # the scheduler's shifted sigmas at that mu are the trainer's shift map with shift = exp(mu)
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")
    mu = adapter.resolution_mu(4096, TrainerConfig())
    base = np.linspace(1.0, 1 / SHIFT_NUM_STEPS, SHIFT_NUM_STEPS)
    sched.set_timesteps(SHIFT_NUM_STEPS, sigmas=base, mu=mu)
    expected = shift_sigmas(torch.tensor(base, dtype=torch.float32), float(np.exp(mu)))
    torch.testing.assert_close(sched.sigmas[:-1].float(), expected, atol=1e-5, rtol=1e-5)
    assert 7.5 < np.exp(mu) < 7.6  # 1024² at 50 steps: a strong shift, far from FLUX.1's exp(1.15) = 3.16


def test_mismatched_cache_is_refused_with_the_difference():
    model = _tiny_transformer(False)
    check_flux2_batch_fits(model, torch.zeros(1, 64, 2, 2), torch.zeros(1, 3, 24))
    with pytest.raises(ValueError, match="latents have 16 channels .* in_channels is 64"):
        check_flux2_batch_fits(model, torch.zeros(1, 16, 4, 4), torch.zeros(1, 3, 24))
    with pytest.raises(ValueError, match="prompt_embeds width is 4096, transformer joint_attention_dim is 24"):
        check_flux2_batch_fits(model, torch.zeros(1, 64, 2, 2), torch.zeros(1, 3, 4096))


def test_peft_targets_leave_other_families_targets_as_given():
    """Only a name that also matches a container is expanded: FLUX.1's and Wan's targets reach PEFT unchanged
    (their LoRA exports keep the same adapter config)."""
    from diffusers import FluxTransformer2DModel
    from latentmill.trainer.adapter import DEFAULT_LORA_TARGETS, peft_targets

    flux1 = FluxTransformer2DModel(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                   num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
                                   axes_dims_rope=[2, 2, 4])
    assert peft_targets(flux1, list(DEFAULT_LORA_TARGETS)) == list(DEFAULT_LORA_TARGETS)
    expanded = peft_targets(_tiny_transformer(False), ["to_q", "to_out"])
    assert expanded == ["to_q", "single_transformer_blocks.0.attn.to_out"]


def test_lora_targets_reach_both_block_kinds():
    from latentmill.trainer.adapter import make_trainable

    model = make_trainable(_tiny_transformer(False), mode="lora", lora_rank=2, lora_target_modules=list(LORA_TARGETS))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert "single_transformer_blocks.0.attn.to_out" in wrapped  # linear2 of the BFL layout
    assert "single_transformer_blocks.0.attn.to_qkv_mlp_proj" in wrapped  # linear1
    double = {n.removeprefix("transformer_blocks.0.") for n in wrapped if n.startswith("transformer_blocks.0.")}
    assert double == {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                      "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                      "ff_context.linear_out"}


def test_a_lora_without_named_targets_trains_the_familys(tmp_path):
    """``trainer.lora_target_modules`` null (the default): each family's adapter names what its community
    LoRAs train, so a FLUX.2 LoRA reaches the single blocks too, where FLUX.1's default would not."""
    from latentmill.trainer.adapters import ADAPTERS, get_adapter
    from latentmill.trainer.config import TrainerConfig

    assert TrainerConfig().lora_target_modules is None
    model = get_adapter("flux2-klein").freeze_unused(_tiny_transformer(False))
    from latentmill.trainer.adapter import make_trainable

    model = make_trainable(model, mode="lora", lora_rank=2,
                           lora_target_modules=get_adapter("flux2-klein").targets(None))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert "single_transformer_blocks.0.attn.to_qkv_mlp_proj" in wrapped
    assert get_adapter("flux").targets(None) == ["to_k", "to_q", "to_v", "to_out.0"]
    assert get_adapter("flux2").targets(["to_q"]) == ["to_q"]  # a recipe's own list wins
    assert all(get_adapter(family).targets(None) for family in ADAPTERS)


# ---------------------------------------------------------------------------------------------------- training


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "family", "pipeline", "seq"), [("klein", "flux2-klein", "Flux2KleinPipeline", SEQ),
                                                                    ("dev", "flux2", "Flux2Pipeline", DEV_SEQ)])
def test_full_training_exports_a_pipeline_that_loads(request, variant, family, pipeline, seq, tmp_path):
    import diffusers
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    pipe_cls = getattr(diffusers, pipeline)
    pretrained = request.getfixturevalue(f"tiny_flux2_{variant}")
    sd, _, _ = request.getfixturevalue(f"{variant}_cache")
    cfg = TrainerConfig(mode="full", max_steps=4, batch_size=2, learning_rate=1e-3, save_every=4,
                        shift_mode="resolution")
    summary = train(cfg, cache_dir=sd.root, pretrained=str(pretrained), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "export", progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path / "train")]
    assert summary["family"] == family and len(losses) == 4 and all(0 < x < 10 for x in losses)
    pipe = DiffusionPipeline.from_pretrained(summary["export_dir"])
    assert type(pipe) is pipe_cls
    trained = load_file(tmp_path / "train" / "checkpoints" / "step-000004" / "model.safetensors")
    exported = pipe.transformer.state_dict()
    base = pipe_cls.from_pretrained(pretrained).transformer.state_dict()
    assert any(not torch.equal(base[k], exported[k]) for k in trained)
    files = load_file(tmp_path / "export" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert {v.dtype for v in files.values()} == {torch.bfloat16}  # trainer.export_dtype's default
    assert all(torch.equal(exported[k], v.to(torch.bfloat16).to(exported[k].dtype)) for k, v in trained.items())
    image = pipe(prompt="a red square", height=64, width=48, num_inference_steps=2, max_sequence_length=seq,
                 generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (48, 64)
    # `latentmill sample` generates from the export too (its prompt goes by keyword: klein's first argument is
    # a reference image)
    from PIL import Image

    from latentmill.sample import sample

    sample(summary["export_dir"], ["a red square", "a blue circle"], out=tmp_path / "samples", steps=2,
           size=[48, 64], repeat=0, max_sequence_length=seq, device="cpu")
    pngs = sorted((tmp_path / "samples" / "images").glob("*.png"))
    assert len(pngs) == 2 and all(Image.open(p).size == (48, 64) for p in pngs)
    timing = json.loads((tmp_path / "samples" / "timing.json").read_text())
    assert timing["family"] == family and timing["kind"] == "full-export"


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "pipeline", "seq"), [("klein", "Flux2KleinPipeline", SEQ),
                                                         ("dev", "Flux2Pipeline", DEV_SEQ)])
def test_lora_export_loads_into_the_base_pipeline(request, variant, pipeline, seq, tmp_path):
    import diffusers
    from PIL import Image

    pipe_cls = getattr(diffusers, pipeline)
    pretrained = request.getfixturevalue(f"tiny_flux2_{variant}")
    sd, _, _ = request.getfixturevalue(f"{variant}_cache")
    add_validation_prompts(sd.root, str(pretrained), ["a red square"], max_sequence_length=seq)  # as a prep does
    cfg = TrainerConfig(mode="lora", max_steps=3, batch_size=2, learning_rate=1e-2, lora_rank=4, save_every=0,
                        lora_target_modules=list(LORA_TARGETS), validate_every=3, validation_prompts=["a red square"],
                        validation_steps=1, validation_size=[48, 64])
    summary = train(cfg, cache_dir=sd.root, pretrained=str(pretrained), train_dir=tmp_path / "train",
                    export_dir=tmp_path / "lora", progress=False)
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    (grid,) = summary["validation"]
    assert Image.open(grid).size == (48, 64)
    pipe = pipe_cls.from_pretrained(pretrained)
    call = dict(prompt="a red square", height=64, width=48, num_inference_steps=2, max_sequence_length=seq,
                output_type="np")
    before = pipe(generator=torch.Generator().manual_seed(0), **call).images
    pipe.load_lora_weights(summary["export_dir"])
    (name,) = pipe.get_active_adapters()
    assert pipe.transformer.peft_config[name].r == 4
    loaded = {n for n, _ in pipe.transformer.named_modules() if n.endswith(".lora_A")}
    assert "single_transformer_blocks.1.attn.to_out.lora_A" in loaded  # linear2 of the single blocks
    assert "transformer_blocks.0.ff_context.linear_out.lora_A" in loaded
    after = pipe(generator=torch.Generator().manual_seed(0), **call).images
    assert after.shape == before.shape == (1, 64, 48, 3) and not np.allclose(after, before)


@pytest.mark.slow
@pytest.mark.heavy  # the demo path make test runs for FLUX.1 and Qwen-Image (make test-all)
def test_the_dev_demo_recipe_preps_trains_and_exports(tiny_flux2_dev, tmp_path):
    """configs/demo-flux2.yaml through the CLI (prep -> train -> export) on the demo images, a few steps."""
    from diffusers import DiffusionPipeline, Flux2Pipeline

    from latentmill.cli import main
    from tests.conftest import REPO_ROOT

    out = tmp_path / "run"
    assert main(["run", str(REPO_ROOT / "configs" / "demo-flux2.yaml"), f"output_dir={out}",
                 f"model.pretrained={tiny_flux2_dev}", "trainer.max_steps=6", "trainer.save_every=0"]) == 0
    manifest = json.loads((out / "prep" / "cache" / "manifest.json").read_text())
    assert manifest["family"] == "flux2" and manifest["counts"]["out"] == 24
    losses = [json.loads(line)["loss"] for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and all(0 < x < 10 for x in losses)
    assert isinstance(DiffusionPipeline.from_pretrained(out / "export"), Flux2Pipeline)


# ---------------------------------------------------------------------------------------------------- bad input


def _fake_pipeline(root, pipeline, classes):
    """A pipeline folder of config files only: model_index.json and each component's config.json."""
    root.mkdir(parents=True)
    index = {name: ["diffusers" if "Model" in cls and "For" not in cls else "transformers", cls]
             for name, cls in classes.items()}
    (root / "model_index.json").write_text(json.dumps({"_class_name": pipeline, **index}))
    for name, cls in classes.items():
        (root / name).mkdir()
        key = {"_class_name": cls} if "Model" in cls and "For" not in cls or cls.startswith("Autoencoder") \
            else {"architectures": [cls]}
        (root / name / "config.json").write_text(json.dumps(key))
    return root


def test_a_recipe_mixing_families_stops_in_preflight_with_one_line(tmp_path):
    from latentmill.core.config import ConfigError
    from latentmill.preflight import check_recipe

    klein = _fake_pipeline(tmp_path / "klein", "Flux2KleinPipeline",
                           {"transformer": "Flux2Transformer2DModel", "vae": "AutoencoderKLFlux2",
                            "text_encoder": "Qwen3ForCausalLM"})
    flux1 = _fake_pipeline(tmp_path / "flux1", "FluxPipeline",
                           {"transformer": "FluxTransformer2DModel", "vae": "AutoencoderKL",
                            "text_encoder": "CLIPTextModel", "text_encoder_2": "T5EncoderModel"})
    dev = _fake_pipeline(tmp_path / "dev", "Flux2Pipeline",
                         {"transformer": "Flux2Transformer2DModel", "vae": "AutoencoderKLFlux2",
                          "text_encoder": "Mistral3ForConditionalGeneration"})

    def check(**model):
        check_recipe(Recipe(output_dir=str(tmp_path / "out"), model=ModelConfig(**model)), "check")

    check(pretrained=str(klein))
    check(pretrained=str(klein), vae=str(dev / "vae"))  # dev and klein share the VAE class
    with pytest.raises(ConfigError) as err:
        check(pretrained=str(klein), vae=str(flux1 / "vae"))
    assert str(err.value) == (f"model.vae: {flux1 / 'vae'} is a AutoencoderKL; the Flux2KleinPipeline at {klein} "
                              "takes a AutoencoderKLFlux2: a recipe cannot mix components of different model families")
    with pytest.raises(ConfigError, match="model.text_encoder: .* is a Mistral3ForConditionalGeneration; the "
                                          "Flux2KleinPipeline at .* takes a Qwen3ForCausalLM"):
        check(pretrained=str(klein), text_encoder=str(dev))  # a pipeline folder as the override: its subfolder
    with pytest.raises(ConfigError, match="model.family: 'flux2', but .* is a FluxPipeline \\(the 'flux' family\\)"):
        check(pretrained=str(flux1), family="flux2")
    with pytest.raises(ConfigError, match="model.vae: .* is a AutoencoderKLFlux2; the FluxPipeline at .* takes a "
                                          "AutoencoderKL"):
        check(pretrained=str(flux1), vae=str(klein))


def test_the_cli_refuses_a_flux1_vae_under_flux2_before_any_work(tiny_flux2_klein, tmp_path):
    from tests.test_cli_errors import _cli, _one_error_line

    flux1 = _fake_pipeline(tmp_path / "flux1", "FluxPipeline", {"vae": "AutoencoderKL"})
    out = tmp_path / "out"
    line = _one_error_line(_cli("prep", "configs/demo-flux2-klein.yaml", f"output_dir={out}",
                                f"model.pretrained={tiny_flux2_klein}", f"model.vae={flux1 / 'vae'}"))
    assert line == (f"latentmill: error: model.vae: {flux1 / 'vae'} is a AutoencoderKL; the Flux2KleinPipeline at "
                    f"{tiny_flux2_klein} takes a AutoencoderKLFlux2: a recipe cannot mix components of different "
                    "model families")
    assert not out.exists()  # nothing ran, nothing was written


# ---------------------------------------------------------------------------------------------------- parallel


@pytest.mark.slow
@pytest.mark.heavy  # the FSDP2 and DDP paths make test runs for FLUX.1, Wan and Qwen-Image (make test-all)
def test_fsdp2_resumes_exactly_and_ddp_lora_trains_on_klein(tiny_flux2_klein, klein_cache, tmp_path):
    """One 2-rank torchrun launch (gloo, CPU): FSDP2 full (the adapter's blocks as units) with an exact resume
    from its step-2 checkpoint, and DDP LoRA (single-block targets included), on the real klein cache."""
    from latentmill.trainer.checkpoint import list_checkpoints

    from tests.trainer_helpers import launch_jobs

    sd, _, _ = klein_cache
    base = {"max_steps": 4, "batch_size": 2, "learning_rate": 1e-3, "save_every": 2, "keep_latest_k": 0,
            "export": False, "shift_mode": "resolution"}

    def job(name, parallel, **cfg):
        return {"cfg": {**base, **cfg}, "cache": str(sd.root), "pretrained": str(tiny_flux2_klein),
                "train_dir": str(tmp_path / name), "parallel": parallel}

    step2 = tmp_path / "a" / "checkpoints" / "step-000002"
    jobs = [job("a", {"strategy": "fsdp2"}, mode="full", export=True),
            job("b", {"strategy": "fsdp2"}, mode="full", resume=str(step2)),
            job("c", {"strategy": "ddp"}, mode="lora", lora_rank=4, learning_rate=1e-2,
                lora_target_modules=list(LORA_TARGETS), export=True)]
    summaries = dict(zip("abc", launch_jobs(tmp_path, jobs)))
    rank0, rank1 = summaries["a"]
    assert rank0["family"] == "flux2-klein" and rank0["steps"] == rank1["steps"] == 4
    assert rank0["final_loss"] == rank1["final_loss"]
    losses = [r["loss"] for r in read_metrics(tmp_path / "a")]
    assert len(losses) == 4 and all(0 < x < 10 for x in losses)
    assert len(list((list_checkpoints(tmp_path / "a" / "checkpoints")[0][1] / "dcp").glob("*.distcp"))) == 2
    assert [r["loss"] for r in read_metrics(tmp_path / "b")] == losses[2:]  # bit for bit from step 3 on
    from diffusers import DiffusionPipeline, Flux2KleinPipeline

    assert isinstance(DiffusionPipeline.from_pretrained(rank0["export_dir"]), Flux2KleinPipeline)
    lora0, lora1 = summaries["c"]
    assert lora0["steps"] == 4 and lora1["export_dir"] is None
    assert (Path(lora0["export_dir"]) / "pytorch_lora_weights.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------- tiny models


@pytest.mark.slow
def test_tiny_builds_are_byte_reproducible(tiny_flux2_klein, tmp_path):
    from latentmill.core.hashing import sha256_file
    from latentmill.tiny_flux2 import KLEIN_RECIPE_PATH, build_tiny_flux2

    again = build_tiny_flux2(tmp_path / "again", KLEIN_RECIPE_PATH, seed=0)
    files = sorted(p.relative_to(tiny_flux2_klein) for p in tiny_flux2_klein.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    weights = [f for f in files if f.suffix == ".safetensors"]
    assert len(weights) == 3  # transformer, vae, text_encoder
    assert all(sha256_file(tiny_flux2_klein / f) == sha256_file(again / f) for f in files)


def test_tiny_recipes_are_checked_before_anything_is_built(tmp_path):
    import yaml

    from latentmill.core.config import ConfigError
    from latentmill.tiny_flux2 import DEV_RECIPE_PATH, KLEIN_RECIPE_PATH, load_recipe

    assert load_recipe(KLEIN_RECIPE_PATH)["variant"] == "klein" and load_recipe(DEV_RECIPE_PATH)["variant"] == "dev"
    data = yaml.safe_load(KLEIN_RECIPE_PATH.read_text())
    cases = [
        (("transformer", "joint_attention_dim", 32), "joint_attention_dim: 32 != 3 x components.text_encoder.hidden_size"),
        (("text_encoder", "num_hidden_layers", 20), "num_hidden_layers: 20 < 27; the pipeline reads hidden layers"),
        (("transformer", "in_channels", 128), "in_channels: 128 != 4 x components.vae.latent_channels"),
        (("transformer", "guidance_embeds", True), "FLUX.2 \\[dev\\] has a guidance embedding, \\[klein\\] has none"),
    ]
    for (component, key, value), message in cases:
        changed = yaml.safe_load(yaml.safe_dump(data))
        changed["components"][component][key] = value
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(changed))
        with pytest.raises(ConfigError, match=message):
            load_recipe(path)
