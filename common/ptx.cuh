// flashladder/common/ptx.cuh -- one inline function per PTX instruction the steps use.
//
// Each wrapper is named after its mnemonic, shows the full PTX string, and cites the section of the
// PTX ISA (version 9.0, "Parallel Thread Execution ISA") that defines it. Why wrappers at all: CUDA C++
// has no intrinsic for most of these (ldmatrix, mma.sync with bf16, cp.async with a cache hint), and a
// named function per instruction keeps the kernels readable.
#pragma once

#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// ---------------------------------------------------------------------------------------------------
// Addresses
// ---------------------------------------------------------------------------------------------------

// A generic pointer into shared memory as the 32-bit .shared address the instructions below take.
// PTX ISA: "Data Movement and Conversion Instructions: cvta".
__device__ __forceinline__ uint32_t smem_u32(const void* smem_ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
}

// ---------------------------------------------------------------------------------------------------
// Ampere-era tensor-core path: ldmatrix -> mma.sync (sm_80+, also fast on sm_90)
// ---------------------------------------------------------------------------------------------------

// ldmatrix: the warp loads 8x8 bf16 matrices from shared memory straight into mma fragment layout.
// Lanes 0-7 give the 8 row addresses of matrix 0, lanes 8-15 those of matrix 1, and so on (16 bytes
// per row). Lane l receives, of each matrix, row l/4, columns 2*(l%4) and 2*(l%4)+1, in one register.
// PTX ISA: "Warp-level matrix load instruction: ldmatrix".
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem_row) {
    ldmatrix_x2(r, smem_u32(smem_row));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
    ldmatrix_x4(r, smem_u32(smem_row));
}
// .trans: lane l receives column l/4, rows 2*(l%4) and 2*(l%4)+1 -- the transposed fragment, which is
// how V (stored [key, dim]) becomes the k-major B operand of P.V.
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem_row) {
    ldmatrix_x2_trans(r, smem_u32(smem_row));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
    ldmatrix_x4_trans(r, smem_u32(smem_row));
}

