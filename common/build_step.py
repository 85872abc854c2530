"""Build glue shared by every step: compile a step's kernel.cu with nvcc into a ctypes-loadable .so.

The one build of a step, used by:
  * each step's setup.py (``pip install steps/stepNN``), which puts the built package in the wheel;
  * ``verify`` (``python -m verify``, the tests), which builds every step into ``build/dev/``;
  * ``verify.trace``, which builds the traced steps into ``build/trace/`` with one extra flag
    (``compile_step(..., extra_nvcc_flags=("-DFLASHLADDER_TRACE",))``).
A step's sdist carries this file, the headers and the binding in its own ``common/`` (see ``setup_step``),
so it builds on its own, away from the repository.

Pure standard library: no torch, no numpy. A built step package is a directory

    flashladder/stepNN/
        __init__.py   the step's tiny binding (steps/stepNN/pkg/__init__.py)
        _binding.py   the shared Python binding (common/binding.py)
        _kernel.so    kernel.cu compiled for sm_90a, plain C ABI (common/flashladder.cuh)
        _ptxas.txt    the `ptxas -v` resource report: registers, shared memory, spills
        LICENSE       the repository's license (MIT)
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

COMMON = Path(__file__).resolve().parent
ROOT = COMMON.parent  # the repository; in a step's unpacked sdist, the sdist's folder
STEPS = ROOT / "steps"
LICENSE = ROOT / "LICENSE"

ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]  # exactly the target: wgmma/setmaxnreg need "a"
NVCC_FLAGS = [
    "-O3", "-std=c++17", *ARCH_FLAGS, "-lineinfo",
    "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden",  # a plain shared library; exports are marked
    "-Xptxas", "-v",                                         # the resource report, kept as _ptxas.txt
    "-Xptxas", "-warn-spills",
]
MIN_NVCC = (12, 8)


def find_steps(root: Path = ROOT) -> list[Path]:
    """Every step folder, found by glob (never a hand-kept list), in ladder order."""
    return sorted(p.parent for p in (root / "steps").glob("step[0-9][0-9]/kernel.cu"))


def step_name(step_dir: Path) -> str:
    """'step01' for steps/step01, read from the distribution name in its pyproject.toml."""
    text = (Path(step_dir) / "pyproject.toml").read_text()
    m = re.search(r'^name\s*=\s*"flashladder-(step\d+)"', text, re.M)
    if not m:
        raise RuntimeError(f"{step_dir}/pyproject.toml: expected name = \"flashladder-stepNN\"")
    return m.group(1)


def find_nvcc() -> str:
    for cand in (os.environ.get("NVCC"),
                 os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc") if os.environ.get("CUDA_HOME") else None,
                 shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand):
            return cand
    raise RuntimeError("nvcc not found: install the CUDA toolkit (>= 12.8) or set CUDA_HOME / NVCC")


@functools.lru_cache(maxsize=None)
def nvcc_version_text(nvcc: str) -> str:
    """`nvcc --version` verbatim: release and build id, so a toolkit updated in place changes it."""
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout


def nvcc_version(nvcc: str) -> tuple[int, int]:
    out = nvcc_version_text(nvcc)
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot read the version of {nvcc}:\n{out}")
    return int(m.group(1)), int(m.group(2))


def common_files() -> list[Path]:
    """What a step's build takes from common/: the headers, the binding, this script."""
    return [*sorted(COMMON.glob("*.cuh")), COMMON / "binding.py", COMMON / "build_step.py"]


def _sources(step_dir: Path) -> list[Path]:
    return [step_dir / "kernel.cu", step_dir / "pkg" / "__init__.py", *common_files(), LICENSE]


def _fingerprint(step_dir: Path, nvcc: str, flags: list[str]) -> str:
    """What a build depends on: nvcc's path, version and flags, and every source file's name and bytes."""
    h = hashlib.sha256(" ".join([nvcc, *flags]).encode() + nvcc_version_text(nvcc).encode())
    for src in _sources(step_dir):
        h.update(src.name.encode() + src.read_bytes())
    return h.hexdigest()


