// flashladder step07 -- two row blocks per warp: every K/V fragment feeds two mma (FlashAttention-2's tiling).
//
// The ladder (docs/ladder.md): 01 plain CUDA -> 02 tensor cores -> 03 cp.async -> 04 swizzle ->
// 05 double buffering -> 06 instruction diet -> 07 two row blocks per warp -> 08 TMA -> 09 wgmma ->
// 10 warp specialization -> 11 ping-pong -> 12 conditional rescale -> 13 intra-warpgroup overlap -> 14 persistent.
//
// WHAT CHANGED FROM STEP06
//   A warp now owns 32 query rows, two 16-row mma blocks: 4 warps x 32 rows make the same 128-row block. Every K and V
//   fragment a warp loads with ldmatrix now feeds TWO mma, one per row block, where step06 fed one: the shared-memory
//   traffic per mma falls by an estimated ~40% (Q's fragments, below, take back part of the half), and each warp has
//   twice as many independent mma in flight between its ldmatrix.
//   The price is registers. O (2 x 64) + S (2 x 32) accumulators per thread leave no room to keep Q in registers for
//   the whole loop: Q's fragments are re-read from shared memory at every k-step (two ldmatrix.x4, rows 0-15 and
//   16-31). The k-step loop of Q K^T stays rolled (#pragma unroll 1): unrolled, ptxas hoists the fragment loads of
//   later k-steps and spills at the 255-register limit. 4 warps x 255 registers let 2 blocks share an SM: 8 warps as
//   before, but from two blocks whose barriers do not line up, so one block's softmax can run beside the other's mma.
//
// PREDICTION: ~1.15-1.2x step06, FlashAttention-2's level (~1.0x SDPA's FLASH backend); the variants on the way are in
//   docs/design.md ("32 rows per warp, at the register file's limit").
// MEASURED (results/h200/2026-12-01T09-46-07Z.json, H200, steady state, N = 4K / 8K / 16K):
//   309.7 / 316.1 / 319.0 -> 350.3 / 360.2 / 359.4 TFLOP/s (1.13 / 1.14 / 1.13x), 0.57 / 0.58 / 0.57x SDPA's cuDNN
//   backend, 1.01 / 1.03 / 1.02x its FLASH backend in the same run: FlashAttention-2's level, as predicted.
// CHECKED: every GPU check passed, and again as compute_80 PTX compiled by the driver
//   (results/h200/2026-12-01T09-46-07Z-logs/checks.log, ptx-jit.log); ptxas reports no spill on any architecture.
#include "flashladder.cuh"
#include "ptx.cuh"
#include "swizzle.cuh"

// Runs on every GPU since Ampere: nothing in it needs more than sm_80 (common/build_step.py, TARGETS).
FLASHLADDER_TARGETS(sm80_and_later);

