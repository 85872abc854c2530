"""CPU: every figure in a step header or in NOTES.md comes from the committed results file it cites.

What is checked:
  * in a step's kernel.cu, a paragraph that opens `// MEASURED (results/<gpu>/<stamp>.json, ...)` (any
    heading whose first word is MEASURED), or any other heading that cites a results file
    (`// BEFORE THE SPLIT (results/....json, ...)`); it runs to the next blank comment line, the next
    ALL-CAPS heading or the end of the comment;
  * in NOTES.md, a paragraph, list item or table row that cites a results file (`results/....json`, `.log`,
    `.txt`; a glob such as `variants*.log` stands for the files it matches), or that sits under a heading
    citing one; a bare file name in it counts when a folder cited there holds that file.
Every number with a decimal point in it must come from one of the files it cites:
  * a results JSON: a TFLOP/s figure of any implementation (the cuBLAS GEMM's too) at any N, to 1 decimal;
    a ratio of two of them at the same N (or of one to the GEMM), to 2 decimals (2 significant digits below
    0.1, as the README table writes them); the clocks and power it records, or a number it records outside
    its timings (versions, settings), rounded to the figure's own number of decimals (times in ms are left
    out on purpose: hundreds of them, rounded to 1 decimal, would back almost any small figure);
  * a .log or .txt: a number in the file, rounded to the figure's own number of decimals, a K/M/G suffix or
    an exponent scaling it (134.7M for 134,742,016; 1.8e-3 for 1.78e-03).
Rounding only drops digits: a figure is never more precise than the number it comes from (4.0 does not
come from a recorded 4).
A MEASURED paragraph that states a number but cites no results file fails, and so does a citation of a file
that does not exist.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A path under the repository's results/, whole ('rev:results/...', as in `git show`, is history, not a file
# here). A results file ends in .json, .log or .txt; a folder in '/'; other paths (a .png, a .cu) are no source.
CITE = re.compile(r"(?<![\w:/.-])results/[\w./*-]*[\w*/](?=[\s`),.;:'\"\]]|$)")
RESULTS_SUFFIXES = (".json", ".log", ".txt")
BARE = re.compile(r"(?<![\w/.*-])[\w*-][\w.*-]*\.(?:json|log|txt)\b")
FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+)(?!\.?\d)(?:e([-+]?\d+))?([KMGT](?![A-Za-z]))?")
ANY_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")
HEADING = re.compile(r"// ([A-Z][A-Z0-9]+(?: [A-Z0-9]+)*)(?=[ :(]|$)")
CLOCK_OR_POWER = re.compile(r"mhz|clock|power|watt", re.I)  # the fields of a timing cell that are not times
SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
NUMBER_IN_TEXT = re.compile(r"(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?:[eE]([-+]?\d+))?")


def fmt_ratio(r: float) -> str:
    return f"{r:.2f}" if r >= 0.1 else f"{r:.2g}"


class Source:
    """What one results file lets a figure say."""

    def __init__(self, path: Path):
        self.path = path
        self.tflops: set[str] = set()
        self.ratios: set[str] = set()
        self.numbers: list[tuple[float, float]] = []  # (value, the last digit's place: 0.01 for 1.23)
        if path.suffix == ".json":
            self._read_run(json.loads(path.read_text()))
        else:
            self.numbers = numbers_in(path.read_text(errors="replace"))

    def _read_run(self, run: dict) -> None:
        # {field: {(impl, N): value}} for every TFLOP/s field ("tflops", "burst_tflops", ...)
        fields: dict[str, dict] = {}
        for impl, by_n in run.get("timings", {}).items():
            for n, cell in by_n.items():
                for key, value in cell.items():
                    if "tflops" in key and isinstance(value, (int, float)):
                        fields.setdefault(key, {})[impl, n] = value
        for values in fields.values():
            self.tflops |= {f"{v:.1f}" for v in values.values()}
            for (a, n), va in values.items():
                for (b, m), vb in values.items():
                    if a != b and (n == m or "cublas_gemm" in (a, b)) and va > 0 and vb > 0:
                        self.ratios.add(fmt_ratio(va / vb))
        cells = [cell for by_n in run.get("timings", {}).values() for cell in by_n.values()]
        self.numbers = numbers_of({k: v for k, v in run.items() if k != "timings"})
        self.numbers += numbers_of([{k: v for k, v in c.items() if CLOCK_OR_POWER.search(k)} for c in cells])

    def has(self, mantissa: str, exponent: str | None, suffix: str) -> bool:
        if not exponent and not suffix and (mantissa in self.tflops or mantissa in self.ratios):
            return True
        scale = SCALE[suffix] * 10.0 ** int(exponent or 0)
        decimals = len(mantissa.split(".")[1])
        place = scale * 10.0 ** -decimals * (1 + 1e-9)
        return any(f"{v / scale:.{decimals}f}" == mantissa and p <= place for v, p in self.numbers)


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
    """Every number in a piece of a results JSON, in its values and in its strings ("1980 MHz")."""
    if isinstance(node, dict):
        return [x for v in node.values() for x in numbers_of(v)]
    if isinstance(node, list):
        return [x for v in node for x in numbers_of(v)]
    if isinstance(node, bool) or node is None:
        return []
    if isinstance(node, (int, float)):
        return numbers_in(repr(node))
    return numbers_in(str(node))


@lru_cache(maxsize=None)
def source(path: Path) -> Source:
    return Source(path)


def resolve(text: str, root: Path) -> tuple[list[Path], list[str]]:
    """The results files a piece of text cites, and what is wrong with its citations."""
    files, folders, problems = [], [], []
    for cite in CITE.findall(text):
        if not cite.endswith(("/", *RESULTS_SUFFIXES)):
            continue
        if "*" in cite:
            hits = sorted(p for p in root.glob(cite) if p.is_file())
            files += hits
            if not hits:
                problems.append(f"cites {cite}, which matches no file")
        elif (root / cite).is_dir() if cite.endswith("/") else (root / cite).is_file():
            (folders if cite.endswith("/") else files).append(root / cite)
        else:
            problems.append(f"cites {cite}, which does not exist")
    for name in BARE.findall(CITE.sub(" ", text)):
        files += [p for folder in folders for p in sorted(folder.glob(name)) if p.is_file()]
    return list(dict.fromkeys(files)), problems


def check_unit(where: str, lines: list[tuple[int, str]], context: str, root: Path, must_cite: bool) -> list[str]:
    """Problems of one paragraph: lines [(line number, text)], `context` = a heading that also cites."""
    text = context + "\n" + "\n".join(t for _, t in lines)
    files, problems = resolve(text, root)
    problems = [f"{where}:{lines[0][0]}: {p}" for p in problems]
    if not files:
        if must_cite and not CITE.search(text) and any(ANY_NUMBER.search(t) for _, t in lines):
            problems.append(f"{where}:{lines[0][0]}: a MEASURED paragraph with numbers cites no results file")
        return problems
    sources = [source(p) for p in files]
    for no, t in lines:
        for m in FIGURE.finditer(BARE.sub(" ", CITE.sub(" ", t))):
            mantissa, exponent, suffix = m.group(1), m.group(2), m.group(3) or ""
            if not any(s.has(mantissa, exponent, suffix) for s in sources):
                cited = ", ".join(str(p.relative_to(root)) for p in files)
                problems.append(f"{where}:{no}: {m.group(0)} has no source in {cited}")
    return problems


def check_header(where: str, text: str, root: Path = ROOT) -> tuple[list[str], int]:
    """Problems of a kernel.cu's measured paragraphs, and how many paragraphs were checked."""
    problems, checked, para, heading = [], 0, [], ""

    def flush():
        nonlocal checked
        measured = heading.split(" ")[0] == "MEASURED"
        if para and (measured or CITE.search(para[0][1])):
            checked += 1
            problems.extend(check_unit(where, para, "", root, must_cite=measured))
        para.clear()

    for no, line in enumerate(text.splitlines(), 1):
        m = HEADING.match(line)
        if m or not line.startswith("//") or not line[2:].strip():
            flush()
            heading = m.group(1) if m else ""
        if m:
            para.append((no, line))
        elif para and line.startswith("//") and line[2:].strip():
            para.append((no, line))
    flush()
    return problems, checked


