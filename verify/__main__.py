"""python -m verify: build every step, check it, benchmark it beside torch SDPA, write the results.

    python -m verify                       # everything: all steps, all shapes of record
    python -m verify --steps 5-6 --seqlens 4096,16384
    python -m verify --no-bench            # build + checks only
    python -m verify --no-checks           # build + benchmark only
    python -m verify --no-causal           # without the causal table (step15 on: causal and GQA at N = 4K/8K/16K)
    python -m verify --no-breadth          # without the breadth tables (step40 on: fp16; step41 on: head dim 64)
    python -m verify --out DIR             # also write the log, the checks' junit XML and the results to DIR
    python -m verify --ptx-jit             # checks of steps 01-07 built as their PTX alone, compiled by the driver

Runs without nox (the GPU machine has no network). What it lacks here (torch, the other requirements, a GPU)
it says first, in one line, before building anything. The kernel checks of each step run in a process of their
own with a time limit (--check-timeout): a kernel that hangs (a wrong mbarrier phase never completes) fails its
step, the process is killed, and the run goes on with the next step; a step that failed is not benchmarked. The
tests that need no GPU (every step's build, SASS, trace points and bad input; the step-free tests) run once, beside
them, a test file a process. Each skip reason is said once; each step's end says about how long the rest of the
checks take.
A step that the GPU here cannot run (the Hopper steps need an sm_90 GPU; the portable ones, any GPU since sm_80) is
said so, in one line, and neither checked nor benchmarked.
Writes results/<gpu>/<timestamp>.json and .png, regenerates the README table after a full run, and prints a
short table last.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from verify import machine, runner
from verify import steps as steps_mod
from verify.log import log

ROOT = steps_mod.ROOT
PROG = "python -m verify"
# What this process and its check processes import (requirements-verify.txt installs them; test_packaging keeps the two agreed).
NEEDS = ("torch", "numpy", "matplotlib", "pytest", "hypothesis")


def main(argv=None) -> int:
    ap = steps_mod.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=steps_mod.steps_arg, help="e.g. 1-6, step03, 2,5 (default: every step under steps/)")
    ap.add_argument("--seqlens", type=steps_mod.seqlens_arg, help="comma-separated N (default: 1024,...,16384; batch = 16384/N)")
    ap.add_argument("--no-checks", action="store_true", help="skip the pytest checks (a hung kernel then hangs the benchmark)")
    ap.add_argument("--no-bench", action="store_true", help="skip the benchmark (without a GPU: build, and run the checks that need none)")
    ap.add_argument("--no-backward", action="store_true",
                    help="skip the benchmark's backward table (the last step with a backward and SDPA cuDNN's and FLASH's "
                         "backward, dense and causal, at N = 4K/8K/16K)")
    ap.add_argument("--no-breadth", action="store_true",
                    help="skip the benchmark's breadth tables (the last step that takes fp16 or head dim 64, SDPA cuDNN "
                         "and FA3 given the same, dense and causal, at N = 4K/8K/16K: 18 cells, about 40 s, per table)")
    ap.add_argument("--no-causal", action="store_true",
                    help="skip the benchmark's causal table (the last step that takes causal masks, SDPA cuDNN and FA3, "
                         "causal and with Llama-3-8B's grouped heads, at N = 4K/8K/16K: 18 cells, about 40 s)")
    ap.add_argument("--check-timeout", type=float, default=300, metavar="SECONDS",
                    help="time limit for the checks of one step, then its process is killed (default: %(default)s)")
    ap.add_argument("--check-jobs", type=int, default=4, metavar="N",
                    help="check N steps side by side, each in its own process (default: %(default)s; 1 streams the output)")
    ap.add_argument("--tests", type=Path, default=runner.TESTS, help="the tests to run as checks (default: verify/tests)")
    ap.add_argument("--ptx-jit", action="store_true",
                    help="build each step as its portable PTX alone (no SASS; steps with PTX only, by default all of them) "
                         "into build/ptx-jit, so that the driver compiles it at load, and check that code: on an H100/H200, "
                         "the code path of a GPU with no SASS of its own in the library. Checks only: no benchmark, and "
                         "the step-free tests are not run")
    ap.add_argument("--out", type=Path, metavar="DIR",
                    help="also write verify.log, the checks' junit XML (checks/) and a copy of the results JSON/PNG here")
    from verify.bench import add_timing_args  # --warmup, --window, ...: defined beside the timer they set
    add_timing_args(ap)
    ap.add_argument("--readme", choices=["auto", "yes", "no"], default="auto",
                    help="regenerate the README table (auto: only after a run of every step at every N)")
    ap.add_argument("--report", metavar="RESULTS_JSON",
                    help="no GPU work: regenerate the README table and results/latest.png from a results file "
                         "(with --steps: only those of its steps)")
    ap.add_argument("--update-steps-table", action="store_true",
                    help="no GPU work: regenerate the README's list of steps from steps/*/kernel.cu")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel nvcc builds")
    args = ap.parse_args(argv)
    if args.check_timeout <= 0:
        ap.error(f"argument --check-timeout: must be positive, not {args.check_timeout:g}")
    if args.check_jobs < 1:
        ap.error(f"argument --check-jobs: must be at least 1, not {args.check_jobs}")
    if not args.tests.exists():
        ap.error(f"argument --tests: {args.tests} does not exist")
    if args.report and not Path(args.report).is_file():
        ap.error(f"argument --report: {args.report} is not a file")
    if args.ptx_jit:
        args.no_bench = True  # the checks of that code; the benchmark times the steps as they are installed
        args.steps = args.steps or steps_mod.portable_steps()
        if without := [s for s in args.steps if s not in steps_mod.portable_steps(args.steps)]:
            ap.error(f"argument --ptx-jit: {', '.join(without)} embed(s) no PTX (built for sm_90a alone); the steps with "
                     f"PTX are {steps_mod.numbers_in_words(steps_mod.portable_steps())}")
        os.environ[steps_mod.PTX_JIT] = "1"  # for this process's build and, inherited, for each check process
        steps_mod.DEV = steps_mod.dev_dir()

    from verify import report
    if args.report:
        return regenerate(Path(args.report), args.steps)
    if args.update_steps_table:
        return 0 if report.update_readme(ROOT / "README.md", None, None) else 1
    # What is missing here is said first, in one line: before the minutes that building every step takes.
    if why := steps_mod.missing_modules_reason(NEEDS):
        raise SystemExit(f"{PROG}: error: {why}")
    if not args.no_bench and (why := steps_mod.no_gpu_reason()):
        raise SystemExit(f"{PROG}: error: {why} (--no-bench: build, and run the checks that need no GPU)")
    if not args.out:
        return run(args)
    (args.out / "checks").mkdir(parents=True, exist_ok=True)
    with log.to(args.out / "verify.log"):
        return run(args)


def stage_labels(args) -> dict[str, str]:
    """'[i/n]' for each stage that this run has (--no-checks, --no-bench leave theirs out), in the order it runs them."""
    names = ["build", *([] if args.no_checks else ["checks"]), *([] if args.no_bench else ["bench", "write"])]
    return {name: f"[{i}/{len(names)}]" for i, name in enumerate(names, 1)}


def run(args) -> int:
    """Build, check, benchmark, write: the whole job (main() has read the command line)."""
    from verify import backward_timing, bench, report
    steps = args.steps or steps_mod.all_steps()
    seqlens = args.seqlens or bench.SEQLENS_OF_RECORD
    out, junit_dir = args.out, (args.out / "checks" if args.out else None)
    tests = args.tests.resolve()
    t_start = time.time()
    if not args.no_checks and (why := steps_mod.no_gpu_reason()):  # (main() refused a benchmark without a GPU)
        log(f"{PROG}: {why}: the checks that need a GPU are skipped")
    stage = stage_labels(args)
    log(f"{stage['build']} building {len(steps)} step(s) with nvcc: {targets_in_words(steps)}")
    try:
        ptxas = steps_mod.build(steps, jobs=args.jobs, log=lambda m: log(m))
    except RuntimeError as e:  # nvcc's own message says what is wrong
        log(str(e))
        log(f"{PROG}: error: a step did not build (nvcc's output above)")
        return 1
    for s in steps:
        for line in resources_in_words(s, ptxas[s]):
            log(f"  {line}")

    checks, others = {s: "not run" for s in steps}, "not run"
    skipped = {}  # steps that this GPU cannot run: neither checked nor benchmarked
    if steps_mod.no_gpu_reason() is None:
        import binding  # common/binding (on sys.path through verify.steps)
        device = binding.device_props(0)
        skipped = steps_mod.unrunnable(steps, device)
        for s, why in skipped.items():
            log(f"  {s}: not run on this GPU ({device.name}, {device.sm}): {why}")
            checks[s] = f"not run ({device.sm})"
    runnable = [s for s in steps if s not in skipped]
    if not args.no_checks and not runnable:
        log(f"{PROG}: no selected step runs on this GPU")
    elif not args.no_checks:
        shown = tests.relative_to(ROOT) if tests.is_relative_to(ROOT) else tests
        from verify.checks import run_seed  # one seed for every step's process: the same inputs, replayed by it
        jit = " (their PTX alone, compiled by the driver at load: FLASHLADDER_PTX_JIT=1)" if steps_mod.ptx_jit() else ""
        ours = tests == runner.TESTS.resolve()  # verify/tests: each step's process runs its kernel checks alone
        what = ("each step's kernel checks in a process of its own, the tests that need no GPU (every step's build, SASS, "
                "trace points, bad input; the step-free tests) beside them, a test file a process" if ours and not steps_mod.ptx_jit()
                else "each in a process of its own")
        log(f"{stage['checks']} checking {len(runnable)} step(s){jit} ({shown}), {what}, {args.check_jobs} at a time; "
            f"random inputs from FLASHLADDER_SEED={run_seed()}")
        with ThreadPoolExecutor(max_workers=1) as side:  # the step-free tests run beside the steps' checks
            # (not with --ptx-jit: they test no step's build)
            skips = runner.Skips()  # each reason said once, after all of them
            others_future = None if steps_mod.ptx_jit() else side.submit(
                runner.check_others, steps, runner.OTHERS_TIMEOUT_FACTOR * args.check_timeout, junit_dir, tests, log, False,
                skips, gpu_only=ours, jobs=runner.others_jobs() if ours else 1)
            checks |= runner.check_steps(runnable, args.check_timeout, junit_dir, tests, jobs=args.check_jobs, skips=skips,
                                         times=runner.times_file() if ours else None, gpu_only=ours)
            others = others_future.result() if others_future else "not run (--ptx-jit)"
        for line in skips.lines():
            log(line)
        log("  " + ", ".join(f"{s} {v}" for s, v in checks.items()) + f"; other tests {others}")
    failed = [s for s, v in checks.items() if v.startswith("FAILED")]
    code = 1 if failed or others.startswith("FAILED") else 0
    if args.no_bench:
        return code

    log(f"{stage['bench']} benchmarking {len(steps)} step(s) and torch SDPA at N = {', '.join(map(str, seqlens))}")
    meta = machine.gpu_meta()
    timed = {s: steps_mod.load(s) for s in runnable if s not in failed}  # a hung or wrong kernel is not timed
    impls = {s: m.attention for s, m in timed.items()}
    causal = None if args.no_causal else causal_step(timed)
    if causal:
        log(f"  causal table: {causal.name} at N = {', '.join(map(str, bench.causal_seqlens(seqlens))) or '(none of this run)'}")
    breadth = None if args.no_breadth else breadth_step(timed)
    if breadth:
        log(f"  breadth tables: {breadth.name}, {', '.join(breadth.tables)}, dense and causal, at N = "
            f"{', '.join(map(str, bench.causal_seqlens(seqlens))) or '(none of this run)'}")
    timing = bench.run(impls, seqlens, timing=bench.timing_from_args(args), log=log, causal=causal, breadth=breadth)
    with_backward = [s for s, m in timed.items() if m.info.get("backward")]
    bwd_seqlens = backward_timing.backward_seqlens(seqlens)
    if with_backward and bwd_seqlens and not args.no_backward:  # the last step with a backward, beside SDPA's
        log(f"  backward table: {with_backward[-1]} at N = {', '.join(map(str, bwd_seqlens))}, dense and causal")
        timing["backward"] = backward_timing.run({with_backward[-1]: timed[with_backward[-1]]}, bwd_seqlens,
                                          bench.timing_from_args(args), log=log)
    meta["clocks_after"] = machine.smi().get("clocks", {})

    log(f"{stage['write']} writing results")
    gpu_slug = machine.results_folder(meta["gpu"])
    stamp = machine.utc_stamp()
    res_dir = ROOT / "results" / gpu_slug
    res_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = res_dir / f"{stamp}.json", res_dir / f"{stamp}.png"
    run = {"path": str(json_path.relative_to(ROOT)), "meta": meta, "steps": steps, "seqlens": seqlens,
           "checks": checks, "checks_other_tests": others, "ptxas": ptxas, **timing,
           "argv": sys.argv[1:], "seconds": round(time.time() - t_start, 1)}
    json_path.write_text(json.dumps(run, indent=1, default=str))
    report.chart(run, png_path)
    full = (steps == steps_mod.all_steps() and seqlens == bench.SEQLENS_OF_RECORD and not args.no_checks and not failed
            and not skipped and not args.no_causal and not args.no_breadth)
    if args.readme == "yes" or (args.readme == "auto" and full):
        shutil.copyfile(png_path, ROOT / "results" / "latest.png")
        if report.update_readme(ROOT / "README.md", report.markdown_table(run), "results/latest.png"):
            log("  README.md results table regenerated")
        if report.update_readme_backward(ROOT / "README.md", run):
            log("  README.md backward table regenerated")
    if out:
        for p in (json_path, png_path):
            shutil.copyfile(p, out / p.name)
    log(f"  wrote {json_path.relative_to(ROOT)} and {png_path.name}" + (f" (copies in {out})" if out else ""))
    log("")
    log(report.console_table(run))
    if run.get("backward"):
        log("\n" + report.backward_console_table(run))
    if failed:
        log(f"\nCHECKS FAILED for {', '.join(failed)} (not benchmarked); see the pytest output above")
    return code


def breadth_step(modules: dict):
    """The breadth tables' step (bench.BreadthStep): the last of `modules` ({step: module}) that takes more than bf16
    at head dim 128 (info["dtypes"], info["head_dims"]), with the tables it takes, or None where none does."""
    from verify import bench

    def tables(m):
        return (*(("fp16",) if "float16" in m.info.get("dtypes", []) else ()),
                *(("hdim64",) if 64 in m.info.get("head_dims", []) else ()))
    takes = [(s, m) for s, m in modules.items() if tables(m)]
    if not takes:
        return None
    step, mod = takes[-1]
    return bench.BreadthStep(step, mod.attention, tables(mod))


def causal_step(modules: dict):
    """The causal table's step (bench.CausalStep): the last of `modules` ({step: module}) whose info["causal"] is
    true, or None where none is."""
    from verify import bench
    takes = [(s, m) for s, m in modules.items() if m.info.get("causal")]
    if not takes:
        return None
    step, mod = takes[-1]
    return bench.CausalStep(step, mod.attention, bool(mod.info.get("gqa")))


def targets_in_words(steps: list[str]) -> str:
    """What the build makes of each group of steps: 'steps 01-07: SASS sm_80, ..., PTX compute_80; steps 08-14: SASS sm_90a'."""
    groups: dict[tuple, list[str]] = {}
    for s in steps:
        t = steps_mod.targets(s)
        groups.setdefault((tuple(t.sass()), tuple(t.ptx())), []).append(s)
    parts = []
    for (sass, ptx), members in groups.items():
        what = [f"SASS for {', '.join(sass)}"] if sass else []
        what += [f"{', '.join(ptx)} PTX" + ("" if sass else " alone, compiled by the driver at load")] if ptx else []
        parts.append(f"{steps_mod.numbers_in_words(members)}: {' + '.join(what)}")
    return "; ".join(parts)


def resources_in_words(step: str, report: dict) -> list[str]:
    """One line per kernel of the step: registers, spills and stack on each architecture (identical ones grouped)."""
    if not report:
        return [f"{step}: no SASS (PTX alone: ptxas runs in the driver, at load)"]
    kernels: dict[str, dict[tuple, list[str]]] = {}
    for arch, found in report.items():
        for kernel, res in found.items():
            key = (res.get("registers"), res.get("spill_stores", 0), res.get("spill_loads", 0), res.get("stack_frame", 0))
            kernels.setdefault(kernel, {}).setdefault(key, []).append(arch)
    return [f"{step} {kernel}: " + "; ".join(f"{', '.join(archs)}: {regs} registers, {st}+{ld} spill bytes, {stack} B stack"
                                             for (regs, st, ld, stack), archs in by_resources.items())
            for kernel, by_resources in kernels.items()]


def regenerate(json_path: Path, steps: list[str] | None = None) -> int:
    """README table + results/latest.png from a results file a GPU run wrote (and that is committed); `steps`: only
    those of its steps (where the others' kernels changed since the run)."""
    from verify import report
    run = report.load(json_path)
    if steps:
        run = report.only_steps(run, steps)
    report.chart(run, ROOT / "results" / "latest.png")
    ok = report.update_readme(ROOT / "README.md", report.markdown_table(run), "results/latest.png")
    log(report.console_table(run))
    log(f"README.md {'regenerated' if ok else 'has no results markers'}; chart: results/latest.png")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