// stmatrix (sm_90): the reverse of ldmatrix, four 8x8 bf16 matrices from mma fragments to shared memory. With
// .trans each is stored transposed: register i's matrix, whose lane l holds (row l/4, cols 2*(l%4), +1), lands
// with its column c as the 16-byte row at the address lane 8*i + c gives. The backward stores dS this way from
// the dS^T its warps hold (step38). PTX ISA: "Warp-level matrix store instruction: stmatrix".
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t smem_addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(smem_addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// D = A.B + D for one 16x8x16 tile: A 16x16 bf16 (row-major, 4 regs), B 16x8 bf16 ("col": k-major,
// 2 regs), D 16x8 fp32 (4 regs). With g = lane/4, t = lane%4, the fragments are
//   A: a[0] = (row g,   cols 2t..2t+1)   a[1] = (row g+8, cols 2t..2t+1)
//      a[2] = (row g,   cols 2t+8..+9)   a[3] = (row g+8, cols 2t+8..+9)
//   B: b[0] = (rows 2t..2t+1, col g)     b[1] = (rows 2t+8..+9, col g)
//   D: d[0..1] = (row g, cols 2t..2t+1)  d[2..3] = (row g+8, cols 2t..2t+1)
// PTX ISA: "Warp-level matrix instructions: mma" (mma.m16n8k16, "Matrix Fragments for mma.m16n8k16").
__device__ __forceinline__ void mma_m16n8k16_bf16_f32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two fp32 -> one register of two bf16 (lo in the low half), round to nearest even.
// PTX ISA: "Data Movement and Conversion Instructions: cvt" (cvt.rn.bf16x2.f32).
__device__ __forceinline__ uint32_t cvt_rn_bf16x2_f32(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// The same into two fp16 (cvt.rn.f16x2.f32): values beyond fp16's 65504 become +-inf.
__device__ __forceinline__ uint32_t cvt_rn_f16x2_f32(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// ---- the two 16-bit input types, for the kernels built for both (step40 on): T = __nv_bfloat16 or __half ----
// bf16 keeps fp32's exponent with 8 bits of precision; fp16 has 11 bits of precision and a range up to 65504. Both
// multiply exactly into fp32 (8 x 8 or 11 x 11 bits), so the tensor cores' products are the same kind of thing.
template <typename T>
constexpr bool is_16bit_float = std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;
// Two fp32 -> one register of two T (lo in the low half), round to nearest even.
template <typename T>
__device__ __forceinline__ uint32_t cvt_rn_x2_f32(float lo, float hi) {
    static_assert(is_16bit_float<T>, "bf16 or fp16");
    if constexpr (std::is_same_v<T, __half>) return cvt_rn_f16x2_f32(lo, hi);
    else return cvt_rn_bf16x2_f32(lo, hi);
}
// One T -> fp32 (exact).
template <typename T>
__device__ __forceinline__ float to_f32(T x) {
    static_assert(is_16bit_float<T>, "bf16 or fp16");
    if constexpr (std::is_same_v<T, __half>) return __half2float(x);
    else return __bfloat162float(x);
}

// ---------------------------------------------------------------------------------------------------
// Asynchronous global -> shared copies (sm_80+)
// ---------------------------------------------------------------------------------------------------

// cp.async: copy 16 bytes global -> shared without passing through registers. .cg caches in L2 only
// (the tile is reused from shared memory, not from L1). Completion is tracked in commit groups.
// PTX ISA: "Data Movement and Conversion Instructions: cp.async".
__device__ __forceinline__ void cp_async_cg_16(void* smem_dst, const void* gmem_src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(smem_u32(smem_dst)), "l"(gmem_src) : "memory");
}
// Close the group of cp.async issued since the last commit. PTX ISA: "cp.async.commit_group".
__device__ __forceinline__ void cp_async_commit_group() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Wait until at most N of this thread's groups are still in flight. PTX ISA: "cp.async.wait_group".
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// ---------------------------------------------------------------------------------------------------
// Special functions
// ---------------------------------------------------------------------------------------------------

// 2^x on the MUFU unit, one instruction (subnormal results flush to zero). expf() is this plus a
// multiply by log2(e) and range handling. PTX ISA: "Floating Point Instructions: ex2".
__device__ __forceinline__ float ex2_approx_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// 1 / x and log2(x) on the MUFU unit, one instruction each (about 23 bits; 1.f / x and logf are IEEE-exact and take
// a Newton step with a slow path, a polynomial). PTX ISA: "Floating Point Instructions: rcp.approx, lg2".
__device__ __forceinline__ float rcp_approx_ftz(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float lg2_approx_ftz(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// ---------------------------------------------------------------------------------------------------
// Named barriers (the hardware barriers behind __syncthreads, which uses id 0)
// ---------------------------------------------------------------------------------------------------

// bar.sync: count this warp's threads in at barrier `id` (1-15 here) and wait until `threads` (a multiple
// of 32) have arrived. bar.arrive: count them in and go on without waiting -- how one group of warps
// signals another. PTX ISA: "Parallel Synchronization and Communication Instructions: bar, barrier".
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// ---------------------------------------------------------------------------------------------------
// Flags between CTAs in global memory (the release / acquire patterns of the PTX memory model)
// ---------------------------------------------------------------------------------------------------

// One thread tells CTAs elsewhere on the GPU that data is ready: what it wrote before, and what other threads of its
// CTA wrote before a barrier it then passed (the fence is cumulative), is visible to a thread that reads `value` with
// load_acquire_gpu. PTX ISA: "Memory Consistency Model: Release and Acquire Patterns"; "st".
__device__ __forceinline__ void store_release_gpu(int* flag, int value) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;\n" :: "l"(flag), "r"(value) : "memory");
}
__device__ __forceinline__ int load_acquire_gpu(const int* flag) {
    int value;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(flag) : "memory");
    return value;
}
