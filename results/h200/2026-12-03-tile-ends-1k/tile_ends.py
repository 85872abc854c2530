"""Where step19's extra time at N = 1K goes, against step14's kernel, from one ncu call of each with source counters
(source-counters-1k.tgz, written by prof1k.sh). No GPU; run from the repository root:

    python results/h200/2026-12-03-tile-ends-1k/tile_ends.py > results/h200/2026-12-03-tile-ends-1k/tile-ends.txt

First stalls.py's tables (results/h200/2026-12-01-source-stalls/stalls.py: samples by instruction class, the steady
loop by phase, step19 against step14), then the samples outside the steady loop by the source line that ncu ties
each SASS instruction to (its "cuda,sass" page), the lines whose samples differ most first. A sample is a warp at the
instruction it is about to issue, so samples add up to warp time; the producer's samples are its waits for free slots."""
import collections
import csv
import importlib.util
import os
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("stalls", HERE.parent / "2026-12-01-source-stalls" / "stalls.py")
stalls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stalls)


def addr_lines(path):
    """SASS address -> (file, line, source text) from ncu's cuda,sass source page."""
    where, f, cur = {}, None, None
    for r in csv.reader(open(path)):
        if not r:
            continue
        if r[0] == "File Path":
            f = r[1].split("/")[-1]
        elif r[0].isdigit():
            cur = (f, r[1].strip()[:80])
        elif r[0] == "" and len(r) > 2 and r[2].startswith("0x"):
            where[int(r[2], 16)] = cur
    return where


def outside(folder, tag):
    """Samples outside the steady loop, by source line."""
    _, ins = stalls.load(str(folder / f"{tag}-1k.source.csv"))
    lo, hi = stalls.steady_loop(ins)
    where = addr_lines(folder / f"{tag}-1k.cudasass.csv")
    by = collections.Counter()
    for d in ins:
        if not lo <= d["off"] <= hi:
            by[where.get(d["addr"], ("?", "?"))] += d["n"]
    return by


def main():
    tmp = Path(tempfile.mkdtemp())
    with tarfile.open(HERE / "source-counters-1k.tgz") as t:
        t.extractall(tmp, filter="data")
    os.chdir(tmp / "keep")  # stalls.py names the files as given
    sys.argv = ["stalls.py", "step14-1k.source.csv+step19-1k.source.csv"]
    stalls.main()
    a, b = outside(Path("."), "step14"), outside(Path("."), "step19")
    print(f"\noutside the steady loop by source line: step14 {sum(a.values())} samples, step19 {sum(b.values())}")
    print("  (the same line of step14's and step19's kernel.cu is matched by its text; the turn barrier's wait is counted at")
    print("  the instruction after it, which ncu may tie to another line)")
    print(f"  {'step19-14':>9} {'step14':>6} {'step19':>6}  file: source")
    for k in sorted(set(a) | set(b), key=lambda k: -abs(b[k] - a[k]))[:40]:
        print(f"  {b[k] - a[k]:+9d} {a[k]:6d} {b[k]:6d}  {k[0]}: {k[1]}")


if __name__ == "__main__":
    main()