namespace {

constexpr int BLOCK_M = 128;                          // query rows per block
constexpr int BLOCK_N = 64;                           // keys per K/V tile
constexpr int NUM_WARPS = 4;
constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int ROWS_PER_WARP = BLOCK_M / NUM_WARPS;    // 32: two mma row blocks per warp
constexpr int M_BLOCKS = ROWS_PER_WARP / 16;          // every K/V fragment feeds M_BLOCKS mma
constexpr int S_BLOCKS = BLOCK_N / 8;                 // S = Q K^T: 8 accumulators of 16x8 per warp
constexpr int O_BLOCKS = HEAD_DIM / 8;                // O: 16 accumulators of 16x8 per warp
constexpr int QK_STEPS = HEAD_DIM / 16;               // k-steps of S = Q K^T over the head dim
constexpr int PV_STEPS = BLOCK_N / 16;                // k-steps of O += P V over the keys
constexpr int STAGES = 2;                             // K/V buffers: compute one while the other fills
constexpr int SMEM_BYTES = (BLOCK_M + 2 * STAGES * BLOCK_N) * HEAD_DIM * sizeof(__nv_bfloat16);  // Q, K, V
// Byte distances inside a swizzled [rows, HEAD_DIM] tile, for the XOR addressing:
constexpr int ROW_BYTES = HEAD_DIM * sizeof(__nv_bfloat16);  // 256: one row
constexpr int KSTEP_BYTES = 16 * sizeof(__nv_bfloat16);      // 32: 16 columns, one k-step of Q K^T
constexpr int DBLOCK_BYTES = 8 * sizeof(__nv_bfloat16);      // 16: 8 columns, one dim block of P V
static_assert(ROWS_PER_WARP % 16 == 0, "each warp owns whole 16-row mma blocks");

// Start copying a [ROWS, HEAD_DIM] bf16 tile (rows `row_stride` elements apart in global memory) into a
// swizzled [ROWS, HEAD_DIM] shared-memory tile, 16 bytes per cp.async. The copies complete asynchronously:
// the caller commits them as a group and waits for the group before reading the tile.
template <int ROWS>
__device__ void load_tile_async(__nv_bfloat16* dst_smem, const __nv_bfloat16* src_gmem, int64_t row_stride) {
    constexpr int CHUNKS_PER_ROW = ROW_BYTES / 16;  // 16 x 16 B per row
    static_assert(ROWS * CHUNKS_PER_ROW % NUM_THREADS == 0, "every thread copies the same number of chunks");
    constexpr int ROWS_PER_PASS = NUM_THREADS / CHUNKS_PER_ROW;
    const int row0 = threadIdx.x / CHUNKS_PER_ROW, chunk = threadIdx.x % CHUNKS_PER_ROW;
    const int stride = int(row_stride);  // in-tile offsets fit 32 bits (the binding keeps strides < 2^24)
    for (int i = 0; i < ROWS / ROWS_PER_PASS; ++i)
        cp_async_cg_16(dst_smem + swizzle_128b<HEAD_DIM>(row0 + i * ROWS_PER_PASS, chunk * 8),
                       src_gmem + ((row0 + i * ROWS_PER_PASS) * stride + chunk * 8));
}

// Max / sum over the 4 threads of a quad (lanes 4r..4r+3 of a warp hold one query row).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__global__ void __launch_bounds__(NUM_THREADS) attention_fwd_kernel(const FwdParams p) {
    // 1024-byte aligned: the XOR addressing below needs every tile base aligned to at least 256 bytes (the
    // XOR must only touch bits 4-7 of an address). Static __shared__ variables would shift this base.
    extern __shared__ __align__(1024) unsigned char smem[];
    __nv_bfloat16* Q_smem = reinterpret_cast<__nv_bfloat16*>(smem);  // [BLOCK_M, HEAD_DIM]
    __nv_bfloat16* K_smem = Q_smem + BLOCK_M * HEAD_DIM;              // [STAGES, BLOCK_N, HEAD_DIM]
    __nv_bfloat16* V_smem = K_smem + STAGES * BLOCK_N * HEAD_DIM;     // [STAGES, BLOCK_N, HEAD_DIM]

    const int q_tile = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quad_row = lane / 4;   // this lane holds rows quad_row and quad_row + 8 of each 16-row block
    const int quad_col = lane % 4;   // ... and columns 2*quad_col, 2*quad_col+1 of every 8-wide block
    const auto* q = static_cast<const __nv_bfloat16*>(p.q);
    const auto* k = static_cast<const __nv_bfloat16*>(p.k);
    const auto* v = static_cast<const __nv_bfloat16*>(p.v);

