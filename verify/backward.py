"""python -m verify.backward: the backward pass alone, timed beside SDPA's backends, in one sustained run.

    python -m verify.backward                          # the steps with a backward, N = 4K, 8K, 16K, dense and causal
    python -m verify.backward --steps 23 --seqlens 1024 --no-causal
    python -m verify.backward --report FILE            # no GPU: the README's backward table from a results file

What is timed and how: verify/backward_timing.py. Writes results/<gpu>/backward-<UTC>.json and prints a table last.
Checks are verify/tests/test_backward_gpu.py's (python -m verify runs them with every step's).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from verify import bench, machine, report
from verify import steps as steps_mod
from verify.backward_timing import SEQLENS, run, steps_with_backward

PROG = "python -m verify.backward"
def main(argv=None) -> int:
    ap = steps_mod.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=steps_mod.steps_arg, default=None, help="e.g. 23 (default: every step with a backward)")
    ap.add_argument("--seqlens", type=steps_mod.seqlens_arg, default=SEQLENS, help="comma-separated N (default: %(default)s)")
    ap.add_argument("--no-causal", action="store_true", help="dense calls only")
    ap.add_argument("--report", metavar="RESULTS_JSON", type=Path,
                    help="no GPU work: regenerate the README's backward table from a results file of this command")
    bench.add_timing_args(ap)
    args = ap.parse_args(argv)
    if args.report:
        return report_to_readme(ap, args.report)
    with_backward = steps_with_backward()
    steps = [s for s in (args.steps or with_backward) if s in with_backward]
    if not steps:
        ap.error(f"no selected step has a backward (the steps with one: {', '.join(with_backward) or 'none'})")
    if why := steps_mod.missing_modules_reason() or steps_mod.no_gpu_reason():
        ap.error(why)
    steps_mod.build(steps, log=print)
    table = run({s: steps_mod.load(s) for s in steps}, args.seqlens, bench.timing_from_args(args), causal=not args.no_causal)
    meta = machine.gpu_meta()
    out = steps_mod.ROOT / "results" / machine.results_folder(meta["gpu"]) / f"backward-{machine.utc_stamp()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "argv": sys.argv[1:], "backward": table}, indent=1))
    print(f"\nwrote {out.relative_to(steps_mod.ROOT)} (the README's table: {PROG} --report {out.relative_to(steps_mod.ROOT)})\n")
    print(report.backward_console_table({"backward": table}))
    return 0


def report_to_readme(ap, path: Path) -> int:
    """--report: the README's backward table from a results file, no GPU work."""
    try:
        run = report.load(path)
    except (OSError, ValueError) as e:
        ap.error(f"cannot read {path}: {e}")
    if not report.backward_rows(run):
        ap.error(f"{path} holds no backward timings")
    run["path"] = str(path.resolve().relative_to(steps_mod.ROOT)) if path.resolve().is_relative_to(steps_mod.ROOT) else str(path)
    if not report.update_readme_backward(steps_mod.ROOT / "README.md", run):
        ap.error(f"README.md has no {report.BACKWARD_BEGIN} ... {report.BACKWARD_END} section to fill")
    print(report.backward_console_table(run))
    print("README.md backward table regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
