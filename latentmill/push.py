"""``latentmill push PATH --repo-id OWNER/NAME [--private]``: hand an export or a snapshot on through the Hub.

An export folder (it holds ``latentmill.json``) goes to a model repository with its model card
(``README.md``, written with the export: ``latentmill.trainer.card``). A snapshot folder
(``<output_dir>/snapshots/<name>``) goes to a dataset repository: its latent shards and their indexes under
``shards/``, its manifest with the shard paths pointing there (the repository, downloaded, is a cache folder
the trainer reads), and a dataset card. Every check runs before the first request: the token
(``HF_TOKEN`` or ``hf auth login``), the repo id, what the folder is. Nothing local is published: a local
absolute path in ``latentmill.json`` or the manifest shows as its last name (``card.public_data``).
``HF_ENDPOINT`` names another Hub (a mirror, or a test's stand-in).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from latentmill.core.config import ConfigError
from latentmill.trainer.card import public, public_data


def _token() -> str:
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise ConfigError("push: no Hugging Face token: set HF_TOKEN or run `hf auth login` (nothing was uploaded)")
    return token


def check_repo_id(repo_id: str) -> None:
    """``owner/name`` as the Hub allows it, or a one-line ``ConfigError``."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
        if repo_id.count("/") != 1:
            raise HFValidationError("it needs an owner")
    except HFValidationError as err:
        reason = str(err).splitlines()[0].rstrip(".")
        raise ConfigError(f"push: --repo-id {repo_id!r} is not a valid Hub repo id ({reason}); use OWNER/NAME: "
                          "letters, digits, '-', '_', '.', at most 96 characters (nothing was uploaded)") from None


def _kind(path: Path) -> str:
    if (path / "latentmill.json").is_file():
        return "model"
    manifest = path / "manifest.json"
    if manifest.is_file() and "snapshot" in json.loads(manifest.read_text()):
        return "dataset"
    raise ConfigError(f"push: {path} is neither an export (no latentmill.json) nor a snapshot folder (no "
                      "manifest.json with a snapshot); give <output_dir>/export or <output_dir>/snapshots/<name>")


def model_files(export: Path) -> list[tuple[str, Path | bytes]]:
    """(path in the repo, local file or bytes) of an export: every file, ``latentmill.json`` made public."""
    if not (export / "README.md").is_file():
        raise ConfigError(f"push: {export} has no model card (README.md); exports made before model cards get one "
                          "when trained again with the same recipe and trainer.resume=latest")
    files: list[tuple[str, Path | bytes]] = []
    for path in sorted(p for p in export.rglob("*") if p.is_file()):
        rel = path.relative_to(export).as_posix()
        if rel == "latentmill.json":
            files.append((rel, json.dumps(public_data(json.loads(path.read_text())), indent=1,
                                          sort_keys=True).encode()))
        else:
            files.append((rel, path))
    return files


def dataset_files(snapshot: Path) -> list[tuple[str, Path | bytes]]:
    """(path in the repo, local file or bytes) of a snapshot: shards and indexes under ``shards/``, the
    manifest pointing there, the dataset card."""
    manifest = json.loads((snapshot / "manifest.json").read_text())
    files: list[tuple[str, Path | bytes]] = []
    shards = []
    for entry in manifest["shards"]:
        tar = (snapshot / entry["path"]).resolve()
        files.append((f"shards/{tar.name}", tar))
        if entry.get("index"):
            files.append((f"shards/{entry['index']['name']}", tar.parent / entry["index"]["name"]))
        shards.append({**entry, "path": f"shards/{tar.name}"})
    published = {**manifest, "shards": shards}
    for field in ("empty_prompt", "validation_prompts"):  # files beside the cache's shards
        if field in manifest:
            file = (snapshot / manifest[field]["path"]).resolve()
            files.append((f"shards/{file.name}", file))
            published[field] = {**manifest[field], "path": f"shards/{file.name}"}
    files.append(("manifest.json", json.dumps(public_data(published), indent=1, sort_keys=True).encode()))
    files.append(("README.md", dataset_card(published).encode()))
    return files


def dataset_card(manifest: dict[str, Any]) -> str:
    """A dataset card for a published snapshot: what the latents are and how they were made."""
    snap = manifest["snapshot"]
    prep = snap.get("prep") or {}
    family = manifest.get("family", "flux")
    front = {"library_name": "latentmill", "tags": ["latentmill", "latents", "webdataset", family],
             "pretty_name": f"latentmill snapshot {snap['name']}"}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# latentmill snapshot {snap['name']}", "",
             f"Cached {family} latents and text embeddings of {snap['samples']} samples, in webdataset shards "
             f"(`shards/`, cache format {manifest.get('format_version')}), made by latentmill's prep. "
             f"Content id `{snap['content_id']}`.", "",
             "Downloaded, this repository is a cache folder: `latentmill.trainer.train(cfg, cache_dir=FOLDER, ...)` "
             "trains on it with the same encoders (`manifest.json` names them and their fingerprints).", "",
             "## Encoders", "", "| component | class | fingerprint |", "|---|---|---|"]
    lines += [f"| {name} | {m.get('class')} | `{str(m.get('fingerprint'))[:16]}` |"
              for name, m in sorted((manifest.get("models") or {}).items())]
    lines += ["", "## Buckets (width x height x frames)", "", "| bucket | samples |", "|---|---:|"]
    lines += [f"| {name} | {count} |" for name, count in (snap.get("buckets") or {}).items()]
    if prep.get("stages"):
        lines += ["", "## Preparation", "", f"Captioner: {public(prep.get('captioner') or '?')}. Curation: "
                  + (", ".join(f"{k} {v}" for k, v in sorted((prep.get("curation") or {}).get("thresholds", {}).items()))
                     or "no thresholds") + ".", "",
                  "| stage | in | out | quarantined |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {c['in']} | {c['out']} | {c['quarantined']} |" for name, c in prep["stages"].items()]
    return "\n".join(lines) + "\n"


def push(path: str | Path, repo_id: str, *, private: bool = False) -> dict[str, Any]:
    """Upload an export (model repo) or a snapshot (dataset repo) to ``repo_id``; returns ``{"repo_type",
    "url", "commit", "files"}``. All checks (token, repo id, folder) come before any request."""
    from huggingface_hub import CommitOperationAdd, HfApi

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"push: {path} is not a folder (give an export or a snapshot folder)")
    check_repo_id(repo_id)
    kind = _kind(path)
    token = _token()
    files = model_files(path) if kind == "model" else dataset_files(path)
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    url = api.create_repo(repo_id, repo_type=kind, private=private, exist_ok=True)
    commit = api.create_commit(repo_id, repo_type=kind, commit_message=f"latentmill push of {path.name}",
                               operations=[CommitOperationAdd(path_in_repo=rel, path_or_fileobj=src if isinstance(
                                   src, bytes) else str(src)) for rel, src in files])
    return {"repo_type": kind, "url": str(url), "commit": commit.oid, "files": [rel for rel, _ in files]}
