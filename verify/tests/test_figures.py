"""CPU: every measured figure in a step header and docs/*.md comes from a results file it cites; every
picture in docs/img/ is drawn by docs/pictures.py from the kernels' constants as they are now, and is shown by a page.

THE PICTURES (the tests at the end): each docs/img/*.png carries what docs/pictures.py drew it from (the constants
it read, where, and a hash of its drawing code); a picture whose constant or drawing code changed since, one that no
function of docs/pictures.py draws, one that no docs page, README or step header shows, or one over 150 KB fails.
`python docs/pictures.py` redraws them all; `python docs/pictures.py --check` lists the stale ones.

WHERE A FIGURE'S SOURCE IS NAMED: a citation is a path under results/ that ends in .json, .log or .txt (a
folder ends in '/'; a glob such as `variants*.log` stands for the files it matches), written in the text:
`results/h200/2026-11-29T21-28-55Z.json`. A file that left the tree is cited at a commit that holds it,
`results/h200/dev/2026-11-29-multicast.log@3c57885`, and read with `git show 3c57885:results/...`. A bare file
name counts where a folder cited beside it holds that file.
  * A step's kernel.cu: the header is its leading comment block; a paragraph there runs from an ALL-CAPS
    heading (`// MEASURED (results/....json, H200, N = 4K / 8K / 16K):`) or a blank comment line to the next
    blank comment line or heading. Further down the file, only paragraphs that cite are checked.
  * docs/*.md: a paragraph, a list item, a table row or a heading; a heading's citations cover its
    section.

WHAT A FIGURE IS:
  * every number with a decimal point, in a paragraph that cites (1.07, 660.4, 134.7M, 1.8e-3);
  * every number, integer or not, that carries a measured unit: TFLOP/s, TFLOPS, GFLOP/s, TB/s, GB/s, MHz, GHz,
    W, %, ms, µs/us, ns, or a ratio sign written on it (1.08x, 2×). A unit written once after a list or a range
    is every member's: `660.4 / 663.3 / 665.5 TFLOP/s`, `1695-1890 MHz`, `13-17 %`;
  * every number in a data cell of a table (a cell of numbers only, not the first column, not the header row).
A number without a measured unit and without a decimal point is no figure: 132 CTAs, 128 keys, N = 4K,
1 x 2 x 5 x 300, 64 MUFU.EX2, 8192³. Text in `backquotes` (code, commands) holds no figure.

NOT A MEASUREMENT, so never checked:
  * a prediction or a target: a figure after "predict...", "PREDICTION", "target", "goal", "expect..." or
    "estimate..." in the same sentence (sentences end at '.', ';' or '?'), unless "got", "measured", "ran",
    "runs", "came" or "gave" comes between; a table row whose header row says so ("| target | |"); all of a
    header paragraph under `// PREDICTION:` that cites no file (one that cites has its sentences read as above);
  * arithmetic written out: the result of `... op ... = figure` (op one of · × * / ÷ + − -, on numbers); its
    operands are figures like any other. Where the left side is numbers and operators only, the result must be
    its value, rounded as written (as a percentage for %): `1 − 649.1/791.3 = 18 %`;
  * a datasheet value, marked right after it: `4.8 TB/s (datasheet)`.

WHERE A FIGURE MAY COME FROM (any of the files its paragraph cites):
  * a results JSON of a run (with "timings", or a backward run's under "backward"): a TFLOP/s figure of any
    implementation (the cuBLAS GEMM's too) at any N, to 0 or 1 decimal; a ratio of two of them at the same N (or of
    one to the GEMM) to the figure's decimals (2 significant digits below 0.1, as the README table writes them); the
    clocks and power it records, or a number it records outside its timings (versions, settings), rounded to the
    figure's decimals. Times and percentages are left out on purpose: hundreds of times, rounded, and the
    percentages of thousands of pairs would back almost any small figure;
  * any other JSON, .log or .txt: a number in the file, rounded to the figure's own number of decimals, a
    K/M/G suffix or an exponent scaling it (134.7M for 134,742,016; 1.8e-3 for 1.78e-03);
  * a ratio (x, ×, or a plain number) or a percentage may also come from two figures of the same paragraph, in
    one unit, that have a source: "584.6 against 515.1 TFLOP/s: 1.13x, 13 % ahead" (|a/b - 1| or a/b).
Rounding only drops digits: a figure is never more precise than the number it comes from (4.0 does not
come from a recorded 4).

WHAT FAILS: a figure no cited file backs; a measured figure (a unit, a table cell) in a paragraph that cites no
results file; a MEASURED paragraph that states a number but cites no results file; a citation of a file that
does not exist (at that commit); a figure whose paragraph cites only a folder (name the file); arithmetic
whose result is not its left side's value. Where the repository has no history to read (a copy without .git, a
shallow clone without the commit), the test skips with that reason once everything else has passed.

LIMITS: an integer with a unit is backed by any equal number in a cited log (logs hold many small integers):
prefer the figure as the log writes it, decimals included; ratios and percentages of a paragraph's own figures
back what any pair of them gives.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A path under the repository's results/, whole, optionally at a commit ('rev:results/...', as in `git show`, is a
# command, not a citation). A results file ends in .json, .log or .txt; a folder in '/'; other paths (a .png) are no source.
CITE = re.compile(r"(?<![\w:/.-])(results/[\w./*-]*[\w*/])(?:@([0-9a-f]{7,40}))?(?=[\s`),.;:'\"\]]|$)")
RESULTS_SUFFIXES = (".json", ".log", ".txt")
BARE = re.compile(r"(?<![\w/.*-])[\w*-][\w.*-]*\.(?:json|log|txt)\b")
# Paths and link targets that are no citation (../results/h200/timeline/step10.png, steps/step14/kernel.cu): no figures.
PATH = re.compile(r"\]\([^)\s]*\)|(?<![\w])(?:\.\./)*(?:results|docs|steps|common|verify|notes|build|img)/[\w./*@-]*")
CODE = re.compile(r"`[^`\n]*`")
NUMBER = re.compile(r"(?<![\w.^])(?P<sign>[+−-](?=\d))?(?P<num>\d+(?:\.\d+)?)(?!\.\d)(?:e(?P<exp>[-+]?\d+))?"
                    r"(?P<suffix>[KMGT](?![A-Za-z]))?(?P<x>[x×](?!\w))?(?!\w|\.\d)")
UNIT = re.compile(r"[ \u00a0]?(?P<unit>TFLOP/s|TFLOPS|GFLOP/s|TB/s|GB/s|MHz|GHz|W(?![\w/])|%|ms\b|[µμ]s\b|us\b|ns\b)")
JOIN = re.compile(r"\s*(?:/|–|−|-|,|→|->|to|and|or)\s*")  # between the members of a list or a range
SENTENCE_END = re.compile(r"[.;?](?=\s)|\n\s*\n")
PREDICTION = re.compile(r"\b(?:predict\w*|PREDICTION|target\w*|goal\w*|expect\w*|estimate\w*)\b", re.I)
MEASURED_WORD = re.compile(r"\b(?:got|measured|ran|runs|came|gave)\b", re.I)
ARITHMETIC_LHS = re.compile(r"\d[^=\n]*?[·×*/÷+−-]\s*[\d(]")
DATASHEET = re.compile(r"\s*[(,]\s*datasheet\b", re.I)
HEADING = re.compile(r"// ([A-Z][A-Z0-9]+(?: [A-Z0-9]+)*)(?=[ :(,]|$)")
TABLE_RULE = re.compile(r"\s*\|?\s*:?-{3,}")
CLOCK_OR_POWER = re.compile(r"mhz|clock|power|watt", re.I)  # the fields of a timing cell that are not times
SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
NUMBER_IN_TEXT = re.compile(r"(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?:[eE]([-+]?\d+))?")


def fmt_ratio(r: float) -> str:
    return f"{r:.2f}" if r >= 0.1 else f"{r:.2g}"


# ---- the repository: the tree, and its history through git ----

class Unreadable(Exception):
    """The repository's history cannot be read here (no .git, no git, a shallow clone): a reason to skip."""


