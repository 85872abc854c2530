"""The command lines: bad input ends in one line, not a traceback, and so does a missing torch or GPU, before any
build; --out; the stage labels; a hung kernel fails its step in time; `nox -s verify` runs where the CUDA torch is.

`python -m verify` runs each step's checks in a process of its own and kills it at --check-timeout; the
tests below drive that machinery with fake test files (a check that sleeps, on the CPU; a CUDA kernel that
waits on an mbarrier phase nobody completes, verify/tests/fixtures/hang.cu, on the GPU).
"""
import argparse
import ctypes
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from verify import __main__ as verify_main
from verify import machine, runner
from verify import steps as steps_mod
from verify.tests.conftest import has_cuda_gpu, needs_gpu

ROOT = steps_mod.ROOT
FIXTURES = Path(__file__).parent / "fixtures"
CLIS = {"verify": "python -m verify", "verify.once": "python -m verify.once", "verify.variants": "python -m verify.variants"}


def run_cli(module: str, *args, env=None, timeout=600, python=(sys.executable,)):
    return subprocess.run([*python, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


NO_SITE_PACKAGES = (sys.executable, "-S")  # this Python without its installed packages: no torch, no numpy, ...


def assert_one_line_error(out, prog: str, *words):
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0, f"exit code 0 for a bad command line:\n{out.stdout}{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error:"), out.stderr
    for w in words:
        assert w in lines[-1], f"{w!r} not in {lines[-1]!r}"


def a_step_that_exists() -> str:
    return steps_mod.all_steps()[0]  # the quickest to compile


def a_step_that_does_not_exist() -> str:
    return str(int(steps_mod.all_steps()[-1][4:]) + 1)


@pytest.mark.parametrize("module", CLIS)
@pytest.mark.parametrize("bad", ["abc", "missing"])
def test_bad_steps_is_a_one_line_error(module, bad):
    value = a_step_that_does_not_exist() if bad == "missing" else bad
    out = run_cli(module, "--steps", value)
    assert_one_line_error(out, CLIS[module], "--steps", repr(value))


def cli_args(module: str, tmp_path: Path) -> list[str]:
    """A command line that would build and run a step (verify.variants: a kernel that must never be built)."""
    (tmp_path / "kernel.cu").write_text("// never built: the GPU check comes first\n")
    return [str(tmp_path)] if module == "verify.variants" else ["--steps", a_step_that_exists()]


@pytest.mark.parametrize("module", CLIS)
def test_without_a_gpu_is_a_one_line_error_before_any_build(module, tmp_path):
    """CUDA_VISIBLE_DEVICES='' hides the GPU, so this also runs (and must pass) on the GPU machine."""
    out = run_cli(module, *cli_args(module, tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})
    assert_one_line_error(out, CLIS[module], "H100/H200")
    assert out.stdout == "", f"printed before the error (a build?):\n{out.stdout}"


@pytest.mark.parametrize("module", CLIS)
def test_without_torch_is_a_one_line_error_before_any_build(module, tmp_path):
    out = run_cli(module, *cli_args(module, tmp_path), python=NO_SITE_PACKAGES)
    assert_one_line_error(out, CLIS[module], "has no torch", "pip install -r requirements-verify.txt")
    assert out.stdout == "", f"printed before the error (a build?):\n{out.stdout}"


def test_verify_names_every_missing_requirement():
    out = run_cli("verify", "--steps", a_step_that_exists(), "--no-bench", python=NO_SITE_PACKAGES)
    assert_one_line_error(out, CLIS["verify"], "has no " + ", ".join(verify_main.NEEDS) + ":")


def test_verify_without_a_gpu_and_no_bench_says_so_first_then_builds_and_checks(tmp_path):
    step = a_step_that_exists()
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_fake.py").write_text(f"def test_kernel_{step}():\n    pass\n")
    out = run_cli("verify", "--steps", step, "--no-bench", "--tests", str(tests), env={"CUDA_VISIBLE_DEVICES": ""})
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout + out.stderr
    assert lines[0].startswith("python -m verify: ") and lines[0].endswith(": the checks that need a GPU are skipped"), lines[0]
    assert "H100/H200" in lines[0]
    labels = [ln.split()[0] for ln in lines if ln.startswith("[")]
    assert labels == ["[1/2]", "[2/2]"], out.stdout
    assert f"[2/2] checking 1 step(s) ({tests})" in out.stdout, out.stdout


@pytest.mark.parametrize("no_checks, no_bench, labels", [
    (False, False, {"build": "[1/4]", "checks": "[2/4]", "bench": "[3/4]", "write": "[4/4]"}),
    (True, False, {"build": "[1/3]", "bench": "[2/3]", "write": "[3/3]"}),
    (False, True, {"build": "[1/2]", "checks": "[2/2]"}),
    (True, True, {"build": "[1/1]"}),
])
def test_stage_labels_count_the_stages_that_run(no_checks, no_bench, labels):
    assert verify_main.stage_labels(argparse.Namespace(no_checks=no_checks, no_bench=no_bench)) == labels


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
    verdicts = runner.check_steps(["step41", "step42", "step43"], limit, tests=tests, log=lines.append)
    elapsed = time.monotonic() - t0
    log = "\n".join(lines)
    assert verdicts["step41"] == "FAILED", log
    assert verdicts["step42"] == runner.verdict(None, limit), log
    assert verdicts["step42"].startswith(f"FAILED (timed out after {limit} s"), log
    assert verdicts["step43"] == "passed", log
    assert elapsed < limit + 60, f"the hung step was not stopped at its {limit} s limit: {elapsed:.0f} s in all"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "\nState:\tZ" not in Path(f"/proc/{child}/status").read_text():
        assert time.monotonic() < deadline, f"the hung check's child process {child} outlived it"
        time.sleep(0.1)


def test_verdicts_of_exit_codes():
    assert runner.verdict(0, 1) == "passed"
    assert runner.verdict(1, 1) == "FAILED"
    for rc in (None, 2, 3, 4, -9):
        assert runner.verdict(rc, 1).startswith("FAILED ("), rc
    assert runner.verdict(5, 1).startswith("not run")


def test_a_skip_reason_is_said_once_for_every_step_that_gives_it(tmp_path):
    """Steps that skip tests for one reason (no GPU here) get one line for it, not one each; a reason that names its
    step counts for each step that gives it; a step that passed shows its verdict alone, one that failed its output."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_fake.py").write_text(textwrap.dedent("""
        import pytest

        STEPS = ["step01", "step02", "step03"]

        @pytest.mark.parametrize("step", STEPS)
        @pytest.mark.parametrize("shape", [1, 2])
        def test_kernel(step, shape):
            pytest.skip("no CUDA GPU on this machine")

        @pytest.mark.parametrize("step", STEPS)
        def test_tiling(step):
            if step != "step03":
                pytest.skip(f"{step} has one tiling")

        @pytest.mark.parametrize("step", STEPS)
        def test_result(step):
            assert step != "step02", "a wrong result"
    """))
    lines = []
    verdicts = runner.check_steps(["step01", "step02", "step03"], 120, tests=tests, log=lines.append, jobs=2)
    log = "\n".join(lines).splitlines()
    assert verdicts == {"step01": "passed", "step02": "FAILED", "step03": "passed"}, log
    assert [ln for ln in log if "no CUDA GPU" in ln] == ["  skipped 6 tests (steps 01-03): no CUDA GPU on this machine"], log
    assert [ln for ln in log if "one tiling" in ln] == ["  skipped 2 tests (steps 01-02): the step has one tiling"], log
    assert not [ln for ln in log if ln.startswith("SKIPPED")], log
    assert any("a wrong result" in ln for ln in log), "the failed step's output is not shown"
    for step in ("step01", "step03"):
        assert [ln for ln in log if step in ln and not ln.startswith("-- ")] == [], f"{step} passed: its verdict alone"
    ends = [ln for ln in log if ln.startswith("-- step0") and "pytest -k" not in ln]
    assert len(ends) == 3 and ends[-1].endswith("[3 of 3 steps checked]"), ends
    assert any("of 3 steps checked, about" in ln for ln in ends[:2]), ends  # an estimate once a step has ended


# Test files with tests of both kinds, each kind for every step (collecting the whole folder four times takes minutes).
MIXED = ["test_steps_gpu.py", "test_errors.py", "test_sdpa_router.py"]


def collected(selection: str, steps: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", *(str(runner.TESTS / f) for f in MIXED), "--collect-only", "-q",
                          "-p", "no:cacheprovider",
                          *(["-k", selection] if selection else [])], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "FLASHLADDER_STEPS": steps}, timeout=600)
    assert out.returncode in (0, 5), out.stdout + out.stderr
    return {ln for ln in out.stdout.splitlines() if "::" in ln}


def test_the_steps_processes_and_the_one_beside_them_run_every_test_once():
    """python -m verify on verify/tests: each step's process takes the step's tests that need the GPU (conftest.py's
    on_gpu keyword), the processes beside them everything else; together every test, each once (in the files MIXED)."""
    steps = steps_mod.all_steps()[:2]
    every = collected("", ",".join(steps))
    parts = {s: collected(runner.step_selection(s, gpu_only=True), ",".join(steps)) for s in steps}
    parts["others"] = collected(runner.others_selection(steps, gpu_only=True), ",".join(steps))
    assert set.union(*parts.values()) == every, sorted(every - set.union(*parts.values()))[:5]
    assert sum(map(len, parts.values())) == len(every), "a test runs in two processes"
    for s in steps:
        assert parts[s] and all(s in t for t in parts[s]), sorted(parts[s])[:5]
        assert any(t.startswith("verify/tests/test_steps_gpu.py::") for t in parts[s])
        assert any(t.startswith("verify/tests/test_errors.py::") and f"[{s}" in t for t in parts["others"]), \
            f"{s}'s tests that need no GPU (bad input) should run beside, once"


@pytest.mark.parametrize("fails", [False, True], ids=["pass", "fail"])
def test_the_other_tests_run_a_file_a_process_side_by_side(tmp_path, fails):
    """check_others with jobs > 1: each test file in a process of its own; one verdict for all (FAILED if one file
    failed, its output shown), their counts summed; a file with no test selected is no failure; junit XML per file."""
    tests, out = tmp_path / "tests", tmp_path / "out"
    tests.mkdir()
    out.mkdir()
    (tests / "test_a.py").write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    (tests / "test_b.py").write_text(f"import pytest\n\ndef test_three():\n    assert not {fails}, 'a wrong result'\n\n"
                                     "def test_four():\n    pytest.skip('nothing to see here')\n")
    (tests / "test_c.py").write_text("def test_step41_only():\n    pass\n")  # deselected: a step's test
    lines = []
    outcome = runner.check_others(["step41"], 120, out, tests, log=lines.append, stream=False, jobs=2)
    log = "\n".join(lines)
    assert outcome == ("FAILED" if fails else "passed"), log
    end = [ln for ln in log.splitlines() if ln.startswith("-- other tests: ")]
    assert len(end) == 1 and end[0].endswith(f"s; {'2' if fails else '3'} passed{', 1 failed' if fails else ''}, 1 skipped)"), end
    assert ("a wrong result" in log) == fails and ("-- other tests, test_b.py: FAILED" in log) == fails, log
    assert "  skipped 1 test (other tests): nothing to see here" in log.splitlines(), log
    assert {p.name for p in out.glob("*.xml")} == {"others-test_a.xml", "others-test_b.xml", "others-test_c.xml"}


def test_the_estimate_of_what_remains(tmp_path):
    """The steps still waiting, dealt to the free processes; each step expected to take its time of the last run, or
    without one the mean of the steps done so far."""
    now = [0.0]
    p = runner.Progress(["step01", "step02", "step03", "step04", "step05"], jobs=2, clock=lambda: now[0])
    p.start("step01")
    p.start("step02")
    assert p.left_s() is None and p.words() == "0 of 5 steps checked"  # nothing tells yet
    now[0] = 60.0
    p.finish("step01")
    p.start("step03")
    now[0] = 80.0
    # step02 and step03: 60 s each, 80 and 20 s in; step04 on the first free process (at 0 s), step05 on the next (40 s)
    assert p.left_s() == pytest.approx(100.0) and p.words() == "1 of 5 steps checked, about 2 min left"
    last = runner.Progress(["step01", "step02"], jobs=1, last={"step01": 30.0, "step02": 600.0}, clock=lambda: 0.0)
    assert last.left_s() == pytest.approx(630.0) and last.words() == "0 of 2 steps checked, about 10 min left"
    times = tmp_path / "times.json"
    runner.save_times({"step01": 12.34}, times)
    runner.save_times({"step02": 5.0}, times)
    assert runner.load_times(times) == {"step01": 12.3, "step02": 5.0}
    assert runner.load_times(tmp_path / "none.json") == {}


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
        transcript = (out / "checks" / f"{name}.txt").read_text()  # pytest's whole output, whatever the log showed
        assert ("1 passed" if outcome == "pass" or name == "others" else "1 failed") in transcript, transcript


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
    verdicts = runner.check_steps(["step42"], limit, tests=tmp_path, log=lines.append)
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


# ---- nox -s verify: runs in the Python that has the CUDA torch --------------------------------------------


@pytest.fixture
def noxfile(monkeypatch):
    """noxfile.py as a module, with a stand-in for nox (the tests' environment need not have nox)."""
    stub = types.ModuleType("nox")
    stub.options = types.SimpleNamespace()
    stub.session = lambda *args, **kwargs: args[0] if args and callable(args[0]) else (lambda f: f)
    monkeypatch.setitem(sys.modules, "nox", stub)
    spec = importlib.util.spec_from_file_location("noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_python(path: Path, torch: str | None) -> str:
    """An executable that answers the noxfile's torch probe as a Python with this torch ("2.11.0+cu130 13.0",
    "2.13.0+cpu None") or none would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if torch is None:
        path.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    else:
        version, cuda = torch.split()
        path.write_text(f"#!/bin/sh\nprintf '%s\\n' {version} {cuda} {path.parent}/torch/__init__.py\n")
    path.chmod(0o755)
    return str(path)


def test_nox_looks_for_torch_in_the_active_environments_first(noxfile, tmp_path):
    venv, conda = fake_python(tmp_path / "venv/bin/python", None), fake_python(tmp_path / "conda/bin/python", None)
    on_path = fake_python(tmp_path / "usr/bin/python3", None)
    found = noxfile.candidate_pythons({"VIRTUAL_ENV": str(tmp_path / "venv"), "CONDA_PREFIX": str(tmp_path / "conda")},
                                      which=lambda name: on_path if name == "python3" else str(tmp_path / "nowhere"))
    assert found[:4] == [venv, conda, sys.executable, on_path], found
    assert len(found) == len(set(found)) and str(tmp_path / "nowhere") not in found, found


def test_nox_picks_the_first_python_with_a_cuda_torch(noxfile, tmp_path):
    none, cpu = fake_python(tmp_path / "a/python", None), fake_python(tmp_path / "b/python", "2.13.0+cpu None")
    cuda = fake_python(tmp_path / "c/python", "2.11.0+cu130 13.0")
    assert noxfile.cuda_torch_python([none, cpu, cuda]) == (cuda, f"torch 2.11.0+cu130 (CUDA 13.0) from {tmp_path}/c/torch/__init__.py")
    assert noxfile.cuda_torch_python([none, cpu]) == (None, f"{none} (no torch), {cpu} (torch 2.13.0+cpu, a CPU build)")


class FakeSession:
    """What the sessions use of nox's Session, recording what they install and run."""
    posargs = ["--steps", "5-7"]
    venv_backend = "virtualenv"

    def __init__(self):
        self.installed, self.ran = [], []

    def error(self, message):
        raise RuntimeError(message)

    def log(self, message):
        pass

    def install(self, *args):
        self.installed.append(args)

    def run(self, *args):
        self.ran.append(args)


def test_nox_tests_installs_the_requirements_files_and_no_list_of_its_own(noxfile, monkeypatch):
    """requirements-verify.txt is the one list of what the tests need, requirements-capstone.txt the capstone's optional
    one (so that CI runs its CPU tests); the session adds only CI's torch pin, first (install_torch: where it comes from
    is test_noxfile_torch.py's)."""
    monkeypatch.setattr(noxfile, "install_torch", lambda s: s.install(noxfile.TORCH_CI))
    session = FakeSession()
    noxfile.tests(session)
    assert session.installed == [(noxfile.TORCH_CI,), ("-r", "requirements-verify.txt", "-r", "requirements-capstone.txt")]
    assert session.ran == [("python", "-m", "pytest", "--steps", "5-7")]


def test_nox_capstone_runs_in_the_python_with_the_cuda_torch(noxfile, tmp_path, monkeypatch):
    cuda = fake_python(tmp_path / "venv/bin/python", "2.11.0+cu130 13.0")
    monkeypatch.setattr(noxfile, "candidate_pythons", lambda: [fake_python(tmp_path / "python3", None), cuda])
    session = FakeSession()
    noxfile.capstone(session)
    assert session.installed == [] and session.ran == [(cuda, "-m", "verify.capstone", "--steps", "5-7")]


def test_nox_prefill_runs_in_the_python_with_the_cuda_torch(noxfile, tmp_path, monkeypatch):
    cuda = fake_python(tmp_path / "venv/bin/python", "2.11.0+cu130 13.0")
    monkeypatch.setattr(noxfile, "candidate_pythons", lambda: [fake_python(tmp_path / "python3", None), cuda])
    session = FakeSession()
    noxfile.prefill(session)
    assert session.installed == [] and session.ran == [(cuda, "-m", "verify.prefill", "--steps", "5-7")]


def test_nox_verify_runs_in_the_python_with_the_cuda_torch(noxfile, tmp_path, monkeypatch):
    cuda = fake_python(tmp_path / "venv/bin/python", "2.11.0+cu130 13.0")
    monkeypatch.setattr(noxfile, "candidate_pythons", lambda: [fake_python(tmp_path / "python3", None), cuda])
    session = FakeSession()
    noxfile.verify(session)
    assert session.ran == [(cuda, "-m", "verify", "--steps", "5-7")]


def test_nox_verify_without_a_cuda_torch_says_what_to_do_in_one_line(noxfile, tmp_path, monkeypatch):
    cpu = fake_python(tmp_path / "python3", "2.13.0+cpu None")
    monkeypatch.setattr(noxfile, "candidate_pythons", lambda: [cpu])
    with pytest.raises(RuntimeError) as e:
        noxfile.verify(FakeSession())
    assert str(e.value).startswith(f"no CUDA build of torch in {cpu} (torch 2.13.0+cpu, a CPU build): install one")
    assert "python -m verify" in str(e.value) and "\n" not in str(e.value)


# ---- GPUs other than the H200, and the PTX-JIT checks ----

def test_ptx_jit_refuses_a_step_without_ptx_in_one_line():
    hopper = next((s for s in steps_mod.all_steps() if s not in steps_mod.portable_steps()), None)
    if hopper is None:
        pytest.skip("every step embeds PTX")
    out = run_cli("verify", "--ptx-jit", "--steps", hopper)
    assert_one_line_error(out, CLIS["verify"], "--ptx-jit", hopper, "embed(s) no PTX",
                          steps_mod.numbers_in_words(steps_mod.portable_steps()))


def test_ptx_jit_builds_the_ptx_alone_and_checks_it(tmp_path):
    """--ptx-jit: the step built as its PTX alone into build/ptx-jit, its checks run with FLASHLADDER_PTX_JIT=1 (so
    that they import that build), no benchmark and no step-free tests. (A fake check stands for the real ones.)"""
    step = steps_mod.portable_steps()[0]
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_fake.py").write_text(textwrap.dedent(f"""
        import os
        from verify import steps as steps_mod

        def test_kernel_{step}():
            assert os.environ.get("FLASHLADDER_PTX_JIT") == "1"
            assert steps_mod.DEV == steps_mod.ROOT / "build" / "ptx-jit"
            assert steps_mod.targets({step!r}).sass() == [] and steps_mod.targets({step!r}).ptx() == ["compute_80"]
            assert (steps_mod.DEV / "flashladder" / {step!r} / "_kernel.so").is_file()

        def test_not_about_one_step():
            raise AssertionError("the step-free tests do not run under --ptx-jit")
    """))
    out = run_cli("verify", "--ptx-jit", "--steps", step, "--tests", str(tests), env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{step[4:]}: compute_80 PTX alone, compiled by the driver at load" in out.stdout, out.stdout
    assert f"-- {step}: passed" in out.stdout and "other tests not run (--ptx-jit)" in out.stdout, out.stdout
    assert "benchmarking" not in out.stdout, out.stdout


def test_the_steps_this_gpu_cannot_run_are_named_with_why(built):
    """On an RTX 4090 (faked): steps 01-07 run, each step built for sm_90a alone is left out, with the binding's
    reason (python -m verify then neither checks nor benchmarks it)."""
    pytest.importorskip("torch")
    import binding
    steps = steps_mod.all_steps()
    skipped = steps_mod.unrunnable(steps, binding.Device("NVIDIA GeForce RTX 4090", 8, 9, 99 * 1024))
    assert sorted(skipped) == [s for s in steps if s not in steps_mod.portable_steps()], skipped
    for why in skipped.values():
        assert why == "needs an sm_90 GPU (H100/H200; built for sm_90a alone), but this GPU is NVIDIA GeForce RTX 4090 (sm_89)"
    assert steps_mod.unrunnable(steps, binding.Device("NVIDIA H200", 9, 0, 227 * 1024)) == {}


@pytest.mark.parametrize("name, folder", [("NVIDIA H200", "h200"), ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
                                          ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"), ("NVIDIA RTX 6000 Ada Generation",
                                                                                      "rtx-6000-ada-generation")])
def test_results_go_to_a_folder_named_after_the_gpu(name, folder):
    assert machine.results_folder(name) == folder


def test_the_build_line_says_what_each_group_of_steps_is_built_for():
    text = verify_main.targets_in_words(steps_mod.all_steps())
    portable = steps_mod.numbers_in_words(steps_mod.portable_steps())
    assert f"{portable}: SASS for sm_80, sm_86, sm_89, sm_90a, sm_120 + compute_80 PTX" in text, text
    hopper = steps_mod.numbers_in_words([s for s in steps_mod.all_steps() if s not in steps_mod.portable_steps()])
    assert text.endswith(f"{hopper}: SASS for sm_90a"), text
    report = {"sm_80": {"k": {"registers": 200, "spill_stores": 0, "spill_loads": 0, "stack_frame": 0}},
              "sm_90a": {"k": {"registers": 255, "spill_stores": 0, "spill_loads": 0, "stack_frame": 0}},
              "sm_120": {"k": {"registers": 200, "spill_stores": 0, "spill_loads": 0, "stack_frame": 0}}}
    assert verify_main.resources_in_words("step07", report) == [
        "step07 k: sm_80, sm_120: 200 registers, 0+0 spill bytes, 0 B stack; sm_90a: 255 registers, 0+0 spill bytes, 0 B stack"]
