"""Each component's class, for the model families that declare them: read by the preflight check
(``latentmill.preflight.check_component_classes``) before torch is imported, so it lives here, without torch,
and the family modules (``stages/family_<name>.py``) refer to it.

A family's entry: its pipeline classes (``model_index.json`` ``_class_name``) and, per component, the class its
config names (``_class_name``, or ``architectures[0]`` for a transformers model). One line per family.
"""

from __future__ import annotations

FAMILY_CLASSES: dict[str, dict[str, tuple[str, ...] | str]] = {}
FAMILY_CLASSES["qwen-image"] = {"pipelines": ("QwenImagePipeline",), "transformer": "QwenImageTransformer2DModel", "vae": "AutoencoderKLQwenImage", "text_encoder": "Qwen2_5_VLForConditionalGeneration"}  # noqa: E501


def pipeline_family(pipeline: str) -> str | None:
    """The declared family whose pipeline class is ``pipeline``, or None."""
    return next((family for family, entry in FAMILY_CLASSES.items() if pipeline in entry["pipelines"]), None)


def component_classes(family: str | None) -> dict[str, str]:
    """``{component: class}`` of ``family`` ({} for a family that declares none)."""
    entry = FAMILY_CLASSES.get(family or "", {})
    return {name: cls for name, cls in entry.items() if name != "pipelines"}
