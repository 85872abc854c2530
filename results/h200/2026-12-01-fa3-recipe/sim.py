"""The causal schedules' balance, simulated: how evenly each schedule spreads the triangle's work over 132 CTAs.

Causal top left, seqlen_q = seqlen_k = N, 128-row Q tiles and 128-key K/V tiles: Q tile i sees i + 1 K/V tiles, and
each work tile costs C more (its first and last blocks, its epilogue), in K/V-tile units. A schedule's balance is
the mean CTA's work over the busiest CTA's (1.000: no CTA waits for another at the end). Printed for step15's pairs
(the i-th longest and i-th shortest Q tile of a head, pair k to CTA k mod 132) and for single tiles, longest first,
in groups of `hg` (batch, head) pairs, heads fastest within a group, each drawn by the first CTA to be free (a
counter in global memory; `dyn`). The prediction for the dynamic schedule, not a measurement.

    python sim.py > sim.txt
"""
import heapq

C = 1.5
G = 132


def balance(loads, total):
    return total / len(loads) / max(loads)


for batch, heads, n in [(4, 16, 4096), (2, 16, 8192), (1, 16, 16384), (2, 32, 8192)]:
    q_tiles = n // 128
    work = [i + 1 + C for i in range(q_tiles)]
    total = batch * heads * sum(work)
    pairs = [work[q_tiles - 1 - j] + work[j] for _ in range(batch * heads) for j in range(q_tiles // 2)]
    loads = [0.0] * G
    for k, w in enumerate(pairs):
        loads[k % G] += w
    row = [f"{batch} x {heads} x {n}: pairs {balance(loads, total):.3f}"]
    for hg in (1, 2, 4, 8, 16):
        order = [work[i] for g0 in range(0, batch * heads, hg) for i in reversed(range(q_tiles))
                 for _ in range(min(hg, batch * heads - g0))]
        free = [(0.0, b) for b in range(G)]
        for w in order:
            t, b = heapq.heappop(free)
            heapq.heappush(free, (t + w, b))
        row.append(f"dyn hg {hg} {total / G / max(t for t, _ in free):.3f}")
    print("; ".join(row))
