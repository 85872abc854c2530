// flashladder step05 -- double-buffered K/V: load tile j+1 while computing tile j.
//
// The ladder (docs/ladder.md): 01 plain CUDA -> 02 tensor cores -> 03 cp.async -> 04 swizzle ->
// 05 double buffering -> 06 instruction diet -> 07 two row blocks per warp -> 08 TMA -> 09 wgmma ->
// 10 warp specialization -> 11 ping-pong -> 12 conditional rescale -> 13 intra-warpgroup overlap -> 14 persistent.
//
// WHAT CHANGED FROM STEP04
//   K and V are double-buffered. Until now each tile was loaded, waited for, computed, and only then was the next one
//   requested: the tensor cores idled through every load's full latency, and the loads through every tile's math. Now
//   shared memory holds two stages of K and V (96 KB in all), and while the block computes tile j from one stage, the
//   cp.async copies of tile j+1 fill the other:
//       prologue: issue Q and tile 0; wait; barrier
//       loop j:   issue tile j+1 into stage (j+1)%2;  compute tile j from stage j%2;  wait; barrier
//   The one barrier per tile now does two jobs: tile j+1 is complete for every thread, and every warp is done reading
//   stage j%2, which the next iteration refills. Q's load also overlaps tile 0's.
//
// PREDICTION: with 8 warps per block and ~1-2 blocks per SM there is little else to hide a tile load behind, so
//   taking the loads off the critical path should pay well: +15-30%.
// MEASURED (results/h200/2026-12-01T09-46-07Z.json, H200, steady state, N = 4K / 8K / 16K):
//   218.5 / 227.7 / 232.6 -> 246.6 / 251.1 / 253.0 TFLOP/s (1.13 / 1.10 / 1.09x), 0.40x SDPA's cuDNN backend: the low end
//   of the prediction. With one 8-warp block per SM the warps still run in lock-step between barriers, and the tensor
//   pipe idles while all of them do their softmax at once; steps 06 and 07 attack that.
// CHECKED: every GPU check passed, and again as compute_80 PTX compiled by the driver
//   (results/h200/2026-12-01T09-46-07Z-logs/checks.log, ptx-jit.log).
#include "flashladder.cuh"
#include "ptx.cuh"
#include "swizzle.cuh"

// Runs on every GPU since Ampere: nothing in it needs more than sm_80 (common/build_step.py, TARGETS).
FLASHLADDER_TARGETS(sm80_and_later);

