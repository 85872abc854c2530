"""The lead's GPU dev check used while writing steps 08-14 (the logs it wrote are under results/h200/dev/).
Builds steps (and variant folders under .scratch/var/) with nvcc, checks each against a float64 reference in a
subprocess with a time limit (a hung mbarrier wait must not stall the run), times a burst, and runs
compute-sanitizer. Kept for the record; python -m verify is the main job. Usage (from the repo root, on the GPU
machine, with this file copied to .scratch/devcheck.py and common/binding.py to .scratch/binding_head.py):
    python .scratch/devcheck.py 06 07 08        |   ... sanitize 08,09   |   DEVCHECK_BENCH=1024,4096 ...
"""
import ctypes
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCR = ROOT / ".scratch"
PKGS = SCR / "pkgs"
OUT = Path(os.environ.get("OUT", SCR / "out"))


def src_of(step):
    return SCR / "var" / step if not step.isdigit() else ROOT / "steps" / f"step{step}"


def build(step):
    d = PKGS / "flashladder" / (f"step{step}" if step.isdigit() else step)
    d.mkdir(parents=True, exist_ok=True)
    (PKGS / "flashladder" / "__init__.py").write_text("")
    shutil.copy(ROOT / "steps" / "step01" / "pkg" / "__init__.py", d / "__init__.py")
    shutil.copy(SCR / "binding_head.py", d / "_binding.py")
    cmd = ["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo", "-shared", "-Xcompiler",
           "-fPIC,-fvisibility=hidden", "-Xptxas", "-v", f"-I{ROOT / 'common'}", str(src_of(step) / "kernel.cu"),
           "-o", str(d / "_kernel.so")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        print(r.stdout, r.stderr)
        raise SystemExit(f"build step{step} failed")
    return d


def reference(q, k, v, scale):
    import torch
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ v.double()
    return o, lse


def one(step):
    import torch
    sys.path.insert(0, str(PKGS))
    import importlib
    mod = importlib.import_module(f"flashladder.{'step' + step if step.isdigit() else step}")
    bm, bn = mod.info["seqlen_multiple_q"], mod.info["seqlen_multiple_k"]
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    def rnd(*shape, f=1.0, mean=0.5):
        return ((torch.randn(*shape, device="cuda", generator=g) + mean) * f).to(torch.bfloat16)
    cases = []
    shapes = [(1, 1, bm, bn), (1, 2, bm, 2 * bn), (1, 1, bm, 3 * bn), (2, 3, 2 * bm, 4 * bn), (1, 2, 4096, 2048), (4, 8, 1024, 1024)]
    for shape in shapes:
        for f in (1.0, 10.0):
            b, h, nq, nk = shape
            cases.append((f"{shape} x{f:g}", rnd(b, h, nq, 128, f=f), rnd(b, h, nk, 128, f=f), rnd(b, h, nk, 128, f=f)))
    # strided q/k/v ([b, n, h, d] viewed as [b, h, n, d]); broadcast k/v over heads; large-V
    b, h, n = 2, 4, 512
    qs, ks, vs = (rnd(b, n, h, 128).transpose(1, 2) for _ in range(3))
    cases.append(("strided bnhd", qs, ks, vs))
    q1 = rnd(2, 4, 256, 128)
    kb = rnd(2, 1, 512, 128).expand(-1, 4, -1, -1)
    vb = rnd(2, 1, 512, 128).expand(-1, 4, -1, -1)
    cases.append(("kv broadcast heads", q1, kb, vb))
    cases.append(("V mean 100", rnd(1, 2, 512, 128), rnd(1, 2, 1024, 128), rnd(1, 2, 1024, 128, mean=100.0)))
    # row max growing along keys: k_j = j-dependent multiple of a common direction
    nk = 8 * bn
    ramp = torch.linspace(0, 3, nk, device="cuda")[None, None, :, None]
    kr = (rnd(1, 1, nk, 128, f=0.1, mean=0) + ramp).to(torch.bfloat16)
    cases.append(("max grows every tile", rnd(1, 1, bm, 128, mean=1.0), kr, rnd(1, 1, nk, 128)))
    results = []
    scale = 1 / math.sqrt(128)
    ok_all = True
    for name, q, k, v in cases:
        o = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device="cuda")
        mod.attention_out(q, k, v, o, lse)
        torch.cuda.synchronize()
        o2, lse2 = mod.attention(q, k, v)
        same = bool(torch.equal(o, o2) and torch.equal(lse, lse2))
        o_ref, lse_ref = reference(q, k, v, scale)
        nonfinite = int((~torch.isfinite(o)).sum() + (~torch.isfinite(lse)).sum())
        rel = float((o.double() - o_ref).norm() / o_ref.norm())
        mx = float((o.double() - o_ref).abs().max())
        le = float((lse.double() - lse_ref).abs().max())
        ok = nonfinite == 0 and rel < 1e-2 and le < 1e-3 * max(1, float(lse_ref.abs().max()) / 100) and same
        ok_all &= ok
        results.append(dict(case=name, ok=ok, rel=rel, maxabs=mx, lse=le, nonfinite=nonfinite, repeat_equal=same))
        print(f"  step{step} {name:<28} {'ok ' if ok else 'BAD'} rel {rel:.2e} maxabs {mx:.2e} lse {le:.2e} "
              f"nonfinite {nonfinite} repeat {same}", flush=True)
    # host cost per call (launch + tensor-map encoding), tiny shape, no sync in between
    lib = ctypes.CDLL(mod.info["library"])
    q, k, v = rnd(1, 1, bm, 128), rnd(1, 1, bn, 128), rnd(1, 1, bn, 128)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda")
    B = mod._binding
    prm = B.FwdParams(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                      (ctypes.c_int64 * 3)(*q.stride()[:3]), (ctypes.c_int64 * 3)(*k.stride()[:3]),
                      (ctypes.c_int64 * 3)(*v.stride()[:3]), (ctypes.c_int64 * 3)(*o.stride()[:3]), 1, 1, bm, bn, scale)
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(50):
        lib.flashladder_fwd(ctypes.byref(prm), ctypes.c_void_p(stream))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(300):
        lib.flashladder_fwd(ctypes.byref(prm), ctypes.c_void_p(stream))
    host_us = (time.perf_counter() - t0) / 300 * 1e6
    torch.cuda.synchronize()
    print(f"  step{step} host time per flashladder_fwd call: {host_us:.2f} us", flush=True)
    print("RESULT " + json.dumps(dict(step=step, ok=ok_all, cases=results, host_us=host_us)), flush=True)


