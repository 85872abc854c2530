"""The Python binding shared by every flashladder step (copied into each step package as its _binding package).

It never links libtorch: the step's kernel is a plain C library (_kernel.so, see common/flashladder.cuh)
loaded with ctypes. The binding checks the tensors, then hands the library raw device pointers, strides
and torch's current CUDA stream. Because nothing is compiled against torch's C++ ABI, one build works
with every torch version (no `undefined symbol` after a torch upgrade).

The call is a real torch op (torch.library.custom_op + register_fake): it works under
torch.compile(fullgraph=True) and inside CUDA-graph capture; it launches on the current stream and never
synchronizes. Bad input raises ValueError/TypeError/RuntimeError before any launch; a failed launch raises.
A GPU the step's library holds no code for (flashladder_archs: SASS it runs as is, PTX the driver compiles for
newer GPUs), or with less shared memory per block than the step asks for, is refused in one line before launch.
Each step also offers `sdpa()`, a drop-in for torch's scaled_dot_product_attention: inside `with step.sdpa():` the
SDPA calls the step can take go to its op, decided from the calls' metadata by these same checks, and the others to
torch. Nothing is active on import.

One module per job, each importing only those before it:
  abi     the library's C ABI: loading _kernel.so, the FwdParams mirror, the ABI checks, one launch's parameters;
  checks  the checks before a launch: the arguments, the tensors' metadata, the GPU, the pointers;
  router  the SDPA drop-in (SdpaRouter): which SDPA calls a step takes, decided from their metadata;
  step    the step factory: Step, whose methods are a step package's attention, attention_out and sdpa.
Their public names are here too (binding.load_library, binding.SdpaRouter, ...). A test that replaces one (e.g. the
GPU's properties, checks.device_props) replaces it in the module that defines it.
"""
from .abi import (
    ABI_VERSION,
    CAUSAL,
    DTYPE_CODE,
    FEATURE_CAUSAL,
    FEATURE_FP16,
    FEATURE_GQA,
    HEAD_DIM,
    HEAD_DIMS,
    FwdParams,
    head_dims_of,
    kernel_strides,
    load_library,
    make_params,
)
from .checks import (
    ALIGN,
    MAX_GRID_YZ,
    MAX_ROW_STRIDE,
    Device,
    check_causal,
    check_causal_code,
    check_device,
    check_inputs,
    check_launch,
    check_outputs_apart,
    check_scale,
    check_types,
    code_for,
    device_props,
    dtypes_of,
    no_cuda_reason,
    runs_on,
)
from .router import (
    CHECKPOINTED,
    SDPA_PARAMETERS,
    CausalMask,
    NotRouted,
    SdpaLimits,
    SdpaRouter,
    TensorMeta,
    checkpoint,
    constant,
    describe,
    route_reason,
    sdpa_arguments,
)
from .step import Step, bind_step, output_like

__all__ = [
    "ABI_VERSION", "CAUSAL", "DTYPE_CODE", "FEATURE_CAUSAL", "FEATURE_FP16", "FEATURE_GQA", "HEAD_DIM", "HEAD_DIMS", "FwdParams",
    "head_dims_of", "kernel_strides", "load_library", "make_params",
    "ALIGN", "MAX_GRID_YZ", "MAX_ROW_STRIDE", "Device", "check_causal", "check_causal_code", "check_device",
    "check_inputs", "check_launch", "check_outputs_apart", "check_scale", "check_types", "code_for", "device_props", "dtypes_of",
    "no_cuda_reason", "runs_on",
    "CHECKPOINTED", "SDPA_PARAMETERS", "CausalMask", "NotRouted", "SdpaLimits", "SdpaRouter", "TensorMeta", "constant",
    "describe",
    "route_reason", "sdpa_arguments", "checkpoint",
    "Step", "bind_step", "output_like",
]
