"""Loader start-up per million samples, from the shard indexes, vs reading the index files alone.

Data: a synthetic cache of ``N`` Flux-512 samples (1,000,000; 100,000 with ``--quick``) in shards of 10,000
samples (what byte-sized shards make of ~760 KB samples), "written directly": each tar holds the real
headers and members of the real sample size (``json``; ``text.safetensors``: T5 77×4096 + pooled 768 bf16;
``vae.safetensors``: 16×64×64 bf16), but the tensor payloads are holes (a sparse file: the tar header and
the safetensors header are written, the payload is seeked over). Only the first shard gets its headers
written (``index_tar`` reads it back to check the index); the others are files of the right size holding
nothing (the loader's start-up opens no tar: it cannot tell). The cache lives on ``/dev/shm``
(tmpfs: ~0.8 GB of memory for the written headers), as freeing millions of sparse extents on this disk
took minutes. Each shard's index is written by the cache stage's own index writer
(``latentmill.stages.shardindex.build_shard_index``, the function ``index_tar`` calls at commit) from the
offsets the tar was written with; a test checks that it equals ``index_tar`` of the tar.

Measured hot (everything read once before timing), each repetition one of each, alternating which goes
first:

* index read (the floor): every index file read whole, in manifest order, parsed and checked
  (``read_shard_index``: numpy columns over the bytes) and kept, as the loader keeps them;
* ours: ``LatentLoader(cache, 8, seed=0, dtype=bfloat16)`` constructed and its first batch read (manifest,
  indexes, grouping by bucket, the epoch's batch order, the first batch's members).

Run alone: ``python -m bench.startup --quick``. The synthetic cache is deleted afterwards (``--keep`` keeps it).
"""

from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

from bench.common import FLUX_512, figure, fresh_dir, log, median, reps_of, run_benchmark, setup_env

setup_env()

SHARD_SAMPLES = 10_000  # samples per shard: what ~10 GB shards (issue 17, item 1) hold of ~760 KB samples
GOAL_S_PER_MILLION = 3.0


def _st_header(tensors: dict[str, tuple[str, list[int], int]]) -> tuple[bytes, int]:
    """(the safetensors prefix: 8-byte length + JSON header, payload bytes) of tensors name -> (dtype,
    shape, itemsize), laid out back to back in name order, as ``safetensors.torch.save`` does."""
    header, position = {}, 0
    for name, (dtype, shape, itemsize) in sorted(tensors.items()):
        n = itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + n]}
        position += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, position


class _TarHeaders:
    """ustar header blocks of members named ``<key>.<ext>`` (keys of one length) and fixed sizes: a
    template per (ext, size) with the key and the checksum patched in (tarfile's own bytes, 10x faster)."""

    def __init__(self, key_len: int) -> None:
        self.key_len = key_len
        self._templates: dict[tuple[str, int], tuple[bytes, int]] = {}

    def __call__(self, key: str, ext: str, size: int) -> bytes:
        template = self._templates.get((ext, size))
        if template is None:
            info = tarfile.TarInfo("\0" * self.key_len + "." + ext)
            info.size, info.mtime, info.mode = size, 0, 0o444
            info.uname = info.gname = "latentmill"
            block = bytearray(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))
            block[148:156] = b" " * 8
            template = self._templates[ext, size] = (bytes(block), sum(block))
        block = bytearray(template[0])
        name = key.encode()
        block[: self.key_len] = name
        block[148:156] = b"%06o\0 " % (template[1] + sum(name))
        return bytes(block)


