"""Where the warps of one kernel call wait, from ncu's source page (`ncu -i REP --page source --csv --print-source sass`):
every SASS instruction's warp-state samples, summed by instruction class over the whole kernel, and over the phases of
the consumers' steady loop (from the loop's first instruction to its backward branch, cut at the turn barrier, the
end of the GEMM issue, and the two wgmma waits). A sample counts a warp at the instruction it is about to issue, so
the samples at a wait are the time spent waiting there.

    python stalls.py A.source.csv+B.source.csv ...   (the kernel with the most samples in each file; B against A)
"""
import collections
import csv
import re
import sys

CLASSES = ["BAR.SYNC", "BAR.ARV", "TRYWAIT", "DEPBAR.LE gsb0, 0x1", "DEPBAR.LE gsb0, 0x0", "HGMMA", "MUFU.EX2", "SHFL",
           "NANOSLEEP", "WARPGROUP.ARRIVE", "SYNCS.ARRIVE", "MEMBAR", "FMNMX", "FFMA", "FADD", "FMUL", "F2FP", "VOTE"]


def load(path):
    """(kernel name, its instructions) of the kernel with the most samples (a call may launch several)."""
    rows = list(csv.reader(open(path)))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] + [len(rows)]
    best = None
    for a, b in zip(starts, starts[1:]):
        hdr = rows[a + 1]
        idx = {h: i for i, h in enumerate(hdr)}
        stalls = [h for h in hdr if h.startswith("stall_") and "(Not" not in h]
        data = [r for r in rows[a + 2:b] if r and r[0].startswith("0x")]
        base = int(data[0][0], 16)
        samples = idx["Warp Stall Sampling (All Samples)"]
        ins = [dict(off=int(r[0], 16) - base, addr=int(r[0], 16), src=r[idx["Source"]].strip(), n=int(r[samples]),
                    execs=int(r[idx["Instructions Executed"]] or 0), st={s[6:]: int(r[idx[s]] or 0) for s in stalls})
               for r in data]
        if best is None or sum(d["n"] for d in ins) > sum(d["n"] for d in best[1]):
            best = (rows[a][1], ins)
    return best


def steady_loop(ins):
    """(first, last) offsets of the smallest loop (a backward branch) that issues both GEMMs of a K/V tile:
    S = Q K^T from shared memory and P V with P from registers (HGMMA ... tnspB)."""
    at = {d["addr"]: i for i, d in enumerate(ins)}
    best = None
    for i, d in enumerate(ins):
        m = re.search(r"\bBRA(?:\.\w+)* (0x[0-9a-f]+)", d["src"])
        if not m or int(m.group(1), 16) >= d["addr"] or int(m.group(1), 16) not in at:
            continue
        body = ins[at[int(m.group(1), 16)]:i + 1]
        ss = any("HGMMA" in x["src"] and "tnspB" not in x["src"] for x in body)
        rs = any("HGMMA" in x["src"] and "tnspB" in x["src"] for x in body)
        if ss and rs and (best is None or len(body) < len(best)):
            best = body
    return best[0]["off"], best[-1]["off"]


def cls(src):
    for key in CLASSES:
        if key in src:
            return key
    op = src.split()[1] if src.startswith("@") else src.split()[0]
    return "uniform datapath" if op.startswith("U") or op.startswith("R2UR") or op.startswith("S2UR") else "other"


def table(groups, tot):
    for key, (n, st, count) in groups.items():
        top = ", ".join(f"{k} {v / tot * 100:.1f}" for k, v in st.most_common(4) if v)
        print(f"  {key:34s} {count:5d} instr {n / tot * 100:5.1f}%   {top}")


def group(ins, key_of):
    out = collections.OrderedDict()
    for d in ins:
        k = key_of(d)
        n, st, c = out.get(k, (0, collections.Counter(), 0))
        st.update(d["st"])
        out[k] = (n + d["n"], st, c + 1)
    return out


def main():
    """Each file's tables; then, for each pair of files given as A+B, B against A."""
    done = {}
    for arg in sys.argv[1:]:
        for path in arg.split("+"):
            if path not in done:
                done[path] = report(path)
    for arg in sys.argv[1:]:
        if "+" in arg:
            a, b = arg.split("+")
            side_by_side(done[a], done[b], a, b)


def report(path):
    """Print the tables of one profile; return its samples: all, in the steady loop, by phase, outside the loop."""
    kernel, ins = load(path)
    tot = sum(d["n"] for d in ins)
    print(f"{path}: {kernel[:90]}\n  {len(ins)} instructions, {tot} samples; by class (% of all samples, top stall reasons):")
    g = group(ins, lambda d: cls(d["src"]))
    table(collections.OrderedDict(sorted(g.items(), key=lambda x: -x[1][0])), tot)
    lo, hi = steady_loop(ins)
    loop = [d for d in ins if lo <= d["off"] <= hi]
    marks = [(lo, "loop top (ring waits)")]
    for d in loop:
        for key, name in PHASES:
            if key in d["src"]:
                marks.append((d["off"], name))
    marks.sort()
    print(f"  the steady loop {lo:x}-{hi:x}, executed {loop[0]['execs']} times (warps x K/V tiles): "
          f"{sum(d['n'] for d in loop) / tot * 100:.1f}% of all samples; by phase:")
    phases = group(loop, lambda d: [m for m in marks if m[0] <= d["off"]][-1][1])
    table(phases, tot)
    outside = sum(d["n"] for d in ins if not lo <= d["off"] <= hi)
    print(f"  outside the steady loop: {outside} samples ({outside / tot * 100:.1f}%)")
    return dict(all=tot, loop_runs=loop[0]["execs"], phases={k: (n, st) for k, (n, st, _) in phases.items()}, outside=outside)


PHASES = [("BAR.SYNC", "turn wait + GEMM issue"), ("BAR.ARV", "turn passed"), ("DEPBAR.LE gsb0, 0x1", "wait for S + softmax"),
          ("DEPBAR.LE gsb0, 0x0", "wait for P V + after")]


def side_by_side(a, b, name_a, name_b):
    """Samples of two profiles of the same work (one call each, the same inputs), b against a."""
    print(f"\n{name_b} against {name_a} (samples; a sample is a warp at an instruction, so samples add up to warp time):")
    print(f"  all: {a['all']} against {b['all']} ({b['all'] / a['all']:.3f}x)")
    print(f"  steady loop runs: {a['loop_runs']} against {b['loop_runs']}")
    for _, name in [(None, "loop top (ring waits)")] + PHASES:
        if name in a["phases"] and name in b["phases"]:
            (na, sa), (nb, sb) = a["phases"][name], b["phases"][name]
            print(f"  {name:24s} {na:7d} against {nb:7d} ({nb / max(na, 1):.3f}x); of them 'wait' {sa['wait']} against "
                  f"{sb['wait']}, 'barrier' {sa['barrier']} against {sb['barrier']}")
    sa = sum(a["phases"][n][0] for n in ("wait for S + softmax", "wait for P V + after")) - sum(
        a["phases"][n][1]["barrier"] for n in ("wait for S + softmax", "wait for P V + after"))
    sb = sum(b["phases"][n][0] for n in ("wait for S + softmax", "wait for P V + after")) - sum(
        b["phases"][n][1]["barrier"] for n in ("wait for S + softmax", "wait for P V + after"))
    print(f"  softmax and after, the waits for the two GEMMs left out: {sa} against {sb} ({sb / sa:.3f}x)")
    print(f"  outside the steady loop: {a['outside']} against {b['outside']} ({b['outside'] / a['outside']:.3f}x)")

if __name__ == "__main__":
    main()
