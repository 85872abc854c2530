"""CPU: the repository stands alone and its packages are what a user expects.

Every step's package (the same files but for its name, its dependencies, license, build backend, wheel tag, an
sdist with a README that builds on its own, a clear refusal of editable installs), the root project (installs the
harness's dependencies and nothing else), the build cache (cached vs built, nvcc's version in the fingerprint),
build outputs that git ignores, and no file that points outside the repository.
The builds call setuptools' PEP 517 hooks in a subprocess, as pip does, but without build isolation
(no package index needed): they need setuptools >= 77 here, which requirements-verify.txt lists.
"""
import ast
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

from verify import steps as steps_mod

ROOT = Path(__file__).resolve().parents[2]
build_step = steps_mod.build_step
STEP_DIRS = build_step.find_steps(ROOT)
SETUPTOOLS_MIN = "77"  # the first setuptools that takes `license` as an SPDX string (PEP 639)


def pyproject(path: Path) -> dict:
    if tomllib is None:
        pytest.skip("reading pyproject.toml needs tomllib (Python >= 3.11)")
    return tomllib.loads(path.read_text())


def setuptools_requirement(meta: dict) -> str:
    reqs = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert reqs, f"no setuptools in build-system.requires: {meta['build-system']}"
    return reqs[0].replace(" ", "")


def backend(hook: str, project: Path, out: Path) -> subprocess.CompletedProcess:
    """Run one PEP 517 hook of setuptools on `project` in a fresh interpreter, as a build frontend does."""
    pytest.importorskip("setuptools", minversion=SETUPTOOLS_MIN, reason="the steps' build backend")
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True)


def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("build", "__pycache__", "*.egg-info", ".nox"))


def included_headers(source: Path, common: Path) -> set[str]:
    """The common/ headers that `source` includes, directly or through other headers."""
    found, todo = set(), [source]
    while todo:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', todo.pop().read_text(), re.M):
            if name not in found and (common / name).is_file():
                found.add(name)
                todo.append(common / name)
    return found


# ---- every step's package: metadata -------------------------------------------------------------------


def test_license_file():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "flashladder developers" in text, "LICENSE: expected the MIT license"


@pytest.mark.parametrize("project", [ROOT, *STEP_DIRS], ids=lambda p: p.name if p != ROOT else "root")
def test_license_is_an_spdx_string_and_setuptools_can_read_it(project):
    meta = pyproject(project / "pyproject.toml")
    assert meta["project"].get("license") == "MIT", \
        f"{project.name}/pyproject.toml: license must be the SPDX string \"MIT\" (the table form is deprecated)"
    req = setuptools_requirement(meta)
    m = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", req)
    assert m and int(m.group(1)) >= int(SETUPTOOLS_MIN), \
        f"{project.name}/pyproject.toml: {req!r}; a license string needs setuptools>={SETUPTOOLS_MIN}"


@pytest.mark.parametrize("name", ["setup.py", "pyproject.toml", "README.md"])
def test_steps_share_one_file_but_their_name(name):
    """Every step's package is made the same way; the kernel.cu is what differs (and says what it adds)."""
    first = (STEP_DIRS[0] / name).read_text().replace(STEP_DIRS[0].name, "stepNN")
    for step in STEP_DIRS[1:]:
        assert (step / name).read_text().replace(step.name, "stepNN") == first, \
            f"{step.name}/{name} differs from {STEP_DIRS[0].name}'s in more than the step's name"


def test_a_step_depends_on_torch_and_numpy():
    """torch at run time; numpy because torch warns at import without it and does not bring it."""
    meta = pyproject(STEP_DIRS[0] / "pyproject.toml")["project"]
    assert meta["dependencies"] == ["torch>=2.4", "numpy"] and meta["readme"] == "README.md", meta


def test_root_pyproject_states_no_false_step_count():
    text = (ROOT / "pyproject.toml").read_text().lower()
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
             "twelve", "thirteen", "fourteen", "fifteen", "sixteen"]
    for count in re.findall(r"\b(\d+|" + "|".join(words) + r")\s+steps\b", text):
        n = int(count) if count.isdigit() else words.index(count)
        assert n == len(STEP_DIRS), f"pyproject.toml speaks of {count} steps; steps/ has {len(STEP_DIRS)}"


