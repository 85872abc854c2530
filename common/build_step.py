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
        _binding/     the shared Python binding (common/binding/, a package: abi, checks, router, step)
        _kernel.so    kernel.cu compiled for the step's targets (TARGETS below), plain C ABI (common/flashladder.cuh)
        _ptxas.txt    the `ptxas -v` resource report, one block per architecture: registers, shared memory, spills
        LICENSE       the repository's license (MIT)

Which GPUs a step's library runs on is said once, in TARGETS: its kernel.cu names a row of it in one line,
`FLASHLADDER_TARGETS(<name>);` (none: sm90a_only), and the build makes of that row nvcc's -gencode flags and the
list the library exports (flashladder_archs(), checked by the binding against the GPU); the line compiles to
a static_assert that the build read it, so a declaration the build missed fails the compile.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

COMMON = Path(__file__).resolve().parent
ROOT = COMMON.parent  # the repository; in a step's unpacked sdist, the sdist's folder
STEPS = ROOT / "steps"
LICENSE = ROOT / "LICENSE"



@dataclass(frozen=True)
class Targets:
    """Where a build's code runs: machine code (SASS) compiled ahead for some GPUs, and PTX that the driver
    compiles at load for any GPU of its compute capability or later that has no SASS of its own here.

    `gencode` is nvcc's: (virtual architecture, the codes made from it), e.g. ("compute_80", ("sm_80", "compute_80")):
    SASS for sm_80 compiled from compute_80 PTX, and that PTX itself, embedded."""
    name: str
    gencode: tuple[tuple[str, tuple[str, ...]], ...]
    jit_only: bool = False  # ptx_only()'s variant of the row `name`

    def flags(self) -> list[str]:
        return [f"-gencode=arch={virtual},code=[{','.join(codes)}]" for virtual, codes in self.gencode]

    def sass(self) -> list[str]:
        """The architectures with SASS in the library, in order of compute capability: ["sm_80", ..., "sm_120"]."""
        return sorted((c for _, codes in self.gencode for c in codes if c.startswith("sm_")), key=arch_number)

    def ptx(self) -> list[str]:
        """The PTX embedded for the driver to compile: ["compute_80"]."""
        return sorted((c for _, codes in self.gencode for c in codes if c.startswith("compute_")), key=arch_number)

    def archs(self) -> list[str]:
        """What the library exports (flashladder_archs): its SASS, then its PTX."""
        return [*self.sass(), *self.ptx()]

    def ptx_source(self, code: str) -> str:
        """The virtual architecture `code` (an entry of archs()) was compiled from: "compute_80" for sm_86 here."""
        return next(virtual for virtual, codes in self.gencode if code in codes)

    def ptx_only(self) -> "Targets":
        """The same build without any SASS: the driver must compile the PTX at load, on every GPU (the PTX-JIT
        check: python -m verify --ptx-jit). Refused for targets that embed no PTX."""
        if not self.ptx():
            raise ValueError(f"targets {self.name} ({', '.join(self.archs())}) embed no PTX: there is nothing to JIT-compile")
        ptx = tuple((virtual, tuple(c for c in codes if c.startswith("compute_"))) for virtual, codes in self.gencode)
        return Targets(self.name, tuple((virtual, codes) for virtual, codes in ptx if codes), jit_only=True)


def arch_number(code: str) -> int:
    """'sm_90a' -> 90, 'compute_80' -> 80, 'sm_120' -> 120."""
    return int(re.fullmatch(r"(?:sm|compute)_(\d+)[af]?", code).group(1))


