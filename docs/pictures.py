"""The teaching pictures of docs/ (docs/img/*.png), drawn from the kernels' own constants.

    python docs/pictures.py                 # draw every picture into docs/img/
    python docs/pictures.py causal_mask     # only these (file names without .png)
    python docs/pictures.py --check         # which pictures are stale (exit 1 if any), drawing nothing

Every size in a picture (tile heights, ring slots, bytes, register budgets, thresholds, the pair of CTAs, the
4K keys from which pairs run) is read from a step's kernel.cu or from common/*.cuh, and the layouts and schedules
(fragments, swizzle, the persistent grid's rounds, the causal pairing, the split tail) are computed from the
kernels' own formulas, ported here function by function. Part I's pictures read the step that introduces the
mechanism; Part II's read the final step (the last steps/stepNN), which keeps every idea of the ladder. The
only numbers of the pictures' own are the GPU (the H200's 132 SMs) and the example shapes, named below.

HOW A PICTURE STAYS TRUE. Each PNG carries, in a text chunk, the constants it was drawn from (where, name,
value) and a hash of the code that drew it (its function, the helpers it calls, the module constants they
read). `stale()` reads them back and compares them with the tree: a kernel whose constant changed, or a
drawing that changed, without `python docs/pictures.py` run after it, makes verify/tests/test_figures.py fail
with the picture, the constant and both values.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import io
import json
import re
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402
from PIL import Image, PngImagePlugin  # noqa: E402  (Pillow: a dependency of matplotlib)

ROOT = Path(__file__).resolve().parent.parent
IMG = "docs/img"
DPI = 100
META_KEY = "flashladder-picture"  # the PNG text chunk that holds what a picture was drawn from

# The machine and the shapes the pictures take as examples (not read from the kernels: parameters of the pictures).
H200_SMS = 132                    # the H200's SMs: one CTA each in the persistent grid
DENSE_4K = (4, 16, 4096)          # batch, heads, N: a shape of record (16K tokens, 16 heads), 4K keys
GQA_HEADS = (32, 8)               # query heads, K/V heads: the grouped-heads shape of record
ELEM_BYTES = 2                    # bf16
CHUNK_ELEMS = 16 // ELEM_BYTES    # one 16-byte chunk: 8 bf16
ATOM_ROWS = 8                     # one 128-byte swizzle atom: 8 rows of 128 bytes (1024 bytes)

# One colour per role, used the same way in every picture.
C_TMA = "#4c78a8"       # TMA copies, the producer
C_COMPUTE = "#f58518"   # tensor-core work, the consumers
C_SOFTMAX = "#72b7b2"   # softmax (exponentials, max, sums) on the other units
C_BARRIER = "#54a24b"   # mbarriers, "full"
C_EMPTY = "#e45756"     # "empty" barriers
C_WAIT = "#bab0ac"      # waiting
C_GRID = "#555555"
C_LIGHT = "#eeeeee"
CHUNK_COLOURS = plt.get_cmap("tab10").colors[:8]   # 16-byte chunk c % 8
REG_COLOURS = ["#c6dbef", "#7fb2dc", "#fdd0a2", "#f9a65a"]  # a fragment's four registers
PAIR_COLOURS = ["#9ecae1", "#fdae6b"]  # the two CTAs of a pair (rank 0, rank 1)


# ---------------------------------------------------------------- reading the code

class Code:
    """The kernels' sources under `root`, and the constants a picture read from them (`reads`, in order)."""

    def __init__(self, root: Path = ROOT):
        self.root = Path(root)
        self.reads: list[dict] = []

    def final_step(self) -> str:
        """The last steps/stepNN: the final kernel, which keeps every idea of the ladder."""
        steps = sorted(p.name for p in self.root.glob("steps/step[0-9][0-9]") if (p / "kernel.cu").is_file())
        if not steps:
            raise LookupError(f"no steps/stepNN/kernel.cu under {self.root}")
        return steps[-1]

    def path_of(self, where: str) -> Path:
        """`where`: "steps/stepNN/kernel.cu", "common/x.cuh", or "final" (the final step's kernel.cu)."""
        return self.root / (f"steps/{self.final_step()}/kernel.cu" if where == "final" else where)

    def source(self, where: str) -> str:
        """A source without its comments: a constant is what the code says, not what a comment says of it."""
        text = self.path_of(where).read_text()
        return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)

    def read(self, where: str, *names: str, branch: int = 0, cast=int):
        """The value a source gives `NAME = ...` (`constexpr int`, `static constexpr`, a `float 8.f`, an enum member),
        the first of `names` it defines: a number, or an expression of numbers and other constants of the source
        or of common/*.cuh (`BLOCK_M / NUM_CONSUMERS`); for `NAME = COND ? a : b`, a (branch 0) or b (branch 1)."""
        for name in names:
            value = self._value(where, name, branch)
            if value is not None:
                read = {"where": where, "names": list(names), "name": name, "value": cast(value)}
                self.reads.append(read | ({"branch": branch} if branch else {}))
                return read["value"]
        raise LookupError(f"no `{' or '.join(names)} = <number>` in {self.path_of(where).relative_to(self.root)}: "
                          "update docs/pictures.py to the code")

    COMMON = ("common/flashladder.cuh", "common/swizzle.cuh", "common/wgmma.cuh")

    def _value(self, where: str, name: str, branch: int = 0, depth: int = 0):
        """`name`'s value in `where` (then in common/), or None."""
        for source in (where, *self.COMMON):
            text = self.source(source)
            for m in re.finditer(rf"\b{name}\s*=\s*([^;,{{}}]+?)\s*[,;}}]", text):
                expr = m.group(1)
                cond = re.fullmatch(r"[\w:<>]+\s*\?\s*(.+?)\s*:\s*(.+)", expr)
                if cond:
                    expr = cond.group(1 + branch)
                value = self._evaluate(expr, where, depth)
                if value is not None:
                    return value
        return None

    def _evaluate(self, expr: str, where: str, depth: int):
        expr = re.sub(r"sizeof\((?:__nv_bfloat16|__half|Bits16)\)", str(ELEM_BYTES), expr)  # 16-bit elements (step40: Bits16)
        expr = re.sub(r"(\d+(?:\.\d*)?)f\b", r"\1", expr)
        if depth > 8:
            return None
        for ident in sorted(set(re.findall(r"\b[A-Za-z_]\w*\b", expr)), key=len, reverse=True):
            value = self._value(where, ident, 0, depth + 1)
            if value is None:
                return None
            expr = re.sub(rf"\b{ident}\b", repr(value), expr)
        if not re.fullmatch(r"[\d.\s()+\-*/%]+", expr):
            return None
        return eval(expr.replace("/", "//") if "." not in expr else expr)  # C's integer division; only digits and operators

    def find(self, where: str, pattern: str, what: str) -> list[str]:
        """The groups of a regular expression's first match in a source without comments (an instruction's shape)."""
        m = re.search(pattern, self.source(where))
        if not m:
            raise LookupError(f"no {what} (/{pattern}/) in {self.path_of(where).relative_to(self.root)}: "
                              "update docs/pictures.py to the code")
        self.reads.append({"where": where, "pattern": pattern, "name": what, "value": list(m.groups())})
        return list(m.groups())

    # The constants of common/ that many pictures use.
    def head_dim(self) -> int:
        return self.read("common/flashladder.cuh", "HEAD_DIM")

    def box_cols(self) -> int:
        """A TMA box row: 64 bf16 = 128 bytes, the widest row the 128-byte swizzle takes."""
        return self.read("common/swizzle.cuh", "TMA_HALF_COLS")

    def step(self, step: str, *names: str, **kw):
        return self.read(f"steps/{step}/kernel.cu", *names, **kw)

    def final(self, *names: str, **kw):
        return self.read("final", *names, **kw)

    def again(self, read: dict):
        """A recorded read done again on this tree: its value now (LookupError where it is gone)."""
        if "pattern" in read:
            return self.find(read["where"], read["pattern"], read["name"])
        return self.read(read["where"], *read["names"], branch=read.get("branch", 0), cast=type(read["value"]))


# ---------------------------------------------------------------- the registry, the fingerprint, the PNG

PICTURES: dict[str, callable] = {}  # file name -> the function that draws it (fig = draw(code))


def picture(name: str):
    def register(draw):
        PICTURES[name] = draw
        return draw
    return register


def _names(code) -> set[str]:
    out = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            out |= _names(const)
    return out


def code_text(draw) -> str:
    """The source a picture depends on: its function, the module's functions it calls (transitively), and the
    values of the module constants they read."""
    module = sys.modules[draw.__module__]
    parts, seen, todo = [], set(), [draw]
    while todo:
        fn = todo.pop()
        if fn.__name__ in seen:
            continue
        seen.add(fn.__name__)
        parts.append(inspect.getsource(fn))
        for name in sorted(_names(fn.__code__)):
            obj = getattr(module, name, None)
            if inspect.isfunction(obj) and obj.__module__ == draw.__module__:
                todo.append(obj)
            elif inspect.isclass(obj) and obj.__module__ == draw.__module__ and name not in seen:
                seen.add(name)
                parts.append(inspect.getsource(obj))
            elif isinstance(obj, (int, float, str, tuple)) and not name.startswith("__") and name not in seen:
                seen.add(name)
                parts.append(f"{name} = {obj!r}")
    return "\n".join(parts)


def fingerprint(name: str, code: Code) -> dict:
    return {"picture": name, "generator": "docs/pictures.py", "reads": code.reads,
            "code": hashlib.sha256(code_text(PICTURES[name]).encode()).hexdigest()[:16]}


def draw(name: str, root: Path = ROOT, out: Path | None = None) -> Path:
    """Draw one picture from the sources under `root` into `out` (default root/docs/img)."""
    code = Code(root)
    fig = PICTURES[name](code)
    out = Path(out or root / IMG)
    out.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=DPI, format="png")
    plt.close(fig)
    info = PngImagePlugin.PngInfo()
    info.add_text(META_KEY, json.dumps(fingerprint(name, code), sort_keys=True))
    # A 256-colour palette: flat diagrams lose nothing and the files stay ~3x smaller.
    image = Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    image.save(out / name, optimize=True, pnginfo=info)
    return out / name


def drawn_from(png: Path) -> dict | None:
    """What a PNG says it was drawn from (None: no such record, so not drawn by this module)."""
    text = Image.open(png).text.get(META_KEY)
    return json.loads(text) if text else None


def stale(png: Path, root: Path = ROOT) -> list[str]:
    """Why `png` no longer shows what the code under `root` says (empty: it is up to date)."""
    where = f"{IMG}/{png.name}"
    meta = drawn_from(png)
    if meta is None:
        return [f"{where}: not drawn by docs/pictures.py (no {META_KEY} record in the PNG)"]
    name = meta.get("picture")
    if name not in PICTURES or name != png.name:
        return [f"{where}: drawn as {name!r}, which docs/pictures.py no longer draws"]
    problems, code = [], Code(root)
    for read in meta["reads"]:
        try:
            now = code.again(read)
        except LookupError as e:
            problems.append(f"{where}: drawn with {read['name']} = {read['value']} from {_source(read)}, {e}")
            continue
        if now != read["value"]:
            problems.append(f"{where}: drawn with {read['name']} = {read['value']} from {_source(read)}, which now says {now}")
    if meta.get("code") != fingerprint(name, Code(root))["code"]:
        problems.append(f"{where}: the code that draws it (docs/pictures.py, {PICTURES[name].__name__} and its helpers) changed")
    return [p + ": run `python docs/pictures.py`" for p in problems]


def _source(read: dict) -> str:
    return "the final step's kernel.cu" if read["where"] == "final" else read["where"]


# ---------------------------------------------------------------- drawing helpers

def box(ax, x, y, w, h, text="", colour="white", edge=C_GRID, size=9, alpha=1.0, lw=1.0, hatch=None, **kw):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor=edge, alpha=alpha, lw=lw, hatch=hatch))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, **kw)


def arrow(ax, start, end, colour=C_GRID, text="", size=8, style="-|>", text_offset=(0, 0), ls="-", lw=1.3, **kw):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=colour, lw=lw, ls=ls,
                                 shrinkA=2, shrinkB=2, **kw))
    if text:
        ax.text((start[0] + end[0]) / 2 + text_offset[0], (start[1] + end[1]) / 2 + text_offset[1], text, fontsize=size,
                ha="center", va="center", color=colour)


def blank(ax, xlim, ylim):
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_axis_off()


def caption(fig, text: str, y: float = 0.01, width: int = 170, size: float = 9, x: float = 0.5):
    """A note under a picture, wrapped to `width` characters a line; a blank line starts a new paragraph."""
    lines = "\n".join(textwrap.fill(par, width) for par in text.split("\n\n"))
    fig.text(x, y, lines, ha="center" if x == 0.5 else "left", va="bottom", fontsize=size)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def lane(ax, y, label, size=9):
    ax.text(-0.15, y + 0.35, label, ha="right", va="center", fontsize=size)


# ---------------------------------------------------------------- steps 01-07: the algorithm on any GPU since Ampere

@picture("tiling.png")
def tiling(k: Code):
    block_m, block_n, head_dim = k.step("step01", "BLOCK_M"), k.step("step01", "BLOCK_N"), k.head_dim()
    n_tiles = 8                                  # an example of 8 K/V tiles
    n = n_tiles * block_n
    q_tiles = n // block_m
    i, j = min(2, q_tiles - 1), 5                # the CTA shown, and the K/V tile it is at
    d = head_dim / block_n                       # the head dim in units of K/V tiles
    fig = plt.figure(figsize=(12, 7.4))
    fig.suptitle(f"step01: Q in tiles of {block_m} rows, K and V in tiles of {block_n} keys; one CTA per Q tile walks every "
                 "K/V tile", fontsize=13)
    ax = fig.add_axes([0.01, 0.01, 0.98, 0.9])
    bm = block_m / block_n                       # a Q tile's height in the same units
    top = q_tiles * bm
    blank(ax, (-d - 1.0, n_tiles + 15.5), (-1.6, top + d + 1.0))
    # Q on the left, K^T on top, S = Q K^T in the middle.
    for qi in range(q_tiles):
        box(ax, -d - 0.6, top - (qi + 1) * bm, d, bm, f"Q tile {qi}" if qi == i else "", C_TMA if qi == i else C_LIGHT,
            size=8, color="white" if qi == i else "black")
    ax.text(-d / 2 - 0.6, top + 0.2, f"Q [{n} x {head_dim}]", ha="center", fontsize=9)
    for kj in range(n_tiles):
        box(ax, kj, top + 0.4, 1, d, f"K{kj}" if kj <= j else "", C_TMA if kj == j else C_LIGHT, size=8,
            color="white" if kj == j else "black")
        for qi in range(q_tiles):
            if qi != i:
                box(ax, kj, top - (qi + 1) * bm, 1, bm, "", "white", edge="#cccccc", lw=0.5)
            else:
                colour = C_COMPUTE if kj == j else "#fde0c5" if kj < j else "white"
                box(ax, kj, top - (qi + 1) * bm, 1, bm, f"S{qi},{kj}" if kj <= j else "", colour, size=8)
    ax.text(n_tiles / 2, top + d + 0.6, f"K$^T$ [{head_dim} x {n}]", ha="center", fontsize=9)
    ax.text(n_tiles / 2, -0.5, f"S = Q K$^T$ [{n} x {n}]: never stored whole. CTA {i} computes its row of tiles one at a "
            f"time,\nleft to right; the {block_m} x {block_n} scores of a tile live only while it is processed.",
            ha="center", va="top", fontsize=9)
    arrow(ax, (0.2, top - (i + 1) * bm - 0.25), (n_tiles - 0.2, top - (i + 1) * bm - 0.25), C_COMPUTE, style="-|>")
    # V below-right, and the update of O.
    x0 = n_tiles + 1.2
    for kj in range(n_tiles):
        box(ax, x0, top - (kj + 1), d, 1, f"V{kj}" if kj <= j else "", C_TMA if kj == j else C_LIGHT, size=8,
            color="white" if kj == j else "black")
    ax.text(x0 + d / 2, top + 0.2, f"V [{n} x {head_dim}]", ha="center", fontsize=9)
    x1 = x0 + d + 1.2
    box(ax, x1, top - (i + 1) * bm, d, bm, f"O tile {i}\n(registers)", C_COMPUTE, size=8)
    ax.text(x1 + d / 2, top + 0.2, f"O [{n} x {head_dim}]", ha="center", fontsize=9)
    smem = (block_m + 2 * block_n) * head_dim * ELEM_BYTES
    ax.text(x1 + d + 0.6, top,
            f"For K/V tile {j}, CTA {i}:\n"
            f"1. loads K{j} and V{j} ({block_n} x {head_dim} bf16 each)\n   into shared memory, beside Q tile {i}: "
            f"{smem // 1024} KB\n"
            f"2. S = Q K{j}$^T$ ({block_m} x {block_n} scores)\n"
            "3. the online softmax of each row (next picture)\n"
            f"4. O += P V{j}\n\nAfter the last tile: O / l, stored once.\n"
            "Memory traffic: Q, K, V read, O written;\nthe N x N scores never leave the chip.",
            fontsize=9, va="top")
    return fig


