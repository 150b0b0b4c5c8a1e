"""The end-of-training export, called by every rank: ``export_trained(adapter, transformer, ...)``.

What it writes is what ``latentmill.trainer.adapter.export_pipeline`` writes (a Diffusers pipeline folder in
``full`` mode, a LoRA weights folder in ``lora`` mode, through ``<export_dir>.tmp`` and a rename), but it
never holds more than the artefact needs:

* ``lora``: only the trainable LoRA parameters are gathered (DTensor ``full_tensor()``, one parameter at a
  time, in the same order on every rank); the frozen base is never gathered (48 GB of FLUX.1-dev for a
  ~100 MB adapter). Names and values are those of ``peft.utils.get_peft_model_state_dict`` on the
  unsharded model.
* ``full``: each weight (and persistent buffer) is cast to ``export_dtype`` (the storage dtype, bf16 by
  default: half the bytes of the float32 masters) before it is gathered, and rank 0 appends it to a buffer
  that a background thread writes as a safetensors file whenever it would exceed ``max_shard_bytes``
  (Diffusers' sharded layout: ``diffusion_pytorch_model-0000i-of-0000N.safetensors`` plus
  ``diffusion_pytorch_model.safetensors.index.json``, or one ``diffusion_pytorch_model.safetensors``).
  No second model is built; the other components (VAE, text encoders, tokenizers, scheduler,
  ``model_index.json``) are copied file by file from the pretrained folder. Rank 0 holds at most two files'
  worth and the tensor being gathered (:func:`export_peak_bytes`, the figure ``latentmill plan`` reports):
  the file being written and the next one filling; on a disk slower than the gathers, handing over a file
  waits until the one before it is written.

The gathers wait for a write only then (the writer runs in its own thread), and ranks > 0 return as soon as
the last gather is done, before rank 0 copies the components and renames the folder. Under DDP (replicated
weights) ranks > 0 return at once.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from latentmill.trainer.adapter import ModelAdapter, replace_export, save_lora
from latentmill.trainer.parallel import DistContext
from torch import nn

from latentmill.tinyio import apply_umask

log = logging.getLogger(__name__)

# A full export's weight files hold at most this many bytes each (a larger single tensor gets a file of its
# own). 5 GiB keeps rank 0's write buffer small next to a 12-14B model's bf16 copy (24-28 GB).
MAX_SHARD_BYTES = 5 * 1024**3
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Diffusers' names (diffusers.utils.constants): SAFETENSORS_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, CONFIG_NAME
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
CONFIG_NAME = "config.json"
MODEL_INDEX = "model_index.json"


def export_peak_bytes(model_bytes: int, largest_bytes: int, max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """Rank 0's most export-held bytes in a full export of ``model_bytes`` (in the export dtype) whose largest
    tensor has ``largest_bytes``: the file being written and the next one filling (a file holds at most
    ``max_shard_bytes``, or one larger tensor), and the tensor just gathered; never more than the model."""
    return min(2 * max(max_shard_bytes, largest_bytes) + largest_bytes, model_bytes)


def export_trained(
    adapter: ModelAdapter,
    transformer: nn.Module,
    *,
    mode: str,
    pretrained: str,
    export_dir: str | Path,
    ctx: DistContext,
    export_dtype: str | torch.dtype = "bfloat16",
    max_shard_bytes: int = MAX_SHARD_BYTES,
    component: str = "transformer",
    lora_subfolder: str | None = None,
    others: tuple[tuple[nn.Module, str, str | None], ...] = (),
    write_file: Callable[[dict[str, torch.Tensor], Path], None] | None = None,
) -> Path | None:
    """Write the Diffusers artefact of the trained ``transformer``; every rank calls this.

    ``transformer`` is the trained model itself: a plain module (one process, or the unwrapped module under
    DDP) or FSDP2-sharded in place (parameters are DTensors). ``full`` writes a complete pipeline folder
    (loads with ``DiffusionPipeline.from_pretrained(export_dir)``, transformer weights in ``export_dtype``);
    ``lora`` writes ``pytorch_lora_weights.safetensors`` with ``save_lora_weights`` (float32, as trained;
    loads with ``load_lora_weights``). Returns the export folder on rank 0, None on the other ranks.

    ``component``: the pipeline folder the model came from and goes back to (a full export copies every
    other component from ``pretrained``); ``lora_subfolder``: write the LoRA file into that subfolder of
    ``export_dir`` (one per expert of a two-expert pipeline: ``high_noise/``, ``low_noise/``). ``others``:
    further trained models of the run as ``(model, component, lora_subfolder)``, written into the same artefact.
    ``write_file(tensors, path)`` writes one weight file of a full export (default: safetensors' ``save_file``;
    e.g. a slow or remote disk).
    """
    if mode not in ("full", "lora"):
        raise ValueError(f"unknown trainer mode {mode!r}")
    dtype = EXPORT_DTYPES.get(export_dtype) if isinstance(export_dtype, str) else export_dtype
    if dtype not in EXPORT_DTYPES.values():
        raise ValueError(f"export_dtype must be one of {sorted(EXPORT_DTYPES)}, got {export_dtype!r}")
    if ctx.initialized and not ctx.sharded and not ctx.is_main:
        return None  # DDP: rank 0 holds the same weights
    export_dir = Path(export_dir)
    parts = ((transformer, component, lora_subfolder), *others)
    if mode == "lora":
        return _export_lora(adapter, parts, export_dir, ctx)
    return _export_full(adapter, parts, pretrained, export_dir, ctx, dtype, max_shard_bytes, write_file)


def _full_on_cpu(value: torch.Tensor, dtype: torch.dtype | None, is_main: bool) -> torch.Tensor | None:
    """The whole of ``value`` (a DTensor shard or a plain tensor) on the CPU on rank 0, None elsewhere.

    Collective for a DTensor: every rank must call it for the same tensors in the same order. Floating
    tensors are cast to ``dtype`` before the gather (bf16: half the traffic and half the buffer).
    """
    from torch.distributed.tensor import DTensor

    value = value.detach()
    if dtype is not None and value.is_floating_point() and value.dtype != dtype:
        value = value.to(dtype)
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if not is_main:
        return None
    return value.to("cpu").contiguous()


def _fresh_tmp(export_dir: Path) -> Path:
    tmp = export_dir.with_name(export_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed while exporting
    return tmp


def _export_lora(adapter: ModelAdapter, parts: tuple[tuple[nn.Module, str, str | None], ...], export_dir: Path,
                 ctx: DistContext) -> Path | None:
    """Gather the trainable (LoRA) parameters only and write them with the pipeline's ``save_lora_weights``,
    each model's into its subfolder."""
    tmp = _fresh_tmp(export_dir) if ctx.is_main else None
    for transformer, _, subfolder in parts:
        trainable = {name for name, param in transformer.named_parameters() if param.requires_grad}
        gathered: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            # state_dict() (references, nothing copied): FSDP2 hands out its sharded parameters there even when
            # a forward left some unsharded
            for name, value in transformer.state_dict().items():
                if name in trainable:
                    full = _full_on_cpu(value, None, ctx.is_main)  # float32, as trained
                    if full is not None:
                        gathered[name] = full
        if tmp is None:
            continue
        from peft.utils import get_peft_model_state_dict

        save_lora(adapter.diffusers_class(adapter.pipeline_class), tmp / subfolder if subfolder else tmp,
                  # the names PEFT gives the unsharded model (".default" dropped), from the gathered tensors
                  get_peft_model_state_dict(transformer, state_dict=gathered),
                  transformer.peft_config["default"].to_dict())
    if tmp is None:
        return None
    apply_umask(tmp)  # safetensors writes 0600: the export gets the modes of every other file
    return replace_export(tmp, export_dir)