# The one source of truth for where a step runs. A kernel.cu names its row with FLASHLADDER_TARGETS(<name>);.
TARGETS = {t.name: t for t in (
    # wgmma, TMA, setmaxnreg: instructions of sm_90a, the "a" (architecture-specific) target, whose SASS runs on
    # sm_90 GPUs (H100, H200) alone; no PTX, since no other GPU could run it. The steps from step08 on, and the default.
    Targets("sm90a_only", (("compute_90a", ("sm_90a",)),)),
    # mma.sync, ldmatrix, cp.async: PTX of sm_80, which every GPU since Ampere runs. One compute_80 PTX is compiled
    # ahead into the SASS of A100 (sm_80), RTX 30xx (sm_86), RTX 40xx / L4 / L40 (sm_89), RTX 50xx (sm_120), and
    # embedded for the driver to compile on any other GPU (sm_87, sm_100, ...); sm_90a keeps its own SASS, compiled
    # from compute_90a exactly as in sm90a_only. (sm_120 from compute_120 PTX instead spills in step07: ptxas runs
    # out of registers by a few; from compute_80 it does not.) Steps 01-07.
    Targets("sm80_and_later", (("compute_80", ("sm_80", "sm_86", "sm_89", "sm_120", "compute_80")),
                               ("compute_90a", ("sm_90a",)))),
)}
DEFAULT_TARGETS = "sm90a_only"
ARCH_FLAGS = TARGETS[DEFAULT_TARGETS].flags()  # for the tests' small probe kernels: sm_90a, as the Hopper steps
NVCC_FLAGS = [
    "-O3", "-std=c++17", "-lineinfo",
    "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden",  # a plain shared library; exports are marked
    "-Xptxas", "-v",                                         # the resource report, kept as _ptxas.txt
    "-Xptxas", "-warn-spills",
    "--threads", "0",  # one architecture's cicc/ptxas beside the next (as many at once as there are CPUs)
    # No device-link step: a step is one translation unit without -rdc, so nvlink has nothing to link, and under
    # --threads its run for each architecture writes the same temporary registration file, a race that CI hit
    # ("nvlink fatal: Could not read file ..._dlink.reg.c").
    "-nodlink",
]
MIN_NVCC = (12, 8)
DECLARATION = re.compile(r"^[ \t]*FLASHLADDER_TARGETS\([ \t]*(\w*)[ \t]*\)[ \t]*;", re.M)


def targets_of(step_dir: Path) -> Targets:
    """The row of TARGETS that the step's kernel.cu names (FLASHLADDER_TARGETS(<name>);), else the default."""
    kernel = Path(step_dir) / "kernel.cu"
    names = DECLARATION.findall(kernel.read_text())
    if len(names) > 1:
        raise RuntimeError(f"{kernel}: FLASHLADDER_TARGETS(...) appears {len(names)} times; name the targets once")
    name = names[0] if names else DEFAULT_TARGETS
    if name not in TARGETS:
        raise RuntimeError(f"{kernel}: FLASHLADDER_TARGETS({name}) names no targets; common/build_step.py's TARGETS "
                           f"has {', '.join(TARGETS)}")
    return TARGETS[name]


def target_flags(targets: Targets) -> list[str]:
    """nvcc's flags for `targets`: the -gencode list, and what flashladder.cuh turns into the library's exports."""
    return [*targets.flags(), f'-DFLASHLADDER_ARCHS="{",".join(targets.archs())}"',
            f'-DFLASHLADDER_TARGETS_BUILT="{targets.name}"']


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
    """What a step's build takes from common/: the headers, the binding's modules, this script."""
    return [*sorted(COMMON.glob("*.cuh")), *sorted((COMMON / "binding").glob("*.py")), COMMON / "build_step.py"]


def _sources(step_dir: Path) -> list[Path]:
    return [step_dir / "kernel.cu", step_dir / "pkg" / "__init__.py", *common_files(), LICENSE]


def _fingerprint(step_dir: Path, nvcc: str, flags: list[str]) -> str:
    """What a build depends on: nvcc's path, version and flags, and every source file's name and bytes."""
    h = hashlib.sha256(" ".join([nvcc, *flags]).encode() + nvcc_version_text(nvcc).encode())
    for src in _sources(step_dir):
        h.update(src.name.encode() + src.read_bytes())
    return h.hexdigest()


