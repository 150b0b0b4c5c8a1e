"""Test helpers shared by several test modules."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a server a test starts)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def loopback_server(cmd: list[str], probe: str, name: str, timeout: float = 120.0, poll: float = 0.1,
                    log: Path | None = None, env: dict[str, str] | None = None) -> Iterator[None]:
    """Run ``cmd`` (a server on 127.0.0.1, in a session of its own) until ``probe`` (a URL) answers, for the
    body; then stop its whole process group. A server that exits or stays silent for ``timeout`` seconds fails
    naming ``name`` (and the tail of ``log``, its output, when given)."""
    import os
    import signal
    import subprocess
    import time
    import urllib.request

    out = open(log, "wb") if log else subprocess.DEVNULL
    try:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    finally:
        if log:
            out.close()
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(probe, timeout=5).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text(errors="replace")[-2000:] if log else ""
                    raise RuntimeError(f"{name} did not start on {probe} (exit {server.poll()})\n{tail}") from None
                time.sleep(poll)
        yield
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)  # the server and any workers it started
        except ProcessLookupError:
            pass
        server.wait(60)


def store(scheme: str = "s3"):
    """The test server's filesystem as a test reads it: every listing asks the server (as ``store_fs`` does),
    since the code under test writes and deletes through instances and processes of its own."""
    import fsspec

    return fsspec.filesystem(scheme, use_listings_cache=False)


def demo_prep_twice_on_store(scheme: str, bucket: str, tiny_flux: Path, tmp_path: Path, monkeypatch) -> tuple[str, dict]:
    """The demo's prep with its inputs and output in ``bucket`` of a test store, then again from a fresh work folder
    (another machine), checking what a prep on any store shows: 24 samples cached and published, ``LATEST`` naming
    the snapshot, the writer lease released, and the second prep processing and uploading nothing (objects
    compared by the MD5 the store gives). The output's URL and the first prep's summary."""
    from latentmill.cli import main

    fs = store(scheme)
    url = f"{scheme}://{bucket}/out"
    source = upload_demo_inputs(fs, bucket)
    config = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")

    def prep(summary: Path) -> dict:
        assert main(["prep", config, f"output_dir={url}", f"model.pretrained={tiny_flux}", f"ingest.source={source}",
                     "--summary-json", str(summary)]) == 0
        return json.loads(summary.read_text())

    first = prep(tmp_path / "first.json")
    name = first["snapshot"]["name"]
    assert first["stages"]["cache"]["out"] == 24 and first["store"]["uploaded"] > 0
    assert fs.cat_file(f"{bucket}/out/snapshots/LATEST").decode().strip() == name
    assert json.loads(fs.cat_file(f"{bucket}/out/.writer.lock")) == {"holder": "", "expires": 0}  # released
    monkeypatch.setenv("LATENTMILL_WORK_DIR", str(tmp_path / "work-fresh"))
    again = prep(tmp_path / "again.json")
    assert all(s["processed"] == 0 for s in again["stages"].values())
    assert again["snapshot"]["name"] == name and again["store"]["uploaded"] == 0
    return url, first
