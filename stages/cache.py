"""Cache: decode, resize and crop each image or clip once, encode it with the VAE, encode its caption.

The format (version 2) is specified in ``docs/cache-format.md``. In short, per sample, as safetensors inside
the tar (never pickle): ``<key>.vae.safetensors`` (``latents``, optionally ``latents_std``),
``<key>.text.safetensors`` (``prompt_embeds``, Flux also ``pooled_prompt_embeds``), ``<key>.json``.

Component keys: a sample's VAE latent is keyed by (media hash, clip window, bucket, crop, VAE fingerprint,
dtype, latent mode) and its text embedding by (caption, text-encoder fingerprints, dtype, length policy).
A work unit that must run (because its input shard or the stage fingerprint changed) still copies every
component whose key an earlier unit already produced: re-captioning re-encodes text only, swapping the VAE
re-encodes latents only.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from latentmill.stages import pixels
from latentmill.stages.audio import clip_sounds
from latentmill.stages.cache_config import CacheConfig
from latentmill.stages.families import (
    compute_dtypes,
    describe_components,
    detect_family,
    deterministic_encoding,
    device_description,
    encoded_on_key,
    family_class,
    family_components,
    get_encoders,
    prepare_cublas_determinism,
)
from latentmill.stages.remotetars import local_tar, read_ranges
from latentmill.stages.shardindex import ShardIndexError, load_shard_index
from latentmill.stages.shardio import (
    GROUP_KEY,
    ID_KEY,
    StageDir,
    StageRecords,
    UnitOutput,
    UnitRecord,
    WorkUnit,
    grouped_unit_id,
    sample_json,
    shard_buckets,
    sibling_stage,
    unit_input_shards,
    units_by_bytes,
)
from latentmill.stages.tarshard import TAR_BLOCK, read_shard
from latentmill.stages.workers import unit_gpu
from PIL import Image
from safetensors.torch import save as safetensors_save

from latentmill.core.config import ConfigError
from latentmill.core.hashing import meta_bytes, sha256_bytes, stable_hash
from latentmill.models import ModelConfig, cached_model_fingerprints, component_source, read_component_config

STAGE = "cache"
FORMAT_VERSION = 2  # in the component keys: what decides a latent's bytes (unchanged by format 3)
MANIFEST_VERSION = 3  # the cache format the manifest declares: 3 adds a shard index beside each tar
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VAE_MEMBER, TEXT_MEMBER = "vae.safetensors", "text.safetensors"
REFERENCE = "reference"  # an edit pair's source image: its member in the bucket shards, its facts in the json


def text_member(j: int) -> str:
    """The member of a sample's caption ``j``: ``text.safetensors`` for the primary, ``text.<j>...`` after."""
    return TEXT_MEMBER if j == 0 else f"text.{j}.safetensors"