# ---- every step's package: builds ----------------------------------------------------------------------


def test_sdist_builds_on_its_own_into_a_py3_none_wheel(tmp_path):
    """sdist of the first step (the quickest compile), unpacked away from the repository, built into a wheel."""
    step = STEP_DIRS[0]
    name = build_step.step_name(step)
    repo = tmp_path / "repo"  # the files the step's build may use, laid out as in the repository
    copy_tree(step, repo / "steps" / step.name)
    copy_tree(ROOT / "common", repo / "common")
    shutil.copy(ROOT / "LICENSE", repo / "LICENSE")

    res = backend("build_sdist", repo / "steps" / step.name, tmp_path / "sdist")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "standard file not found" not in res.stdout + res.stderr, "the sdist has no README"
    sdist = tmp_path / "sdist" / res.stdout.split()[-1]
    with tarfile.open(sdist) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
        # filter="data" (no links out, no absolute paths) where tarfile has it: from Python 3.11.4 and 3.12; an older
        # 3.11 (Debian 12's 3.11.2, CI's) extracts our own sdist without it
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp_path / "unpacked", filter="data")
        else:
            tar.extractall(tmp_path / "unpacked")
    binding = [f.relative_to(ROOT / "common").as_posix() for f in sorted((ROOT / "common" / "binding").glob("*.py"))]
    assert "binding/__init__.py" in binding and len(binding) > 1, binding
    needed = {"kernel.cu", "pkg/__init__.py", "setup.py", "pyproject.toml", "README.md", "LICENSE", "common/build_step.py",
              *(f"common/{f}" for f in binding),
              *(f"common/{h}" for h in included_headers(step / "kernel.cu", ROOT / "common"))}
    assert needed <= members, f"{sdist.name} lacks {sorted(needed - members)}"

    unpacked = next((tmp_path / "unpacked").iterdir())
    res = backend("build_wheel", unpacked, tmp_path / "wheel")  # no repository around it: only the sdist
    assert res.returncode == 0, res.stdout + res.stderr
    wheel = tmp_path / "wheel" / res.stdout.split()[-1]
    machine = platform.machine()
    assert wheel.name.endswith(f"-py3-none-linux_{machine}.whl"), \
        f"{wheel.name}: expected py3-none-linux_{machine} (the library is loaded with ctypes: no CPython ABI)"
    with zipfile.ZipFile(wheel) as whl:
        files = set(whl.namelist())
        metadata = whl.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
        root_is_purelib = whl.read(next(f for f in files if f.endswith(".dist-info/WHEEL"))).decode()
    package = {f"flashladder/{name}/{f}" for f in ("__init__.py", "_kernel.so", "_ptxas.txt", "LICENSE",
                                                   *(f.replace("binding/", "_binding/", 1) for f in binding))}
    assert package <= files, f"{wheel.name} lacks {sorted(package - files)}"
    assert "License-Expression: MIT" in metadata
    assert re.findall(r"^Requires-Dist: (.+)$", metadata, re.M) == ["torch>=2.4", "numpy"], metadata
    assert "Description-Content-Type: text/markdown" in metadata and f"# flashladder-{name}" in metadata
    assert "Root-Is-Purelib: false" in root_is_purelib  # installs into platlib: the wheel holds a binary


def test_editable_install_is_refused_with_a_message(tmp_path):
    step = STEP_DIRS[0]
    copy_tree(step, tmp_path / "steps" / step.name)
    copy_tree(ROOT / "common", tmp_path / "common")
    shutil.copy(ROOT / "LICENSE", tmp_path / "LICENSE")
    res = backend("build_editable", tmp_path / "steps" / step.name, tmp_path / "out")
    output = res.stdout + res.stderr
    assert res.returncode != 0, f"an editable build of {step.name} succeeded; importing it would find no _kernel.so"
    assert "cannot be installed in editable mode" in output and f"pip install steps/{step.name}" in output, output
    assert "Traceback" not in output, output


