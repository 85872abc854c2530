"""CPU: the README and the docs pages say what is true, stay short where they must, and what they generate is generated.

The README is what a newcomer reads first: what it is, the set-up, the two commands, reading a step, the final step in
three lines, the results table, and links; everything else is in docs/. Its generated sections (the steps, the results)
are what verify makes of the steps and the newest run, and the docs' generated sections (the capstone, the prefill) what
their entry points make of theirs. Every command the pages show names a nox session that exists, a module of verify and
options it has, and files that exist. (Step ranges and the final step: test_step_ranges.py.)
"""
import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from verify import capstone, prefill, report, train

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
GENERATED = [(report.STEPS_BEGIN, report.STEPS_END), (report.README_BEGIN, report.README_END),
             (report.BACKWARD_BEGIN, report.BACKWARD_END),
             (capstone.README_BEGIN, capstone.README_END), (prefill.README_BEGIN, prefill.README_END),
             (train.README_BEGIN, train.README_END)]
PROSE_LIMIT = 4500  # bytes of the README a person writes (the generated sections apart): a page, not a manual


def section(text: str, title: str) -> str:
    """The body of the markdown's `## title` section."""
    parts = text.split(f"\n## {title}\n", 1)
    assert len(parts) == 2, f"no section '## {title}'"
    return parts[1].split("\n## ", 1)[0]


def commands(markdown: str) -> list[str]:
    """The commands of the bash blocks in `markdown`, comments dropped, `a && b` split."""
    blocks = re.findall(r"```bash\n(.*?)```", markdown, re.S)
    return [c.strip() for b in blocks for line in b.splitlines() for c in line.split("#")[0].split("&&") if c.strip()]


def without_generated(text: str) -> str:
    for begin, end in GENERATED:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), "", text, flags=re.S)
    return text


def as_in_docs(body: str) -> str:
    """A generated section as it reads in docs/: its links to results/ relative to docs/."""
    return body.replace("](results/", "](../results/")


# ---- the README ------------------------------------------------------------------------------------------------


def test_readme_lists_every_step():
    assert report.steps_table(ROOT) in README.read_text(), \
        "README.md's step list is stale: run `python -m verify --update-steps-table`"


def test_readme_keeps_the_results_markers():
    text = README.read_text()
    assert text.count(report.README_BEGIN) == 1 and text.count(report.README_END) == 1, \
        "README.md must keep the results markers once: python -m verify regenerates the table between them"
    assert text.index(report.README_BEGIN) > text.index("\n## Results\n")


def test_readme_is_a_page():
    """What a person wrote in the README stays a page: the rest belongs in docs/."""
    prose = without_generated(README.read_text())
    assert len(prose.encode()) <= PROSE_LIMIT, (f"README.md's own text is {len(prose.encode())} bytes (limit {PROSE_LIMIT}): "
                                                "move the detail to a page under docs/ and link it")
    sections = re.findall(r"^## (.+)$", prose, re.M)
    assert sections == ["Set up", "The main job and the tests", "Read a step", "Use the final step", "Results", "More"], \
        sections


def test_readme_commands_exist():
    text = README.read_text()
    for cmd in ("nox -s verify", "nox -s tests", "python -m verify", "pip install steps/step",
                "git diff --no-index steps/step"):
        assert cmd in text, f"README.md no longer shows `{cmd}`"
    noxfile = (ROOT / "noxfile.py").read_text()
    assert "def tests(" in noxfile and "def verify(" in noxfile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "nox -s tests" in ci, ".ci/run must call the README's test command"
    assert "\nset -euo pipefail\n" in ci, ".ci/run must fail on any failure"


def test_readme_set_up_works_on_a_fresh_machine_and_leads_to_the_commands():
    """Only what a fresh Linux with Python has (git, python3 with venv and pip), then the next section runs nox."""
    text = README.read_text()
    set_up = commands(section(text, "Set up"))
    assert set_up and all(c.split()[0] in {"git", "cd", "python3", ".", "pip"} for c in set_up), set_up
    assert "pip install nox" in set_up, set_up
    after = text.split("\n## Set up\n", 1)[1].split("\n## ", 2)[1]
    assert after.startswith("The main job and the tests\n"), "the set-up's next section must be the one with the commands"
    assert {"nox -s verify", "nox -s tests"} <= set(commands(after)), commands(after)


def test_readme_says_what_the_tests_download_and_how_to_choose():
    """`nox -s tests` needs no GPU but installs torch: the README says how much, from where, and how to choose."""
    tests = section(README.read_text(), "The main job and the tests")
    noxfile = (ROOT / "noxfile.py").read_text()
    env = re.search(r'^TORCH_INDEX_ENV = "(\w+)"', noxfile, re.M).group(1)
    for needed in ("CPU", "PyPI", "CUDA", "GB", "MB", env, "nox --no-venv -s tests"):
        assert needed in tests, f"the README's commands section does not say `{needed}`"


def test_readme_says_what_installing_a_step_brings():
    """The build needs no torch, the install does: the README names each of a step's dependencies."""
    deps = re.search(r"^dependencies = \[(.*)\]$", (ROOT / "steps" / "step01" / "pyproject.toml").read_text(), re.M)
    use = section(README.read_text(), "Use the final step")
    for dep in re.findall(r'"([^"]+)"', deps.group(1)):
        as_written = dep.replace(">=", " >= ")  # torch>=2.4 reads "torch >= 2.4"
        assert as_written in use, f"the README's 'Use the final step' does not say `{as_written}`"
    assert "nvcc >= 12.8" in use and "(docs/models.md)" in use


