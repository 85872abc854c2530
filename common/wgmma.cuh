// flashladder/common/wgmma.cuh -- warpgroup MMA (wgmma, sm_90a) and the registers it needs (setmaxnreg).
//
// wgmma.mma_async is issued by a WARPGROUP: 4 consecutive warps (128 threads, the first warp index a
// multiple of 4) that together compute D[64 x N] (+)= A[64 x 16] . B[16 x N]. It is asynchronous: the
// instruction returns at once, the tensor cores read A and B (B always from shared memory, through a
// descriptor; A from shared memory too, or from registers) and write D in registers later. The rules:
//   wgmma_fence()            before the first wgmma that reads registers (accumulators, A fragments)
//                            written by ordinary instructions since the last wgmma;
//   wgmma_commit_group()     closes the wgmmas issued so far into one group;
//   wgmma_wait_group<N>()    waits until at most N groups are still running; only then may ordinary
//                            instructions read (or write) their accumulators.
//
// The accumulator D[64 x N] in registers (fp32, N/2 registers per thread): warp w of the warpgroup owns rows
// 16w..16w+15, laid out per 8-column block exactly as mma.m16n8k16's D (common/ptx.cuh): with g = lane/4,
// t = lane%4, register d[4j + 0..1] = (row 16w + g, cols 8j + 2t, +1), d[4j + 2..3] = (row 16w + g + 8, same
// cols). So a row of S lives in the 4 lanes of a quad, and two neighbouring 8-column blocks of S are
// exactly the A fragment of a 16-key slice of P for the next product, as in the mma.sync steps:
//
//        cols: 0 1 | 2 3 | 4 5 | 6 7 | 8 9 ...            (warp w, rows 16w + ...)
//   row  g   : t=0 | t=1 | t=2 | t=3 | t=0 ...  d[0..1], d[4..5], ...
//   row g+8  : t=0 | t=1 | t=2 | t=3 | t=0 ...  d[2..3], d[6..7], ...
#pragma once

#include <cstdint>
#include <type_traits>

#include "ptx.cuh"  // is_16bit_float: the types the MMAs below take

constexpr int WARPGROUP_THREADS = 128;  // 4 warps: the unit that issues a wgmma

// The accumulator fragment above, by its coordinates: the register of row g + 8 r (r = 0, 1) and column 8 nb + 2 t + i
// (i = 0, 1) of a thread of lane g * 4 + t, in 8-column block nb. Indexed with constants (unrolled loops), it is that
// register, as d[4 nb + 2 r + i] is.
template <int N>
__device__ __forceinline__ float& frag_at(float (&d)[N], int nb, int r, int i) { return d[4 * nb + 2 * r + i]; }

