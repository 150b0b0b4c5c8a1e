"""Run the benchmark suite and write ``results.json`` and ``RESULTS.md`` (``make bench``).

Each benchmark runs in its own process (``python -m bench.<name> --json ...``), so that one's loaded
models, allocator state or thread settings never colour the next; a failing one is reported and the
suite goes on. The full run writes ``bench/results.json`` and ``bench/RESULTS.md``; ``--quick`` (a
smoke check with small sizes) writes to ``bench/.work/quick/`` unless ``--out`` says otherwise.

    python -m bench.run                 # the full suite (~10 minutes on 2 CPU cores)
    python -m bench.run --quick         # smoke check (3-5 minutes)
    python -m bench.run --only loader trainer
    python -m bench.run --only loader --merge   # re-run one benchmark, replace its figures in results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import BENCH_DIR, REPO_ROOT, WORK, log, machine_info, setup_env

setup_env()

BENCHMARKS = ("loader", "trainer", "prep", "onthefly", "memory", "disk", "ranks", "video", "startup", "files",
              "jaxloader", "scale", "heap", "compaction", "sample", "curate", "dedup", "threads", "families", "longclip",
              "unchanged", "stream")
# Benchmarks whose full run needs more than --timeout's default: bench.scale preps 100,000 + 10,000 inputs
# through the CLI (about 40 minutes on 2 CPU cores).
MIN_TIMEOUT_S = {"scale": 3600, "heap": 3600}
PRODUCT_CODE = ("latentmill", "stages", "pipelines", "trainer")


def code_fingerprint() -> str:
    """sha256 over the product's Python sources: which code a figure measured (others edit it meanwhile)."""
    import hashlib

    digest = hashlib.sha256()
    for room in PRODUCT_CODE:
        for path in sorted((REPO_ROOT / room).rglob("*.py")):
            digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def run_one(name: str, args: argparse.Namespace, out: Path) -> dict:
    """Run ``bench.<name>`` in a child process; its JSON, or an error entry."""
    cmd = [sys.executable, "-m", f"bench.{name}", "--json", str(out), "--device", args.device]
    if args.quick:
        cmd.append("--quick")
    if args.reps:
        cmd += ["--reps", str(args.reps)]
    log(f"running {' '.join(cmd[1:])}")
    start = time.perf_counter()
    try:
        timeout = args.timeout if args.quick else max(args.timeout, MIN_TIMEOUT_S.get(name, 0))
        done = subprocess.run(cmd, cwd=REPO_ROOT, timeout=timeout, stdout=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        return {"benchmark": name, "error": f"timed out after {timeout} s", "figures": []}
    seconds = time.perf_counter() - start
    print(done.stdout, end="", flush=True)
    if done.returncode != 0 or not out.is_file():
        return {"benchmark": name, "error": f"exit status {done.returncode} (see the log above)", "figures": [],
                "seconds": round(seconds, 1)}
    return json.loads(out.read_text())


def fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.3g}"
    return str(x)


def markdown(results: dict) -> str:
    """The RESULTS.md text: a table of every figure, the machine, then each figure's inputs."""
    m = results["machine"]
    codes = sorted({f.get("code_fingerprint") for f in results["figures"] if f.get("code_fingerprint")})
    lines = [
        "# Benchmark results",
        "",
        f"`{results['command']}` on {m['date']} ({'quick smoke sizes' if results['quick'] else 'full sizes'}), "
        f"{results['seconds'] / 60:.1f} minutes. Product code measured (sha256 of latentmill/, stages/, "
        f"pipelines/, trainer/ sources): {', '.join(codes) or 'not recorded'}"
        + (" (more than one: see each figure's code_fingerprint)" if len(codes) > 1 else "") + ".",
        "",
        *([results["notes"], ""] if results.get("notes") else []),
        "Ratio = ours / baseline, the median of the per-repetition ratios (ours and the baseline measured back "
        "to back in each repetition); min–max over the repetitions. See `bench/README.md` for what each figure "
        "measures.",
        "",
        "| figure | ours | baseline | unit | ratio | min–max | goal | meets | reps |",
        "|---|---:|---:|---|---:|---|---|---|---:|",
    ]
    for f in results["figures"]:
        lines.append(f"| {f['name']} | {fmt(f['ours'])} | {fmt(f['baseline'])} | {f['unit']} | {fmt(f['ratio'])} "
                     f"| {fmt(f['ratio_min'])}–{fmt(f['ratio_max'])} | {f['goal'] or '—'} | {fmt(f['meets'])} "
                     f"| {f['reps']} |")
    for err in results.get("errors", []):
        lines.append(f"| {err['benchmark']}: FAILED ({err['error']}) | | | | | | | | |")
    lines += [
        "",
        "## Machine",
        "",
        *[f"- Re-run of {', '.join(r['benchmarks'])} (`{r['command']}`) on {r['date']}, load average "
          f"{r['load_average_start']} at start, {r['load_average_end']} at end; its figures replace the first "
          "run's" for r in results.get("reruns", [])],
        f"- CPU: {m['cpu']}, {m['cpu_count']} logical cores (torch threads {m['torch_threads']}), "
        f"{m['memory_gib']} GiB RAM; device: {m['device']}" + (f" ({m['gpu']})" if m.get("gpu") else ""),
        f"- Platform: {m['platform']}",
        f"- Load average (1/5/15 min) at start: {m['load_average']}; at end: {results['load_average_end']} "
        "(a shared machine: other people's jobs ran alongside)",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
        f"- Date (UTC): {m['date']}",
        "",
        "## Inputs, notes and details per figure",
        "",
    ]
    for f in results["figures"]:
        lines += [f"### {f['name']}", ""]
        if f.get("notes"):
            lines += [f["notes"], ""]
        lines += [f"- ours per repetition: {f['ours_reps']}", f"- baseline per repetition: {f['baseline_reps']}"]
        if f.get("details"):
            lines.append(f"- details: `{json.dumps(f['details'], separators=(', ', ': '))}`")
        lines += ["- inputs:", "", "```json", json.dumps(f["inputs"], indent=1), "```", ""]
    return "\n".join(lines) + "\n"


