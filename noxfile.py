"""nox sessions. `nox -s verify` is the main job (on a GPU machine); `nox -s tests` is CI's test command.

`tests` and `verify` install requirements-verify.txt, the one list of what verify and its tests need.
`nox --no-venv -s <session>` runs in the current environment and installs nothing.
"""
import glob

import nox

nox.options.sessions = ["tests"]
REQUIREMENTS = ("-r", "requirements-verify.txt")
TORCH_CI = "torch==2.13.0"  # CI's pin: its machine has this (CPU) wheel on disk
SETUPTOOLS = "setuptools>=77"  # the steps' build backend, for the packaging tests (as in steps/*/pyproject.toml)
CUOBJDUMP = ["nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"]  # the disassembler (cuobjdump -sass runs nvdisasm) for
#                                                                  verify/tests/test_sass.py: CI's toolkit may lack both


@nox.session
def tests(session):
    """CPU-safe test suite: numerics model, every step compiled with nvcc, packaging, bad-input errors; GPU checks skip."""
    if session.venv_backend != "none":
        session.install(TORCH_CI, *REQUIREMENTS, SETUPTOOLS, *CUOBJDUMP)
    session.run("python", "-m", "pytest", *session.posargs)


# The GPU machine's CUDA torch is large and often preinstalled, with no package index in reach: the session's
# venv sees the system's packages, and pip keeps an installed torch >= 2.4 instead of downloading another.
# (A torch inside another venv is not visible from here: run `nox --no-venv -s verify` from that venv.)
@nox.session(venv_params=["--system-site-packages"])
def verify(session):
    """Build, check and benchmark every step beside torch SDPA; writes results/ and the README table."""
    if session.venv_backend != "none":
        session.install(*REQUIREMENTS)
    session.run("python", "-c", "import torch; print('verify uses torch', torch.__version__, 'from', torch.__file__, "
                "'CUDA', torch.version.cuda)")
    session.run("python", "-m", "verify", *session.posargs)


@nox.session
def build(session):
    """Compile every step (nvcc, sm_90a) and print its ptxas resource report."""
    session.run("python", "common/build_step.py")


@nox.session
def install_steps(session):
    """pip install every step package the way a user does (build isolation on), then import each."""
    if session.venv_backend != "none":
        session.install(TORCH_CI, "numpy")  # what the steps need at import (numpy: only to keep torch from warning)
    for step in sorted(glob.glob("steps/step[0-9][0-9]")):
        session.install(step)
        name = step.rsplit("/", 1)[-1]
        session.run("python", "-c", f"import flashladder.{name} as m; print(m.__name__, m.info['seqlen_multiple_q'], "
                    "m.info['seqlen_multiple_k'])")


@nox.session
def lint(session):
    if session.venv_backend != "none":
        session.install("ruff")
    session.run("ruff", "check", ".")
