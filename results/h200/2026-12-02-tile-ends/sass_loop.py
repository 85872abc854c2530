"""The steady-state loop of an attention kernel in SASS: the smallest loop (a backward branch) that issues both
GEMMs of a K/V tile (S = Q K^T from shared memory, P V with P from registers), its instructions by opcode, and
where its MUFU.EX2 sit against the two wgmma waits (WARPGROUP.DEPBAR.LE gsb0, 0x1 then 0x0).

    python sass_loop.py NAME=path/to/_kernel.so[:function-substring] ...

cuobjdump is found as verify/tests/test_sass.py finds it (PATH, CUDA_HOME, beside nvcc, the nvidia-cuda-cuobjdump
wheel); run from anywhere, the repository is found from this file's place.
"""
import collections
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for verify
from verify.tests.test_sass import find_cuobjdump  # noqa: E402


def cuobjdump() -> str:
    tool = find_cuobjdump()
    if tool is None:
        raise SystemExit("cuobjdump not found: pip install nvidia-cuda-cuobjdump, or install the CUDA toolkit's")
    return tool


def functions(path):
    """{mangled name: SASS text} of every function in a cubin or a host binary."""
    out = subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout
    funcs, name = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            funcs[name] = []
        elif name:
            funcs[name].append(line)
    return {k: "\n".join(v) for k, v in funcs.items()}


def steady_loop(sass):
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    best = None
    for i, (a, s) in enumerate(ins):
        m = re.search(r"\bBRA(?:\.\w+)* (0x[0-9a-f]+)", s)
        if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in at:
            continue
        body = ins[at[int(m.group(1), 16)]:i + 1]
        ss = sum("HGMMA" in x and "tnspB" not in x for _, x in body)
        rs = sum("HGMMA" in x and "tnspB" in x for _, x in body)
        if ss and rs and (best is None or len(body) < len(best)):
            best = body
    return best


def main(args):
    for arg in args:
        name, _, spec = arg.partition("=")
        path, _, want = spec.partition(":")
        funcs = {k: v for k, v in functions(path).items() if want in k and "HGMMA" in v}
        if len(funcs) != 1:
            raise SystemExit(f"{name}: {len(funcs)} functions with HGMMA match {want!r} in {path}")
        body = steady_loop(next(iter(funcs.values())))
        ops = collections.Counter((x.split()[1] if x.startswith("@") else x.split()[0]).split(".")[0] for _, x in body)
        w1 = [k for k, (_, x) in enumerate(body) if "DEPBAR.LE gsb0, 0x1" in x]
        w0 = [k for k, (_, x) in enumerate(body) if "DEPBAR.LE gsb0, 0x0" in x]
        mufu = [k for k, (_, x) in enumerate(body) if "MUFU.EX2" in x]
        between = sum(1 for k in mufu if w1 and w0 and w1[0] < k < w0[0])
        gemm = [x.split()[0] for _, x in body if "HGMMA" in x]
        uniform = sum(n for op, n in ops.items() if op.startswith("U") or op == "R2UR")
        print(f"{name}: steady loop of {len(body)} instructions; HGMMA {len(gemm)} ({', '.join(sorted(set(gemm)))}); "
              f"MUFU.EX2 {len(mufu)}, {between} of them between the two wgmma waits; uniform datapath {uniform}")
        print("   " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))


if __name__ == "__main__":
    main(sys.argv[1:])