def test_a_wheel_build_with_an_old_nvcc_says_why(tmp_path, monkeypatch):
    step = STEP_DIRS[0]
    copy_tree(step, tmp_path / "steps" / step.name)
    copy_tree(ROOT / "common", tmp_path / "common")
    shutil.copy(ROOT / "LICENSE", tmp_path / "LICENSE")
    old = tmp_path / "bin" / "nvcc"
    old.parent.mkdir()
    old.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 11.8, V11.8.89'\n")
    old.chmod(0o755)
    monkeypatch.setenv("NVCC", str(old))
    res = backend("build_wheel", tmp_path / "steps" / step.name, tmp_path / "out")
    output = res.stdout + res.stderr
    assert res.returncode != 0 and "needs nvcc >= 12.8" in output, output
    assert "Traceback" not in output, output


# ---- the root project ----------------------------------------------------------------------------------


def requirement_lines() -> list[str]:
    lines = (ROOT / "requirements-verify.txt").read_text().splitlines()
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


def test_root_installs_the_requirements_and_no_package(tmp_path):
    """`pip install .` at the root: setuptools must not discover verify/, common/, steps/ as packages."""
    project = tmp_path / "root"
    project.mkdir()
    for f in ("pyproject.toml", "requirements-verify.txt", "LICENSE"):
        shutil.copy(ROOT / f, project / f)
    for d in ("verify", "common", "steps"):  # the folders that made setuptools' discovery fail
        copy_tree(ROOT / d, project / d)
    res = backend("build_wheel", project, tmp_path / "wheel")
    assert res.returncode == 0, res.stdout + res.stderr
    with zipfile.ZipFile(tmp_path / "wheel" / res.stdout.split()[-1]) as whl:
        files = whl.namelist()
        metadata = whl.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
    assert all(".dist-info/" in f for f in files), f"the root wheel packages files: {files}"
    assert re.findall(r"^Requires-Dist: (.+)$", metadata, re.M) == requirement_lines()


def third_party_imports(files) -> tuple[set[str], set[str]]:
    """Top-level modules that `files` import, less the standard library: (unguarded, guarded by `except ImportError`)."""
    plain, guarded = set(), set()
    for f in files:
        tree = ast.parse(f.read_text())
        in_try = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try)
                  and any(isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                          for h in t.handlers)
                  for n in ast.walk(t)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = {node.module.split(".")[0]}
            else:
                continue
            (guarded if id(node) in in_try else plain).update(names)
    stdlib = set(sys.stdlib_module_names)
    return plain - stdlib, guarded - stdlib


def requirement_names() -> set[str]:
    return {re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower() for r in requirement_lines()}


# What the tests run rather than import: setuptools' PEP 517 hooks (in a subprocess, above) and the programs of the
# nvidia-* wheels (cuobjdump and nvdisasm, which verify/tests/test_sass.py looks for).
RUN_NOT_IMPORTED = {"setuptools", "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"}


def test_requirements_are_what_verify_imports():
    local = {"verify", "binding", "build_step", "flashladder"}
    plain, guarded = third_party_imports([*(ROOT / "verify").rglob("*.py"), *(ROOT / "common" / "binding").glob("*.py")])
    listed = requirement_names()
    assert plain - local <= listed, f"verify imports {sorted(plain - local - listed)}: add them to requirements-verify.txt"
    assert listed - RUN_NOT_IMPORTED <= plain | guarded, \
        f"requirements-verify.txt lists {sorted(listed - RUN_NOT_IMPORTED - plain - guarded)}, which nothing imports"
    assert RUN_NOT_IMPORTED <= listed, f"requirements-verify.txt lacks {sorted(RUN_NOT_IMPORTED - listed)}, which the tests run"


def test_verify_checks_first_for_every_module_of_the_requirements():
    from verify.__main__ import NEEDS
    assert set(NEEDS) == requirement_names() - RUN_NOT_IMPORTED, "python -m verify's NEEDS and requirements-verify.txt disagree"


