"""CPU: no stale step range and no wrong "final step" anywhere in the repository's text.

The steps are the folders that exist (steps/stepNN/kernel.cu, in order); the final step is the last of them.
Part I of the ladder (step01 to step14) is closed, so a range inside it stays true ("steps 01-07 run on any GPU
since sm_80"). A range that reaches past it names the steps that have something ("steps 15-20 take causal masks"),
and a step added later has it too: such a range must end at the final step, or be written so that it cannot go
stale ("from step15 on", "step15 to the final step"). A step named as the final (or last, or newest) one must be
the final step, and so must every step in the code blocks of a section about the final step.

What is read: README.md, docs/*.md, the steps' READMEs, noxfile.py, pyproject.toml, .ci/run, and the Python of
common/ and verify/ (docstrings, messages, comments). The kernels' headers are stories told at their step's
time ("steps 15-18 test causal at run time" stays true in step19's), so only their claims about the final step
are read. Ranges of history say so ("the old steps 16-20") and are not checked.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PART_I_END = 14  # step14 closes Part I: a range that ends at or before it cannot go stale
# A part of the ladder that a later part has followed, by its span: named as the part ("Part II, step15 to step22"),
# its range stays true.
CLOSED_PARTS = {"ii": (15, 22)}
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
                "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
                "twenty-one", "twenty-two", "twenty-three", "twenty-four", "twenty-five", "twenty-six", "twenty-seven",
                "twenty-eight", "twenty-nine", "thirty"]


def steps(root: Path = ROOT) -> list[int]:
    """The steps that exist, by number, in order: the last is the final step."""
    return sorted(int(p.parent.name[4:]) for p in (root / "steps").glob("step[0-9][0-9]/kernel.cu"))


def texts(root: Path = ROOT) -> list[Path]:
    """The files whose every line is checked (ranges and final-step claims)."""
    found = [root / "README.md", root / "noxfile.py", root / "pyproject.toml", root / ".ci" / "run",
             *sorted((root / "docs").glob("*.md")), *sorted((root / "steps").glob("step[0-9][0-9]/README.md")),
             *sorted((root / "common").glob("*.py")), *sorted((root / "verify").rglob("*.py"))]
    return [p for p in found if p.is_file() and p.resolve() != Path(__file__).resolve()]


def kernels(root: Path = ROOT) -> list[Path]:
    """The files checked for claims about the final step only (their headers tell history)."""
    return sorted((root / "steps").glob("step[0-9][0-9]/kernel.cu"))


SEP = r"\s*(?:-|–|—|\.\.|to|through)\s*"
# "steps 08-16", "Steps 1-7", "step16 to step20", "step01..step14"; never part of a path (a results folder named
# for the steps it ran, results/h200/2026-12-04-steps30-31/)
RANGE = re.compile(r"(?<![\w./-])\bsteps?\s*(\d{1,2})" + SEP + r"(?:step\s*)?(\d{1,2})\b", re.I)
# "01-07 and 08-16" after a "step" earlier on the line, or a cell "| 08-16 |" of a table whose first column is steps;
# never a date (2026-12-03) or a time
PAIR = re.compile(r"(?<![\w.\-/:])(\d{2})\s?[-–]\s?(\d{2})(?![\w\-])")
CELL = re.compile(r"\|\s*(\d{2})\s?[-–]\s?(\d{2})\s*\|")
FINAL_WORDS = r"(?:final|last|newest)\s+step(?![\w'’-])"
# "step20, the final step", "step20 (the final step)", "step22 is the final step"
NAMED_BEFORE = re.compile(r"\bstep\s?(\d{1,2})\b[\s,(:#—–-]*(?:(?:is|was|becomes|now|here)\s+)*(?:the|its|our)\s+"
                          + FINAL_WORDS, re.I)
# "the final step (step22)", "the final step, step22", "the final step: `steps/step22`", "the final step is step22"
NAMED_AFTER = re.compile(FINAL_WORDS + r"[\s,(:—–=`-]*(?:(?:is|here)\s+)?`?(?:steps/|flashladder\.)?step\s?(\d{1,2})\b(?!['’]s)",
                         re.I)
STOPS = re.compile(r"\b(?:ladder|it)\s+(?:stops|ends)\s+at\s+(?:step\s?)?([\w-]+)", re.I)
COUNT = re.compile(r"\b(" + "|".join(sorted(NUMBER_WORDS[8:], key=len, reverse=True)) + r")\s+steps\b", re.I)
HEADING = re.compile(r"^(#+)\s+(.*)$")
STEP_IN_CODE = re.compile(r"(?:steps/|flashladder\.|flashladder-)step(\d{2})\b")


def number(word: str) -> int | None:
    word = word.lower()
    if word.isdigit():
        return int(word)
    return NUMBER_WORDS.index(word) if word in NUMBER_WORDS else None


def range_problem(lo: int, hi: int, have: list[int]) -> str | None:
    final = have[-1]
    if lo > hi:
        return f"runs backwards ({lo} > {hi})"
    if hi > final:
        return f"reaches step{hi:02d}, past the final step (step{final:02d})"
    if hi > PART_I_END and hi != final:
        return (f"reaches past Part I (step{PART_I_END:02d}) but stops at step{hi:02d}, before the final step "
                f"(step{final:02d}): end it at the final step, or write 'from step{lo:02d} on'")
    return None


def line_ranges(line: str, step_table: bool = False) -> list[tuple[int, int, int]]:
    """(start column, lo, hi) of every step range on the line (a row of a table whose first column is steps: its
    cells too)."""
    found = {m.start(): (int(m.group(1)), int(m.group(2))) for m in RANGE.finditer(line)}
    for m in CELL.finditer(line) if step_table else ():
        found.setdefault(m.start(1), (int(m.group(1)), int(m.group(2))))
    for m in PAIR.finditer(line):
        before = line[max(0, m.start() - 60):m.start()].lower()
        if "step" in before and not any(m.start() - 12 <= s <= m.start() for s in found):
            found.setdefault(m.start(), (int(m.group(1)), int(m.group(2))))
    return [(col, lo, hi) for col, (lo, hi) in sorted(found.items())]


def final_problems(line: str, have: list[int]) -> list[str]:
    final, out = have[-1], []
    for m in (*NAMED_BEFORE.finditer(line), *NAMED_AFTER.finditer(line)):
        if int(m.group(1)) != final:
            out.append(f"calls step{int(m.group(1)):02d} the final step; the final step is step{final:02d}")
    for m in STOPS.finditer(line):
        n = number(m.group(1))
        if n is not None and n != final:
            out.append(f"says the ladder stops at {m.group(1)}; the final step is step{final:02d}")
    return out


def stale(text: str, have: list[int], ranges: bool = True) -> list[tuple[int, str]]:
    """(line number, what is wrong) for every stale step range, count of steps or final-step claim in `text`."""
    out = []
    final_section, in_code, step_table, previous = False, False, False, ""
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("|") and not previous.startswith("|"):  # a table's header row
            step_table = "step" in line.split("|")[1].lower()
        previous = line
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and (h := HEADING.match(line)):
            final_section = bool(re.search(FINAL_WORDS, h.group(2), re.I))
        if in_code and final_section:
            for m in STEP_IN_CODE.finditer(line):
                if int(m.group(1)) != have[-1]:
                    out.append((i, f"a snippet of a section on the final step uses step{m.group(1)}; the final step "
                                   f"is step{have[-1]:02d}"))
        out += [(i, p) for p in final_problems(line, have)]
        if not ranges:
            continue
        for col, lo, hi in line_ranges(line, step_table and line.startswith("|")):
            if re.search(r"\bold\s+(?:steps?\s*)?$", line[max(0, col - 12):col], re.I):
                continue  # history: "the old steps 16-20"
            if (m := re.search(r"\bpart\s+(i+|iv)\b[,:]?\s*$", line[max(0, col - 16):col], re.I)) and \
                    CLOSED_PARTS.get(m.group(1).lower()) == (lo, hi):
                continue  # a closed part by its span: "Part II, step15 to step22"
            if (p := range_problem(lo, hi, have)) is not None:
                out.append((i, f"'{line[col:col + 24].strip()}...' {p}"))
        for m in COUNT.finditer(line):
            n = number(m.group(1))
            part_i = n == PART_I_END and re.search(r"\bpart i\b|\bfirst\b|01-14|01–14", line, re.I)
            if n != len(have) and not part_i:
                out.append((i, f"speaks of {m.group(1)} steps; steps/ has {len(have)} (Part I: {PART_I_END})"))
    return list(dict.fromkeys(out))


def report(path: Path, problems: list[tuple[int, str]]) -> str:
    return "\n".join(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{i}: {p}" for i, p in problems)


# ---- the checker itself: it finds what went stale, and passes what cannot ------------------------------------

HAVE = list(range(1, 23))  # a ladder of 22 steps


@pytest.mark.parametrize("text", [
    "Steps 08-16 use Hopper's TMA",                      # the README's, 2026-12-03
    "| steps | built for | runs on |\n|---|---|---|\n| 08-16 | SASS for sm_90a | H100, H200 |",
    "Steps 01-07 and 08-16 are built for",
    "steps 18-19 keep a workspace of their own",
    "Only steps 15-20 take these",
    "a range past the end: steps 15-23",
    "step16 to step20 run the paired kernel",
    "step20, the final step, came after the table's run",
    "pip install steps/step20            # the final step",
    "the final step (step21) was measured",
    "The ladder: fourteen steps from plain CUDA",
    "the ladder stops at fourteen",
    "Twenty steps, each one idea",
])
def test_the_checker_finds_a_stale_range_or_final_step(text):
    assert stale(text, HAVE), f"not flagged: {text!r}"


@pytest.mark.parametrize("text", [
    "Steps 01-07 use only what every NVIDIA GPU since Ampere has; steps 08-14 Hopper's TMA",
    "| steps | built for |\n|---|---|\n| 01-07 | SASS for sm_80 ... |",
    "| bits | field |\n|---|---|\n| 16–29 | leading-dimension byte offset |",
    "Part II, step15 to the final step: what models pass",
    "steps 15-22 take causal masks",
    "from step08 on: TMA, wgmma",
    "step22, the final step",
    "the final step (step22)",
    "the old steps 16-20 exist in git history",
    "Part I's fourteen steps",
    "results/h200/2026-12-03T08-42-01Z.json and results/h200/2026-12-03-step20/checks.log",
    "a 21×60×104 latent, 4.4-9.8 s per call, SM clock 1650–1980 MHz",
    "python -m verify --steps 1-7",
    "the last step that takes causal masks",
])
def test_the_checker_passes_what_cannot_go_stale(text):
    assert not stale(text, HAVE), stale(text, HAVE)


def test_a_closed_part_named_by_its_span_stays_true_and_nothing_else_does():
    """Part II, once Part III began, is step15 to step22 for good; the same range without the part's name, or the part
    named with another span, is a claim about steps that may grow."""
    have = list(range(1, 24))
    assert not stale("Part II, step15 to step22: what models pass", have)
    assert stale("steps 15-22 take causal masks", have)
    assert stale("Part II, step15 to step21", have)



def test_a_snippet_under_a_heading_on_the_final_step_names_the_final_step():
    text = "## Use the final step\n\n```bash\npip install steps/step20\n```\n\n## Read a step\n\n```bash\n" \
           "git diff --no-index steps/step13 steps/step14\n```\n"
    assert [i for i, _ in stale(text, HAVE)] == [4]
    assert not stale(text.replace("step20", "step22"), HAVE)


# ---- the repository -------------------------------------------------------------------------------------------


def test_the_final_step_exists():
    have = steps()
    assert have and have == sorted(set(have)) and have[0] == 1, have


@pytest.mark.parametrize("path", texts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_stale_step_range_or_final_step(path):
    problems = stale(path.read_text(errors="replace"), steps())
    assert not problems, "stale (steps/ has step01 to step%02d):\n%s" % (steps()[-1], report(path, problems))


def test_no_kernel_header_names_a_wrong_final_step():
    problems = [report(p, stale(p.read_text(errors="replace"), steps(), ranges=False)) for p in kernels()]
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)