def compile_step(step_dir: Path, pkg_out: Path, force: bool = False, extra_nvcc_flags: tuple[str, ...] = (),
                 ptx_only: bool = False) -> bool:
    """Build the step package into `pkg_out` (a folder named after the step), for the step's targets (targets_of).

    `extra_nvcc_flags` go after NVCC_FLAGS (e.g. ("-DFLASHLADDER_TRACE",) for verify.trace's build); they are
    part of the fingerprint, so a build with other flags into the same folder is never taken for current.
    `ptx_only` builds the targets' PTX alone (Targets.ptx_only: no SASS, the driver compiles it at load).
    Skips nvcc when nothing that goes into the build (sources, flags, nvcc's path and version) changed since
    the last build into pkg_out. Returns True if nvcc ran, False if the build there was current (cached).
    Raises RuntimeError with nvcc's output if the compile fails.
    """
    step_dir, pkg_out = Path(step_dir).resolve(), Path(pkg_out)
    if isinstance(extra_nvcc_flags, str):  # ("-DX") is a string, not a tuple: refuse it rather than split it
        raise TypeError(f"extra_nvcc_flags must be a sequence of flags, got the string {extra_nvcc_flags!r}")
    targets = targets_of(step_dir)
    if ptx_only:
        try:
            targets = targets.ptx_only()
        except ValueError as e:
            raise RuntimeError(f"{step_dir.name}: {e}") from None
    flags = [*NVCC_FLAGS, *target_flags(targets), *extra_nvcc_flags]
    nvcc = find_nvcc()
    if nvcc_version(nvcc) < MIN_NVCC:
        raise RuntimeError(f"{nvcc} is CUDA {nvcc_version(nvcc)}; flashladder needs nvcc >= 12.8 for sm_90a and sm_120")
    pkg_out.mkdir(parents=True, exist_ok=True)
    so, report, stamp = pkg_out / "_kernel.so", pkg_out / "_ptxas.txt", pkg_out / ".fingerprint"
    fp = _fingerprint(step_dir, nvcc, flags)
    if not force and so.exists() and report.exists() and stamp.exists() and stamp.read_text() == fp:
        return False
    shutil.copyfile(step_dir / "pkg" / "__init__.py", pkg_out / "__init__.py")
    (pkg_out / "_binding.py").unlink(missing_ok=True)  # the binding as one module, before it became a package
    shutil.rmtree(pkg_out / "_binding", ignore_errors=True)
    shutil.copytree(COMMON / "binding", pkg_out / "_binding", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(LICENSE, pkg_out / "LICENSE")
    cmd = [nvcc, *flags, f"-I{COMMON}", str(step_dir / "kernel.cu"), "-o", str(so)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        with_flags = f" (with {' '.join(extra_nvcc_flags)})" if extra_nvcc_flags else ""
        raise RuntimeError(f"nvcc failed for {step_dir.name}{with_flags}:\n$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    report.write_text(ptxas_report(proc.stdout + proc.stderr, targets))
    stamp.write_text(fp)
    return True


_ENTRY = re.compile(r"Compiling entry function '?([\w$]+)'? for '(\w+)'")
_FUNCTION = re.compile(r"Function properties for '?([\w$]+)'?")
_BLOCK_START = re.compile(r"^ptxas warning|^ptxas info\s*: \d+ bytes gmem")  # the first line of a ptxas run


def ptxas_report(output: str, targets: Targets) -> str:
    """nvcc's output, `ptxas -v`'s lines grouped by architecture (ptxas runs once per SASS architecture, side by
    side under --threads, each run naming its architecture on its 'Compiling entry function' lines), in the
    order of targets.sass(), each under a `== sm_XX ==` line; what is not ptxas's (host compiler warnings)
    first. A run's warnings come before its first info line, so a warning goes with the run that follows it."""
    other: list[str] = []
    blocks: dict[str, list[str]] = {}
    pending: list[str] = []  # lines of a run whose architecture is not known yet
    current = last = None
    for line in output.splitlines():
        if not line.startswith("ptxas") and not (line.startswith(" ") and (current is not None or pending)):
            other.append(line)
            continue
        if _BLOCK_START.search(line):
            current = None
        if current is None and (m := _ENTRY.search(line)):
            current = last = blocks.setdefault(m.group(2), [])
            current.extend(pending)
            pending = []
        (pending if current is None else current).append(line)
    if last is not None:  # lines after the last run (a warning ptxas printed at its end): that run's
        last.extend(pending)
        pending = []
    order = sorted(blocks, key=lambda a: (targets.sass().index(a) if a in targets.sass() else len(blocks), a))
    head = [f"# ptxas -v for {', '.join(order) or 'no SASS architecture'}"
            + (f"; embedded PTX, compiled by the driver at load: {', '.join(targets.ptx())}" if targets.ptx() else "")]
    body = [line for arch in order for line in (f"== {arch} ==", *blocks[arch])]
    return "\n".join([*head, *other, *pending, *body]) + "\n"


def parse_ptxas(text: str) -> dict:
    """The kernels' resources from a `ptxas -v` report, per architecture:
    {arch: {kernel: {registers, spill_stores, spill_loads, stack_frame, static_smem}}}. Warning lines are not read:
    the counts come from each function's own lines (a spill warning precedes the run it belongs to)."""
    archs: dict[str, dict[str, dict]] = {}
    current, arch = None, None
    for line in text.splitlines():
        if line.startswith("ptxas warning"):
            continue
        if m := _ENTRY.search(line):
            arch = m.group(2)
            current = archs.setdefault(arch, {}).setdefault(m.group(1), {})
            continue
        if (m := _FUNCTION.search(line)) and arch is not None:
            current = archs[arch].setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        for key, pat in (("stack_frame", r"(\d+) bytes stack frame"), ("spill_stores", r"(\d+) bytes spill stores"),
                         ("spill_loads", r"(\d+) bytes spill loads"), ("registers", r"Used (\d+) registers"),
                         ("static_smem", r"(\d+) bytes smem")):
            mm = re.search(pat, line)
            if mm:
                current[key] = int(mm.group(1))
    return {a: {_demangle(name): info for name, info in kernels.items() if info} for a, kernels in archs.items()}


def _demangle(name: str) -> str:
    """'_ZN..attention_fwd_kernelE9FwdParams' -> 'attention_fwd_kernel' (c++filt where there is one)."""
    tool = shutil.which("c++filt")
    if not tool or not name.startswith("_Z"):
        return name
    out = subprocess.run([tool, name], capture_output=True, text=True).stdout.strip() or name
    return re.sub(r"\(anonymous namespace\)::", "", out).split("(")[0]


def editable_install() -> bool:
    """Whether setup.py runs under one of PEP 660's hooks (pip install -e); pip calls the first before it resolves
    the step's dependencies, so a refusal here comes before any download."""
    import inspect
    return any(f.function in ("get_requires_for_build_editable", "prepare_metadata_for_build_editable", "build_editable")
               for f in inspect.stack())


def editable_refusal(name: str) -> str:
    return (f"flashladder-{name} cannot be installed in editable mode (pip install -e): its _kernel.so is compiled from "
            f"kernel.cu at install time. Use `pip install steps/{name}` (again after each edit), or `python -m verify`, "
            "which rebuilds what changed.")


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
    if editable_install():  # before pip resolves the step's dependencies (torch: gigabytes) only to refuse them
        sys.exit(editable_refusal(name))

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
            raise SetupError(editable_refusal(name))

    class SdistThatBuilds(sdist):
        """The sdist carries kernel.cu and what the build takes from common/, so it builds on its own."""
        def make_release_tree(self, base_dir, files):
            super().make_release_tree(base_dir, files)
            extras = {"kernel.cu": step_dir / "kernel.cu", "LICENSE": LICENSE,
                      **{f"common/{f.relative_to(COMMON).as_posix()}": f for f in common_files()}}
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
        print(step.name, "built" if built else "cached", f"for {', '.join(targets_of(step).archs())}:",
              parse_ptxas((out / step_name(step) / "_ptxas.txt").read_text()))
