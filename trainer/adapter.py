"""What a model family plugs into the training loop: ``ModelAdapter``, plus the loading and export they share.

An adapter stands between cached latents and an unmodified Diffusers transformer. The loop only ever calls:

* ``experts(pretrained)``              the pipeline's denoisers and their noise ranges (one, or Wan 2.2's two);
* ``load(pretrained, mode=..., ...)``   the transformer, trainable (full, or frozen base + PEFT LoRA);
* ``blocks(transformer)``              the repeated blocks (FSDP2 units, activation checkpointing, compile);
* ``check_batch(transformer, batch)``  a clear error when cached tensors do not fit the model;
* ``seq_len(latents)``                 transformer tokens per sample (resolution-dependent shift);
* ``forward(model, noisy, sigmas, batch, cfg)``  the velocity prediction, shaped like ``noisy``;
* ``export(transformer, mode=..., pretrained=..., export_dir=...)``  the Diffusers artefact;
* ``pipeline_prompt_kwargs(prompts, pad_to)``  cached prompt embeddings as the pipeline's keyword arguments;
* ``validation_images(pipe, text, negative, ...)``  sample the assembled pipeline for the validation grid.

A new family (SD3, HunyuanVideo, LTX...) is one module with a subclass and one line in
``latentmill.trainer.adapters.ADAPTERS``; the loop does not change.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from latentmill.core.config import ConfigError
from latentmill.tinyio import apply_umask

# Files that mark a folder as an earlier export (safe to replace).
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
EXPORT_MARKERS = ("model_index.json", LORA_WEIGHTS)
DEFAULT_LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")
REGEX_PREFIX = "re:"  # trainer.lora_target_modules: ["re:<regex>"] selects the modules whose full name matches


@dataclass(frozen=True)
class Expert:
    """One denoiser of a pipeline: the component folder it is stored in and the noise levels it serves.

    A pipeline of one transformer has one expert serving every sigma. Wan 2.2 A14B has two: ``high``
    (``transformer``) for sigma >= ``boundary_ratio`` and ``low`` (``transformer_2``) below it, the rule of
    ``WanPipeline.__call__`` (``t >= boundary_ratio * num_train_timesteps`` with ``t = 1000 * sigma``).
    """

    name: str  # the value of trainer.expert that picks it ("all" for a pipeline's only transformer)
    component: str  # the pipeline folder's subfolder: transformer, transformer_2
    sigma_min: float = 0.0  # it serves sigma_min <= sigma < sigma_max (after the shift)
    sigma_max: float = math.inf

    @property
    def lora_folder(self) -> str | None:
        """The export's subfolder of this expert's LoRA (``high_noise``, ``low_noise``); None for the only one."""
        return None if self.name == "all" else f"{self.name}_noise"

    def serves(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Which of ``sigmas`` this expert denoises (bool, like ``sigmas``)."""
        return (sigmas >= self.sigma_min) & (sigmas < self.sigma_max)


ONE_EXPERT = (Expert("all", "transformer"),)

VALIDATION_FRAMES = 17  # frames of a video family's validation samples when trainer.validation_size names none


def pipeline_index(pretrained: str) -> dict[str, Any]:
    """``model_index.json`` of a pipeline folder or hub id (only that file is read); {} for a folder without one
    (a transformer alone)."""
    local = Path(pretrained) / "model_index.json"
    if Path(pretrained).is_dir():
        return json.loads(local.read_text()) if local.is_file() else {}
    from huggingface_hub import hf_hub_download

    return json.loads(Path(hf_hub_download(pretrained, "model_index.json")).read_text())


def choose_experts(experts: tuple[Expert, ...], expert: str | None, pretrained: str) -> tuple[Expert, ...]:
    """The experts a run trains for ``trainer.expert`` (null: the only one; a name: that one; ``both``: all of a
    two-expert pipeline);
    a ConfigError naming the key and the pipeline's experts when they do not fit."""
    names = [e.name for e in experts]
    if len(experts) == 1:
        if expert is None:
            return experts
        raise ConfigError(f"trainer.expert: {expert!r} needs a pipeline with two experts (a boundary_ratio and a "
                          f"transformer_2 in model_index.json); {pretrained} has one transformer: set "
                          "trainer.expert: null")
    described = "; ".join(f"{e.name}: {e.component}, sigma in [{e.sigma_min:g}, {min(e.sigma_max, 1.0):g}"
                          f"{']' if e.sigma_max > 1 else ')'}" for e in experts)
    if expert is None:
        raise ConfigError(f"trainer.expert: {pretrained} has {len(experts)} experts ({described}); set "
                          f"trainer.expert to one of {', '.join(map(repr, names))} (one per run) or 'both'")
    if expert == "both":
        return experts
    if expert not in names:
        raise ConfigError(f"trainer.expert: {expert!r} is not one of {', '.join(map(repr, names))} "
                          f"({pretrained}: {described})")
    return tuple(e for e in experts if e.name == expert)


