"""Find, build and import the steps. Every step under steps/ is found by glob, never by a hand-kept list."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "common"))
import build_step  # noqa: E402  (common/build_step.py: the same build the wheels use)

DEV = ROOT / "build" / "dev"  # holds flashladder/stepNN/ packages; put first on sys.path


def all_steps() -> list[str]:
    return [build_step.step_name(d) for d in build_step.find_steps(ROOT)]


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
        built = build_step.compile_step(dirs[step], DEV / "flashladder" / step)
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
        return f"torch {torch.__version__} is a CPU build; the kernels run on an H100/H200 with a CUDA build of torch"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU on this machine; the kernels run on an H100/H200"
    return None
