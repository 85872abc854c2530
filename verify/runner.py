"""The checks of python -m verify, each step's in a process of its own: `python -m pytest` with a time limit, its verdict
in words, several steps side by side, and the tests that concern no step beside them; what they skipped, each reason
said once; how many steps are checked and about how long the rest takes.

A hung kernel blocks its process in a CUDA call for good, and nothing inside that process can end it: only killing the
process frees the GPU. So each step's checks run in a process of their own, killed at the time limit; the step fails and
the run goes on with the next one.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from verify import steps as steps_mod
from verify.log import log
from verify.steps import ROOT

TESTS = ROOT / "verify" / "tests"
# The step-free tests build every step for every target it has and run beside the steps' checks: on a GPU
# machine busy with those they took over 300 s (2026-12-01), so they get this many times a step's limit.
OTHERS_TIMEOUT_FACTOR = 3
SKIPPED = re.compile(r"^SKIPPED \[(\d+)\] [^ ]+?:\d+: (.*)$")  # pytest -rs: one line per reason and place, with a count


def run_pytest(args: list[str], env: dict, timeout: float, junit: Path | None = None, log=log, stream: bool = True,
               transcript: Path | None = None) -> tuple[str, list[str]]:
    """`python -m pytest ARGS` in a process of its own, killed at `timeout` s. Returns (verdict, its output's lines).

    stream=True copies each line to the log as it comes (but pytest's lines of skip reasons, which the caller says once:
    Skips); stream=False logs nothing (the caller decides what of the output to show: processes run side by side,
    whose lines would otherwise interleave). `transcript`: a file that gets the whole output.

    A hung kernel blocks its process in a CUDA call for good, and nothing inside that process can end it:
    only killing the process frees the GPU. The process gets its own process group so that its children
    (torch.compile's workers, subprocesses of the tests) go with it.
    """
    cmd = [sys.executable, "-m", "pytest", *args, "-q", "-rfEs", "-p", "no:cacheprovider"]
    if junit:
        cmd.append(f"--junitxml={junit}")
    lines: list[str] = []

    def copy_output():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if stream and not SKIPPED.match(lines[-1]):
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
    if transcript:
        transcript.write_text("\n".join(lines) + "\n")
    return verdict(rc, timeout), lines


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


def last_line(lines: list[str]) -> str:
    """pytest's last words: '72 passed, 13 skipped in 25.13s'."""
    return next((ln.strip(" =") for ln in reversed(lines) if ln.strip()), "")


def shown(verdict_: str, lines: list[str]) -> list[str]:
    """What of a check process's output the log shows once it ended: nothing of one that passed (its verdict says it;
    --out keeps every line), all of one that did not but its lines of skip reasons (said once for all: Skips)."""
    return [] if not verdict_.startswith("FAILED") else [ln for ln in lines if not SKIPPED.match(ln)]


class Skips:
    """The reasons the check processes skipped tests for, gathered from pytest's `SKIPPED [n] file:line: reason`
    lines, to be said once each (lines()) rather than once per step: 20 steps on a machine without a GPU skip the same
    kernel checks for the same reason 20 times. A step's name in a reason is read as "the step", so that a reason that
    names the step (e.g. "step03 has one tiling") counts for every step that gives it."""

    def __init__(self):
        self.counts: dict[str, dict[str, int]] = {}  # reason -> {step or "other tests": tests skipped}
        self.lock = threading.Lock()

    def add(self, who: str, lines: list[str]) -> None:
        with self.lock:
            for line in lines:
                if m := SKIPPED.match(line):
                    reason = m[2].replace(who, "the step") if who.startswith("step") else m[2]
                    by = self.counts.setdefault(reason, {})
                    by[who] = by.get(who, 0) + int(m[1])

    def lines(self) -> list[str]:
        """One line per reason, the most tests first: how many, of which steps (or the other tests), and why."""
        out = []
        for reason, by in sorted(self.counts.items(), key=lambda kv: -sum(kv[1].values())):
            steps = sorted(w for w in by if w.startswith("step"))
            whose = [steps_mod.numbers_in_words(steps)] if steps else []
            whose += [w for w in by if not w.startswith("step")]
            out.append(f"  skipped {sum(by.values())} test{'s' * (sum(by.values()) != 1)} ({' and '.join(whose)}): {reason}")
        return out


class Progress:
    """How many of the steps' check processes ended, and about how long the rest takes: each step expected to take
    what it took in the last run here (times_file()), or, for a step without one, the mean of the steps done so far; the
    steps still waiting dealt to the `jobs` processes as they free up, as the pool deals them."""

    def __init__(self, steps: list[str], jobs: int, last: dict[str, float] | None = None, clock=time.monotonic):
        self.steps, self.jobs, self.last, self.clock = list(steps), max(1, jobs), dict(last or {}), clock
        self.started: dict[str, float] = {}
        self.took: dict[str, float] = {}
        self.lock = threading.Lock()

    def start(self, step: str) -> None:
        with self.lock:
            self.started[step] = self.clock()

    def finish(self, step: str) -> float:
        """Records the step's end; returns its seconds."""
        with self.lock:
            self.took[step] = self.clock() - self.started[step]
            return self.took[step]

    def expected(self, step: str) -> float | None:
        if step in self.last:
            return self.last[step]
        return sum(self.took.values()) / len(self.took) if self.took else None

    def left_s(self) -> float | None:
        """Seconds until the last step's checks end, as far as can be told now; None before anything tells."""
        with self.lock:
            now = self.clock()
            running = [s for s in self.started if s not in self.took]
            waiting = [s for s in self.steps if s not in self.started]
            if any(self.expected(s) is None for s in running + waiting):
                return None
            slots = sorted(max(0.0, self.expected(s) - (now - self.started[s])) for s in running)
            slots = (slots + [0.0] * self.jobs)[:max(self.jobs, len(slots))]
            for s in waiting:  # the pool hands the next step to the first process that frees up
                slots.sort()
                slots[0] += self.expected(s)
            return max(slots, default=0.0)

    def words(self) -> str:
        """'3 of 20 steps checked, about 9 min left'."""
        left = self.left_s()
        done = f"{len(self.took)} of {len(self.steps)} step{'s' * (len(self.steps) != 1)} checked"
        if left is None or len(self.took) == len(self.steps):
            return done
        return f"{done}, about {minutes(left)} left"


def minutes(seconds: float) -> str:
    """'40 s', '3 min'; 'a few seconds' under 5 (a step that runs past its expected time leaves an estimate of 0)."""
    return "a few seconds" if seconds < 5 else f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def times_file() -> Path:
    """Where the seconds of each step's checks in the last run here are kept, for the next run's estimate: beside the
    builds they checked (build/dev/, or build/ptx-jit/ for --ptx-jit)."""
    return steps_mod.DEV / "check-times.json"


def load_times(path: Path) -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def save_times(took: dict[str, float], path: Path) -> None:
    """This run's seconds per step, over the last runs' (a step checked again keeps its newest time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**load_times(path), **{k: round(v, 1) for k, v in took.items()}}, indent=1))
    except OSError:  # a read-only checkout: no estimate next time, nothing worse
        pass


def step_selection(step: str, gpu_only: bool) -> str:
    """pytest -k of a step's process: the tests whose id names the step; with gpu_only, those of them that need the GPU
    (conftest.py gives them the keyword on_gpu), its kernel checks."""
    return f"{step} and on_gpu" if gpu_only else step


def others_selection(steps: list[str], gpu_only: bool) -> str:
    """pytest -k of the process beside the steps': every test the steps' processes do not run."""
    if gpu_only:
        return f"not (on_gpu and ({' or '.join(steps)}))"
    return " and ".join(f"not {s}" for s in steps)


def check_steps(steps: list[str], timeout: float, junit_dir: Path | None = None, tests: Path = TESTS, log=log,
                jobs: int = 1, skips: Skips | None = None, times: Path | None = None, gpu_only: bool = False) -> dict:
    """Each step's checks (the tests whose id names it; gpu_only: those of them that need the GPU, its kernel checks,
    the others running beside: check_others) in a process of their own, `jobs` processes at a time. Each
    step's end is logged with its verdict, how many steps are done and about how long the rest takes (from `times`, a
    file of the last run's seconds per step, which this run's then update; and from the steps done so far); the
    output of a step that failed is logged after it (jobs=1: every line as it comes). The skip reasons are said once
    for all steps: into `skips`, or, without it, at the end. With junit_dir, each step's junit XML and whole output
    (<step>.xml, <step>.txt) are written there. Returns {step: verdict}."""
    own_skips = skips is None
    skips = Skips() if own_skips else skips
    progress = Progress(steps, jobs, load_times(times) if times else {})
    if (left := progress.left_s()) is not None:
        log(f"  the last run's times here: about {minutes(left)} for these checks, {max(1, jobs)} at a time")

    def one(step):
        log(f"-- {step}: pytest -k '{step_selection(step, gpu_only)}' (time limit {timeout:g} s)")
        progress.start(step)
        env = {**os.environ, "FLASHLADDER_STEPS": step}
        verdict_, lines = run_pytest([str(tests), "-k", step_selection(step, gpu_only)], env, timeout,
                                     junit_dir / f"{step}.xml" if junit_dir else None, log=log, stream=jobs == 1,
                                     transcript=junit_dir / f"{step}.txt" if junit_dir else None)
        seconds = progress.finish(step)
        skips.add(step, lines)
        log("\n".join([*(shown(verdict_, lines) if jobs != 1 else []),
                       f"-- {step}: {verdict_} ({seconds:.0f} s; {last_line(lines)}) [{progress.words()}]"]))
        return step, verdict_

    # The longest first where the last run's times say which (the last to start then is a short one); else in order.
    order = sorted(steps, key=lambda s: -progress.last[s]) if all(s in progress.last for s in steps) else steps
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        verdicts = dict(pool.map(one, order))
    verdicts = {s: verdicts[s] for s in steps}
    if times:
        save_times({s: progress.took[s] for s, v in verdicts.items() if v == "passed"}, times)
    if own_skips:
        for line in skips.lines():
            log(line)
    return verdicts


def others_jobs() -> int:
    """Processes for the tests beside the steps' (a test file each): a quarter of the CPUs (4 on a 16-core GPU host), the
    rest left to the steps' processes and to the nvcc builds some of these tests make."""
    return max(1, (os.cpu_count() or 1) // 4)


def check_others(steps: list[str], timeout: float, junit_dir: Path | None = None, tests: Path = TESTS, log=log,
                 stream: bool = True, skips: Skips | None = None, gpu_only: bool = False, jobs: int = 1) -> str:
    """The tests that concern no single step (model, CLI, README, figures), and with gpu_only the tests of every step
    that need no GPU (its build, SASS, trace points, bad input), once: in one process, or with jobs > 1 one process per
    test file, `jobs` at a time (their verdicts said as one; the output of one that failed logged after it). Their skip
    reasons go to `skips` (without it: are logged after them)."""
    files = sorted(tests.glob("test_*.py")) if jobs > 1 and tests.is_dir() else []
    groups = {f"others-{f.stem}": f for f in files} or {"others": tests}
    log(f"-- other tests (time limit {timeout:g} s" + (f" a file, {len(groups)} files, {jobs} at a time)" if files else ")"))
    env = {**os.environ, "FLASHLADDER_STEPS": ",".join(steps)}
    t0 = time.monotonic()
    own = Skips() if skips is None else skips

    def one(item):
        name, path = item
        outcome, lines = run_pytest([str(path), "-k", others_selection(steps, gpu_only)], env, timeout,
                                    junit_dir / f"{name}.xml" if junit_dir else None, log=log, stream=stream and not files,
                                    transcript=junit_dir / f"{name}.txt" if junit_dir else None)
        own.add("other tests", lines)
        if files and outcome.startswith("FAILED"):
            log("\n".join([*shown(outcome, lines), f"-- other tests, {path.name}: {outcome} ({last_line(lines)})"]))
        return outcome, lines

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(one, groups.items()))
    outcomes = [o for o, _ in results if not o.startswith("not run")] or [results[0][0]]
    outcome = next((o for o in outcomes if o.startswith("FAILED")), outcomes[0])
    summary = last_line(results[0][1]) if not files else counts_in_words(last_line(lines) for _, lines in results)
    log("\n".join([*(shown(outcome, results[0][1]) if not stream and not files else []),
                   f"-- other tests: {outcome} ({time.monotonic() - t0:.0f} s; {summary})",
                   *(own.lines() if skips is None else [])]))
    return outcome


def counts_in_words(last_lines) -> str:
    """pytest's last lines of several processes as one: '1021 passed, 230 skipped, 2 failed' (summed)."""
    total: dict[str, int] = {}
    for line in last_lines:
        for n, what in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)\b", line):
            what = "errors" if what.startswith("error") else what
            total[what] = total.get(what, 0) + int(n)
    return ", ".join(f"{n} {what}" for what, n in total.items()) or "no tests"
