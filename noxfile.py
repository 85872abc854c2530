"""nox sessions. `nox -s verify` is the main job (on a GPU machine); `nox -s tests` is CI's test command.

`tests` installs torch (a CPU build where one can be had: install_torch), requirements-verify.txt, the one list of what
verify and its tests need, and requirements-capstone.txt, the capstone's and the prefill's optional one (diffusers,
transformers, ...), into a fresh venv.
`verify`, `capstone` and `prefill` make no venv: they run in the Python that has the CUDA torch (see cuda_torch_python).
`nox --no-venv -s <session>` runs in the current environment and installs nothing.
"""
import glob
import os
import shutil
import subprocess
import sys
import urllib.request

import nox

nox.options.sessions = ["tests"]
REQUIREMENTS = ("-r", "requirements-verify.txt")
CAPSTONE_REQUIREMENTS = ("-r", "requirements-capstone.txt")  # optional: the model entry points (verify.capstone, ...), their tests
TORCH_CI = "torch==2.13.0"  # CI's pin: its machine has this (CPU) wheel on disk
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's index of CPU builds (and of torch's dependencies)
TORCH_INDEX_ENV = "FLASHLADDER_TORCH_INDEX"  # the index torch comes from instead, e.g. https://pypi.org/simple


def reachable(url: str, timeout: float = 10.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except Exception:  # no network, no DNS, a proxy's refusal: out of reach, whatever the reason
        return False


def install_torch(session) -> None:
    """torch==2.13.0 into the session's venv, a CPU build where one can be had, and say where it came from.

    The tests need no GPU, and on Linux PyPI's torch is a CUDA build (about 3 GB of wheels, 5 GB installed); a CPU
    build is about 190 MB. So, in order: the index in $FLASHLADDER_TORCH_INDEX (the user's choice); a wheel that pip
    finds on this machine without any index (its --find-links: CI's machine has the CPU wheel on disk); PyTorch's CPU
    index; PyPI, saying what it downloads. torch's dependencies come with the requirements after it."""
    index = os.environ.get(TORCH_INDEX_ENV)
    if index:
        session.log(f"torch from {index} (${TORCH_INDEX_ENV})")
        session.install("--index-url", index, TORCH_CI)
        return
    if session.venv_backend in ("virtualenv", "venv"):  # a pip of its own, to ask without downloading anything
        python = os.path.join(session.bin, "python")
        local = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", TORCH_CI],
                               capture_output=True, text=True)
        if local.returncode == 0:
            version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                                     capture_output=True, text=True).stdout.strip()
            session.log(f"torch {version}: a wheel on this machine (pip's --find-links), nothing downloaded")
            return
    if sys.platform.startswith("linux"):
        if reachable(f"{TORCH_CPU_INDEX}/torch/"):
            session.log(f"torch: the CPU build from {TORCH_CPU_INDEX} (about 190 MB)")
            session.install("--index-url", TORCH_CPU_INDEX, TORCH_CI)
            return
        session.warn(f"{TORCH_CPU_INDEX} is out of reach: {TORCH_CI} comes from the indexes pip is configured with; "
                     "PyPI's is a CUDA build on Linux (about 3 GB of wheels, 5 GB installed). To choose, set "
                     f"${TORCH_INDEX_ENV} to an index, or run `nox --no-venv -s tests` in an environment that has torch")
    session.install(TORCH_CI)  # elsewhere (macOS, Windows) PyPI's torch is a CPU build


@nox.session
def tests(session):
    """CPU-safe test suite: numerics model, every step compiled with nvcc, packaging, bad-input errors, the SDPA drop-in,
    the capstone's and the prefill's parts on tiny models; GPU checks skip."""
    if session.venv_backend != "none":
        install_torch(session)
        session.install(*REQUIREMENTS, *CAPSTONE_REQUIREMENTS)
    session.run("python", "-m", "pytest", *session.posargs)


def candidate_pythons(environ=os.environ, which=shutil.which) -> list[str]:
    """Where a CUDA torch may be, most likely first: the active virtual or conda environment, nox's own Python,
    python3 and python on PATH, the Python that nox's environment was made from (e.g. the system's, under pipx)."""
    found = [os.path.join(environ[var], "bin", "python") for var in ("VIRTUAL_ENV", "CONDA_PREFIX") if environ.get(var)]
    found += [sys.executable, which("python3"), which("python"), os.path.join(sys.base_prefix, "bin", "python3")]
    return list(dict.fromkeys(p for p in found if p and os.path.isfile(p)))