def test_verify_cli_runs_without_a_gpu():
    """`python -m verify --help` works anywhere (the main job's entry point imports cleanly)."""
    out = subprocess.run([sys.executable, "-m", "verify", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--steps" in out.stdout, out.stderr


# ---- the docs' generated sections --------------------------------------------------------------------------------


def test_capstone_section_is_generated_from_the_newest_run_of_record():
    """The section between the capstone markers in docs/capstone.md is what `python -m verify.capstone --report` makes
    of the newest full run under results/ (a partial run, --quick or one shape, leaves it as it is), or says that none
    is recorded."""
    text = (ROOT / "docs" / "capstone.md").read_text()
    run = capstone.newest_full_run(ROOT)
    want = f"{capstone.README_BEGIN}\n{as_in_docs(capstone.readme_section(run))}\n{capstone.README_END}"
    assert want in text, ("docs/capstone.md's capstone section is stale: run `python -m verify.capstone --report "
                          f"{run['path'] if run else 'results/<gpu>/capstone-<timestamp>.json'}`")
    for cmd in ("pip install -r requirements-capstone.txt", "python -m verify.capstone", "--checkpoint", "--tiny-pipeline",
                "python -m verify.prefill"):
        assert cmd in text, f"docs/capstone.md no longer shows `{cmd}`"


def test_prefill_section_is_generated_from_the_newest_run_of_record():
    text = (ROOT / "docs" / "capstone.md").read_text()
    run = prefill.newest_full_run(ROOT)
    want = f"{prefill.README_BEGIN}\n{as_in_docs(prefill.readme_section(run))}\n{prefill.README_END}"
    assert want in text, ("docs/capstone.md's prefill section is stale: run `python -m verify.prefill --report "
                          f"{run['path'] if run else 'results/<gpu>/prefill-<timestamp>.json'}`")


def test_train_section_is_generated_from_the_newest_run_of_record():
    text = (ROOT / "docs" / "capstone.md").read_text()
    runs = train.newest_full_runs(ROOT)
    want = f"{train.README_BEGIN}\n{as_in_docs(train.readme_section(runs))}\n{train.README_END}"
    newest = next((r["path"] for r in runs.values() if r), "results/<gpu>/train-<model>-<timestamp>.json")
    assert want in text, f"docs/capstone.md's training section is stale: run `python -m verify.train --report {newest}`"


def test_generated_sections_are_where_their_generators_write():
    """Each pair of markers once, in the page its section belongs to, and nowhere else."""
    pages = {README: GENERATED[:3], ROOT / "docs" / "capstone.md": GENERATED[3:6]}
    for page in [README, *DOCS]:
        text = page.read_text()
        for begin, end in GENERATED:
            want = 1 if (begin, end) in pages.get(page, []) else 0
            assert text.count(begin) == want and text.count(end) == want, \
                f"{page.relative_to(ROOT)} holds {begin!r} {text.count(begin)} times (expected {want})"


# ---- every page: links, commands, the ladder's rows ----------------------------------------------------------------


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_somewhere(page):
    text = page.read_text()
    anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in link:
            continue
        path, _, anchor = link.partition("#")
        if path:
            assert (page.parent / path).exists(), f"{page.relative_to(ROOT)} links {link}, which does not exist"
        elif anchor:
            assert anchor in anchors, f"{page.relative_to(ROOT)} links #{anchor}, which no heading there makes"


@cache
def nox_sessions() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    return {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
            and any("session" in ast.unparse(d) for d in f.decorator_list)}


@cache
def options_of(module: str) -> str:
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"python -m {module} --help: {out.stderr}"
    return out.stdout


def shown_commands() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), c) for p in [README, *DOCS] for c in commands(p.read_text())]


@pytest.mark.parametrize("page, command", shown_commands())
def test_a_shown_command_names_what_exists(page, command):
    """nox sessions that the noxfile has; verify's modules with the options they take; files in the repository."""
    words = command.split()
    if words[:2] == ["nox", "-s"] or (words[0] == "nox" and "-s" in words):
        assert words[words.index("-s") + 1] in nox_sessions(), f"{page}: `{command}`: no such nox session"
    if "-m" in words and words[words.index("-m") + 1].startswith("verify"):
        module = words[words.index("-m") + 1]
        assert (ROOT / Path(*module.split("."))).with_suffix(".py").is_file() or (ROOT / module).is_dir(), \
            f"{page}: `{command}`: no module {module}"
        options = options_of(module)
        for flag in (w.split("=")[0] for w in words[words.index("-m") + 2:] if w.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", options), \
                f"{page}: `{command}`: python -m {module} has no option {flag}"
    for word in words:
        if re.fullmatch(r"(requirements[\w-]*\.txt|steps/step\d\d|results/[\w./-]+\.json|common/[\w.]+)", word):
            assert (ROOT / word).exists() or re.fullmatch(r"steps/step\d\d", word), f"{page}: `{command}`: no {word}"


def test_ladder_has_a_row_for_every_step_and_no_other():
    """docs/ladder.md's one line per step, Part I and Part II, is the steps that exist."""
    rows = re.findall(r"^\| (\d{2}) \|", (ROOT / "docs" / "ladder.md").read_text(), re.M)
    have = [p.parent.name[4:] for p in sorted((ROOT / "steps").glob("step[0-9][0-9]/kernel.cu"))]
    assert rows == have, (f"docs/ladder.md has rows for {', '.join(rows)}; steps/ has {', '.join(have)}: one row per "
                          "step, in order")