def check_notes(where: str, text: str, root: Path = ROOT) -> tuple[list[str], int]:
    """Problems of NOTES.md's paragraphs, list items and table rows that cite results files."""
    problems, checked, unit, heading = [], 0, [], ""

    def flush():
        nonlocal checked
        if unit and CITE.search(heading + "\n" + "\n".join(t for _, t in unit)):
            checked += 1
            problems.extend(check_unit(where, unit, heading, root, must_cite=False))
        unit.clear()

    for no, line in enumerate(text.splitlines(), 1):
        starts_unit = re.match(r"\s*(?:[-*]|\d+\.)\s|\|", line)
        if line.startswith("#") or not line.strip() or starts_unit or (unit and unit[-1][1].startswith("|")):
            flush()
        if line.startswith("#"):
            heading = line
        elif line.strip():
            unit.append((no, line))
    flush()
    return problems, checked


KERNELS = sorted(ROOT.glob("steps/step[0-9][0-9]/kernel.cu"))


# ids without the step's name: `python -m verify` runs the tests whose id names a step with that step's
# kernel checks, and a header's wording is no reason to leave a kernel out of the benchmark.
@pytest.mark.parametrize("path", [*KERNELS, ROOT / "NOTES.md"], ids=lambda p: p.name if p.suffix == ".md" else f"header{p.parent.name[4:]}")
def test_every_figure_has_a_source(path):
    check = check_notes if path.suffix == ".md" else check_header
    problems, _ = check(str(path.relative_to(ROOT)), path.read_text())
    assert not problems, "figures without a source in the results files they cite (TFLOP/s to 1 decimal, " \
        "ratios to 2, other recorded numbers rounded):\n  " + "\n  ".join(problems)


