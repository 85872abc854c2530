"""The causal schedules' balance, counted on the CPU: each CTA's K/V tiles (a work tile of Q tile i costs i + 1, plus one
for its ends), mean over max across 132 CTAs, at the causal shapes of record. `python balance.py > balance.txt`."""
G = 132


def balance(load):
    return sum(load) / len(load) / max(load)


def pairs(heads, q_tiles):  # main's step15: the i-th longest and i-th shortest tile of a head on one CTA, pairs round robin
    load = [0] * G
    for p in range(heads * q_tiles // 2):
        load[p % G] += q_tiles + 1 + 2
    return balance(load)


def snake(heads, q_tiles, section):  # the variants: tiles longest first within sections of heads, rounds in a snake
    load, start = [0] * G, 0
    for first in range(0, heads, section):
        here = min(section, heads - first)
        for x in range(here * q_tiles):
            k, lane = divmod(x, G)
            cta = (start + (lane if k % 2 == 0 else G - 1 - lane)) % G
            load[cta] += q_tiles - x // here + 1
        start = (start + here * q_tiles) % G
    return balance(load)


# (label, batch x heads, Q tiles, heads of a 32 MB section as the variant computes them)
for label, heads, q_tiles, section in [("4K", 64, 32, 16), ("8K", 32, 64, 8), ("16K", 16, 128, 4), ("GQA 8K", 64, 64, 32)]:
    print(f"{label}: pairs {pairs(heads, q_tiles):.3f}, snake over all heads {snake(heads, q_tiles, heads):.3f}, "
          f"snake in 32 MB sections {snake(heads, q_tiles, section):.3f}")
