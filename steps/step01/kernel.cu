// flashladder step01 -- the algorithm, plainly: tiles in shared memory, online softmax in fp32, scalar FMAs.
//
// The ladder (docs/ladder.md): 01 plain CUDA -> 02 tensor cores -> 03 cp.async -> 04 swizzle ->
// 05 double buffering -> 06 instruction diet -> 07 two row blocks per warp -> 08 TMA -> 09 wgmma ->
// 10 warp specialization -> 11 ping-pong -> 12 conditional rescale -> 13 intra-warpgroup overlap -> 14 persistent.
//
// WHAT THIS STEP IS
//   O = softmax(Q K^T * scale) V and LSE = logsumexp(Q K^T * scale), the FlashAttention way, in the plainest correct
//   CUDA: scalar fp32 FMAs, no tensor cores, no tricks. S = Q K^T is never formed (N x N per head: 1 GiB at N = 16K):
//   a block owns BLOCK_M query rows and streams over the keys in tiles of BLOCK_N, folds each tile's scores into a
//   running result in fast on-chip memory and throws them away. Global memory sees Q, K, V once per block and O, LSE
//   once: O(N * d) traffic instead of O(N^2).
//
// THE ONLINE-SOFTMAX UPDATE (per query row; m = running max, l = running sum, O_acc = running output)
//   Start: m = -inf, l = 0, O_acc = 0. For each key tile j with scores s_j (a row of BLOCK_N numbers):
//       m_new = max(m, max(s_j));   alpha = exp(m - m_new);   p_j = exp(s_j - m_new)       // all <= 1
//       l = alpha * l + sum(p_j);   O_acc = alpha * O_acc + p_j V_j;   m = m_new
//   After the last tile: O = O_acc / l and LSE = m + log(l). Every exp() argument is <= 0, so nothing overflows
//   even for logits of 1e4. verify/model.py is the same loop in float64 numpy.
//
// HOW THE WORK IS SPLIT: one block of 256 threads per 64 query rows of one (batch, head). A quad of 4 threads owns a
//   row: thread `part` computes key columns part, part+4, ... and output dims [part*32, part*32+32), and the quad
//   combines its max and sum with two shuffles. Shared memory holds Q, the current K and V tiles and P: 64 KB, above
//   the 48 KB default, so the launcher raises the block's limit.
//
// MEASURED (results/h200/2026-12-01T09-46-07Z.json, H200, steady state): 2.3 TFLOP/s at every N, 0.0036-0.0037x SDPA's
//   cuDNN backend. Meant to be slow: every multiply-add is a scalar FFMA fed from shared memory; step02 uses the tensor cores.
// CHECKED: every GPU check passed on this build, and again as compute_80 PTX compiled by the driver, the code a GPU
//   other than Hopper runs (results/h200/2026-12-01T09-46-07Z-logs/checks.log, ptx-jit.log).
#include "flashladder.cuh"

// Runs on every GPU since Ampere: nothing in it needs more than sm_80 (common/build_step.py, TARGETS).
FLASHLADDER_TARGETS(sm80_and_later);

namespace {

constexpr int BLOCK_M = 64;                                // query rows per block
constexpr int BLOCK_N = 64;                                // keys per K/V tile
constexpr int NUM_THREADS = 256;
constexpr int THREADS_PER_ROW = NUM_THREADS / BLOCK_M;     // 4: a quad of lanes per query row
constexpr int COLS_PER_THREAD = BLOCK_N / THREADS_PER_ROW; // 16 score columns per thread
constexpr int DIMS_PER_THREAD = HEAD_DIM / THREADS_PER_ROW; // 32 output dims per thread
constexpr int SMEM_BYTES = (BLOCK_M + 2 * BLOCK_N) * HEAD_DIM * sizeof(__nv_bfloat16)  // Q, K, V
                         + BLOCK_M * BLOCK_N * sizeof(float);                          // P
static_assert(NUM_THREADS % BLOCK_M == 0 && THREADS_PER_ROW == 4, "the quad shuffles assume 4 threads per row");

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
    float* P_smem = reinterpret_cast<float*>(V_smem + BLOCK_N * HEAD_DIM);  // [BLOCK_M, BLOCK_N]

    const int q_tile = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const int row = threadIdx.x / THREADS_PER_ROW;   // this thread's query row within the tile
    const int part = threadIdx.x % THREADS_PER_ROW;  // which quarter of the row's work it does
    const auto* q = static_cast<const __nv_bfloat16*>(p.q);
    const auto* k = static_cast<const __nv_bfloat16*>(p.k);
    const auto* v = static_cast<const __nv_bfloat16*>(p.v);

