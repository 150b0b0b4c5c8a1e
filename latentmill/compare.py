"""``latentmill compare RUN_A RUN_B [--plot FILE]``: two training runs side by side.

A run is a folder ``<output_dir>/train/runs/<run>`` (``latentmill.pipelines.runs``), or an output_dir (its run
started last). Printed: the recipe keys whose values differ (``recipe.json``), the two snapshots (content ids,
sample and held-out counts, the sample keys only one of them holds, read from their shard indexes), and the
train and held-out eval losses at the steps both runs logged (``metrics.jsonl``). ``--plot`` draws the
curves into a PNG.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from latentmill.pipelines.runs import LATEST, RECIPE_FILE, RUN_FILE
from latentmill.pipelines.snapshot import resolve_snapshot
from latentmill.stages.shardindex import load_shard_index
from latentmill.trainer.trackers import flatten

MAX_ROWS = 20  # loss rows printed when no step holds an eval (evenly spread, the last one always)
MAX_KEYS = 5  # sample keys printed per side of the snapshot diff


def find_run(path: str | Path) -> Path:
    """The run folder ``path`` names: a run (``run.json`` or ``metrics.jsonl`` inside), or an output_dir whose
    ``train/LATEST`` names one; anything else raises ``FileNotFoundError`` in one line."""
    path = Path(path)
    pointer = path / "train" / LATEST
    if pointer.is_file():
        path = path / "train" / "runs" / pointer.read_text().strip()
    if not ((path / RUN_FILE).is_file() or (path / "metrics.jsonl").is_file()):
        raise FileNotFoundError(f"{path} is not a training run: it holds no {RUN_FILE} or metrics.jsonl (a run is "
                                "<output_dir>/train/runs/<run>, or give the output_dir for its latest run)")
    return path


def read_curves(run: Path) -> dict[int, dict[str, Any]]:
    """Step -> that step's ``metrics.jsonl`` record (the last one written for a step, as a resume rewinds)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {int(r["step"]): r for r in records}


def snapshot_keys(folder: Path, manifest: dict[str, Any]) -> set[str]:
    """Every sample key of a snapshot, from its shards' indexes (no tar is read)."""
    keys: set[str] = set()
    for shard in manifest["shards"]:
        index = load_shard_index(folder / shard["path"], shard["index"])
        keys.update(index.key(i) for i in range(index.num_samples))
    return keys


