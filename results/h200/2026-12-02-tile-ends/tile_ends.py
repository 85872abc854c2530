"""What a work tile costs outside the steady loop, from the source-counter profiles already taken (no GPU run):
ncu's samples of every SASS instruction (results/h200/2026-12-01-source-stalls/source-counters*.tgz), split into the
consumers' steady loop (stalls.py's steady_loop: the smallest backward branch around both GEMMs) and the code run once
per consumer warp and work tile (the instructions executed as many times as the loop's entry: warps x work tiles),
before the loop (the tile's set-up and its first block, S alone) and after it (the last block, P V alone, and the
epilogue). Samples are warp time, so a consumer warp's time per work tile outside the loop, over its time per pass of
the loop, is that time in steady K/V blocks.

    python tile_ends.py DIR   (DIR: where the two archives unpack, `tar xzf ... -C DIR`; prints the table)
"""
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "2026-12-01-source-stalls"))
from stalls import load, steady_loop  # noqa: E402

PROFILES = [("s15c", "step15 causal, 4 x 16 x 8192"), ("fa3c", "FA3 causal, 4 x 16 x 8192"),
            ("step15-1k", "step15 dense, 16 x 16 x 1024"), ("step14-1k", "step14 dense, 16 x 16 x 1024")]


def split(ins):
    lo, hi = steady_loop(ins)
    loop = [d for d in ins if lo <= d["off"] <= hi]
    passes = max(d["execs"] for d in loop)  # warps x K/V tiles
    # once per consumer warp and work tile: the most samples among the exec counts outside the loop
    outside = [d for d in ins if not lo <= d["off"] <= hi and d["execs"]]
    by_count = collections.Counter()
    for d in outside:
        by_count[d["execs"]] += d["n"]
    per_tile = max(by_count, key=by_count.get)
    before = [d for d in outside if d["execs"] == per_tile and d["off"] < lo]
    after = [d for d in outside if d["execs"] == per_tile and d["off"] > hi]
    return loop, passes, per_tile, before, after


def top(part, k=4):
    stall = collections.Counter()
    for d in part:
        stall.update(d["st"])
    return ", ".join(f"{s} {n}" for s, n in stall.most_common(k))


def main(folder):
    for stem, what in PROFILES:
        path = Path(folder) / "keep" / f"{stem}.source.csv"
        if not path.exists():
            print(f"{what}: {path} missing")
            continue
        name, ins = load(path)
        loop, passes, per_tile, before, after = split(ins)
        per_pass = sum(d["n"] for d in loop) / passes
        total = sum(d["n"] for d in ins)
        print(f"{what} ({stem}): {total} samples; steady loop {sum(d['n'] for d in loop)} over {passes} passes "
              f"(warps x K/V tiles), {per_pass:.4f} a pass; {per_tile} warp-tiles")
        for label, part in (("before the loop", before), ("after the loop", after)):
            n = sum(d["n"] for d in part)
            print(f"  {label:16s} {len(part):4d} instructions, {n:6d} samples, {n / per_tile:.4f} a warp-tile = "
                  f"{n / per_tile / per_pass:.2f} steady passes; top stalls: {top(part)}")
            for d in sorted(part, key=lambda d: -d["n"])[:5]:
                print(f"      {d['n']:5d}  {d['src'][:64]:64s} {top([d], 2)}")
        print()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
