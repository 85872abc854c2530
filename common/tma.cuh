// flashladder/common/tma.cuh -- the Tensor Memory Accelerator: bulk tensor copies global <-> shared (sm_90).
//
// One thread describes a whole tile ("box") by its coordinates in a tensor map; the TMA unit copies it,
// applies the shared-memory swizzle, and counts the bytes off an mbarrier (common/mbarrier.cuh). No
// address arithmetic per thread, no registers, no per-thread instructions in the loop.
//
// The tensor map (a 128-byte CUtensorMap) is built on the host by the driver's cuTensorMapEncodeTiled
// (reached through common/driver_api.cuh, no -lcuda) and passed to the kernel as a
// `const __grid_constant__ CUtensorMap` parameter, so the TMA unit can read it from parameter memory.
#pragma once

#include <cstdint>
#include "driver_api.cuh"
#include "flashladder.cuh"
#include "ptx.cuh"

// Copy the box at coordinates (c0 innermost .. c3) of `map` into shared memory at `dst` (1024-byte aligned
// for the 128-byte swizzle), completing on `bar` with complete_tx of the box's bytes.
// PTX ISA: "Data Movement and Conversion Instructions: cp.async.bulk.tensor".
__device__ __forceinline__ void cp_async_bulk_tensor_4d_global_to_shared(void* dst, const CUtensorMap* map, int c0, int c1,
                                                                          int c2, int c3, uint64_t* bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 :: "r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "r"(smem_u32(bar))
                 : "memory");
}

// The same copy, multicast: the box lands at the same shared-memory offset `dst` in every CTA of the cluster named
// in `cta_mask` (bit r: the CTA of rank r), and completes on the barrier at offset `bar` in each of them. One load
// from L2 feeds them all (step16: two CTAs that read the same K/V tiles). PTX ISA: "cp.async.bulk.tensor"
// (.multicast::cluster).
__device__ __forceinline__ void cp_async_bulk_tensor_4d_global_to_shared_multicast(void* dst, const CUtensorMap* map, int c0,
                                                                                    int c1, int c2, int c3, uint64_t* bar,
                                                                                    uint16_t cta_mask) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n"
                 :: "r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "r"(smem_u32(bar)), "h"(cta_mask)
                 : "memory");
}

// Fetch the tensor map into the TMA unit's cache before the first copy needs it.
// PTX ISA: "Data Movement and Conversion Instructions: prefetch" (prefetch.tensormap).
__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// The other direction: copy a box from shared memory at `src` to the coordinates of `map` in global memory.
// Tracked by bulk groups of the issuing thread (no mbarrier). PTX ISA: "cp.async.bulk.tensor".
__device__ __forceinline__ void cp_async_bulk_tensor_4d_shared_to_global(const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                                                          const void* src) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
                 :: "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(src))
                 : "memory");
}
// Add a box of fp32 from shared memory at `src` (laid out as the map's swizzle says) into the tensor of `map` at
// coordinates (c0 innermost .. c3), element by element, in L2: a whole tile of partial sums by one instruction of one
// thread, where per-thread atomics take one instruction per pair of floats. Elements outside the tensor are left out.
// Tracked by bulk groups, as the store above. PTX ISA: "cp.reduce.async.bulk.tensor" (.add, f32 from the map).
__device__ __forceinline__ void cp_reduce_async_bulk_tensor_4d_add(const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                                                   const void* src) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
                 :: "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(src))
                 : "memory");
}
// Close the bulk copies issued so far by this thread into a group. PTX ISA: "cp.async.bulk.commit_group".
__device__ __forceinline__ void cp_async_bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's bulk groups still READ their shared-memory source (after which the
// source may be overwritten; the global writes may still be in flight). PTX ISA: "cp.async.bulk.wait_group".
template <int N>
__device__ __forceinline__ void cp_async_bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
// ... until at most N groups are still in flight at all.
template <int N>
__device__ __forceinline__ void cp_async_bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}
// Make this thread's ordinary shared-memory writes visible to the async proxy (the TMA unit) before a bulk
// copy reads them. PTX ISA: "Parallel Synchronization and Communication Instructions: membar/fence"
// (fence.proxy.async).
__device__ __forceinline__ void fence_proxy_async_shared_cta() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The same between the proxies' accesses to global memory: a TMA reduction issued after it sees what this thread
// acquired before it, and what a TMA reduction it waited for wrote is ordered before this thread's later release.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