// ---- matrix descriptors ----
// A 64-bit description of a matrix in shared memory (PTX ISA: "Asynchronous Warpgroup Level Matrix
// Shared Memory Layout: Matrix Descriptor Format"):
//   bits  0-13  start address >> 4          bits 16-29  leading-dimension byte offset (LBO) >> 4
//   bits 32-45  stride-dimension byte offset (SBO) >> 4
//   bits 49-51  base offset (0: the swizzle atoms start 1024-byte aligned)
//   bits 62-63  swizzle: 0 none, 1 128-byte, 2 64-byte, 3 32-byte
// With the 128-byte swizzle (TMA's layout here, common/swizzle.cuh) the unit is an 8-row x 128-byte
// ATOM (1024 bytes), rows 128 bytes apart, and:
//   K-major (Q, K: [row, dim], K = dim contiguous): SBO = distance between 8-row groups (1024 in a dense
//     half-tile); LBO is unused, its field set to 1 (16 bytes) by convention. The next k-step of 16
//     elements starts 32 bytes further inside the atom: the hardware applies the XOR to the address it is given.
//   N-major (V: [key, dim], N = dim contiguous, K = key): LBO = distance between 64-column halves along N,
//     SBO = distance between 8-key groups along K (1024). The next k-step of 16 keys starts 2 atoms further.
constexpr uint64_t WGMMA_SWIZZLE_128B = 1;
__host__ __device__ constexpr uint64_t wgmma_desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                                  uint64_t swizzle = WGMMA_SWIZZLE_128B) {
    return uint64_t((smem_addr & 0x3FFFF) >> 4) | (uint64_t((lbo_bytes & 0x3FFFF) >> 4) << 16) |
           (uint64_t((sbo_bytes & 0x3FFFF) >> 4) << 32) | (swizzle << 62);
}
// The two layouts the steps use, both as TMA writes a tile (common/swizzle.cuh: 128-byte swizzle, dense
// 1024-byte atoms of 8 rows). K-major: Q and K, read along the head dim. N-major: V, read along the keys;
// `half_bytes` is the distance between its two 64-column halves (rows x 128 bytes).
constexpr uint32_t WGMMA_ATOM_BYTES = 8 * 128;  // one 8-row x 128-byte swizzle atom
__host__ __device__ constexpr uint64_t wgmma_desc_kmajor(uint32_t smem_addr) {
    return wgmma_desc(smem_addr, 16, WGMMA_ATOM_BYTES);
}
__host__ __device__ constexpr uint64_t wgmma_desc_nmajor(uint32_t smem_addr, uint32_t half_bytes) {
    return wgmma_desc(smem_addr, half_bytes, WGMMA_ATOM_BYTES);
}
// The descriptor of a matrix `bytes` further on in shared memory: the start address field plus bytes / 16, in
// the low word alone. Exact while the address stays below 256 KB (the field's 14 bits of address / 16), as every
// shared-memory address does. A loop over k-steps builds a descriptor once and advances it: one integer add per
// wgmma instead of the whole encoding (step17).
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) {
    const uint32_t lo = uint32_t(desc) + (bytes >> 4), hi = uint32_t(desc >> 32);
    uint64_t d;
    asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo), "r"(hi));
    return d;
}

// ---- ordering ----
// PTX ISA: "Asynchronous Warpgroup Level Matrix Instructions: wgmma.fence".
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// PTX ISA: "wgmma.commit_group".
__device__ __forceinline__ void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// PTX ISA: "wgmma.wait_group".
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// Not an instruction: tells the compiler that `r` may change here, so that it neither reads an accumulator
// before the wgmma_wait_group that makes it valid nor moves a write past the wgmma that reads it.
__device__ __forceinline__ void wgmma_fence_operand(float& r) { asm volatile("" : "+f"(r) :: "memory"); }
__device__ __forceinline__ void wgmma_fence_operand(uint32_t& r) { asm volatile("" : "+r"(r) :: "memory"); }
template <typename T, int N>
__device__ __forceinline__ void wgmma_fence_operands(T (&regs)[N]) {
    for (int i = 0; i < N; ++i) wgmma_fence_operand(regs[i]);
}
// Not about correctness: where ptxas puts a wait. The source order "work; wgmma_wait_group<0>()" does not
// make the work run while the group is in flight: ptxas may move the wait up, above independent work (steps
// 13-14 write their softmax there, and without this fence ptxas puts the wait for P V before its exponentials). With a
// CTA-scope memory fence just before the wait, ptxas (in these builds) keeps the wait below the work. A
// compiler's choice, not a rule of the ISA: verify/tests/test_sass.py checks the SASS of each step that relies
// on it. Cost: one MEMBAR, with nothing to wait for but the warp's last mbarrier arrive.
__device__ __forceinline__ void keep_work_before_wait() { asm volatile("fence.acq_rel.cta;\n" ::: "memory"); }

// ---- register budget per warpgroup ----
// Move registers between warpgroups at run time: a producer gives its registers up, the consumers take them.
// Needs a register cap at kernel entry (__launch_bounds__(threads, 1)). PTX ISA: "setmaxnreg".
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGS)); }

// ---- the MMAs (PTX ISA: "wgmma.mma_async"), one wrapper per shape the steps use ----
// Each takes its inputs' type T: bf16 (__nv_bfloat16, the default, every step's) or, from step40 on, fp16 (__half);
// the accumulator is fp32 either way. The instruction names the type (.bf16 or .f16), so each wrapper holds its asm
// once, in a macro of the type's name, and picks one of the two at compile time.
// D[64 x 128] (+)= A[64 x 16] . B[16 x 128], A and B both K-major in shared memory (Q and K stored
// [row, dim]) and given by descriptors. scale_d = 0: D = A.B (the first k-step of a new product).
template <typename T = __nv_bfloat16>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    static_assert(is_16bit_float<T>, "bf16 or fp16");
#define FLASHLADDER_WGMMA(TYPE) \
    asm volatile("{\n" \
                 ".reg .pred p;\n" \
                 "setp.ne.b32 p, %66, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
                 "%64, %65, p, 1, 1, 0, 0;\n" \
                 "}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d))
    if constexpr (std::is_same_v<T, __half>) FLASHLADDER_WGMMA("f16");
    else FLASHLADDER_WGMMA("bf16");
#undef FLASHLADDER_WGMMA
}