def _snapshot(run: Path, recipe: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
    """The folder and manifest of the snapshot ``run`` trained on, or None when it cannot be found."""
    record = json.loads((run / RUN_FILE).read_text()) if (run / RUN_FILE).is_file() else {}
    name = record.get("snapshot") or (record.get("summary") or {}).get("snapshot")
    output_dir = recipe.get("output_dir") or run.parent.parent.parent
    if not name:
        return None
    try:
        folder = resolve_snapshot(output_dir, name)
    except FileNotFoundError:
        return None
    return folder, json.loads((folder / "manifest.json").read_text())


def compare_runs(path_a: str | Path, path_b: str | Path) -> dict[str, Any]:
    """What ``latentmill compare`` prints, as data: ``runs``, ``settings`` (key -> [a, b]), ``snapshots``
    (per side: name, content id, samples, held out; ``only_a``/``only_b``: keys), ``steps`` (step -> train
    and eval losses of each side, for the steps both logged)."""
    runs = [find_run(path_a), find_run(path_b)]
    recipes = [json.loads((r / RECIPE_FILE).read_text()) if (r / RECIPE_FILE).is_file() else {} for r in runs]
    flat = [flatten(r) for r in recipes]
    settings = {key: [flat[0].get(key), flat[1].get(key)] for key in sorted(set(flat[0]) | set(flat[1]))
                if key != "output_dir" and flat[0].get(key) != flat[1].get(key)}
    snapshots: dict[str, Any] = {"a": None, "b": None}
    found = [_snapshot(run, recipe) for run, recipe in zip(runs, recipes)]
    for side, snap in zip("ab", found):
        if snap is not None:
            info = snap[1]["snapshot"]
            snapshots[side] = {"name": info["name"], "content_id": info["content_id"], "samples": info["samples"],
                               "held_out": (info.get("eval") or {}).get("samples", 0)}
    if found[0] is not None and found[1] is not None:
        keys = [snapshot_keys(*snap) for snap in found]
        snapshots["only_a"], snapshots["only_b"] = sorted(keys[0] - keys[1]), sorted(keys[1] - keys[0])
    curves = [read_curves(run) for run in runs]
    steps = {}
    for step in sorted(set(curves[0]) & set(curves[1])):
        a, b = curves[0][step], curves[1][step]
        steps[step] = {"loss": [a.get("loss"), b.get("loss")],
                       "eval": [(a.get("eval") or {}).get("loss"), (b.get("eval") or {}).get("loss")]}
    return {"runs": [str(r) for r in runs], "settings": settings, "snapshots": snapshots, "steps": steps,
            "curves": curves}


def _number(value: Any) -> str:
    return "-" if value is None else f"{value:.5f}" if isinstance(value, float) else str(value)


def format_comparison(result: dict[str, Any]) -> str:
    """The report ``latentmill compare`` prints."""
    a, b = result["runs"]
    lines = [f"A: {a}", f"B: {b}", "", "settings (recipe keys that differ):"]
    lines += [f"  {key}: {json.dumps(va)} -> {json.dumps(vb)}" for key, (va, vb) in result["settings"].items()] or \
        ["  none"]
    snaps = result["snapshots"]
    lines += ["", "snapshots:"]
    for side in "ab":
        s = snaps[side]
        lines.append(f"  {side.upper()}: " + (f"{s['name']} (content {s['content_id'][:12]}), {s['samples']} samples, "
                                              f"{s['held_out']} held out" if s else "not found"))
    if "only_a" in snaps:
        if snaps["a"]["content_id"] == snaps["b"]["content_id"]:
            lines.append("  the same data")
        for side in "ab":
            keys = snaps[f"only_{side}"]
            shown = ", ".join(keys[:MAX_KEYS]) + (f", ... ({len(keys) - MAX_KEYS} more)" if len(keys) > MAX_KEYS else "")
            lines.append(f"  samples only in {side.upper()}: {len(keys)}" + (f" ({shown})" if keys else ""))
    steps = result["steps"]
    rows = [s for s in steps if steps[s]["eval"] != [None, None]]
    if not rows and steps:
        every = sorted(steps)
        stride = max(1, -(-len(every) // MAX_ROWS))
        rows = sorted(set(every[::stride]) | {every[-1]})
    lines += ["", "losses at equal steps:" if steps else "losses: no step that both runs logged"]
    if rows:
        lines.append(f"  {'step':>6}  {'train A':>9}  {'train B':>9}  {'eval A':>9}  {'eval B':>9}")
        for step in rows:
            (la, lb), (ea, eb) = steps[step]["loss"], steps[step]["eval"]
            lines.append(f"  {step:>6}  {_number(la):>9}  {_number(lb):>9}  {_number(ea):>9}  {_number(eb):>9}")
    return "\n".join(lines)


def plot_comparison(result: dict[str, Any], path: str | Path) -> Path:
    """The two runs' train loss and eval loss curves against the step, in one PNG (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for side, curve in zip("AB", result["curves"]):
        steps = sorted(curve)
        train_ax.plot(steps, [curve[s]["loss"] for s in steps], label=side)
        evaluated = [s for s in steps if "eval" in curve[s]]
        eval_ax.plot(evaluated, [curve[s]["eval"]["loss"] for s in evaluated], marker="o", label=side)
    for ax, title in ((train_ax, "train loss"), (eval_ax, "held-out eval loss")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
