"""CPU: `nox -s tests` installs a CPU build of torch where one can be had, and says where it came from.

On Linux PyPI's torch is a CUDA build (about 3 GB of wheels); the tests need none of it. noxfile.install_torch takes,
in order: the index the user names ($FLASHLADDER_TORCH_INDEX), a wheel pip finds on the machine without an index (CI's
machine has the CPU wheel on disk), PyTorch's CPU index, and only then the indexes pip is configured with, saying so.
"""
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


class Session:
    """What install_torch and the tests session use of nox's Session, recording what they install, run and say."""
    venv_backend = "virtualenv"
    bin = "/nonexistent/bin"
    posargs = ["-k", "x"]

    def __init__(self):
        self.installed, self.ran, self.said, self.warned = [], [], [], []

    def install(self, *args):
        self.installed.append(args)

    def run(self, *args, **kwargs):
        self.ran.append(args)

    def log(self, message):
        self.said.append(message)

    def warn(self, message):
        self.warned.append(message)


def local_wheel(found: bool, version: str = "2.13.0+cpu"):
    """subprocess.run as install_torch calls it: pip's --no-index install (found or not), then the version query."""
    def run(args, **kwargs):
        if "--no-index" in args:
            return subprocess.CompletedProcess(args, 0 if found else 1, "", "" if found else "No matching distribution")
        return subprocess.CompletedProcess(args, 0, version + "\n", "")
    return run


def test_the_index_the_user_names_comes_first(noxfile, monkeypatch):
    monkeypatch.setenv(noxfile.TORCH_INDEX_ENV, "https://example.invalid/simple")
    monkeypatch.setattr(noxfile.subprocess, "run", lambda *a, **k: pytest.fail("asked pip with an index named"))
    session = Session()
    noxfile.install_torch(session)
    assert session.installed == [("--index-url", "https://example.invalid/simple", noxfile.TORCH_CI)]


def test_a_wheel_on_the_machine_is_taken_and_nothing_downloaded(noxfile, monkeypatch):
    monkeypatch.delenv(noxfile.TORCH_INDEX_ENV, raising=False)
    monkeypatch.setattr(noxfile.subprocess, "run", local_wheel(True))
    monkeypatch.setattr(noxfile, "reachable", lambda url: pytest.fail("reached for an index with a wheel on disk"))
    session = Session()
    noxfile.install_torch(session)
    assert session.installed == [] and any("2.13.0+cpu" in m and "nothing downloaded" in m for m in session.said)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="off Linux, PyPI's torch is a CPU build")
def test_pytorchs_cpu_index_where_it_is_in_reach(noxfile, monkeypatch):
    monkeypatch.delenv(noxfile.TORCH_INDEX_ENV, raising=False)
    monkeypatch.setattr(noxfile.subprocess, "run", local_wheel(False))
    monkeypatch.setattr(noxfile, "reachable", lambda url: url.startswith(noxfile.TORCH_CPU_INDEX))
    session = Session()
    noxfile.install_torch(session)
    assert session.installed == [("--index-url", noxfile.TORCH_CPU_INDEX, noxfile.TORCH_CI)]
    assert not session.warned


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="off Linux, PyPI's torch is a CPU build")
def test_otherwise_pips_own_indexes_and_a_line_that_says_what_that_downloads(noxfile, monkeypatch):
    monkeypatch.delenv(noxfile.TORCH_INDEX_ENV, raising=False)
    monkeypatch.setattr(noxfile.subprocess, "run", local_wheel(False))
    monkeypatch.setattr(noxfile, "reachable", lambda url: False)
    session = Session()
    noxfile.install_torch(session)
    assert session.installed == [(noxfile.TORCH_CI,)]
    assert len(session.warned) == 1 and all(w in session.warned[0] for w in ("CUDA", "3 GB", noxfile.TORCH_INDEX_ENV))


def test_an_unreachable_index_is_said_so_quickly(noxfile):
    assert noxfile.reachable("http://127.0.0.1:9/", timeout=2) is False


def test_the_tests_session_installs_torch_then_the_two_lists(noxfile, monkeypatch):
    monkeypatch.setattr(noxfile, "install_torch", lambda session: session.install("TORCH"))
    session = Session()
    noxfile.tests(session)
    assert session.installed == [("TORCH",), ("-r", "requirements-verify.txt", "-r", "requirements-capstone.txt")]
    assert session.ran == [("python", "-m", "pytest", "-k", "x")]
