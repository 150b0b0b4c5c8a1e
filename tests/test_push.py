"""``latentmill push``: an export to a model repo, a snapshot to a dataset repo, through huggingface_hub against a
small loopback server standing in for the Hub API (it records every request); bad input fails before any."""

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from latentmill.pipelines.snapshot import publish

from latentmill.cli import main
from latentmill.core.config import ConfigError
from latentmill.push import push
from tests.trainer_helpers import write_fake_cache

COMMIT = "c0ffee" + "0" * 34


class _Hub(BaseHTTPRequestHandler):
    """The three calls of a push of small files: create the repo, ask how to upload, commit them inline."""

    def log_message(self, *args):  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _answer(self, data: dict, status: int = 200) -> None:
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self._body()
        self.server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        base = f"http://127.0.0.1:{self.server.server_port}"
        path = self.path.split("?")[0]
        if path == "/api/repos/create":
            payload = json.loads(body)
            repo = f"{payload['organization']}/{payload['name']}"
            prefix = "datasets/" if payload.get("type") == "dataset" else ""
            return self._answer({"url": f"{base}/{prefix}{repo}", "name": repo, "id": repo})
        if path == "/api/validate-yaml":  # the Hub checks a README's front matter before the commit
            content = json.loads(body)["content"]
            try:
                yaml.safe_load(content.split("---")[1])
            except (IndexError, yaml.YAMLError) as err:
                return self._answer({"error": f"invalid metadata: {err}"}, 400)
            return self._answer({"warnings": []})
        if path.endswith("/preupload/main"):
            files = json.loads(body)["files"]
            return self._answer({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                            "oid": None} for f in files]})
        if path.endswith("/commit/main"):
            repo = path.split("/api/")[1].rsplit("/commit/", 1)[0]
            return self._answer({"commitUrl": f"{base}/{repo}/commit/{COMMIT}", "commitOid": COMMIT,
                                 "pullRequestUrl": None})
        return self._answer({"error": f"not here: {path}"}, 404)

    do_PUT = do_POST


@pytest.fixture()
def hub(monkeypatch, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_TOKEN", "hf_testtoken123")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    yield server
    server.shutdown()
    server.server_close()


def _committed(server) -> dict[str, bytes]:
    """The files of the commit request: path -> bytes (NDJSON lines, contents in base64)."""
    (commit,) = [r for r in server.requests if r["path"].split("?")[0].endswith("/commit/main")]
    files = {}
    for line in commit["body"].decode().splitlines():
        item = json.loads(line)
        if item["key"] == "file":
            files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
    return files


def _export(root: Path) -> Path:
    export = root / "export"
    (export / "images").mkdir(parents=True)
    (export / "README.md").write_text("---\nlibrary_name: diffusers\n---\n# card\n")
    (export / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
    (export / "images" / "step-000002.png").write_bytes(b"png")
    (export / "latentmill.json").write_text(json.dumps({"output_dir": str(root / "out"), "snapshot": "0001-ab",
                                                        "pretrained": "/home/me/models/FLUX.1-dev", "steps": 2}))
    return export


def test_an_export_goes_to_a_model_repo_with_its_card(hub, tmp_path):
    export = _export(tmp_path)
    pushed = push(export, "someone/my-lora", private=True)
    assert pushed["repo_type"] == "model" and pushed["commit"] == COMMIT
    create = json.loads(hub.requests[0]["body"])
    assert hub.requests[0]["path"] == "/api/repos/create"
    assert (create["name"], create["organization"], create["visibility"]) == ("my-lora", "someone", "private")
    assert all(r["auth"] == "Bearer hf_testtoken123" for r in hub.requests)
    assert [r["path"].split("?")[0] for r in hub.requests[1:]] == [
        "/api/validate-yaml", "/api/models/someone/my-lora/preupload/main", "/api/models/someone/my-lora/commit/main"]
    files = _committed(hub)
    assert sorted(files) == ["README.md", "images/step-000002.png", "latentmill.json",
                             "pytorch_lora_weights.safetensors"]
    assert files["README.md"] == (export / "README.md").read_bytes()
    assert files["pytorch_lora_weights.safetensors"] == b"weights"
    info = json.loads(files["latentmill.json"])
    assert info == {"output_dir": "out", "snapshot": "0001-ab", "pretrained": "FLUX.1-dev", "steps": 2}
    assert str(tmp_path).encode() not in b"".join(files.values())


def test_a_snapshot_goes_to_a_dataset_repo_that_is_a_cache_folder(hub, tmp_path):
    out = tmp_path / "out"
    write_fake_cache(out / "prep" / "cache", {(32, 32, 1): 3, (32, 48, 1): 2}, seq_len=8)
    snapshot = Path(publish(out, out / "prep" / "cache")["path"])
    pushed = push(snapshot, "someone/latents")
    assert pushed["repo_type"] == "dataset"
    assert json.loads(hub.requests[0]["body"])["type"] == "dataset"
    files = _committed(hub)
    manifest = json.loads(files["manifest.json"])
    local = json.loads((snapshot / "manifest.json").read_text())
    assert [s["path"] for s in manifest["shards"]] == [f"shards/{Path(s['path']).name}" for s in local["shards"]]
    for shard in local["shards"]:  # the shards and their indexes, byte for byte
        tar = (snapshot / shard["path"]).resolve()
        assert files[f"shards/{tar.name}"] == tar.read_bytes()
        assert files[f"shards/{shard['index']['name']}"] == (tar.parent / shard["index"]["name"]).read_bytes()
    assert manifest["snapshot"]["content_id"] == local["snapshot"]["content_id"]
    card = files["README.md"].decode()
    assert f"# latentmill snapshot {snapshot.name}" in card and "Cached flux latents" in card
    assert "| 32x32x1 | 3 |" in card and "| 32x48x1 | 2 |" in card
    assert str(tmp_path).encode() not in b"".join(files.values())


def test_no_token_or_a_bad_repo_id_fails_in_one_line_before_any_request(hub, tmp_path, monkeypatch, capsys):
    export = _export(tmp_path)
    for repo_id in ("no-owner", "a/b/c", "some one/x", "owner/" + "x" * 100):
        with pytest.raises(ConfigError, match=r"push: --repo-id .* is not a valid Hub repo id .*use OWNER/NAME"):
            push(export, repo_id)
    monkeypatch.delenv("HF_TOKEN")
    assert main(["push", str(export), "--repo-id", "someone/x"]) == 2
    err = capsys.readouterr().err
    assert err == ("latentmill: error: push: no Hugging Face token: set HF_TOKEN or run `hf auth login` "
                   "(nothing was uploaded)\n")
    with pytest.raises(ConfigError, match="neither an export .* nor a snapshot folder"):
        push(tmp_path, "someone/x")
    assert hub.requests == []
