"""Find, build and import the steps. Every step under steps/ is found by glob, never by a hand-kept list."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "common"))
import build_step  # noqa: E402  (common/build_step.py: the same build the wheels use)

PTX_JIT = "FLASHLADDER_PTX_JIT"  # =1: build and check the steps' portable PTX alone (python -m verify --ptx-jit)


def ptx_jit() -> bool:
    """FLASHLADDER_PTX_JIT=1: each step is built as its portable PTX alone, without SASS (build_step.Targets.ptx_only),
    into build/ptx-jit/, so that the driver compiles it when it loads it, on any GPU: the code a GPU newer than the
    build's SASS (or, with this build, any GPU) runs. python -m verify --ptx-jit sets it for its check processes."""
    return os.environ.get(PTX_JIT, "") not in ("", "0")


def dev_dir() -> Path:
    return ROOT / "build" / ("ptx-jit" if ptx_jit() else "dev")


DEV = dev_dir()  # holds flashladder/stepNN/ packages; put first on sys.path


def all_steps() -> list[str]:
    return [build_step.step_name(d) for d in build_step.find_steps(ROOT)]


def step_dir(step: str) -> Path:
    return next(d for d in build_step.find_steps(ROOT) if build_step.step_name(d) == step)


def targets(step: str) -> build_step.Targets:
    """What the step's build holds: its row of build_step.TARGETS, or that row's PTX alone under FLASHLADDER_PTX_JIT."""
    t = build_step.targets_of(step_dir(step))
    return t.ptx_only() if ptx_jit() else t


def portable_steps(steps: list[str] | None = None) -> list[str]:
    """Of `steps` (default: all), those whose library embeds PTX, which the driver compiles for GPUs without SASS of
    their own in it (steps 01-07: sm80_and_later)."""
    return [s for s in (steps or all_steps()) if build_step.targets_of(step_dir(s)).ptx()]


class SelectionError(ValueError):
    """A step selection (--steps, FLASHLADDER_STEPS) that names no step; the message says what is wrong."""


_PART = re.compile(r"(?:step)?(\d+)(?:-(?:step)?(\d+))?")  # 3, step03, 1-6, step01-step06


def select(names: str | None) -> list[str]:
    """'step01,step03' or '1,3' or '1-4' -> step names; None or '' -> all. Every part must name a step."""
    steps = all_steps()
    if not names:
        return steps
    chosen: set[str] = set()
    for part in (p.strip() for p in names.split(",")):
        m = _PART.fullmatch(part)
        if not m:
            raise SelectionError(f"cannot read {part!r} in {names!r}: give step numbers such as 3, 1-6, step03 or 2,5")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if lo > hi:
            raise SelectionError(f"the range {part!r} runs backwards: write it low-high")
        hit = [s for s in steps if lo <= int(s[4:]) <= hi]
        if not hit:
            raise SelectionError(f"no step matches {part!r}; the steps are {', '.join(steps)}")
        chosen.update(hit)
    return sorted(chosen)


def build(steps: list[str], jobs: int = 8, log=print) -> dict[str, dict]:
    """Compile the steps in parallel into build/dev. Returns {step: parsed ptxas report}."""
    dirs = {build_step.step_name(d): d for d in build_step.find_steps(ROOT)}

    def one(step):
        built = build_step.compile_step(dirs[step], DEV / "flashladder" / step, ptx_only=ptx_jit())
        log(f"  {'built' if built else 'cached'} {step}")
        return step, ptxas_of(step)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return dict(pool.map(one, steps))


def ptxas_of(name: str) -> dict:
    return build_step.parse_ptxas((DEV / "flashladder" / name / "_ptxas.txt").read_text())


def load(step: str):
    """Import the dev build of a step as flashladder.<step>."""
    if str(DEV) not in sys.path:
        sys.path.insert(0, str(DEV))
    return importlib.import_module(f"flashladder.{step}")


# Shared by the command lines (python -m verify, verify.once, verify.variants).

class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage is one --help away) with exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def steps_arg(text: str) -> list[str]:
    """argparse type for --steps."""
    try:
        return select(text)
    except SelectionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seqlens_arg(text: str) -> list[int]:
    """argparse type for --seqlens: '4096,16384' -> [4096, 16384]."""
    try:
        seqlens = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: give sequence lengths such as 4096,16384") from None
    if any(n <= 0 for n in seqlens):
        raise argparse.ArgumentTypeError(f"sequence lengths must be positive: {text!r}")
    return seqlens


def missing_modules_reason(names=("torch",)) -> str | None:
    """Which of the modules `names` this Python cannot import, said with what to do; None when it has them all."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    return f"{sys.executable} has no {', '.join(missing)}: pip install -r requirements-verify.txt" if missing else None


def no_gpu_reason() -> str | None:
    """Why the kernels cannot run on this machine, or None when they can."""
    if why := missing_modules_reason():
        return why
    import torch
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build; the kernels run on {GPUS} with a CUDA build of torch"
    if not torch.cuda.is_available():
        return f"torch sees no CUDA GPU on this machine; the kernels run on {GPUS}"
    return None


def numbers_in_words(steps: list[str]) -> str:
    """['step01', ..., 'step07'] -> 'steps 01-07'; ['step01', 'step03'] -> 'steps 01, 03'."""
    nums = [int(s[4:]) for s in steps]
    if len(nums) == 1:
        return f"step {nums[0]:02d}"
    if nums == list(range(nums[0], nums[-1] + 1)):
        return f"steps {nums[0]:02d}-{nums[-1]:02d}"
    return "steps " + ", ".join(f"{n:02d}" for n in nums)


def gpus_in_words() -> str:
    """Where the steps run, from their builds' targets: 'an H100/H200 (every step) or any GPU since Ampere, sm_80
    (steps 01-07)'."""
    portable = portable_steps()
    return "an H100/H200 (every step)" + (f" or any GPU since Ampere, sm_80 ({numbers_in_words(portable)})" if portable else "")


GPUS = gpus_in_words()


def unrunnable(steps: list[str], device) -> dict[str, str]:
    """The steps of `steps` whose built library holds no code for `device` (a binding.Device), each with why, in one
    line (the binding's own check, without a launch). Needs the steps built."""
    import binding  # common/binding/: needs torch
    out = {}
    for step in steps:
        lib = binding.load_library(DEV / "flashladder" / step / "_kernel.so")
        archs = lib.flashladder_archs().decode().split(",")
        smem = lib.flashladder_smem_bytes() if hasattr(lib, "flashladder_smem_bytes") else None
        try:
            binding.check_device(step, archs, smem, device, "this GPU")
        except RuntimeError as e:
            out[step] = str(e).removeprefix(f"flashladder.{step}: ")
    return out