class Repo:
    """The files a citation may name: the working tree, or a commit of the history (`git show COMMIT:PATH`)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._trees: dict[str, set[str]] = {}

    def git(self, *args: str) -> subprocess.CompletedProcess:
        if shutil.which("git") is None:
            raise Unreadable("git is not installed")
        return subprocess.run(["git", "-C", str(self.root), *args], capture_output=True, text=True)

    @functools.cached_property
    def history(self) -> str | None:
        """None where the history can be read, else why not."""
        try:
            top = self.git("rev-parse", "--show-toplevel")
        except Unreadable as e:
            return str(e)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != self.root.resolve():
            return f"{self.root} is not the top of a git repository (a copy without its history)"
        return None

    def commit(self, rev: str) -> str:
        """The full hash of `rev`; Unreadable where the history is missing, ValueError where `rev` is none of it."""
        if self.history:
            raise Unreadable(self.history)
        out = self.git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
        if out.returncode == 0:
            return out.stdout.strip()
        if self.git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
            raise Unreadable(f"this clone is shallow and lacks commit {rev} (git fetch --unshallow)")
        raise ValueError(f"{rev} is not a commit of this repository")

    def tree(self, commit: str) -> set[str]:
        if commit not in self._trees:
            out = self.git("ls-tree", "-r", "--name-only", "-z", commit)
            if out.returncode != 0:
                raise Unreadable(f"git ls-tree {commit} failed: {out.stderr.strip()}")
            self._trees[commit] = set(filter(None, out.stdout.split("\0")))
        return self._trees[commit]

    def files(self, cite: str, commit: str | None) -> list[str]:
        """The files a citation names (a file, a folder's files, a glob's matches), as paths relative to the root."""
        if commit is None:
            if "*" in cite:
                return sorted(str(p.relative_to(self.root)) for p in self.root.glob(cite) if p.is_file())
            path = self.root / cite
            if cite.endswith("/"):
                return sorted(str(p.relative_to(self.root)) for p in path.iterdir() if p.is_file()) if path.is_dir() else []
            return [cite] if path.is_file() else []
        tree = self.tree(commit)
        if "*" in cite:
            pattern = re.compile("[^/]*".join(map(re.escape, cite.split("*"))) + r"\Z")
            return sorted(f for f in tree if pattern.match(f))
        if cite.endswith("/"):
            return sorted(f for f in tree if f.startswith(cite) and "/" not in f[len(cite):])
        return [cite] if cite in tree else []

    def read(self, path: str, commit: str | None) -> str:
        if commit is None:
            return (self.root / path).read_text(errors="replace")
        out = self.git("show", f"{commit}:{path}")
        if out.returncode != 0:
            raise Unreadable(f"git show {commit[:12]}:{path} failed: {out.stderr.strip()}")
        return out.stdout

    def where_it_was(self, path: str) -> str:
        """A hint for a citation of a file that is not in the tree: the newest commit that holds it, if any."""
        if self.history:
            return ""
        if self.git("cat-file", "-e", f"HEAD:{path.rstrip('/')}").returncode == 0:
            held = self.git("rev-parse", "--short", "HEAD").stdout.strip()
            return f" (HEAD still holds it: cite it as {path}@{held})"
        gone = self.git("log", "-1", "--format=%h %P", "--diff-filter=D", "--", path.rstrip("/")).stdout.split()
        if len(gone) >= 2:
            held = self.git("rev-parse", "--short", gone[1]).stdout.strip()
            return f" (it left the tree in {gone[0]}: cite it as {path}@{held}, the commit before)"
        return ""


@functools.lru_cache(maxsize=None)
def repo(root: Path) -> Repo:
    return Repo(root)


# ---- what a results file lets a figure say ----

class Source:
    def __init__(self, text: str, is_json: bool, name: str):
        self.name = name
        self.tflops: list[float] = []
        self.ratios: list[float] = []
        self.numbers: list[tuple[float, float]] = []  # (value, the last digit's place: 0.01 for 1.23)
        data = json.loads(text) if is_json else None
        # A run's timings: the forward's at the top, the backward's under "backward" (python -m verify.backward, or
        # the main job's backward table), each read the same way.
        runs = [r for r in (data, data.get("backward") if isinstance(data, dict) else None)
                if isinstance(r, dict) and "timings" in r]
        self.run = bool(runs)
        if self.run:
            for run in runs:
                self._read_run(run)
        elif data is not None:
            self.numbers = numbers_of(data)
        else:
            self.numbers = numbers_in(text)

    def _read_run(self, run: dict) -> None:
        # {field: {(impl, N): value}} for every TFLOP/s field ("tflops", "burst_tflops", ...)
        fields: dict[str, dict] = {}
        for impl, by_n in run.get("timings", {}).items():
            for n, cell in by_n.items():
                for key, value in cell.items():
                    if "tflops" in key and isinstance(value, (int, float)):
                        fields.setdefault(key, {})[impl, n] = value
        for values in fields.values():
            self.tflops += list(values.values())
            for (a, n), va in values.items():
                for (b, m), vb in values.items():
                    if a != b and (n == m or "cublas_gemm" in (a, b)) and va > 0 and vb > 0:
                        self.ratios.append(va / vb)
        cells = [cell for by_n in run.get("timings", {}).values() for cell in by_n.values()]
        self.numbers += numbers_of({k: v for k, v in run.items() if k not in ("timings", "backward")})
        self.numbers += numbers_of([{k: v for k, v in c.items() if CLOCK_OR_POWER.search(k)} for c in cells])

    @functools.cached_property
    def _formatted(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {"tflops": set(), "ratio": set()}
        for d in (0, 1):
            out["tflops"] |= {f"{v:.{d}f}" for v in self.tflops}
        for d in (0, 1, 2):
            out["ratio"] |= {f"{r:.{d}f}" for r in self.ratios}  # a figure with its ratio sign: 1.1x, 1.08x
        out["plain ratio"] = {fmt_ratio(r) for r in self.ratios}  # without the sign: as the README table writes them
        out["ratio"] |= out["plain ratio"]
        return out

    def has(self, fig: Figure) -> bool:
        if not self.run:
            return matches(fig, self.numbers)
        f, plain = self._formatted, not fig.exp and not fig.suffix
        if fig.unit in ("TFLOP/s", "TFLOPS"):
            return plain and fig.num in f["tflops"]
        if fig.unit == "x":
            return plain and fig.num in f["ratio"]
        if fig.unit in ("%", "ms", "µs", "μs", "us", "ns", "TB/s", "GB/s", "GFLOP/s"):
            return False  # times: hundreds of them, they would back anything; a percentage: from the paragraph's figures
        if fig.unit == "" and plain and (fig.num in f["plain ratio"] or fig.num in f["tflops"] and fig.decimals <= 1):
            return True
        return matches(fig, self.numbers)  # MHz, W, or a plain number: the clocks, the power, what it records


def matches(fig: Figure, numbers) -> bool:
    """Whether one of (value, place) rounds to the figure without the figure being more precise than it."""
    scale = SCALE[fig.suffix] * 10.0 ** int(fig.exp or 0)
    place = scale * 10.0 ** -fig.decimals * (1 + 1e-9)
    return any(f"{v / scale:.{fig.decimals}f}" == fig.num and p <= place for v, p in numbers)


def numbers_in(text: str) -> list[tuple[float, float]]:
    """(value, place of its last digit) of every number written in a text: '134,742,016' -> (134742016, 1)."""
    out = []
    for whole, frac, exp in NUMBER_IN_TEXT.findall(text):
        e = int(exp or 0)
        if abs(e) > 300:  # not a number: a hash such as 7e98024 in a log
            continue
        out.append((float(f"{whole.replace(',', '')}.{frac or 0}e{e}"), 10.0 ** (e - len(frac))))
    return out


def numbers_of(node) -> list[tuple[float, float]]:
    """Every number in a piece of a JSON, in its values and in its strings ("1980 MHz")."""
    if isinstance(node, dict):
        return [x for v in node.values() for x in numbers_of(v)]
    if isinstance(node, list):
        return [x for v in node for x in numbers_of(v)]
    if isinstance(node, bool) or node is None:
        return []
    if isinstance(node, (int, float)):
        return numbers_in(repr(node))
    return numbers_in(str(node))


@functools.lru_cache(maxsize=None)
def source(root: Path, path: str, commit: str | None, name: str | None = None) -> Source:
    return Source(repo(root).read(path, commit), path.endswith(".json"), name or path)


# ---- the figures of a piece of text ----

class Figure:
    def __init__(self, m: re.Match, unit: str, start: int):
        self.text = m.group(0)
        self.num, self.exp, self.suffix = m.group("num"), m.group("exp"), m.group("suffix") or ""
        self.decimals = len(self.num.split(".")[1]) if "." in self.num else 0
        self.unit = "x" if m.group("x") else unit
        self.start, self.end = start, m.end()
        self.value = float(self.num) * SCALE[self.suffix] * 10.0 ** int(self.exp or 0)
        self.in_table = False

    @property
    def measured(self) -> bool:  # a figure even without a decimal point
        return bool(self.unit) or self.in_table


def blank(text: str, pattern: re.Pattern) -> str:
    """The text with every match of `pattern` replaced by spaces (offsets, and so line numbers, stay)."""
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def figures_in(text: str) -> list[Figure]:
    """Every number of `text` (citations, paths and code already blanked) with its unit; a unit after the last
    member of a list or range is every member's."""
    found = [m for m in NUMBER.finditer(text)]
    figs: list[Figure] = []
    group: list[re.Match] = []

    def close():
        if not group:
            return
        unit_m = UNIT.match(text, group[-1].end())
        unit = unit_m.group("unit") if unit_m else ""
        for m in group:
            figs.append(Figure(m, unit, m.start()))
        group.clear()

    for m in found:
        if group and not (JOIN.fullmatch(text[group[-1].end():m.start()]) and not UNIT.match(text, group[-1].end())
                          and not group[-1].group("x")):
            close()
        group.append(m)
    close()
    return figs