def lora_targets(modules: list[str] | tuple[str, ...] | None) -> list[str] | str:
    """PEFT ``target_modules`` of ``trainer.lora_target_modules``: module-name suffixes (``to_q`` matches
    ``blocks.3.attn.to_q``), or one ``re:<regex>`` entry, a regex the full module name must match (PEFT's
    string form; e.g. Z-Image's main layers without its refiner blocks)."""
    modules = list(modules or DEFAULT_LORA_TARGETS)
    if len(modules) == 1 and modules[0].startswith(REGEX_PREFIX):
        return modules[0][len(REGEX_PREFIX):]
    return modules


def load_transformer(
    transformer_cls: type,
    pretrained: str,
    *,
    mode: str = "full",
    device: torch.device | str = "cpu",
    lora_rank: int = 16,
    lora_alpha: float = 16.0,
    lora_target_modules: list[str] | None = None,
    base_dtype: torch.dtype | None = None,
    component: str = "transformer",
) -> nn.Module:
    """``transformer_cls.from_pretrained(pretrained, subfolder=component)``, made trainable.

    ``full``: every parameter trains, in float32. ``lora``: the base is frozen (``base_dtype``; default
    bfloat16 on CUDA, float32 on CPU) and a PEFT LoRA adapter (float32) is added with ``add_adapter``.
    ``component``: the pipeline folder's subfolder of the model (an :class:`Expert`'s).
    """
    device = torch.device(device)
    if base_dtype is None:
        base_dtype = torch.bfloat16 if (mode == "lora" and device.type == "cuda") else torch.float32
    if mode == "full":
        base_dtype = torch.float32
    elif mode != "lora":
        raise ValueError(f"unknown trainer mode {mode!r}")
    # torch_dtype only when not the default (diffusers 0.42 deprecates the name, older releases lack `dtype`)
    extra = {"torch_dtype": base_dtype} if base_dtype != torch.float32 else {}
    transformer = transformer_cls.from_pretrained(pretrained, subfolder=component, **extra)
    return make_trainable(
        transformer, mode=mode, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_target_modules=lora_target_modules
    ).to(device)


def peft_targets(transformer: nn.Module, targets: list[str] | tuple[str, ...]) -> list[str]:
    """``targets`` as PEFT's ``target_modules``: each name as given, unless it also names a container (a
    ModuleList: FLUX.2's ``to_out`` is the single blocks' output Linear and the double blocks' ModuleList around
    ``to_out.0``), which PEFT cannot wrap; such a name becomes the full names of the Linear layers it matches."""
    modules = dict(transformer.named_modules())
    out: list[str] = []
    for target in targets:
        matched = [name for name in modules if name == target or name.endswith("." + target)]
        if any(isinstance(modules[name], (nn.ModuleList, nn.ModuleDict, nn.Sequential)) for name in matched):
            out += [name for name in matched if isinstance(modules[name], nn.Linear)]
        else:
            out.append(target)
    return out


def make_trainable(
    transformer: nn.Module,
    *,
    mode: str = "full",
    lora_rank: int = 16,
    lora_alpha: float = 16.0,
    lora_target_modules: list[str] | None = None,
) -> nn.Module:
    """Mark what trains: ``full`` every parameter; ``lora`` a PEFT LoRA adapter (float32) on a frozen base.

    The one place that adds the adapter, for a loaded model and for one built on the meta device
    (``latentmill.trainer.model_load.meta_transformer``) alike, so both have the same parameter names.
    LoRA weights are drawn from the global RNG (``init_lora_weights="gaussian"``). Returns the model in
    train mode.
    """
    if mode == "lora":
        from peft import LoraConfig

        transformer.requires_grad_(False)
        targets = lora_targets(lora_target_modules)  # suffixes, or one regex (re:...)
        transformer.add_adapter(
            LoraConfig(
                r=lora_rank,
                lora_alpha=lora_alpha,
                init_lora_weights="gaussian",
                target_modules=targets if isinstance(targets, str) else peft_targets(transformer, targets),
            )
        )
        for param in transformer.parameters():
            if param.requires_grad:
                param.data = param.data.float()  # trainable weights stay float32 even on a bf16 base
    elif mode == "full":
        transformer.requires_grad_(True)
    else:
        raise ValueError(f"unknown trainer mode {mode!r}")
    return transformer.train()


