"""Find, build and import the steps. Every step under steps/ is found by glob, never by a hand-kept list."""
from __future__ import annotations

import importlib
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "common"))
import build_step  # noqa: E402  (common/build_step.py: the same build the wheels use)

DEV = ROOT / "build" / "dev"  # holds flashladder/stepNN/ packages; put first on sys.path


def all_steps() -> list[str]:
    return [build_step.step_name(d) for d in build_step.find_steps(ROOT)]


def select(names: str | None) -> list[str]:
    """'step01,step03' or '1,3' or '1-4' -> step names; None -> all."""
    steps = all_steps()
    if not names:
        return steps
    chosen = []
    for part in names.split(","):
        part = part.strip()
        lo, _, hi = part.partition("-")
        lo_i = int(lo.removeprefix("step"))
        hi_i = int(hi.removeprefix("step")) if hi else lo_i
        chosen += [s for s in steps if lo_i <= int(s[4:]) <= hi_i]
    if not chosen:
        raise SystemExit(f"no step matches {names!r}; steps: {', '.join(steps)}")
    return sorted(set(chosen))


def build(steps: list[str], jobs: int = 8, log=print) -> dict[str, dict]:
    """Compile the steps in parallel into build/dev. Returns {step: parsed ptxas report}."""
    dirs = {build_step.step_name(d): d for d in build_step.find_steps(ROOT)}

    def one(step):
        build_step.compile_step(dirs[step], DEV / "flashladder" / step)
        log(f"  built {step}")
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