def clause_start(text: str, start: int, end: int) -> int:
    """Where the left side of arithmetic ending at `end` may begin: after the last ':', ';', ', ' or '='."""
    cut = [m.end() for m in re.finditer(r"[:;=≈]|, ", text[start:end])]
    return start + (cut[-1] if cut else 0)


def exempt(text: str, fig: Figure, context: str = "") -> bool:
    """A prediction, a target, written-out arithmetic or a datasheet value: not a measurement."""
    start = max([0] + [m.end() for m in SENTENCE_END.finditer(text, 0, fig.start)])
    before = text[start:fig.start]
    pred = [m.end() for m in PREDICTION.finditer(before)]
    if pred and not MEASURED_WORD.search(before, pred[-1]) or PREDICTION.search(context):
        return True
    unit = UNIT.match(text, fig.end)
    if DATASHEET.match(text, unit.end() if unit else fig.end):
        return True
    return arithmetic(text, fig) is not None


# Units the arithmetic may carry, in SI (a K on a number is 1024, as in N = 16K: the shapes are powers of two).
ARITH_UNITS = {"TFLOP/s": 1e12, "GFLOP/s": 1e9, "TB/s": 1e12, "GB/s": 1e9, "TFLOP": 1e12, "FLOP per byte": 1.0,
               "FLOP": 1.0, "MB": 1e6, "GB": 1e9, "B": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9, "s": 1.0,
               "%": 1e-2}
ARITH_UNIT = "|".join(re.escape(u) for u in sorted(ARITH_UNITS, key=len, reverse=True))
OPERAND = re.compile(rf"(?<![\w.])(\d+(?:\.\d+)?)(K?)(?:\s*({ARITH_UNIT})(?![\w/]))?")
EXPRESSION = re.compile(rf"(?<![\w.])[\d(](?:[\d.K\s()+\-−*/·×÷]|{ARITH_UNIT})*$")


def arithmetic(text: str, fig: Figure) -> str | None:
    """Where `fig` is the result of arithmetic written before it (`a op b = fig`): the left side's value in the
    figure's unit, rounded as the figure is ('' where the left side cannot be evaluated: words in it, a unit
    not in ARITH_UNITS); else None."""
    start = max([0] + [m.end() for m in SENTENCE_END.finditer(text, 0, fig.start)])
    before = text[start:fig.start]
    eq = re.search(r"[=≈]\s*[~≈]?\s*$", before)
    if not eq:
        return None
    lhs = text[clause_start(text, start, start + eq.start()):start + eq.start()]
    if not ARITHMETIC_LHS.search(lhs):
        return None
    # the numbers, units and operators that end the left side ("costs 1 − 649.1/791.3 "), from a number's start
    lhs = re.sub(r"\s*\(datasheet\)", " ", lhs)
    m = EXPRESSION.search(lhs)
    if not m or not re.search(r"\d\s*(?:[A-Za-zµ%/]+\s*)?[-−+*/·×÷]\s*[\d(]", m.group(0)):
        return ""
    operands = list(OPERAND.finditer(m.group(0).strip()))
    with_units = any(o.group(3) for o in operands)  # without any, the result's unit is the operands' (or % of 1)
    expr = OPERAND.sub(lambda o: f"({float(o.group(1)) * (1024 if o.group(2) else 1) * ARITH_UNITS.get(o.group(3), 1.0)!r})",
                       m.group(0).strip())
    expr = " ".join(expr.translate(str.maketrans({"·": "*", "×": "*", "÷": "/", "−": "-"})).split())  # one line
    if not re.fullmatch(r"[\d.e()+\-*/ ]+", expr):
        return ""
    try:
        value = eval(expr, {"__builtins__": {}})  # numbers and operators only (checked above)
    except (SyntaxError, ZeroDivisionError):
        return ""
    fraction = re.match(r"/(\d+)(?![\w.])", text[fig.end:])  # a result written as a fraction: = 2/3
    if fraction:
        return fig.num if math.isclose(value, fig.value / int(fraction.group(1)), rel_tol=1e-6) else f"{value:.4g}"
    unit = re.match(rf"\s*({ARITH_UNIT})(?![\w/])", text[fig.end:])
    if unit and (with_units or unit.group(1) == "%"):
        value /= ARITH_UNITS[unit.group(1)]
    return f"{value / (SCALE[fig.suffix] * 10.0 ** int(fig.exp or 0)):.{fig.decimals}f}"


# ---- checking a unit of text (a paragraph, a list item, a table row, a heading) ----

