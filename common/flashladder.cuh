// flashladder/common/flashladder.cuh -- the contract every step's kernel.cu implements.
//
// Each step is one shared library (_kernel.so) with a plain C ABI, loaded from Python with ctypes:
// no libtorch, no pybind11, so one build serves every torch version. The Python side
// (common/binding/) validates the tensors, fills a FwdParams, and calls
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
// (3: flashladder_archs and flashladder_loaded_code; flashladder_smem_bytes in the steps that run beyond Hopper.
// 4: FwdParams' heads_k, causal and causal_offset; flashladder_features in the steps that read them.
// 5: FwdParams' workspace; flashladder_workspace_bytes in the steps that read it.
// 6: FwdParams' and BwdParams' dtype, read by the steps with FLASHLADDER_FEATURE_FP16.)
#define FLASHLADDER_ABI_VERSION 7

// ---- which GPUs the library runs on: said by the build (common/build_step.py, TARGETS) ----
// FLASHLADDER_ARCHS: what the library holds, its SASS then its PTX, e.g. "sm_80,sm_86,sm_89,sm_90a,sm_120,compute_80"
// (exported by flashladder_archs below; the binding refuses a GPU that none of them runs on). FLASHLADDER_TARGETS_BUILT:
// the row of TARGETS the build used, e.g. "sm80_and_later".
#if !defined(FLASHLADDER_ARCHS) || !defined(FLASHLADDER_TARGETS_BUILT)
#error "build the steps with common/build_step.py (pip install steps/<step>, python -m verify): it defines FLASHLADDER_ARCHS and FLASHLADDER_TARGETS_BUILT from its TARGETS"
#endif

constexpr bool flashladder_same_string(const char* a, const char* b) {
    return *a == *b && (*a == '\0' || flashladder_same_string(a + 1, b + 1));
}

