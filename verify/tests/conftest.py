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


@pytest.fixture(params=["bfloat16", "float16"])
def dtype(request, mod):
    """The inputs' type of a numerics test: bf16, then fp16 for the steps that take it (info["dtypes"], step40 on)."""
    if request.param not in mod.info["dtypes"]:
        pytest.skip(f"{mod.__name__} computes in {' and '.join(mod.info['dtypes'])}")
    return getattr(pytest.importorskip("torch"), request.param)


@pytest.fixture(params=[128, 64], ids=lambda d: f"d{d}")
def head_dim(request, mod):
    """The head dim of a numerics test: 128, then 64 for the steps that take it (info["head_dims"], step41 on)."""
    if request.param not in mod.info["head_dims"]:
        pytest.skip(f"{mod.__name__} takes head dim {' and '.join(map(str, mod.info['head_dims']))}")
    return request.param


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


NO_GPU = f"no CUDA GPU on this machine: the kernel checks run on {steps_mod.GPUS} (python -m verify on the GPU machine)"
needs_gpu = pytest.mark.skipif(not has_cuda_gpu(), reason=NO_GPU)
ON_GPU = "on_gpu"  # the keyword of every test marked needs_gpu (pytest -k on_gpu): python -m verify's runner splits by it


def pytest_configure(config):
    config.addinivalue_line("markers", f"{ON_GPU}: a test that needs the GPU (marked needs_gpu; given to it at collection)")


@pytest.hookimpl(tryfirst=True)  # before -k deselects (the mark plugin's hook): the keyword must be there by then
def pytest_collection_modifyitems(items):
    """Each test marked needs_gpu also gets the marker on_gpu, whether or not this machine has a GPU, so that
    `-k "step05 and on_gpu"` selects step05's kernel checks (python -m verify runs each step's in a process of its own)
    and `-k "not on_gpu"` the tests that need no GPU (run once for every step, beside them)."""
    for item in items:
        if any(m.kwargs.get("reason") == NO_GPU for m in item.iter_markers("skipif")):
            item.add_marker(getattr(pytest.mark, ON_GPU))
