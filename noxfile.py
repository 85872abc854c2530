"""nox sessions. `nox -s verify` is the main job (on a GPU machine); `nox -s tests` is CI's test command.

Where torch is preinstalled and no package index is reachable (the GPU machine), use `nox --no-venv`,
or skip nox entirely: `python -m verify` and `python -m pytest` need nothing but the packages.
"""
import nox

nox.options.sessions = ["tests"]
DEPS = ["numpy", "scipy", "matplotlib", "pytest", "hypothesis"]
TORCH = "torch==2.13.0"  # CI's pin: its machine has this (CPU) wheel on disk. On a GPU machine keep the CUDA
#                          torch it has (nox --no-venv); elsewhere PyPI serves the large CUDA wheel for this pin.


def install(session, *extra):
    if session.venv_backend != "none":
        session.install(TORCH, *DEPS, *extra)


@nox.session
def tests(session):
    """CPU-safe test suite: numerics model, every step compiled with nvcc, bad-input errors; GPU checks skip."""
    install(session)
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def verify(session):
    """Build, check and benchmark every step beside torch SDPA; writes results/ and the README table."""
    install(session)
    session.run("python", "-m", "verify", *session.posargs)


@nox.session
def build(session):
    """Compile every step (nvcc, sm_90a) and print its ptxas resource report."""
    session.run("python", "common/build_step.py")


@nox.session
def install_steps(session):
    """pip install every step package the way a user does (build isolation on), then import each."""
    install(session)
    import glob
    for step in sorted(glob.glob("steps/step[0-9][0-9]")):
        session.install(step)
        name = step.rsplit("/", 1)[-1]
        session.run("python", "-c", f"import flashladder.{name} as m; print(m.__name__, m.info['seqlen_multiple_q'], m.info['seqlen_multiple_k'])",
                    external=True)


@nox.session
def lint(session):
    if session.venv_backend != "none":
        session.install("ruff")
    session.run("ruff", "check", ".")