def compile_step(step_dir: Path, pkg_out: Path, force: bool = False, extra_nvcc_flags: tuple[str, ...] = ()) -> bool:
    """Build the step package into `pkg_out` (a folder named after the step).

    `extra_nvcc_flags` go after NVCC_FLAGS (e.g. ("-DFLASHLADDER_TRACE",) for verify.trace's build); they are
    part of the fingerprint, so a build with other flags into the same folder is never taken for current.
    Skips nvcc when nothing that goes into the build (sources, flags, nvcc's path and version) changed since
    the last build into pkg_out. Returns True if nvcc ran, False if the build there was current (cached).
    Raises RuntimeError with nvcc's output if the compile fails.
    """
    step_dir, pkg_out = Path(step_dir).resolve(), Path(pkg_out)
    if isinstance(extra_nvcc_flags, str):  # ("-DX") is a string, not a tuple: refuse it rather than split it
        raise TypeError(f"extra_nvcc_flags must be a sequence of flags, got the string {extra_nvcc_flags!r}")
    flags = [*NVCC_FLAGS, *extra_nvcc_flags]
    nvcc = find_nvcc()
    if nvcc_version(nvcc) < MIN_NVCC:
        raise RuntimeError(f"{nvcc} is CUDA {nvcc_version(nvcc)}; flashladder needs nvcc >= 12.8 for sm_90a")
    pkg_out.mkdir(parents=True, exist_ok=True)
    so, report, stamp = pkg_out / "_kernel.so", pkg_out / "_ptxas.txt", pkg_out / ".fingerprint"
    fp = _fingerprint(step_dir, nvcc, flags)
    if not force and so.exists() and report.exists() and stamp.exists() and stamp.read_text() == fp:
        return False
    shutil.copyfile(step_dir / "pkg" / "__init__.py", pkg_out / "__init__.py")
    shutil.copyfile(COMMON / "binding.py", pkg_out / "_binding.py")
    shutil.copyfile(LICENSE, pkg_out / "LICENSE")
    cmd = [nvcc, *flags, f"-I{COMMON}", str(step_dir / "kernel.cu"), "-o", str(so)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        with_flags = f" (with {' '.join(extra_nvcc_flags)})" if extra_nvcc_flags else ""
        raise RuntimeError(f"nvcc failed for {step_dir.name}{with_flags}:\n$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    report.write_text(proc.stdout + proc.stderr)
    stamp.write_text(fp)
    return True


def parse_ptxas(text: str) -> dict:
    """The kernels' resources from a `ptxas -v` report: {kernel: {registers, spill_stores, ...}}."""
    kernels: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$]+)'?", line)
        if m:
            current = kernels.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        for key, pat in (("stack_frame", r"(\d+) bytes stack frame"), ("spill_stores", r"(\d+) bytes spill stores"),
                         ("spill_loads", r"(\d+) bytes spill loads"), ("registers", r"Used (\d+) registers"),
                         ("static_smem", r"(\d+) bytes smem")):
            mm = re.search(pat, line)
            if mm:
                current[key] = int(mm.group(1))
    return {_demangle(name): info for name, info in kernels.items() if info}


def _demangle(name: str) -> str:
    """'_ZN..attention_fwd_kernelE9FwdParams' -> 'attention_fwd_kernel' (c++filt where there is one)."""
    tool = shutil.which("c++filt")
    if not tool or not name.startswith("_Z"):
        return name
    out = subprocess.run([tool, name], capture_output=True, text=True).stdout.strip() or name
    return re.sub(r"\(anonymous namespace\)::", "", out).split("(")[0]


def setup_step(step_dir: str | Path) -> None:
    """setuptools entry point for steps/stepNN/setup.py: the wheel holds the built package."""
    from setuptools import Distribution, setup
    from setuptools.command.bdist_wheel import bdist_wheel
    from setuptools.command.build_py import build_py
    from setuptools.command.editable_wheel import editable_wheel
    from setuptools.command.sdist import sdist
    from setuptools.errors import ExecError, SetupError

    step_dir = Path(step_dir).resolve()
    name = step_name(step_dir)

    class BuildWithNvcc(build_py):
        def run(self):
            try:
                compile_step(step_dir, Path(self.build_lib) / "flashladder" / name, force=True)
            except RuntimeError as e:  # nvcc missing, too old or failing: its message, without a traceback
                raise ExecError(str(e)) from None
            (Path(self.build_lib) / "flashladder" / name / ".fingerprint").unlink()

    class BinaryDistribution(Distribution):  # the wheel carries a compiled library: platform-specific
        def has_ext_modules(self):
            return True

    class AnyPythonWheel(bdist_wheel):
        """py3-none-<platform>: _kernel.so is loaded with ctypes, so no CPython ABI is involved."""
        def get_tag(self):
            return "py3", "none", super().get_tag()[2]

    class NoEditable(editable_wheel):
        def run(self):  # an editable install would import pkg/, which has no _kernel.so: refuse, saying why
            raise SetupError(f"flashladder-{name} cannot be installed in editable mode (pip install -e): its _kernel.so "
                             f"is compiled from kernel.cu at install time. Use `pip install steps/{name}` (again after "
                             "each edit), or `python -m verify`, which rebuilds what changed.")

    class SdistThatBuilds(sdist):
        """The sdist carries kernel.cu and what the build takes from common/, so it builds on its own."""
        def make_release_tree(self, base_dir, files):
            super().make_release_tree(base_dir, files)
            extras = {"kernel.cu": step_dir / "kernel.cu", "LICENSE": LICENSE,
                      **{f"common/{f.name}": f for f in common_files()}}
            for rel, src in extras.items():
                dst = Path(base_dir) / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.unlink(missing_ok=True)  # never write through a hard link into the source tree
                shutil.copyfile(src, dst)

    setup(packages=[f"flashladder.{name}"], package_dir={f"flashladder.{name}": "pkg"}, distclass=BinaryDistribution,
          cmdclass={"build_py": BuildWithNvcc, "bdist_wheel": AnyPythonWheel, "editable_wheel": NoEditable,
                    "sdist": SdistThatBuilds})


if __name__ == "__main__":  # python common/build_step.py [out_dir]: build every step, print the report
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "dev" / "flashladder"
    for step in find_steps():
        built = compile_step(step, out / step_name(step))
        print(step.name, "built" if built else "cached", parse_ptxas((out / step_name(step) / "_ptxas.txt").read_text()))
