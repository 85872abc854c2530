// flashladder/common/flashladder.cuh -- the contract every step's kernel.cu implements.
//
// Each step is one shared library (_kernel.so) with a plain C ABI, loaded from Python with ctypes:
// no libtorch, no pybind11, so one build serves every torch version. The Python side
// (common/binding.py) validates the tensors, fills a FwdParams, and calls
//
//     int flashladder_fwd(const FwdParams* params, cudaStream_t stream);   // returns a cudaError_t
//
// on torch's current stream. The launcher never synchronizes; it returns the launch error, if any.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#define FLASHLADDER_EXPORT extern "C" __attribute__((visibility("default")))

// Bumped when FwdParams or the exported functions change; the binding refuses a mismatched .so.
#define FLASHLADDER_ABI_VERSION 2

constexpr int HEAD_DIM = 128;  // the ladder's one head size (docs/ladder.md: fixed scope)
constexpr float LOG2E = 1.4426950408889634f;  // log2(e): exp(x) = 2^(x * LOG2E), so a softmax can use ex2

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Everything a forward call needs. Mirrored field by field in common/binding.py (ctypes).
// Strides are in elements; the last dimension (HEAD_DIM) is contiguous (stride 1) for all four tensors.
struct FwdParams {
    const void* q;        // bf16 [batch, heads, seqlen_q, HEAD_DIM]
    const void* k;        // bf16 [batch, heads, seqlen_k, HEAD_DIM]
    const void* v;        // bf16 [batch, heads, seqlen_k, HEAD_DIM]
    void* o;              // bf16 [batch, heads, seqlen_q, HEAD_DIM]
    float* lse;           // fp32 [batch, heads, seqlen_q], contiguous; natural log
    int64_t q_stride[3];  // strides of q's batch, head and row dimensions
    int64_t k_stride[3];
    int64_t v_stride[3];
    int64_t o_stride[3];
    int32_t batch, heads, seqlen_q, seqlen_k;
    float scale;          // softmax scale applied to Q.K^T (1/sqrt(HEAD_DIM) by default)
};

// Address of row `row` of the [seqlen, HEAD_DIM] matrix of (batch, head) in a strided tensor.
template <typename T>
__device__ __forceinline__ T* row_ptr(T* base, const int64_t stride[3], int batch, int head, int64_t row) {
    return base + batch * stride[0] + head * stride[1] + row * stride[2];
}

// ---- exported alongside each step's own flashladder_fwd, flashladder_seqlen_multiple_q/_k ----
// (A step whose seqlen multiples are 1 -- it takes any length -- also exports flashladder_tile_q/_k, its work
// tiles: the tests size their cases in tiles. For the other steps the tiles are the multiples.)
// (each step's .so is built from exactly one translation unit, its kernel.cu, so these are defined once)
FLASHLADDER_EXPORT int flashladder_abi_version() { return FLASHLADDER_ABI_VERSION; }
// The binding compares this with ctypes.sizeof of its mirror of FwdParams when it loads the library.
FLASHLADDER_EXPORT int flashladder_params_size() { return static_cast<int>(sizeof(FwdParams)); }
FLASHLADDER_EXPORT const char* flashladder_error_string(int err) {
    return cudaGetErrorString(static_cast<cudaError_t>(err));
}

// Ask for more than 48 KB of dynamic shared memory for `kernel`, once per device and process: the limit
// is an attribute of the function on one device, and setting it on every launch is a wasted driver call.
// (A template on the kernel: one flag per kernel and device; a race between two threads sets it twice,
// which is harmless.)
template <auto kernel>
inline cudaError_t raise_smem_limit_once(int bytes) {
    constexpr int MAX_DEVICES = 64;
    static bool done[MAX_DEVICES] = {};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    if (device < MAX_DEVICES && done[device]) return cudaSuccess;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err == cudaSuccess && device < MAX_DEVICES) done[device] = true;
    return err;
}