def bench(steps, seqlens):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sys.path.insert(0, str(PKGS))
    import importlib
    mods = {(f"step{s}" if s.isdigit() else s): importlib.import_module(f"flashladder.{'step' + s if s.isdigit() else s}") for s in steps}
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    res = {}
    for n in seqlens:
        b = 16384 // n
        q, k, v = (torch.randn(b, 16, n, 128, device="cuda").add_(0.5).to(torch.bfloat16) for _ in range(3))
        fns = {name: (lambda m=m: m.attention(q, k, v)) for name, m in mods.items()}
        for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            def f(be=be):
                with sdpa_kernel(getattr(SDPBackend, be)):
                    return F.scaled_dot_product_attention(q, k, v)
            fns[be] = f
        for name, fn in fns.items():
            t_end = time.time() + 0.4
            while time.time() < t_end:
                fn()
                torch.cuda.synchronize()
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(40)]
            for s, e in ev:
                flush.zero_()
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            ms = sorted(s.elapsed_time(e) for s, e in ev)[len(ev) // 2]
            tf = 4 * b * 16 * n * n * 128 / (ms * 1e-3) / 1e12
            res.setdefault(name, {})[n] = tf
            print(f"  N={n} {name:<16} {ms:8.3f} ms {tf:7.1f} TFLOP/s", flush=True)
    print("\n" + " " * 18 + "".join(f"{n:>10}" for n in seqlens))
    for name, r in res.items():
        print(f"{name:<18}" + "".join(f"{r[n]:10.1f}" for n in seqlens))
    return res


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "one":
        one(args[1])
        sys.exit(0)
    if args and args[0] == "small":  # one small call, for compute-sanitizer
        import torch
        sys.path.insert(0, str(PKGS))
        import importlib
        mod = importlib.import_module(f"flashladder.{'step' + args[1] if args[1].isdigit() else args[1]}")
        q, k, v = (torch.randn(1, 2, n, 128, device="cuda").add_(0.5).to(torch.bfloat16) for n in (256, 512, 512))
        o, lse = mod.attention(q, k, v)
        torch.cuda.synchronize()
        print(f"step{args[1]} small ok: finite={bool(torch.isfinite(o).all())}")
        sys.exit(0)
    if args and args[0] == "sanitize":
        OUT.mkdir(parents=True, exist_ok=True)
        for s in args[1].split(","):
            build(s)
            for tool in ("memcheck", "racecheck", "synccheck"):
                try:
                    r = subprocess.run(["compute-sanitizer", "--tool", tool, sys.executable, __file__, "small", s],
                                       capture_output=True, text=True, timeout=120)
                    tail = (r.stdout + r.stderr).strip().splitlines()[-2:]
                    print(f"step{s} {tool}: rc={r.returncode} {' | '.join(tail)}", flush=True)
                except subprocess.TimeoutExpired:
                    print(f"step{s} {tool}: TIMED OUT", flush=True)
        sys.exit(0)
    if args and args[0] == "bench":
        bench(args[1].split(","), [int(x) for x in args[2].split(",")])
        sys.exit(0)
    steps = args or ["06", "07", "08", "09", "10"]
    OUT.mkdir(parents=True, exist_ok=True)
    for s in steps:
        build(s)
    print("built", steps, flush=True)
    os.environ.setdefault("DEVCHECK_BENCH", "4096,16384")
    passed = []
    for s in steps:
        try:
            r = subprocess.run([sys.executable, __file__, "one", s], capture_output=True, text=True, timeout=90)
            print(r.stdout[-6000:], r.stderr[-3000:], flush=True)
            if r.returncode == 0 and '"ok": true' in r.stdout:
                passed.append(s)
        except subprocess.TimeoutExpired as e:
            print(f"step{s}: TIMED OUT after 90 s (hang?)\n", (e.stdout or b"")[-3000:], flush=True)
    print("passed:", passed, flush=True)
    if passed:
        r = subprocess.run([sys.executable, __file__, "bench", ",".join(passed), os.environ["DEVCHECK_BENCH"]],
                           capture_output=True, text=True, timeout=300)
        print(r.stdout, r.stderr[-3000:], flush=True)
