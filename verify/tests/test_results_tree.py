"""CPU: results/ holds data that the tree cites, and no code; every folder a step header cites says what its files are.

CITED: a file under results/ is cited when a text file of the repository outside results/ names it (its path; a folder
above it, results/<gpu>/<folder>/ or deeper; or a glob that matches it), or when the README.md of a folder that such a
text cites names it (its path from the README's folder, or a glob: `ab-*.log`). A citation at a commit
(`results/.../x.log@43bfacc`) names a file of the git history, not of the tree. The runs of record that verify writes
and renders (results/<gpu>/<stamp>.json and .png, capstone-<stamp>.*, prefill-<stamp>.*, results/latest.png) are
cited by the tools that write them, and a folder of their logs (results/<gpu>/<name>-logs/) with them, where its
README.md names the run of record it belongs to.
CODE: a script, patch or kernel under results/ would import verify's internals or copy a step, and break when they
change: it stays in git history, cited as `path@commit`.
"""
from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_SUFFIXES = {".py", ".cu", ".cuh", ".patch", ".diff", ".sh", ".c", ".cpp", ".h", ".ipynb"}
# results/<gpu>/<stamp>.json|.png, capstone-<stamp>..., prefill-<stamp>...: what `python -m verify` and its
# capstone and prefill write; test_report renders every one.
RUN_OF_RECORD = re.compile(r"results/[\w.-]+/(?:capstone-|prefill-)?\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ\.(?:json|png)")
CITE = re.compile(r"(?<![\w/.-])(results/[\w./*+-]*[\w*/])(@[0-9a-f]{7,40})?")
NAME = re.compile(r"[\w./*+-]+")


def tree_files(root: Path) -> list[str]:
    """Every file of the tree, tracked or not yet tracked and not ignored, as a path from the root."""
    res = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True, text=True)
    if res.returncode == 0 and res.stdout.strip():
        return sorted(p for p in res.stdout.splitlines() if (root / p).is_file())
    skip = {".git", "build", ".nox", "__pycache__", ".venv"}
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not skip & set(p.parts))


def read(root: Path, path: str) -> str:
    try:
        return (root / path).read_text()
    except (UnicodeDecodeError, OSError):
        return ""  # a picture, an archive: it cites nothing


def citations(text: str) -> set[str]:
    """The paths under results/ that `text` names (files, folders, globs), leaving out those at a commit."""
    return {m.group(1).rstrip(".") for m in CITE.finditer(text) if not m.group(2)}


def covers(cite: str, path: str) -> bool:
    if "*" in cite:
        return fnmatch.fnmatch(path, cite)
    folder = cite.rstrip("/")
    # a folder counts for its files from results/<gpu>/<folder> down: results/ or results/h200/ alone is no citation
    return path == cite or (folder.count("/") >= 2 and path.startswith(folder + "/"))


def readme_names(text: str, folder: str, path: str) -> bool:
    """Does the README.md of `folder` name `path` (a file below it), by its path from the folder or a glob?"""
    rel = path[len(folder) + 1:]
    names = set(NAME.findall(text))
    return rel in names or path in names or any("*" in n and fnmatch.fnmatch(rel, n) for n in names)


def logs_of_a_run(root: Path, folder: str, readme: str) -> bool:
    """Is `folder` a run's logs (results/<gpu>/<name>-logs/) whose README names a run of record beside it?"""
    parent = str(Path(folder).parent)
    return (folder.endswith("-logs") and parent.count("/") == 1
            and any(RUN_OF_RECORD.fullmatch(f"{parent}/{Path(n).name}") and (root / parent / Path(n).name).is_file()
                    for n in NAME.findall(readme)))