    // Step 1: the Q tile, loaded once and reused against every K/V tile.
    load_tile<BLOCK_M>(Q_smem, row_ptr(q, p.q_stride, batch, head, int64_t(q_tile) * BLOCK_M), p.q_stride[2]);

    float m_i = -INFINITY;             // running max of this row's scaled scores
    float l_i = 0.f;                   // running sum of exp(score - m_i)
    float O_rmem[DIMS_PER_THREAD];     // running unnormalized output, dims [part*32, part*32+32)
    for (int d = 0; d < DIMS_PER_THREAD; ++d) O_rmem[d] = 0.f;

    for (int kv_tile = 0; kv_tile < p.seqlen_k / BLOCK_N; ++kv_tile) {
        // Step 2: bring in this K/V tile. The barrier after it makes every thread's copy visible.
        load_tile<BLOCK_N>(K_smem, row_ptr(k, p.k_stride, batch, head, int64_t(kv_tile) * BLOCK_N), p.k_stride[2]);
        load_tile<BLOCK_N>(V_smem, row_ptr(v, p.v_stride, batch, head, int64_t(kv_tile) * BLOCK_N), p.v_stride[2]);
        __syncthreads();  // K_smem, V_smem (and Q_smem, the first time) are complete

        // Step 3: scores S = Q K^T * scale for this thread's 16 columns, and the tile's row max.
        float S_rmem[COLS_PER_THREAD];
        float tile_max = -INFINITY;
        for (int j = 0; j < COLS_PER_THREAD; ++j) {
            const int col = part + j * THREADS_PER_ROW;
            float dot = 0.f;
            for (int d = 0; d < HEAD_DIM; ++d)
                dot = fmaf(__bfloat162float(Q_smem[row * HEAD_DIM + d]), __bfloat162float(K_smem[col * HEAD_DIM + d]), dot);
            S_rmem[j] = dot * p.scale;
            tile_max = fmaxf(tile_max, S_rmem[j]);
        }

        // Step 4: the online-softmax update of m_i and l_i; P goes to shared memory for step 5.
        const float m_new = fmaxf(m_i, quad_max(tile_max));
        const float alpha = expf(m_i - m_new);  // exp(-inf) = 0 on the first tile: nothing to rescale
        float row_sum = 0.f;
        for (int j = 0; j < COLS_PER_THREAD; ++j) {
            const float prob = expf(S_rmem[j] - m_new);
            P_smem[row * BLOCK_N + part + j * THREADS_PER_ROW] = prob;
            row_sum += prob;
        }
        l_i = alpha * l_i + quad_sum(row_sum);
        m_i = m_new;
        __syncwarp();  // a row's 4 threads are in one warp: their P_smem writes are visible to each other

        // Step 5: O_acc = alpha * O_acc + P V for this thread's 32 output dims.
        for (int d = 0; d < DIMS_PER_THREAD; ++d) O_rmem[d] *= alpha;
        for (int col = 0; col < BLOCK_N; ++col) {
            const float prob = P_smem[row * BLOCK_N + col];
            for (int d = 0; d < DIMS_PER_THREAD; ++d)
                O_rmem[d] = fmaf(prob, __bfloat162float(V_smem[col * HEAD_DIM + part * DIMS_PER_THREAD + d]), O_rmem[d]);
        }
        __syncthreads();  // everyone is done reading K_smem, V_smem, P_smem before the next tile overwrites them
    }

    // Step 6: the final normalization, once per row, and the log-sum-exp.
    const float inv_l = 1.f / l_i;
    const int64_t q_row = int64_t(q_tile) * BLOCK_M + row;
    __nv_bfloat16* O_gmem = row_ptr(static_cast<__nv_bfloat16*>(p.o), p.o_stride, batch, head, q_row) + part * DIMS_PER_THREAD;
    for (int d = 0; d < DIMS_PER_THREAD; d += 2)
        *reinterpret_cast<__nv_bfloat162*>(O_gmem + d) = __floats2bfloat162_rn(O_rmem[d] * inv_l, O_rmem[d + 1] * inv_l);
    if (part == 0)
        p.lse[(int64_t(batch) * p.heads + head) * p.seqlen_q + q_row] = m_i + logf(l_i);
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