class Unit:
    """Lines [(number, text)]; `context`: the heading (and a table's header row) whose citations also count;
    `table_header`: the header row of the table the unit is a row of; `prediction`: all of it is a prediction."""

    def __init__(self, lines: list[tuple[int, str]], context: str = "", table_header: str | None = None,
                 prediction: bool = False):
        self.lines, self.context, self.table_header, self.prediction = lines, context, table_header, prediction

    @property
    def text(self) -> str:
        return "\n".join(t for _, t in self.lines)

    def line_of(self, offset: int) -> int:
        seen = 0
        for no, t in self.lines:
            seen += len(t) + 1
            if offset < seen:
                return no
        return self.lines[-1][0]


def resolve(text: str, root: Path, unread: list[str]) -> tuple[list[tuple[str, str | None, str]], list[str], bool]:
    """The results files a piece of text cites [(path, full commit or None, as cited)], what is wrong with its
    citations, and whether it cites a folder. A citation at a commit that cannot be read here goes to `unread`."""
    r = repo(root)
    files: list[tuple[str, str | None, str]] = []
    folders: list[tuple[str, str | None]] = []
    problems: list[str] = []
    for m in CITE.finditer(text):
        cite, rev = m.group(1), m.group(2)
        if not cite.endswith(("/", *RESULTS_SUFFIXES)):
            continue
        shown = f"{cite}@{rev}" if rev else cite
        try:
            commit = r.commit(rev) if rev else None
            hits = r.files(cite, commit)
        except Unreadable as e:
            unread.append(f"{shown}: {e}")
            continue
        except ValueError as e:
            problems.append(f"cites {shown}, but {e}")
            continue
        if cite.endswith("/") and (hits or commit is None and (root / cite).is_dir()):
            folders.append((cite, commit))
            continue
        if hits and not cite.endswith("/"):
            files += [(h, commit, f"{h}@{rev}" if rev else h) for h in hits]
            continue
        at = f" at {rev}" if rev else ""
        if "*" in cite:
            problems.append(f"cites {shown}, which matches no file{at}")
        else:
            problems.append(f"cites {shown}, which does not exist{at}" + ("" if rev else r.where_it_was(cite)))
    for name in BARE.findall(CITE.sub(" ", text)):
        for folder, commit in folders:
            rev = next((m.group(2) for m in CITE.finditer(text) if m.group(1) == folder and m.group(2)), None)
            files += [(h, commit, f"{h}@{rev}" if rev else h) for h in r.files(folder + name, commit)]
    return list(dict.fromkeys(files)), problems, bool(folders)


def numeric_cells(row: str) -> list[tuple[int, int]]:
    """(start, end) of the data cells of a table row that hold numbers only (not the first column)."""
    bounds = [m.start() for m in re.finditer(r"(?<!\\)\|", row)]
    cells = []
    for a, b in zip(bounds[1:], bounds[2:]):  # from the second column on
        cell = row[a + 1:b]
        rest = UNIT.sub(" ", NUMBER.sub(" ", cell))
        if NUMBER.search(cell) and re.fullmatch(r"[\s/–\-−~≈≥≤<>+,()×x%]*", rest):
            cells.append((a + 1, b))
    return cells


def check_unit(where: str, unit: Unit, root: Path, must_cite: bool = False, unread: list[str] | None = None) -> tuple[list[str], bool]:
    """Problems of one unit of text, and whether it cites (so was checked against files, or could not be)."""
    unread = [] if unread is None else unread
    text, first = unit.text, unit.lines[0][0]
    n_unread = len(unread)
    files, _, folder = resolve(unit.context + "\n" + text, root, unread)
    problems = [f"{where}:{first}: {p}" for p in resolve(text, root, [])[1]]  # the context's: reported where it stands
    cites = bool(CITE.search(unit.context + "\n" + text))
    masked = blank(blank(blank(blank(text, CODE), CITE), PATH), BARE)
    figs = figures_in(masked)
    if unit.table_header is not None and masked.lstrip().startswith("|"):
        for a, b in numeric_cells(masked):
            for f in figs:
                f.in_table = f.in_table or a <= f.start < b
    wrong_sums = [f"{where}:{unit.line_of(f.start)}: {f.text} is not what the arithmetic before it gives ({v})"
                  for f in figs if (v := arithmetic(masked, f)) and v != f.num]
    figs = [f for f in figs if not (unit.prediction or exempt(masked, f, unit.table_header or ""))]

    problems += wrong_sums

    def shown(f: Figure) -> str:
        return f.text + (f" {f.unit}" if f.unit not in ("", "x") else "")

    if not files:
        if len(unread) > n_unread or problems:  # history that cannot be read here; a citation already wrong
            return problems, cites
        if must_cite and not cites and NUMBER.search(masked):
            problems.append(f"{where}:{first}: a MEASURED paragraph with numbers cites no results file")
        elif folder:
            problems += [f"{where}:{unit.line_of(f.start)}: {shown(f)} cites only a folder: name the file it comes from"
                         for f in figs if f.measured or f.decimals]
        elif not cites:
            problems += [f"{where}:{unit.line_of(f.start)}: {shown(f)} is a measured figure, and its paragraph cites no "
                         "results file" for f in figs if f.measured]
        return problems, cites
    sources = [source(root, path, commit, shown_as) for path, commit, shown_as in files]
    checked = [f for f in figs if f.measured or f.decimals]
    sourced = [f for f in checked if any(s.has(f) for s in sources)]
    derived = derived_figures([f for f in sourced if f.unit not in ("x", "%")])
    names = ", ".join(s.name for s in sources)
    for f in checked:
        if f not in sourced and not (f.unit in ("x", "%", "") and matches(f, derived["%" if f.unit == "%" else "x"])):
            problems.append(f"{where}:{unit.line_of(f.start)}: {f.text} has no source in {names}")
    return problems, True


def derived_figures(figs: list[Figure]) -> dict[str, list[tuple[float, float]]]:
    """Ratios and percentages of two sourced figures of one paragraph in one unit (or without one), as (value,
    place 0) numbers for matches(): a/b as a ratio, |a/b - 1| and a/b as percentages."""
    ratios = [a.value / b.value for a in figs for b in figs
              if a is not b and b.value > 0 and (a.unit == b.unit or "" in (a.unit, b.unit))]
    return {"x": [(r, 0.0) for r in ratios], "%": [(abs(r - 1) * 100, 0.0) for r in ratios] + [(r * 100, 0.0) for r in ratios]}


def check_header(where: str, text: str, root: Path = ROOT, unread: list[str] | None = None) -> tuple[list[str], int]:
    """Problems of a kernel.cu's paragraphs (all of the leading comment block, the citing ones below it), and how
    many paragraphs cite."""
    problems, checked, para, heading = [], 0, [], ""
    in_header = True

    def flush():
        nonlocal checked
        if para:
            measured = heading.split(" ")[0] == "MEASURED"
            cites = CITE.search("\n".join(t for _, t in para))
            prediction = heading.split(" ")[0] in ("PREDICTION", "PREDICTED", "PREDICTIONS") and not cites
            if in_header or measured or cites:
                p, cites = check_unit(where, Unit(para[:], prediction=prediction), root, must_cite=measured, unread=unread)
                problems.extend(p)
                checked += cites
        para.clear()

    for no, line in enumerate(text.splitlines(), 1):
        comment = line.startswith("//")
        m = HEADING.match(line)
        if m or not comment or not line[2:].strip():
            flush()
            heading = m.group(1) if m else ""
        if not comment:
            in_header = False
        elif line[2:].strip():
            para.append((no, line[2:]))
    flush()
    return problems, checked