def _export_full(
    adapter: ModelAdapter,
    parts: tuple[tuple[nn.Module, str, str | None], ...],
    pretrained: str,
    export_dir: Path,
    ctx: DistContext,
    dtype: torch.dtype,
    max_shard_bytes: int,
    write_file: Callable[[dict[str, torch.Tensor], Path], None] | None,
) -> Path | None:
    """Stream each model's gathered weights into ``<tmp>/<component>/``, then copy the other components from
    ``pretrained`` (rank 0, after the last gather)."""
    tmp = _fresh_tmp(export_dir) if ctx.is_main else None
    for transformer, component, _ in parts:
        writer = None
        if tmp is not None:
            (tmp / component).mkdir(parents=True)
            writer = _ShardWriter(tmp / component, max_shard_bytes, write_file)
        # modules the class keeps in float32 (Wan: norms, time embedder, modulation) stay float32, as they do
        # when Diffusers loads the model in bf16 and saves it (diffusers' rule: a component of the dotted name)
        keep_fp32 = set(getattr(transformer, "_keep_in_fp32_modules", None) or ())
        try:
            with torch.no_grad():
                # state_dict(): the parameters and persistent buffers, under the names save_pretrained writes
                for name, value in transformer.state_dict().items():
                    kept = dtype != torch.float32 and not keep_fp32.isdisjoint(name.split("."))
                    full = _full_on_cpu(value, torch.float32 if kept else dtype, ctx.is_main)
                    if writer is not None:
                        writer.add(name, full)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if writer is not None:  # rank 0: the writer thread finishes while the next model is gathered
            _write_config(adapter, transformer, tmp / component)
            writer.close()
    if tmp is None:
        return None  # ranks > 0: done; nothing below is collective
    # --- rank 0 only, no collective from here on
    _copy_components(pretrained, tmp, {component for _, component, _ in parts})
    apply_umask(tmp)
    return replace_export(tmp, export_dir)


