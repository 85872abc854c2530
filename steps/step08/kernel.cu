// flashladder step08 -- TMA: bulk tensor copies into a K/V ring whose slots complete on mbarriers; its zero fill gives any seqlen.
//
// The ladder (docs/ladder.md): 01 plain CUDA -> 02 tensor cores -> 03 cp.async -> 04 swizzle ->
// 05 double buffering -> 06 instruction diet -> 07 two row blocks per warp -> 08 TMA -> 09 wgmma ->
// 10 warp specialization -> 11 ping-pong -> 12 conditional rescale -> 13 intra-warpgroup overlap -> 14 persistent.
//
// WHAT CHANGED FROM STEP07
//   The first Hopper-only hardware: the Tensor Memory Accelerator (TMA) loads the tiles. Until now every thread issued
//   16-byte cp.async copies with their address math; now ONE thread asks for a whole tile with cp.async.bulk.tensor
//   (common/tma.cuh): the TMA unit walks the tensor through a tensor map (built on the host from its shape and strides,
//   a __grid_constant__ parameter), writes shared memory already swizzled (a 256-byte row as two 64-column halves,
//   swizzle_tma_128b), and counts the bytes off an mbarrier (common/mbarrier.cuh).
//   * The ring: STAGES = 2 slots, each with a "full" mbarrier for K and one for V. Thread 0 arrives with expect_tx and
//     issues the copies; every thread waits on the slot's phase, tile j on parity (j / STAGES) % 2, so Q K^T starts as
//     soon as K is in. A __syncthreads after tile j frees slot j % 2, refilled with tile j + 2.
//   * Any sequence length: a load's rows past the tensor's end arrive as zeros. Tiles are counted with a ceiling, the
//     zero keys' scores become -inf, the stores skip rows past seqlen_q, and the K/V walk runs from the LAST tile to
//     the first, so only tile 0 is partial, masked behind a branch taken once.
//   The math is untouched: mma.sync with ldmatrix fragments, 4 warps x 32 rows, 2 blocks per SM.
//
// PREDICTION: +0-3%: the copies were never the bottleneck, and TMA saves only issue slots (~24 instructions per thread
//   per tile of ~1700). It matters later: wgmma (step09) reads this layout, and one producer warp (step10) keeps the
//   ring full. Any seqlen: free at the lengths of record (one compare per tile).
// MEASURED (results/h200/2026-12-01T09-46-07Z.json, H200, steady state, N = 4K / 8K / 16K):
//   350.3 / 360.2 / 359.4 -> 376.3 / 379.9 / 385.3 TFLOP/s (1.07 / 1.05 / 1.07x), 0.61x SDPA's cuDNN backend: above the
//   prediction; not profiled (likely: the copies take no issue slots and no registers from a kernel at its limit).
// CHECKED: every GPU check passed, ragged lengths included, and they fail on a copy without the tail mask; memcheck and
//   racecheck clean (results/h200/2026-12-01T09-46-07Z-logs/checks.log, broken-copies.log, sanitizer_08_14.txt).
#include "flashladder.cuh"
#include "mbarrier.cuh"
#include "ptx.cuh"
#include "swizzle.cuh"
#include "tma.cuh"

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
constexpr int STAGES = 2;                             // K/V ring slots: compute one while the other fills
// Byte distances inside a TMA-swizzled [rows, HEAD_DIM] tile (common/swizzle.cuh: two 64-column halves),
// for the XOR addressing:
constexpr int ROW_BYTES = TMA_HALF_COLS * sizeof(__nv_bfloat16);  // 128: one row of one half
constexpr int KSTEP_BYTES = 16 * sizeof(__nv_bfloat16);           // 32: 16 columns, one k-step of Q K^T
constexpr int DBLOCK_BYTES = 8 * sizeof(__nv_bfloat16);           // 16: 8 columns, one dim block of P V
constexpr int KSTEPS_PER_HALF = TMA_HALF_COLS / 16;               // k-steps 0-3 read half 0, 4-7 half 1
constexpr int DBLOCKS_PER_HALF = TMA_HALF_COLS / 8;               // dim blocks 0-7 in half 0, 8-15 in half 1
static_assert(ROWS_PER_WARP % 16 == 0, "each warp owns whole 16-row mma blocks");

