"""Test helpers shared by several test modules."""

from __future__ import annotations

from latentmill.pipelines.prep import run_stages_in_process as prep_in_process  # noqa: F401  (the stages, no Prefect)


def qwen2vl_processor(pipeline_folder):
    """The ``Qwen2VLProcessor`` of a Qwen-Image-Edit pipeline folder, its own ``__call__`` over its tokenizer and
    image processor. Its constructor cannot run here: transformers 5 checks its video half against a class
    that exists only beside torchvision, which the CPU install lacks; the attributes it would set are set."""
    from pathlib import Path

    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor

    folder = Path(pipeline_folder) / "processor"
    processor = object.__new__(Qwen2VLProcessor)
    processor.image_processor = Qwen2VLImageProcessor.from_pretrained(folder)
    processor.tokenizer = AutoTokenizer.from_pretrained(folder)
    processor.video_processor, processor.chat_template = None, None
    for kind in ("image", "video"):
        token = f"<|{kind}_pad|>"
        setattr(processor, f"{kind}_token", token)
        setattr(processor, f"{kind}_token_id", processor.tokenizer.convert_tokens_to_ids(token))
    return processor


def assert_recipe_refused(tmp_path, load_recipe, recipe, change, match: str) -> None:
    """``load_recipe`` refuses the recipe YAML ``recipe`` after ``change(data)`` (written to ``tmp_path/bad.yaml``)
    with a ConfigError whose message matches ``match``."""
    from pathlib import Path

    import pytest
    import yaml

    from latentmill.core.config import ConfigError

    data = yaml.safe_load(Path(recipe).read_text(encoding="utf-8"))
    change(data)
    bad = Path(tmp_path) / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=match):
        load_recipe(bad)
