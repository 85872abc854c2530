"""The steady K/V loops of step19's dense kernels in SASS (no GPU): each backward branch's body that holds wgmma
(HGMMA) and exponentials (MUFU.EX2), its length and its uniform-datapath instructions by opcode.
Run from the repository root, cuobjdump on PATH: python results/h200/2026-12-02-step19/sass_loops.py"""
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "common")
import build_step  # noqa: E402

out = Path(tempfile.mkdtemp()) / "step19"
build_step.compile_step(Path("steps/step19"), out)
sass = subprocess.run(["cuobjdump", "-sass", str(out / "_kernel.so")], capture_output=True, text=True, check=True).stdout
for fn in re.split(r"\n\s*Function : ", sass)[1:]:
    name = fn.split()[0]
    if "ELb1EEEv" in name:  # the causal kernels: step18's (test_sass.py)
        continue
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", fn)]
    where = {a: i for i, (a, _) in enumerate(ins)}
    op = [t.split()[1] if t.startswith("@") else t.split()[0] for _, t in ins]
    print(re.search(r"attention_fwd_kernelILb(\d)ELb(\d)ELb(\d)", name).expand(r"attention_fwd_kernel<\1, \2, \3>"))
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA.*?0x([0-9a-f]+)", t)
        if not m or int(m[1], 16) >= a or int(m[1], 16) not in where:
            continue
        body = op[where[int(m[1], 16)]: i + 1]
        hgmma, ex2 = sum(o.startswith("HGMMA") for o in body), sum(o == "MUFU.EX2" for o in body)
        if 0 < hgmma <= 16 and ex2 >= 60 and len(body) < 900:  # one K/V tile's loop, not the unrolled pro/epilogues
            uni = collections.Counter(o for o in body if o.startswith("U") or o == "R2UR")
            print(f"  loop of {len(body)} instructions: {hgmma} HGMMA, {ex2} MUFU.EX2, {sum(uni.values())} uniform:",
                  ", ".join(f"{o} {n}" for o, n in uni.most_common()))
