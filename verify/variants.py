"""Try ideas before they become steps: build kernel variants, check them, time them side by side.

    python -m verify.variants build/exp/v1 build/exp/v2 --steps 6 --seqlens 4096,16384

Each variant folder holds a kernel.cu (e.g. a copy of steps/step06/kernel.cu with one change); its
folder name becomes its name. Steps given with --steps run beside them as baselines. One correctness
check per variant (the same rules as the tests), then the median time at each N, and a table last: TFLOP/s,
the SM clock and board power of the timed window, and TFLOP/s per GHz (on a GPU at its power limit a change
can win per clock and lose the clock). A folder named diag_* is a diagnostic build, wrong on purpose (a copy
that skips the loads, say): it is timed, not checked. Each variant is built by build_step.compile_step, the
steps' own build, into build/dev/flashladder/<name>/.

The variants behind NOTES.md's experiments (the wait ptxas moved, step14's diagnostics, TMA multicast) were
text patches of the kernels of their day; they live in the git history, with how to rebuild each:
`git show 3c57885:notes/variants/README.md`.
"""
import shutil
import sys
from pathlib import Path

from verify import steps as steps_mod

PROG = "python -m verify.variants"


def build_variant(folder: Path):
    name = folder.name.replace("-", "_")
    pkg = folder / "pkg"
    if not (pkg / "__init__.py").exists():
        pkg.mkdir(exist_ok=True)
        shutil.copyfile(steps_mod.ROOT / "steps" / "step01" / "pkg" / "__init__.py", pkg / "__init__.py")
    steps_mod.build_step.compile_step(folder, steps_mod.DEV / "flashladder" / name)
    return name, steps_mod.ptxas_of(name)


def cell_text(c: dict) -> str:
    """TFLOP/s, SM clock, board power and TFLOP/s per GHz of one timed cell (clock or power may be unknown)."""
    mhz, watts = c.get("sm_mhz_median"), c.get("power_w_median")
    per_ghz = f"{c['tflops'] / mhz * 1e3:5.1f}/GHz" if mhz else f"{'-':>9}"
    return (f"{c['tflops']:8.1f} TF" + (f" {mhz:5.0f} MHz" if mhz else f"{'':>10}")
            + (f" {watts:4.0f} W" if watts else f"{'':>7}") + f" {per_ghz}")


def main(argv=None) -> int:
    ap = steps_mod.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="*", type=Path, help="variant folders, each with a kernel.cu")
    ap.add_argument("--steps", type=steps_mod.steps_arg, help="baseline steps, e.g. 5-6")
    ap.add_argument("--seqlens", type=steps_mod.seqlens_arg, default=[4096, 16384], help="comma-separated N (default: 4096,16384)")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per (implementation, N)")
    args = ap.parse_args(argv)
    if not args.folders and not args.steps:
        ap.error("nothing to run: give variant folders and/or --steps")
    for folder in args.folders:
        if not (folder / "kernel.cu").is_file():
            ap.error(f"{folder} has no kernel.cu")
    if why := steps_mod.no_gpu_reason():
        raise SystemExit(f"{PROG}: error: {why}")
    import torch

    from verify import bench
    from verify.checks import make_inputs, measure_errors
    names = []
    if args.steps:
        steps_mod.build(args.steps)
        names += args.steps
    for folder in args.folders:
        name, report = build_variant(folder)
        print(f"built {name}: {report}", flush=True)
        names.append(name)
    impls, errors = {}, {}
    for name in names:
        mod = steps_mod.load(name)
        if name.startswith("diag_"):
            errors[name], impls[name] = "diag", mod.attention
            print(f"{name}: a diagnostic build, not checked", flush=True)
            continue
        q, k, v = make_inputs(2, 4, 1024, 1024)
        err = measure_errors(mod, q, k, v)
        errors[name] = "ok" if not err.failures() else "; ".join(err.failures())
        print(f"{name}: {errors[name]}  (O rel {err.o_rel_frob:.2e}, LSE {err.lse_max_abs:.2e})", flush=True)
        if errors[name] == "ok":
            impls[name] = mod.attention
    seqlens = args.seqlens
    res = bench.run(impls, seqlens, budget_s=args.budget)["timings"]
    print(f"\n{'':<22}" + "".join(f"{f'N={n}':>34}" for n in seqlens))
    for name in [*names, *bench.SDPA_BACKENDS, *bench.PEERS]:
        cells = [res.get(name, {}).get(n) for n in seqlens]
        print(f"{name:<22}" + "".join(cell_text(c) if c else f"{'-':>34}" for c in cells)
              + {"ok": "", "diag": "  (diagnostic)"}.get(errors.get(name, "ok"), "  CHECK FAILED"))
    print(f"GPU: {torch.cuda.get_device_name(0)}")
    return 0 if all(e in ("ok", "diag") for e in errors.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