// Shared memory. The tiles first, each 1024-byte aligned: TMA's 128-byte swizzle is a function of the
// address bits 4-9, so every tile must start on a 1024-byte boundary for the XOR addressing below to match
// what TMA wrote.
struct alignas(1024) SharedStorage {
    __nv_bfloat16 Q[BLOCK_M * HEAD_DIM];          // [2 halves, BLOCK_M, 64]
    __nv_bfloat16 K[STAGES][BLOCK_N * HEAD_DIM];  // [2 halves, BLOCK_N, 64] per slot
    __nv_bfloat16 V[STAGES][BLOCK_N * HEAD_DIM];
    uint64_t Q_full;                              // Q has landed (one phase)
    uint64_t K_full[STAGES], V_full[STAGES];      // slot s holds its tile: thread 0's expect_tx + TMA bytes
};
constexpr int SMEM_BYTES = sizeof(SharedStorage);

// The K/V walk runs from the last tile to the first: the one partial tile (seqlen_k not a multiple of BLOCK_N)
// is the first one, and only its scores are masked.
__device__ __forceinline__ int kv_row(int kv_tile, int num_kv_tiles) { return (num_kv_tiles - 1 - kv_tile) * BLOCK_N; }

// One thread asks the TMA unit for a [ROWS, HEAD_DIM] tile starting at `row` of (head, batch): two boxes of
// [ROWS, 64] (the two swizzled halves), both completing on `bar`, which first learns how many bytes to expect.
// Rows past the tensor's end arrive as zeros.
template <int ROWS>
__device__ void load_tile_tma(__nv_bfloat16* dst_smem, const CUtensorMap* map, int row, int head, int batch, uint64_t* bar) {
    mbarrier_arrive_expect_tx(bar, ROWS * HEAD_DIM * sizeof(__nv_bfloat16));
    cp_async_bulk_tensor_4d_global_to_shared(dst_smem, map, 0, row, head, batch, bar);
    cp_async_bulk_tensor_4d_global_to_shared(dst_smem + ROWS * TMA_HALF_COLS, map, TMA_HALF_COLS, row, head, batch, bar);
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

// The tensor maps are kernel parameters (__grid_constant__): the TMA unit reads them from parameter memory.
__global__ void __launch_bounds__(NUM_THREADS)
    attention_fwd_kernel(const FwdParams p, const __grid_constant__ CUtensorMap Q_map,
                         const __grid_constant__ CUtensorMap K_map, const __grid_constant__ CUtensorMap V_map) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

    const int q_tile = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quad_row = lane / 4;   // this lane holds rows quad_row and quad_row + 8 of each 16-row block
    const int quad_col = lane % 4;   // ... and columns 2*quad_col, 2*quad_col+1 of every 8-wide block
    const int num_kv_tiles = ceil_div(p.seqlen_k, BLOCK_N);  // the last one may be partial: TMA fills zeros
    // Issued by thread 0 only. The head and batch coordinates are recomputed from the parameters at each
    // call rather than kept in registers all loop long (this kernel has none to spare).
    auto load_kv = [&](int kv_tile, int stage) {
        const int row = kv_row(kv_tile, num_kv_tiles);
        load_tile_tma<BLOCK_N>(smem.K[stage], &K_map, row, tma_coord(p.k_stride[1], head),
                               tma_coord(p.k_stride[0], batch), &smem.K_full[stage]);
        load_tile_tma<BLOCK_N>(smem.V[stage], &V_map, row, tma_coord(p.v_stride[1], head),
                               tma_coord(p.v_stride[0], batch), &smem.V_full[stage]);
    };

    // Step 1: thread 0 sets up the barriers (one arrival each: its own expect_tx) and fills the ring: Q
    // and the first STAGES K/V tiles are in flight together. Everyone else goes straight to waiting.
    if (threadIdx.x == 0) {
        mbarrier_init(&smem.Q_full, 1);
        for (int s = 0; s < STAGES; ++s) mbarrier_init(&smem.K_full[s], 1), mbarrier_init(&smem.V_full[s], 1);
        fence_mbarrier_init();  // the inits are visible to the TMA unit before the first copy completes on them
        prefetch_tensormap(&Q_map), prefetch_tensormap(&K_map), prefetch_tensormap(&V_map);
        load_tile_tma<BLOCK_M>(smem.Q, &Q_map, q_tile * BLOCK_M, tma_coord(p.q_stride[1], head), tma_coord(p.q_stride[0], batch),
                               &smem.Q_full);
        for (int s = 0; s < STAGES && s < num_kv_tiles; ++s) load_kv(s, s);
    }
    __syncthreads();               // no thread waits on a barrier before thread 0 has initialized it
    mbarrier_wait_parity(&smem.Q_full, 0);  // Q's one and only phase

    // Each lane's ldmatrix byte address at k-step 0, block 0 (the lane patterns are step05's, with x4 for
    // K and V): another k-step is an XOR inside the 128-byte swizzle span plus a half's offset, another block
    // (of keys, dims or query rows) a constant offset.
    //   Q: lanes 0-15 give rows 0-15 at dims +0, lanes 16-31 the same rows at dims +8.
    //   K: lanes 0-7 give keys 0-7 at dims +0, lanes 8-15 the same keys at dims +8, lanes 16-31 keys 8-15
    //      likewise: the B fragments of two 8-key blocks.
    //   V: lanes 0-15 give keys 0-15 at dims +0, lanes 16-31 the same keys at dims +8, transposed: the B
    //      fragments of two 8-dim blocks.
    const uint32_t Q_lane = smem_u32(smem.Q + swizzle_tma_128b<BLOCK_M>(warp * ROWS_PER_WARP + lane % 16, (lane / 16) * 8));
    const uint32_t K_lane = 2 * swizzle_tma_128b<BLOCK_N>((lane / 16) * 8 + lane % 8, ((lane / 8) % 2) * 8);  // bytes into a tile
    const uint32_t V_lane = 2 * swizzle_tma_128b<BLOCK_N>(lane % 16, (lane / 16) * 8);
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
    const int first_tile_keys = p.seqlen_k - (num_kv_tiles - 1) * BLOCK_N;  // 1 .. BLOCK_N: K/V tile 0 is the last

    constexpr int KV_HALF_BYTES = BLOCK_N * ROW_BYTES, Q_HALF_BYTES = BLOCK_M * ROW_BYTES;
    for (int kv_tile = 0; kv_tile < num_kv_tiles; ++kv_tile) {
        // Step 2: refill the slot the previous tile freed (every warp passed the barrier at the end of the
        // last iteration) with the tile STAGES ahead of it. Done here rather than at the end of the last
        // iteration, where the O and S accumulators leave thread 0 too few registers for the copy's operands.
        const int refill = kv_tile - 1 + STAGES;
        if (threadIdx.x == 0 && kv_tile > 0 && refill < num_kv_tiles) load_kv(refill, (kv_tile - 1) % STAGES);

        // This tile's slot, and the parity of its fill (the slot's n-th use completes phase n).
        const int stage = kv_tile % STAGES;
        const uint32_t parity = (kv_tile / STAGES) % 2;
        const uint32_t K_tile = smem_u32(smem.K[stage]) + K_lane;
        const uint32_t V_tile = smem_u32(smem.V[stage]) + V_lane;
        mbarrier_wait_parity(&smem.K_full[stage], parity);  // K has landed (V may still be on its way)

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
                ldmatrix_x4(Q_frag[mb], (Q_lane ^ (kk % KSTEPS_PER_HALF * KSTEP_BYTES)) + kk / KSTEPS_PER_HALF * Q_HALF_BYTES
                                            + mb * 16 * ROW_BYTES);
            for (int nb = 0; nb < S_BLOCKS; nb += 2) {
                uint32_t K_frag[4];  // [0..1]: B fragment of key block nb, [2..3]: of key block nb+1, for BOTH row blocks
                ldmatrix_x4(K_frag, (K_tile ^ (kk % KSTEPS_PER_HALF * KSTEP_BYTES)) + kk / KSTEPS_PER_HALF * KV_HALF_BYTES
                                    + nb * 8 * ROW_BYTES);
                for (int mb = 0; mb < M_BLOCKS; ++mb) {
                    mma_m16n8k16_bf16_f32(S_acc[mb][nb], Q_frag[mb], {K_frag[0], K_frag[1]});
                    mma_m16n8k16_bf16_f32(S_acc[mb][nb + 1], Q_frag[mb], {K_frag[2], K_frag[3]});
                }
            }
        }

        // Any seqlen_k: tile 0 may hold fewer than BLOCK_N keys. TMA filled the rest of its K and V with zeros,
        // whose scores (0, not -inf) must not count: they become -inf before the softmax (2^-inf = 0).
        if (kv_tile == 0 && first_tile_keys < BLOCK_N)
            for (int mb = 0; mb < M_BLOCKS; ++mb)
                for (int nb = 0; nb < S_BLOCKS; ++nb)
                    for (int i = 0; i < 4; ++i)  // S_acc[mb][nb][i] is key 8 nb + 2 quad_col + i % 2 (common/ptx.cuh)
                        if (8 * nb + 2 * quad_col + i % 2 >= first_tile_keys) S_acc[mb][nb][i] = -INFINITY;

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
        mbarrier_wait_parity(&smem.V_full[stage], parity);
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
                ldmatrix_x4_trans(V_frag, (V_tile ^ (db % DBLOCKS_PER_HALF * DBLOCK_BYTES)) + db / DBLOCKS_PER_HALF * KV_HALF_BYTES
                                          + kk * 16 * ROW_BYTES);
                for (int mb = 0; mb < M_BLOCKS; ++mb) {
                    mma_m16n8k16_bf16_f32(O_acc[mb][db], P_frag[mb], {V_frag[0], V_frag[1]});
                    mma_m16n8k16_bf16_f32(O_acc[mb][db + 1], P_frag[mb], {V_frag[2], V_frag[3]});
                }
            }
        }
        __syncthreads();  // every warp is done reading this slot: it may be refilled (next iteration, Step 2)
    }

    // Step 6: the row sums' quad parts added up, the final normalization, once per row, and the log-sum-exp.
    // Rows past seqlen_q (zeros from TMA) are computed, not stored.
    for (int mb = 0; mb < M_BLOCKS; ++mb) {
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(l_i[mb][r]);
            const float inv_l = 1.f / l;
            const int64_t q_row = int64_t(q_tile) * BLOCK_M + warp * ROWS_PER_WARP + mb * 16 + quad_row + 8 * r;
            if (q_row >= p.seqlen_q) continue;
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
FLASHLADDER_EXPORT int flashladder_seqlen_multiple_q() { return 1; }  // any seqlen: TMA fills the last tiles with zeros
FLASHLADDER_EXPORT int flashladder_seqlen_multiple_k() { return 1; }
FLASHLADDER_EXPORT int flashladder_tile_q() { return BLOCK_M; }  // the tiles (for tests and tools)
FLASHLADDER_EXPORT int flashladder_tile_k() { return BLOCK_N; }

FLASHLADDER_EXPORT int flashladder_fwd(const FwdParams* params, cudaStream_t stream) {
    // 96 KB of dynamic shared memory is above the 48 KB a block gets without asking (asked once per device).
    const cudaError_t err = raise_smem_limit_once<attention_fwd_kernel>(SMEM_BYTES);
    if (err != cudaSuccess) return err;
    // The tensor maps, encoded on the host for every call (host work only, no round trip to the GPU; the
    // cost is measured in docs/design.md, "TMA: tensor maps encoded per call"); they travel in the launch's parameters.
    const FwdParams& p = *params;
    CUtensorMap Q_map, K_map, V_map;
    if (encode_tile_map(&Q_map, p.q, p.q_stride, p.seqlen_q, p.heads, p.batch, BLOCK_M) != CUDA_SUCCESS ||
        encode_tile_map(&K_map, p.k, p.k_stride, p.seqlen_k, p.heads, p.batch, BLOCK_N) != CUDA_SUCCESS ||
        encode_tile_map(&V_map, p.v, p.v_stride, p.seqlen_k, p.heads, p.batch, BLOCK_N) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;  // a layout the TMA unit cannot describe (the binding's checks should prevent it)
    const dim3 grid(ceil_div(p.seqlen_q, BLOCK_M), p.heads, p.batch);
    attention_fwd_kernel<<<grid, NUM_THREADS, SMEM_BYTES, stream>>>(p, Q_map, K_map, V_map);
    return cudaGetLastError();
}
