"""The checks of python -m verify, each step's in a process of its own: `python -m pytest` with a time limit, its verdict
in words, several steps side by side, and the tests that concern no step beside them.

A hung kernel blocks its process in a CUDA call for good, and nothing inside that process can end it: only killing the
process frees the GPU. So each step's checks run in a process of their own, killed at the time limit; the step fails and
the run goes on with the next one.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from verify.log import log
from verify.steps import ROOT

TESTS = ROOT / "verify" / "tests"
# The step-free tests build every step for every target it has and run beside the steps' checks: on a GPU
# machine busy with those they took over 300 s (2026-12-01), so they get this many times a step's limit.
OTHERS_TIMEOUT_FACTOR = 3


def run_pytest(args: list[str], env: dict, timeout: float, junit: Path | None = None, log=log,
               stream: bool = True) -> tuple[str, str]:
    """`python -m pytest ARGS` in a process of its own, its output copied to the log, killed at `timeout` s.

    stream=False holds the output back and logs it in one piece at the end (for processes running side by
    side, whose lines would otherwise interleave).

    A hung kernel blocks its process in a CUDA call for good, and nothing inside that process can end it:
    only killing the process frees the GPU. The process gets its own process group so that its children
    (torch.compile's workers, subprocesses of the tests) go with it. Returns (verdict, pytest's last line).
    """
    cmd = [sys.executable, "-m", "pytest", *args, "-q", "-rfEs", "-p", "no:cacheprovider"]
    if junit:
        cmd.append(f"--junitxml={junit}")
    lines: list[str] = []

    def copy_output():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if stream:
                log(lines[-1])

    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    reader = threading.Thread(target=copy_output, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        # Kill the whole group: at the time limit; on Ctrl-C (the terminal's SIGINT does not reach another
        # session); and after a normal exit too, for children the tests left behind (one could hold a hung kernel).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing left in the group
            pass
        proc.wait()
    reader.join(timeout=10)  # a child that left the group could hold the pipe open: don't wait for it
    if not stream:
        log("\n".join(lines))
    last = next((ln for ln in reversed(lines) if ln.strip()), "")
    return verdict(rc, timeout), last


def verdict(rc: int | None, timeout: float) -> str:
    """A check process's exit status in words (pytest's exit codes; rc None = killed at the time limit)."""
    if rc is None:
        return f"FAILED (timed out after {timeout:g} s: a hung kernel?)"
    if rc == 0:
        return "passed"
    if rc == 5:
        return "not run (no tests selected)"
    if rc < 0:
        return f"FAILED (the test process died of {signal.Signals(-rc).name})"
    return "FAILED" if rc == 1 else f"FAILED (pytest exit code {rc})"


def check_steps(steps: list[str], timeout: float, junit_dir: Path | None = None, tests: Path = TESTS, log=log,
                jobs: int = 1) -> dict:
    """Each step's checks (the tests whose id names it) in a process of their own, `jobs` processes at a time
    (their output is then logged step by step as each finishes). Returns {step: verdict}."""
    def one(step):
        log(f"-- {step}: pytest -k {step} (time limit {timeout:g} s)")
        t0 = time.monotonic()
        env = {**os.environ, "FLASHLADDER_STEPS": step}
        verdict_, last = run_pytest([str(tests), "-k", step], env, timeout,
                                    junit_dir / f"{step}.xml" if junit_dir else None, log=log, stream=jobs == 1)
        log(f"-- {step}: {verdict_} ({time.monotonic() - t0:.0f} s; {last})")
        return step, verdict_

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return dict(pool.map(one, steps))


def check_others(steps: list[str], timeout: float, junit_dir: Path | None = None, tests: Path = TESTS, log=log,
                 stream: bool = True) -> str:
    """The tests that concern no single step (model, CLI, README, figures), once, in a process of their own."""
    log(f"-- other tests (time limit {timeout:g} s)")
    env = {**os.environ, "FLASHLADDER_STEPS": ",".join(steps)}
    outcome, last = run_pytest([str(tests), "-k", " and ".join(f"not {s}" for s in steps)], env, timeout,
                               junit_dir / "others.xml" if junit_dir else None, log=log, stream=stream)
    log(f"-- other tests: {outcome} ({last})")
    return outcome