class _ShardWriter:
    """Rank 0's weight files: tensors are grouped in order into files of at most ``max_bytes`` (a larger
    tensor alone in its own), written by one background thread while the next file fills; a file is handed
    over once the one before it is written, so at most two are held (:func:`export_peak_bytes`).

    Files are written under provisional names and renamed once their count is known (``close``).
    """

    def __init__(self, folder: Path, max_bytes: int,
                 write_file: Callable[[dict[str, torch.Tensor], Path], None] | None = None) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_bytes}")
        self.folder, self.max_bytes = folder, max_bytes
        self.write_file = write_file
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffer_bytes = 0
        self.files: list[list[str]] = []  # tensor names of each file, in file order
        self.total_bytes = 0
        self.error: BaseException | None = None
        self.queue: queue.Queue[tuple[int, dict[str, torch.Tensor]] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="export-writer", daemon=True)
        self.thread.start()

    def _part(self, index: int) -> Path:
        return self.folder / f"part-{index:05d}.safetensors.partial"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append one tensor; hand the buffer to the writer first if the tensor would overflow it."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffer_bytes + nbytes > self.max_bytes:
            self.flush()
        self.buffer[name] = tensor
        self.buffer_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        """Queue the buffered tensors as the next file (no-op when empty)."""
        if not self.buffer:
            return
        self.files.append(list(self.buffer))
        self.queue.join()  # the file before this one is written (and freed): two files held at most
        self.queue.put((len(self.files) - 1, self.buffer))
        self.buffer, self.buffer_bytes = {}, 0  # the writer thread now holds the only reference

    def _run(self) -> None:
        from safetensors.torch import save_file

        write = self.write_file or (lambda tensors, path: save_file(tensors, path, metadata={"format": "pt"}))
        while (item := self.queue.get()) is not None:
            index, tensors = item
            if self.error is None:  # after a failure: drain (and free) the rest
                try:
                    write(tensors, self._part(index))
                except BaseException as err:  # re-raised on rank 0 by close(), after the gathers
                    self.error = err
            del item, tensors
            self.queue.task_done()

    def abort(self) -> None:
        """Stop the writer thread without naming the files (the tmp folder stays incomplete)."""
        self.buffer = {}
        self.queue.put(None)
        self.thread.join()

    def close(self) -> None:
        """Wait for the writes, then give the files Diffusers' names and write the index if there are several."""
        self.flush()
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        count = len(self.files)
        weight_map = {}
        for index, names in enumerate(self.files):
            final = WEIGHTS_NAME if count == 1 else WEIGHTS_NAME.replace(
                ".safetensors", f"-{index + 1:05d}-of-{count:05d}.safetensors"
            )
            os.replace(self._part(index), self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        if count > 1:  # as ModelMixin.save_pretrained writes it
            index_doc = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index_doc, indent=2, sort_keys=True) + "\n")


def _write_config(adapter: ModelAdapter, transformer: nn.Module, folder: Path) -> None:
    """``config.json`` as ``save_config`` writes it, naming the Diffusers class (FSDP2 renames the module's
    class to ``FSDP<name>``)."""
    config = json.loads(transformer.to_json_string())
    config["_class_name"] = adapter.transformer_class
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _components(model_index: dict[str, Any]) -> list[str]:
    """The component folders a ``model_index.json`` names (entries ``[library, class]``, not null)."""
    return [
        key for key, value in model_index.items()
        if not key.startswith("_") and isinstance(value, (list, tuple)) and len(value) == 2 and all(value)
    ]


def _pretrained_folder(pretrained: str, trained: set[str]) -> Path:
    """``pretrained`` as a local folder: itself, or the hub snapshot without the trained components' weights."""
    local = Path(pretrained)
    if local.is_dir():
        return local
    from huggingface_hub import hf_hub_download, snapshot_download

    model_index = json.loads(Path(hf_hub_download(pretrained, MODEL_INDEX)).read_text())
    patterns = [MODEL_INDEX, *(f"{name}/*" for name in _components(model_index) if name not in trained)]
    return Path(snapshot_download(pretrained, allow_patterns=patterns))


def _copy_components(pretrained: str, tmp: Path, trained: set[str]) -> None:
    """Copy ``model_index.json`` and every component but the ``trained`` ones from the pretrained pipeline."""
    source = _pretrained_folder(pretrained, trained)
    model_index = json.loads((source / MODEL_INDEX).read_text())
    for name in _components(model_index):
        if name in trained:
            continue
        if not (source / name).is_dir():
            raise FileNotFoundError(f"{source / name}: component {name!r} of {source / MODEL_INDEX} is missing")
        # copyfile follows the hub cache's symlinks and leaves the modes to apply_umask
        shutil.copytree(source / name, tmp / name, copy_function=shutil.copyfile)
    shutil.copyfile(source / MODEL_INDEX, tmp / MODEL_INDEX)