def write_sparse_cache(root: Path, num: int, spec: dict = FLUX_512, with_headers: int | None = None) -> dict:
    """A cache of ``num`` samples shaped as ``spec`` whose tensor payloads are holes; returns the manifest
    (format 3: each shard's index written by ``build_shard_index``). Only the shards of the first
    ``with_headers`` samples (default: all) get their tar and safetensors headers written; the others are
    files of the right size and nothing else (the loader's start-up opens no tar, and every written header
    costs a page of memory on tmpfs or an extent to free on disk)."""
    from latentmill.stages.shardindex import build_shard_index, write_index_file

    (root / "shards").mkdir(parents=True, exist_ok=True)
    vae_prefix, vae_payload = _st_header({"latents": ("BF16", spec["latent"], 2)})
    text_prefix, text_payload = _st_header({"prompt_embeds": ("BF16", [spec["text_len"], spec["text_dim"]], 2),
                                            "pooled_prompt_embeds": ("BF16", [spec["pooled_dim"]], 2)})
    members = [("text.safetensors", text_prefix, text_payload), ("vae.safetensors", vae_prefix, vae_payload)]
    shards = []
    tar_header = _TarHeaders(len("s0000000"))
    for first in range(0, num, SHARD_SAMPLES):
        write = with_headers is None or first < with_headers
        count = min(SHARD_SAMPLES, num - first)
        name = f"cache-{first // SHARD_SAMPLES:05d}.tar"
        path = root / "shards" / name
        samples, headers, buckets = [], {}, []
        with open(path, "wb") as fh:
            offset = 0
            for i in range(first, first + count):
                key = f"s{i:07d}"
                meta = json.dumps({"bucket": spec["bucket"], "key": key}, separators=(",", ":")).encode()
                if write:
                    fh.seek(offset)
                    fh.write(tar_header(key, "json", len(meta)) + meta)
                where = {"json": (offset + 512, len(meta))}
                offset += 512 + len(meta) + (-len(meta) % 512)
                for ext, prefix, payload in members:
                    size = len(prefix) + payload
                    if write:
                        fh.seek(offset)
                        fh.write(tar_header(key, ext, size) + prefix)
                    where[ext] = (offset + 512, size)
                    headers[i - first, ext] = prefix[8:]
                    offset += 512 + size + (-size % 512)  # the payload: a hole
                samples.append((key, where))
                buckets.append(spec["bucket"])
            offset += 1024  # the end-of-archive blocks
            fh.truncate(offset)
        index = write_index_file(path, build_shard_index(offset, samples, headers, buckets))
        shards.append({"name": name, "path": f"shards/{name}", "sha256": None, "samples": count,
                       "bucket": spec["bucket"], "index": index})
    import torch
    from safetensors.torch import save

    empty = save({"prompt_embeds": torch.zeros(spec["text_len"], spec["text_dim"], dtype=torch.bfloat16),
                  "pooled_prompt_embeds": torch.zeros(spec["pooled_dim"], dtype=torch.bfloat16)})
    (root / "empty_prompt.safetensors").write_bytes(empty)
    manifest = {
        "stage": "cache", "format_version": 3, "family": "flux", "fingerprint": "bench-startup",
        "models": {"vae": {"class": "AutoencoderKL", "fingerprint": "bench", "scaling_factor": 0.3611,
                           "shift_factor": 0.1159}},
        "dtype": "bfloat16", "latents": "mean", "text": {"trimmed": False, "pad_to": spec["text_len"]},
        "empty_prompt": {"path": "empty_prompt.safetensors", "sha256": None},
        "shards": shards, "counts": {"in": num, "out": num, "quarantined": 0},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def _disk_bytes(root: Path) -> tuple[int, int]:
    """(bytes allocated on disk, apparent bytes) of every file under ``root``."""
    allocated = apparent = 0
    for path in root.rglob("*"):
        if path.is_file():
            st = path.stat()
            allocated += st.st_blocks * 512
            apparent += st.st_size
    return allocated, apparent


def run(args) -> list:
    num = 100_000 if args.quick else 1_000_000
    reps = reps_of(args, full=9, quick=5)
    shm = Path("/dev/shm")  # tmpfs: a written header costs a page; on this disk (ext4, discard) freeing
    # the ~2 extents per sample of a sparse tar took ~1.5 ms per sample
    work = Path(tempfile.mkdtemp(prefix="latentmill-startup-", dir=shm)) if shm.is_dir() else fresh_dir("startup")
    try:
        return _measure(args, work, num, reps)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            log(f"startup: removed {work}")


def _measure(args, work: Path, num: int, reps: int) -> list:
    import torch
    from latentmill.stages.shardindex import index_tar, read_shard_index
    from latentmill.trainer.loader import LatentLoader

    cache = work / "cache"
    start = time.perf_counter()
    manifest = write_sparse_cache(cache, num, with_headers=SHARD_SAMPLES)
    write_s = time.perf_counter() - start
    first_tar = cache / manifest["shards"][0]["path"]
    assert index_tar(first_tar) == (cache / "shards" / manifest["shards"][0]["index"]["name"]).read_bytes()
    allocated, apparent = _disk_bytes(cache)
    index_paths = [cache / "shards" / e["index"]["name"] for e in manifest["shards"]]
    index_bytes = sum(e["index"]["size"] for e in manifest["shards"])
    log(f"startup: {num} samples in {len(index_paths)} shards written in {write_s:.1f} s; "
        f"{allocated / 2**30:.2f} GiB on disk for {apparent / 2**30:.0f} GiB of tar, "
        f"indexes {index_bytes / 2**20:.1f} MiB")

    def read_indexes() -> int:
        """The floor: every index read whole and parsed, and kept (as any reader that uses them must)."""
        indexes = [read_shard_index(path.read_bytes(), str(path)) for path in index_paths]
        return sum(index.num_samples for index in indexes)

    def read_discarding() -> int:
        return sum(read_shard_index(path.read_bytes(), str(path)).num_samples for path in index_paths)

    def raw_read() -> int:
        return sum(len(path.read_bytes()) for path in index_paths)

    ours, construct, plan = [], [], []  # to the first batch; the constructor alone; the epoch's order alone

    def start_loader() -> int:
        t0 = time.perf_counter()
        loader = LatentLoader(cache, 8, seed=0, dtype=torch.bfloat16)
        t1 = time.perf_counter()
        batch = next(iter(loader))
        t2 = time.perf_counter()
        loader.global_batches(0)  # once more, timed alone (not part of ours)
        plan.append(time.perf_counter() - t2)
        construct.append(t1 - t0)
        ours.append(t2 - t0)
        assert batch["latents"].shape == (8, 16, 64, 64)
        n = loader.num_samples
        loader.close()
        return n

    assert read_indexes() == num and start_loader() == num  # warm: every index file read once
    floor, raw, discarding = [], [], []
    ours.clear(), construct.clear(), plan.clear()
    for rep in range(reps):
        def floor_read() -> None:
            t0 = time.perf_counter()
            read_indexes()
            floor.append(time.perf_counter() - t0)

        for fn in (floor_read, start_loader) if rep % 2 == 0 else (start_loader, floor_read):
            fn()
        t0 = time.perf_counter()
        raw_read()
        raw.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        read_discarding()
        discarding.append(time.perf_counter() - t0)
    per_million = 1e6 / num
    log(f"startup: index read {median(floor):.3f} s, loader {median(ours):.3f} s for {num} samples")

    inputs = {"samples": num, "shards": len(index_paths), "shard_samples": SHARD_SAMPLES,
              "sample": FLUX_512 | {"dtype": "bfloat16", "tar_bytes_per_sample": round(apparent / num)},
              "index_bytes_per_sample": round(index_bytes / num, 1),
              "loader": "LatentLoader(cache, 8, seed=0, dtype=bfloat16), constructed and its first batch read",
              "cache": "written directly: real tar and safetensors headers, tensor payloads as holes (sparse)"}
    details = {"disk_bytes_allocated": allocated, "tar_bytes_apparent": apparent, "write_s": round(write_s, 2),
               "index_files_raw_read_s_per_million": median([r * per_million for r in raw]),
               "index_read_discarding_s_per_million": median([r * per_million for r in discarding]),
               "construct_s_per_million": median([c * per_million for c in construct]),
               "construct_vs_index_read": median([c / f for c, f in zip(construct, floor)]),
               "epoch_order_s_per_million": median([p * per_million for p in plan]),
               # issue 17 item 3: the manifest every rank parses holds shard entries only (per-sample detail is
               # in the indexes), so it grows with shards, not samples
               "manifest_bytes": (cache / "manifest.json").stat().st_size,
               "manifest_bytes_per_million_samples": round((cache / "manifest.json").stat().st_size * per_million)}
    figures = [
        figure("11. loader start-up per million samples vs reading the index files (hot)",
               [o * per_million for o in ours], [f * per_million for f in floor], "s per million samples",
               "<= 1.5", inputs,
               "ours: LatentLoader construction (manifest, every shard index read and checked, samples grouped "
               "by bucket, no tar opened) to its first batch read, which includes the epoch's batch order "
               "(torch.randperm over every bucket's samples, then over the batches: the order contract; "
               "details.epoch_order_s_per_million); baseline: every "
               "index file read whole and parsed (read_shard_index) and kept, nothing else (each parsed index "
               "dropped at once: details.index_read_discarding_s_per_million); "
               "details.construct_vs_index_read: the constructor alone. The machine is shared: see ratio_min",
               details=details),
        figure("11. loader start-up per million samples vs the 3 s goal (hot)",
               [o * per_million for o in ours], [GOAL_S_PER_MILLION] * len(ours), "s per million samples",
               "< 1.0", inputs, "ratio: seconds per million samples / 3 s (the issue's goal: under 3 s)",
               details=details),
    ]
    return figures


def main(argv=None) -> None:
    run_benchmark("startup", __doc__, run, argv)


if __name__ == "__main__":
    main()