def merged(old: dict, new: dict, names) -> dict:
    """``old`` with the figures of benchmarks ``names`` replaced by ``new``'s, the re-run recorded."""
    by_name = {f["name"]: f for f in new["figures"]}
    out = []
    for f in old["figures"]:  # keep the suite's order
        if f.get("benchmark") in names:
            if f["name"] in by_name:
                out.append(by_name.pop(f["name"]))
        else:
            out.append(f)
    out += list(by_name.values())
    rerun = {"benchmarks": list(names), "command": new["command"], "date": new["machine"]["date"],
             "load_average_start": new["machine"]["load_average"], "load_average_end": new["load_average_end"],
             "seconds": new["seconds"]}
    return {**old, "figures": out, "errors": old.get("errors", []) + new["errors"],
            "reruns": old.get("reruns", []) + [rerun],
            "seconds_per_benchmark": {**old.get("seconds_per_benchmark", {}), **new["seconds_per_benchmark"]}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few repetitions (a smoke check)")
    p.add_argument("--reps", type=int, default=None, help="override every benchmark's repetitions")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where models run (default cpu)")
    p.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these benchmarks")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for results.json and RESULTS.md (default bench/, or bench/.work/quick with --quick)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds allowed per benchmark (default 1200)")
    p.add_argument("--merge", action="store_true",
                   help="replace only the figures of the benchmarks run in an existing results.json (noted in it)")
    args = p.parse_args(argv)
    out_dir = args.out or (WORK / "quick" if args.quick else BENCH_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts_dir = WORK / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(WORK / "prefect-home", ignore_errors=True)  # a fresh throwaway Prefect database per suite

    start = time.perf_counter()
    machine = machine_info(args.device)
    figures, errors, seconds = [], [], {}
    for name in args.only or BENCHMARKS:
        part = parts_dir / f"{name}.json"
        part.unlink(missing_ok=True)
        code = code_fingerprint()
        data = run_one(name, args, part)
        if code_fingerprint() != code:  # the product changed while this benchmark ran: say so
            errors.append({"benchmark": name, "error": "product code changed while it ran (see code_fingerprint)"})
            log(f"{name}: the product code changed while it ran; its figures mix two versions")
        figures += [{**f, "benchmark": name, "code_fingerprint": code} for f in data["figures"]]
        seconds[name] = data.get("seconds")
        if data.get("error"):
            errors.append({"benchmark": name, "error": data["error"]})
            log(f"{name} FAILED: {data['error']}")
    results = {
        "machine": machine,
        "figures": figures,
        "errors": errors,
        "quick": args.quick,
        "command": " ".join(["python -m bench.run", *(argv if argv is not None else sys.argv[1:])]),
        "seconds": round(time.perf_counter() - start, 1),
        "seconds_per_benchmark": seconds,
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }
    elapsed = results["seconds"]
    if args.merge and (out_dir / "results.json").is_file():
        old = json.loads((out_dir / "results.json").read_text())
        if old.get("quick") != results["quick"]:
            raise SystemExit("--merge: the existing results.json is from a run of the other size (--quick)")
        results = merged(old, results, args.only or BENCHMARKS)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "RESULTS.md").write_text(markdown(results))
    log(f"wrote {out_dir / 'results.json'} and {out_dir / 'RESULTS.md'} in {elapsed / 60:.1f} min")
    for f in figures:
        log(f"  {f['name']}: ratio {f['ratio']} (goal {f['goal'] or '-'}): "
            f"{ {True: 'meets', False: 'MISSES', None: 'no goal'}[f['meets']] }")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
