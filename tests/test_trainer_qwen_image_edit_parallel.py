"""Qwen-Image-Edit under torchrun on CPU (gloo), as Qwen-Image's 2-rank test: FSDP2 over the adapter's blocks
(full, activation checkpointing) with a sharded checkpoint, an exact resume and a gathered export for
QwenImageEditPipeline (make test); DDP LoRA with an exact resume and a LoRA export (make test-all). Every
batch carries the sources' latents beside the targets' and masked text of different lengths."""

from pathlib import Path

import pytest
from latentmill.trainer.checkpoint import list_checkpoints

from tests.trainer_helpers import run_and_resume, write_fake_cache

pytestmark = pytest.mark.slow  # a torchrun launch starts two interpreters


def _run(root: Path, pretrained: Path, parallel: dict, **cfg) -> dict:
    """Train 8 steps (checkpoint at 4) and resume from step 4 on 2 ranks (tests.trainer_helpers.run_and_resume);
    rank 0's summary of the run."""
    from latentmill.stages.families import family_streams

    write_fake_cache(root / "cache", {(48, 64, 1): 5, (64, 32, 1): 3}, family="qwen-image-edit", smooth=True,
                     trimmed=True, seq_len=8, shards_per_bucket=2, reference=True,
                     streams=[s.to_json() for s in family_streams("qwen-image-edit")])
    rank0, _ = run_and_resume(root, root / "cache", pretrained, parallel, 8, lora_rank=4, **cfg)
    assert rank0["family"] == "qwen-image-edit"
    return rank0


# the second variant of Qwen-Image's 2-rank FSDP2 path (tests/test_trainer_qwen_image_parallel.py, in make test):
# make test-all
@pytest.mark.heavy
def test_fsdp2_full_trains_resumes_exactly_and_exports(tiny_qwen_image_edit, tmp_path):
    import torch
    from diffusers import DiffusionPipeline, QwenImageEditPipeline

    from tests.helpers import qwen2vl_processor

    pretrained = tiny_qwen_image_edit
    rank0 = _run(tmp_path, pretrained, {"strategy": "fsdp2"}, mode="full", activation_checkpointing=True)
    step4 = list_checkpoints(tmp_path / "run" / "checkpoints")[0][1]
    assert len(list((step4 / "dcp").glob("*.distcp"))) == 2  # sharded: one file per rank
    export = rank0["export_dir"]
    pipe = DiffusionPipeline.from_pretrained(export, processor=qwen2vl_processor(export))
    assert isinstance(pipe, QwenImageEditPipeline)
    base = QwenImageEditPipeline.from_pretrained(pretrained, processor=None).transformer.state_dict()
    exported = pipe.transformer.state_dict()
    assert base.keys() == exported.keys() and any(not torch.equal(base[k], exported[k].to(base[k].dtype))
                                                  for k in base)


@pytest.mark.heavy  # the second variant of the 2-rank path (DDP LoRA), in make test-all
def test_ddp_lora_resumes_exactly_and_exports(tiny_qwen_image_edit, tmp_path):
    from diffusers import QwenImageEditPipeline
    from latentmill.trainer.qwen_image import QWEN_IMAGE_LORA_TARGETS

    rank0 = _run(tmp_path, tiny_qwen_image_edit, {"strategy": "ddp"}, mode="lora", learning_rate=1e-2)
    pipe = QwenImageEditPipeline.from_pretrained(tiny_qwen_image_edit, processor=None)
    pipe.load_lora_weights(rank0["export_dir"])
    (adapter,) = pipe.get_active_adapters()
    assert set(pipe.transformer.peft_config[adapter].target_modules) == set(QWEN_IMAGE_LORA_TARGETS)
