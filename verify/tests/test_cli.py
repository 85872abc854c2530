"""The command lines: bad input ends in one line, not a traceback; --out; a hung kernel fails its step in time.

`python -m verify` runs each step's checks in a process of its own and kills it at --check-timeout; the
tests below drive that machinery with fake test files (a check that sleeps, on the CPU; a CUDA kernel that
waits on an mbarrier phase nobody completes, verify/tests/fixtures/hang.cu, on the GPU).
"""
import ctypes
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from verify import __main__ as verify_main
from verify import steps as steps_mod
from verify.tests.conftest import has_cuda_gpu, needs_gpu

ROOT = steps_mod.ROOT
FIXTURES = Path(__file__).parent / "fixtures"
CLIS = {"verify": "python -m verify", "verify.once": "python -m verify.once", "verify.variants": "python -m verify.variants"}


def run_cli(module: str, *args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def assert_one_line_error(out, prog: str, *words):
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0, f"exit code 0 for a bad command line:\n{out.stdout}{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error:"), out.stderr
    for w in words:
        assert w in lines[-1], f"{w!r} not in {lines[-1]!r}"


def a_step_that_does_not_exist() -> str:
    return str(int(steps_mod.all_steps()[-1][4:]) + 1)


@pytest.mark.parametrize("module", CLIS)
@pytest.mark.parametrize("bad", ["abc", "missing"])
def test_bad_steps_is_a_one_line_error(module, bad):
    value = a_step_that_does_not_exist() if bad == "missing" else bad
    out = run_cli(module, "--steps", value)
    assert_one_line_error(out, CLIS[module], "--steps", repr(value))


@pytest.mark.parametrize("module", ["verify.once", "verify.variants"])
def test_without_a_gpu_is_a_one_line_error(module, tmp_path):
    """CUDA_VISIBLE_DEVICES='' hides the GPU, so this also runs (and must pass) on the GPU machine."""
    (tmp_path / "kernel.cu").write_text("// never built: the GPU check comes first\n")
    args = ["--steps", "1"] if module == "verify.once" else [str(tmp_path)]
    out = run_cli(module, *args, env={"CUDA_VISIBLE_DEVICES": ""})
    assert_one_line_error(out, CLIS[module], "H100/H200")