GENERATED = re.compile(r"<!-- (\w+):begin \(generated.*?<!-- \1:end -->", re.S)


def check_notes(where: str, text: str, root: Path = ROOT, unread: list[str] | None = None) -> tuple[list[str], int]:
    """Problems of a Markdown file's paragraphs, list items, table rows and headings, and how many of them cite. A
    section between a generator's markers (`<!-- name:begin (generated ... -->` ... `<!-- name:end -->`) is left out:
    test_readme.py checks that it is what its generator makes of the run it names."""
    text = GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # blank lines keep the line numbers
    problems, checked, unit, heading = [], 0, [], ""
    lines = text.splitlines()
    table_header = None  # the header row of the table being read: it names the columns and holds no figure
    in_fence = False

    def flush():
        nonlocal checked
        if unit:
            context = heading + ("\n" + table_header if table_header else "")
            p, cites = check_unit(where, Unit(unit[:], context, table_header), root, unread=unread)
            problems.extend(p)
            checked += cites
        unit.clear()

    for i, line in enumerate(lines):
        if line.startswith("```"):  # a code block: commands and their output, no figures
            flush()
            in_fence = not in_fence
            continue
        row = line.lstrip().startswith("|")
        if in_fence or (row and TABLE_RULE.match(line)):
            continue
        starts_unit = re.match(r"\s*(?:[-*]|\d+\.)\s", line) or row
        if line.startswith("#") or not line.strip() or starts_unit or (unit and unit[-1][1].lstrip().startswith("|")):
            flush()
        if not row:
            table_header = None
        if line.startswith("#"):
            heading = line
            unit.append((i + 1, line))
            flush()
        elif row and i + 1 < len(lines) and TABLE_RULE.match(lines[i + 1]):
            table_header = line
        elif line.strip():
            unit.append((i + 1, line))
    flush()
    return problems, checked


KERNELS = sorted(ROOT.glob("steps/step[0-9][0-9]/kernel.cu"))
MARKDOWN = sorted(ROOT.glob("docs/*.md"))


def check_file(path: Path, unread: list[str]) -> tuple[list[str], int]:
    check = check_header if path.suffix == ".cu" else check_notes
    return check(str(path.relative_to(ROOT)), path.read_text(), ROOT, unread)


# ids without the step's name: `python -m verify` runs the tests whose id names a step with that step's
# kernel checks, and a header's wording is no reason to leave a kernel out of the benchmark.
@pytest.mark.parametrize("path", [*KERNELS, *MARKDOWN], ids=lambda p: p.name if p.suffix == ".md" else f"header{p.parent.name[4:]}")
def test_every_figure_has_a_source(path):
    unread: list[str] = []
    problems, _ = check_file(path, unread)
    assert not problems, "figures without a source in the results files they cite (see verify/tests/test_figures.py's " \
        "docstring for what a figure is and where it may come from):\n  " + "\n  ".join(problems)
    if unread:
        pytest.skip("cites files of the git history, which cannot be read here: " + "; ".join(dict.fromkeys(unread)))


def test_the_checker_sees_the_figures():
    """Guard against a checker that passes because it finds nothing: the committed notes cite results."""
    counts = [check_file(p, [])[1] for p in [*KERNELS, ROOT / "docs" / "design.md"]]
    assert sum(counts) > 0 and counts[-1] > 0, counts


def test_the_history_the_notes_cite_is_readable():
    """docs/design.md cites files that left the tree as PATH@COMMIT; CI runs on a full clone, where `git show` reads them."""
    r = repo(ROOT)
    if r.history:
        pytest.skip(f"no git history here ({r.history}): the citations of files at past commits cannot be read")
    cites = [(m.group(1), m.group(2)) for m in CITE.finditer((ROOT / "docs" / "design.md").read_text()) if m.group(2)]
    assert cites, "docs/design.md cites no file of the git history (PATH@COMMIT)"
    path, rev = next((p, c) for p, c in cites if p.endswith(RESULTS_SUFFIXES))
    try:
        text = r.read(path, r.commit(rev))
    except Unreadable as e:
        pytest.skip(str(e))
    assert text.strip(), f"git show {rev}:{path} is empty"


# The checker on made-up text, with figures computed from the newest committed results file.

def newest_run() -> tuple[str, dict]:
    runs = sorted(p for p in ROOT.glob("results/*/[0-9]*.json") if "timings" in json.loads(p.read_text()))  # a forward run
    assert runs, "no results JSON committed under results/"
    return str(runs[-1].relative_to(ROOT)), json.loads(runs[-1].read_text())


def two_cells(run: dict):
    """Two implementations measured at the same N: (impl a, impl b, N, tflops a, tflops b)."""
    timings = {k: v for k, v in run["timings"].items() if k != "cublas_gemm"}
    for n in run["seqlens"]:
        have = [impl for impl, by_n in timings.items() if str(n) in by_n]
        if len(have) >= 2:
            a, b = have[:2]
            return a, b, n, timings[a][str(n)]["tflops"], timings[b][str(n)]["tflops"]
    raise AssertionError("the newest run has no two implementations at one N")


def unsourced(cite: str, near: float, decimals: int = 1) -> str:
    """The figure nearest above `near` (to `decimals`) that the results file cannot back, with or without a unit."""
    src = source(ROOT, cite, None)
    step = 10.0 ** -decimals
    backed = lambda s: src.has(make_figure(s, "TFLOP/s")) or src.has(make_figure(s))
    return next(f for f in (f"{near + i * step:.{decimals}f}" for i in range(1, 1000)) if not backed(f))


def make_figure(text: str, unit: str = "") -> Figure:
    return Figure(NUMBER.fullmatch(text), unit, 0)


def header(cite: str, *figures: str, after: str = "//\n") -> str:
    """A kernel.cu header whose MEASURED paragraph (lines 2-3) holds `figures`, then `after`."""
    return ("// PREDICTION: 1.5x, a prediction is not a measurement.\n"
            f"// MEASURED ({cite}, N = 4K):\n//   " + " -> ".join(figures) + " TFLOP/s.\n" + after + "#include <x>\n")


def test_a_correct_header_passes():
    cite, run = newest_run()
    a, b, n, ta, tb = two_cells(run)
    problems, checked = check_header("fake.cu", header(cite, f"{ta:.1f}", f"{tb:.1f}", f"({fmt_ratio(ta / tb)}x)"))
    assert checked == 1 and not problems, problems


def test_one_wrong_figure_is_named():
    cite, run = newest_run()
    _, _, _, ta, tb = two_cells(run)
    wrong = unsourced(cite, ta)
    problems, _ = check_header("fake.cu", header(cite, wrong, f"{tb:.1f}"))
    assert problems == [f"fake.cu:3: {wrong} has no source in {cite}"], problems


@pytest.mark.parametrize("end", ["//\n", "// LEFT ALONE: the next heading.\n", "#include <y>\n"])
def test_where_a_measured_paragraph_ends(end):
    """A blank comment line, an ALL-CAPS heading or code ends the paragraph: a decimal after it is not checked
    against the paragraph's file (and is, with no end in between)."""
    cite, run = newest_run()
    _, _, _, ta, _ = two_cells(run)
    wrong = unsourced(cite, ta)
    line = f"//   {wrong}, not from the file.\n"
    assert check_header("fake.cu", header(cite, f"{ta:.1f}", after=end + line)) == ([], 1)
    assert check_header("fake.cu", header(cite, f"{ta:.1f}", after=line)) == ([f"fake.cu:4: {wrong} has no source in {cite}"], 1)