def test_the_checker_sees_the_figures():
    """Guard against a checker that passes because it finds nothing: the committed notes cite results."""
    counts = [check_header("", p.read_text())[1] for p in KERNELS] + [check_notes("", (ROOT / "NOTES.md").read_text())[1]]
    assert sum(counts) > 0 and counts[-1] > 0, counts


# The checker on made-up text, with figures computed from the newest committed results file.

def newest_run() -> tuple[str, dict]:
    runs = sorted(p for p in ROOT.glob("results/*/*.json") if "timings" in json.loads(p.read_text()))
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


def unsourced(cite: str, near: float) -> str:
    """The 1-decimal figure nearest above `near` that the results file cannot back."""
    src = source(ROOT / cite)
    return next(f for f in (f"{near + i / 10:.1f}" for i in range(1, 1000)) if not src.has(f, None, ""))


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
    """A blank comment line, an ALL-CAPS heading or code ends the paragraph: a number after it is not checked
    (and is, with no end in between)."""
    cite, run = newest_run()
    _, _, _, ta, _ = two_cells(run)
    wrong = unsourced(cite, ta)
    line = f"//   {wrong}, not from the file.\n"
    assert check_header("fake.cu", header(cite, f"{ta:.1f}", after=end + line)) == ([], 1)
    assert check_header("fake.cu", header(cite, f"{ta:.1f}", after=line)) == ([f"fake.cu:4: {wrong} has no source in {cite}"], 1)


def test_too_many_decimals_is_not_a_source():
    """The TFLOP/s rule is 1 decimal: the same value written with 2 has no source."""
    cite, run = newest_run()
    _, _, _, ta, _ = two_cells(run)
    problems, _ = check_header("fake.cu", header(cite, f"{ta:.2f}"))
    assert len(problems) == 1 and f"{ta:.2f} has no source" in problems[0], problems


def test_a_measured_paragraph_must_cite_a_file():
    cite, run = newest_run()
    _, _, _, ta, _ = two_cells(run)
    problems, _ = check_header("fake.cu", header("H200", f"{ta:.1f}"))
    assert problems == ["fake.cu:2: a MEASURED paragraph with numbers cites no results file"], problems
    assert check_header("fake.cu", "// MEASURED: pending the next H200 run.\n")[0] == []  # no number, no claim


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
    assert check_notes("NOTES.md", notes, tmp_path) == ([], 1)  # the second item cites nothing: not checked
    notes = notes.replace("- again:", "- again (results/gpu/run.txt):")
    assert check_notes("NOTES.md", notes, tmp_path) == ([f"NOTES.md:4: {bad} has no source in results/gpu/run.txt"], 2)
    too_precise = f"{reps:.1f}"  # more digits than the file recorded
    notes = notes.replace(bad, too_precise)
    assert check_notes("NOTES.md", notes, tmp_path) == ([f"NOTES.md:4: {too_precise} has no source in results/gpu/run.txt"], 2)


def test_notes_heading_and_folder_citations(tmp_path):
    """A heading's citation covers its section; a bare file name resolves in a cited folder."""
    run = {"timings": {"x": {"1024": {"tflops": 2.0}}, "y": {"1024": {"tflops": 3.0}}}}
    (tmp_path / "results" / "gpu").mkdir(parents=True)
    (tmp_path / "results" / "gpu" / "run.json").write_text(json.dumps(run))
    ratio = fmt_ratio(3.0 / 2.0)
    notes = f"## Section (results/gpu/)\n\ny is {ratio}x x, not 8.8 (run.json).\n\n## Other (results/gpu/run.json)\n\n{ratio}x, 9.9\n"
    assert check_notes("NOTES.md", notes, tmp_path) == (["NOTES.md:3: 8.8 has no source in results/gpu/run.json",
                                                         "NOTES.md:7: 9.9 has no source in results/gpu/run.json"], 2)
