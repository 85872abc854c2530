// flashladder step02 -- tensor cores: mma.sync.m16n8k16 (bf16 in, fp32 accumulate), fragments via ldmatrix.
//
// The ladder (docs/ladder.md): 01 plain CUDA -> 02 tensor cores -> 03 cp.async -> 04 swizzle ->
// 05 double buffering -> 06 instruction diet -> 07 two row blocks per warp -> 08 TMA -> 09 wgmma ->
// 10 warp specialization -> 11 ping-pong -> 12 conditional rescale -> 13 intra-warpgroup overlap -> 14 persistent.
//
// WHAT CHANGED FROM STEP01
//   Both matmuls move to the tensor cores: one warp-wide mma.sync.m16n8k16 multiplies a 16x16 bf16 tile by a 16x8 one
//   into a 16x8 fp32 accumulator, 4096 multiply-adds where step01 did 1 per FFMA per thread. A warp now owns 16 query
//   rows, and every matrix lives in registers as "fragments" in the layout mma expects (common/ptx.cuh draws it):
//     * Q: the warp's 16 x 128 slice is loaded once with ldmatrix.x4 into 8 A fragments (32 registers).
//     * S = Q K^T: K fragments come from shared memory with ldmatrix.x2 (K stored [key, dim] is mma's "col" B layout).
//     * softmax: lane l holds rows l/4 and l/4+8 of each 8-key block, so a row lives in a quad: two shuffles, as before.
//     * O += P V: two neighbouring 8-key blocks of S are exactly the A fragment of a 16-key slice of P, so P is rounded
//       to bf16 and used from registers, never through shared memory; V comes k-major through ldmatrix.x2.trans.
//   The block grows to 8 warps x 16 rows = 128 query rows (each K/V tile feeds twice the rows: half the K/V traffic
//   from L2); shared memory holds Q, K and V (64 KB). Still plain: copies staged through registers (step03), unswizzled
//   rows (step04), loads and math in turn (step05), libm's expf and ldmatrix.x2 (step06).
//
// PREDICTION: the matmuls were ~100% of step01's time; here they become cheap, and the tile loads, the barriers and the
//   softmax dominate. Well over 10x step01, far from FlashAttention-2 (~345 TFLOP/s): perhaps 100-150 TFLOP/s.
// MEASURED (results/h200/2026-12-01T09-46-07Z.json, H200, steady state, N = 4K / 8K / 16K):
//   2.3 / 2.3 / 2.3 -> 53.5 / 54.0 / 54.3 TFLOP/s (23.66 / 23.89 / 24.00x), 0.09x SDPA's cuDNN backend. Below the
//   prediction: every ldmatrix meets an 8-way bank conflict (its 8 rows are 256 bytes apart), so shared memory, not the
//   tensor cores, sets the pace; step04 shows how much (docs/design.md, "Bank conflicts").
// CHECKED: every GPU check passed, and again as compute_80 PTX compiled by the driver
//   (results/h200/2026-12-01T09-46-07Z-logs/checks.log, ptx-jit.log); test_sass.py finds HMMA and LDSM in its SASS.
#include "flashladder.cuh"
#include "ptx.cuh"

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
constexpr int SMEM_BYTES = (BLOCK_M + 2 * BLOCK_N) * HEAD_DIM * sizeof(__nv_bfloat16);  // Q, K, V
static_assert(ROWS_PER_WARP == 16, "each warp owns exactly one 16-row mma block");

