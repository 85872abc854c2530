"""python -m verify: build every step, check it, benchmark it beside torch SDPA, write the results.

    python -m verify                       # everything: all steps, all shapes of record
    python -m verify --steps 5-6 --seqlens 4096,16384
    python -m verify --no-bench            # build + checks only
    python -m verify --no-checks           # build + benchmark only

Runs without nox (the GPU machine has no network). Writes results/<gpu>/<timestamp>.json and .png,
regenerates the README table after a full run, copies the logs to $OUT when that is set, and prints
a short table last.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from verify import steps as steps_mod

ROOT = steps_mod.ROOT


def log(msg: str = "") -> None:
    print(msg, flush=True)


def gpu_meta() -> dict:
    import torch
    meta = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU",
            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
            "python": platform.python_version(), "host": platform.node()}
    nvcc = steps_mod.build_step.find_nvcc()
    meta["nvcc"] = ".".join(map(str, steps_mod.build_step.nvcc_version(nvcc)))
    meta.update(smi())
    return meta


def smi() -> dict:
    """Driver and clocks as nvidia-smi reads them now (read only: the card's settings are never changed)."""
    fields = ["driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "power.limit", "temperature.gpu"]
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        vals = [v.strip() for v in out.split(",")]
        d = dict(zip(fields, vals))
        return {"driver": d.pop("driver_version"), "clocks": d}
    except (OSError, IndexError, subprocess.SubprocessError):
        return {"driver": "unknown", "clocks": {}}


class StepOutcomes:
    """pytest plugin: pass/fail per step, read from the test ids ('...[step03-...]')."""
    def __init__(self):
        self.failed: dict[str, list[str]] = {}
        self.passed: set[str] = set()

    def pytest_runtest_logreport(self, report):
        m = re.search(r"\b(step\d\d)\b", report.nodeid)
        if not m:
            return
        if report.failed:
            self.failed.setdefault(m.group(1), []).append(report.nodeid)
        elif report.passed and report.when == "call":
            self.passed.add(m.group(1))


def run_checks(steps: list[str], out_dir: Path | None) -> tuple[int, dict]:
    import pytest
    os.environ["FLASHLADDER_STEPS"] = ",".join(steps)
    plugin = StepOutcomes()
    args = [str(ROOT / "verify" / "tests"), "-q", "-rfEs", "-p", "no:cacheprovider"]
    if out_dir:
        args.append(f"--junitxml={out_dir / 'checks.xml'}")
    code = pytest.main(args, plugins=[plugin])
    outcome = {s: ("FAILED" if s in plugin.failed else "passed" if s in plugin.passed else "not run") for s in steps}
    return int(code), outcome


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", help="e.g. 1-6, step03, 2,5 (default: every step under steps/)")
    ap.add_argument("--seqlens", help="comma-separated N (default: 1024,...,16384; batch = 16384/N)")
    ap.add_argument("--no-checks", action="store_true", help="skip the pytest checks")
    ap.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per (implementation, N)")
    ap.add_argument("--readme", choices=["auto", "yes", "no"], default="auto",
                    help="regenerate the README table (auto: only after a run of every step at every N)")
    ap.add_argument("--report", metavar="RESULTS_JSON",
                    help="no GPU work: regenerate the README table and results/latest.png from a results file")
    ap.add_argument("--update-steps-table", action="store_true",
                    help="no GPU work: regenerate the README's list of steps from steps/*/kernel.cu")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel nvcc builds")
    args = ap.parse_args(argv)

    from verify import bench, report
    if args.report:
        return regenerate(Path(args.report))
    if args.update_steps_table:
        return 0 if report.update_readme(ROOT / "README.md", None, None) else 1
    steps = steps_mod.select(args.steps)
    seqlens = [int(x) for x in args.seqlens.split(",")] if args.seqlens else bench.SEQLENS_OF_RECORD
    out_env = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    t_start = time.time()

    log(f"[1/4] building {len(steps)} step(s) with nvcc (sm_90a): {', '.join(steps)}")
    ptxas = steps_mod.build(steps, jobs=args.jobs, log=lambda m: log(m))
    for s in steps:
        for kernel, res in ptxas[s].items():
            log(f"  {s} {kernel}: {res.get('registers')} registers, {res.get('spill_stores', 0)}+{res.get('spill_loads', 0)} "
                f"spill bytes, {res.get('stack_frame', 0)} B stack")

    import torch
    checks_code, checks = 0, {s: "not run" for s in steps}
    if not args.no_checks:
        log("[2/4] checking every step (pytest verify/tests)")
        checks_code, checks = run_checks(steps, out_env)
    else:
        log("[2/4] checks skipped (--no-checks)")

    if args.no_bench or not torch.cuda.is_available():
        log("[3/4] benchmark skipped" + ("" if args.no_bench else ": no CUDA GPU on this machine"))
        return checks_code

    log(f"[3/4] benchmarking {len(steps)} step(s) and torch SDPA at N = {', '.join(map(str, seqlens))}")
    meta = gpu_meta()
    impls = {s: steps_mod.load(s).attention for s in steps if checks.get(s) != "FAILED"}
    timing = bench.run(impls, seqlens, budget_s=args.budget, log=log)
    meta["clocks_after"] = smi().get("clocks", {})

    log("[4/4] writing results")
    gpu_slug = re.sub(r"[^a-z0-9]+", "-", meta["gpu"].lower().replace("nvidia", "")).strip("-") or "gpu"
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
    res_dir = ROOT / "results" / gpu_slug
    res_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = res_dir / f"{stamp}.json", res_dir / f"{stamp}.png"
    run = {"path": str(json_path.relative_to(ROOT)), "meta": meta, "steps": steps, "seqlens": seqlens,
           "checks": checks, "ptxas": ptxas, "timings": timing["timings"], "unavailable": timing["unavailable"],
           "argv": sys.argv[1:], "seconds": round(time.time() - t_start, 1)}
    json_path.write_text(json.dumps(run, indent=1, default=str))
    report.chart(run, png_path)
    full = steps == steps_mod.all_steps() and seqlens == bench.SEQLENS_OF_RECORD and not args.no_checks
    if args.readme == "yes" or (args.readme == "auto" and full):
        shutil.copyfile(png_path, ROOT / "results" / "latest.png")
        if report.update_readme(ROOT / "README.md", report.markdown_table(run), "results/latest.png"):
            log("  README.md results table regenerated")
    if out_env:
        for p in (json_path, png_path):
            shutil.copyfile(p, out_env / p.name)
    log(f"  wrote {json_path.relative_to(ROOT)} and {png_path.name}")
    log("")
    log(report.console_table(run))
    failed = [s for s, c in checks.items() if c == "FAILED"]
    if failed:
        log(f"\nCHECKS FAILED for {', '.join(failed)} (not benchmarked); see the pytest output above")
    return checks_code


def regenerate(json_path: Path) -> int:
    """README table + results/latest.png from a results file a GPU run wrote (and that is committed)."""
    from verify import report
    run = report.load(json_path)
    report.chart(run, ROOT / "results" / "latest.png")
    ok = report.update_readme(ROOT / "README.md", report.markdown_table(run), "results/latest.png")
    log(report.console_table(run))
    log(f"README.md {'regenerated' if ok else 'has no results markers'}; chart: results/latest.png")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