def problems(root: Path = ROOT, own: str = "verify/tests/test_results_tree.py") -> list[str]:
    files = tree_files(root)
    results = [p for p in files if p.startswith("results/")]
    outside: set[str] = set()
    for p in files:
        if not p.startswith("results/") and p != own:
            outside |= citations(read(root, p))
    readmes = {str(Path(p).parent): read(root, p) for p in results if Path(p).name == "README.md"}
    # a folder is cited when a text outside results/ names it or anything in it, a run's logs with the run
    cited_readmes = {d: t for d, t in readmes.items() if any(c.rstrip("/") == d or c.startswith(d + "/") for c in outside)
                     or logs_of_a_run(root, d, t)}
    found = []
    for p in results:
        if Path(p).suffix in CODE_SUFFIXES:
            found.append(f"{p}: code under results/ (leave it to git history and cite it as path@commit)")
        elif Path(p).name == "README.md" or p == "results/latest.png" or RUN_OF_RECORD.fullmatch(p):
            continue
        elif not any(covers(c, p) for c in outside) and not any(
                p.startswith(d + "/") and readme_names(t, d, p) for d, t in cited_readmes.items()):
            found.append(f"{p}: cited by nothing in the tree")
    return found


def header(text: str) -> str:
    """A kernel.cu's header: its comment lines before the first #include."""
    return text.split("\n#include", 1)[0]


def readme_gaps(root: Path = ROOT) -> list[str]:
    """Folders under results/ that a step header cites, and what their README.md leaves unsaid."""
    files = tree_files(root)
    gaps = []
    for kernel in sorted(root.glob("steps/step[0-9][0-9]/kernel.cu")):
        for cite in sorted(citations(header(kernel.read_text()))):
            parts = cite.split("/")
            if len(parts) < 4 or not (root / "/".join(parts[:3])).is_dir():
                continue  # a file at results/<gpu>/, or no folder
            folder = "/".join(parts[:3])
            readme = root / folder / "README.md"
            where = f"{kernel.relative_to(root)} cites {cite}"
            if not readme.is_file():
                gaps.append(f"{where}: {folder} has no README.md")
                continue
            text = readme.read_text()
            gaps += [f"{where}: {folder}/README.md does not say what {p[len(folder) + 1:]} is"
                     for p in files if p.startswith(folder + "/") and not p.endswith("/README.md")
                     and not readme_names(text, folder, p)]
    return sorted(set(gaps))


def test_results_hold_cited_data_and_no_code():
    found = problems()
    assert not found, "results/ holds data that the tree cites, and no code (this file's docstring says what " \
        "counts):\n  " + "\n  ".join(found)


def test_every_folder_a_header_cites_says_what_its_files_are():
    gaps = readme_gaps()
    assert not gaps, "a results folder that a step header cites has a README.md naming each file:\n  " + "\n  ".join(gaps)


def test_the_checks_see_code_and_uncited_files(tmp_path):
    """On a made-up tree: a script, an uncited log, a log named only by an uncited README, and what passes."""
    (tmp_path / "results/h200/a").mkdir(parents=True)
    (tmp_path / "results/h200/b").mkdir(parents=True)
    for name in ("a/x.log", "a/y.log", "a/ab.py", "a/README.md", "b/z.log", "b/README.md",
                 "2026-12-01T09-46-07Z.json", "c.log"):
        (tmp_path / "results/h200" / name).write_text("{}\n" if name.endswith(".json") else "x\n")
    (tmp_path / "results/h200/a/README.md").write_text("| x.log | a run |\n")
    (tmp_path / "results/h200/b/README.md").write_text("z.log: a run\n")
    (tmp_path / "cites.md").write_text("results/h200/a/ab.py@43bfacc, results/h200/a/README.md, results/h200/c.log@43bfacc\n")
    got = problems(tmp_path, own="")
    assert got == ["results/h200/a/ab.py: code under results/ (leave it to git history and cite it as path@commit)",
                   "results/h200/a/y.log: cited by nothing in the tree",
                   "results/h200/b/z.log: cited by nothing in the tree",
                   "results/h200/c.log: cited by nothing in the tree"], got
    (tmp_path / "cites.md").write_text("results/h200/a/y.log results/h200/b/ results/h200/c.log\n")
    (tmp_path / "results/h200/a/ab.py").unlink()
    assert problems(tmp_path, own="") == []
