"""Test helpers shared by several test modules."""

from __future__ import annotations

import json
from pathlib import Path

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


DEMO_IMAGES = Path(__file__).resolve().parents[1] / "data" / "demo" / "images"


def upload_demo_inputs(fs, bucket: str, count: int | None = None) -> str:
    """The demo images (the first ``count``) and a JSON-lines manifest of them (path, caption from the
    sidecar) on the store."""
    rows = []
    for image in sorted(p for p in DEMO_IMAGES.iterdir() if p.suffix != ".txt")[:count]:
        fs.pipe_file(f"{bucket}/inputs/{image.name}", image.read_bytes())
        caption = image.with_suffix(".txt")
        rows.append({"path": image.name, **({"caption": caption.read_text().strip()} if caption.is_file() else {})})
    fs.pipe_file(f"{bucket}/inputs/list.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    scheme = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol  # s3, gs
    return f"{scheme}://{bucket}/inputs/list.jsonl"
