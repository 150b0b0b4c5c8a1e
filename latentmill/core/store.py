"""Output folders on an object store: an ``output_dir`` given as an fsspec URL (``s3://bucket/prefix``).

The store is reached through fsspec with no options of ours: credentials, endpoint and region come from the
environment and fsspec's own configuration (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``~/.aws``,
``FSSPEC_S3_*``), so none of them is ever part of a recipe, a manifest or a record. What must be local (the
SQLite catalog, the input digests, scratch) lives in a work folder on this machine (:func:`work_dir_for`).
See docs/object-stores.md.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from latentmill.core.config import ConfigError

CHECK_TIMEOUT_S = 5  # the start-up check's connect timeout: an unreachable endpoint fails in seconds
# What the start-up check's messages name per store: the command that makes a bucket, where credentials come
# from, the settings of the endpoint (any other fsspec store is named as S3's)
S3_HINTS = ("aws s3 mb s3://", "AWS_ACCESS_KEY_ID, ...", ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))
GCS_HINTS = ("gcloud storage buckets create gs://", "GOOGLE_APPLICATION_CREDENTIALS, ...", ("STORAGE_EMULATOR_HOST",))
# Azure: the endpoint named is the client's host (never the connection string's text: it holds the key)
AZURE_HINTS = ("az storage container create --name ", "AZURE_STORAGE_CONNECTION_STRING, ...",
               ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME"))
STORE_HINTS = {"gs": GCS_HINTS, "gcs": GCS_HINTS, "az": AZURE_HINTS, "abfs": AZURE_HINTS, "abfss": AZURE_HINTS}


class StoreError(RuntimeError):
    """An object store that cannot be used (unreachable, missing bucket, refused credentials), in one line."""


def is_url(path: Any) -> bool:
    """Whether ``path`` names an object-store location (``scheme://``) rather than a local folder."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


def _check_url(url: str) -> None:
    if urlsplit(url).username is not None or urlsplit(url).password is not None:
        raise ConfigError("output_dir: the URL holds credentials; give them through the environment (e.g. "
                          "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or fsspec's configuration, never in a URL")


def store_fs(url: str, **options: Any) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it (``bucket/prefix``, no trailing slash)."""
    import fsspec

    _check_url(url)
    # Every listing asks the store: another process writes there, and a cached listing would still name the
    # objects it deleted (``exists`` true, an emptied folder listed) and miss the ones it wrote.
    options.setdefault("use_listings_cache", False)
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as err:  # s3fs, gcsfs, adlfs: an extra each
        scheme = url.split("://", 1)[0]
        raise ConfigError(f"output_dir: {url} needs the {scheme} filesystem for fsspec ({err}); install "
                          "`latentmill[s3]` for S3, `latentmill[gcs]` for GCS, `latentmill[az]` for Azure") from None
    return fs, root.rstrip("/")


def join(root: str, *parts: str) -> str:
    """``root/part/...`` inside a store (its paths always use ``/``)."""
    return "/".join([root.rstrip("/"), *[p.strip("/") for p in parts if p]])


def check_store(url: str) -> None:
    """Fail in one line, before any work, when the store behind ``url`` cannot be used: an endpoint that does
    not answer, a bucket that does not exist, credentials it refuses."""
    options: dict[str, Any] = {"skip_instance_cache": True}
    if url.startswith(("s3://", "s3a://")):  # botocore's defaults retry for about 8 s before giving up
        options["config_kwargs"] = {"connect_timeout": CHECK_TIMEOUT_S, "retries": {"max_attempts": 1}}
    fs, root = store_fs(url, **options)
    bucket = root.split("/", 1)[0]
    scheme = url.split("://", 1)[0]
    make, credentials, endpoints = STORE_HINTS.get(scheme, S3_HINTS)
    azure = STORE_HINTS.get(scheme) is AZURE_HINTS
    try:
        if azure:
            _probe_azure(fs, bucket)
        else:
            fs.info(bucket)
    except FileNotFoundError:
        raise StoreError(f"output_dir: {url}: the bucket {bucket!r} does not exist on the store; create it "
                         f"first (e.g. `{make}{bucket}`)") from None
    except PermissionError as err:
        raise StoreError(f"output_dir: {url}: the store refused access to the bucket {bucket!r} ({err}); check "
                         f"the credentials in the environment ({credentials})") from None
    except Exception as err:  # botocore's EndpointConnectionError and friends are no OSError
        if azure:  # the client's host, from the connection string or the account name: no key, no SAS token
            endpoint = fs.service_client.primary_hostname
        else:
            endpoint = next((os.environ[name] for name in endpoints if os.environ.get(name)), "the default")
        raise StoreError(f"output_dir: {url}: cannot reach the store (endpoint {endpoint}): "
                         f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}; check "
                         f"{' or '.join(endpoints) if azure else endpoints[-1]} and the network") from None


def _probe_azure(fs: Any, container: str) -> None:
    """``fs.info(container)`` on adlfs in one request: azure-storage-blob retries an endpoint that does not answer
    for about 80 s (3 retries, backoff from 15 s), and adlfs passes no retry setting through to its client."""
    from azure.core.exceptions import HttpResponseError, ResourceNotFoundError
    from fsspec.asyn import sync

    async def properties() -> None:
        async with fs.service_client.get_container_client(container) as client:
            await client.get_container_properties(retry_total=0, connection_timeout=CHECK_TIMEOUT_S)

    try:
        sync(fs.loop, properties)
    except ResourceNotFoundError:
        raise FileNotFoundError(container) from None
    except HttpResponseError as err:  # a refused key is a bare 403 here (a HEAD has no error code to map)
        if err.status_code not in (401, 403):
            raise
        raise PermissionError(str(err).splitlines()[0]) from None


def work_dir_for(url: str) -> Path:
    """The local work folder of an output on a store: ``$LATENTMILL_WORK_DIR/<hash of url>``, else under
    ``$XDG_CACHE_HOME/latentmill/work`` (``~/.cache``). Only the URL decides it, so a rerun on this machine
    finds what it uploaded already."""
    base = os.environ.get("LATENTMILL_WORK_DIR")
    if not base:
        base = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "latentmill" / "work")
    return Path(base) / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