namespace {

constexpr int BLOCK_M = 128;                          // query rows per block
constexpr int BLOCK_N = 64;                           // keys per K/V tile
constexpr int NUM_WARPS = 8;
constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int ROWS_PER_WARP = BLOCK_M / NUM_WARPS;    // 16: one mma row block per warp
constexpr int S_BLOCKS = BLOCK_N / 8;                 // S = Q K^T: 8 accumulators of 16x8 per warp
constexpr int O_BLOCKS = HEAD_DIM / 8;                // O: 16 accumulators of 16x8 per warp
constexpr int QK_STEPS = HEAD_DIM / 16;               // k-steps of S = Q K^T over the head dim
constexpr int PV_STEPS = BLOCK_N / 16;                // k-steps of O += P V over the keys
constexpr int STAGES = 2;                             // K/V buffers: compute one while the other fills
constexpr int SMEM_BYTES = (BLOCK_M + 2 * STAGES * BLOCK_N) * HEAD_DIM * sizeof(__nv_bfloat16);  // Q, K, V
static_assert(ROWS_PER_WARP == 16, "each warp owns exactly one 16-row mma block");

// Start copying a [ROWS, HEAD_DIM] bf16 tile (rows `row_stride` elements apart in global memory) into a
// swizzled [ROWS, HEAD_DIM] shared-memory tile, 16 bytes per cp.async. The copies complete asynchronously:
// the caller commits them as a group and waits for the group before reading the tile.
template <int ROWS>
__device__ void load_tile_async(__nv_bfloat16* dst_smem, const __nv_bfloat16* src_gmem, int64_t row_stride) {
    constexpr int CHUNKS_PER_ROW = HEAD_DIM * sizeof(__nv_bfloat16) / 16;  // 16 x 16 B per row
    static_assert(ROWS * CHUNKS_PER_ROW % NUM_THREADS == 0, "every thread copies the same number of chunks");
    for (int i = 0; i < ROWS * CHUNKS_PER_ROW / NUM_THREADS; ++i) {
        const int c = threadIdx.x + i * NUM_THREADS;
        const int row = c / CHUNKS_PER_ROW, chunk = c % CHUNKS_PER_ROW;
        cp_async_cg_16(dst_smem + swizzle_128b<HEAD_DIM>(row, chunk * 8), src_gmem + row * row_stride + chunk * 8);
    }
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
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* Q_smem = reinterpret_cast<__nv_bfloat16*>(smem);  // [BLOCK_M, HEAD_DIM]
    __nv_bfloat16* K_smem = Q_smem + BLOCK_M * HEAD_DIM;              // [STAGES, BLOCK_N, HEAD_DIM]
    __nv_bfloat16* V_smem = K_smem + STAGES * BLOCK_N * HEAD_DIM;     // [STAGES, BLOCK_N, HEAD_DIM]

    const int q_tile = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quad_row = lane / 4;   // this lane holds rows quad_row and quad_row + 8 of the warp's 16
    const int quad_col = lane % 4;   // ... and columns 2*quad_col, 2*quad_col+1 of every 8-wide block
    const auto* q = static_cast<const __nv_bfloat16*>(p.q);
    const auto* k = static_cast<const __nv_bfloat16*>(p.k);
    const auto* v = static_cast<const __nv_bfloat16*>(p.v);

    // Step 1: the Q tile (loaded once) and K/V tile 0 (into stage 0), in flight together;
    // each warp then keeps its 16 x 128 slice of Q as 8 A fragments.
    const int num_kv_tiles = p.seqlen_k / BLOCK_N;
    load_tile_async<BLOCK_M>(Q_smem, row_ptr(q, p.q_stride, batch, head, int64_t(q_tile) * BLOCK_M), p.q_stride[2]);
    load_tile_async<BLOCK_N>(K_smem, row_ptr(k, p.k_stride, batch, head, 0), p.k_stride[2]);
    load_tile_async<BLOCK_N>(V_smem, row_ptr(v, p.v_stride, batch, head, 0), p.v_stride[2]);
    cp_async_commit_group();
    cp_async_wait_group<0>();  // this thread's copies have landed...
    __syncthreads();           // ...and so have everyone else's: Q_smem and stage 0 are complete
    uint32_t Q_frag[QK_STEPS][4];  // [16 rows, 16 dims] per k-step
    for (int kk = 0; kk < QK_STEPS; ++kk)  // lanes 0-15: rows 0-15 at dims kk*16; lanes 16-31: the same at +8
        ldmatrix_x4(Q_frag[kk], Q_smem + swizzle_128b<HEAD_DIM>(warp * ROWS_PER_WARP + lane % 16, kk * 16 + (lane / 16) * 8));

    float m_i[2] = {-INFINITY, -INFINITY};  // running max of rows quad_row, quad_row+8 (scaled scores)
    float l_i[2] = {0.f, 0.f};              // running sum of exp(score - m_i)
    float O_acc[O_BLOCKS][4];               // [16 rows, 128 dims] as 16 accumulators of 16x8
    for (int db = 0; db < O_BLOCKS; ++db)
        for (int i = 0; i < 4; ++i) O_acc[db][i] = 0.f;

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
        const __nv_bfloat16* K_tile = K_smem + (kv_tile % STAGES) * BLOCK_N * HEAD_DIM;  // this tile's stage
        const __nv_bfloat16* V_tile = V_smem + (kv_tile % STAGES) * BLOCK_N * HEAD_DIM;

        // Step 3: S = Q K^T on the tensor cores: [16 rows, 64 keys] per warp, in fp32 accumulators.
        float S_acc[S_BLOCKS][4];
        for (int nb = 0; nb < S_BLOCKS; ++nb)
            for (int i = 0; i < 4; ++i) S_acc[nb][i] = 0.f;
        for (int kk = 0; kk < QK_STEPS; ++kk) {
            for (int nb = 0; nb < S_BLOCKS; ++nb) {
                uint32_t K_frag[2];  // keys nb*8..+7, dims kk*16..+15: lanes 0-7 give dims +0, lanes 8-15 dims +8
                ldmatrix_x2(K_frag, K_tile + swizzle_128b<HEAD_DIM>(nb * 8 + lane % 8, kk * 16 + ((lane / 8) % 2) * 8));
                mma_m16n8k16_bf16_f32(S_acc[nb], Q_frag[kk], K_frag);
            }
        }

        // Step 4: the online-softmax update for this lane's two rows (r = 0: quad_row, r = 1: quad_row + 8).
        // S_acc[nb][2r], S_acc[nb][2r+1] are row r's scores; they become the probabilities P in place.
        for (int r = 0; r < 2; ++r) {
            float tile_max = -INFINITY;
            for (int nb = 0; nb < S_BLOCKS; ++nb) {
                S_acc[nb][2 * r] *= p.scale;
                S_acc[nb][2 * r + 1] *= p.scale;
                tile_max = fmaxf(tile_max, fmaxf(S_acc[nb][2 * r], S_acc[nb][2 * r + 1]));
            }
            const float m_new = fmaxf(m_i[r], quad_max(tile_max));
            const float alpha = expf(m_i[r] - m_new);  // exp(-inf) = 0 on the first tile
            float row_sum = 0.f;
            for (int nb = 0; nb < S_BLOCKS; ++nb) {
                S_acc[nb][2 * r] = expf(S_acc[nb][2 * r] - m_new);
                S_acc[nb][2 * r + 1] = expf(S_acc[nb][2 * r + 1] - m_new);
                row_sum += S_acc[nb][2 * r] + S_acc[nb][2 * r + 1];
            }
            l_i[r] = alpha * l_i[r] + quad_sum(row_sum);
            m_i[r] = m_new;
            for (int db = 0; db < O_BLOCKS; ++db) {
                O_acc[db][2 * r] *= alpha;
                O_acc[db][2 * r + 1] *= alpha;
            }
        }

        // Step 5: O += P V. Two neighbouring 8-key accumulators of P form one 16x16 A fragment (bf16).
        for (int kk = 0; kk < PV_STEPS; ++kk) {
            uint32_t P_frag[4];
            P_frag[0] = cvt_rn_bf16x2_f32(S_acc[2 * kk][0], S_acc[2 * kk][1]);          // row g,   keys +2t
            P_frag[1] = cvt_rn_bf16x2_f32(S_acc[2 * kk][2], S_acc[2 * kk][3]);          // row g+8, keys +2t
            P_frag[2] = cvt_rn_bf16x2_f32(S_acc[2 * kk + 1][0], S_acc[2 * kk + 1][1]);  // row g,   keys +8+2t
            P_frag[3] = cvt_rn_bf16x2_f32(S_acc[2 * kk + 1][2], S_acc[2 * kk + 1][3]);  // row g+8, keys +8+2t
            for (int db = 0; db < O_BLOCKS; ++db) {
                uint32_t V_frag[2];  // keys kk*16..+15, dims db*8..+7, transposed to k-major by ldmatrix
                ldmatrix_x2_trans(V_frag, V_tile + swizzle_128b<HEAD_DIM>(kk * 16 + lane % 16, db * 8));
                mma_m16n8k16_bf16_f32(O_acc[db], P_frag, V_frag);
            }
        }
        cp_async_wait_group<0>();  // this thread's copies of the next tile have landed...
        __syncthreads();  // ...and everyone's have; and every warp is done with this stage, refilled next iteration
    }

    // Step 6: the final normalization, once per row, and the log-sum-exp.
    for (int r = 0; r < 2; ++r) {
        const float inv_l = 1.f / l_i[r];
        const int64_t q_row = int64_t(q_tile) * BLOCK_M + warp * ROWS_PER_WARP + quad_row + 8 * r;
        __nv_bfloat16* O_gmem = row_ptr(static_cast<__nv_bfloat16*>(p.o), p.o_stride, batch, head, q_row);
        for (int db = 0; db < O_BLOCKS; ++db)
            *reinterpret_cast<__nv_bfloat162*>(O_gmem + db * 8 + 2 * quad_col) =
                __floats2bfloat162_rn(O_acc[db][2 * r] * inv_l, O_acc[db][2 * r + 1] * inv_l);
        if (quad_col == 0)
            p.lse[(int64_t(batch) * p.heads + head) * p.seqlen_q + q_row] = m_i[r] + logf(l_i[r]);
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