    // Step 1: the Q tile (loaded once) and K/V tile 0 (into stage 0), in flight together.
    const int num_kv_tiles = p.seqlen_k / BLOCK_N;
    load_tile_async<BLOCK_M>(Q_smem, row_ptr(q, p.q_stride, batch, head, int64_t(q_tile) * BLOCK_M), p.q_stride[2]);
    load_tile_async<BLOCK_N>(K_smem, row_ptr(k, p.k_stride, batch, head, 0), p.k_stride[2]);
    load_tile_async<BLOCK_N>(V_smem, row_ptr(v, p.v_stride, batch, head, 0), p.v_stride[2]);
    cp_async_commit_group();
    cp_async_wait_group<0>();  // this thread's copies have landed...
    __syncthreads();           // ...and so have everyone else's: Q_smem and stage 0 are complete

    // Each lane's ldmatrix byte address at k-step 0, block 0 (the lane patterns are step05's, with x4 for
    // K and V): another k-step is an XOR inside the 128-byte swizzle span, another block (of keys, dims or
    // query rows) a constant offset.
    //   Q: lanes 0-15 give rows 0-15 at dims +0, lanes 16-31 the same rows at dims +8.
    //   K: lanes 0-7 give keys 0-7 at dims +0, lanes 8-15 the same keys at dims +8, lanes 16-31 keys 8-15
    //      likewise: the B fragments of two 8-key blocks.
    //   V: lanes 0-15 give keys 0-15 at dims +0, lanes 16-31 the same keys at dims +8, transposed: the B
    //      fragments of two 8-dim blocks.
    const uint32_t Q_lane = smem_u32(Q_smem + swizzle_128b<HEAD_DIM>(warp * ROWS_PER_WARP + lane % 16, (lane / 16) * 8));
    const uint32_t K_lane = 2 * swizzle_128b<HEAD_DIM>((lane / 16) * 8 + lane % 8, ((lane / 8) % 2) * 8);  // bytes into a tile
    const uint32_t V_lane = 2 * swizzle_128b<HEAD_DIM>(lane % 16, (lane / 16) * 8);
    const float scale_log2 = p.scale * LOG2E;  // softmax scale * log2(e): exp(x*scale) = 2^(x*scale_log2)
    float m_i[M_BLOCKS][2];                 // running max of rows quad_row, quad_row+8 of each block (RAW scores)
    float l_i[M_BLOCKS][2];                 // this lane's part of the running sum of 2^((score - m_i) * scale_log2)
    float O_acc[M_BLOCKS][O_BLOCKS][4];     // [32 rows, 128 dims] as 2 x 16 accumulators of 16x8
    for (int mb = 0; mb < M_BLOCKS; ++mb) {
        m_i[mb][0] = m_i[mb][1] = -INFINITY;
        l_i[mb][0] = l_i[mb][1] = 0.f;
        for (int db = 0; db < O_BLOCKS; ++db)
            for (int i = 0; i < 4; ++i) O_acc[mb][db][i] = 0.f;
    }

