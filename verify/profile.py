"""Nsight Compute side by side: one call of each kernel under ncu, the counters that say where the work per clock goes.

    python -m verify.profile --impls step14,fa3 --shape 2,16,8192 --out DIR
    python -m verify.profile --impls step15,fa3 --shape 2,32,8192 --heads-k 8 --causal top_left

Each implementation is profiled in a process of its own: it runs a few calls (lazy set-up, warm caches), then one
call between cudaProfilerStart/Stop, the only one ncu records (--profile-from-start off). The clocks are left as
they are (--clock-control none): the card runs at its own, power-capped clock, as in the benchmark. The table counts
per call and per K/V block of 128 x 128 (batch x heads x (N/128)^2 of them, whatever each kernel's own tiles are;
causal: the blocks on and below the diagonal), so kernels with other tiles compare per unit of work. The SMs' active
cycles, their least, mean and most, say how evenly the kernel spreads its work over the SMs: the mean over the most
is the share of the call the average SM works. The raw CSV of every counter ncu collected is written beside it.
Needs ncu on PATH (or NCU=...) and a GPU; an implementation that is not installed (fa3) is left out, with the reason.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PROG = "python -m verify.profile"
# (what, ncu metric): per call unless the name says otherwise; the ones this ncu does not know are left out
METRICS = [
    ("elapsed SM cycles (max over SMs)", "sm__cycles_elapsed.max"),
    ("SM active cycles, least SM", "sm__cycles_active.min"),
    ("SM active cycles, mean", "sm__cycles_active.avg"),
    ("SM active cycles, most", "sm__cycles_active.max"),
    ("instructions executed", "smsp__inst_executed.sum"),
    ("  uniform datapath", "smsp__inst_executed_pipe_uniform.sum"),
    ("  ALU pipe", "smsp__inst_executed_pipe_alu.sum"),
    ("  FMA pipe", "smsp__inst_executed_pipe_fma.sum"),
    ("    of it FMA-heavy", "smsp__inst_executed_pipe_fmaheavy.sum"),
    ("  XU pipe (MUFU)", "smsp__inst_executed_pipe_xu.sum"),
    ("  tensor pipe (wgmma)", "sm__inst_executed_pipe_tensor_op_gmma.sum"),
    ("issue slots busy, % of active", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("shared-memory wavefronts", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"),
    ("L2 bytes", "lts__t_bytes.sum"),
    ("HBM bytes read", "dram__bytes_read.sum"),
    ("HBM bytes written", "dram__bytes_write.sum"),
]
STALLS = ["barrier", "branch_resolving", "dispatch_stall", "drain", "lg_throttle", "long_scoreboard", "math_pipe_throttle",
          "membar", "mio_throttle", "misc", "no_instruction", "not_selected", "selected", "short_scoreboard", "sleeping",
          "tex_throttle", "wait"]
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
PER_CALL = {"smsp__issue_active.avg.pct_of_peak_sustained_active", "sm__cycles_active.min", "sm__cycles_active.avg",
            "sm__cycles_active.max"}


def one_call(impl: str, shape: tuple[int, int, int], heads_k: int, causal, warm: int = 5) -> None:
    """The profiled process: `warm` calls, then one call between cudaProfilerStart and Stop. causal: False, or the
    diagonal's corner as the steps take it ("top_left", "bottom_right")."""
    import torch

    from verify import bench, steps
    batch, heads, n = shape
    q = torch.randn(batch, heads, n, 128, device="cuda").add_(0.5).to(torch.bfloat16)
    k, v = (torch.randn(batch, heads_k, n, 128, device="cuda").add_(0.5).to(torch.bfloat16) for _ in range(2))
    if impl == "fa3":
        fa3, why = bench.fa3_attention()
        if fa3 is None:
            raise SystemExit(f"{PROG}: fa3 {why}")
        qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
        fn = lambda: fa3(qt, kt, vt, causal=causal)  # noqa: E731
    elif impl in bench.SDPA_BACKENDS:
        # seqlen_q = seqlen_k here, where SDPA's is_causal is the top-left diagonal, and so both corners' one
        fn = bench.sdpa_fn(bench.SDPA_BACKENDS[impl], q, k, v, is_causal=bool(causal), enable_gqa=heads_k != heads)
    else:
        attention = steps.load(impl).attention
        fn = (lambda: attention(q, k, v, causal=causal)) if causal or heads_k != heads else (lambda: attention(q, k, v))
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def work_blocks(batch: int, heads: int, n: int, causal: bool) -> float:
    """The 128 x 128 blocks of S a call computes: all (N/128)^2 per head, or causal (seqlen_q = seqlen_k), those on and
    below the diagonal, t (t + 1) / 2 for t = N/128 (a block the diagonal crosses counts whole)."""
    t = n / 128
    return batch * heads * (t * (t + 1) / 2 if causal else t * t)


def known_metrics(ncu: str) -> set[str]:
    out = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip() and not line.startswith(("-", "Device", "Metric"))}