def replace_export(tmp: Path, export_dir: Path) -> Path:
    """Move the finished export ``tmp`` to ``export_dir``, replacing a previous export there (nothing else)."""
    if export_dir.exists():
        # an expert's LoRA sits one level down (Expert.lora_folder)
        if not any((export_dir / marker).exists() or any(export_dir.glob(f"*/{marker}")) for marker in EXPORT_MARKERS):
            raise FileExistsError(f"{export_dir} exists and is not a previous export; refusing to replace it")
        shutil.rmtree(export_dir)
    os.replace(tmp, export_dir)
    return export_dir


def save_lora(pipeline_cls: type, folder: Path, layers: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Write a transformer's LoRA ``layers`` (PEFT names) as ``pipeline_cls.save_lora_weights`` does:
    ``pytorch_lora_weights.safetensors``, keys and adapter metadata under ``transformer.``.

    A pipeline without a LoRA loader (HunyuanVideo 1.5 in diffusers 0.42) gets the same file, written here; it
    loads with ``pipe.transformer.load_lora_adapter(folder, use_safetensors=True)`` (whose default prefix is
    ``transformer``).
    """
    if hasattr(pipeline_cls, "save_lora_weights"):
        pipeline_cls.save_lora_weights(folder, transformer_lora_layers=layers,
                                       transformer_lora_adapter_metadata=metadata)
        return
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    packed = {f"transformer.{k}": sorted(v) if isinstance(v, set) else v for k, v in metadata.items()}
    save_file({f"transformer.{k}": v.contiguous() for k, v in layers.items()}, folder / LORA_WEIGHTS,
              metadata={"format": "pt", "lora_adapter_metadata": json.dumps(packed, indent=2, sort_keys=True)})


def export_pipeline(
    pipeline_cls: type, transformer: nn.Module, *, mode: str, pretrained: str, export_dir: str | Path
) -> Path:
    """Write a Diffusers artefact: full -> a complete pipeline folder; lora -> a LoRA weights folder.

    The full export is ``pipeline_cls.from_pretrained(pretrained, transformer=transformer).save_pretrained``
    and loads with ``DiffusionPipeline.from_pretrained(export_dir)``; the LoRA export is
    ``pipeline_cls.save_lora_weights`` and loads with ``pipeline_cls.from_pretrained(pretrained)
    .load_lora_weights(export_dir)``. Written to ``<export_dir>.tmp`` and renamed.
    """
    export_dir = Path(export_dir)
    tmp = export_dir.with_name(export_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    if mode == "full":
        pipe = pipeline_cls.from_pretrained(pretrained, transformer=transformer)
        pipe.save_pretrained(tmp)
    elif mode == "lora":
        from peft.utils import get_peft_model_state_dict

        save_lora(pipeline_cls, tmp, get_peft_model_state_dict(transformer),
                  transformer.peft_config["default"].to_dict())
    else:
        raise ValueError(f"unknown trainer mode {mode!r}")
    apply_umask(tmp)  # safetensors writes 0600: the export gets the modes of every other file
    return replace_export(tmp, export_dir)


def padded(tensors: list[torch.Tensor], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-axis tensors ``[L_i, D]`` stacked as ``[B, length, D]``, zero past each one's tokens, and their mask
    ``[B, length]`` (int64, 1 on real tokens), as the pipelines pad prompts; ``length`` None: the longest."""
    length = max(len(t) for t in tensors) if length is None else length
    embeds_BLD = tensors[0].new_zeros(len(tensors), length, *tensors[0].shape[1:])
    mask_BL = torch.zeros(len(tensors), length, dtype=torch.int64)
    for i, tensor in enumerate(tensors):
        embeds_BLD[i, : len(tensor)] = tensor
        mask_BL[i, : len(tensor)] = 1
    return embeds_BLD, mask_BL


def mask_problems(prompt_embeds_BLD: torch.Tensor, mask_BL: torch.Tensor, template: str) -> list[str]:
    """What is wrong with a batch of a ``mask`` text stream: a sample without a real token (``template``
    says what the pipeline's prompt template alone gives), or embeddings stored padded (zeros inside the
    mask: a cache whose text was not trimmed to its real tokens)."""
    lengths = mask_BL.sum(1)
    if bool((lengths == 0).any()):
        return [f"a sample has no real text token ({template})"]
    if bool((prompt_embeds_BLD[torch.arange(len(lengths)), lengths - 1] == 0).all(-1).any()):
        return ["prompt_embeds are stored padded (zeros inside the mask): prep the cache with "
                "cache.trim_text: auto (or always), which stores the real tokens only"]
    return []


class ModelAdapter(ABC):
    """Base of the per-family adapters; subclasses set the class names and implement the model-specific parts."""

    family: str = ""
    transformer_class: str = ""  # diffusers class names, imported on use
    pipeline_class: str = ""
    # the modules a LoRA trains when trainer.lora_target_modules names none: what the community's LoRAs of
    # the family train (module-name suffixes, or one "re:<regex>" entry)
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    # the cache streams (batch columns) the forward reads, checked against the cache manifest's streams
    streams: tuple[str, ...] = ("latents", "prompt_embeds")
    latent_ndim: int = 3  # of one sample: 3 = image [C, H, W], 4 = video [C, F, H, W]
    # the model conditions a video on an image as its clean first latent frame (trainer.i2v_probability): the
    # forward then reads the batch's ``first_frame_mask`` (latentmill.trainer.objective.first_frame_mask)
    first_frame_conditioning: bool = False
    # latent streams denoised together with ``latents`` at each sample's noise level (LTX-2's audio): the loop
    # noises each one, puts the noisy tensor in the batch under its name, and adds its loss weighted by
    # ``trainer.audio_loss_weight``; ``forward`` then returns ``(prediction, {name: prediction})``
    noised_streams: tuple[str, ...] = ()
    # validation samples from the recipe's prompts alone (an edit model needs a source image too)
    validates_from_prompts: bool = True
    # validation takes the prompts' embeddings from the snapshot (encoded at prep), never a text encoder
    prompts_from_cache: bool = True
    # the prompt whose embeddings stand for "no prompt" in validation's classifier-free guidance (the pipeline's)
    negative_prompt: str = ""
    # the text tokens run through the blocks with the latent tokens (joint attention); False: they only feed
    # cross-attention (latentmill.activations: what a block's sequence holds)
    text_in_blocks: bool = True
    # bytes per token and unit of hidden width a block holds in float32 on top of latentmill.activations' bf16
    # count: (its input while checkpointed, its saved tensors); Wan's blocks run their norms and residuals in float32
    float32_activations: tuple[int, int] = (0, 0)
    # bytes per (query token, key token) of the blocks' sequence each block saves for backward when its attention
    # takes a dense mask (latentmill.activations); 0: none
    attention_mask_bytes: int = 0

    def block_widths(self, config: dict[str, Any]) -> tuple[int, int]:
        """(hidden, feed-forward) widths of the repeated blocks from the transformer's config: heads x head
        dim, and ``ffn_dim`` or ``mlp_ratio`` (4 by default) x hidden (latentmill.activations)."""
        hidden = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
        return hidden, int(config.get("ffn_dim") or round(float(config.get("mlp_ratio") or 4.0) * hidden))

    def text_tokens(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """The text tokens per sample in the blocks' sequence (or their cross-attention's) from a sample's stream
        ``shapes`` at the longest caption (latentmill.activations): ``prompt_embeds``' by default."""
        return int(shapes.get("prompt_embeds", (0,))[0])

    def side_streams(self, config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[tuple[int, int, int]]:
        """(tokens per sample, hidden width, feed-forward width) of each token stream the blocks carry beside the
        latents', from the transformer's config and a sample's stream ``shapes`` (latentmill.activations); none by
        default."""
        return []

    @staticmethod
    def diffusers_class(name: str) -> type:
        """A class of the ``diffusers`` package by name (imported on use)."""
        import diffusers

        return getattr(diffusers, name)

    def load(self, pretrained: str, **kwargs: Any) -> nn.Module:
        """The trainable transformer of ``pretrained`` (see ``load_transformer`` for the keyword arguments;
        LoRA without ``lora_target_modules``: the family's :attr:`lora_targets`), its :meth:`unused_modules`
        frozen."""
        kwargs["lora_target_modules"] = self.targets(kwargs.get("lora_target_modules"))
        return self.freeze_unused(load_transformer(self.diffusers_class(self.transformer_class), pretrained, **kwargs))

    def targets(self, lora_target_modules: list[str] | tuple[str, ...] | None) -> list[str]:
        """``trainer.lora_target_modules``, or, when the recipe names none, the family's :attr:`lora_targets`."""
        return list(lora_target_modules or self.lora_targets)

    def unused_modules(self, transformer: nn.Module) -> list[nn.Module]:
        """Modules whose output never reaches the prediction (none by default). They are frozen wherever the
        trainable model is built: no gradient ever reaches them, which DDP refuses and for which the optimizer
        would hold no state (a sharded checkpoint would then lack their state)."""
        return []

    def freeze_unused(self, transformer: nn.Module) -> nn.Module:
        for module in self.unused_modules(transformer):
            module.requires_grad_(False)
        return transformer

    def experts(self, pretrained: str) -> tuple[Expert, ...]:
        """The pipeline's denoisers and the noise levels each serves: one ``transformer`` by default."""
        return ONE_EXPERT

    @abstractmethod
    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        """The repeated transformer blocks, in forward order."""
        ...

    @abstractmethod
    def check_batch(self, transformer: nn.Module, batch: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming what differs when cached tensors do not fit the transformer."""
        ...

    @abstractmethod
    def seq_len(self, latents: torch.Tensor) -> int:
        """Transformer tokens of one sample of ``latents`` [B, ...]."""
        ...

    def resolution_mu(self, image_seq_len: int, cfg: Any) -> float:
        """``mu`` of the resolution-dependent shift (``trainer.shift_mode: resolution``, shift = exp(mu)) as
        the family's pipeline computes it at inference: by default Flux's ``calculate_shift``, linear in the
        token count between the cfg's ``base_shift`` / ``max_shift`` values."""
        from latentmill.trainer.objective import resolution_mu

        return resolution_mu(image_seq_len, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift,
                             cfg.max_shift)

    @abstractmethod
    def forward(
        self, model: nn.Module, noisy: torch.Tensor, sigmas_B: torch.Tensor, batch: dict[str, Any], cfg: Any
    ) -> torch.Tensor:
        """Velocity prediction for ``noisy`` at noise levels ``sigmas_B``, shaped like ``noisy`` (with
        :attr:`noised_streams`: and each one's prediction, by name)."""
        ...

    def export(self, transformer: nn.Module, *, mode: str, pretrained: str, export_dir: str | Path) -> Path:
        """The Diffusers artefact of the trained transformer (see ``export_pipeline``)."""
        return export_pipeline(
            self.diffusers_class(self.pipeline_class),
            transformer,
            mode=mode,
            pretrained=pretrained,
            export_dir=export_dir,
        )

    def pipeline_prompt_kwargs(self, prompts: list[dict[str, torch.Tensor]], pad_to: dict[str, int]) -> dict[str, Any]:
        """The pipeline's prompt keyword arguments for cached prompts (each one's text streams as stored: a
        trimmed stream holds its real tokens; ``pad_to``: each token stream's padded length), as the pipeline's
        own ``encode_prompt`` would give them: by default ``prompt_embeds`` zero-padded to its length (stored
        padded: as stored)."""
        return {"prompt_embeds": padded([p["prompt_embeds"] for p in prompts], pad_to.get("prompt_embeds"))[0]}

    @abstractmethod
    def validation_images(
        self,
        pipe: Any,
        text: dict[str, Any],
        negative: dict[str, Any],
        *,
        size: list[int],
        steps: int,
        generator: torch.Generator,
        max_sequence_length: int,
        guidance_scale: float,
    ) -> list[list[Any]]:
        """Sample ``pipe`` once per prompt; one row of PIL images per prompt (every frame of a video, or 1 image).

        ``text``: the prompts as pipeline keyword arguments (``pipeline_prompt_kwargs``, or ``prompt=`` where
        the pipeline encodes them); ``negative``: the negative prompt's, ``negative_``-prefixed (for classifier-free
        guidance; ``negative_prompt=`` where the pipeline encodes it)."""
        ...