// ---- host side ----

// The tensor map of one of the four [batch, heads, seqlen, head_dim] bf16 tensors (strides in elements, as
// in FwdParams; `type`: fp16 in the steps that take it, tma_type below; head_dim: HEAD_DIM but in the steps that take
// others, a multiple of 64), read in boxes of [box_rows, 64] with the
// 128-byte swizzle (common/swizzle.cuh: swizzle_tma_128b). TMA dims, innermost first: (dim, row, head, batch). A dimension whose stride is 0
// (k/v broadcast over heads or batch) is described as size 1: the kernel then asks for coordinate 0 there
// (tma_coord below). Returns a CUresult (0 = success).
inline int encode_tile_map(CUtensorMap* map, const void* base, const int64_t stride[3], int rows, int heads, int batch,
                           int box_rows, CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                           int head_dim = HEAD_DIM) {
    cudaError_t lookup = cudaSuccess;
    const auto encode = driver_cuTensorMapEncodeTiled(&lookup);
    if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
    constexpr uint64_t ELEM = sizeof(__nv_bfloat16);  // or __half's: the same 2 bytes
    const uint64_t row_bytes = uint64_t(stride[2]) * ELEM;
    // A broadcast dimension (stride 0) becomes size 1; its stride is then never used, but must be valid.
    const uint64_t head_bytes = stride[1] ? uint64_t(stride[1]) * ELEM : row_bytes;
    const uint64_t batch_bytes = stride[0] ? uint64_t(stride[0]) * ELEM : row_bytes;
    const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(rows), cuuint64_t(stride[1] ? heads : 1),
                                cuuint64_t(stride[0] ? batch : 1)};
    const cuuint64_t strides[3] = {row_bytes, head_bytes, batch_bytes};  // bytes, of dims 1..3 (dim 0 is contiguous)
    const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};          // 64 bf16 = one 128-byte swizzle row
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    return encode(map, type, 4, const_cast<void*>(base), dims, strides, box, elem_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// The TMA type of a kernel's 16-bit element type (a copy moves bytes; the map names what they are).
template <typename T>
constexpr CUtensorMapDataType tma_type =
    std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;

// The tensor map of a contiguous fp32 [batch, heads, rows, head_dim] accumulator (the backward's dQ; head_dim as in
// encode_tile_map, a multiple of 32), in boxes of
// [box_rows, 32] with the 128-byte swizzle: 32 floats are one 128-byte row of the swizzle, so a box row is the same
// 128-byte atom row as a bf16 tile's (common/swizzle.cuh), four boxes across the head dim. TMA dims, innermost first:
// (dim, row, head, batch). Returns a CUresult (0 = success).
inline int encode_accum_map(CUtensorMap* map, float* base, int rows, int heads, int batch, int box_rows,
                            int head_dim = HEAD_DIM) {
    cudaError_t lookup = cudaSuccess;
    const auto encode = driver_cuTensorMapEncodeTiled(&lookup);
    if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
    const uint64_t row_bytes = uint64_t(head_dim) * sizeof(float);
    const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(rows), cuuint64_t(heads), cuuint64_t(batch)};
    const cuuint64_t strides[3] = {row_bytes, row_bytes * rows, row_bytes * rows * heads};
    const cuuint32_t box[4] = {32, cuuint32_t(box_rows), 1, 1};
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// The coordinate to ask a tensor map for along a head or batch dimension of stride `stride`: 0 where the
// tensor is broadcast (encode_tile_map made that dimension size 1), else the index itself.
__device__ __forceinline__ int tma_coord(int64_t stride, int index) { return stride ? index : 0; }
