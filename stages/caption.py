"""Caption: give every raw sample one or more captions, post-processed, with provenance.

The captioner (``caption.captioner``) makes new captions; the policy (``caption.policy``) decides how they
meet the captions a sample already has (what ingest found: a sidecar file, a manifest column, a webdataset
member; or captions of an upstream caption pass):

* ``auto``    — ``replace`` for the ``template`` captioner (it formats existing captions: keeping them would
  make it a no-op), ``keep`` for the others (default);
* ``keep``    — a sample with an existing caption keeps it; only the others are captioned;
* ``replace`` — every sample is captioned; existing captions are dropped;
* ``append``  — every sample is captioned and the new text is appended to each existing caption with
  ``caption.separator`` (e.g. tags or a trigger token after a human caption);
* ``extend``  — every sample is captioned and the new captions join the existing ones as alternatives.

Every caption then goes through the post-processing rules (:mod:`latentmill.stages.captioners.postprocess`);
boilerplate prefixes are stripped only from captions a captioning model wrote (:func:`written_by_model`), so
sidecar, manifest and template captions keep the words they were written with. The stage counts, per rule,
the written captions a rule changed (``rewritten_by_rule`` in the run summary and ``latentmill inspect``). A
sample is written with ``meta["captions"]`` (all captions, primary first; the trainer picks one per step),
``meta["caption"]`` and the ``.txt`` member (the primary caption, what the cache stage encodes) and
``meta["caption_provenance"]`` (one dict per caption: captioner, model id and fingerprint, prompt,
generation settings...). A sample left without a caption is quarantined with the reason, or kept with an
empty caption when ``caption.on_missing`` is ``keep_empty``.

The stage counts the captions it changed; a model or template captioner that changed none of them is
reported loudly (run summary, log), with the reason, since an explicit setting should never be a silent
no-op. Everything that decides a caption is in the stage fingerprint, so changing the prompt re-captions and a
re-run reuses every unit. Wall-clock facts (when, how long, on which device) go to the unit record
(``units/<id>.json`` ``extra``), never into the shard bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from latentmill.stages import pixels
from latentmill.stages.captioners import Captioner, CaptionItem, CaptionResult
from latentmill.stages.captioners.hf import TransformersCaptioner
from latentmill.stages.captioners.postprocess import DEFAULT_STRIP_PREFIXES, CaptionRules
from latentmill.stages.captioners.sidecar import SidecarCaptioner, sidecar_provenance
from latentmill.stages.captioners.template import TemplateCaptioner, template_fields
from latentmill.stages.shardio import (
    StageDir,
    UnitOutput,
    WorkUnit,
    check_shard_bytes,
    copy_estimate,
    iter_unit_samples,
    sample_json,
    sibling_stage,
    units_by_bytes,
)

from latentmill.core.config import ConfigError
from latentmill.core.hashing import meta_bytes

STAGE = "caption"
FORMAT_VERSION = 2  # 2: captions list, per-caption provenance, policies, post-processing rules


@dataclass
class CaptionConfig:
    """Which captioner runs, how its captions meet existing ones, and how captions are cleaned."""

    captioner: Literal["sidecar", "transformers", "template"] = "sidecar"
    policy: Literal["auto", "keep", "replace", "append", "extend"] = "auto"  # auto: see resolved_policy
    on_missing: Literal["quarantine", "keep_empty"] = "quarantine"
    # transformers captioner
    model: Optional[str] = None  # hub id or local folder, e.g. Salesforce/blip-image-captioning-large
    revision: Optional[str] = None  # hub revision (branch, tag or commit) of `model`
    prompt: Optional[Union[str, list[str]]] = None  # a list makes one caption per prompt
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    num_beams: int = 1
    generate_kwargs: dict[str, Any] = field(default_factory=dict)  # more model.generate(...) arguments
    batch_size: int = 8  # model inputs per generate call (images, or videos)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    trust_remote_code: bool = False
    frames: int = 8  # K frames sampled uniformly from a video's clip window
    # template captioner
    template: Optional[Union[str, list[str]]] = None  # e.g. "trtcrd, {caption}"; a list: one caption each
    # policy append
    separator: str = ", "
    # post-processing, applied to every caption
    strip_prefixes: list[str] = field(default_factory=lambda: list(DEFAULT_STRIP_PREFIXES))
    # whose captions lose those prefixes: "model" (what a captioning model wrote) or "all" (scraped alt text)
    strip_prefixes_from: Literal["model", "all"] = "model"
    blocklist: list[str] = field(default_factory=list)  # phrases deleted from captions
    reject: list[str] = field(default_factory=list)  # a caption containing one of these is dropped
    max_chars: int = 1000  # longer captions are cut at a word boundary
    min_chars: int = 1
    # target size of a caption shard: upstream shards are grouped into units up to this many bytes
    shard_bytes: int = 256 << 20

    def validate(self) -> None:
        check_shard_bytes(self.shard_bytes, "caption.shard_bytes")

        for key in ("batch_size", "frames", "max_new_tokens", "num_beams"):
            if getattr(self, key) < 1:
                raise ConfigError(f"caption.{key}: must be >= 1, got {getattr(self, key)}")
        if self.min_new_tokens < 0 or self.min_chars < 0:
            raise ConfigError("caption.min_new_tokens and caption.min_chars: must be >= 0")
        if self.max_chars < max(1, self.min_chars):
            raise ConfigError(f"caption.max_chars: must be >= caption.min_chars and >= 1, got {self.max_chars}")
        if self.captioner == "transformers" and not self.model:
            raise ConfigError("caption.model: must be set when caption.captioner is 'transformers' "
                              "(a Hugging Face model id or a local model folder)")
        if self.captioner == "template":
            if not self.templates:
                raise ConfigError("caption.template: must be set when caption.captioner is 'template', "
                                  "e.g. 'trtcrd, {caption}'")
            for template in self.templates:
                try:
                    template_fields(template)
                except ValueError as err:
                    raise ConfigError(f"caption.template: {template!r}: {err}") from None
        if isinstance(self.prompt, list) and not self.prompt:
            raise ConfigError("caption.prompt: an empty list; give a prompt, a list of prompts, or null")
        if self.captioner == "sidecar" and self.policy in ("append", "extend"):
            raise ConfigError(f"caption.policy: {self.policy!r} needs a captioner that makes new text "
                              "('transformers' or 'template'); with 'sidecar' use 'keep' or 'replace'")
        if self.policy == "append" and any("caption" in template_fields(t) for t in self.templates
                                           if self.captioner == "template"):
            raise ConfigError("caption.policy: 'append' with a caption.template that uses {caption} would write "
                              "each caption twice; use 'replace' (or 'auto') to format the existing captions")

    @property
    def resolved_policy(self) -> str:
        """The policy in force: ``auto`` is ``replace`` for the template captioner, ``keep`` otherwise."""
        if self.policy != "auto":
            return self.policy
        return "replace" if self.captioner == "template" else "keep"

    @property
    def templates(self) -> list[str]:
        """``caption.template`` as a list (one caption per template)."""
        return [self.template] if isinstance(self.template, str) else list(self.template or [])

    @property
    def prompts(self) -> list[str | None]:
        """``caption.prompt`` as a list (one caption per prompt; None: the model's default)."""
        return [self.prompt] if isinstance(self.prompt, str) or self.prompt is None else list(self.prompt)

    def rules(self) -> CaptionRules:
        """The post-processing rules these settings describe."""
        return CaptionRules(tuple(self.strip_prefixes), tuple(self.blocklist), tuple(self.reject),
                            self.max_chars, self.min_chars, self.strip_prefixes_from)


def build_captioner(cfg: CaptionConfig, background: tuple[int, int, int] = pixels.WHITE) -> Captioner:
    """The captioner named by ``caption.captioner`` (cheap: models load on first use, once per process).

    ``background`` is ``cache.alpha_background``: a model sees transparent pixels composited over it, as the
    cache stage encodes them."""
    if cfg.captioner == "sidecar":
        return SidecarCaptioner()
    if cfg.captioner == "template":
        return TemplateCaptioner(cfg.templates)
    return TransformersCaptioner(
        cfg.model, revision=cfg.revision, prompts=cfg.prompts, max_new_tokens=cfg.max_new_tokens,
        min_new_tokens=cfg.min_new_tokens, num_beams=cfg.num_beams, generate_kwargs=cfg.generate_kwargs,
        batch_size=cfg.batch_size, dtype=cfg.dtype, device=cfg.device, frames=cfg.frames,
        trust_remote_code=cfg.trust_remote_code, background=background)


def fingerprint(cfg: CaptionConfig, captioner: Captioner | None = None) -> dict[str, Any]:
    """Everything that decides a caption: captioner (model, prompt, generation), policy, rules, format."""
    captioner = captioner or build_captioner(cfg)
    policy = cfg.resolved_policy
    fp = {"stage": STAGE, "version": FORMAT_VERSION, "captioner": captioner.fingerprint(),
          "policy": policy, "on_missing": cfg.on_missing, "rules": cfg.rules().fingerprint()}
    if policy == "append":
        fp["separator"] = cfg.separator
    return fp


def manifest_header(cfg: CaptionConfig, captioner: Captioner | None = None) -> dict[str, Any]:
    """The stage fingerprint and the captioner's settings, for the caption manifest."""
    from latentmill.core.hashing import stable_hash

    fp = fingerprint(cfg, captioner)
    described = dict(fp["captioner"])
    if cfg.captioner == "transformers":
        described.update(model=cfg.model, revision=cfg.revision)
    return {"fingerprint": stable_hash(fp), "captioner": described, "policy": cfg.resolved_policy}


def plan(cfg: CaptionConfig, upstream: StageDir, captioner: Captioner | None = None,
         stage_dir: StageDir | None = None) -> list[WorkUnit]:
    """Units of upstream shards grouped up to ``shard_bytes`` (their tar sizes: a caption shard is its
    input's samples plus captions), keyed by their hashes and the captioning fingerprint; ``stage_dir`` (by
    default the caption folder beside ``upstream``) keeps the last run's groups."""
    return units_by_bytes(upstream, fingerprint(cfg, captioner), cfg.shard_bytes,
                          stage_dir if stage_dir is not None else sibling_stage(upstream, STAGE),
                          copy_estimate(2 * 512))


def report(cfg: CaptionConfig, records: list) -> dict[str, Any]:
    """How many captions the stage changed, and a warning when a captioner the user chose changed none.

    ``records`` are the stage's unit records; each ran unit counted its samples in ``extra``.
    """
    counted = changed = asked = written = 0
    by_rule: dict[str, int] = {}
    for record in records:  # one pass (a StageRecords reads each record from disk)
        if "changed" not in record.extra:
            continue
        counted += 1
        changed += int(record.extra["changed"])
        asked += int(record.extra.get("sent_to_captioner", 0))
        written += record.samples_out
        for rule, n in (record.extra.get(REWRITTEN_KEY) or {}).items():
            by_rule[rule] = by_rule.get(rule, 0) + int(n)
    result: dict[str, Any] = {"changed": changed, "sent_to_captioner": asked,
                              REWRITTEN_KEY: dict(sorted(by_rule.items()))}
    if cfg.captioner != "sidecar" and counted and written and not changed:
        if not asked:
            why = (f"caption.policy is {cfg.resolved_policy!r} and every sample already had a caption; set "
                   "caption.policy=replace (or append, extend) to caption them with it")
        else:
            why = f"its {asked} captions, after post-processing, equal the existing ones"
        result["warning"] = f"captioner {cfg.captioner!r} changed 0 of {written} captions: {why}"
    return result


# ---------------------------------------------------------------------------------------------------------
# Existing captions and policies
# ---------------------------------------------------------------------------------------------------------


def existing_captions(sample: dict[str, Any], meta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A sample's captions before this stage, with provenance: upstream metadata, ``.txt``, or sidecar."""
    if isinstance(meta.get("captions"), list) and meta["captions"]:
        provs = meta.get("caption_provenance")
        provs = provs if isinstance(provs, list) and len(provs) == len(meta["captions"]) else None
        return [(str(t), provs[i] if provs else {"captioner": "upstream"}) for i, t in enumerate(meta["captions"])]
    if isinstance(meta.get("caption"), str) and meta["caption"].strip():
        prov = meta.get("caption_provenance")
        return [(meta["caption"], prov if isinstance(prov, dict) else {"captioner": "upstream"})]
    if sample.get("txt"):
        return [(sample["txt"].decode("utf-8", errors="replace"), {"captioner": "upstream", "member": "txt"})]
    if isinstance(meta.get("sidecar_caption"), str) and meta["sidecar_caption"].strip():
        return [(meta["sidecar_caption"], sidecar_provenance(meta))]
    return []


MODEL_CAPTIONERS = ("transformers",)  # captioners whose text a model wrote
REWRITTEN_KEY = "rewritten_by_rule"  # unit record extra and run summary: rule -> captions it changed
_RULES_HIT = "_rewritten_by"  # while a sample is captioned: the rules that changed a caption (never written)


def written_by_model(prov: dict[str, Any]) -> bool:
    """Whether a captioning model wrote the whole caption (an appended caption: both of its parts)."""
    inner = prov.get("appended_to")
    if isinstance(inner, dict) and not written_by_model(inner):
        return False
    return prov.get("captioner") in MODEL_CAPTIONERS


def _clean(rules: CaptionRules, pairs: list[tuple[str, dict[str, Any]]],
           reasons: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Post-process captions, dropping empty and rejected ones (their reasons go to ``reasons``); a caption a
    rule changed carries the rule's name in its provenance until :func:`_rules_hit` takes it out."""
    kept, seen = [], set()
    for text, prov in pairs:
        cleaned = rules.clean(text, by_model=written_by_model(prov))
        if cleaned.reason:
            reasons.append(cleaned.reason)
        elif cleaned.text not in seen:
            seen.add(cleaned.text)
            if cleaned.rewritten_by:
                prov = {**prov, _RULES_HIT: sorted({*prov.get(_RULES_HIT, ()), *cleaned.rewritten_by})}
            kept.append((cleaned.text, prov))
    return kept


def _rules_hit(prov: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """``prov`` without the rules that changed its caption (an appended caption's parts included), and those
    rules."""
    hit = set(prov.get(_RULES_HIT, ()))
    prov = {k: v for k, v in prov.items() if k != _RULES_HIT}
    if isinstance(prov.get("appended_to"), dict):
        prov["appended_to"], inner = _rules_hit(prov["appended_to"])
        hit |= inner
    return prov, hit


def combine(policy: str, existing: list[tuple[str, dict]], new: list[tuple[str, dict]],
            separator: str) -> list[tuple[str, dict]]:
    """The captions a sample ends with under ``policy``, primary first."""
    if policy == "keep":
        return existing or new
    if policy == "replace":
        return new
    if policy == "extend":
        return existing + new
    if not existing or not new:  # append: nothing to append to, or nothing to append
        return existing or new
    return [(f"{old}{separator}{text}", {**prov, "appended_to": old_prov})
            for old, old_prov in existing for text, prov in new]


# ---------------------------------------------------------------------------------------------------------
# Processing one unit
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    sample: dict[str, Any]
    meta: dict[str, Any]
    existing: list[tuple[str, dict[str, Any]]]
    reasons: list[str]
    needs_captioner: bool


def process(cfg: CaptionConfig, unit: WorkUnit, out: UnitOutput, captioner: Captioner | None = None) -> None:
    """Caption the unit's shard, streaming: at most ``batch_size`` samples wait for the captioner at once."""
    captioner = captioner or build_captioner(cfg)
    rules, policy = cfg.rules(), cfg.resolved_policy
    pending: list[_Pending] = []
    counts: dict[str, Any] = {"changed": 0, "sent_to_captioner": 0, REWRITTEN_KEY: {}}

    def flush() -> None:
        todo = [p for p in pending if p.needs_captioner]
        results = captioner.caption([
            CaptionItem(p.sample["__key__"], p.meta, p.sample, [t for t, _ in p.existing]) for p in todo
        ]) if todo else []
        if len(results) != len(todo):
            raise RuntimeError(f"captioner {captioner.name!r} returned {len(results)} results for {len(todo)}")
        by_id = {id(p): r for p, r in zip(todo, results)}
        counts["sent_to_captioner"] += len(todo)
        for p in pending:
            counts["changed"] += _finish(cfg, rules, captioner.name, p, by_id.get(id(p)), out,
                                         counts[REWRITTEN_KEY])
        pending.clear()

    for sample in iter_unit_samples(unit):
        meta = sample_json(sample)
        reasons: list[str] = []
        existing = _clean(rules, existing_captions(sample, meta), reasons)
        needs = policy != "keep" or not existing
        pending.append(_Pending(sample, meta, existing, reasons, needs))
        # Bound memory: flush when a batch is ready, or when many kept samples queue behind it.
        if sum(p.needs_captioner for p in pending) >= cfg.batch_size or len(pending) >= 8 * cfg.batch_size:
            flush()
    flush()
    out.extra.update({"captioner": captioner.name, **counts, **getattr(captioner, "stats", dict)(),  # (keeps
                      "captioned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})  # the upstream)


def _finish(cfg: CaptionConfig, rules: CaptionRules, name: str, p: _Pending, result: CaptionResult | None,
            out: UnitOutput, by_rule: dict[str, int]) -> bool:
    """Apply the policy and the rules to one sample; write it or quarantine it, counting in ``by_rule`` the
    written captions each rule changed. True when the sample was written with captions other than the ones
    it came with."""
    new: list[tuple[str, dict[str, Any]]] = []
    if result is not None:
        if result.error:
            p.reasons.append(result.error)
        new = _clean(rules, list(zip(result.texts, result.provenance)), p.reasons)
    # Cleaned again: appended text may need cutting to max_chars, and extend may repeat a caption.
    policy = cfg.resolved_policy
    final = _clean(rules, combine(policy, p.existing, new, cfg.separator), p.reasons)
    meta, key = p.meta, p.sample["__key__"]
    if not final:
        why = "; ".join(dict.fromkeys(p.reasons)) or "no caption"
        if cfg.on_missing == "quarantine":
            out.quarantine(key, meta.get("source", "?"),
                           f"no caption from captioner {name!r}: {why} (set caption.on_missing=keep_empty "
                           "to train it unconditionally)")
            return False
        final = [("", {"captioner": name, "policy": policy, "empty": why})]
    written = []
    for text, prov in final:
        prov, hit = _rules_hit(prov)
        for rule in hit:
            by_rule[rule] = by_rule.get(rule, 0) + 1
        written.append((text, {**prov, "policy": policy}))
    final = written
    meta["captions"] = [text for text, _ in final]
    meta["caption"] = final[0][0]
    meta["caption_provenance"] = [prov for _, prov in final]
    # images and video references stay in shards of their own (every sample of a shard has the same members)
    out.add({**p.sample, "txt": final[0][0].encode("utf-8"), "json": meta_bytes(meta)},
            part=meta.get("kind") or "image")
    return meta["captions"] != [text for text, _ in p.existing]