    for (int kv_tile = 0; kv_tile < num_kv_tiles; ++kv_tile) {
        // Step 2: start the copies of the NEXT tile into the other stage; they land while this one computes.
        const int next = kv_tile + 1, next_stage = next % STAGES;
        if (next < num_kv_tiles) {
            load_tile_async<BLOCK_N>(K_smem + next_stage * BLOCK_N * HEAD_DIM,
                                     row_ptr(k, p.k_stride, batch, head, int64_t(next) * BLOCK_N), p.k_stride[2]);
            load_tile_async<BLOCK_N>(V_smem + next_stage * BLOCK_N * HEAD_DIM,
                                     row_ptr(v, p.v_stride, batch, head, int64_t(next) * BLOCK_N), p.v_stride[2]);
        }
        cp_async_commit_group();
        const uint32_t K_tile = smem_u32(K_smem + (kv_tile % STAGES) * BLOCK_N * HEAD_DIM) + K_lane;  // this tile's stage
        const uint32_t V_tile = smem_u32(V_smem + (kv_tile % STAGES) * BLOCK_N * HEAD_DIM) + V_lane;

        // Step 3: S = Q K^T on the tensor cores: [32 rows, 64 keys] per warp, in fp32 accumulators.
        // The k-step loop stays rolled: unrolled, ptxas hoists the fragment loads of later k-steps and
        // spills at the 255-register limit.
        float S_acc[M_BLOCKS][S_BLOCKS][4];
        for (int mb = 0; mb < M_BLOCKS; ++mb)
            for (int nb = 0; nb < S_BLOCKS; ++nb)
                for (int i = 0; i < 4; ++i) S_acc[mb][nb][i] = 0.f;
#pragma unroll 1
        for (int kk = 0; kk < QK_STEPS; ++kk) {
            uint32_t Q_frag[M_BLOCKS][4];  // re-read from shared memory: no registers left to keep all of Q
            for (int mb = 0; mb < M_BLOCKS; ++mb)
                ldmatrix_x4(Q_frag[mb], (Q_lane ^ (kk * KSTEP_BYTES)) + mb * 16 * ROW_BYTES);
            for (int nb = 0; nb < S_BLOCKS; nb += 2) {
                uint32_t K_frag[4];  // [0..1]: B fragment of key block nb, [2..3]: of key block nb+1, for BOTH row blocks
                ldmatrix_x4(K_frag, (K_tile ^ (kk * KSTEP_BYTES)) + nb * 8 * ROW_BYTES);
                for (int mb = 0; mb < M_BLOCKS; ++mb) {
                    mma_m16n8k16_bf16_f32(S_acc[mb][nb], Q_frag[mb], {K_frag[0], K_frag[1]});
                    mma_m16n8k16_bf16_f32(S_acc[mb][nb + 1], Q_frag[mb], {K_frag[2], K_frag[3]});
                }
            }
        }

        // Step 4: the online-softmax update for this lane's rows (r = 0: quad_row, r = 1: quad_row + 8 of
        // row block mb). S_acc[mb][nb][2r..2r+1] are raw scores; they become the probabilities P in place.
        for (int mb = 0; mb < M_BLOCKS; ++mb) {
            for (int r = 0; r < 2; ++r) {
                float tile_max = -INFINITY;
                for (int nb = 0; nb < S_BLOCKS; ++nb)
                    tile_max = fmaxf(tile_max, fmaxf(S_acc[mb][nb][2 * r], S_acc[mb][nb][2 * r + 1]));
                const float m_new = fmaxf(m_i[mb][r], quad_max(tile_max));
                const float alpha = ex2_approx_ftz((m_i[mb][r] - m_new) * scale_log2);  // 2^-inf = 0 on the first tile
                const float m_scaled = m_new * scale_log2;
                float row_sum = 0.f;
                for (int nb = 0; nb < S_BLOCKS; ++nb) {  // one FFMA + one MUFU.EX2 per element
                    S_acc[mb][nb][2 * r] = ex2_approx_ftz(fmaf(S_acc[mb][nb][2 * r], scale_log2, -m_scaled));
                    S_acc[mb][nb][2 * r + 1] = ex2_approx_ftz(fmaf(S_acc[mb][nb][2 * r + 1], scale_log2, -m_scaled));
                    row_sum += S_acc[mb][nb][2 * r] + S_acc[mb][nb][2 * r + 1];
                }
                l_i[mb][r] = alpha * l_i[mb][r] + row_sum;  // no shuffle: the quad's parts are added once, at the end
                m_i[mb][r] = m_new;
                for (int db = 0; db < O_BLOCKS; ++db) {
                    O_acc[mb][db][2 * r] *= alpha;
                    O_acc[mb][db][2 * r + 1] *= alpha;
                }
            }
        }

        // Step 5: O += P V. Two neighbouring 8-key accumulators of P form one 16x16 A fragment (bf16).
        for (int kk = 0; kk < PV_STEPS; ++kk) {
            uint32_t P_frag[M_BLOCKS][4];
            for (int mb = 0; mb < M_BLOCKS; ++mb) {
                P_frag[mb][0] = cvt_rn_bf16x2_f32(S_acc[mb][2 * kk][0], S_acc[mb][2 * kk][1]);          // row g,   keys +2t
                P_frag[mb][1] = cvt_rn_bf16x2_f32(S_acc[mb][2 * kk][2], S_acc[mb][2 * kk][3]);          // row g+8, keys +2t
                P_frag[mb][2] = cvt_rn_bf16x2_f32(S_acc[mb][2 * kk + 1][0], S_acc[mb][2 * kk + 1][1]);  // row g,   keys +8+2t
                P_frag[mb][3] = cvt_rn_bf16x2_f32(S_acc[mb][2 * kk + 1][2], S_acc[mb][2 * kk + 1][3]);  // row g+8, keys +8+2t
            }
            for (int db = 0; db < O_BLOCKS; db += 2) {
                uint32_t V_frag[4];  // [0..1]: B fragment of dim block db, [2..3]: of dim block db+1, for both row blocks
                ldmatrix_x4_trans(V_frag, (V_tile ^ (db * DBLOCK_BYTES)) + kk * 16 * ROW_BYTES);
                for (int mb = 0; mb < M_BLOCKS; ++mb) {
                    mma_m16n8k16_bf16_f32(O_acc[mb][db], P_frag[mb], {V_frag[0], V_frag[1]});
                    mma_m16n8k16_bf16_f32(O_acc[mb][db + 1], P_frag[mb], {V_frag[2], V_frag[3]});
                }
            }
        }
        cp_async_wait_group<0>();  // this thread's copies of the next tile have landed...
        __syncthreads();  // ...and everyone's have; and every warp is done with this stage, refilled next iteration
    }

