"""Draw the pictures of docs/hopper.md into docs/img/: `python docs/pictures.py` (matplotlib, no GPU).

One picture per Hopper mechanism of steps 08-10. The sizes in them (ring slots, tile heights, bytes, register
budgets) are read from the steps' kernel.cu, so a picture shows what the code does; the layouts (swizzle,
accumulator fragments) are computed from their definitions, not drawn by hand.
"""
from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402
from PIL import Image  # noqa: E402  (Pillow: a dependency of matplotlib)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "img"
DPI = 110

# One colour per role, used the same way in every picture.
C_TMA = "#4c78a8"       # TMA copies, the producer
C_COMPUTE = "#f58518"   # tensor-core work, the consumers
C_BARRIER = "#54a24b"   # mbarriers
C_EMPTY = "#e45756"     # "empty" barriers (step10)
C_GRID = "#555555"
CHUNK_COLOURS = plt.get_cmap("tab10").colors[:8]   # 16-byte chunk c % 8
REG_COLOURS = ["#c6dbef", "#7fb2dc", "#fdd0a2", "#f9a65a"]  # a fragment's four registers


def constant(path: Path, name: str) -> int:
    """`constexpr int ... NAME = <number>` from a source file: the picture follows the code."""
    m = re.search(rf"\b{name}\s*=\s*(\d+)\s*[,;]", path.read_text())
    if not m:
        sys.exit(f"pictures.py: no `{name} = <number>` in {path.relative_to(ROOT)}: update the picture to the code")
    return int(m.group(1))


def step_constant(step: str, name: str) -> int:
    return constant(ROOT / "steps" / step / "kernel.cu", name)


HEAD_DIM = constant(ROOT / "common" / "flashladder.cuh", "HEAD_DIM")
ELEM_BYTES = 2                    # bf16
# a TMA box row: 64 bf16 = 128 bytes, the widest row the 128-byte swizzle takes (common/swizzle.cuh)
BOX_COLS = constant(ROOT / "common" / "swizzle.cuh", "TMA_HALF_COLS")
CHUNK_ELEMS = 16 // ELEM_BYTES    # one 16-byte chunk: 8 bf16
ATOM_ROWS = 8                     # one swizzle atom: 8 rows of 128 bytes