// D[64 x 128] (+)= A[64 x 16] . B[16 x 128], A from registers (each warp's 16 rows in mma.m16n8k16's A
// fragment layout, 4 registers), B N-major in shared memory (imm-trans-b = 1: V is stored [key, dim], so
// N = dim is its contiguous direction). scale_d as above.
template <typename T = __nv_bfloat16>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
    static_assert(is_16bit_float<T>, "bf16 or fp16");
#define FLASHLADDER_WGMMA(TYPE) \
    asm volatile("{\n" \
                 ".reg .pred p;\n" \
                 "setp.ne.b32 p, %69, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n" \
                 "}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
    if constexpr (std::is_same_v<T, __half>) FLASHLADDER_WGMMA("f16");
    else FLASHLADDER_WGMMA("bf16");
#undef FLASHLADDER_WGMMA
}

// D[64 x 64] (+)= A[64 x 16] . B[16 x 64], A from registers, B N-major in shared memory, as wgmma_m64n128k16_rs: the
// forward's O += P V at head dim 64 (step41). 32 fp32 registers per thread.
template <typename T = __nv_bfloat16>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
    static_assert(is_16bit_float<T>, "bf16 or fp16");
#define FLASHLADDER_WGMMA(TYPE) \
    asm volatile("{\n" \
                 ".reg .pred p;\n" \
                 "setp.ne.b32 p, %37, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n" \
                 "}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
    if constexpr (std::is_same_v<T, __half>) FLASHLADDER_WGMMA("f16");
    else FLASHLADDER_WGMMA("bf16");
#undef FLASHLADDER_WGMMA
}

// D[64 x 64] (+)= A[64 x 16] . B[16 x 64], A and B both in shared memory (descriptors): the backward's products
// (from step28), whose tiles of 64 queries give N = 64. TRANS_A / TRANS_B = 0: the operand is K-major (stored
// [row, k], like Q and K read along the head dim); 1: M- or N-major (stored [k, row], like V read along the keys;
// 16-bit types only). 32 fp32 registers per thread, laid out as above. scale_d = 0: D = A.B.
template <int TRANS_A, int TRANS_B, typename T = __nv_bfloat16>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    static_assert(is_16bit_float<T>, "bf16 or fp16");
#define FLASHLADDER_WGMMA(TYPE) \
    asm volatile("{\n" \
                 ".reg .pred p;\n" \
                 "setp.ne.b32 p, %34, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
                 "%32, %33, p, 1, 1, %35, %36;\n" \
                 "}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B))
    if constexpr (std::is_same_v<T, __half>) FLASHLADDER_WGMMA("f16");
    else FLASHLADDER_WGMMA("bf16");
#undef FLASHLADDER_WGMMA
}

// D[64 x 80] (+)= A[64 x 16] . B[16 x 80], both by descriptors, TRANS_A / TRANS_B as above: the backward's
// products over tiles of 80 queries (step38). 40 fp32 registers per thread, 10 blocks of 8 columns.
template <int TRANS_A, int TRANS_B, typename T = __nv_bfloat16>
__device__ __forceinline__ void wgmma_m64n80k16_ss(float (&d)[40], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    static_assert(is_16bit_float<T>, "bf16 or fp16");
#define FLASHLADDER_WGMMA(TYPE) \
    asm volatile("{\n" \
                 ".reg .pred p;\n" \
                 "setp.ne.b32 p, %42, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n80k16.f32." TYPE "." TYPE " " \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, " \
                 "%40, %41, p, 1, 1, %43, %44;\n" \
                 "}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]) \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B))
    if constexpr (std::is_same_v<T, __half>) FLASHLADDER_WGMMA("f16");
    else FLASHLADDER_WGMMA("bf16");
#undef FLASHLADDER_WGMMA
}