def test_too_many_decimals_is_not_a_source():
    """The TFLOP/s rule is 0 or 1 decimal: the same value written with 2 has no source."""
    cite, run = newest_run()
    _, _, _, ta, _ = two_cells(run)
    problems, _ = check_header("fake.cu", header(cite, f"{ta:.2f}"))
    assert len(problems) == 1 and f"{ta:.2f} has no source" in problems[0], problems


def test_integers_and_ranges_with_units_are_checked():
    """A whole TFLOP/s figure, a range of them and a whole percentage are figures too; 132 CTAs is not."""
    cite, run = newest_run()
    _, _, _, ta, tb = two_cells(run)
    good = f"{ta:.0f}-{tb:.0f} TFLOP/s on 132 CTAs, {abs(ta / tb - 1) * 100:.0f}% apart"
    assert check_notes("NOTES.md", f"- ({cite}) {good}.\n") == ([], 1)
    wrong = unsourced(cite, ta, decimals=0)
    problems, _ = check_notes("NOTES.md", f"- ({cite}) {ta:.0f}-{wrong} TFLOP/s on 132 CTAs.\n")
    assert problems == [f"NOTES.md:1: {wrong} has no source in {cite}"], problems


def test_the_702_790_range_of_the_old_notes_fails():
    """The figure that started this rule: a cuBLAS range no run of record of its day holds (they say 678.6 and 685.4).
    Checked against one of those runs: a newer run may well hold a 702 somewhere (a burst rate)."""
    cite = "results/h200/2026-12-01T09-46-07Z.json"
    assert (ROOT / cite).is_file()
    old = f"- ({cite}) the bf16 rate of a cuBLAS 8192³ GEMM (702–790 TFLOP/s across the runs here).\n"
    problems, _ = check_notes("NOTES.md", old)
    assert problems == [f"NOTES.md:1: 702 has no source in {cite}", f"NOTES.md:1: 790 has no source in {cite}"], problems
    assert check_notes("NOTES.md", old.replace(f"({cite}) ", ""))[0] == [
        "NOTES.md:1: 702 TFLOP/s is a measured figure, and its paragraph cites no results file",
        "NOTES.md:1: 790 TFLOP/s is a measured figure, and its paragraph cites no results file"]


@pytest.mark.parametrize("text, measured", [
    ("step14 ran at 660 TFLOP/s.", ["660 TFLOP/s"]),
    ("SM clock 1650–1980 MHz, 690 W, 34 %, 1.08x cuDNN, 0.20 ms.", ["1650 MHz", "1980 MHz", "690 W", "34 %", "1.08x", "0.20 ms"]),
    ("| step14 | 611 | 649 / 660 |", ["611", "649", "660"]),
    ("The 132 CTAs of 128 threads, N = 4K, 1 x 2 x 5 x 300 at x10, 64 MUFU.EX2 per thread, 8192³.", []),
    ("predicted +5-10 %, got nothing; the target is 1.10x cuDNN.", []),
    ("PREDICTION: +2-5% at N = 1K-2K, +1-2% at 16K.", []),
    ("0.14 TFLOP / 678.6 TFLOP/s = 0.21 ms.", ["678.6 TFLOP/s"]),
    ("268 MB at 4.8 TB/s (datasheet).", []),
    ("`--settle-max 1.0` and `702 TFLOP/s` are code.", []),
], ids=["tflops", "units", "table", "counts", "predicted", "prediction_heading", "arithmetic", "datasheet", "code"])
def test_what_is_a_measured_figure(text, measured):
    """Without a citation, exactly the measured figures fail (the rule in the module's docstring)."""
    problems, _ = check_notes("NOTES.md", ("| a | b | c |\n|---|---|---|\n" if text.startswith("|") else "") + text + "\n")
    named = [re.match(r"NOTES.md:\d+: (.*?) is a measured figure", p).group(1) for p in problems]
    assert named == measured, problems


def test_a_measured_paragraph_must_cite_a_file():
    cite, run = newest_run()
    _, _, _, ta, _ = two_cells(run)
    problems, _ = check_header("fake.cu", header("H200", f"{ta:.1f}"))
    assert problems == ["fake.cu:2: a MEASURED paragraph with numbers cites no results file"], problems
    assert check_header("fake.cu", "// MEASURED: pending the next H200 run.\n")[0] == []  # no number, no claim


def test_a_header_figure_that_cites_nothing_fails():
    """Anywhere in the leading comment block, not only under MEASURED; below it only citing paragraphs count."""
    text = "// flashladder stepNN -- x.\n//\n// WHAT CHANGED: the tensor pipe was busy 79% of the time.\n//\n#include <x>\n"
    assert check_header("fake.cu", text)[0] == ["fake.cu:3: 79 % is a measured figure, and its paragraph cites no results file"]
    assert check_header("fake.cu", text.replace("#include <x>\n", "") + "#include <x>\n// later: 79% busy.\n")[0] == [
        "fake.cu:3: 79 % is a measured figure, and its paragraph cites no results file"]


def test_a_missing_results_file_fails():
    cite, _ = newest_run()
    missing = cite.replace(".json", "-missing.json")
    problems, _ = check_header("fake.cu", header(missing, "1.0"))
    assert problems == [f"fake.cu:2: cites {missing}, which does not exist"], problems


def test_notes_figures_from_a_log(tmp_path):
    """NOTES.md style: a list item citing a .txt; a scaled figure (M) and a plain one; one wrong."""
    count, small, reps = 134_742_016, 0.57, 100
    log = tmp_path / "results" / "gpu" / "run.txt"
    log.parent.mkdir(parents=True)
    log.write_text(f"wavefronts {count:,}\neligible {small}\n{reps} reps\n")
    good, bad = f"{count / 1e6:.1f}M", f"{count / 1e6 + 0.1:.1f}M"
    notes = f"# Notes\n\n- ncu (results/gpu/run.txt): {good} wavefronts, {small} eligible.\n- again: {bad}\n"
    assert check_notes("NOTES.md", notes, tmp_path) == ([], 1)  # the second item cites nothing: not checked (no unit)
    notes = notes.replace("- again:", "- again (results/gpu/run.txt):")
    assert check_notes("NOTES.md", notes, tmp_path) == ([f"NOTES.md:4: {bad} has no source in results/gpu/run.txt"], 2)
    too_precise = f"{reps:.1f}"  # more digits than the file recorded
    notes = notes.replace(bad, too_precise)
    assert check_notes("NOTES.md", notes, tmp_path) == ([f"NOTES.md:4: {too_precise} has no source in results/gpu/run.txt"], 2)


def test_ratios_and_percentages_of_a_paragraph_s_own_figures(tmp_path):
    """584.6 against 515.1 in one paragraph back 1.13x and 13 %, not 15 %."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.log").write_text("a 584.6 TF\nb 515.1 TF\n")
    notes = "- (results/r.log) a 584.6 against b 515.1 TFLOP/s: 1.13x, 13 % ahead, not {} %.\n"
    assert check_notes("NOTES.md", notes.format(13), tmp_path) == ([], 1)
    assert check_notes("NOTES.md", notes.format(15), tmp_path) == (["NOTES.md:1: 15 has no source in results/r.log"], 1)


def test_notes_heading_and_folder_citations(tmp_path):
    """A heading's citation covers its section; a bare file name resolves in a cited folder."""
    run = {"timings": {"x": {"1024": {"tflops": 2.0}}, "y": {"1024": {"tflops": 3.0}}}}
    (tmp_path / "results" / "gpu").mkdir(parents=True)
    (tmp_path / "results" / "gpu" / "run.json").write_text(json.dumps(run))
    ratio = fmt_ratio(3.0 / 2.0)
    notes = f"## Section (results/gpu/)\n\ny is {ratio}x x, not 8.8 (run.json).\n\n## Other (results/gpu/run.json)\n\n{ratio}x, 9.9\n"
    assert check_notes("NOTES.md", notes, tmp_path) == (["NOTES.md:3: 8.8 has no source in results/gpu/run.json",
                                                         "NOTES.md:7: 9.9 has no source in results/gpu/run.json"], 4)