def save(fig, name: str) -> Path:
    """PNG with a 256-colour palette: flat diagrams lose nothing and the files stay ~3x smaller."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    buf = io.BytesIO()
    fig.savefig(buf, dpi=DPI, format="png")
    plt.close(fig)
    Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path


def box(ax, x, y, w, h, text="", colour="white", edge=C_GRID, size=9, alpha=1.0, lw=1.0, **kw):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor=edge, alpha=alpha, lw=lw))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, **kw)


def arrow(ax, start, end, colour=C_GRID, text="", size=8, style="-|>", text_offset=(0, 0), ls="-", **kw):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=colour, lw=1.3, ls=ls,
                                 shrinkA=2, shrinkB=2, **kw))
    if text:
        ax.text((start[0] + end[0]) / 2 + text_offset[0], (start[1] + end[1]) / 2 + text_offset[1], text, fontsize=size,
                ha="center", va="center", color=colour)


def blank(ax, xlim, ylim):
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_axis_off()


# ---------------------------------------------------------------- step08: the TMA ring and its phases

def ring_schedule(stages: int, tiles: int, load: float, compute: float):
    """step08's schedule: every slot filled at the start; tile j computed once its fill landed and tile j-1 is
    done; its slot refilled with tile j + STAGES once every warp is done with tile j (the __syncthreads)."""
    fills, computes = {}, {}
    for j in range(min(stages, tiles)):
        fills[j] = (0.15 * j, 0.15 * j + load)  # issued together, landing one after the other
    t = 0.0
    for j in range(tiles):
        start = max(t, fills[j][1])
        computes[j] = (start, start + compute)
        t = start + compute
        if j + stages < tiles:
            fills[j + stages] = (t, t + load)
    return fills, computes


def picture_tma_ring() -> Path:
    stages, block_n = step_constant("step08", "STAGES"), step_constant("step08", "BLOCK_N")
    tile_bytes = block_n * HEAD_DIM * ELEM_BYTES
    tiles = 3 * stages
    fills, computes = ring_schedule(stages, tiles, load=1.0, compute=1.5)
    fig = plt.figure(figsize=(12, 8.2))
    fig.suptitle(f"step08: a ring of {stages} K/V slots, each slot's tiles completing on its mbarriers", fontsize=13)

    # Top: the timeline.
    ax = fig.add_axes([0.02, 0.43, 0.96, 0.5])
    end = max(e for _, e in computes.values())
    blank(ax, (-3.3, end + 0.3), (-1.6, stages + 1.2))
    rows = {f"slot {s}": stages - s for s in range(stages)}
    for label, y in rows.items():
        ax.text(-0.2, y + 0.35, f"TMA -> {label}\n(K_full[{label[-1]}], V_full[{label[-1]}])", ha="right", va="center",
                fontsize=9)
    ax.text(-0.2, 0.35, "all warps:\nmma.sync on it", ha="right", va="center", fontsize=9)
    for j, (a, b) in fills.items():
        s, n = j % stages, j // stages
        y = rows[f"slot {s}"]
        box(ax, a, y, b - a, 0.7, f"tile {j}: fill {n}\nphase {n} done", C_TMA, size=8, color="white", alpha=0.9)
    for j, (a, b) in computes.items():
        s, n = j % stages, j // stages
        box(ax, a, 0, b - a, 0.7, f"tile {j}  (slot {s})", C_COMPUTE, size=8, alpha=0.9)
        ax.text(a + 0.05, -0.25, f"wait parity {n % 2}", fontsize=7, ha="left", va="top", color=C_BARRIER)
        fill_end = fills[j][1]
        arrow(ax, (fill_end, rows[f"slot {s}"]), (a + 0.02, 0.7), C_BARRIER, ls=":")
        if j + stages < tiles:
            arrow(ax, (b, 0.72), (fills[j + stages][0] + 0.02, rows[f"slot {s}"]), C_GRID, ls="--")
    ax.text(-3.2, -1.1, f"Tile j lives in slot j % {stages}, as that slot's fill n = j / {stages}; fill n completes the "
            f"slot's barrier phase n, so the warps wait with try_wait.parity((j / {stages}) % 2).\n"
            f"Dotted: a phase completes and the waiting warps go on. Dashed: after tile j, a __syncthreads frees its slot "
            f"and thread 0 refills it with tile j + {stages}.", fontsize=9, va="center")
    ax.annotate("time", xy=(end, -0.55), xytext=(end - 1.2, -0.55), fontsize=9, va="center",
                arrowprops=dict(arrowstyle="->", color=C_GRID))

    # Bottom: one fill, step by step.
    ax = fig.add_axes([0.02, 0.0, 0.96, 0.4])
    blank(ax, (0, 12), (0, 5.2))
    ax.text(0.1, 5.0, f"One fill of slot s (a K tile: {block_n} rows x {HEAD_DIM} bf16 = {tile_bytes} bytes; V the same "
            "on V_full[s])", fontsize=10, weight="bold", va="top")
    lanes = {"thread 0": 1.2, "mbarrier K_full[s]": 4.6, "TMA unit": 7.6, "all threads": 10.6}
    for name, x in lanes.items():
        box(ax, x - 0.9, 4.0, 1.8, 0.5, name, C_BARRIER if "mbarrier" in name else "#eeeeee", size=9,
            color="white" if "mbarrier" in name else "black")
        ax.plot([x, x], [0.2, 4.0], color="#bbbbbb", lw=1, zorder=0)
    half = tile_bytes // 2
    events = [
        (3.55, "thread 0", "mbarrier K_full[s]", f"1. arrive.expect_tx({tile_bytes}): the one arrival is in, {tile_bytes} bytes owed"),
        (2.95, "thread 0", "TMA unit", f"2. cp.async.bulk.tensor x 2: the two 64-column halves ({half} B each)"),
        (2.35, "TMA unit", "mbarrier K_full[s]", f"3. complete_tx({half}) as each half lands, swizzled"),
        (1.45, "mbarrier K_full[s]", "all threads", "4. arrivals 0 and bytes 0: phase n completes,\n"
                                                     "the parity bit flips, the barrier re-arms for phase n + 1"),
    ]
    for y, a, b, text in events:
        xa, xb = lanes[a], lanes[b]
        arrow(ax, (xa, y), (xb, y), C_TMA if "TMA" in a + b and "3." not in text else C_BARRIER)
        ax.text((xa + xb) / 2, y + 0.08, text, fontsize=8.5, ha="center", va="bottom")
    ax.text(lanes["all threads"], 0.75, "5. try_wait.parity(n % 2) was\nfalse until now; it returns true:\n"
            "the tile may be read", fontsize=8.5, ha="center", va="center")
    return save(fig, "tma_ring.png")


def picture_tma_swizzle() -> Path:
    chunks_per_row = HEAD_DIM // CHUNK_ELEMS            # 16 chunks in a 256-byte row
    chunks_per_half = BOX_COLS // CHUNK_ELEMS          # 8 in a 128-byte box row
    fig = plt.figure(figsize=(12, 5.9))
    fig.suptitle("TMA's 128-byte swizzle on a 256-byte row: two 64-column halves; in each, chunk c of row r is "
                 "stored at c ^ (r % 8)", fontsize=12)
    ax = fig.add_axes([0.01, 0.02, 0.98, 0.88])
    blank(ax, (-1.5, 36), (-3.6, 10.2))
    ax.text(0, 9.6, f"global memory: rows of {HEAD_DIM} bf16 = {chunks_per_row} chunks of 16 bytes", fontsize=10)
    for r in range(ATOM_ROWS):
        ax.text(-0.3, ATOM_ROWS - 1 - r + 0.5, f"row {r}", ha="right", va="center", fontsize=8)
        for c in range(chunks_per_row):
            box(ax, c, ATOM_ROWS - 1 - r, 1, 1, str(c), CHUNK_COLOURS[c % 8], size=8,
                alpha=1.0 if c < chunks_per_half else 0.55)
    arrow(ax, (16.3, 4), (18.2, 4), C_TMA, "TMA", size=9, text_offset=(0, 0.4))
    x0 = 19
    ax.text(x0, 9.6, "shared memory: half 0 (chunks 0-7) then half 1 (chunks 8-15)", fontsize=10)
    for h in range(HEAD_DIM // BOX_COLS):
        for r in range(ATOM_ROWS):
            for p in range(chunks_per_half):
                c = h * chunks_per_half + (p ^ (r % ATOM_ROWS))  # the chunk stored at position p of row r
                reads = c == 0  # the chunk ldmatrix takes from each of rows 0-7
                box(ax, x0 + h * (chunks_per_half + 0.6) + p, ATOM_ROWS - 1 - r, 1, 1, str(c), CHUNK_COLOURS[c % 8],
                    size=8, alpha=1.0 if h == 0 else 0.55, lw=3 if reads else 1, edge="black" if reads else C_GRID)
        ax.text(x0 + h * (chunks_per_half + 0.6) + chunks_per_half / 2, -0.35,
                "half 0: a [ROWS, 64] box" if h == 0 else "half 1: ROWS x 128 bytes further", ha="center", va="top",
                fontsize=9)
    for p in range(chunks_per_half):
        ax.text(x0 + p + 0.5, 8.2, f"{4 * p}-{4 * p + 3}", ha="center", fontsize=6.5, rotation=90)
    ax.text(x0 - 0.1, 8.55, "banks", ha="right", fontsize=7)
    ax.text(0, -1.2, "Each half is a dense [ROWS, 64] tile (128-byte rows); half 1 starts ROWS x 128 bytes after half 0. "
            "Inside an 8-row atom (1024 bytes) the hardware XORs\naddress bits 4-6 (the chunk) with bits 7-9 (the row): "
            "chunk c (0-7 in its half) of row r lands at position c ^ (r % 8).\nOutlined: the chunk 0 of rows 0-7 that one ldmatrix reads, "
            "at 8 different positions, so in 8 different groups of 4 banks: no bank conflict.\n"
            "common/swizzle.cuh: swizzle_tma_128b<ROWS>(row, col).", fontsize=9, va="top")
    return save(fig, "tma_swizzle.png")


# ---------------------------------------------------------------- step09: wgmma

def picture_wgmma_layout() -> Path:
    block_n = step_constant("step09", "BLOCK_N")
    warps, rows_per_warp, cols = 4, 16, 8  # a warpgroup; mma.m16n8's D fragment, which each warp's part repeats
    blocks = block_n // cols
    shown_warp, shown_block = 1, 2
    fig = plt.figure(figsize=(13, 7.4))
    fig.suptitle(f"step09: one warpgroup computes S[64 x {block_n}] = Q K$^T$; each warp's rows hold mma.m16n8's D layout",
                 fontsize=13)

    # Left: the warpgroup's tile.
    ax = fig.add_axes([0.01, 0.08, 0.33, 0.8])
    blank(ax, (-4, blocks + 0.5), (-6.5, warps * 4 + 1.5))
    for w in range(warps):
        y = (warps - 1 - w) * 4
        for nb in range(blocks):
            box(ax, nb, y, 1, 4, "", C_COMPUTE if (w, nb) == (shown_warp, shown_block) else "#fde0c5", lw=0.6)
        ax.text(-0.2, y + 2, f"warp {w}\nrows {rows_per_warp * w}-{rows_per_warp * w + rows_per_warp - 1}", ha="right",
                va="center", fontsize=9)
    for nb in range(0, blocks, 4):
        ax.text(nb + 0.5, warps * 4 + 0.2, f"{cols * nb}", ha="center", fontsize=8)
    ax.text(blocks / 2, warps * 4 + 0.9, f"keys (N = {block_n}), in blocks of {cols}", ha="center", fontsize=9)
    ax.text(blocks / 2, -0.6, f"one wgmma.m64n{block_n}k16 per 16 dims of Q K$^T$:\n4 warps, 64 rows; "
            f"each thread holds {block_n // 2} fp32,\nS_acc[4 nb + i] (nb: key block, i: 0-3 as in the middle)",
            ha="center", va="top", fontsize=9)

    # Middle: one 16 x 8 block, element by element, coloured by register.
    ax = fig.add_axes([0.36, 0.08, 0.3, 0.8])
    blank(ax, (-2.5, 8.6), (-6.5, 17.8))
    ax.text(4, 17.2, f"warp {shown_warp}, key block nb = {shown_block}: 16 rows x 8 keys", ha="center", fontsize=10)
    for row in range(rows_per_warp):
        g, upper = row % 8, row < 8
        ax.text(-0.2, 15.5 - row, f"{'g' if upper else 'g+8'} = {row}" if row in (0, 8) else str(row), ha="right",
                va="center", fontsize=7)
        for col in range(cols):
            reg = (0 if upper else 2) + col % 2  # S_acc[4nb + reg]
            box(ax, col, 15 - row, 1, 1, "", REG_COLOURS[reg], lw=0.5)
        for t in range(4):
            ax.text(2 * t + 1, 15.5 - row, f"lane {4 * g + t}", ha="center", va="center", fontsize=7)
    for col in range(cols):
        ax.text(col + 0.5, 16.15, str(col), ha="center", fontsize=7)
    for reg in range(4):
        x, y = 4 * (reg % 2), -0.8 - 0.8 * (reg // 2)
        box(ax, x, y, 0.6, 0.6, "", REG_COLOURS[reg])
        ax.text(x + 0.8, y + 0.3, f"S_acc[4nb + {reg}]", fontsize=8, va="center")
    ax.text(4, -2.6, "lane = 4g + t holds (row g, keys 2t, 2t+1)\nand (row g + 8, the same keys). A row lives in\n"
            "the 4 lanes of a quad: its max and sum take\ntwo shuffles (xor 1, xor 2).", ha="center", va="top",
            fontsize=9)

    # Right: two S blocks become one A fragment of P.
    ax = fig.add_axes([0.68, 0.08, 0.31, 0.8])
    blank(ax, (-1, 17), (-6.5, 17.8))
    ax.text(8, 17.2, "O += P V: P is wgmma's A, from registers (RS)", ha="center", fontsize=10)
    quads = [("a0", 0, 0, "S_acc[8kk+0, 1]", 0), ("a1", 0, 8, "S_acc[8kk+2, 3]", 2), ("a2", 8, 0, "S_acc[8kk+4, 5]", 0),
             ("a3", 8, 8, "S_acc[8kk+6, 7]", 2)]
    for name, x, y_from_top, src, reg in quads:
        box(ax, x, 15 - y_from_top - 7, 8, 8, "", REG_COLOURS[reg], alpha=0.6)
        ax.text(x + 4, 15 - y_from_top - 3, f"{name} = bf16x2(\n{src})\n\nrows {'g' if y_from_top == 0 else 'g+8'}, "
                f"keys {'' if x == 0 else '8+'}2t, +1", ha="center", va="center", fontsize=8.5)
    ax.text(4, 16.15, "key block 2kk", ha="center", fontsize=8)
    ax.text(12, 16.15, "key block 2kk+1", ha="center", fontsize=8)
    ax.text(8, -0.6, "Two neighbouring 8-key blocks of S, rounded to\nbf16, are exactly mma.m16n8k16's A fragment of\n"
            f"a 16-key slice of P, in every warp: P_frag[kk][0..3],\nkk = 0..{block_n // 16 - 1}, one wgmma each. "
            "No shared memory,\nno shuffle.", ha="center", va="top", fontsize=9)
    return save(fig, "wgmma_layout.png")


def picture_wgmma_descriptors() -> Path:
    block_n = step_constant("step09", "BLOCK_N")
    row_bytes, atom_bytes = BOX_COLS * ELEM_BYTES, ATOM_ROWS * BOX_COLS * ELEM_BYTES
    half_bytes = block_n * row_bytes
    kstep_bytes = 16 * ELEM_BYTES
    ksteps_per_half = BOX_COLS // 16
    atoms_shown = 4
    fig = plt.figure(figsize=(13, 6.0))
    fig.suptitle(f"step09: the shared-memory descriptors (128-byte swizzle: atoms of 8 rows x {row_bytes} bytes = "
                 f"{atom_bytes} bytes)", fontsize=13)
    top = atoms_shown * 2

    # Left: K-major Q and K.
    ax = fig.add_axes([0.01, 0.02, 0.48, 0.86])
    blank(ax, (-5, 20), (-5, top + 2.2))
    ax.text(8, top + 1.5, "Q, K: K-major (the head dim, wgmma's K, is contiguous)", ha="center", fontsize=11)
    kk = 1
    for h in range(2):
        x = 1 + h * 9
        for a in range(atoms_shown):
            y = (atoms_shown - 1 - a) * 2
            box(ax, x, y, 8, 1.8, "", "#eeeeee", lw=0.8)
            if h == kk // ksteps_per_half:
                step = kk % ksteps_per_half
                box(ax, x + 2 * step, y, 2, 1.8, f"k-step {kk}\n{kstep_bytes} B" if a == 0 else "", C_COMPUTE, size=8)
            if h == 0:
                ax.text(x - 0.15, y + 0.9, f"rows {8 * a}-{8 * a + 7}", fontsize=7, va="center", ha="right")
        ax.text(x + 4, top + 0.3, f"half {h}: dims {64 * h}-{64 * h + 63}", ha="center", fontsize=9)
        ax.text(x + 4, -0.5, "...", ha="center", fontsize=12)
    arrow(ax, (-2.6, top - 0.2), (-2.6, top - 2.2), C_TMA, f"SBO\n{atom_bytes} B", size=8, text_offset=(-1.1, 0))
    ax.text(7.5, -1.2, f"k-step kk (orange: kk = {kk}; rows: Q's 64 per warpgroup, or K's {block_n} keys):\n"
            f"wgmma_desc(tile + (kk / {ksteps_per_half}) * ROWS * {row_bytes} + "
            f"(kk % {ksteps_per_half}) * {kstep_bytes}, LBO = 16, SBO = {atom_bytes})\n"
            f"A k-step is 16 dims = {kstep_bytes} bytes of every row (drawn where they belong before the swizzle).\n"
            "Its start may sit inside an atom: the hardware swizzles the addresses it generates,\n"
            "so the atoms must be 1024-byte aligned. SBO steps from one 8-row group to the next;\n"
            "LBO is not used with this swizzle (16 bytes, encoded 1, by convention).", ha="center", va="top", fontsize=9)

    # Right: N-major V.
    ax = fig.add_axes([0.51, 0.02, 0.48, 0.86])
    blank(ax, (-5, 20), (-5, top + 2.2))
    ax.text(8, top + 1.5, "V: N-major (the head dim, wgmma's N, is contiguous)", ha="center", fontsize=11)
    kk = 1
    for h in range(2):
        x = 1 + h * 9
        for a in range(atoms_shown):
            y = (atoms_shown - 1 - a) * 2
            hit = a in (2 * kk, 2 * kk + 1)
            box(ax, x, y, 8, 1.8, f"keys {8 * a}-{8 * a + 7}", C_COMPUTE if hit else "#eeeeee", size=8, lw=0.8)
        ax.text(x + 4, top + 0.3, f"half {h}: dims {64 * h}-{64 * h + 63}", ha="center", fontsize=9)
        ax.text(x + 4, -0.5, "...", ha="center", fontsize=12)
    y_first = (atoms_shown - 1 - 2 * kk) * 2
    arrow(ax, (1, y_first + 1.8), (10, y_first + 1.8), C_TMA)
    ax.text(5.5, y_first + 2.05, f"LBO = {half_bytes} B: to the other half (along N)", ha="center", fontsize=8,
            color=C_TMA, bbox=dict(facecolor="white", edgecolor="none", pad=1))
    arrow(ax, (0.6, y_first + 1.8), (0.6, y_first - 0.2), C_TMA, f"SBO\n{atom_bytes} B", size=8, text_offset=(-1.1, 0))
    ax.text(9.5, -1.2, f"k-step kk of O += P V (orange: kk = {kk}) is keys 16kk to 16kk + 15, all {HEAD_DIM} dims:\n"
            f"wgmma_desc(V tile + kk * 2 * {atom_bytes}, LBO = {half_bytes}, SBO = {atom_bytes}),\n"
            "read transposed (imm-trans-b = 1). SBO steps along K (8 keys), LBO along N.", ha="center", va="top",
            fontsize=9)
    return save(fig, "wgmma_descriptors.png")


# ---------------------------------------------------------------- step10: producer and consumers

def picture_producer_consumer() -> Path:
    producer_regs, consumer_regs = step_constant("step10", "PRODUCER_REGS"), step_constant("step10", "CONSUMER_REGS")
    consumers, stages = step_constant("step10", "NUM_CONSUMERS"), step_constant("step10", "STAGES")
    block_m = step_constant("step10", "BLOCK_M")
    warps_per_group, threads_per_group = 4, 128
    arrivals = consumers * warps_per_group
    fig = plt.figure(figsize=(13, 7.2))
    fig.suptitle(f"step10: a producer warpgroup fills the ring, {consumers} consumer warpgroups compute; "
                 "full and empty mbarriers between them", fontsize=13)
    ax = fig.add_axes([0.01, 0.19, 0.98, 0.74])
    blank(ax, (0, 26), (0.4, 11))

    # The producer (left), the slot (middle), the consumers (right): work flows left to right along the top
    # (copies, full barriers) and slots come back right to left along the bottom (empty barriers).
    box(ax, 0.3, 1.8, 5.8, 8.6, "", "#dbe6f2", edge=C_TMA, lw=1.5)
    ax.text(3.2, 9.8, "producer: warpgroup 0", ha="center", fontsize=10, weight="bold")
    ax.text(3.2, 9.2, f"setmaxnreg.dec -> {producer_regs} registers", ha="center", fontsize=8.5)
    ax.text(3.2, 6.0, f"thread 0 alone, for tile j\n(slot s = j % {stages}, fill n = j / {stages}):\n\n"
            "1. wait K_empty[s], parity (n-1) % 2\n    (the first fills skip it)\n"
            "2. arrive.expect_tx(K_full[s]),\n    TMA K into the slot\n"
            "3. the same for V: wait V_empty[s],\n    expect_tx, TMA V\n\nthe other 127 threads: done", ha="center",
            va="center", fontsize=8.5)

    box(ax, 9.0, 1.8, 6.9, 8.6, "", "#f4f4f4", lw=1.2)
    ax.text(12.45, 9.8, "ring slot s (shared memory)", ha="center", fontsize=10, weight="bold")
    box(ax, 9.4, 7.6, 2.9, 1.6, "K tile", "#ffffff", size=9)
    box(ax, 12.6, 7.6, 2.9, 1.6, "V tile", "#ffffff", size=9)
    box(ax, 9.4, 5.0, 2.9, 1.5, "K_full[s]", C_BARRIER, size=9, color="white")
    box(ax, 12.6, 5.0, 2.9, 1.5, "V_full[s]", C_BARRIER, size=9, color="white")
    ax.text(12.45, 4.6, "1 arrival (expect_tx) + the tile's bytes", ha="center", fontsize=7.5)
    box(ax, 9.4, 2.6, 2.9, 1.5, "K_empty[s]", C_EMPTY, size=9, color="white")
    box(ax, 12.6, 2.6, 2.9, 1.5, "V_empty[s]", C_EMPTY, size=9, color="white")
    ax.text(12.45, 2.2, f"{arrivals} arrivals: lane 0 of each consumer warp", ha="center", fontsize=7.5)

    box(ax, 18.9, 1.8, 6.9, 8.6, "", "#fff4ea", edge=C_COMPUTE, lw=1.5)
    for i in range(consumers):
        y = 6.2 - i * 4.2
        first, last = i * block_m // consumers, (i + 1) * block_m // consumers - 1
        box(ax, 19.2, y, 6.3, 3.9, "", "#fde0c5", edge=C_COMPUTE, lw=1)
        ax.text(22.35, y + 3.45, f"consumer: warpgroup {i + 1}, rows {first}-{last}", ha="center", fontsize=9.5,
                weight="bold")
        ax.text(22.35, y + 2.95, f"setmaxnreg.inc -> {consumer_regs} registers", ha="center", fontsize=8.5)
        ax.text(22.35, y + 1.35, "4. wait K_full[s], parity n % 2\n5. S = Q K$^T$ (wgmma); arrive K_empty[s]\n"
                "6. softmax; wait V_full[s]\n7. O += P V (wgmma); arrive V_empty[s]", ha="center", va="center",
                fontsize=8.5)

    arrow(ax, (6.1, 8.4), (9.4, 8.4), C_TMA, "2, 3. the TMA unit\nwrites the tiles", size=8, text_offset=(0, 0.55))
    arrow(ax, (6.1, 5.75), (9.4, 5.75), C_TMA, "... and counts\nthe bytes off:\ncomplete_tx", size=8,
          text_offset=(0, 0.7))
    arrow(ax, (15.5, 8.4), (18.9, 8.4), C_COMPUTE, "wgmma reads them", size=8, text_offset=(0, 0.35))
    arrow(ax, (15.5, 5.75), (18.9, 5.75), C_BARRIER, "4, 6. full: wait", size=8, text_offset=(0, 0.35))
    arrow(ax, (18.9, 3.35), (15.5, 3.35), C_EMPTY, "5, 7. empty: arrive", size=8, text_offset=(0, 0.35))
    arrow(ax, (9.4, 3.35), (6.1, 3.35), C_EMPTY, "1. empty: wait", size=8, text_offset=(0, 0.35))

    ax.text(0.3, 1.0, f"No __syncthreads in the loop: the producer runs up to {stages} tiles ahead, each consumer at its "
            "own pace. Every slot's barriers complete one phase per use:\nthe consumers wait on full for fill n "
            "(parity n % 2); the producer's wait on empty before fill n is the consumers' release of fill n - 1 "
            "(parity (n - 1) % 2).", fontsize=9, va="center")

    # Bottom: the register file, split by setmaxnreg.
    ax = fig.add_axes([0.06, 0.03, 0.88, 0.12])
    total = 65536  # the register file of one Hopper SM (32-bit registers)
    used_p = threads_per_group * producer_regs
    used_c = consumers * threads_per_group * consumer_regs
    blank(ax, (0, total), (0, 1.6))
    box(ax, 0, 0.2, used_p, 0.8, "", C_TMA)
    box(ax, used_p, 0.2, used_c, 0.8, f"consumers: {consumers} x {threads_per_group} threads x {consumer_regs} = {used_c}",
        C_COMPUTE, size=9)
    box(ax, used_p + used_c, 0.2, total - used_p - used_c, 0.8, "", "#eeeeee")
    ax.text(0, 1.3, f"the SM's {total} registers: producer {threads_per_group} x {producer_regs} = {used_p} (blue), "
            f"consumers {used_c} (orange), unused {total - used_p - used_c}", fontsize=9)
    return save(fig, "producer_consumer.png")


PICTURES = [picture_tma_ring, picture_tma_swizzle, picture_wgmma_layout, picture_wgmma_descriptors,
            picture_producer_consumer]

if __name__ == "__main__":
    for draw in PICTURES:
        path = draw()
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size // 1024} KB")
