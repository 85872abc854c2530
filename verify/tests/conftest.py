"""Every step under steps/ is tested (found by glob). FLASHLADDER_STEPS=1-3 narrows it (python -m verify --steps)."""
import os

import pytest

from verify import steps as steps_mod


def selected_steps():
    return steps_mod.select(os.environ.get("FLASHLADDER_STEPS"))


def pytest_report_header(config):
    try:
        from verify.checks import run_seed
    except ImportError:  # no torch: no random inputs either
        return None
    return f"flashladder: random inputs from FLASHLADDER_SEED={run_seed()} (set it to replay this run)"


def pytest_generate_tests(metafunc):
    if "step" in metafunc.fixturenames:
        metafunc.parametrize("step", selected_steps())


@pytest.fixture(scope="session")
def built():
    """Compile the selected steps once per session (nvcc; cached by content in build/dev)."""
    return steps_mod.build(selected_steps(), jobs=os.cpu_count() or 2, log=lambda *_: None)


@pytest.fixture
def mod(step, built):
    pytest.importorskip("torch", reason="the binding needs torch")
    return steps_mod.load(step)


def has_cuda_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


needs_gpu = pytest.mark.skipif(not has_cuda_gpu(), reason="no CUDA GPU on this machine: the kernel checks run on "
                               f"{steps_mod.GPUS} (python -m verify on the GPU machine)")