def cuda_torch_python(candidates) -> tuple[str | None, str]:
    """The first of `candidates` that imports a CUDA build of torch, and its torch in words; else None and what
    each one has instead (one line)."""
    probe = "import torch; print(torch.__version__, torch.version.cuda, torch.__file__, sep='\\n')"
    tried = []
    for python in candidates:
        res = subprocess.run([python, "-c", probe], capture_output=True, text=True)
        version, cuda, where = res.stdout.splitlines()[-3:] if res.returncode == 0 else ("", "", "")
        if cuda not in ("", "None"):
            return python, f"torch {version} (CUDA {cuda}) from {where}"
        tried.append(f"{python} ({f'torch {version}, a CPU build' if version else 'no torch'})")
    return None, ", ".join(tried)


# The GPU machine's CUDA torch is large and preinstalled, often in a virtual or conda environment, with no package
# index in reach. A venv made by nox would not see a torch inside another venv, so this session makes none: it runs
# verify with the Python that has the CUDA torch, and installs nothing into it (verify says first what it lacks).
def run_in_cuda_torch_python(session, module: str) -> None:
    """`python -m <module> <posargs>` in the first Python that has a CUDA torch, or one line saying there is none."""
    python, torch_found = cuda_torch_python(candidate_pythons())
    if python is None:
        session.error(f"no CUDA build of torch in {torch_found}: install one (>= 2.4) in the environment you run nox "
                      f"from, or run `python -m {module}` in the environment that has one")
    session.log(f"{module} runs in {python}: {torch_found}")
    session.run(python, "-m", module, *session.posargs)


@nox.session(venv_backend="none")
def verify(session):
    """Build, check and benchmark every step beside torch SDPA; writes results/ and the README table."""
    run_in_cuda_torch_python(session, "verify")


@nox.session(venv_backend="none")
def capstone(session):
    """The final step inside a video diffusion model (python -m verify.capstone), in the Python with the CUDA torch; it
    needs requirements-capstone.txt there (and says so in one line where it is missing)."""
    run_in_cuda_torch_python(session, "verify.capstone")


@nox.session(venv_backend="none")
def cogvideox(session):
    """The final step inside CogVideoX-2B's denoiser, head dim 64 (python -m verify.cogvideox), in the Python with the
    CUDA torch; it needs requirements-capstone.txt there (and says so in one line where it is missing)."""
    run_in_cuda_torch_python(session, "verify.cogvideox")


@nox.session(venv_backend="none")
def prefill(session):
    """The final step inside a Llama-3-8B prefill (python -m verify.prefill), in the Python with the CUDA torch; it needs
    transformers there (requirements-capstone.txt; it says so in one line where it is missing)."""
    run_in_cuda_torch_python(session, "verify.prefill")


@nox.session
def build(session):
    """Compile every step (nvcc, for each architecture of its targets) and print its ptxas resource report."""
    session.run("python", "common/build_step.py")


@nox.session
def install_steps(session):
    """pip install every step package the way a user does (build isolation on), then import each."""
    if session.venv_backend != "none":
        install_torch(session)  # the steps' torch: CI's pin, a CPU build, not the CUDA torch that pip would choose
    for step in sorted(glob.glob("steps/step[0-9][0-9]")):
        session.install(step)
        name = step.rsplit("/", 1)[-1]
        # torch's warning without numpy made an error: the step's own dependencies must bring numpy
        session.run("python", "-W", "error:Failed to initialize NumPy", "-c", f"import flashladder.{name} as m; "
                    "print(m.__name__, m.info['seqlen_multiple_q'], m.info['seqlen_multiple_k'])")


@nox.session
def sdist(session):
    """A step's sdist, which carries kernel.cu and what it takes from common/ and builds on its own:
    `nox -s sdist -- steps/step14` writes steps/step14/dist/flashladder_step14-<version>.tar.gz (default: every step)."""
    session.install("build")
    for step in session.posargs or sorted(glob.glob("steps/step[0-9][0-9]")):
        # pyproject-build, the command of the `build` package: `python -m build` here would import the build/ folder
        session.run("pyproject-build", "--sdist", "--outdir", os.path.join(step, "dist"), step)


@nox.session
def lint(session):
    if session.venv_backend != "none":
        session.install("ruff")
    session.run("ruff", "check", ".")