def online_softmax_row(scores: np.ndarray, block_n: int):
    """The online softmax of one row, tile by tile (verify/model.py's loop, for one row): after each tile the
    running max m, the rescale factor alpha = exp(m_old - m_new) and the running sum l."""
    m, row_sum, out = -np.inf, 0.0, []
    for j in range(len(scores) // block_n):
        s = scores[j * block_n:(j + 1) * block_n]
        m_new = max(m, s.max())
        alpha = np.exp(m - m_new)
        row_sum = alpha * row_sum + np.exp(s - m_new).sum()
        out.append({"tile_max": s.max(), "m": m_new, "alpha": alpha, "l": row_sum})
        m = m_new
    return out


@picture("online_softmax.png")
def online_softmax(k: Code):
    block_n = k.step("step01", "BLOCK_N")
    n_tiles = 8
    rng = np.random.default_rng(7)
    scores = rng.normal(0.0, 1.0, n_tiles * block_n)
    for j, bump in ((2, 1.6), (5, 2.6)):          # two tiles whose keys score higher: the max moves there
        scores[j * block_n:(j + 1) * block_n] += bump
    steps = online_softmax_row(scores, block_n)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 7.4), gridspec_kw={"height_ratios": [3, 2]})
    fig.suptitle(f"The online softmax: one query row across {n_tiles} K/V tiles of {block_n} keys (step01; every step since)",
                 fontsize=13)
    x = np.arange(len(scores))
    ax.scatter(x, scores, s=4, color=C_TMA, label="the row's scores s (scale folded in)")
    for j, st in enumerate(steps):
        a, b = j * block_n, (j + 1) * block_n
        ax.axvline(a, color="#cccccc", lw=0.8)
        ax.plot([a, b], [st["m"]] * 2, color=C_COMPUTE, lw=2.5, label="running max m after the tile" if j == 0 else None)
        if j and st["alpha"] < 1:
            ax.text(a + 1, st["m"] + 0.12, f"alpha = {st['alpha']:.2f}", fontsize=8, va="bottom", color=C_COMPUTE)
        ax.text((a + b) / 2, scores.min() - 0.3, f"tile {j}", ha="center", fontsize=8)
    big = min(range(1, n_tiles), key=lambda j: steps[j]["alpha"])  # the largest move
    ax.annotate("where a tile's max is above the running max, the max moves, and\nwhat was summed before (l and O) is "
                "multiplied by alpha = exp(m_old - m_new)", xy=(big * block_n + 2, steps[big]["m"]),
                xytext=(block_n * 0.3, steps[big]["m"] + 0.9), fontsize=9, arrowprops=dict(arrowstyle="->", color=C_GRID))
    ax.set_xlim(0, len(scores))
    ax.set_ylim(scores.min() - 0.7, scores.max() + 2.0)
    ax.set_xticks([])
    ax.set_ylabel("score")
    ax.legend(loc="upper right", fontsize=8.5)
    total = np.exp(scores - steps[-1]["m"]).sum()
    ls = [st["l"] * np.exp(st["m"] - steps[-1]["m"]) for st in steps]
    ax2.bar(np.arange(n_tiles), [st["l"] for st in steps], width=0.4, color=C_COMPUTE, label="l after tile j, relative to "
            "its m: l = alpha l + sum exp(s - m)")
    ax2.bar(np.arange(n_tiles) + 0.42, ls, width=0.4, color=C_SOFTMAX, label="the same sums relative to the final m")
    ax2.axhline(total, color=C_GRID, ls="--", lw=1, label="the row's whole sum, relative to the final m")
    ax2.set_xticks(np.arange(n_tiles) + 0.21, [f"after tile {j}" for j in range(n_tiles)], fontsize=8)
    ax2.legend(loc="upper left", fontsize=8.5)
    ax2.set_ylabel("row sum l")
    fig.text(0.5, 0.005, "Each tile is seen once: its exponentials use the max so far, and whenever the max moves, what was "
             "summed before (l, and O = sum exp(s - m) v) is multiplied by alpha.\nAfter the last tile l is the whole "
             "sum (the dashed line), and O / l is exactly softmax(s) V: verify/model.py checks it in float64.",
             ha="center", fontsize=9)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.92, bottom=0.12, hspace=0.25)
    return fig


def mma_owner(fragment: str, row: int, col: int) -> tuple[int, int]:
    """(lane, register) of element (row, col) of mma.m16n8k16's A [16 x 16], B [16 x 8] (k, n) or C [16 x 8] fragment,
    as the PTX ISA defines them (groupID g = lane / 4, threadID_in_group t = lane % 4); a register holds two elements."""
    if fragment == "A":   # a0,a1: (g, 2t..2t+1), a2,a3: (g+8, ..), a4..a7: the same, 8 columns on: 4 registers
        return 4 * (row % 8) + (col % 8) // 2, (row // 8) + 2 * (col // 8)
    if fragment == "B":   # b0,b1: (k = 2t..2t+1, n = g), b2,b3: k + 8: 2 registers
        return 4 * col + (row % 8) // 2, row // 8
    return 4 * (row % 8) + col // 2, row // 8   # C: c0,c1: (g, 2t..2t+1), c2,c3: (g+8, ..): 2 registers of pairs


@picture("mma_fragments.png")
def mma_fragments(k: Code):
    m, n, kk = (int(v) for v in k.find("common/ptx.cuh", r"mma\.sync\.aligned\.m(\d+)n(\d+)k(\d+)", "mma.sync's shape"))
    fig = plt.figure(figsize=(13, 6.6))
    fig.suptitle(f"step02: mma.sync.m{m}n{n}k{kk}, D [{m} x {n}] += A [{m} x {kk}] B [{kk} x {n}]: which lane holds which "
                 "element (T lane, in register colour)", fontsize=12)
    ax = fig.add_axes([0.01, 0.01, 0.98, 0.86])
    blank(ax, (-1.5, kk + n + n + 6.5), (-5.2, m + 1.6))
    panels = [("A", 0, m, kk, "A (Q, or P): 4 registers, 8 bf16"), ("B", kk + 2, kk, n, "B (K, or V): 2 registers, 4 bf16"),
              ("C", kk + n + 4, m, n, "C, D (S, or O): 4 fp32 registers")]
    for frag, x0, rows, cols, title in panels:
        ax.text(x0 + cols / 2, m + 0.9, title, ha="center", fontsize=10)
        for r in range(rows):
            for c in range(cols):
                lane_, reg = mma_owner(frag, r, c)
                if frag == "C":
                    reg = 2 * reg + c % 2          # C's registers hold one fp32 each: c0..c3
                box(ax, x0 + c, m - 1 - r, 1, 1, f"T{lane_}", REG_COLOURS[reg % 4], size=5.2, lw=0.3)
            if frag != "B" or r % 8 == 0:
                ax.text(x0 - 0.15, m - 0.5 - r, str(r), ha="right", va="center", fontsize=6)
        for c in range(cols):
            ax.text(x0 + c + 0.5, m + 0.15, str(c), ha="center", fontsize=6)
    for reg in range(4):
        box(ax, 11 * reg, -1.6, 0.8, 0.8, "", REG_COLOURS[reg])
        ax.text(11 * reg + 1.0, -1.2, f"register {reg}: A's a{reg}, " + (f"B's b{reg}, " if reg < 2 else "") + f"C's c{reg}",
                fontsize=8.5, va="center")
    ax.text(0, -2.6, "g = lane / 4 picks the row (and g + 8), t = lane % 4 the pair of columns 2t, 2t + 1. A row of C (a row of S) "
            "is spread over the 4 lanes of a quad,\nso the softmax's row max and row sum take two shuffles (xor 1, xor 2). "
            "The C fragments of two neighbouring 8-key blocks of S, rounded to bf16,\nare exactly an A fragment of P: "
            "P goes from the accumulators into the next mma without shared memory. common/ptx.cuh: mma_m16n8k16_bf16_f32.",
            fontsize=9, va="top")
    return fig