def test_check_steps_a_hung_step_is_killed_and_the_next_step_runs(tmp_path, monkeypatch):
    """A check that never returns (as a hung kernel doesn't) fails its step at the limit; its children die
    with it; the steps before and after it get their own verdicts."""
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("FLASHLADDER_TEST_CHILD_PID", str(pid_file))
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_fake.py").write_text(textwrap.dedent("""
        import os, subprocess, sys, time
        import pytest

        @pytest.mark.parametrize("step", ["step41", "step42", "step43"])
        def test_kernel(step):
            assert step != "step41", "a wrong result"
            if step == "step42":
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
                with open(os.environ["FLASHLADDER_TEST_CHILD_PID"], "w") as f:
                    f.write(str(child.pid))
                time.sleep(3600)
    """))
    limit, lines = 20, []  # the passing step must start pytest within it on a machine busy with other checks
    t0 = time.monotonic()
    verdicts = verify_main.check_steps(["step41", "step42", "step43"], limit, tests=tests, log=lines.append)
    elapsed = time.monotonic() - t0
    log = "\n".join(lines)
    assert verdicts["step41"] == "FAILED", log
    assert verdicts["step42"] == verify_main.verdict(None, limit), log
    assert verdicts["step42"].startswith(f"FAILED (timed out after {limit} s"), log
    assert verdicts["step43"] == "passed", log
    assert elapsed < limit + 60, f"the hung step was not stopped at its {limit} s limit: {elapsed:.0f} s in all"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "\nState:\tZ" not in Path(f"/proc/{child}/status").read_text():
        assert time.monotonic() < deadline, f"the hung check's child process {child} outlived it"
        time.sleep(0.1)


def test_verdicts_of_exit_codes():
    assert verify_main.verdict(0, 1) == "passed"
    assert verify_main.verdict(1, 1) == "FAILED"
    for rc in (None, 2, 3, 4, -9):
        assert verify_main.verdict(rc, 1).startswith("FAILED ("), rc
    assert verify_main.verdict(5, 1).startswith("not run")


@pytest.mark.parametrize("outcome", ["pass", "fail"])
def test_verify_writes_to_out(tmp_path, outcome):
    """--out DIR gets verify.log and the junit XML of every check process; a failed step gives exit code 1."""
    step = steps_mod.all_steps()[0]
    tests, out = tmp_path / "tests", tmp_path / "out"
    tests.mkdir()
    (tests / "test_fake.py").write_text(textwrap.dedent(f"""
        import pytest

        @pytest.mark.parametrize("step", [{step!r}])
        def test_kernel(step):
            assert {outcome == "pass"}, "a wrong result"

        def test_not_about_one_step():
            pass
    """))
    res = run_cli("verify", "--steps", step, "--no-bench", "--tests", str(tests), "--out", str(out))
    log = (out / "verify.log").read_text()
    assert res.stdout.strip() == log.strip(), "verify.log differs from what the run printed"
    expect = "passed" if outcome == "pass" else "FAILED"
    assert f"-- {step}: {expect}" in log, log
    assert res.returncode == (0 if outcome == "pass" else 1), log
    for name, n_tests in ((step, 1), ("others", 1)):
        xml = (out / "checks" / f"{name}.xml").read_text()
        assert f'tests="{n_tests}"' in xml, xml


@pytest.fixture(scope="session")
def hang_so(tmp_path_factory):
    """verify/tests/fixtures/hang.cu as a ctypes library (nvcc, sm_90a; no GPU needed to build it)."""
    so = tmp_path_factory.mktemp("hang") / "hang.so"
    cmd = [steps_mod.build_step.find_nvcc(), "-std=c++17", *steps_mod.build_step.ARCH_FLAGS, "-shared",
           "-Xcompiler", "-fPIC", str(FIXTURES / "hang.cu"), "-o", str(so)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"$ {' '.join(cmd)}\n{res.stdout}{res.stderr}"
    return so


def test_hang_fixture_builds(hang_so):
    lib = ctypes.CDLL(str(hang_so))
    if not has_cuda_gpu():  # on a GPU this call would never return
        assert lib.launch_and_wait() != 0, "no GPU here: launching must return a CUDA error code"


@needs_gpu
def test_a_hung_kernel_fails_its_check_in_time(hang_so, tmp_path):
    """The real thing: a kernel that never finishes, in a check process that must be killed at the limit,
    after which the GPU is free for the next step."""
    (tmp_path / "test_hang.py").write_text(textwrap.dedent(f"""
        import ctypes

        def test_kernel_step42():
            assert ctypes.CDLL({str(hang_so)!r}).launch_and_wait() == 0, "the hanging kernel did not launch"
    """))
    limit, lines = 15, []
    t0 = time.monotonic()
    verdicts = verify_main.check_steps(["step42"], limit, tests=tmp_path, log=lines.append)
    elapsed = time.monotonic() - t0
    assert verdicts["step42"].startswith("FAILED (timed out"), "\n".join(lines)
    assert elapsed < limit + 60, f"{elapsed:.0f} s for a {limit} s limit"
    after = subprocess.run([sys.executable, "-c", "import torch; x = torch.ones(8, device='cuda'); "
                            "assert (x + x).sum().item() == 2 * x.numel()"], capture_output=True, text=True, timeout=120)
    assert after.returncode == 0, f"the GPU is not usable after the hung process was killed:\n{after.stderr}"


WATCHED = "import sys, time; from verify.once import watchdog; t = watchdog('step42', {limit}); {body}"


@pytest.mark.parametrize("cancel", [False, True], ids=["expires", "cancelled"])
def test_once_watchdog(cancel):
    """verify.once's per-step limit ends a process that is stuck (here: asleep), and only such a process."""
    limit = 1
    body = "t.cancel(); time.sleep(3 * {limit}); print('finished')" if cancel else "time.sleep(3600)"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", WATCHED.format(limit=limit, body=body.format(limit=limit))], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    if cancel:
        assert out.returncode == 0 and "finished" in out.stdout, out.stdout + out.stderr
    else:
        assert out.returncode == 1 and f"step42: FAILED (timed out after {limit} s" in out.stdout, out.stdout + out.stderr
        assert time.monotonic() - t0 < limit + 60


@needs_gpu
def test_once_watchdog_ends_a_hung_kernel(hang_so):
    limit = 10
    body = f"import ctypes; sys.exit(ctypes.CDLL({str(hang_so)!r}).launch_and_wait())"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", WATCHED.format(limit=limit, body=body)], cwd=ROOT,
                         capture_output=True, text=True, timeout=limit + 120)
    assert out.returncode == 1 and f"step42: FAILED (timed out after {limit} s" in out.stdout, out.stdout + out.stderr
    assert time.monotonic() - t0 < limit + 60


def test_variants_table_cell_shows_clock_power_and_rate_per_ghz():
    from verify.variants import cell_text
    full = cell_text({"tflops": 660.4, "sm_mhz_median": 1695.0, "power_w_median": 686.5})
    assert full.split() == ["660.4", "TF", "1695", "MHz", "686", "W", "389.6/GHz"]
    bare = cell_text({"tflops": 660.4, "sm_mhz_median": None, "power_w_median": None})
    assert bare.split() == ["660.4", "TF", "-"] and len(bare) == len(full)