    // Step 6: the row sums' quad parts added up, the final normalization, once per row, and the log-sum-exp.
    for (int mb = 0; mb < M_BLOCKS; ++mb) {
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(l_i[mb][r]);
            const float inv_l = 1.f / l;
            const int64_t q_row = int64_t(q_tile) * BLOCK_M + warp * ROWS_PER_WARP + mb * 16 + quad_row + 8 * r;
            __nv_bfloat16* O_gmem = row_ptr(static_cast<__nv_bfloat16*>(p.o), p.o_stride, batch, head, q_row);
            for (int db = 0; db < O_BLOCKS; ++db)
                *reinterpret_cast<__nv_bfloat162*>(O_gmem + db * 8 + 2 * quad_col) =
                    __floats2bfloat162_rn(O_acc[mb][db][2 * r] * inv_l, O_acc[mb][db][2 * r + 1] * inv_l);
            if (quad_col == 0)
                p.lse[(int64_t(batch) * p.heads + head) * p.seqlen_q + q_row] = m_i[mb][r] * p.scale + logf(l);
        }
    }
}

}  // namespace

// ---- host launcher: grid, block, shared memory, attributes ----
FLASHLADDER_EXPORT int flashladder_seqlen_multiple_q() { return BLOCK_M; }  // one block per BLOCK_M query rows
FLASHLADDER_EXPORT int flashladder_seqlen_multiple_k() { return BLOCK_N; }  // whole K/V tiles only
FLASHLADDER_EXPORT int flashladder_smem_bytes() { return SMEM_BYTES; }  // per block: the binding checks the GPU has it

FLASHLADDER_EXPORT int flashladder_fwd(const FwdParams* params, cudaStream_t stream) {
    // 96 KB of dynamic shared memory is above the 48 KB a block gets without asking (asked once per device).
    const cudaError_t err = raise_smem_limit_once<attention_fwd_kernel>(SMEM_BYTES);
    if (err != cudaSuccess) return err;
    const dim3 grid(params->seqlen_q / BLOCK_M, params->heads, params->batch);
    attention_fwd_kernel<<<grid, NUM_THREADS, SMEM_BYTES, stream>>>(*params);
    return cudaGetLastError();
}