@picture("ldmatrix.png")
def ldmatrix(k: Code):
    rows_per_warp = k.step("step02", "ROWS_PER_WARP")
    row_expr, col_expr = k.find("steps/step02/kernel.cu", r"ldmatrix_x4\(Q_frag\[kk\], Q_smem \+ \((.*?)\) \* HEAD_DIM \+ (.*?)\);",
                                "ldmatrix.x4's address of Q")
    fig = plt.figure(figsize=(13, 6.4))
    fig.suptitle(f"step02: ldmatrix.x4 loads a warp's {rows_per_warp} x 16 slice of Q from shared memory into the A fragment "
                 "of mma", fontsize=12)
    ax = fig.add_axes([0.01, 0.01, 0.98, 0.88])
    blank(ax, (-3, 33), (-5.4, 17.6))
    matrix_colours = ["#c6dbef", "#7fb2dc", "#fdd0a2", "#f9a65a"]
    ax.text(4, 16.9, "shared memory: 16 rows, each two 16-byte chunks\n(8 bf16 each); the lane that gives each address",
            ha="center", fontsize=9)
    for ln in range(32):
        r, chunk = ln % 16, ln // 16                 # step02: row lane % 16, dims + (lane / 16) * 8
        box(ax, chunk * 4, 15 - r, 4, 1, f"lane {ln}: row {r}", matrix_colours[ln // 8], size=7.5)
    for chunk in range(2):
        ax.text(chunk * 4 + 2, 16.15, f"dims {8 * chunk}-{8 * chunk + 7}", ha="center", fontsize=8)
        for half in range(2):
            ax.text(-0.2 if chunk == 0 else 8.2, 11.5 - 8 * half, f"matrix {2 * chunk + half}", fontsize=8.5, va="center",
                    ha="right" if chunk == 0 else "left")
    ax.text(4, -0.6, f"the lane's address: Q_smem + ({row_expr}) * HEAD_DIM\n + {col_expr}   (step02/kernel.cu)", ha="center",
            va="top", fontsize=8.5)
    arrow(ax, (10.5, 8), (14, 8), C_GRID, "ldmatrix.x4", size=9, text_offset=(0, 0.5))
    x0 = 15.5
    ax.text(x0 + 8, 16.9, "registers: matrix i (the addresses of lanes 8i .. 8i + 7)\ngoes to register i of every lane",
            ha="center", fontsize=9)
    for r in range(16):
        for c in range(16):
            ln, reg = mma_owner("A", r, c)
            box(ax, x0 + c, 15 - r, 1, 1, f"T{ln}" if c % 2 == 0 else "", matrix_colours[reg], size=6, lw=0.3)
    ax.text(x0 + 8, -0.6, "= mma's A fragment: register i of lane l holds row l/4 (+8), columns 2(l%4), +1 (+8)\n"
            "of matrix i: a0 to a3 with no shuffle and no address per element.", ha="center", va="top", fontsize=8.5)
    ax.text(-2.5, -3.0, "Each 8 x 8 matrix is 8 rows of 16 bytes: one shared-memory request per matrix, if the 8 rows sit in "
            "different banks (step04).\nK, stored [key, dim], is already mma's B (\"col\") layout: ldmatrix without .trans. V, "
            "also [key, dim], is needed k-major for O += P V:\nldmatrix.trans hands each lane the transposed pairs. step06 loads "
            "K and V four matrices at a time (.x4).", fontsize=8.5, va="top")
    return fig


@picture("bank_conflicts.png")
def bank_conflicts(k: Code):
    head_dim = k.head_dim()
    (atom,) = (int(v) for v in k.find("common/swizzle.cuh", r"chunk \^ \(row % (\d+)\)", "swizzle_128b's XOR"))
    chunks = head_dim * ELEM_BYTES // 16
    fig = plt.figure(figsize=(13, 6.4))
    fig.suptitle(f"step04: rows of {head_dim} bf16 ({head_dim * ELEM_BYTES} bytes); an ldmatrix reads chunk 0 of {atom} rows",
                 fontsize=13)
    for panel, swizzled in enumerate((False, True)):
        ax = fig.add_axes([0.01 + 0.5 * panel, 0.02, 0.48, 0.86])
        blank(ax, (-2.5, chunks + 0.5), (-6.5, atom + 2.2))
        ax.text(chunks / 2, atom + 1.5, "swizzled: chunk c of row r stored at c ^ (r % 8)" if swizzled else
                "plain: chunk c of row r stored at position c", ha="center", fontsize=11)
        hits = [0] * 8
        for r in range(atom):
            ax.text(-0.2, atom - 0.5 - r, f"row {r}", ha="right", va="center", fontsize=8)
            for pos in range(chunks):
                c = (pos % 8 ^ r % 8) + pos // 8 * 8 if swizzled else pos
                read = c == 0
                if read:
                    hits[pos % 8] += 1
                box(ax, pos, atom - 1 - r, 1, 1, str(c), CHUNK_COLOURS[c % 8], size=7, alpha=1.0 if read else 0.35,
                    lw=2.5 if read else 0.5, edge="black" if read else C_GRID)
        for pos in range(chunks):
            ax.text(pos + 0.5, atom + 0.15, f"{4 * (pos % 8)}-{4 * (pos % 8) + 3}", ha="center", fontsize=6, rotation=90)
        ax.text(-0.2, atom + 0.5, "banks", ha="right", fontsize=7)
        for g in range(8):
            box(ax, 2 * g, -3.3, 2, 2.2 * hits[g] / atom + 0.02, "", C_EMPTY if hits[g] > 1 else C_BARRIER)
            ax.text(2 * g + 1, -3.6, f"{4 * g}-{4 * g + 3}", ha="center", va="top", fontsize=7)
            if hits[g]:
                ax.text(2 * g + 1, -3.2 + 2.2 * hits[g] / atom, str(hits[g]), ha="center", va="bottom", fontsize=8)
        worst = max(hits)
        ax.text(chunks / 2, -4.6, f"requests per group of 4 banks: {worst} on one group, {worst} wavefronts"
                if worst > 1 else "one request per group of 4 banks: 1 wavefront", ha="center", va="top", fontsize=9.5,
                color=C_EMPTY if worst > 1 else C_BARRIER)
    fig.text(0.5, 0.005, f"32 banks of 4 bytes span 128 bytes, so chunk positions p and p + 8 share banks, and a "
             f"{head_dim * 2}-byte row puts chunk 0 of every row on banks 0-3.\nThe XOR by the row (common/swizzle.cuh) spreads "
             f"the {atom} chunks over all 32 banks; writers and readers use the same function. TMA's 128-byte swizzle (step08) "
             "is the same idea, in hardware.", ha="center", fontsize=9)
    return fig


def pipeline_schedule(stages: int, tiles: int, load: float, compute: float):
    """steps 04-05: with one buffer each tile is loaded, waited for and computed in turn; with `stages` buffers the
    copies of tile j + 1 are issued before tile j is computed, and one wait + barrier per tile closes both."""
    loads, computes, t = [], [], 0.0
    if stages == 1:
        for _ in range(tiles):
            loads.append((t, t + load))
            computes.append((t + load, t + load + compute))
            t += load + compute
        return loads, computes
    loads.append((0.0, load))
    t = load
    for j in range(tiles):
        if j + 1 < tiles:
            loads.append((t, t + load))
        computes.append((t, t + compute))
        t = max(t + compute, loads[-1][1] if j + 1 < tiles else 0.0)
    return loads, computes


@picture("cp_async_pipeline.png")
def cp_async_pipeline(k: Code):
    stages, block_n = k.step("step05", "STAGES"), k.step("step05", "BLOCK_N")
    tiles, load, compute = 6, 1.0, 1.3
    fig = plt.figure(figsize=(12, 5.6))
    fig.suptitle(f"steps 04 -> 05: K/V tiles of {block_n} keys through 1 buffer, then through {stages} (cp.async)",
                 fontsize=13)
    ax = fig.add_axes([0.12, 0.2, 0.86, 0.7])
    single, double = pipeline_schedule(1, tiles, load, compute), pipeline_schedule(stages, tiles, load, compute)
    end = max(single[1][-1][1], double[1][-1][1])
    blank(ax, (-0.2, end + 0.3), (-0.6, 5.2))
    for y0, (loads, computes), title in ((3.0, single, "step04, one buffer"), (0.0, double, f"step05, {stages} buffers")):
        ax.text(0, y0 + 2.1, title, ha="left", fontsize=10, weight="bold")
        lane(ax, y0 + 1.1, "copies in flight")
        lane(ax, y0, "tensor cores, softmax")
        for j, (a, b) in enumerate(loads):
            box(ax, a, y0 + 1.1, b - a, 0.7, f"tile {j} -> buf {j % stages if y0 == 0 else 0}", C_TMA, size=7.5,
                color="white")
        for j, (a, b) in enumerate(computes):
            box(ax, a, y0, b - a, 0.7, f"tile {j}", C_COMPUTE, size=8)
            ax.plot([b, b], [y0 - 0.1, y0 + 1.9], color=C_BARRIER, lw=1.2, ls=":")
    ax.annotate("time", xy=(end, -0.45), xytext=(end - 1.2, -0.45), fontsize=9, va="center",
                arrowprops=dict(arrowstyle="->", color=C_GRID))
    fig.text(0.02, 0.02, "A schematic, not a measurement: a tile's copies take 1.0, its math 1.3 (units of time). Dotted: "
             "cp.async.wait_group + __syncthreads, once per tile.\nWith one buffer the tile's loads and its math alternate. "
             f"With {stages}, the copies of tile j + 1 are issued into the other buffer before tile j is computed, so they "
             "land during its math;\nthe one barrier per tile says both that tile j + 1 has landed and that every warp is done "
             "with the buffer the next copies overwrite.", fontsize=9)
    return fig


@picture("two_row_blocks.png")
def two_row_blocks(k: Code):
    warps6, rows6 = k.step("step06", "NUM_WARPS"), k.step("step06", "ROWS_PER_WARP")
    warps7, rows7, m_blocks = k.step("step07", "NUM_WARPS"), k.step("step07", "ROWS_PER_WARP"), k.step("step07", "M_BLOCKS")
    block_m, block_n, head_dim = k.step("step07", "BLOCK_M"), k.step("step07", "BLOCK_N"), k.head_dim()
    tile_kb = 2 * block_n * head_dim * ELEM_BYTES // 1024    # K and V of one tile
    fig = plt.figure(figsize=(12, 6.4))
    fig.suptitle(f"step07: {warps7} warps of {rows7} rows instead of {warps6} of {rows6}: every K/V fragment read from shared "
                 f"memory feeds {m_blocks} mma", fontsize=12)
    for panel, (warps, rows, step) in enumerate(((warps6, rows6, "step06"), (warps7, rows7, "step07"))):
        ax = fig.add_axes([0.01 + 0.5 * panel, 0.13, 0.48, 0.78])
        blank(ax, (-3.5, 12), (-1.2, block_m / 8 + 1.6))
        ax.text(4.5, block_m / 8 + 1.0, f"{step}: the CTA's {block_m} query rows, {warps} warps", ha="center", fontsize=11)
        box(ax, 9, block_m / 16 - 1.5, 2.5, 3, f"K/V tile\n{block_n} keys\n(shared\nmemory)", C_TMA, size=8, color="white")
        for w in range(warps):
            y = block_m / 8 - (w + 1) * rows / 8
            for mb in range(rows // 16):
                box(ax, 0, y + (rows // 16 - 1 - mb) * 2, 5, 2, f"warp {w}, rows {w * rows + 16 * mb}-{w * rows + 16 * mb + 15}",
                    C_COMPUTE if mb else "#fdd0a2", size=7.5)
            box(ax, 5.5, y + rows / 16 - 0.6, 1.6, 1.2, "frag", C_LIGHT, size=7)
            arrow(ax, (9, block_m / 16), (7.1, y + rows / 16), C_TMA, lw=0.8)
            for mb in range(rows // 16):
                arrow(ax, (5.5, y + rows / 16), (5.0, y + (rows // 16 - 1 - mb) * 2 + 1), C_COMPUTE)
        ax.text(4.5, -0.8, f"each warp reads the whole tile: {warps} x {tile_kb} KB = {warps * tile_kb} KB\nof shared-memory "
                "reads per K/V tile", ha="center", va="top", fontsize=9)
    caption(fig, "A fragment is loaded once per warp (ldmatrix) and used by every mma of that warp's rows. With two 16-row "
            "blocks per warp (FlashAttention-2's tiling) the same math reads half the bytes from shared memory, and each warp has "
            "two independent mma chains to interleave; the price is twice the accumulator registers per thread.")
    return fig


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


@picture("tma_ring.png")
def tma_ring(k: Code):
    head_dim = k.head_dim()
    stages, block_n = k.step("step08", "STAGES"), k.step("step08", "BLOCK_N")
    tile_bytes = block_n * head_dim * ELEM_BYTES
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
    ax.text(0.1, 5.0, f"One fill of slot s (a K tile: {block_n} rows x {head_dim} bf16 = {tile_bytes} bytes; V the same "
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
    return fig


@picture("tma_swizzle.png")
def tma_swizzle(k: Code):
    head_dim, box_cols = k.head_dim(), k.box_cols()
    chunks_per_row = head_dim // CHUNK_ELEMS            # 16 chunks in a 256-byte row
    chunks_per_half = box_cols // CHUNK_ELEMS          # 8 in a 128-byte box row
    fig = plt.figure(figsize=(12, 5.9))
    fig.suptitle("TMA's 128-byte swizzle on a 256-byte row: two 64-column halves; in each, chunk c of row r is "
                 "stored at c ^ (r % 8)", fontsize=12)
    ax = fig.add_axes([0.01, 0.02, 0.98, 0.88])
    blank(ax, (-1.5, 36), (-3.6, 10.2))
    ax.text(0, 9.6, f"global memory: rows of {head_dim} bf16 = {chunks_per_row} chunks of 16 bytes", fontsize=10)
    for r in range(ATOM_ROWS):
        ax.text(-0.3, ATOM_ROWS - 1 - r + 0.5, f"row {r}", ha="right", va="center", fontsize=8)
        for c in range(chunks_per_row):
            box(ax, c, ATOM_ROWS - 1 - r, 1, 1, str(c), CHUNK_COLOURS[c % 8], size=8,
                alpha=1.0 if c < chunks_per_half else 0.55)
    arrow(ax, (16.3, 4), (18.2, 4), C_TMA, "TMA", size=9, text_offset=(0, 0.4))
    x0 = 19
    ax.text(x0, 9.6, "shared memory: half 0 (chunks 0-7) then half 1 (chunks 8-15)", fontsize=10)
    for h in range(head_dim // box_cols):
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
    return fig


# ---------------------------------------------------------------- step09: wgmma

@picture("wgmma_layout.png")
def wgmma_layout(k: Code):
    block_n = k.step("step09", "BLOCK_N")
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
    return fig


@picture("wgmma_descriptors.png")
def wgmma_descriptors(k: Code):
    head_dim, box_cols = k.head_dim(), k.box_cols()
    block_n = k.step("step09", "BLOCK_N")
    row_bytes, atom_bytes = box_cols * ELEM_BYTES, ATOM_ROWS * box_cols * ELEM_BYTES
    half_bytes = block_n * row_bytes
    kstep_bytes = 16 * ELEM_BYTES
    ksteps_per_half = box_cols // 16
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
    ax.text(9.5, -1.2, f"k-step kk of O += P V (orange: kk = {kk}) is keys 16kk to 16kk + 15, all {head_dim} dims:\n"
            f"wgmma_desc(V tile + kk * 2 * {atom_bytes}, LBO = {half_bytes}, SBO = {atom_bytes}),\n"
            "read transposed (imm-trans-b = 1). SBO steps along K (8 keys), LBO along N.", ha="center", va="top",
            fontsize=9)
    return fig


# ---------------------------------------------------------------- step10: producer and consumers

@picture("producer_consumer.png")
def producer_consumer(k: Code):
    producer_regs, consumer_regs = k.step("step10", "PRODUCER_REGS"), k.step("step10", "CONSUMER_REGS")
    consumers, stages = k.step("step10", "NUM_CONSUMERS"), k.step("step10", "STAGES")
    block_m = k.step("step10", "BLOCK_M")
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
    return fig




# ---------------------------------------------------------------- steps 11-14: the order of the work

def pingpong_schedule(consumers: int, blocks: int, gemm: float, softmax: float):
    """step11's turns: consumer c issues its GEMM block j once its softmax j-1 is done AND the previous block
    (the other consumer's) has been issued; the tensor cores run the blocks in the order issued. Returns, per
    consumer, its (issue, start, end) of each block and the turn waits (ready, issue)."""
    tensor_free, last_issue, ready = 0.0, 0.0, [0.0] * consumers
    blocks_of = {c: [] for c in range(consumers)}
    waits = {c: [] for c in range(consumers)}
    for j in range(blocks):
        for c in range(consumers):
            issue = max(ready[c], last_issue)
            if issue > ready[c] + 1e-9:
                waits[c].append((ready[c], issue))
            start = max(issue, tensor_free)
            end = start + gemm
            blocks_of[c].append((issue, start, end))
            tensor_free, last_issue = end, issue + 0.05
            ready[c] = end + softmax
    return blocks_of, waits


@picture("pingpong.png")
def pingpong(k: Code):
    consumers = k.step("step11", "NUM_CONSUMERS")
    turn0, turn1 = k.step("step11", "CONSUMER0_TURN"), k.step("step11", "CONSUMER1_TURN")
    gemm, softmax, blocks = 1.0, 0.8, 4
    blocks_of, waits = pingpong_schedule(consumers, blocks, gemm, softmax)
    end = max(e for c in blocks_of for _, _, e in blocks_of[c]) + softmax
    fig = plt.figure(figsize=(13, 5.8))
    fig.suptitle(f"step11: ping-pong, {consumers} consumer warpgroups take turns on the tensor cores (named barriers "
                 f"{turn0} and {turn1})", fontsize=13)
    ax = fig.add_axes([0.14, 0.24, 0.84, 0.66])
    blank(ax, (-0.1, end + 0.2), (-0.7, 4.4))
    rows = {"tensor cores": 3.2, **{f"consumer {c}": 2.0 - 1.2 * c for c in range(consumers)}}
    for label, y in rows.items():
        lane(ax, y, label if label == "tensor cores" else f"{label}\n(warpgroup {int(label[-1]) + 1})")
    colours = [C_COMPUTE, "#e0a060"]
    for c in range(consumers):
        y = rows[f"consumer {c}"]
        for j, (issue, start, stop) in enumerate(blocks_of[c]):
            box(ax, start, rows["tensor cores"], stop - start, 0.7, f"c{c}: block {j}", colours[c], size=8)
            box(ax, issue, y + 0.1, 0.08, 0.5, "", C_BARRIER, edge="none")   # issue, then bar.arrive: the other's turn
            ax.plot([issue + 0.08, stop], [y + 0.35] * 2, color=C_GRID, lw=1, ls=":")  # waiting for its block (wait_group)
            box(ax, stop, y, softmax, 0.7, f"softmax {j}", C_SOFTMAX, size=8)
            if j == 1:
                ax.text(issue, y + 0.8, "issue block 1, bar.arrive", fontsize=7.5, color=C_BARRIER)
        for a, b in waits[c]:
            box(ax, a, y + 0.1, b - a, 0.5, "", "#c5a3e0", edge="none")
    ax.annotate("time", xy=(end, -0.5), xytext=(end - 1.0, -0.5), fontsize=9, va="center",
                arrowprops=dict(arrowstyle="->", color=C_GRID))
    caption(fig, "A schematic (a GEMM block takes 1.0 on the tensor cores, a softmax 0.8). A GEMM block is the wgmma between two "
            "softmaxes (S = Q K^T of tile j and O += P V of tile j-1). Each consumer waits on its own turn barrier (bar.sync) "
            "before it issues a block and arrives on the other's (bar.arrive) right after issuing (green tick): the blocks "
            "reach the tensor cores as c0, c1, c0, c1, and one consumer's softmax runs while the other's block computes. "
            "Dotted: a consumer waiting for its own block (wgmma.wait_group); lilac: a consumer ready before its turn. "
            "Measured: results/h200/timeline/step11.png.", y=0.02, width=165)
    return fig


def shift_moves(tile_max: list[float], threshold: float) -> list[float]:
    """step12's shift of one row (log2 units): moves to the tile's max only when that exceeds it by more than
    `threshold` (always on the first tile); -inf before the first tile."""
    m, out = -np.inf, []
    for x in tile_max:
        if x - m > threshold:
            m = x
        out.append(m)
    return out


@picture("conditional_rescale.png")
def conditional_rescale(k: Code):
    threshold = k.step("step12", "RESCALE_THRESHOLD", cast=float)
    block_n = k.step("step12", "BLOCK_N")
    tiles = 16
    rng = np.random.default_rng(3)
    drift = np.linspace(0.0, 1.9 * threshold, tiles)                 # a row whose scores rise along the keys
    scores = rng.normal(0.0, 1.6, (tiles, block_n)) + drift[:, None]
    tile_max = scores.max(axis=1)
    running = np.maximum.accumulate(tile_max)                        # step11's shift: the running max
    shift = shift_moves(list(tile_max), threshold)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 6.8), gridspec_kw={"height_ratios": [3, 1.2]})
    fig.suptitle(f"step12: the conditional rescale, one row across {tiles} K/V tiles: the shift moves only when a tile's "
                 f"max is more than {threshold:g} above it", fontsize=12)
    x = np.arange(tiles)
    ax.scatter(np.repeat(x, block_n) + rng.uniform(-0.35, 0.35, tiles * block_n), scores.ravel(), s=2, color="#9ecae1",
               label="the row's scores (x scale x log2 e)")
    ax.plot(x, tile_max, "o", color=C_TMA, ms=5, label="each tile's max")
    ax.step(x, running, where="mid", color=C_GRID, ls="--", lw=1.3, label="step11's shift: the running max (O rescaled every tile)")
    ax.step(x, shift, where="mid", color=C_COMPUTE, lw=2.5, label="step12's shift (O rescaled only where it moves)")
    ax.fill_between(x, shift, np.array(shift) + threshold, step="mid", color=C_COMPUTE, alpha=0.12,
                    label=f"shift + {threshold:g}: exponentials stay below 2^{threshold:g}")
    ax.set_xlim(-0.6, tiles - 0.4)
    ax.set_xticks(x, [f"{j}" for j in x], fontsize=8)
    ax.set_ylabel("log2 units")
    ax.legend(loc="upper left", fontsize=8.5)
    moves11 = [True] * tiles
    moves12 = [j == 0 or shift[j] != shift[j - 1] for j in range(tiles)]
    blank(ax2, (-0.6, tiles - 0.4), (-0.2, 2.3))
    for row, (moves, label) in enumerate(((moves11, "step11"), (moves12, "step12"))):
        y = 1.2 - 1.1 * row
        ax2.text(-0.7, y + 0.4, f"{label}: O x alpha", ha="right", va="center", fontsize=9)
        for j in range(tiles):
            box(ax2, j - 0.4, y, 0.8, 0.8, "x alpha" if moves[j] else "", C_COMPUTE if moves[j] else C_LIGHT, size=7)
    caption(fig, "A synthetic row (its scores rise along the keys). Any shift gives the same result as long as l and O use the "
            f"same one (verify/model.py proves it in float64): step12 keeps the old shift until a tile's max is more than "
            f"{threshold:g} (RESCALE_THRESHOLD, log2 units) above it, so alpha = 1 on every other tile, and a warp none of "
            "whose rows moved skips the 64 multiplies of the O rescale (a warp-uniform branch).", y=0.01, width=160)
    fig.subplots_adjust(left=0.12, right=0.98, top=0.92, bottom=0.13, hspace=0.15)
    return fig


@picture("intra_overlap.png")
def intra_overlap(k: Code):
    qk_steps, pv_steps = k.step("step13", "QK_STEPS"), k.step("step13", "PV_STEPS")
    t_s, t_pv, soft1, soft2, tiles = 0.45, 0.45, 0.7, 0.25, 3
    fig = plt.figure(figsize=(13, 5.6))
    fig.suptitle("step13: S = Q K$^T$ first, then P V of the tile before, as two commit groups: the softmax runs under its "
                 "own P V", fontsize=13)
    ax = fig.add_axes([0.16, 0.22, 0.82, 0.68])
    blank(ax, (-0.1, 6.4), (-0.4, 5.0))
    # step12: one group [P V j-1, S j], wait for all, then the whole softmax.
    t, y_tc, y_wg = 0.0, 3.5, 2.7
    lane(ax, y_tc, "step12: tensor cores")
    lane(ax, y_wg, "the warpgroup")
    for j in range(tiles):
        pv = t_pv if j else 0.0                                   # block 0 is S of tile 0 alone
        if j:
            box(ax, t, y_tc, pv, 0.6, f"PV {j - 1}", C_COMPUTE, size=7.5)
        box(ax, t + pv, y_tc, t_s, 0.6, f"S {j}", "#e0a060", size=7.5)
        t += pv + t_s
        box(ax, t, y_wg, soft1 + soft2, 0.6, f"softmax {j}", C_SOFTMAX, size=8)
        ax.text(t, y_wg - 0.15, "wait 0", fontsize=7, va="top", color=C_GRID)
        t += soft1 + soft2
    # step13: [S j] then [P V j-1]; wait 1 -> max, exponentials; wait 0 -> rescale O, P.
    t, y_tc, y_wg = 0.0, 1.2, 0.4
    lane(ax, y_tc, "step13: tensor cores")
    lane(ax, y_wg, "the warpgroup")
    for j in range(tiles):
        pv = t_pv if j else 0.0
        box(ax, t, y_tc, t_s, 0.6, f"S {j}", "#e0a060", size=7.5)
        if j:
            box(ax, t + t_s, y_tc, pv, 0.6, f"PV {j - 1}", C_COMPUTE, size=7.5)
        a = t + t_s
        box(ax, a, y_wg, soft1, 0.6, f"max, exp {j}", C_SOFTMAX, size=7.5)
        ax.text(a, y_wg - 0.15, "wait 1" if j else "wait 0", fontsize=7, va="top", color=C_GRID)
        b = max(a + soft1, t + t_s + pv)
        box(ax, b, y_wg, soft2, 0.6, "O, P", "#a6d5d1", size=7)
        ax.text(b, y_wg - 0.15, "wait 0", fontsize=7, va="top", color=C_GRID)
        t = b + soft2
    ax.annotate("time", xy=(6.2, -0.25), xytext=(5.4, -0.25), fontsize=9, va="center",
                arrowprops=dict(arrowstyle="->", color=C_GRID))
    caption(fig, f"One warpgroup's work, a schematic (the other consumer's ping-pong blocks left out). step12 issues one group, "
            f"P V of tile j-1 ({pv_steps} wgmma) then S of tile j ({qk_steps} wgmma), and waits for all of it (wait_group 0) "
            "before its softmax. The softmax of tile j needs only S: step13 issues S first and P V second as two commit "
            "groups, starts the max and the exponentials once S is done (wait_group 1), while the tensor cores still run "
            "its own P V, and only the rescale of O and the conversion to P wait for the P V (wait_group 0). "
            "Measured: results/h200/timeline/step12.png and step13.png.", y=0.02, width=160)
    return fig


def rounds(tiles: int, ctas: int) -> list[list[int]]:
    """step14's persistent grid: CTA b takes tiles b, b + ctas, b + 2 ctas, ...: round r is tiles r*ctas .. ."""
    return [list(range(r * ctas, min((r + 1) * ctas, tiles))) for r in range(ceil_div(tiles, ctas))]


@picture("persistent_rounds.png")
def persistent_rounds(k: Code):
    block_m = k.step("step14", "BLOCK_M")
    batch, heads, n = DENSE_4K
    q_tiles = ceil_div(n, block_m)
    tiles = q_tiles * heads * batch
    ctas = min(H200_SMS, tiles)
    grid = rounds(tiles, ctas)
    fig = plt.figure(figsize=(13, 6.6))
    fig.suptitle(f"step14: a persistent grid of {ctas} CTAs (one per SM of the H200) over {tiles} work tiles "
                 f"(batch {batch} x {heads} heads x {q_tiles} Q tiles of {block_m} rows at N = {n})", fontsize=12)
    ax = fig.add_axes([0.07, 0.22, 0.91, 0.68])
    cmap = plt.get_cmap("tab20")
    blank(ax, (-1, ctas + 1), (-1.6, len(grid) + 1.2))
    for r, ts in enumerate(grid):
        y = len(grid) - 1 - r
        for b, t in enumerate(ts):
            bh = t // q_tiles                                          # the (batch, head) the tile belongs to
            ax.add_patch(Rectangle((b, y), 1, 1, facecolor=cmap(bh % 20), edgecolor="white", lw=0.3))
        for b in range(len(ts), ctas):
            ax.add_patch(Rectangle((b, y), 1, 1, facecolor="white", edgecolor="#dddddd", lw=0.3, hatch="///"))
        ax.text(-0.5, y + 0.5, f"round {r}", ha="right", va="center", fontsize=7)
    for b in (0, 32, 64, 96, ctas - 1):
        ax.text(b + 0.5, len(grid) + 0.2, f"CTA {b}", ha="center", fontsize=7, rotation=0)
    last = grid[-1]
    ax.text(len(last) / 2, -0.9, f"the last round: {len(last)} tiles on {ctas} CTAs, {ctas - len(last)} SMs idle (hatched)",
            ha="center", fontsize=9)
    caption(fig, f"Work tile t = (q_tile, head, batch) with q_tile fastest (colour: the (batch, head) it belongs to, {q_tiles} "
            f"tiles each); CTA b takes tiles b, b + {ctas}, b + {2 * ctas}, ... So the CTAs that run at the same time work on "
            f"neighbouring Q tiles of the same few heads (a round covers about {ctas / q_tiles:.0f} of them), and each K/V tile "
            "comes from HBM once and from L2 after that. A CTA starts its next tile without exiting: its producer loads the next "
            "Q while the consumers finish, and the output leaves by TMA stores under the next tile's work. The partial last "
            "round is what the split tail (Part II) cuts up.", y=0.01, width=165)
    return fig


@picture("persistent_epilogue.png")
def persistent_epilogue(k: Code):
    block_m, consumers = k.step("step14", "BLOCK_M"), k.step("step14", "NUM_CONSUMERS")
    rows, head_dim, half = k.step("step14", "ROWS_PER_WARPGROUP"), k.head_dim(), k.box_cols()
    tile_kb = rows * head_dim * ELEM_BYTES // 1024
    fig = plt.figure(figsize=(13, 5.8))
    fig.suptitle("step14: the end of one work tile and the start of the next, in a persistent CTA (one consumer shown)",
                 fontsize=12)
    ax = fig.add_axes([0.16, 0.25, 0.82, 0.65])
    blank(ax, (-0.1, 10.3), (-0.6, 4.4))
    y_p, y_c, y_t = 3.4, 2.0, 0.6
    lane(ax, y_p, "producer\n(thread 0)")
    lane(ax, y_c, f"a consumer\n({rows} rows)")
    lane(ax, y_t, "the TMA unit")
    # tile t's last blocks, the epilogue, tile t+1's first blocks
    spans_c = [(0.0, 1.2, "last S = Q K^T\nof tile t", "#e0a060"), (1.2, 2.6, "last P V, softmax", C_COMPUTE),
               (2.6, 3.9, "O / l to shared\nmemory (swizzled)", C_SOFTMAX), (3.9, 4.3, "fence", "#f5c542"),
               (4.3, 4.7, "", C_WAIT), (4.7, 6.3, "tile t+1:\nS = Q K^T", "#e0a060"), (6.3, 8.6, "blocks, softmax ...",
                                                                                       C_COMPUTE),
               (8.6, 9.2, "wait .read", C_WAIT), (9.2, 10.2, "O of t+1", C_SOFTMAX)]
    for a, b, text, colour in spans_c:
        box(ax, a, y_c, b - a, 0.7, text, colour, size=7.5)
    ax.text(4.3, y_c + 0.85, "bar.sync, one thread stores", fontsize=7.5)
    for a, b, text, colour in [(0.3, 1.1, "K, V of tile t", C_TMA), (1.4, 2.5, f"Q of t+1: {block_m} rows", C_TMA),
                               (2.7, 3.7, "K, V of tile t+1", C_TMA)]:
        box(ax, a, y_p, b - a, 0.6, text, colour, size=7.5, color="white")
    arrow(ax, (1.2, y_c + 0.7), (1.4, y_p), C_EMPTY, lw=1.0)
    ax.text(0.55, y_p - 0.45, "Q_empty: every S of tile t done", fontsize=7.5, color=C_EMPTY)
    box(ax, 4.5, y_t, 4.0, 0.6, f"bulk tensor store of O tile t: 2 halves of {half} columns, {tile_kb} KB", C_TMA, size=8,
        color="white")
    arrow(ax, (4.5, y_c), (4.6, y_t + 0.6), C_TMA, lw=1.0)
    arrow(ax, (8.5, y_t + 0.6), (8.7, y_c), C_BARRIER, lw=1.0)
    ax.text(8.8, y_t + 0.3, "has read the tile:\nit may be rewritten", fontsize=7.5, color=C_BARRIER, va="center")
    ax.annotate("time", xy=(10.2, -0.4), xytext=(9.3, -0.4), fontsize=9, va="center",
                arrowprops=dict(arrowstyle="->", color=C_GRID))
    caption(fig, f"A schematic of the order in step14's code (made-up widths). Each of the {consumers} consumers writes its "
            f"normalized {rows} x {head_dim} output into a tile of its own in shared memory, in TMA's swizzled layout; "
            "fence.proxy.async makes those ordinary stores visible to the TMA unit, and after a barrier of the warpgroup "
            "one thread issues the two bulk stores and moves on: the stores complete under the next tile's work. Before "
            "the tile is written again, cp.async.bulk.wait_group.read waits only until the previous store has read it. The "
            "producer has loaded the next Q already: Q_empty completed when the consumers' last S = Q K^T of tile t did. "
            "Measured: results/h200/timeline/step14.png.", y=0.01, width=165)
    return fig


# ---------------------------------------------------------------- Part II: the final kernel's schedule, in Python
# Ported function by function from the final step's kernel.cu (tile scheduler, K/V ranges, the split tail), so that the
# pictures below show what the kernel does at the shapes they name. Sizes come in as arguments, read from the code.

def tiles_per_head(q_tiles: int, causal: bool) -> int:
    return 2 * ceil_div(q_tiles, 2) if causal else q_tiles   # causal: whole pairs


def work_tile(t: int, q_tiles: int, heads: int, causal: bool) -> tuple[int, int, int]:
    """Work tile t -> (q_tile, head, batch), q_tile fastest; causal: within a head, tile 2i is the i-th longest Q tile and
    tile 2i + 1 the i-th shortest (-1: the empty half of an odd head's last pair)."""
    per_head = tiles_per_head(q_tiles, causal)
    bh, i = divmod(t, per_head)
    batch, head = divmod(bh, heads)
    j = i // 2
    q_tile = i if not causal else q_tiles - 1 - j if i % 2 == 0 else j if j < q_tiles - 1 - j else -1
    return q_tile, head, batch


def kv_range(q_tile: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, causal: bool, offset: int = 0):
    """(tiles, masked): the K/V tiles a work tile visits from key 0, and how many of them (the last) need a mask."""
    row0, row_end = q_tile * block_m, min(q_tile * block_m + block_m, seqlen_q)
    seen_by_last = seen_by_first = seqlen_k
    if causal:
        seen_by_last = max(0, min(seqlen_k, row_end + offset))
        seen_by_first = max(0, min(seqlen_k, row0 + 1 + offset))
    tiles = ceil_div(seen_by_last, block_n)
    return tiles, tiles - min(tiles, seen_by_first // block_n)


def cta_tiles(b: int, grid: int, tiles: int, per_turn: int) -> list[int]:
    """A CTA's work tiles: first_tile, next_tile, ... (a pair of tiles per round where per_turn = 2)."""
    out, t = [], b * per_turn
    while t < tiles:
        out.append(t)
        t = t + 1 if (t + 1) % per_turn else t + 1 + (grid - 1) * per_turn
    return out


def split_tail(tiles: int, grid: int, cluster: int, n: int) -> dict:
    """The split tail (tail_of, tail_piece): the work tiles of the full rounds run whole; the last round's walks (a work
    tile's n K/V tiles, or a pair's) are cut into `grid / cluster` runs of about the same number of units, run r going
    to cluster runs - 1 - r. Returns the whole count and, per run, its pieces (walk, begin, end)."""
    whole = tiles // grid * grid
    runs = grid // cluster
    units = (tiles - whole) // cluster * n
    start = [r * units // runs for r in range(runs + 1)]
    pieces = {}
    for r in range(runs):
        walk, out = (start[r] // n if units else 0), []
        while True:
            lo, hi = start[r] - walk * n, start[r + 1] - walk * n
            if hi <= max(lo, 0):
                break
            out.append((walk, max(lo, 0), min(hi, n)))
            walk += 1
        pieces[r] = out
    return {"whole": whole, "runs": runs, "units": units, "n": n, "walks": (tiles - whole) // cluster, "pieces": pieces}


def fast_div(d: int) -> tuple[int, int]:
    """FastDiv's magic numbers (Granlund and Montgomery): shift = ceil(log2 d), mul = 2^32 (2^shift - d) / d + 1."""
    shift = 0
    while (1 << shift) < d:
        shift += 1
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def fast_div_apply(n, mul: int, shift: int):
    """n / d as a multiply-high, an add and a shift (numpy arrays or ints, 0 <= n < 2^31)."""
    return (((np.asarray(n, dtype=np.uint64) * np.uint64(mul)) >> np.uint64(32)) + np.asarray(n, dtype=np.uint64)) >> np.uint64(shift)


# ---------------------------------------------------------------- Part II pictures

@picture("causal_mask.png")
def causal_mask(k: Code):
    block_m, block_n = k.final("BLOCK_M"), k.final("BLOCK_N")
    n = 16 * block_m                                   # an example: 16 Q tiles
    q_tiles, kv_tiles = ceil_div(n, block_m), ceil_div(n, block_n)
    shown = q_tiles - 5
    fig = plt.figure(figsize=(13, 6.6))
    fig.suptitle(f"Causal attention: which K/V tiles a work tile visits (N = {n}, Q tiles of {block_m} rows, K/V tiles of "
                 f"{block_n} keys)", fontsize=12)
    ax = fig.add_axes([0.02, 0.03, 0.5, 0.86])
    blank(ax, (-2.2, kv_tiles + 0.5), (-2.4, q_tiles + 1.2))
    for qt in range(q_tiles):
        tiles, masked = kv_range(qt, block_m, block_n, n, n, True)
        y = q_tiles - 1 - qt
        ax.text(-0.2, y + 0.5, f"Q {qt}", ha="right", va="center", fontsize=7)
        for kt in range(kv_tiles):
            if kt >= tiles:
                colour, hatch = "white", None
            elif kt >= tiles - masked:
                colour, hatch = "#fdd0a2", "////"
            else:
                colour, hatch = C_COMPUTE if qt == shown else "#fde0c5", None
            ax.add_patch(Rectangle((kt, y), 1, 1, facecolor=colour, edgecolor="#999999", lw=0.4, hatch=hatch))
        if qt == shown:
            ax.add_patch(Rectangle((0, y), tiles, 1, facecolor="none", edgecolor="black", lw=2))
            for pos in range(tiles):                   # the walk runs from the last visited tile to the first
                ax.text(tiles - 1 - pos + 0.5, y + 0.5, str(pos), ha="center", va="center", fontsize=6.5)
    for kt in range(0, kv_tiles, 4):
        ax.text(kt + 0.5, q_tiles + 0.2, f"K/V {kt}", ha="center", fontsize=7)
    ax.text(kv_tiles / 2, -0.5, f"outlined: Q tile {shown}'s walk, numbered in the order it visits the tiles (from the last\n"
            "key it sees back to key 0: the one tile that needs a mask comes first). Hatched: the tiles the\n"
            "diagonal crosses (keys past some rows: -inf before the softmax). White: never loaded.",
            ha="center", va="top", fontsize=8.5)
    # The diagonal tile, element by element.
    ax = fig.add_axes([0.56, 0.2, 0.4, 0.66])
    rows = np.arange(block_m)[:, None]
    keys = np.arange(block_n)[None, :]
    ax.imshow(np.where(keys <= rows, 1.0, 0.0), cmap=matplotlib.colors.ListedColormap(["#ffffff", "#fdd0a2"]),
              extent=(0, block_n, block_m, 0), interpolation="nearest")
    ax.set_title("a diagonal tile: row r sees key c only where c <= r\n(top-left diagonal; a KV cache's bottom-right one "
                 "shifts it by\nseqlen_k - seqlen_q: causal_offset)", fontsize=9)
    ax.set_xlabel("key in the tile")
    ax.set_ylabel("query row in the tile")
    ax.text(block_n * 0.62, block_m * 0.28, "-inf", fontsize=11, ha="center")
    caption(fig, "Half the work of the dense call: a Q tile's rows see the keys up to their own, so its walk is cut where "
            "the diagonal is, and only the tiles the diagonal crosses take the mask.", y=0.02, width=80, x=0.56)
    return fig


@picture("causal_balance.png")
def causal_balance(k: Code):
    block_m, block_n = k.final("BLOCK_M"), k.final("BLOCK_N")
    q_tiles = 16                                    # one head of N = 16 Q tiles
    n = q_tiles * block_m
    ctas = q_tiles // 2
    work = [kv_range(qt, block_m, block_n, n, n, True)[0] for qt in range(q_tiles)]
    order = [work_tile(t, q_tiles, 1, True)[0] for t in range(tiles_per_head(q_tiles, True))]
    fig = plt.figure(figsize=(13, 6.4))
    fig.suptitle(f"The balanced causal schedule: within a head, the i-th longest Q tile beside the i-th shortest "
                 f"(one head of {q_tiles} Q tiles, N = {n})", fontsize=12)
    cmap = plt.get_cmap("viridis")
    colour = {qt: cmap(qt / (q_tiles - 1)) for qt in range(q_tiles)}
    for panel, (title, per_cta) in enumerate((
            (f"step14's order on {ctas} CTAs: CTA b takes Q tiles b, b + {ctas}",
             [[b, b + ctas] for b in range(ctas)]),
            (f"the causal order on {ctas} CTAs: CTA b takes pair b, its tiles 2b and 2b + 1",
             [[order[2 * b], order[2 * b + 1]] for b in range(ctas)]))):
        ax = fig.add_axes([0.06 + 0.49 * panel, 0.2, 0.42, 0.68])
        for b, qts in enumerate(per_cta):
            left = 0
            for qt in qts:
                ax.barh(b, work[qt], left=left, color=colour[qt], edgecolor="white")
                ax.text(left + work[qt] / 2, b, f"Q {qt}", ha="center", va="center", fontsize=7,
                        color="white" if qt < q_tiles * 0.6 else "black")
                left += work[qt]
            ax.text(left + 0.3, b, str(left), va="center", fontsize=8)
        ax.set_yticks(range(ctas), [f"CTA {b}" for b in range(ctas)], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, 2 * q_tiles + 4)
        ax.set_xlabel("K/V tiles computed")
        ax.set_title(title, fontsize=10)
    caption(fig, f"Causal, Q tile i sees i + 1 K/V tiles: taken in order, the CTA holding the last tiles works the longest "
            f"and the others wait for it. work_tile() numbers the tiles of a head as longest, shortest, second longest, second "
            f"shortest, ...: each pair (2i, 2i + 1) is {q_tiles + 1} K/V tiles, and a CTA takes both tiles of a pair in one "
            "round (a head with an odd number of Q tiles ends in a pair whose second tile is no tile).", y=0.01, width=165)
    return fig


@picture("gqa_heads.png")
def gqa_heads(k: Code):
    block_m = k.final("BLOCK_M")
    heads, heads_k = GQA_HEADS
    group = heads // heads_k
    n = 4096
    q_tiles = ceil_div(n, block_m)
    per_turn = 2                                     # causal: a pair of work tiles per CTA and round
    fig = plt.figure(figsize=(13, 6.2))
    fig.suptitle(f"Grouped K/V heads: {heads} query heads read {heads_k} K/V heads, {group} each (query head h reads K/V "
                 f"head h / {group})", fontsize=12)
    ax = fig.add_axes([0.02, 0.46, 0.96, 0.44])
    blank(ax, (-1, heads + 1), (-0.2, 3.4))
    cmap = plt.get_cmap("tab10")
    for h in range(heads):
        box(ax, h + 0.05, 2.4, 0.9, 0.7, f"Q{h}", cmap(h // group % 10), size=7, alpha=0.8)
        arrow(ax, (h + 0.5, 2.4), ((h // group) * group + group / 2, 1.1), cmap(h // group % 10), lw=0.7, style="-")
    for g in range(heads_k):
        box(ax, g * group + 0.3, 0.2, group - 0.6, 0.9, f"K/V head {g}", cmap(g % 10), size=8)
    # One round of the causal schedule: which K/V head each CTA reads.
    ax = fig.add_axes([0.02, 0.14, 0.96, 0.26])
    ctas = H200_SMS
    blank(ax, (-1, ctas + 1), (-0.8, 1.8))
    for b in range(ctas):
        t = b * per_turn
        _, head, _ = work_tile(t, q_tiles, heads, True)
        ax.add_patch(Rectangle((b, 0), 1, 1, facecolor=cmap(head // group % 10), edgecolor="white", lw=0.3))
    ax.text(ctas / 2, 1.3, f"round 0 of a causal call at N = {n} ({q_tiles} Q tiles per head, a pair per CTA): CTA b's "
            "colour is the K/V head it reads", ha="center", fontsize=9)
    for b in (0, ctas - 1):
        ax.text(b + 0.5, -0.35, f"CTA {b}", ha="center", va="top", fontsize=7)
    caption(fig, f"The tile scheduler numbers work tiles with the Q tile fastest, then the query head: the CTAs that run at the "
            f"same time work on neighbouring query heads, and {group} neighbours share a K/V head, so each K/V tile comes "
            "from HBM once and is read from L2 by the CTAs of all the heads of its group. The kernel only divides the head "
            "by the group size to find its K/V head (the TMA coordinates of K and V); nothing else changes.", y=0.01, width=165)
    return fig


@picture("cta_pair_multicast.png")
def cta_pair_multicast(k: Code):
    cluster = k.final("PAIR_CTAS")
    block_n, head_dim, half = k.final("BLOCK_N"), k.head_dim(), k.box_cols()
    consumer_warps = k.final("CONSUMER_WARPS")
    pair_min = k.final("PAIR_MIN_SEQLEN_K")
    tile_bytes = block_n * head_dim * ELEM_BYTES
    half_bytes = block_n * half * ELEM_BYTES
    fig = plt.figure(figsize=(13, 7.6))
    fig.suptitle(f"CTA pairs: a cluster of {cluster} CTAs walks the same K/V tiles, and each CTA loads one {half}-column "
                 "half of every tile into both (TMA multicast)", fontsize=12)
    ax = fig.add_axes([0.01, 0.13, 0.98, 0.8])
    blank(ax, (0, 26), (0, 13))
    # Global memory: one K tile, two halves.
    ax.text(13, 12.6, f"global memory: K tile j [{block_n} keys x {head_dim}] (V the same)", ha="center", fontsize=10)
    for h in range(2):
        box(ax, 9 + 4 * h, 11.0, 4, 1.2, f"dims {h * half}-{h * half + half - 1}\n({half_bytes // 1024} KB)", PAIR_COLOURS[h], size=8.5)
    for rank in range(cluster):
        x0 = 0.5 + 13 * rank
        box(ax, x0, 0.4, 12, 8.6, "", "#f7f7f7", edge=C_GRID, lw=1.5)
        cta, q_tile = ("2c", "2i") if rank == 0 else ("2c + 1", "2i + 1")
        ax.text(x0 + 6, 8.55, f"CTA {cta} (rank {rank} in the cluster): Q tile {q_tile}",
                ha="center", fontsize=10, weight="bold")
        box(ax, x0 + 0.4, 6.2, 3.2, 1.6, f"producer\n(thread 0)\nloads half {rank}", C_TMA, size=8, color="white")
        ax.text(x0 + 8.2, 7.95, "ring slot s: K tile", ha="center", fontsize=8.5)
        for h in range(2):
            box(ax, x0 + 4.6 + 3.6 * h, 6.2, 3.4, 1.5, f"half {h}\nfrom rank {h}", PAIR_COLOURS[h], size=8.5)
        box(ax, x0 + 4.6, 3.9, 3.4, 1.5, f"K_full[s]\nexpects {tile_bytes // 1024} KB", C_BARRIER, size=8, color="white")
        box(ax, x0 + 8.2, 3.9, 3.4, 1.5, f"K_empty[s]\n{cluster * consumer_warps} arrivals", C_EMPTY, size=8, color="white")
        box(ax, x0 + 0.4, 1.0, 11.2, 2.0, "", "#fde0c5", edge=C_COMPUTE)
        ax.text(x0 + 6, 2.0, f"{consumer_warps // 4} consumer warpgroups ({consumer_warps} warps): wait K_full[s], S = Q K$^T$,\n"
                "then lane 0 of each warp arrives on K_empty[s] here AND in the peer", ha="center", va="center", fontsize=8.5)
    for rank in range(cluster):  # global half `rank` -> the slot's half `rank` in both CTAs; the local arrivals
        x0 = 0.5 + 13 * rank
        for dst_rank in range(cluster):
            dst = (0.5 + 13 * dst_rank + 4.6 + 3.6 * rank + 1.7, 7.7)
            arrow(ax, (10.5 + 4 * rank + dst_rank, 11.0), dst, C_TMA, lw=1.4, zorder=5)
        arrow(ax, (x0 + 3.6, 7.0), (9.3 + 4 * rank, 11.0), C_TMA, ls=":", lw=0.9, zorder=5)
        arrow(ax, (x0 + 9.9, 3.0), (x0 + 9.9, 3.9), C_EMPTY, lw=1.2, zorder=5)
    ax.text(6.5, 10.3, "each producer: cp.async.bulk.tensor\n.multicast::cluster, mask 0b11", ha="center", fontsize=8.5,
            color=C_TMA)
    arrow(ax, (0.5 + 11.0, 3.0), (13.5 + 8.6, 3.9), C_EMPTY, ls="--", lw=1.0, zorder=5)
    arrow(ax, (13.5 + 1.0, 3.0), (0.5 + 8.6, 3.9), C_EMPTY, ls="--", lw=1.0, zorder=5)
    ax.text(13, 0.05, "mbarrier.arrive.shared::cluster (the peer's barrier, through mapa)", ha="center", fontsize=8.5,
            color=C_EMPTY)
    caption(fig, f"Each CTA's K_full[s] expects the whole tile ({tile_bytes} bytes) as before, and receives {half_bytes} from "
            f"each of the two copies: the tile is complete in both CTAs when both halves have landed. A slot may be refilled "
            f"only when both CTAs are done with it, since either producer writes into both: so K_empty[s] counts "
            f"{cluster} x {consumer_warps} arrivals, every consumer warp of the pair arriving in its own CTA and in the peer. "
            f"The pair computes neighbouring Q tiles of one head (2i, 2i + 1), so both need the same K/V tiles: each tile "
            f"leaves L2 once for two CTAs. The launcher takes pairs for calls of at least {pair_min} keys with an even number "
            "of Q tiles (causal: whole quadruples, a diagonal at or right of the top-left one).", y=0.01, width=165)
    return fig


def wgmma_desc(addr: int, lbo: int, sbo: int, shifts: tuple[int, int, int]) -> int:
    """common/wgmma.cuh's wgmma_desc with the 128-byte swizzle, its field positions as read from there."""
    lbo_at, sbo_at, swizzle_at = shifts
    return ((addr & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << lbo_at) | (((sbo & 0x3FFFF) >> 4) << sbo_at) | (1 << swizzle_at)


@picture("descriptor_advance.png")
def descriptor_advance(k: Code):
    shifts = tuple(int(v) for v in k.find("common/wgmma.cuh", r"lbo_bytes[^;]*?<< (\d+)\)[^;]*?sbo_bytes[^;]*?<< (\d+)\)"
                                           r"[^;]*?swizzle << (\d+)\)", "wgmma_desc's field positions"))
    atom = k.read("common/wgmma.cuh", "WGMMA_ATOM_BYTES")
    q_half, kstep, per_half = k.final("Q_HALF_BYTES"), k.final("KSTEP_BYTES"), k.final("KSTEPS_PER_HALF")
    qk_steps = k.read("common/flashladder.cuh", "HEAD_DIM") // 16  # QK_STEPS at head dim 128 (the final step's QK_STEPS<D>)
    q_addr = 0                                                   # Q is the first member of the shared storage
    base = wgmma_desc(q_addr, 16, atom, shifts)
    fig = plt.figure(figsize=(13, 6.8))
    fig.suptitle("Descriptors built once per tile and advanced: k-step kk of S = Q K$^T$ only moves the start address",
                 fontsize=13)
    ax = fig.add_axes([0.02, 0.62, 0.96, 0.28])
    blank(ax, (-1, 65), (-0.8, 2.2))
    fields = [(0, 14, "start address >> 4", C_COMPUTE), (shifts[0], 14, "LBO >> 4", "#c6dbef"),
              (shifts[1], 14, "SBO >> 4", "#c6dbef"), (49, 3, "base", C_LIGHT), (shifts[2], 2, "swizzle", "#c6dbef")]
    for bit in range(64):
        ax.add_patch(Rectangle((63 - bit, 0), 1, 1, facecolor="white", edgecolor="#cccccc", lw=0.3))
    for lo, width, name, colour in fields:
        box(ax, 64 - lo - width, 0, width, 1, name, colour, size=8)
        ax.text(64 - lo - 0.5, -0.35, str(lo), ha="center", fontsize=7)
    ax.text(32, 1.5, f"the 64-bit shared-memory matrix descriptor (common/wgmma.cuh; fields at bits 0, {shifts[0]}, {shifts[1]}, "
            f"{shifts[2]}): only the low word's start address differs between k-steps", ha="center", fontsize=9.5)
    ax = fig.add_axes([0.04, 0.13, 0.92, 0.46])
    blank(ax, (-0.5, 13), (-0.2, qk_steps + 1.6))
    cols = [0.2, 1.6, 3.4, 6.0, 9.2]
    for x, head in zip(cols, ["kk", "half", "offset (bytes)", "+ (offset >> 4)", "Q's descriptor"]):
        ax.text(x, qk_steps + 0.8, head, fontsize=9.5, weight="bold")
    for kk in range(qk_steps):
        half, within = kk // per_half, kk % per_half * kstep
        offset = half * q_half + within
        desc = wgmma_desc(q_addr + offset, 16, atom, shifts)
        assert desc == base + (offset >> 4)                     # what wgmma_desc_advance adds: the same descriptor
        y = qk_steps - 1 - kk
        for x, text in zip(cols, [str(kk), str(half), f"{half} x {q_half} + {kk % per_half} x {kstep} = {offset}",
                                  f"+ {offset >> 4}", f"0x{desc:016x}"]):
            ax.text(x, y + 0.3, text, fontsize=9, family="monospace" if x == cols[-1] else None)
    caption(fig, f"A k-step kk of S = Q K^T reads 16 dims: {kstep} bytes of every row, in half kk / {per_half} ({q_half} bytes "
            f"on for Q, the K tile's half likewise). Built whole, each descriptor costs the masks, shifts and ors of wgmma_desc "
            "for Q and for K before every wgmma; built once per tile, the next k-step is the same 64 bits with the start "
            "address field plus offset / 16 (wgmma_desc_advance: one add on the low word, exact while the address stays "
            "below the field's 256 KB). The table is computed both ways and checked equal; Q at shared address 0.",
            y=0.01, width=165)
    return fig


def split_order_schedule(split: bool, v_lands: float, t_s: float, t_pv: float, t_max: float, t_exp: float, t_p: float,
                         t_rescale: float):
    """One consumer's GEMM block (K tile j landed at 0, V tile j-1 at v_lands): (tensor-core spans, warpgroup spans)."""
    tc, wg = [], []
    if split:   # S first; V waited for under it; row 0's exponentials under P V, row 1's after the wait
        tc += [("S = Q K^T", 0.0, t_s)]
        wg += [("wait V", 0.0, v_lands)] if v_lands > 0 else []
        pv0 = max(t_s, v_lands)
        tc += [("P V", pv0, pv0 + t_pv)]
        t = t_s
        for name, d in (("max", t_max), ("exp row 0", t_exp)):
            wg.append((name, t, t + d))
            t += d
        t = max(t, pv0 + t_pv)
        for name, d in (("P row 0", t_p), ("exp row 1", t_exp), ("P row 1", t_p), ("O x alpha", t_rescale)):
            wg.append((name, t, t + d))
            t += d
    else:       # step14's block: both K and V waited for before the turn, both rows' exponentials under P V
        wg += [("wait V", 0.0, v_lands)]
        tc += [("S = Q K^T", v_lands, v_lands + t_s), ("P V", v_lands + t_s, v_lands + t_s + t_pv)]
        t = v_lands + t_s
        for name, d in (("max", t_max), ("exp row 0", t_exp), ("exp row 1", t_exp)):
            wg.append((name, t, t + d))
            t += d
        t = max(t, v_lands + t_s + t_pv)
        for name, d in (("O x alpha", t_rescale), ("P rows 0, 1", 2 * t_p)):
            wg.append((name, t, t + d))
            t += d
    return tc, wg


@picture("split_order.png")
def split_order(k: Code):
    qk_steps = k.read("common/flashladder.cuh", "HEAD_DIM") // 16  # QK_STEPS at head dim 128 (the final step's QK_STEPS<D>)
    durations = dict(v_lands=0.3, t_s=0.5, t_pv=0.5, t_max=0.12, t_exp=0.36, t_p=0.07, t_rescale=0.05)
    colours = {"S = Q K^T": "#e0a060", "P V": C_COMPUTE, "wait V": C_WAIT, "max": C_SOFTMAX, "exp row 0": C_SOFTMAX,
               "exp row 1": "#4c9f99", "P row 0": "#a6d5d1", "P row 1": "#a6d5d1", "P rows 0, 1": "#a6d5d1",
               "O x alpha": "#f5c542"}
    fig = plt.figure(figsize=(13, 5.8))
    fig.suptitle("The split order inside a GEMM block: V waited for under S = Q K$^T$; row 0's exponentials under P V, "
                 "row 1's after the wait", fontsize=12)
    ax = fig.add_axes([0.17, 0.25, 0.81, 0.66])
    blank(ax, (-0.05, 2.35), (-0.6, 5.3))
    for y0, split, title in ((2.8, False, "step14's order"), (0.2, True, "the split order")):
        tc, wg = split_order_schedule(split, **durations)
        ax.text(-0.03, y0 + 2.05, title, ha="left", fontsize=10, weight="bold")
        lane(ax, y0 + 1.0, "tensor cores", size=8.5)
        lane(ax, y0, "the warpgroup", size=8.5)
        for name, a, b in tc:
            box(ax, a, y0 + 1.0, b - a, 0.6, name, colours[name], size=8)
        for name, a, b in wg:
            box(ax, a, y0, b - a, 0.6, name if b - a > 0.1 else "", colours[name], size=7.5)
        ax.plot([durations["v_lands"]] * 2, [y0 - 0.15, y0 + 1.75], color=C_TMA, lw=1.2, ls="--")
        ax.text(durations["v_lands"] + 0.01, y0 + 1.68, "V lands", fontsize=7.5, color=C_TMA)
        end = max(b for _, _, b in wg)
        ax.plot([end, end], [y0 - 0.15, y0 + 0.75], color=C_GRID, lw=1)
    ax.annotate("time", xy=(2.3, -0.35), xytext=(2.05, -0.35), fontsize=9, va="center",
                arrowprops=dict(arrowstyle="->", color=C_GRID))
    for i, (name, label) in enumerate((("P row 0", "a row of S to bf16: P (its A fragments)"), ("O x alpha", "O rescaled"),
                                       ("exp row 1", "row 1's exponentials"))):
        box(ax, 0.0 + 0.75 * i, -0.45, 0.05, 0.2, "", colours[name])
        ax.text(0.07 + 0.75 * i, -0.35, label, fontsize=8, va="center")
    caption(fig, f"One consumer's block (K tile j landed, V tile j-1 a little later), a schematic. step14 waits for both "
            f"tiles before it takes its turn; the split order issues S = Q K^T ({qk_steps} wgmma) as soon as K is there and "
            "waits for V while they run, then issues P V. The max and row 0's exponentials run under P V (their row sums "
            "stored to shared memory, which keeps them there), and row 1's after the wait for P V, beside the conversion of "
            "each row to P and the rescale of O, while the tensor cores run the other consumer's block. The widths are made up; "
            "measured timelines of the steps are in results/h200/timeline/.", y=0.01, width=165)
    return fig


@picture("causal_pairs.png")
def causal_pairs(k: Code):
    block_m, block_n = k.final("BLOCK_M"), k.final("BLOCK_N")
    cluster = k.final("PAIR_CTAS")
    n = k.final("PAIR_MIN_SEQLEN_K")        # the shortest causal call in pairs
    q_tiles = ceil_div(n, block_m)
    per_head = tiles_per_head(q_tiles, True)
    c = 1                                                         # the cluster drawn: its CTAs 2c and 2c + 1
    ctas = [cluster * c + r for r in range(cluster)]
    turns = [[work_tile(t, q_tiles, 1, True)[0] for t in cta_tiles(b, H200_SMS, per_head, 2)] for b in ctas]
    fig = plt.figure(figsize=(13, 7.0))
    fig.suptitle(f"Causal attention in CTA pairs (N = {n}, {q_tiles} Q tiles per head): both CTAs walk the K/V tiles the "
                 "higher Q tile sees", fontsize=12)
    ax = fig.add_axes([0.02, 0.12, 0.5, 0.8])
    blank(ax, (-2.4, q_tiles + 0.5), (-1.0, q_tiles + 1.0))
    drawn = {}
    for turn in range(2):
        pair = [turns[r][turn] for r in range(cluster)]
        walk = kv_range(max(pair) | 1, block_m, block_n, n, n, True)[0]
        for r, qt in enumerate(pair):
            drawn[qt] = (r, walk, kv_range(qt, block_m, block_n, n, n, True)[0])
    for qt in range(q_tiles):
        y = q_tiles - 1 - qt
        seen = kv_range(qt, block_m, block_n, n, n, True)[0]
        for kt in range(q_tiles):
            colour, hatch, edge = ("#f2f2f2" if kt < seen else "white"), None, "#dddddd"
            if qt in drawn:
                r, walk, own = drawn[qt]
                if kt < own:
                    colour, edge = PAIR_COLOURS[r], "#999999"
                elif kt < walk:
                    colour, hatch, edge = "white", "xxxx", "#999999"
            ax.add_patch(Rectangle((kt, y), 1, 1, facecolor=colour, edgecolor=edge, lw=0.3, hatch=hatch))
        if qt in drawn:
            ax.text(-0.2, y + 0.5, f"Q {qt}: CTA {ctas[drawn[qt][0]]}", ha="right", va="center", fontsize=7)
    ax.text(q_tiles / 2, -0.3, "hatched: a tile of the pair's walk that this CTA's Q tile does not see: it waits for it and\n"
            "releases it (the peer computes it), so both CTAs' ring slots and barriers stay in step", ha="center", va="top",
            fontsize=8.5)
    # Right: every cluster of the head, the K/V tiles its walks load.
    ax = fig.add_axes([0.58, 0.2, 0.4, 0.68])
    clusters = q_tiles // (2 * cluster)
    for cc in range(clusters):
        left = 0
        for turn in range(2):
            pair = [work_tile(t, q_tiles, 1, True)[0] for t in
                    (cta_tiles(cluster * cc + r, H200_SMS, per_head, 2)[turn] for r in range(cluster))]
            walk = kv_range(max(pair) | 1, block_m, block_n, n, n, True)[0]
            ax.barh(cc, walk, left=left, color=["#9ecae1", "#c6dbef"][turn], edgecolor="white")
            ax.text(left + walk / 2, cc, f"Q {max(pair)}, {min(pair)}", ha="center", va="center", fontsize=7)
            left += walk
        ax.text(left + 0.3, cc, str(left), va="center", fontsize=8)
    ax.set_yticks(range(clusters), [f"CTAs {cluster * cc}, {cluster * cc + 1}" for cc in range(clusters)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("K/V tiles the pair loads (each tile once, half by each CTA)")
    ax.set_title("every pair of a head: its two rounds' walks", fontsize=10)
    caption(fig, "A cluster takes two neighbouring pairs of one head (its pairs 2m and 2m + 1): the Q tiles q - 1 - 2m and "
            "q - 2 - 2m first, then 2m and 2m + 1, so its two CTAs always work on neighbouring Q tiles, each the higher one "
            "once. The walk runs from the last K/V tile back to key 0, so the tile only the higher Q tile sees comes first. "
            "Every cluster loads the same number of K/V tiles.", y=0.01, width=165)
    return fig


@picture("split_tail.png")
def split_tail_picture(k: Code):
    block_m, block_n = k.final("BLOCK_M"), k.final("BLOCK_N")
    cluster = k.final("PAIR_CTAS")
    batch, heads, n = DENSE_4K
    tiles = ceil_div(n, block_m) * heads * batch
    grid = min(H200_SMS, tiles) // cluster * cluster
    walk = ceil_div(n, block_n)
    tail = split_tail(tiles, grid, cluster, walk)
    runs = tail["runs"]
    fig = plt.figure(figsize=(13, 7.2))
    fig.suptitle(f"The split tail: the last, partial round of {tiles} work tiles on {grid} CTAs ({runs} pairs), cut along "
                 f"its K/V walks ({batch} x {heads} heads x N = {n})", fontsize=12)
    cmap = plt.get_cmap("tab20")
    for panel in range(2):
        ax = fig.add_axes([0.07 + 0.48 * panel, 0.2, 0.42, 0.7])
        ax.set_xlim(0, walk + 1)
        ax.set_ylim(runs, -1)
        for cl in range(runs):
            if panel == 0:                                       # whole: pair cl takes walk cl if there is one
                if cl < tail["walks"]:
                    ax.barh(cl, walk, color=cmap(cl % 20), height=0.85)
                continue
            r = runs - 1 - cl                                    # run r goes to cluster runs - 1 - r
            left = 0
            for w, begin, end in tail["pieces"][r]:
                ax.barh(cl, end - begin, left=left, color=cmap(w % 20), height=0.85, hatch="////" if begin else None,
                        edgecolor="#333333" if begin else "white", lw=0.3)
                left += end - begin
        ax.set_yticks(range(0, runs, 5), [f"CTA pair {cl}" for cl in range(0, runs, 5)], fontsize=8)
        ax.set_xlabel("K/V tiles (time)")
        ax.set_title(f"whole: {tail['walks']} CTA pairs work {walk} K/V tiles, {runs - tail['walks']} idle" if panel == 0 else
                     f"split: {tail['units']} units in {runs} runs of {tail['units'] // runs}-{ceil_div(tail['units'], runs)}",
                     fontsize=10)
    caption(fig, f"The full rounds before (work tiles 0 to {tail['whole'] - 1}) run whole and are not drawn. The last round's "
            f"{tail['walks']} walks (a pair's {walk} K/V tiles; colour: the walk) are cut into {runs} runs of about the same "
            "length, one per CTA pair, the last pair taking the first run. A piece that starts inside its walk (hatched) is "
            "partial: it stores its unnormalized O, its row maxima and sums in the workspace and raises a flag; the piece that "
            "holds the walk's start (its owner) merges them into its registers and stores O and LSE as a whole tile does "
            "(next picture). The last round's pieces are about half a walk long.", y=0.01, width=165)
    return fig


@picture("split_merge.png")
def split_merge(k: Code):
    block_m, block_n = k.final("BLOCK_M"), k.final("BLOCK_N")
    cluster = k.final("PAIR_CTAS")
    max_ctas, slot_float4s = k.final("MAX_SPLIT_CTAS"), k.final("PARTIAL_FLOAT4S")
    consumers, wg_threads = k.final("NUM_CONSUMERS"), k.read("common/wgmma.cuh", "WARPGROUP_THREADS")
    batch, heads, n = DENSE_4K
    tiles = ceil_div(n, block_m) * heads * batch
    grid = min(H200_SMS, tiles) // cluster * cluster
    walk_len = ceil_div(n, block_n)
    tail = split_tail(tiles, grid, cluster, walk_len)
    by_walk: dict[int, list] = {}
    for r, ps in tail["pieces"].items():
        for w, b, e in ps:
            by_walk.setdefault(w, []).append((r, b, e))
    w = next(w for w, ps in sorted(by_walk.items()) if len(ps) == 3 and ps[0][2] - ps[0][1] >= 2)
    runs_of = [r for r, _, _ in by_walk[w]]
    fig = plt.figure(figsize=(13, 5.6))
    fig.suptitle(f"The split tail's merge: walk {w} of the tail, cut into {len(runs_of)} pieces on {len(runs_of)} CTA pairs",
                 fontsize=13)
    ax = fig.add_axes([0.12, 0.24, 0.62, 0.66])
    blank(ax, (-0.5, walk_len * 0.72), (-0.6, len(runs_of) * 1.4 + 0.2))
    cmap = plt.get_cmap("tab20")
    done = {}
    for i, r in enumerate(runs_of):
        y = (len(runs_of) - 1 - i) * 1.4
        cl = tail["runs"] - 1 - r
        lane(ax, y, f"CTA pair {cl}\n(run {r})", size=8.5)
        t = 0.0
        for pw, b, e in tail["pieces"][r]:
            kind = "owner" if pw == w and b == 0 else "partial" if b else "owner"
            box(ax, t, y, e - b, 0.7, f"walk {pw}, tiles {b}-{e - 1}" + (f"\n({kind})" if pw == w else ""),
                cmap(pw % 20), size=7.5, hatch="////" if b else None, alpha=1.0 if pw == w else 0.45)
            t += e - b
            if pw == w:
                done[r] = (t, y, b)
    owner = runs_of[0]
    t_own, y_own, _ = done[owner]
    last = max(t for r, (t, _, _) in done.items() if r != owner)
    for i, r in enumerate(runs_of[1:]):
        t, y, _ = done[r]
        ax.plot([t], [y + 0.85], marker="v", color=C_BARRIER, ms=9)
        ax.text(t - 0.4, y + 0.85, "store O, m, l; raise the flag" if i == 0 else "", fontsize=7.5, ha="right", va="center",
                color=C_BARRIER)
        arrow(ax, (t, y + 0.85), (max(t_own, last) + 0.2, y_own + 0.35), C_BARRIER, lw=1.0, ls=":")
    if last > t_own:
        box(ax, t_own, y_own + 0.1, last - t_own, 0.5, "wait flags", C_WAIT, size=7)
    m0 = max(t_own, last)
    box(ax, m0 + 0.2, y_own, 2.0, 0.7, "merge", "#f5c542", size=8)
    box(ax, m0 + 2.2, y_own, 1.6, 0.7, "epilogue", C_BARRIER, size=8, color="white")
    ax.text(0, -0.5, "time, in K/V tiles ->", fontsize=8)
    # The workspace and the merge.
    ax = fig.add_axes([0.76, 0.24, 0.23, 0.66])
    blank(ax, (0, 10), (0, 10))
    slot_bytes = slot_float4s * wg_threads * 16
    box(ax, 0.3, 7.2, 9.4, 2.2, f"flags: {max_ctas} CTAs x {consumers} ints\n(release store / acquire load)", C_BARRIER, size=8,
        color="white")
    box(ax, 0.3, 3.0, 9.4, 3.8, f"a slot per consumer warpgroup\nof each CTA: {slot_float4s} float4 x {wg_threads} threads\n"
        f"= {slot_bytes} bytes (O_acc's {slot_float4s - 1},\nthen m and l of two rows)", C_LIGHT, size=8)
    ax.text(5, 2.4, "the workspace (global memory)", ha="center", fontsize=8.5)
    caption(fig, "Each CTA pair runs its pieces in order; a partial piece (hatched, it starts inside its walk) stores O unnormalized, "
            "with its rows' maxima m and sums l, and then its flag. The owner (the piece that starts the walk, last in its run) "
            "waits for each flag in turn and merges like the online softmax: m = max(m_own, m_part), O = O_own 2^(m_own - m) + "
            "O_part 2^(m_part - m), l likewise; then it stores O / l and the LSE. Partials come from higher runs, that is lower "
            "CTAs, which the GPU starts first; each stores before it waits for anything, so no wait can close a cycle.",
            y=0.01, width=165)
    return fig


@picture("magic_division.png")
def magic_division(k: Code):
    block_m = k.final("BLOCK_M")
    k.find("final", r"(__umulhi)\(", "the multiply-high of the divisions by multiplying")
    d, example = 12, 1000                                       # 12 heads: the video shape of record
    mul, shift = fast_div(d)
    hi = (example * mul) >> 32
    checked = np.arange(1 << 22, dtype=np.uint64)
    for dd in range(1, 300):                                    # exact, for every n < 2^22 and these divisors
        m_, s_ = fast_div(dd)
        assert (fast_div_apply(checked, m_, s_) == checked // np.uint64(dd)).all(), dd
    fig = plt.figure(figsize=(13, 6.2))
    fig.suptitle("Division by multiplying: n / d as a multiply-high, an add and a shift, with d's magic number made once",
                 fontsize=13)
    ax = fig.add_axes([0.02, 0.2, 0.96, 0.7])
    blank(ax, (0, 26), (0, 10))
    box(ax, 0.5, 7.2, 7.5, 2.2, f"once, for d = {d}:\nshift = ceil(log2 d) = {shift}\nmul = 2^32 (2^shift - d) / d + 1\n"
        f"    = {mul}", C_LIGHT, size=9.5)
    steps = [(f"n = {example}", "#c6dbef"), (f"umulhi(n, mul)\n= (n x mul) >> 32 = {hi}", C_COMPUTE),
             (f"+ n = {hi + example}", "#fdd0a2"), (f">> {shift} = {(hi + example) >> shift}", C_BARRIER)]
    for i, (text, colour) in enumerate(steps):
        box(ax, 0.5 + 6.4 * i, 3.6, 5.6, 2.2, text, colour, size=10, color="white" if colour == C_BARRIER else "black")
        if i:
            arrow(ax, (6.4 * i + 0.1, 4.7), (6.4 * i + 0.5, 4.7), C_GRID)
    ax.text(13, 6.4, f"per division: three integer instructions, no divider: {example} / {d} = {example // d}", ha="center",
            fontsize=10)
    product = example * mul
    box(ax, 3.0, 0.6, 10, 1.6, f"high 32 bits: {product >> 32}", C_COMPUTE, size=9.5)
    box(ax, 13.0, 0.6, 10, 1.6, f"low 32 bits: {product & 0xFFFFFFFF} (dropped)", C_LIGHT, size=9.5)
    ax.text(13, 2.6, f"n x mul = {product}, 64 bits; umulhi keeps the high word. Since mul / 2^32 + 1 is just above "
            f"2^shift / d, (umulhi(n, mul) + n) / 2^shift is just above n / d, and the shift's floor is n / d.",
            ha="center", fontsize=9)
    ax.text(9, 8.3, "the work tile's coordinates: t / (work tiles per head), then / heads; its K/V head: head / (heads per "
            "K/V head)\n(work tiles per head: Q tiles of " f"{block_m} rows, paired when causal). All three divisors are fixed "
            "for a call:\ntheir magic numbers are made once, not per tile.", fontsize=9.5, va="center")
    caption(fig, "A GPU has no integer divider: n / d for a d known only at run time compiles to a subroutine (a floating-point "
            "reciprocal and integer corrections). With mul and shift made once for each divisor (Granlund and Montgomery, "
            "\"Division by invariant integers using multiplication\", 1994), every division is a multiply-high, an add and a "
            "shift, exact for 0 <= n < 2^31. This picture computes the example and checks the formula against n // d for every "
            "n < 2^22 and d = 1 to 299 when it is drawn.", y=0.01, width=165)
    return fig


@picture("work_tile_coords.png")
def work_tile_coords(k: Code):
    block_m = k.final("BLOCK_M")
    batch, heads, q_tiles = 2, 3, 5                                  # a small example: N = 5 Q tiles, odd (causal)
    n = q_tiles * block_m
    fig = plt.figure(figsize=(13, 6.0))
    fig.suptitle(f"The work tile's coordinates: t -> (q_tile, head, batch), q_tile fastest (batch {batch}, {heads} heads, "
                 f"N = {n}: {q_tiles} Q tiles of {block_m} rows)", fontsize=12)
    cmap = plt.get_cmap("tab10")
    for panel, causal in enumerate((False, True)):
        per_head = tiles_per_head(q_tiles, causal)
        total = per_head * heads * batch
        ax = fig.add_axes([0.08, 0.58 - 0.4 * panel, 0.9, 0.32])
        blank(ax, (-0.2, total + 0.2), (-0.5, 4.4))
        ax.text(-0.3, 3.9, "causal (pairs of equal work)" if causal else "dense", ha="left", fontsize=10, weight="bold")
        for t in range(total):
            q_tile, head, b = work_tile(t, q_tiles, heads, causal)
            box(ax, t, 2.6, 1, 0.7, str(t), "#eeeeee", size=7)
            box(ax, t, 1.8, 1, 0.7, str(q_tile) if q_tile >= 0 else "-", plt.get_cmap("viridis")(max(q_tile, 0) / q_tiles)
                if q_tile >= 0 else "white", size=7, color="white" if 0 <= q_tile < q_tiles * 0.6 else "black")
            box(ax, t, 1.0, 1, 0.7, str(head), cmap(head), size=7, alpha=0.7)
            box(ax, t, 0.2, 1, 0.7, str(b), cmap(3 + b), size=7, alpha=0.5)
        for y, label in ((2.6, "t"), (1.8, "q_tile"), (1.0, "head"), (0.2, "batch")):
            ax.text(-0.3, y + 0.35, label, ha="right", va="center", fontsize=8.5)
    caption(fig, "bh = t / per_head and i = t - bh per_head; batch = bh / heads and head = bh - batch heads. Dense: q_tile = i "
            f"(per_head = {q_tiles}). Causal: per_head rounds the Q tiles up to whole pairs, and within a head tile 2j is the "
            "j-th longest (q_tiles - 1 - j) and 2j + 1 the j-th shortest (j); '-' is the empty half of an odd head's last pair, "
            "which the CTA skips. Two divisions per tile, by divisors fixed for the call: made once into magic numbers "
            "(magic_division.png).",
            y=0.01, width=165)
    return fig



@picture("backward_walks.png")
def backward_walks(k: Code):
    tile = k.step("step23", "BWD_TILE")
    head_dim = k.head_dim()
    nq, nk = 8, 8                                # an example: 8 query tiles, 8 key tiles, causal (top left)
    j, i = 2, 5                                  # the key tile of the dK/dV CTA shown, the query tile of the dQ CTA
    fig = plt.figure(figsize=(13, 6.6))
    fig.suptitle(f"step23, the backward written plainly: P and dS recomputed tile by tile ({tile} queries x {tile} keys), "
                 "walked twice", fontsize=13)
    for panel, (x0, title) in enumerate(((0.02, f"dK, dV: one CTA per key tile (here tile {j}) walks down its column"),
                                         (0.51, f"dQ: one CTA per query tile (here tile {i}) walks along its row"))):
        ax = fig.add_axes([x0, 0.2, 0.47, 0.68])
        blank(ax, (-2.2, nk + 0.4), (-0.6, nq + 1.6))
        ax.set_title(title, fontsize=10.5)
        for qi in range(nq):
            for kj in range(nk):
                y = nq - 1 - qi
                seen = kj <= qi                  # causal: key tile kj has a key some query of tile qi sees
                walked = seen and (kj == j if panel == 0 else qi == i)
                colour = (C_COMPUTE if walked else "#f3f3f3") if seen else "white"
                box(ax, kj, y, 1, 1, "P, dS" if walked else "", colour, edge="#bbbbbb", size=7, lw=0.6)
        for kj in range(nk):
            box(ax, kj, nq + 0.2, 1, 0.8, f"K{kj} V{kj}", C_TMA if (panel == 0 and kj == j) else C_LIGHT, size=7,
                color="white" if (panel == 0 and kj == j) else "black")
        for qi in range(nq):
            box(ax, -2.0, nq - 1 - qi, 1.8, 1, f"Q{qi} dO{qi}", C_TMA if (panel == 1 and qi == i) else C_LIGHT, size=7,
                color="white" if (panel == 1 and qi == i) else "black")
        if panel == 0:
            arrow(ax, (j + 0.5, nq - j - 0.1), (j + 0.5, 0.1), C_GRID)
            ax.text(nk / 2 - 1, -0.3, f"dV{j} += P$^T$ dO,  dK{j} += scale dS$^T$ Q: in registers, written once;\nthe walk "
                    "starts at the diagonal (the tiles above it see no key of the column)", ha="center", va="top", fontsize=8.5)
        else:
            arrow(ax, (0.1, nq - 1 - i + 0.5), (i + 0.9, nq - 1 - i + 0.5), C_GRID)
            ax.text(nk / 2 - 1, -0.3, f"dQ{i} += scale dS K: in registers, written once;\nthe walk ends at the diagonal",
                    ha="center", va="top", fontsize=8.5)
    caption(fig, "Per tile, from what the forward kept (O and each row's LSE; never P): S = scale Q K$^T$, "
            "P = exp(S - LSE), dP = dO V$^T$, dS = P (dP - D) with D = rowsum(dO O), one number per query row that a "
            f"first kernel makes. Each CTA holds its tiles in shared memory as fp32 ({head_dim} dims a row) and its "
            "gradient rows in registers; every output element has one writer, so no atomics and the same bits every "
            "call, at the price of recomputing P and dS twice (once per walk). Grey: tiles the other CTAs walk; white: "
            "above the diagonal, skipped.", y=0.01, width=175)
    return fig


@picture("backward_one_pass.png")
def backward_one_pass(k: Code):
    tile = k.step("step26", "BWD_TILE")
    nq, nk, j = 6, 6, 2                          # an example: 6 query tiles, 6 key tiles, dense; the key tile shown
    fig = plt.figure(figsize=(13, 6.6))
    fig.suptitle("steps 25 and 26: one walk over the scores, dQ added up across CTAs; the next query tile copied in "
                 "under the products", fontsize=12.5)
    ax = fig.add_axes([0.02, 0.22, 0.44, 0.66])
    blank(ax, (-3.4, nk + 0.4), (-0.4, nq + 1.4))
    ax.set_title(f"step25: the CTA of key tile {j} ({tile} keys) makes dQ's share of every query tile it walks",
                 fontsize=10)
    for qi in range(nq):
        y = nq - 1 - qi
        for kj in range(nk):
            box(ax, kj, y, 1, 1, "P, dS" if kj == j else "", C_COMPUTE if kj == j else "#f3f3f3", edge="#bbbbbb",
                size=7, lw=0.6)
        box(ax, -3.2, y, 1.4, 1, f"Q{qi} dO{qi}", C_LIGHT, size=7)
        box(ax, -1.7, y, 1.5, 1, f"dQ{qi} fp32", "#fde0c5", size=7)
        arrow(ax, (j, y + 0.5), (-0.2, y + 0.5), C_EMPTY, lw=0.9)
    for kj in range(nk):
        box(ax, kj, nq + 0.2, 1, 0.8, f"K{kj} V{kj}", C_TMA if kj == j else C_LIGHT, size=7,
            color="white" if kj == j else "black")
    ax.text(nk / 2 - 1, -0.3, f"red: += dS K{j} (atomicAdd of float2); every key tile's CTA adds to every row:\n"
            "the order of the adds varies, and with it dQ's last bits", ha="center", va="top", fontsize=8.5)
    ax = fig.add_axes([0.52, 0.3, 0.46, 0.55])
    blank(ax, (-2.6, 6.2), (-0.4, 3.3))
    ax.set_title("step26: two slots of Q, dO, LSE and D; one CTA, its query tiles in time", fontsize=10)
    lanes = (("copies (cp.async)", 2.2), ("products (mma.sync)", 1.2), ("dQ adds (red.global)", 0.2))
    for label, y in lanes:
        ax.text(-0.2, y + 0.35, label, ha="right", va="center", fontsize=8.5)
    for tj in range(5):
        x = tj * 1.2
        if tj < 4:
            box(ax, x, 2.2, 1.1, 0.7, f"tile {tj + 1} -> slot {(tj + 1) % 2}", C_TMA, size=7, color="white")
        box(ax, x, 1.2, 1.1, 0.7, f"tile {tj}, slot {tj % 2}", C_COMPUTE, size=7)
        box(ax, x + 0.55, 0.2, 0.55, 0.7, "dQ", C_EMPTY, size=7, color="white")
    ax.text(2.4, -0.3, "the copies of tile j+1 are in flight while tile j's products run\n(cp.async.wait_group 1, "
            "then one barrier); step25 loaded each tile, then waited for it", ha="center", va="top", fontsize=8.5)
    caption(fig, "Left: step24 walked the scores twice, the key tiles' CTAs for dK and dV, the query tiles' for dQ, making "
            "S and dP twice; step25's key-tile CTA writes dS to shared memory, multiplies it by its K tile and adds the "
            "result to an fp32 accumulator, zeroed by the first kernel and scaled into bf16 dQ by the last. "
            "deterministic=True keeps step24's second walk, whose single writer per element gives the same bits every "
            f"call. Right: step26's key-tile CTA with its {tile}-query tiles in two slots.", y=0.01, width=175)
    return fig



@picture("backward_warp_roles.png")
def backward_warp_roles(k: Code):
    slots, tile, keys = k.step("step36", "BWD_SLOTS"), k.step("step36", "BWD_TILE"), k.step("step36", "KEY_TILE")
    producer_regs, consumer_regs = k.step("step36", "PRODUCER_REGS"), k.step("step36", "CONSUMER_REGS")
    consumer_threads = k.step("step36", "DKDV_THREADS")
    half = keys // 2
    dq_regs = tile * (k.head_dim() // 2) // 128  # a consumer's dQ: its half of the dims, 128 threads
    fig = plt.figure(figsize=(13, 6.8))
    fig.suptitle(f"steps 35 and 36: the backward's warp roles, one query tile j ({tile} queries) against the CTA's "
                 f"{keys} keys, in order (a schedule, not a measurement)", fontsize=12.5)
    ax = fig.add_axes([0.22, 0.25, 0.76, 0.66])
    blank(ax, (-0.2, 10.6), (-0.3, 5.2))
    rows = {"load": 4.4, "stats": 3.6, "reduce": 2.8, "wg1": 1.6, "wg2": 0.6}
    labels = {"load": "producer warp 0: Q, dO (TMA)", "stats": "producer warp 1: LSE, D",
              "reduce": "producer warp 2: dQ's reducer", "wg1": f"consumer warpgroup 1: keys 0-{half - 1}",
              "wg2": f"consumer warpgroup 2: keys {half}-{keys - 1}"}
    for name, y in rows.items():
        ax.text(-0.3, y + 0.3, labels[name], ha="right", va="center", fontsize=9)
    for name in ("wg1", "wg2"):                  # the consumers' tile: their phases in order
        y = rows[name]
        box(ax, 0.0, y, 0.3, 0.6, "", C_WAIT)
        box(ax, 0.3, y, 2.6, 0.6, "S$^T$ = K Q$^T$, dP$^T$ = V dO$^T$", C_COMPUTE, size=8)
        box(ax, 2.9, y, 1.5, 0.6, "P$^T$, dS$^T$ (ex2)", C_SOFTMAX, size=8)
        box(ax, 4.4, y, 0.9, 0.6, "dV", C_COMPUTE, size=8)
        box(ax, 5.45, y, 2.3, 0.6, "dQ = dS K, dK", C_COMPUTE, size=8)
        box(ax, 6.7, y - 0.28, 1.05, 0.26, "stage dQ", C_TMA, size=7, color="white")
        box(ax, 7.9, y, 2.6, 0.6, "tile j + 1: S$^T$, dP$^T$ ...", "#fbe3cc", size=8)
    ax.plot([5.37, 5.37], [0.45, 2.35], color=C_BARRIER, lw=3)
    ax.text(5.37, 2.45, f"named barrier ({consumer_threads} consumer threads):\ndS$^T$(j) whole in shared memory",
            ha="center", va="bottom", fontsize=7.5, color=C_BARRIER)
    box(ax, 0.0, rows["load"], 7.75, 0.6, f"tiles j + 1, j + 2 already in their slots ({slots} slots)", "#f4f4f4", size=8)
    box(ax, 7.9, rows["load"], 1.2, 0.6, "tile j + 3", C_TMA, size=8, color="white")
    box(ax, 0.0, rows["stats"], 7.75, 0.6, "", "#f4f4f4")
    box(ax, 7.9, rows["stats"], 1.2, 0.6, "tile j + 3", C_TMA, size=8, color="white")
    box(ax, 0.0, rows["reduce"], 7.75, 0.6, "waits for dq_full (dQ(j) staged)", C_WAIT, size=8)
    box(ax, 7.9, rows["reduce"], 2.3, 0.6, "TMA reduce-add of dQ(j)", C_TMA, size=8, color="white")
    arrow(ax, (7.75, 1.0), (7.95, 2.8), C_BARRIER, "dq_full", size=7.5, text_offset=(-0.35, 0.15))
    arrow(ax, (7.8, 2.0), (7.95, 4.4), C_EMPTY, "empty[j % " + str(slots) + "]", size=7.5, text_offset=(-0.55, 0.9))
    arrow(ax, (10.2, 2.8), (10.45, 2.3), C_EMPTY, "stage_free", size=7.5, text_offset=(0.1, -0.55))
    ax.text(0.0, -0.2, "full[j % " + str(slots) + "] completed: Q and dO landed, LSE and D stored; the consumers "
            "start tile j", fontsize=8, va="top", color=C_BARRIER)
    caption(fig, f"Step35 moved dQ = dS K from behind the next tile's S$^T$ and dP$^T$ to beside dK in its own tile: its "
            f"{dq_regs} accumulator registers are no longer live beside S$^T$'s and dP$^T$'s, and a consumer fits in "
            f"{consumer_regs} registers. Step36 then gives warpgroup 0 the errands (setmaxnreg {producer_regs}): warp 0 "
            f"loads Q and dO up to {slots} tiles ahead, warp 1 the LSE and D, warp 2 adds each staged dQ to the fp32 "
            "accumulator by TMA. Slots change hands on mbarriers: full (2 TMA arrivals + 32 lanes), empty (every "
            "consumer thread), dq_full (every consumer thread), stage_free (the reducer, once the TMA unit has read "
            f"the staging tile). The consumers meet only each other, once a tile, where step35's {consumer_threads} threads met at "
            "__syncthreads with the copies and the reduction on their path.", y=0.01, width=175)
    return fig


# ---------------------------------------------------------------- Part IV: what else models pass

FORMATS = [("fp32", 8, 23), ("bf16", 8, 7), ("fp16", 5, 10)]  # (name, exponent bits, fraction bits)


def float_format(exponent_bits: int, fraction_bits: int) -> dict:
    """What an IEEE-style binary format of these widths holds: its largest finite value, its smallest normal one, and
    the distance from 1 to the next value up (its precision, relative)."""
    bias = 2 ** (exponent_bits - 1) - 1
    return {"max": (2 - 2.0 ** -fraction_bits) * 2.0 ** bias, "min_normal": 2.0 ** (1 - bias),
            "ulp_at_1": 2.0 ** -fraction_bits}


@picture("fp16_bf16.png")
def fp16_bf16(k: Code):
    k.find("final", r"cvt_rn_x2_f32<(Elem)>", "the conversions from fp32 to the call's 16-bit type")
    k.find("final", r"wgmma_m64n128k16_ss<(Elem)>", "the MMA of the call's 16-bit type")
    fig = plt.figure(figsize=(13, 6.4))
    fig.suptitle("bf16 and fp16: the same 16 bits, split differently; step40 builds every kernel for either", fontsize=13)
    ax = fig.add_axes([0.02, 0.2, 0.96, 0.72])
    blank(ax, (0, 40), (0, 11))
    colours = {"sign": "#fdd0a2", "exponent": "#c6dbef", "fraction": "#c7e9c0"}
    unit = 0.95                                      # the width of one bit
    for row, (name, e_bits, f_bits) in enumerate(FORMATS):
        y = 9.2 - 2.2 * row
        fmt = float_format(e_bits, f_bits)
        ax.text(0.3, y + 0.45, name, fontsize=11, va="center", weight="bold")
        x = 2.2
        for part, width in (("sign", 1), ("exponent", e_bits), ("fraction", f_bits)):
            w = unit * min(width, 10) if name == "fp32" and part == "fraction" else unit * width
            label = f"{width}" if part != "fraction" or name != "fp32" else f"{width} (drawn cut)"
            box(ax, x, y, w, 0.9, label, colours[part], size=8.5)
            x += w
        ax.text(x + 0.4, y + 0.45, f"largest {fmt['max']:.6g}, smallest normal {fmt['min_normal']:.3g}, "
                f"1 + 2^-{f_bits} is the next value after 1", fontsize=9, va="center")
    for part, colour in colours.items():
        ax.text(2.2 + 4.2 * list(colours).index(part), 2.55, part, fontsize=8.5,
                bbox={"facecolor": colour, "edgecolor": C_GRID, "pad": 2})
    box(ax, 0.4, 0.2, 39.2, 1.9, "", C_LIGHT)
    ax.text(20, 1.15, "in step40: Q, K, V, dO and the outputs O, dQ, dK, dV in the call's type; S, dP, O and every "
            "accumulator in fp32 (the tensor cores multiply\nbf16 x bf16 or fp16 x fp16 exactly into fp32); rounded to "
            "the call's type on the way: P and dS (the A operands of the next products) and the outputs",
            ha="center", va="center", fontsize=9)
    bf16, fp16 = float_format(8, 7), float_format(5, 10)
    caption(fig, f"bf16 keeps fp32's exponent and 8 bits of precision; fp16 trades 3 exponent bits for 3 more bits of "
            f"precision (each rounding {bf16['ulp_at_1'] / fp16['ulp_at_1']:.0f}x finer) and a range up to "
            f"{fp16['max']:.0f}. In attention the inputs and P (at most 2^8 under the conditional rescale, step12) fit "
            "fp16's range, so the same kernel computes both, ptxas gives the two builds the same code, and only the "
            "precision of the roundings differs: the checks judge an fp16 call against a yardstick that rounds to fp16. "
            "The numbers are computed from the bit widths when the picture is drawn.", y=0.01, width=170)
    return fig


@picture("dq_partials.png")
def dq_partials(k: Code):
    keys, queries = k.final("KEY_TILE"), k.final("BWD_TILE")
    box_cols = k.final("DQ_BOX_FLOATS") // queries                 # 32 dims a box of the staged dQ tile
    boxes = 128 // box_cols
    k.find("final", r"for \(int kk = 0; kk < (KEY_TILE / 16 / \(128 / D\)); \+\+kk\)", "dQ^T's k-steps by the head dim")
    k.find("final", r"cp_reduce_async_bulk_tensor_4d_add\(&dQ_map, (box % \(D / 32\) \* 32)", "the column a staged box adds to")
    fig = plt.figure(figsize=(13, 7.0))
    fig.suptitle("step42: dQ^T = K^T dS^T by the two consumer warpgroups, at head dim 128 and at 64", fontsize=13)
    colours = (C_COMPUTE, C_TMA)
    for panel, d in enumerate((128, 64)):
        ax = fig.add_axes([0.01 + 0.5 * panel, 0.2, 0.48, 0.68])
        blank(ax, (0, 24), (0, 20))
        ax.text(12, 19.4, f"head dim {d}", ha="center", fontsize=12, weight="bold")
        # K: [keys, d], keys down, dims across; each warpgroup's share in its colour
        sx = 6.5 / 128                                           # drawing units per dim or key
        kx, ky, kw, kh = 0.5, 11, d * sx, keys * sx
        ax.text(kx, ky + kh + 0.4, f"K: {keys} keys x {d} dims", fontsize=8.5)
        for wg in range(2):
            if d == 128:   # each warpgroup: its half of the dims, all the keys
                box(ax, kx + wg * kw / 2, ky, kw / 2, kh, f"wg{wg}\ndims\n{64 * wg}-{64 * wg + 63}\nall keys",
                    colours[wg], alpha=0.45, size=7.5)
            else:          # each warpgroup: all 64 dims, its half of the keys
                box(ax, kx, ky + (1 - wg) * kh / 2, kw, kh / 2, f"wg{wg}\nkeys\n{64 * wg}-{64 * wg + 63}", colours[wg],
                    alpha=0.45, size=7.5)
        steps = keys // 16 // (128 // d)
        ax.text(kx, ky - 0.6, f"each warpgroup:\nM = 64 dims,\nN = {queries} queries,\n{steps} k-steps of 16 keys",
                fontsize=8, va="top")
        # the staged dQ tile: boxes of box_cols dims x queries, and the accumulator they are added to
        tx, ty, bw = 8.2, 13.5, 3.7
        ax.text(tx, ty + 3.3, f"dQ staged (shared memory): {boxes} boxes of {queries} queries x {box_cols} dims", fontsize=8.5)
        for b in range(boxes):
            wg = b // 2
            dims = b * box_cols if d == 128 else b % 2 * box_cols
            box(ax, tx + b * (bw + 0.2), ty, bw, 2.8, f"box {b}: wg{wg}\ndims {dims}-{dims + box_cols - 1}", colours[wg],
                alpha=0.45, size=7.5)
        ax.text(tx, 4.2, f"dQ accumulator (fp32, L2): {queries} queries x {d} dims", fontsize=8.5, va="top")
        for c in range(d // box_cols):
            box(ax, tx + c * (bw + 0.2), 4.6, bw, 2.6, f"dims {c * box_cols}-{c * box_cols + box_cols - 1}", C_LIGHT, size=7.5)
        for b in range(boxes):
            target = b % (d // box_cols)
            arrow(ax, (tx + b * (bw + 0.2) + bw / 2, ty), (tx + target * (bw + 0.2) + bw / 2, 7.2), colours[b // 2])
        ax.text(tx, 3.2, "cp.reduce.async.bulk.tensor .add, one instruction a box" + (
            "" if d == 128 else ":\ntwo partials to each column; a deterministic call adds\nwg1's once wg0's have landed (the same bits)"),
                fontsize=8, va="top")
    caption(fig, f"At 128 each consumer warpgroup of the dK/dV kernel (64 keys of the CTA's {keys}) computes dQ^T for its "
            f"half of the head dim over all {keys} keys: M = 64 dims is one wgmma's M. At 64 there is one half, so each "
            f"warpgroup computes all 64 dims over its own 64 keys instead, half the k-steps: a partial sum. Both partials "
            f"are staged in the same tile as at 128 (the same {boxes} boxes, the same bytes) and the reducer adds each box "
            f"to its column of the accumulator: at 128 every box to its own, at 64 two boxes to each. The sizes are read "
            "from the final step's kernel.cu.", y=0.01, width=170)
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python docs/pictures.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="pictures to draw (file names, .png optional; default: all)")
    ap.add_argument("--check", action="store_true", help="draw nothing; list the stale pictures (exit 1 if any)")
    args = ap.parse_args(argv)
    names = [n if n.endswith(".png") else n + ".png" for n in args.names] or list(PICTURES)
    unknown = [n for n in names if n not in PICTURES]
    if unknown:
        ap.error(f"no picture {', '.join(unknown)} (there are: {', '.join(PICTURES)})")
    if args.check:
        problems = [p for n in names for p in (stale(ROOT / IMG / n) if (ROOT / IMG / n).exists() else [f"{IMG}/{n}: missing"])]
        print("\n".join(problems) or f"{len(names)} pictures up to date")
        return 1 if problems else 0
    for name in names:
        path = draw(name)
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size // 1024} KB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