// A kernel.cu that runs beyond Hopper names its row of build_step.py's TARGETS in one line at file scope, e.g.
//     FLASHLADDER_TARGETS(sm80_and_later);
// (a kernel.cu that names none is built for sm90a_only). The build reads that line for its -gencode flags; the line
// itself checks, at compile time, that the build read it (a declaration the build missed fails here).
#define FLASHLADDER_TARGETS(name)                                                                             \
    static_assert(flashladder_same_string(FLASHLADDER_TARGETS_BUILT, #name),                                \
                  "kernel.cu names the targets " #name ", but the build compiled it for " FLASHLADDER_TARGETS_BUILT \
                  ": build it with common/build_step.py, which reads the FLASHLADDER_TARGETS line")

constexpr int HEAD_DIM = 128;  // the head size of every step before step41, and the one the others take too
constexpr float LOG2E = 1.4426950408889634f;  // log2(e): exp(x) = 2^(x * LOG2E), so a softmax can use ex2
constexpr float LN2 = 0.6931471805599453f;    // ln(2): log(x) = log2(x) * LN2, so an LSE can use lg2

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Everything a forward call needs. Mirrored field by field in common/binding/abi.py (ctypes).
// Strides are in elements; the last dimension (HEAD_DIM, or head_dim) is contiguous (stride 1) for all four tensors.
struct FwdParams {
    const void* q;        // bf16 [batch, heads, seqlen_q, HEAD_DIM]
    const void* k;        // bf16 [batch, heads_k, seqlen_k, HEAD_DIM]
    const void* v;        // bf16 [batch, heads_k, seqlen_k, HEAD_DIM]
    void* o;              // bf16 [batch, heads, seqlen_q, HEAD_DIM]
    float* lse;           // fp32 [batch, heads, seqlen_q], contiguous; natural log
    int64_t q_stride[3];  // strides of q's batch, head and row dimensions
    int64_t k_stride[3];
    int64_t v_stride[3];
    int64_t o_stride[3];
    int32_t batch, heads, seqlen_q, seqlen_k;
    float scale;          // softmax scale applied to Q.K^T (1/sqrt(HEAD_DIM) by default)
    // What only the steps that export flashladder_features (below) read; for the others the binding passes
    // heads_k = heads and causal = 0 (and refuses any other call).
    int32_t heads_k;        // key/value heads, a divisor of heads: query head h reads key/value head h / (heads / heads_k)
    int32_t causal;         // 1: row i sees key j only if j <= i + causal_offset; 0: every key
    int32_t causal_offset;  // 0: the diagonal from the top left (SDPA's is_causal); seqlen_k - seqlen_q: from the bottom right
    // What only the steps that export flashladder_workspace_bytes(sms) read (the others get nullptr): that many bytes of
    // device memory, zero before the step's first call on the stream, which the step leaves zero again after each call.
    // nullptr: the step runs without it.
    void* workspace;
    // The type of q, k, v and o: FLASHLADDER_BF16, or FLASHLADDER_FP16 for the steps with FLASHLADDER_FEATURE_FP16 (the
    // binding passes the others bf16 alone). The LSE is fp32 either way.
    int32_t dtype;
    // The last dim of q and k (head_dim) and of v and o (head_dim_v): HEAD_DIM, or another that the step exports in
    // flashladder_head_dims (below); the binding passes the others HEAD_DIM alone.
    int32_t head_dim, head_dim_v;
};

// Everything a backward call needs (the steps that export flashladder_bwd). Mirrored in common/binding/abi.py.
// Given O = attention(Q, K, V) and its LSE from the forward, and dO (and dLSE, the gradient of the LSE, or nullptr):
// dQ, dK, dV. The strides are those of FwdParams, in elements, the last dimension contiguous.
struct BwdParams {
    const void* q;         // bf16 [batch, heads, seqlen_q, HEAD_DIM]
    const void* k;         // bf16 [batch, heads_k, seqlen_k, HEAD_DIM]
    const void* v;         // bf16 [batch, heads_k, seqlen_k, HEAD_DIM]
    const void* o;         // bf16 [batch, heads, seqlen_q, HEAD_DIM], the forward's output
    const void* d_o;       // bf16 [batch, heads, seqlen_q, HEAD_DIM], the gradient of the loss with respect to O
    const float* lse;      // fp32 [batch, heads, seqlen_q], contiguous: the forward's LSE (natural log)
    const float* d_lse;    // fp32 [batch, heads, seqlen_q], contiguous, or nullptr (no gradient reaches the LSE)
    float* delta;          // fp32 [batch, heads, seqlen_q], contiguous scratch: D = rowsum(dO * O) - dLSE
    float* dq_accum;       // fp32 [batch, heads, seqlen_q, HEAD_DIM], contiguous scratch for the steps that add dQ up
                           // across CTAs (they export flashladder_bwd_accumulates_dq), or nullptr
    void* dq;              // bf16 [batch, heads, seqlen_q, HEAD_DIM]
    void* dk;              // bf16 [batch, heads_k, seqlen_k, HEAD_DIM]: summed over the query heads that read it
    void* dv;              // bf16 [batch, heads_k, seqlen_k, HEAD_DIM]: summed the same way
    int64_t q_stride[3], k_stride[3], v_stride[3], o_stride[3], do_stride[3];
    int64_t dq_stride[3], dk_stride[3], dv_stride[3];
    int32_t batch, heads, seqlen_q, seqlen_k;
    float scale;
    int32_t heads_k, causal, causal_offset;  // as in FwdParams
    int32_t deterministic;  // 1: the same bits every call (a step that adds dQ up in any order then takes another way)
    int32_t dtype;          // as in FwdParams: of q, k, v, o, d_o and of dq, dk, dv
    int32_t head_dim, head_dim_v;  // as in FwdParams (flashladder_bwd_head_dims)
};

// Bits of flashladder_features(), exported by the steps that take more than dense attention with equal heads.
constexpr int FLASHLADDER_FEATURE_CAUSAL = 1;  // FwdParams' causal and causal_offset
constexpr int FLASHLADDER_FEATURE_GQA = 2;     // heads_k < heads (grouped and multi-query attention)
constexpr int FLASHLADDER_FEATURE_FP16 = 4;    // dtype = FLASHLADDER_FP16 (fp16 inputs and outputs) as well as bf16
// FwdParams' and BwdParams' dtype.
constexpr int32_t FLASHLADDER_BF16 = 0, FLASHLADDER_FP16 = 1;
// The head dims a step may take, by bit: bit i of flashladder_head_dims() (the forward) and flashladder_bwd_head_dims()
// (the backward), exported by the steps that take more than HEAD_DIM, says that it takes FLASHLADDER_HEAD_DIMS[i] (q, k
// and v alike). A step without them takes HEAD_DIM alone.
constexpr int FLASHLADDER_HEAD_DIMS[] = {64, 96, 128, 192, 256};
constexpr int flashladder_head_dim_bit(int head_dim) {
    for (int i = 0; i < int(sizeof(FLASHLADDER_HEAD_DIMS) / sizeof(int)); ++i)
        if (FLASHLADDER_HEAD_DIMS[i] == head_dim) return 1 << i;
    return 0;
}

// Address of row `row` of the [seqlen, HEAD_DIM] matrix of (batch, head) in a strided tensor.
template <typename T>
__device__ __forceinline__ T* row_ptr(T* base, const int64_t stride[3], int batch, int head, int64_t row) {
    return base + batch * stride[0] + head * stride[1] + row * stride[2];
}

// ---- exported alongside each step's own flashladder_fwd, flashladder_seqlen_multiple_q/_k ----
// (A step whose seqlen multiples are 1 -- it takes any length -- also exports flashladder_tile_q/_k, its work
// tiles: the tests size their cases in tiles. For the other steps the tiles are the multiples. A step that runs
// on GPUs with less shared memory per block than Hopper's 227 KB exports flashladder_smem_bytes, the dynamic
// shared memory a block of it asks for: the binding compares it with the GPU's before a launch.)
// (each step's .so is built from exactly one translation unit, its kernel.cu, so these are defined once)
FLASHLADDER_EXPORT int flashladder_abi_version() { return FLASHLADDER_ABI_VERSION; }
// The binding compares this with ctypes.sizeof of its mirror of FwdParams when it loads the library.
FLASHLADDER_EXPORT int flashladder_params_size() { return static_cast<int>(sizeof(FwdParams)); }
FLASHLADDER_EXPORT const char* flashladder_error_string(int err) {
    return cudaGetErrorString(static_cast<cudaError_t>(err));
}
// The architectures the library holds code for (FLASHLADDER_ARCHS above), comma-separated.
FLASHLADDER_EXPORT const char* flashladder_archs() { return FLASHLADDER_ARCHS; }

constexpr int FLASHLADDER_MAX_DEVICES = 64;
// Which code the driver loaded for the step's kernel on each device, from its first launch there on:
// cudaFuncAttributes' ptxVersion (the PTX the code came from) and binaryVersion (the SASS it runs), as
// 10 * major + minor: on an H200, 90 and 90 for the sm_90a SASS, 80 and 90 for compute_80 PTX that the driver compiled.
inline int flashladder_loaded[FLASHLADDER_MAX_DEVICES][2] = {};
// 0 and the two versions of `device`, once the kernel ran there; a cudaError (cudaErrorNotReady before that).
FLASHLADDER_EXPORT int flashladder_loaded_code(int device, int* ptx_version, int* binary_version) {
    if (device < 0 || device >= FLASHLADDER_MAX_DEVICES) return cudaErrorInvalidDevice;
    if (flashladder_loaded[device][1] == 0) return cudaErrorNotReady;
    *ptx_version = flashladder_loaded[device][0];
    *binary_version = flashladder_loaded[device][1];
    return cudaSuccess;
}

// Ask for more than 48 KB of dynamic shared memory for `kernel`, once per device and process: the limit
// is an attribute of the function on one device, and setting it on every launch is a wasted driver call.
// Then note which code the driver loaded for it there (flashladder_loaded_code).
// (A template on the kernel: one flag per kernel and device; a race between two threads sets it twice,
// which is harmless.)
template <auto kernel>
inline cudaError_t raise_smem_limit_once(int bytes) {
    static bool done[FLASHLADDER_MAX_DEVICES] = {};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    if (device < FLASHLADDER_MAX_DEVICES && done[device]) return cudaSuccess;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
    cudaFuncAttributes attributes;
    err = cudaFuncGetAttributes(&attributes, kernel);
    if (err == cudaSuccess && device < FLASHLADDER_MAX_DEVICES) {
        flashladder_loaded[device][0] = attributes.ptxVersion;
        flashladder_loaded[device][1] = attributes.binaryVersion;
        done[device] = true;
    }
    return err;
}