// Copy a [ROWS, HEAD_DIM] bf16 tile (rows `row_stride` elements apart in global memory) into a dense
// [ROWS, HEAD_DIM] shared-memory tile, 16 bytes per thread per copy.
template <int ROWS>
__device__ void load_tile(__nv_bfloat16* dst_smem, const __nv_bfloat16* src_gmem, int64_t row_stride) {
    constexpr int CHUNKS_PER_ROW = HEAD_DIM * sizeof(__nv_bfloat16) / 16;  // 16 x 16 B per row
    static_assert(ROWS * CHUNKS_PER_ROW % NUM_THREADS == 0, "every thread copies the same number of chunks");
    for (int i = 0; i < ROWS * CHUNKS_PER_ROW / NUM_THREADS; ++i) {
        const int c = threadIdx.x + i * NUM_THREADS;
        const int row = c / CHUNKS_PER_ROW, chunk = c % CHUNKS_PER_ROW;
        const uint4 data = *reinterpret_cast<const uint4*>(src_gmem + row * row_stride + chunk * 8);
        *reinterpret_cast<uint4*>(dst_smem + row * HEAD_DIM + chunk * 8) = data;
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
    __nv_bfloat16* K_smem = Q_smem + BLOCK_M * HEAD_DIM;              // [BLOCK_N, HEAD_DIM]
    __nv_bfloat16* V_smem = K_smem + BLOCK_N * HEAD_DIM;              // [BLOCK_N, HEAD_DIM]

    const int q_tile = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quad_row = lane / 4;   // this lane holds rows quad_row and quad_row + 8 of the warp's 16
    const int quad_col = lane % 4;   // ... and columns 2*quad_col, 2*quad_col+1 of every 8-wide block
    const auto* q = static_cast<const __nv_bfloat16*>(p.q);
    const auto* k = static_cast<const __nv_bfloat16*>(p.k);
    const auto* v = static_cast<const __nv_bfloat16*>(p.v);

    // Step 1: the Q tile, loaded once; each warp keeps its 16 x 128 slice as 8 A fragments.
    load_tile<BLOCK_M>(Q_smem, row_ptr(q, p.q_stride, batch, head, int64_t(q_tile) * BLOCK_M), p.q_stride[2]);
    __syncthreads();  // Q_smem is complete
    uint32_t Q_frag[QK_STEPS][4];  // [16 rows, 16 dims] per k-step
    for (int kk = 0; kk < QK_STEPS; ++kk)  // lanes 0-15: rows 0-15 at dims kk*16; lanes 16-31: the same at +8
        ldmatrix_x4(Q_frag[kk], Q_smem + (warp * ROWS_PER_WARP + lane % 16) * HEAD_DIM + kk * 16 + (lane / 16) * 8);

    float m_i[2] = {-INFINITY, -INFINITY};  // running max of rows quad_row, quad_row+8 (scaled scores)
    float l_i[2] = {0.f, 0.f};              // running sum of exp(score - m_i)
    float O_acc[O_BLOCKS][4];               // [16 rows, 128 dims] as 16 accumulators of 16x8
    for (int db = 0; db < O_BLOCKS; ++db)
        for (int i = 0; i < 4; ++i) O_acc[db][i] = 0.f;

    for (int kv_tile = 0; kv_tile < p.seqlen_k / BLOCK_N; ++kv_tile) {
        // Step 2: bring in this K/V tile. The barrier after it makes every thread's copy visible.
        load_tile<BLOCK_N>(K_smem, row_ptr(k, p.k_stride, batch, head, int64_t(kv_tile) * BLOCK_N), p.k_stride[2]);
        load_tile<BLOCK_N>(V_smem, row_ptr(v, p.v_stride, batch, head, int64_t(kv_tile) * BLOCK_N), p.v_stride[2]);
        __syncthreads();  // K_smem, V_smem are complete

        // Step 3: S = Q K^T on the tensor cores: [16 rows, 64 keys] per warp, in fp32 accumulators.
        float S_acc[S_BLOCKS][4];
        for (int nb = 0; nb < S_BLOCKS; ++nb)
            for (int i = 0; i < 4; ++i) S_acc[nb][i] = 0.f;
        for (int kk = 0; kk < QK_STEPS; ++kk) {
            for (int nb = 0; nb < S_BLOCKS; ++nb) {
                uint32_t K_frag[2];  // keys nb*8..+7, dims kk*16..+15: lanes 0-7 give dims +0, lanes 8-15 dims +8
                ldmatrix_x2(K_frag, K_smem + (nb * 8 + lane % 8) * HEAD_DIM + kk * 16 + ((lane / 8) % 2) * 8);
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
                ldmatrix_x2_trans(V_frag, V_smem + (kk * 16 + lane % 16) * HEAD_DIM + db * 8);
                mma_m16n8k16_bf16_f32(O_acc[db], P_frag, V_frag);
            }
        }
        __syncthreads();  // everyone is done reading K_smem, V_smem before the next tile overwrites them
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
    // 64 KB of dynamic shared memory is above the 48 KB a block gets without asking (asked once per device).
    const cudaError_t err = raise_smem_limit_once<attention_fwd_kernel>(SMEM_BYTES);
    if (err != cudaSuccess) return err;
    const dim3 grid(params->seqlen_q / BLOCK_M, params->heads, params->batch);
    attention_fwd_kernel<<<grid, NUM_THREADS, SMEM_BYTES, stream>>>(*params);
    return cudaGetLastError();
}
