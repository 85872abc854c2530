"""Build glue shared by every step: compile a step's kernel.cu with nvcc into a ctypes-loadable .so.

Used twice, always the same way:
  * by each step's setup.py (``pip install steps/stepNN``), which puts the built package in the wheel;
  * by ``verify`` (``python -m verify``, the tests), which builds every step into ``build/dev/``.

Pure standard library: no torch, no numpy. A built step package is a directory

    flashladder/stepNN/
        __init__.py   the step's tiny binding (steps/stepNN/pkg/__init__.py)
        _binding.py   the shared Python binding (common/binding.py)
        _kernel.so    kernel.cu compiled for sm_90a, plain C ABI (common/flashladder.cuh)
        _ptxas.txt    the `ptxas -v` resource report: registers, shared memory, spills
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

COMMON = Path(__file__).resolve().parent
ROOT = COMMON.parent
STEPS = ROOT / "steps"

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


def nvcc_version(nvcc: str) -> tuple[int, int]:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot read the version of {nvcc}:\n{out}")
    return int(m.group(1)), int(m.group(2))


def _sources(step_dir: Path) -> list[Path]:
    return [step_dir / "kernel.cu", step_dir / "pkg" / "__init__.py",
            *sorted(COMMON.glob("*.cuh")), COMMON / "binding.py", Path(__file__).resolve()]


def _fingerprint(step_dir: Path, nvcc: str) -> str:
    h = hashlib.sha256(" ".join([nvcc, *NVCC_FLAGS]).encode())
    for src in _sources(step_dir):
        h.update(src.name.encode() + src.read_bytes())
    return h.hexdigest()


def compile_step(step_dir: Path, pkg_out: Path, force: bool = False) -> Path:
    """Build the step package into `pkg_out` (a folder named after the step). Returns _kernel.so.

    Skips nvcc when nothing that goes into the build changed since the last build into pkg_out.
    Raises RuntimeError with nvcc's output if the compile fails.
    """
    step_dir, pkg_out = Path(step_dir).resolve(), Path(pkg_out)
    nvcc = find_nvcc()
    if nvcc_version(nvcc) < MIN_NVCC:
        raise RuntimeError(f"{nvcc} is CUDA {nvcc_version(nvcc)}; flashladder needs nvcc >= 12.8 for sm_90a")
    pkg_out.mkdir(parents=True, exist_ok=True)
    so, report, stamp = pkg_out / "_kernel.so", pkg_out / "_ptxas.txt", pkg_out / ".fingerprint"
    fp = _fingerprint(step_dir, nvcc)
    if not force and so.exists() and report.exists() and stamp.exists() and stamp.read_text() == fp:
        return so
    shutil.copyfile(step_dir / "pkg" / "__init__.py", pkg_out / "__init__.py")
    shutil.copyfile(COMMON / "binding.py", pkg_out / "_binding.py")
    cmd = [nvcc, *NVCC_FLAGS, f"-I{COMMON}", str(step_dir / "kernel.cu"), "-o", str(so)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {step_dir.name}:\n$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    report.write_text(proc.stdout + proc.stderr)
    stamp.write_text(fp)
    return so


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
    from setuptools.command.build_py import build_py

    step_dir = Path(step_dir).resolve()
    name = step_name(step_dir)

    class BuildWithNvcc(build_py):
        def run(self):
            compile_step(step_dir, Path(self.build_lib) / "flashladder" / name, force=True)
            (Path(self.build_lib) / "flashladder" / name / ".fingerprint").unlink()

    class BinaryDistribution(Distribution):  # the wheel carries a compiled library: platform-specific tag
        def has_ext_modules(self):
            return True

    setup(packages=[f"flashladder.{name}"], package_dir={f"flashladder.{name}": "pkg"},
          cmdclass={"build_py": BuildWithNvcc}, distclass=BinaryDistribution)


if __name__ == "__main__":  # python common/build_step.py [out_dir]: build every step, print the report
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "dev" / "flashladder"
    for step in find_steps():
        compile_step(step, out / step_name(step))
        print(step.name, parse_ptxas((out / step_name(step) / "_ptxas.txt").read_text()))