def _on_gpu(cfg: CacheConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def _device(cfg: CacheConfig, unit_id: str = "0") -> torch.device:
    """CPU, or one of the GPUs: each GPU holds one copy of the encoders per process that uses it."""
    if not _on_gpu(cfg):
        return torch.device("cpu")
    return torch.device("cuda", unit_gpu(unit_id, torch.cuda.device_count()))


def _compute(dtype: torch.dtype) -> dict[str, str]:
    """A component key's record of the dtype its encoder ran in: nothing for float32 (the keys of caches
    made on the CPU stay what they were), else its name."""
    return {} if dtype == torch.float32 else {"compute": str(dtype).removeprefix("torch.")}


def _deterministic(cfg: CacheConfig) -> bool:
    """Whether the encoders run in deterministic mode (``cache.deterministic``; ``auto``: on CUDA)."""
    return cfg.deterministic is True or (cfg.deterministic == "auto" and _on_gpu(cfg))


def _load_encoders(cfg: CacheConfig, model: ModelConfig, family: str, device: torch.device):
    """The family's encoders on ``device`` (CUBLAS_WORKSPACE_CONFIG set first in deterministic mode: the move
    to the GPU initialises CUDA), with the CPU thread count pinned."""
    if _deterministic(cfg):
        prepare_cublas_determinism()
    encoders = get_encoders(model, family, device)
    encoders.vae_tiling = cfg.vae_tiling
    _pin_threads(cfg)
    return encoders


def _pin_threads(cfg: CacheConfig) -> None:
    threads = cfg.threads or os.cpu_count() or 1
    if not _on_gpu(cfg) and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def trims_text(cfg: CacheConfig, family: str) -> bool:
    """Whether text embeddings are stored at their real length (see docs/cache-format.md): ``auto`` trims
    the streams the model sees zero-padded or masked, not those whose padding it attends to."""
    return cfg.trim_text == "always" or (cfg.trim_text == "auto" and family_class(family).text_pad() in ("zeros", "mask"))


# ---------------------------------------------------------------------------------------------------------
# Fingerprints and component keys
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CachePlan:
    """Everything that decides a latent or an embedding, computed once per recipe (no model loaded)."""

    family: str
    prints: dict[str, str]  # component -> weights fingerprint
    vae_fp: str
    text_fp: str
    background: tuple[int, int, int] = pixels.WHITE  # cache.alpha_background
    vae_tiling: str = "auto"  # cache.vae_tiling

    @classmethod
    def of(cls, cfg: CacheConfig, model: ModelConfig) -> CachePlan:
        family = detect_family(model)
        if cfg.trim_text == "never" and family_class(family).text_pad() == "mask":
            raise ConfigError(f"cache.trim_text: 'never' stores the padding as tokens, which the {family} family's "
                              "masked text stream cannot tell from real ones; use 'auto' or 'always'")
        prints = cached_model_fingerprints(model, family_components(family))
        # the encoders' own dtype too (bf16 on a GPU): a GPU-made latent is not the CPU-made one's bytes
        compute = compute_dtypes(family, torch.device("cuda" if _on_gpu(cfg) else "cpu"))
        pixel_side = family_class(family).PIXEL_COMPONENTS
        # a family whose pixels meet more than the VAE (an image encoder) keys its vae member with them too
        others = {k: prints[k] for k in pixel_side if k != "vae"}
        # a stream from a clip's sound keys the vae member with its declared rule (the window, its latent length)
        sound = [s.to_json() for s in family_class(family).STREAMS if s.from_audio]
        vae_fp = stable_hash({"family": family, "vae": prints["vae"], "dtype": cfg.dtype, "latents": cfg.latents,
                              "seed": cfg.seed if cfg.latents == "sample" else None, "resample": "lanczos",
                              "version": FORMAT_VERSION, **_compute(compute["vae"]),
                              **({"pixel_encoders": others} if others else {}), **({"sound": sound} if sound else {})})
        text_fp = stable_hash({"family": family, "encoders": {k: v for k, v in prints.items() if k not in pixel_side},
                               "dtype": cfg.dtype, "max_sequence_length": cfg.max_sequence_length,
                               "trim": trims_text(cfg, family), "version": FORMAT_VERSION,
                               **_compute(compute["text"])})
        return cls(family, prints, vae_fp, text_fp, cfg.background, cfg.vae_tiling)

    def fingerprint(self) -> dict[str, Any]:
        return {"stage": STAGE, "version": FORMAT_VERSION, "vae": self.vae_fp, "text": self.text_fp,
                "pixels": [pixels.RULES_VERSION, list(self.background)]}

    def vae_key(self, meta: dict[str, Any]) -> str:
        # The decoding rules that change this sample's pixels from a plain RGB conversion (rotation, alpha
        # over the background, colour profile...) join its key; a plain image keeps the key it always had.
        parts = [self.vae_fp, meta["sha256"], meta.get("clip"), meta["bucket"], meta.get("crop")]
        rules = pixels.pixel_rules(meta, self.background)
        parts = parts + [rules] if rules else parts
        tiling = self.tiling(meta["bucket"])
        parts = parts + [tiling] if tiling else parts
        if any(s.from_reference for s in family_class(self.family).STREAMS):  # an edit pair: its source too
            reference = meta.get(REFERENCE) or {}
            parts.append([reference.get("sha256"), reference.get("crop"), pixels.pixel_rules(reference, self.background)])
        return stable_hash(parts)

    def tiling(self, bucket: list[int]) -> dict[str, Any] | None:
        """The VAE's temporal tiles when a clip of ``bucket`` is encoded in them (``cache.vae_tiling``), else
        None: only then do they key its latents and its unit, so every other latent keeps the key it had."""
        family = family_class(self.family)
        frames = int(bucket[2]) if len(bucket) > 2 else 1
        return {"vae_tiling": list(family.VAE_TEMPORAL_TILE)} if family.tiles_clip(frames, self.vae_tiling) else None

    def text_key(self, caption: str, meta: dict[str, Any] | None = None) -> str:
        if meta is not None and family_class(self.family).TEXT_SEES_REFERENCE:  # the caption and the image
            return stable_hash([self.text_fp, caption, (meta.get(REFERENCE) or {}).get("sha256")])
        return stable_hash([self.text_fp, caption])


_plans: dict[tuple, CachePlan] = {}
_plans_lock = threading.Lock()


def cache_plan(cfg: CacheConfig, model: ModelConfig) -> CachePlan:
    """The recipe's CachePlan, computed once per process (fingerprints hash weight files)."""
    key = (json.dumps(cfg.__dict__, sort_keys=True), json.dumps(model.__dict__, sort_keys=True))
    with _plans_lock:
        if key not in _plans:
            _plans[key] = CachePlan.of(cfg, model)
        return _plans[key]


def forget_plans() -> int:
    """Forget the cache plans this process computed (their weight fingerprints are found again); how many."""
    with _plans_lock:
        count = len(_plans)
        _plans.clear()
    return count


def _config(model: ModelConfig, name: str) -> dict[str, Any]:
    """A component's config.json, or {} when it is not on this machine (the estimate then uses defaults)."""
    try:
        return read_component_config(component_source(model, name))
    except Exception:  # a hub id not in the local cache, a missing folder: only an estimate is at stake
        return {}


def sample_bytes_estimate(cfg: CacheConfig, model: ModelConfig, family: str) -> Callable[[list[int]], int]:
    """Bytes one cached sample of a bucket ``[W, H, F]`` takes in a shard, estimated before encoding.

    Exact for the latents (shape from the VAE config, ``cache.dtype``, ``latents: distribution`` doubles
    them); the text embeddings are counted at ``max_sequence_length`` tokens of one caption (exact for
    untrimmed text, an upper bound for trimmed text and low for samples with several captions); plus the
    json member and tar headers. Used only to group units: the shard bytes themselves never depend on it.
    """
    itemsize = DTYPES[cfg.dtype].itemsize
    family_cls = family_class(family)
    configs: dict[str, dict[str, Any]] = {}

    def config(name: str) -> dict[str, Any]:
        if name not in configs:
            configs[name] = _config(model, name)
        return configs[name]

    copies = 2 if cfg.latents == "distribution" else 1
    # the json member, the VAE member's tar header; a text member's safetensors header and tar blocks
    overhead, text_overhead = 1024 + 2 * TAR_BLOCK, 256 + 3 * TAR_BLOCK
    components = {s.name: s.component for s in family_cls.STREAMS}

    def estimate(bucket: list[int]) -> int:
        shapes = family_cls.sample_shapes(config, bucket, cfg.max_sequence_length)
        vae = sum(math.prod(shape) for name, shape in shapes.items() if components[name] == "vae")
        text = sum(math.prod(shape) for name, shape in shapes.items() if components[name] == "text")
        return vae * copies * itemsize + 256 + text * itemsize + text_overhead + overhead

    return estimate


def plan(cfg: CacheConfig, model: ModelConfig, upstream: StageDir, stage_dir: StageDir | None = None) -> list[WorkUnit]:
    """Bucket shards grouped into units of about ``shard_bytes`` of estimated cache output
    (:func:`sample_bytes_estimate` per sample, each sample's bucket from its shard's index), keyed by
    their hashes and the cache fingerprint; ``stage_dir`` (by default the cache folder beside ``upstream``)
    keeps the last run's groups. Each unit writes one shard holding all of its buckets.

    Units reuse only components committed before this plan: what a unit encodes then never depends on
    which other units of the same run happened to finish first (encoders are not bit-exact across batch
    compositions), so a run's bytes are a pure function of its inputs and of the cache it started from.
    """
    plan_ = cache_plan(cfg, model)
    per_sample = sample_bytes_estimate(cfg, model, plan_.family)
    buckets = {entry["name"]: _upstream_buckets(upstream, entry) for entry in upstream.read_manifest()["shards"]}

    def estimate(upstream: StageDir, entry: dict[str, Any]) -> int:
        return sum(n * per_sample(bucket) for bucket, n in buckets[entry["name"]])

    units = units_by_bytes(upstream, plan_.fingerprint(), cfg.shard_bytes,
                           stage_dir if stage_dir is not None else sibling_stage(upstream, STAGE), estimate)
    cutoff = time.time_ns()
    for unit in units:
        unit.payload["reuse_before_ns"] = cutoff
        # a unit holding clips encoded in the VAE's tiles has them in its id (as curate's units with videos)
        held = (bucket for name in unit.payload[GROUP_KEY] for bucket, _ in buckets[name])
        if tiling := next((t for bucket in held if (t := plan_.tiling(bucket))), None):
            unit.unit_id = grouped_unit_id({**plan_.fingerprint(), **tiling}, unit.inputs)
            unit.payload[ID_KEY] = tiling  # in its record: a compaction merging it keeps the tiles in the id
    return units


def _upstream_buckets(upstream: StageDir, entry: dict[str, Any]) -> list[tuple[list[int], int]]:
    """(bucket [W, H, F], samples) of one bucket shard of ``upstream``'s manifest: its entry's counts, or its index's."""
    counts = shard_buckets(entry)
    if not counts:  # a bucket shard written before per-shard bucket counts: its index has them
        index = load_shard_index(upstream.root / entry["path"], entry.get("index"))
        for b in index.columns["sample_bucket"].tolist():
            name = "x".join(map(str, index.buckets[b])) if b >= 0 else "0x0x1"
            counts[name] = counts.get(name, 0) + 1
    return [([int(d) for d in name.split("x")], n) for name, n in counts.items()]


# ---------------------------------------------------------------------------------------------------------
# Reuse of components encoded by earlier units
# ---------------------------------------------------------------------------------------------------------


def stored_components(stage_dir: StageDir, keys: list[tuple[str, list[str]]],
                      before_ns: int) -> tuple[dict[str, tuple], dict[str, tuple], dict[tuple[str, str], str]]:
    """Where the catalog holds each component of ``keys`` (a sample's (vae key, text keys) each), committed
    before ``before_ns``: (vae hits, text hits, origins). A hit is (shards, sample key, member), as
    :func:`_fetch` reads it; ``origins`` maps (table, key) to where the component was encoded."""
    vae, text, origins = {}, {}, {}
    with stage_dir.lookup() as found:
        for table, wanted, hits in (("vae", [vk for vk, _ in keys], vae),
                                    ("text", [tk for _, tks in keys for tk in tks], text)):
            for key in dict.fromkeys(wanted):
                hit = found.component(stage_dir.root, table, key, before_ns)
                if hit is not None:
                    shards, sample, member, device = hit
                    hits[key] = (shards, sample, VAE_MEMBER if member == 0 else text_member(member - 1))
                    origins[(table, key)] = device or UNKNOWN_DEVICE
    return vae, text, origins


# ---------------------------------------------------------------------------------------------------------
# Where components were encoded (device class and library versions, docs/cache-format.md)
# ---------------------------------------------------------------------------------------------------------

UNKNOWN_DEVICE = "unknown (encoded before device classes were recorded)"


def mixed_devices_warning(encoded_on: dict[str, dict[str, int]]) -> str | None:
    """The warning for a cache whose components were encoded on more than one known device class (or
    library version): their bytes are not what one machine would have made."""
    known = {k: v for k, v in encoded_on.items() if k != UNKNOWN_DEVICE}
    if len(known) < 2:
        return None
    parts = [f"{k} (vae {v.get('vae', 0)}, text {v.get('text', 0)})" for k, v in sorted(known.items())]
    return ("mixed device classes: " + "; ".join(parts) + ". Components are reused across machine classes "
            "(docs/cache-format.md, 'Reproducible where'); re-encode on one class for byte-identical caches")


def merged_origins(stage_dir: StageDir, records: list[UnitRecord]) -> dict[str, Any]:
    """The ``device``, ``encoded_on`` and ``foreign`` fields of one record that holds the samples of
    ``records``, units of ``stage_dir`` (a compaction merging them): provenance survives the merge. Empty
    when none recorded it."""
    base = next((r.extra["device"] for r in records if r.extra.get("device")), None)
    if base is None:
        return {}
    foreign: dict[str, str] = {}
    for record in records:
        here = (record.extra.get("device") or {}).get("key", UNKNOWN_DEVICE)
        theirs = record.extra.get("foreign") or {}
        for keys in (stage_dir.unit_detail(record).get("components") or {}).values():
            texts = keys["text"] if isinstance(keys["text"], list) else [keys["text"]]
            for key in [keys["vae"], *texts]:
                where = theirs.get(key, here)
                if where != base["key"]:
                    foreign[key] = where
    return {"device": base, "encoded_on": encoded_on_total(records), **({"foreign": foreign} if foreign else {})}


def encoded_on_total(records: list[UnitRecord]) -> dict[str, dict[str, int]]:
    """The ``encoded_on`` counts of the records, summed (units written before the field: unknown)."""
    total: dict[str, dict[str, int]] = {}
    for record in records:
        counts = record.extra.get("encoded_on")
        if counts is None:
            done = record.extra.get("counts") or {}
            counts = {UNKNOWN_DEVICE: {c: sum((done.get(c) or {}).values()) for c in ("vae", "text")}}
        for where, n in counts.items():
            tally = total.setdefault(where, {"vae": 0, "text": 0})
            for comp in ("vae", "text"):
                tally[comp] += int(n.get(comp, 0))
    return dict(sorted(total.items()))


def _fetch(wanted: dict[str, tuple[tuple[Path, ...], str, str]]) -> dict[str, bytes]:
    """Read each wanted (shards, sample, member): the sample is found in its unit's shards through their
    indexes and only its member is read (not the whole tar). Returns component key -> bytes; a component
    whose shards are gone or unreadable is left out (it is encoded again)."""
    by_unit: dict[tuple[Path, ...], dict[tuple[str, str], str]] = {}
    for comp_key, (shards, sample_key, member) in wanted.items():
        by_unit.setdefault(shards, {})[(sample_key, member)] = comp_key
    found = {}
    for shards, members in by_unit.items():
        wanted_keys = {sample_key for sample_key, _ in members}
        for shard in shards:
            try:
                index = load_shard_index(shard)
            except (OSError, ShardIndexError):
                continue
            places = []  # (component key, (offset, size)) of each wanted member of this shard
            for i in range(index.num_samples):
                sample_key = index.key(i)
                if sample_key in wanted_keys:
                    places += [(comp_key, place) for ext, place in index.members(i).items()
                               if (comp_key := members.get((sample_key, ext))) is not None]
            if not places:
                continue
            try:  # only these members: a store's tar is not downloaded for them (remotetars.read_ranges)
                datas = read_ranges(shard, [place for _, place in places])
            except OSError:
                continue
            for (comp_key, (_, size)), data in zip(places, datas):
                if len(data) == size:
                    found[comp_key] = data
    return found


# ---------------------------------------------------------------------------------------------------------
# Pixels
# ---------------------------------------------------------------------------------------------------------


def _resize_crop(img: Image.Image, crop: dict[str, int], width: int, height: int) -> torch.Tensor:
    img = img.resize((crop["resize_width"], crop["resize_height"]), Image.Resampling.LANCZOS)
    img = img.crop((crop["left"], crop["top"], crop["left"] + width, crop["top"] + height))
    raw = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    return raw.view(height, width, 3).permute(2, 0, 1).float().div(127.5).sub(1.0)


def load_pixels(data: bytes, crop: dict[str, int], bucket: list[int],
                background: tuple[int, int, int] = pixels.WHITE) -> torch.Tensor:
    """Decode an image by the decoding rules (:mod:`latentmill.stages.pixels`: shown orientation, 8-bit sRGB, alpha over
    ``background``), resize to cover, crop to the bucket: a [3, H, W] tensor in [-1, 1]."""
    return _resize_crop(pixels.decode_rgb(data, background), crop, bucket[0], bucket[1])


def load_clip_pixels(meta: dict[str, Any], sample: dict[str, Any]) -> torch.Tensor:
    """Decode a clip's frames, resize and crop each like an image: a [3, F, H, W] tensor in [-1, 1]."""
    from latentmill.stages.video import read_clip

    return clip_pixels(read_clip(meta, sample), meta)


def clip_pixels(frames_FHWC: torch.Tensor, meta: dict[str, Any]) -> torch.Tensor:
    """A clip's decoded ``uint8 [F, H, W, 3]`` frames resized and cropped to its bucket: [3, F, H, W] in [-1, 1]."""
    width, height = meta["bucket"][0], meta["bucket"][1]
    frames = [_resize_crop(Image.fromarray(f.numpy()), meta["crop"], width, height) for f in frames_FHWC]
    return torch.stack(frames, dim=1)


def _source_clip(meta: dict[str, Any]) -> bool:
    """Whether a sample is a clip read from its source video (not a re-encoded copy of its own)."""
    return meta.get("kind") == "video" and "clip" in meta and not meta["clip"].get("reencoded")


class SourcePasses:
    """The frames of a unit's source clips, each source video decoded in one forward pass.

    Clip by clip, every clip cost an open of its video and a seek-and-decode from the keyframe before it
    (with PyAV, a decode from the first frame): 11× (decord) and 32× (PyAV) one sequential pass over a
    minute of 480p. Here the clips of one video are read by one :func:`~latentmill.stages.video.read_clips`
    generator: one open, frames held about one clip at a time, the same pixels.

    Built from the (sample index, meta) of the clips the unit will decode, in the order it will ask for them;
    :meth:`frames` must then be called once for each, in that order (the decode loop keeps the unit's sample
    order, with or without prefetching).
    """

    def __init__(self, clips: list[tuple[int, dict[str, Any]]]):
        from latentmill.stages.video import read_clips

        groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
        self._group: dict[int, tuple[str, int]] = {}
        for i, meta in clips:
            key = (meta["source_uri"], meta.get("rotation", 0))
            groups.setdefault(key, []).append(meta)
            self._group[i] = key
        self._left = {key: len(metas) for key, metas in groups.items()}
        self._passes = {key: read_clips(key[0], [m["clip"]["frame_indices"] for m in metas], rotation=key[1])
                        for key, metas in groups.items()}

    def __contains__(self, i: int) -> bool:
        return i in self._group

    def frames(self, i: int) -> torch.Tensor:
        """Sample ``i``'s ``uint8 [F, H, W, 3]`` frames; raises what reading them clip by clip would."""
        key = self._group[i]
        value = next(self._passes[key])
        self._left[key] -= 1
        if not self._left[key]:  # the video's last clip in this unit: release its decoder now
            self._passes.pop(key).close()
        if isinstance(value, Exception):
            raise value
        return value

    def close(self) -> None:
        """Release every decoder still open (a unit that stopped early)."""
        for gen in self._passes.values():
            gen.close()
        self._passes.clear()


def decode_sample(sample: dict[str, Any], meta: dict[str, Any],
                  background: tuple[int, int, int] = pixels.WHITE) -> torch.Tensor:
    """The pixels of one image or clip, as the bucket stage sized and cropped it."""
    if meta.get("kind") == "video":
        return load_clip_pixels(meta, sample)
    member = pixels.image_member(sample)
    if member is None:
        raise ValueError("sample has no image member")
    return load_pixels(sample[member], meta["crop"], meta["bucket"], background)


# ---------------------------------------------------------------------------------------------------------
# The unit
# ---------------------------------------------------------------------------------------------------------


def _prefetched(fn, items: list, enabled: bool):
    """Yield ``fn(item)`` for each item, computing the next one in a background thread when enabled."""
    if not enabled:
        yield from (fn(item) for item in items)
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(fn, items[0]) if items else None
        for k in range(len(items)):
            result = future.result()
            if k + 1 < len(items):
                future = pool.submit(fn, items[k + 1])
            yield result


def _batch(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` stacked into a batch; a view of the one tensor when there is one (a long clip is not copied)."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def _tensor_bytes(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> bytes:
    return safetensors_save({k: v.to(dtype).contiguous() for k, v in tensors.items()})


def _text_tensors(encoded: dict[str, Any], i: int, trim: bool, family: str) -> dict[str, torch.Tensor]:
    """Caption ``i``'s tensors of the family's text streams; with ``trim``, a token axis holds the real
    tokens only."""
    tensors = {}
    for stream in family_class(family).streams("text"):
        tensor = encoded[stream.name][i]
        length = encoded.get(f"{stream.name}_lengths", encoded["lengths"])[i]
        tensors[stream.name] = tensor[:length] if trim and stream.pad != "none" else tensor
    return tensors


def _latent_tensors(mean: torch.Tensor, std: torch.Tensor, cfg: CacheConfig, key: str) -> dict[str, torch.Tensor]:
    if cfg.latents == "distribution":
        return {"latents": mean, "latents_std": std}
    if cfg.latents == "sample":  # seeded per sample: the same inputs give the same bytes
        gen = torch.Generator().manual_seed(int(stable_hash([cfg.seed, key])[:15], 16))
        return {"latents": mean + std * torch.randn(mean.shape, generator=gen)}
    return {"latents": mean}


class UnitSamples:
    """A cache unit's input samples in the unit's order (bucket, key), without their payloads in memory.

    Each upstream (bucket) shard's index gives every sample's members; only the ``json`` members are read
    here. :meth:`sample` reads one sample's members when its pixels are decoded, so the unit holds one
    batch of raw images at a time, not the whole unit's (a unit reads up to ``cache.shard_bytes`` of
    output's worth of bucket shards: hundreds of MB of images). A shard whose index cannot be read is read
    whole, as before indexes.
    """

    def __init__(self, unit: WorkUnit):
        rows: list[tuple[dict[str, Any], str, Any]] = []  # (meta, key, where: (path, members) or the sample)
        for path in unit_input_shards(unit):
            try:
                shard_index = load_shard_index(path)
            except ShardIndexError:
                rows += [(sample_json(s), s["__key__"], s) for s in read_shard(path)]
                continue
            with open(local_tar(path), "rb") as fh:  # a unit to run reads its input tars whole
                fd = fh.fileno()
                for i in range(shard_index.num_samples):
                    members = shard_index.members(i)
                    offset, size = members["json"]
                    rows.append((json.loads(os.pread(fd, size, offset)), shard_index.key(i), (Path(path), members)))
        rows.sort(key=lambda row: (list(row[0]["bucket"]), row[1]))
        self.metas = [row[0] for row in rows]
        self.keys = [row[1] for row in rows]
        self._where = [row[2] for row in rows]

    def __len__(self) -> int:
        return len(self.keys)

    def sample(self, i: int) -> dict[str, Any]:
        """Sample ``i`` as ``read_shard`` yields it: ``{"__key__": key, extension: bytes, ...}``."""
        where = self._where[i]
        if isinstance(where, dict):
            return where
        path, members = where
        sample: dict[str, Any] = {"__key__": self.keys[i]}
        with open(path, "rb") as fh:
            for ext, (offset, size) in members.items():
                data = os.pread(fh.fileno(), size, offset)
                if len(data) != size:
                    raise OSError(f"{path}: member {self.keys[i]}.{ext} ends past the file")
                sample[ext] = data
        return sample


def process(cfg: CacheConfig, model: ModelConfig, unit: WorkUnit, out: UnitOutput) -> None:
    """Encode (or copy already-encoded components of) every sample of a unit's bucket shards.

    The unit's samples are taken in the order (bucket, key), so its shard lists them so whichever shards
    they came from and whichever runner ran it, and every encoder batch holds one bucket (a VAE batch
    cannot mix shapes): ``batch_size`` samples at a time, a bucket's last batch possibly shorter.
    """
    plan_ = cache_plan(cfg, model)
    dtype, trim = DTYPES[cfg.dtype], trims_text(cfg, plan_.family)
    samples = UnitSamples(unit)  # metadata now; pixels when a batch needs them (memory: one batch)
    metas = samples.metas
    # Every caption of a sample is encoded (the trainer picks one per step); the first is the primary.
    captions = [m.get("captions") or [m["caption"]] for m in metas]
    keys = [(plan_.vae_key(m), [plan_.text_key(c, m) for c in caps]) for m, caps in zip(metas, captions)]
    family = family_class(plan_.family)
    reference_streams = [s.name for s in family.STREAMS if s.from_reference]
    # an edit family's samples without a source image (data prepared without ingest.edit) are quarantined
    unpaired = ({i for i, m in enumerate(metas) if not isinstance(m.get(REFERENCE), dict)}
                if family.needs_reference() else set())
    before = unit.payload.get("reuse_before_ns", 0)
    vae_hits, text_hits, origins = stored_components(out.stage_dir, keys, before)
    old_vae, old_text = _fetch(vae_hits), _fetch(text_hits)
    encoders = None
    device = _device(cfg, unit.unit_id)
    # where this unit encodes (device class, versions); reused components count where they were encoded
    if _deterministic(cfg):
        prepare_cublas_determinism()  # before device_description initialises CUDA
    described = {**device_description(device), "deterministic": _deterministic(cfg)}
    here = described["key"] = encoded_on_key(described)
    encoded_on: dict[str, dict[str, int]] = {}
    foreign: dict[str, str] = {}  # reused component key -> where it was encoded, when not here

    def count_origin(comp: str, key: str, reused: bool) -> None:
        where = origins[(comp, key)] if reused else here
        if where != here:
            foreign[key] = where
        encoded_on.setdefault(where, {"vae": 0, "text": 0})[comp] += 1

    counts = {"vae": {"encoded": 0, "reused": 0}, "text": {"encoded": 0, "reused": 0}}
    sizes = {"vae": 0, "text": 0}
    components: dict[str, dict[str, str]] = {}
    audio_clips = {"with_track": 0, "silent": 0}  # clips whose sound was encoded: from a track, or silence

    # the clips of one source video are decoded in one pass, in the order the loop below asks for them
    passes = SourcePasses([(i, m) for i, m in enumerate(metas) if keys[i][0] not in old_vae and _source_clip(m)])

    def decode(batch: list[int]) -> dict[int, Any]:
        """Pixels of the samples whose latents are not reused: a tensor each, or (target, source image) for
        an edit family's pair, or the exception that quarantines the sample."""
        decoded: dict[int, Any] = {}
        for i in batch:
            if keys[i][0] not in old_vae and i not in unpaired:
                try:
                    if i in passes:
                        decoded[i] = clip_pixels(passes.frames(i), metas[i])
                    else:
                        sample = samples.sample(i)
                        decoded[i] = decode_sample(sample, metas[i], plan_.background)
                        if reference_streams:
                            decoded[i] = (decoded[i], load_pixels(sample[REFERENCE], metas[i][REFERENCE]["crop"],
                                                                  metas[i]["bucket"], plan_.background))
                except Exception as err:  # any undecodable input is quarantined, never fatal
                    decoded[i] = err
        return decoded

    batches: list[list[int]] = []
    for i, meta in enumerate(metas):  # runs of one bucket, cut every batch_size samples
        if batches and len(batches[-1]) < cfg.batch_size and metas[batches[-1][0]]["bucket"] == meta["bucket"]:
            batches[-1].append(i)
        else:
            batches.append([i])
    prefetch = cfg.prefetch if cfg.prefetch != "auto" else _on_gpu(cfg)
    for batch, decoded in zip(batches, _prefetched(decode, batches, prefetch)):
        for i, value in list(decoded.items()):
            if isinstance(value, Exception):
                out.quarantine(samples.keys[i], metas[i].get("source", "?"), f"cannot decode pixels: {value}")
                del decoded[i]
        for i in unpaired.intersection(batch):
            out.quarantine(samples.keys[i], metas[i].get("source", "?"), f"no source image: the {plan_.family} "
                           "family trains on edit pairs (ingest.edit: true, docs/prep.md \"Edit datasets\")")
        keep = [i for i in batch if i not in unpaired and (keys[i][0] in old_vae or i in decoded)]
        need_vae = [i for i in keep if keys[i][0] not in old_vae]
        need_text = {tk: (captions[i][j], i) for i in keep for j, tk in enumerate(keys[i][1]) if tk not in old_text}
        if (need_vae or need_text) and encoders is None:
            encoders = _load_encoders(cfg, model, plan_.family, device)
        sounds = clip_sounds({i: metas[i] for i in need_vae}, encoders.audio_sample_rate) if (
            need_vae and family.needs_audio()) else {}
        for i, value in list(sounds.items()):
            if isinstance(value, Exception):
                out.quarantine(samples.keys[i], metas[i].get("source", "?"), f"cannot read audio: {value}")
                need_vae.remove(i)
                keep.remove(i)
            else:
                audio_clips["silent" if not value[1] else "with_track"] += 1
        vae_bytes: dict[str, bytes] = {}
        if need_vae:
            # one batch of pixels, and the decoded frames let go: the encoders never hold two copies of a batch
            frames = _batch([decoded[i][0] if reference_streams else decoded[i] for i in need_vae])
            references = _batch([decoded[i][1] for i in need_vae]) if reference_streams else None
            for i in need_vae:
                del decoded[i]
            with deterministic_encoding(described["deterministic"]):
                mean, std = encoders.encode_pixels(frames)
                if references is not None:  # the source images at the target's bucket, the distribution's mean
                    reference_mean = encoders.encode_pixels(references)[0]
                conditions = encoders.encode_conditions(frames)
                del frames, references
                if sounds:  # the clips' sound under their frames (from_audio streams)
                    conditions.update(encoders.encode_audio(
                        torch.stack([sounds[i][0] for i in need_vae]),
                        torch.tensor([float(metas[i]["clip"]["fps"]) for i in need_vae])))
            for j, i in enumerate(need_vae):
                tensors = _latent_tensors(mean[j], std[j], cfg, keys[i][0])
                tensors.update({name: tensor[j] for name, tensor in conditions.items()})
                tensors.update({name: reference_mean[j] for name in reference_streams})
                vae_bytes[keys[i][0]] = _tensor_bytes(tensors, dtype)
        text_bytes: dict[str, bytes] = {}
        if need_text:
            texts = [caption for caption, _ in need_text.values()]
            images = ([pixels.decode_rgb(samples.sample(i)[REFERENCE], plan_.background) for _, i in need_text.values()]
                      if family.TEXT_SEES_REFERENCE else None)
            with deterministic_encoding(described["deterministic"]):
                encoded = (encoders.encode_text(texts, cfg.max_sequence_length, images=images) if images is not None
                           else encoders.encode_text(texts, cfg.max_sequence_length))
            for j, tk in enumerate(need_text):
                text_bytes[tk] = _tensor_bytes(_text_tensors(encoded, j, trim, plan_.family), dtype)
        for i in keep:
            vk, tks = keys[i]
            vae = old_vae.get(vk) or vae_bytes[vk]
            texts = [old_text.get(tk) or text_bytes[tk] for tk in tks]
            counts["vae"]["reused" if vk in old_vae else "encoded"] += 1
            count_origin("vae", vk, vk in old_vae)
            for tk in tks:
                counts["text"]["reused" if tk in old_text else "encoded"] += 1
                count_origin("text", tk, tk in old_text)
            sizes["vae"] += len(vae)
            sizes["text"] += len(texts[0])
            key = samples.keys[i]
            components[key] = {"vae": vk, "text": tks}
            meta = {**metas[i], "components": components[key]}
            members = {text_member(j): data for j, data in enumerate(texts)}
            out.add({"__key__": key, VAE_MEMBER: vae, **members, "json": meta_bytes(meta)}, bucket=metas[i]["bucket"])
    passes.close()  # (an exception above leaves them to the garbage collector, which closes them too)
    out.detail["components"] = components
    if family.needs_audio():
        out.extra["audio"] = audio_clips
    out.extra.update(counts=counts, bytes=sizes, device=described,
                     encoded_on=dict(sorted(encoded_on.items())), **({"foreign": foreign} if foreign else {}))


# ---------------------------------------------------------------------------------------------------------
# Empty prompt and manifest
# ---------------------------------------------------------------------------------------------------------


def ensure_empty_prompt(cfg: CacheConfig, model: ModelConfig, stage_dir: StageDir) -> dict[str, str]:
    """Embeddings of the empty caption, cached once per text-encoder fingerprint (for caption dropout)."""
    plan_ = cache_plan(cfg, model)
    name = f"empty_prompt-{plan_.text_key('')[:16]}.safetensors"
    path = stage_dir.root / name
    if not path.is_file():
        encoders = _load_encoders(cfg, model, plan_.family, _device(cfg))
        with deterministic_encoding(_deterministic(cfg)):
            encoded = encoders.encode_text([""], cfg.max_sequence_length)
        data = _tensor_bytes(_text_tensors(encoded, 0, trims_text(cfg, plan_.family), plan_.family),
                             DTYPES[cfg.dtype])
        tmp = path.with_name(name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return {"path": name, "sha256": sha256_bytes(path.read_bytes())}


PROMPTS_PREFIX = "prompts-"  # the validation prompts' embeddings beside the cache's shards


def ensure_prompts(cfg: CacheConfig, model: ModelConfig, stage_dir: StageDir, prompts: list[str]) -> dict[str, Any]:
    """Embeddings of ``prompts`` (the validation prompts and the family's negative prompt), as captions'.

    One safetensors file per prompt set, ``prompts-<hash>.safetensors``, tensors named ``<text key>.<stream>``
    (the caption's component key: the prompt's text under the text encoders' fingerprints); a prompt already in
    an earlier file of this folder is copied from it, so a changed list encodes only its new prompts. The new
    prompts are encoded in one batch in the list's order, as a pipeline given the list encodes them. Returns
    the manifest entry: ``path``, ``sha256`` and ``keys`` (prompt -> text key); {} for no prompts.
    """
    if not prompts:
        return {}
    from safetensors import safe_open
    from safetensors.torch import load_file

    plan_ = cache_plan(cfg, model)
    keys = {prompt: plan_.text_key(prompt) for prompt in prompts}
    name = f"{PROMPTS_PREFIX}{stable_hash(sorted(set(keys.values())))[:16]}.safetensors"
    path = stage_dir.root / name
    if not path.is_file():
        tensors: dict[str, torch.Tensor] = {}
        for older in sorted(stage_dir.root.glob(f"{PROMPTS_PREFIX}*.safetensors")):
            with safe_open(older, "pt") as f:
                wanted = [k for k in f.keys() if k.split(".")[0] in keys.values()]
            if wanted:
                stored = load_file(older)
                tensors.update({k: stored[k] for k in wanted})
        missing = list(dict.fromkeys(p for p in prompts if not any(k.startswith(keys[p] + ".") for k in tensors)))
        if missing:
            encoders = _load_encoders(cfg, model, plan_.family, _device(cfg))
            with deterministic_encoding(_deterministic(cfg)):
                encoded = encoders.encode_text(missing, cfg.max_sequence_length)
            for i, prompt in enumerate(missing):
                for stream, tensor in _text_tensors(encoded, i, trims_text(cfg, plan_.family), plan_.family).items():
                    tensors[f"{keys[prompt]}.{stream}"] = tensor.to(DTYPES[cfg.dtype]).contiguous()
        tmp = path.with_name(name + ".tmp")
        tmp.write_bytes(safetensors_save(tensors))
        tmp.replace(path)
    return {"path": name, "sha256": sha256_bytes(path.read_bytes()), "keys": keys}


def manifest_header(cfg: CacheConfig, model: ModelConfig, stage_dir: StageDir,
                    records: list[UnitRecord] | None = None, prompts: list[str] | None = None) -> dict[str, Any]:
    """Family, models, dtype, latent mode, text layout, empty prompt and validation prompts (``prompts``: the
    validation prompts' embeddings, ``ensure_prompts``) of this cache. ``records``: the records of the run's
    units, when the caller has them (else the current plan's are read again)."""
    plan_ = cache_plan(cfg, model)
    models = describe_components(model, plan_.family)
    for name, fp in plan_.prints.items():
        models[name]["fingerprint"] = fp
    return {
        "format_version": MANIFEST_VERSION,
        "family": plan_.family,
        "fingerprint": stable_hash(plan_.fingerprint()),
        # what unit ids are made of, and the shard target: `latentmill compact OUTPUT` needs both
        "stage_fingerprint": plan_.fingerprint(),
        "shard_bytes": cfg.shard_bytes,
        "models": models,
        "dtype": cfg.dtype,
        "latents": cfg.latents,
        "max_sequence_length": cfg.max_sequence_length,
        "text": {"trimmed": trims_text(cfg, plan_.family), "pad_to": cfg.max_sequence_length},
        "streams": [stream.to_json() for stream in family_class(plan_.family).STREAMS],
        "empty_prompt": ensure_empty_prompt(cfg, model, stage_dir),
        **_encoded_on_field(cfg, model, stage_dir, records),
        # only with prompts: a cache without them keeps its manifest, and so its snapshot name
        **({"validation_prompts": ensure_prompts(cfg, model, stage_dir, prompts)} if prompts else {}),
    }


def _encoded_on_field(cfg: CacheConfig, model: ModelConfig, stage_dir: StageDir,
                      records: list[UnitRecord] | None = None) -> dict[str, Any]:
    """``{"encoded_on": {"<device class> | torch ... [| cudnn ...]": {"vae": n, "text": n}}}`` over the units
    of this cache (``records``, or the current plan's committed records, planned and read again); nothing when
    none of them recorded it (a cache written before the field keeps its manifest, and so its snapshot name)."""
    if records is not None:
        return {"encoded_on": encoded_on_total(records)} if any("encoded_on" in r.extra for r in records) else {}
    upstream = StageDir(stage_dir.root.parent / "bucket", "bucket")
    if not upstream.manifest_path.is_file():
        return {}
    committed = StageRecords(stage_dir, [u.unit_id for u in plan(cfg, model, upstream, stage_dir)
                                         if stage_dir.unit_path(u.unit_id).is_file()])
    if not any("encoded_on" in r.extra for r in committed):
        return {}
    return {"encoded_on": encoded_on_total(committed)}


def component_report(records: list[UnitRecord]) -> dict[str, Any]:
    """``components.{vae,text}.{processed,reused}`` and bytes per sample for the run summary."""
    report = {"vae": {"processed": 0, "reused": 0}, "text": {"processed": 0, "reused": 0}}
    sizes = {"vae": 0, "text": 0}
    for record in records:
        for comp in ("vae", "text"):
            counts = record.extra.get("counts", {}).get(comp, {})
            if record.reused:  # the whole unit was reused: every component too
                report[comp]["reused"] += counts.get("encoded", 0) + counts.get("reused", 0)
            else:
                report[comp]["processed"] += counts.get("encoded", 0)
                report[comp]["reused"] += counts.get("reused", 0)
            sizes[comp] += record.extra.get("bytes", {}).get(comp, 0)
    samples = sum(r.samples_out for r in records)
    per_sample = {k: round(v / samples) for k, v in sizes.items()} if samples else {"vae": 0, "text": 0}
    result: dict[str, Any] = {"components": report, "bytes_per_sample": per_sample}
    if any("encoded_on" in r.extra for r in records):
        result["encoded_on"] = encoded_on_total(records)
        warning = mixed_devices_warning(result["encoded_on"])
        if warning:
            result["warning"] = warning
    return result