def profile(ncu: str, impl: str, shape, metrics: list[str], raw_csv: Path, heads_k: int | None = None,
            causal: str | None = None) -> dict:
    """ncu on one call of impl; {metric: value} of its largest kernel (by cycles), or {"error": ...}."""
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
           "--metrics", ",".join(metrics), sys.executable, "-m", "verify.profile", "--one", impl,
           "--shape", ",".join(map(str, shape))]
    cmd += ["--heads-k", str(heads_k)] if heads_k else []
    cmd += ["--causal", causal] if causal else []
    res = subprocess.run(cmd, capture_output=True, text=True)
    raw_csv.write_text(res.stdout + ("\n# stderr\n" + res.stderr if res.stderr else ""))
    parsed = parse_ncu_csv(res.stdout, metrics)
    if res.returncode != 0 or parsed is None:
        return {"error": (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"ncu exited {res.returncode}"]}
    return parsed


def parse_ncu_csv(text: str, metrics: list[str]) -> dict | None:
    """ncu's `--csv --page raw` output -> {metric: value} of the kernel with the most cycles, its name and how many
    kernels the call launched; None if the text holds no kernel."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if len(lines) < 3:
        return None
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))[1:]  # the second row holds the units

    def num(x):
        try:
            return float(str(x).replace(",", ""))
        except ValueError:
            return None
    kernels = [r for r in rows if num(r.get("sm__cycles_elapsed.max")) is not None]
    if not kernels:
        return None
    main = max(kernels, key=lambda r: num(r["sm__cycles_elapsed.max"]))
    out = {m: num(main.get(m)) for m in metrics}
    out["kernel"] = main.get("Kernel Name", "")
    out["kernels_in_call"] = len(kernels)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", default="step14,fa3", help="comma-separated: steps, sdpa_cudnn, fa3 (default: %(default)s)")
    ap.add_argument("--shape", default="2,16,8192", help="batch,heads,N (default: %(default)s)")
    ap.add_argument("--heads-k", type=int, help="key/value heads, a divisor of heads (default: heads)")
    ap.add_argument("--causal", choices=["top_left", "bottom_right"], help="a causal mask from this corner (default: none)")
    ap.add_argument("--out", type=Path, help="folder for the JSON and the raw CSVs (default: build/profile)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the profiled process
    args = ap.parse_args(argv)
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        ap.error(f"--shape takes batch,heads,N, got {args.shape!r}")
    heads_k = shape[1] if args.heads_k is None else args.heads_k
    if heads_k < 1 or shape[1] % heads_k:
        ap.error(f"--heads-k must divide the {shape[1]} heads, got {heads_k}")
    if args.one:
        one_call(args.one, shape, heads_k, args.causal or False)
        return 0
    ncu = os.environ.get("NCU") or shutil.which("ncu")
    if not ncu:
        raise SystemExit(f"{PROG}: error: ncu not found (put Nsight Compute on PATH or set NCU=...)")
    out = args.out or Path(__file__).resolve().parent.parent / "build" / "profile"
    out.mkdir(parents=True, exist_ok=True)
    known = known_metrics(ncu)
    wanted = [m for _, m in METRICS] + [STALL_METRIC.format(s) for s in STALLS]
    metrics = [m for m in wanted if m.split(".")[0] in known or not known]
    left_out = sorted(set(wanted) - set(metrics))
    if left_out:
        print(f"  this ncu does not know: {', '.join(left_out)}", file=sys.stderr)
    batch, heads, n = shape
    blocks = work_blocks(batch, heads, n, bool(args.causal))  # 128 x 128 blocks of S: the unit of work the table counts per
    what_ran = f"{batch} x {heads} x {n}" + (f", {heads_k} K/V heads" if heads_k != heads else "") + (
        f", causal from the {args.causal.replace('_', ' ')}" if args.causal else "")
    results = {}
    for impl in args.impls.split(","):
        print(f"  ncu: {impl} at {what_ran} ...", file=sys.stderr, flush=True)
        results[impl] = profile(ncu, impl, shape, metrics, out / f"ncu-{impl}.csv", heads_k if heads_k != heads else None,
                                args.causal)
    names = list(results)
    width = max(len(w) for w, _ in METRICS) + 2
    lines = [f"ncu, one call each, {what_ran}, bf16, d = 128 (per call; per 128 x 128 block in brackets)",
             f"{'':<{width}}" + "".join(f"{x:>26}" for x in names)]
    for what, m in [*METRICS, *((f"stall {s} (warps per issue)", STALL_METRIC.format(s)) for s in STALLS)]:
        if m not in metrics:
            continue
        cells = []
        for x in names:
            v = results[x].get(m)
            if v is None:
                cells.append(f"{'-':>26}")
            elif m in PER_CALL or m.startswith("smsp__average_warps"):
                cells.append(f"{v:>26.3g}" if m.startswith("smsp__average") else f"{v:>26,.4g}")
            else:
                cells.append(f"{v:>14.4g} [{v / blocks:>9.1f}]")
        lines.append(f"{what:<{width}}" + "".join(cells))
    for x in names:
        lines.append(f"{x}: {results[x].get('kernel') or results[x].get('error')}")
    table = "\n".join(lines)
    print(table)
    (out / "profile.json").write_text(json.dumps({"shape": shape, "heads_k": heads_k, "causal": args.causal, "results": results,
                                                  "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
