"""Scratch experiment: build variant folders, check the non-diagnostic ones, time all in steady state.
python notes/variants/exp.py [--seqlens 4096,16384] [--steps 14] .scratch/var/a .scratch/var/b ..."""
import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from verify import bench, variants
from verify import steps as steps_mod

ap = argparse.ArgumentParser()
ap.add_argument("folders", nargs="*", type=Path)
ap.add_argument("--seqlens", default="4096,16384")
ap.add_argument("--steps", default="")
ap.add_argument("--window", type=float, default=0.5)
a = ap.parse_args()
out = Path(os.environ.get("OUT", ".scratch/out"))
out.mkdir(parents=True, exist_ok=True)
t0 = time.time()
names = [s for s in a.steps.split(",") if s]
if names:
    steps_mod.build(names)
with ThreadPoolExecutor(8) as ex:
    built = list(ex.map(variants.build_variant, a.folders))
for name, rep in built:
    print("built", name, rep, flush=True)
    names.append(name)
print(f"build {time.time()-t0:.0f} s", flush=True)
from verify.checks import make_inputs, measure_errors  # noqa: E402 (imports torch: after the builds)

impls, status = {}, {}
for name in names:
    mod = steps_mod.load(name)
    if not name.startswith("diag"):
        fails = []
        for shape in [(2, 4, 1024, 1024), (1, 3, 512, 2048), (3, 2, 2048, 384)]:
            err = measure_errors(mod, *make_inputs(*shape))
            fails += err.failures()
            verdict = "ok" if not err.failures() else err.failures()
            print(f"  {name} {shape}: O rel {err.o_rel_frob:.2e} LSE {err.lse_max_abs:.2e} {verdict}", flush=True)
        status[name] = "ok" if not fails else "FAIL"
        if fails:
            continue
    else:
        status[name] = "diag"
    impls[name] = mod.attention
seqlens = [int(s) for s in a.seqlens.split(",")]
res = bench.run(impls, seqlens, budget_s=a.window)
(out / "exp.json").write_text(json.dumps(res, indent=1))
T = res["timings"]
print(f"\n{'':<20}" + "".join(f"{'N=' + str(n):>34}" for n in seqlens))
for name in [*impls, *bench.SDPA_BACKENDS]:
    row = f"{name:<20}"
    for n in seqlens:
        c = T.get(name, {}).get(n)
        per_ghz = c['tflops'] / c['sm_mhz_median'] * 1e3 if c else 0
        row += (f"{c['tflops']:8.1f} TF {c['sm_mhz_median']:5.0f} MHz {c['power_w_median']:4.0f} W {per_ghz:5.1f}/GHz"
                if c else f"{'-':>34}")
    print(row + f"  {status.get(name, '')}")
g = T["cublas_gemm"]["8192"]
print(f"cublas_gemm {g['tflops']:.1f} TF {g['sm_mhz_median']:.0f} MHz {g['power_w_median']:.0f} W; total {time.time()-t0:.0f} s")
