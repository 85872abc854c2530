// flashladder/common/driver_api.cuh -- reaching CUDA driver entry points without linking libcuda.
//
// Later steps build TMA tensor maps on the host with the driver's cuTensorMapEncodeTiled. Linking
// -lcuda would tie the build to a machine with a GPU driver (build machines often have none) and to
// its exact version. Instead the runtime hands us the driver function at run time:
// cudaGetDriverEntryPointByVersion (CUDA 12.5+) looks it up in the driver the process already loaded.
#pragma once

#include <cuda.h>            // the driver API's types (CUtensorMap, ...); nothing is linked
#include <cudaTypedefs.h>    // PFN_cuTensorMapEncodeTiled_v12000: the function-pointer type
#include <cuda_runtime.h>

// Returns the driver's cuTensorMapEncodeTiled, or nullptr (and the runtime error in *err) if the
// driver lacks it. Looked up once per process.
inline PFN_cuTensorMapEncodeTiled_v12000 driver_cuTensorMapEncodeTiled(cudaError_t* err) {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    static cudaError_t status = cudaSuccess;
    if (fn == nullptr && status == cudaSuccess) {
        cudaDriverEntryPointQueryResult found;
        status = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&fn), 12000,
                                                  cudaEnableDefault, &found);
        if (status == cudaSuccess && found != cudaDriverEntryPointSuccess) status = cudaErrorSymbolNotFound;
    }
    if (err) *err = status;
    return status == cudaSuccess ? fn : nullptr;
}