def test_a_backward_run_backs_ratios_of_its_own_timings(tmp_path):
    """A backward results file ({"backward": {"timings": ...}}) backs a ratio of two of its cells at one N, as a forward
    run does; not one it does not hold."""
    run = {"backward": {"timings": {"a_bwd": {"4096": {"tflops": 150.0}}, "b_bwd": {"4096": {"tflops": 110.7}}}}}
    (tmp_path / "results" / "gpu").mkdir(parents=True)
    (tmp_path / "results" / "gpu" / "backward.json").write_text(json.dumps(run))
    notes = "- (results/gpu/backward.json) a 150.0 TFLOP/s, {}x b.\n"
    assert check_notes("NOTES.md", notes.format("1.36"), tmp_path) == ([], 1)
    assert check_notes("NOTES.md", notes.format("1.41"), tmp_path) == (
        ["NOTES.md:1: 1.41x has no source in results/gpu/backward.json"], 1)


def test_table_cells_are_figures(tmp_path):
    """Every number of a data cell counts, whole or not; the first column and the header row are labels."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "v.log").write_text("m64 333 324\nn128 310 321\n")
    table = "| variant (results/v.log) | N=4K | N=16K |\n|---|---:|---:|\n| m64w4 | 333 | {} |\n| n128, 20 B spills | 310 | 321 |\n"
    assert check_notes("NOTES.md", table.format(324), tmp_path)[0] == []
    assert check_notes("NOTES.md", "## (results/v.log)\n\n" + table.format(325), tmp_path)[0] == [
        "NOTES.md:5: 325 has no source in results/v.log"]


def git(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false",
                          *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_file_of_the_history_is_cited_at_its_commit(tmp_path):
    """results/x.log@<commit>: read with git show, after the file left the tree; the wrong commit or path fails."""
    git(tmp_path, "init", "-q")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "x.log").write_text("step14 662.3 TF 1710 MHz\n")
    git(tmp_path, "add", "results/x.log")
    git(tmp_path, "commit", "-q", "-m", "a log")
    held = git(tmp_path, "rev-parse", "--short", "HEAD")
    git(tmp_path, "rm", "-q", "results/x.log")
    git(tmp_path, "commit", "-q", "-m", "the log leaves the tree")
    notes = f"- (results/x.log@{held}) step14 662.3 TFLOP/s at 1710 MHz.\n"
    assert check_notes("NOTES.md", notes, tmp_path) == ([], 1)
    assert check_notes("NOTES.md", notes.replace("662.3", "662.4"), tmp_path)[0] == [
        f"NOTES.md:1: 662.4 has no source in results/x.log@{held}"]
    problems, _ = check_notes("NOTES.md", notes.replace(f"@{held}", ""), tmp_path)
    assert len(problems) == 1 and "cites results/x.log, which does not exist (it left the tree in" in problems[0], problems
    head = git(tmp_path, "rev-parse", "--short", "HEAD")
    assert check_notes("NOTES.md", notes.replace(held, head), tmp_path)[0] == [
        f"NOTES.md:1: cites results/x.log@{head}, which does not exist at {head}"]
    assert check_notes("NOTES.md", notes.replace(held, "0badc0ffee"), tmp_path)[0] == [
        "NOTES.md:1: cites results/x.log@0badc0ffee, but 0badc0ffee is not a commit of this repository"]


def test_without_history_a_history_citation_is_unread(tmp_path):
    """A copy without .git (the GPU machine's working tree): the figure cannot be checked, and the test skips."""
    (tmp_path / "results").mkdir()
    unread: list[str] = []
    assert check_notes("NOTES.md", "- (results/x.log@3c57885) 662.3 TFLOP/s.\n", tmp_path, unread) == ([], 1)
    assert unread and "not the top of a git repository" in unread[0], unread


@pytest.mark.parametrize("text, problem", [
    ("1 − 649.1/791.3 = 18 % of the time.", None),
    ("1 − 649.1/791.3 = 25 % of the time.", "25 is not what the arithmetic before it gives (18)"),
    ("4 × 16K × 16 × 128 × 2 B = 268 MB.", None),
    ("4 × 16K × 16 × 128 × 2 B = 270 MB.", "270 is not what the arithmetic before it gives (268)"),
    ("268 MB / 4.8 TB/s (datasheet) = 0.056 ms.", None),
    ("(1/8) / (1/8 + 1/16) = 2/3 of its rate.", None),
    ("(1/8) / (1/8 + 1/32) = 2/3 of its rate.", "2 is not what the arithmetic before it gives (0.8)"),
], ids=["percent", "percent_wrong", "bytes", "bytes_wrong", "units", "fraction", "fraction_wrong"])
def test_arithmetic_written_out_is_checked(text, problem):
    """The result of numbers and operators (units in SI, K = 1024) must be their value, as rounded."""
    problems, _ = check_notes("NOTES.md", text + "\n")
    assert problems == ([f"NOTES.md:1: {problem}"] if problem else []), problems


def test_a_prediction_paragraph_without_citation_is_all_prediction():
    text = ("// PREDICTION: little. The copies were never the bottleneck (compute-bound ~45x at N = 16K),\n"
            "//   so +0-3%.\n//\n#include <x>\n")
    assert check_header("fake.cu", text)[0] == []
    assert check_header("fake.cu", text.replace("PREDICTION", "WHY"))[0] == [
        "fake.cu:1: 45x is a measured figure, and its paragraph cites no results file",
        "fake.cu:2: +0 % is a measured figure, and its paragraph cites no results file",
        "fake.cu:2: 3 % is a measured figure, and its paragraph cites no results file"]


def test_a_folder_alone_backs_no_figure(tmp_path):
    (tmp_path / "results" / "gpu").mkdir(parents=True)
    (tmp_path / "results" / "gpu" / "a.log").write_text("662.3\n")
    assert check_notes("NOTES.md", "- (results/gpu/) 662.3 TFLOP/s.\n", tmp_path)[0] == [
        "NOTES.md:1: 662.3 TFLOP/s cites only a folder: name the file it comes from"]
    assert check_notes("NOTES.md", "- (results/gpu/, a.log) 662.3 TFLOP/s.\n", tmp_path)[0] == []


# ---- the pictures: docs/img/*.png, drawn by docs/pictures.py from the kernels' own constants ----

IMG = ROOT / "docs" / "img"
PICTURE_LIMIT_BYTES = 150 * 1024  # the whole repository travels to the GPU machine: keep each picture small


@functools.lru_cache(maxsize=None)
def pictures():
    """docs/pictures.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("flashladder_pictures", ROOT / "docs" / "pictures.py")
    module = importlib.util.module_from_spec(spec)
    import sys
    sys.modules[spec.name] = module  # inspect.getsource finds the module's functions through it
    spec.loader.exec_module(module)
    return module


PNGS = sorted(IMG.glob("*.png"))


def test_every_picture_is_drawn_by_pictures_py():
    """docs/img holds exactly the pictures docs/pictures.py draws, each recording that it was drawn by it."""
    drawn = set(pictures().PICTURES)
    present = {p.name for p in PNGS}
    assert present == drawn, (f"in docs/img but drawn by no function of docs/pictures.py: {sorted(present - drawn)}; "
                              f"drawn but missing (python docs/pictures.py): {sorted(drawn - present)}")
    for png in PNGS:
        meta = pictures().drawn_from(png)
        assert meta and meta["picture"] == png.name and meta["generator"] == "docs/pictures.py", png.name
    assert len(PNGS) >= 25, f"only {len(PNGS)} pictures in docs/img"


@pytest.mark.parametrize("png", PNGS, ids=lambda p: p.stem)
def test_every_picture_is_up_to_date(png):
    """The constants it was drawn from still have those values in the code, and its drawing code is unchanged."""
    problems = pictures().stale(png)
    assert not problems, "\n".join(problems)


def test_every_picture_is_shown_by_a_page():
    """Referenced (as img/NAME.png) from a docs page, the README or a step's kernel.cu: a picture nobody shows is dead."""
    pages = [*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("steps/step[0-9][0-9]/kernel.cu"),
             *ROOT.glob("steps/step[0-9][0-9]/README.md")]
    text = "\n".join(p.read_text() for p in pages if p.is_file())
    unshown = [p.name for p in PNGS if not re.search(rf"(?<![\w-])img/{re.escape(p.name)}", text)]
    assert not unshown, f"pictures no page shows: {unshown}"


def timeline_key(png: Path) -> str:
    """How a page names a timeline: timeline/step10.png, timeline/causal/step15.png."""
    parts = png.relative_to(ROOT).parts
    return "/".join(parts[parts.index("timeline"):])


def test_every_measured_timeline_is_shown_by_a_page():
    """The timelines `python -m verify.trace` draws (results/<gpu>/timeline/...) are pictures too: each one committed is
    shown by a docs page or a step header (as .../timeline/stepNN.png)."""
    pages = [*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("steps/step[0-9][0-9]/kernel.cu")]
    text = "\n".join(p.read_text() for p in pages if p.is_file())
    timelines = sorted(ROOT.glob("results/*/timeline/**/*.png"))
    unshown = [str(p.relative_to(ROOT)) for p in timelines if timeline_key(p) not in text]
    assert timelines and not unshown, f"measured timelines no page shows: {unshown}"


@pytest.mark.parametrize("png", PNGS, ids=lambda p: p.stem)
def test_pictures_are_small(png):
    assert png.stat().st_size < PICTURE_LIMIT_BYTES, f"{png.name}: {png.stat().st_size // 1024} KB (lower the dpi or simplify)"


def tree_with(tmp_path: Path, path: str, name: str, old: str, new: str) -> Path:
    """A copy of the sources the pictures read (steps/*/kernel.cu, common/*.cuh) with one constant's value changed."""
    for src in [*ROOT.glob("steps/step[0-9][0-9]/kernel.cu"), *ROOT.glob("common/*.cuh")]:
        dst = tmp_path / src.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(src.read_text())
    target = tmp_path / path
    text, n = re.subn(rf"\b{name}(\s*=\s*){re.escape(old)}(?![\w.])", rf"{name}\g<1>{new}", target.read_text())
    assert n >= 1, f"no `{name} = {old}` in {path}"
    target.write_text(text)
    return tmp_path


def final_step() -> str:
    return sorted(p.name for p in ROOT.glob("steps/step[0-9][0-9]"))[-1]


@pytest.mark.parametrize("picture, path, name, new", [
    ("tma_ring.png", "steps/step08/kernel.cu", "STAGES", "3"),
    ("conditional_rescale.png", "steps/step12/kernel.cu", "RESCALE_THRESHOLD", "6.f"),
    ("causal_mask.png", "final", "BLOCK_N", "176"),
    ("tma_swizzle.png", "common/swizzle.cuh", "TMA_HALF_COLS", "32"),
], ids=["ring-slots", "rescale-threshold", "final-tile", "common-header"])
def test_a_picture_whose_constant_changed_is_stale(tmp_path, picture, path, name, new):
    """The check fails on a stale picture: the same PNG against a tree where one constant it was drawn from changed."""
    path = f"steps/{final_step()}/kernel.cu" if path == "final" else path
    png = IMG / picture
    assert pictures().stale(png) == [], "the committed picture must be up to date for this test to mean anything"
    read = next(r for r in pictures().drawn_from(png)["reads"] if r["name"] == name)
    old = re.search(rf"\b{name}\s*=\s*([\w.]+)", pictures().Code(ROOT).source(path)).group(1)  # in the code
    problems = pictures().stale(png, tree_with(tmp_path, path, name, old, new))
    now = type(read["value"])(float(new.rstrip("f")))
    assert any(f"drawn with {name} = {read['value']} from" in p and f"which now says {now}" in p for p in problems), problems


def test_a_picture_whose_drawing_changed_is_stale(tmp_path):
    """The same constants, another hash of the drawing code (as after an edit of its function or a helper)."""
    pil = pictures()  # Pillow, as docs/pictures.py imports it (a dependency of matplotlib)
    png = IMG / "tiling.png"
    meta = pil.drawn_from(png)
    info = pil.PngImagePlugin.PngInfo()
    info.add_text(pil.META_KEY, json.dumps(meta | {"code": "0" * 16}))
    pil.Image.open(png).save(tmp_path / png.name, pnginfo=info)
    problems = pictures().stale(tmp_path / png.name)
    assert len(problems) == 1 and "the code that draws it" in problems[0], problems


def test_a_png_not_drawn_by_pictures_py_is_named(tmp_path):
    pictures().Image.new("RGB", (4, 4)).save(tmp_path / "hand_drawn.png")
    assert pictures().stale(tmp_path / "hand_drawn.png") == [
        "docs/img/hand_drawn.png: not drawn by docs/pictures.py (no flashladder-picture record in the PNG)"]


def test_a_picture_drawn_again_records_the_same(tmp_path):
    """Drawing runs here (matplotlib, no GPU) and records what the committed PNG records."""
    for name in ("tiling.png", "causal_balance.png"):
        out = pictures().draw(name, out=tmp_path)
        assert pictures().drawn_from(out) == pictures().drawn_from(IMG / name), name


@pytest.mark.parametrize("source, name, kw, value", [
    ("constexpr int STAGES = 2;  // slots", "STAGES", {}, 2),
    ("constexpr float RESCALE_THRESHOLD = 8.f;", "RESCALE_THRESHOLD", {"cast": float}, 8.0),
    ("constexpr int A = 64, B = 2;\nconstexpr int C = A / B * 3;", "C", {}, 96),
    ("static constexpr int CLUSTER = PAIRED ? 2 : 1;", "CLUSTER", {}, 2),
    ("static constexpr int CLUSTER = PAIRED ? 2 : 1;", "CLUSTER", {"branch": 1}, 1),
    ("enum NamedBarrier : int { TURN0 = 1, TURN1 = 2 };", "TURN1", {}, 2),
    ("// STAGES = 3 in a comment\nconstexpr int STAGES = 2;", "STAGES", {}, 2),
], ids=["int", "float", "expression", "conditional", "conditional-else", "enum", "not-a-comment"])
def test_how_constants_are_read(tmp_path, source, name, kw, value):
    (tmp_path / "common").mkdir()
    (tmp_path / "x.cu").write_text(source + "\n")
    assert pictures().Code(tmp_path).read("x.cu", name, **kw) == value