# ---- the build cache -----------------------------------------------------------------------------------


def test_a_cached_build_says_cached():
    step = steps_mod.all_steps()[0]
    steps_mod.build([step], jobs=1, log=lambda *_: None)  # built or cached: current from here on
    lines = []
    steps_mod.build([step], jobs=1, log=lines.append)
    assert lines == [f"  cached {step}"], lines


def test_nvcc_version_is_in_the_fingerprint(tmp_path, monkeypatch):
    """Same nvcc path, same sources, another nvcc build: the step is rebuilt; the same one again: cached."""
    real = build_step.find_nvcc()
    fake = tmp_path / "bin" / "nvcc"  # forwards to the real nvcc, but reports a version of our choosing
    fake.parent.mkdir()

    def release(tag: str) -> None:
        (tmp_path / "version.txt").write_text(build_step.nvcc_version_text(real) + tag + "\n")
        fake.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && exec cat '{tmp_path / 'version.txt'}'\nexec '{real}' \"$@\"\n")
        fake.chmod(0o755)
        build_step.nvcc_version_text.cache_clear()

    monkeypatch.setenv("NVCC", str(fake))
    out = tmp_path / "pkg" / "step"
    release("fake build 1")
    assert build_step.compile_step(STEP_DIRS[0], out) is True
    assert build_step.compile_step(STEP_DIRS[0], out) is False, "an unchanged build was not cached"
    release("fake build 2")
    assert build_step.compile_step(STEP_DIRS[0], out) is True, "a new nvcc build at the same path reused the old build"
    build_step.nvcc_version_text.cache_clear()


# ---- the repository stands alone -----------------------------------------------------------------------

# Written with [/] so that this file does not match itself.
OUTSIDE = re.compile(r"\bshared[/]|[/]work[/]|[/]tmp[/]|beside this repositor[y]")
AUTHORED = {".py", ".md", ".cu", ".cuh", ".toml", ".txt", ".cfg", ".sh"}


def authored_files() -> list[Path]:
    """Every file a person wrote: tracked or not yet tracked, not ignored, outside results/ (what runs wrote)."""
    res = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    if res.returncode == 0:
        paths = [ROOT / p for p in res.stdout.splitlines()]
    else:  # not a git checkout
        paths = [p for p in ROOT.rglob("*") if not {".git", "build", ".nox", "__pycache__"} & set(p.parts)]
    return [p for p in paths if p.is_file() and (p.suffix in AUTHORED or p == ROOT / ".ci" / "run")
            and p.relative_to(ROOT).parts[0] != "results"]


def test_build_outputs_are_ignored():
    """What building, installing and the README's set-up leave in a checkout is not taken for a change."""
    step = STEP_DIRS[0].relative_to(ROOT)
    outputs = [f"{step}/dist/x.tar.gz", f"{step}/build/lib/x", f"{step}/flashladder_{step.name}.egg-info/PKG-INFO",
               "dist/x.whl", "build/dev/x", ".venv/bin/python", ".nox/tests/bin/python"]
    res = subprocess.run(["git", "check-ignore", "--no-index", *outputs], cwd=ROOT, capture_output=True, text=True)
    if res.returncode == 128:
        pytest.skip(f"not a git checkout: {res.stderr.strip()}")
    assert sorted(res.stdout.split()) == sorted(outputs), f"not ignored: {sorted(set(outputs) - set(res.stdout.split()))}"


def test_no_file_points_outside_the_repository():
    files = authored_files()
    assert ROOT / "README.md" in files and ROOT / "docs" / "ladder.md" in files
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "a user's clone has only the repository:\n" + "\n".join(hits)


def test_readme_links_the_plan_and_the_set_up():
    text = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        if "://" not in link:
            assert (ROOT / link).exists(), f"README.md links {link}, which does not exist"
    for needed in ("(docs/ladder.md)", "git clone", "install nox", "pip install -r requirements-verify.txt", "nox -s verify"):
        assert needed in text, f"README.md no longer shows `{needed}`"
