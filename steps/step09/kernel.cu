// flashladder step09 -- wgmma: warpgroup MMA, S = Q K^T straight from shared memory, O += P V with P in registers.
//
// The ladder (docs/ladder.md): 01 plain CUDA -> 02 tensor cores -> 03 cp.async -> 04 swizzle ->
// 05 double buffering -> 06 instruction diet -> 07 two row blocks per warp -> 08 TMA -> 09 wgmma ->
// 10 warp specialization -> 11 ping-pong -> 12 conditional rescale -> 13 intra-warpgroup overlap -> 14 persistent.
//
// WHAT CHANGED FROM STEP08
//   Both matmuls move from mma.sync (one warp, 16x8x16, fragments loaded by ldmatrix) to wgmma.mma_async
//   (common/wgmma.cuh): one instruction per WARPGROUP of 4 warps computes a 64 x 128 x 16 product, and the tensor cores
//   read their shared-memory operands themselves through 64-bit descriptors. The ldmatrix loads, their addresses and
//   the fragment registers all leave the main loop.
//   * S = Q K^T is the "SS" form: Q (A, this warpgroup's 64 rows) and K (B, 128 keys) are both read from the
//     TMA-swizzled tiles, K-major; 8 wgmma per tile, one per 16-wide k-step of the head dim.
//   * O += P V is the "RS" form: P stays in registers as the A operand (each warp's accumulator layout IS mma's D
//     layout, so two 8-key blocks of S are one A fragment of P); V is read N-major (imm-trans-b).
//   * wgmma is asynchronous: a fence before the first wgmma that reads registers written since, a commit, and a wait
//     before the accumulators are read. Here each product is waited for at once: the overlap comes in steps 11 and 13.
//   * The tiling follows the instruction: 2 warpgroups x 64 rows = the same 128-row block, 128-key tiles (the ring
//     holds 2 x 64 KB of K/V, 160 KB with Q), 157 registers per thread, one block of 8 warps per SM.
//
// PREDICTION: mma.sync tops out near 0.5x of the tensor cores' rate on Hopper; wgmma is the path to the rest. Without
//   any overlap yet (softmax and GEMMs in turn) expect ~1.2-1.3x step08, ~430-470 TFLOP/s.
// MEASURED (results/h200/2026-12-01T09-46-07Z.json, H200, steady state, N = 4K / 8K / 16K):
//   376.3 / 379.9 / 385.3 -> 525.9 / 536.3 / 541.5 TFLOP/s (1.40 / 1.41 / 1.41x), 0.86x SDPA's cuDNN backend: above the
//   prediction; with the ldmatrix traffic gone, the two warpgroups' softmax and GEMMs already interleave somewhat.
// CHECKED: every GPU check passed; memcheck and racecheck clean (results/h200/2026-12-01T09-46-07Z-logs/checks.log,
//   sanitizer_08_14.txt); test_sass.py finds HGMMA in both forms and no HMMA or LDSM.
#include "flashladder.cuh"
#include "mbarrier.cuh"
#include "ptx.cuh"
#include "swizzle.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace {

constexpr int BLOCK_M = 128;                          // query rows per block
constexpr int BLOCK_N = 128;                          // keys per K/V tile
constexpr int NUM_WARPGROUPS = 2;                     // each computes 64 query rows with wgmma
constexpr int NUM_THREADS = NUM_WARPGROUPS * WARPGROUP_THREADS;
constexpr int ROWS_PER_WARPGROUP = BLOCK_M / NUM_WARPGROUPS;  // 64: wgmma's M
constexpr int S_BLOCKS = BLOCK_N / 8;                 // S: 16 blocks of 8 keys, 4 registers each per thread
constexpr int O_BLOCKS = HEAD_DIM / 8;                // O: 16 blocks of 8 dims, 4 registers each per thread
constexpr int QK_STEPS = HEAD_DIM / 16;               // k-steps of S = Q K^T over the head dim
constexpr int PV_STEPS = BLOCK_N / 16;                // k-steps of O += P V over the keys
constexpr int STAGES = 2;                             // K/V ring slots: compute one while the other fills
// Byte distances inside a TMA-swizzled [rows, HEAD_DIM] tile (common/swizzle.cuh: two 64-column halves),
// for the wgmma descriptors (common/wgmma.cuh):
constexpr int ROW_BYTES = TMA_HALF_COLS * sizeof(__nv_bfloat16);  // 128: one row of one half
constexpr int KSTEP_BYTES = 16 * sizeof(__nv_bfloat16);           // 32: 16 columns, one k-step of Q K^T
constexpr int KSTEPS_PER_HALF = TMA_HALF_COLS / 16;               // k-steps 0-3 read half 0, 4-7 half 1
constexpr int Q_HALF_BYTES = BLOCK_M * ROW_BYTES, KV_HALF_BYTES = BLOCK_N * ROW_BYTES;

// Shared memory. The tiles first, each 1024-byte aligned: TMA's 128-byte swizzle is a function of the
// address bits 4-9, so every tile must start on a 1024-byte boundary for the wgmma descriptors
// (base offset 0) to match what TMA wrote.
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
// One block per SM (the register file holds one: 256 threads x 157 registers, ptxas -v).
__global__ void __launch_bounds__(NUM_THREADS, 1)
    attention_fwd_kernel(const FwdParams p, const __grid_constant__ CUtensorMap Q_map,
                         const __grid_constant__ CUtensorMap K_map, const __grid_constant__ CUtensorMap V_map) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

    const int q_tile = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const int warpgroup = threadIdx.x / WARPGROUP_THREADS, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quad_row = lane / 4;   // this lane holds rows quad_row and quad_row + 8 of its warp's 16
    const int quad_col = lane % 4;   // ... and columns 2*quad_col, 2*quad_col+1 of every 8-wide block
    const int num_kv_tiles = ceil_div(p.seqlen_k, BLOCK_N);  // the last one may be partial: TMA fills zeros
    // Issued by thread 0 only. The head and batch coordinates are recomputed from the parameters at each
    // call rather than kept in registers all loop long.
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

    // Each warpgroup's 64 rows of Q, at k-step 0: the A operand of S = Q K^T, K-major, 128-byte swizzle.
    const uint32_t Q_rows = smem_u32(smem.Q) + warpgroup * ROWS_PER_WARPGROUP * ROW_BYTES;
    const float scale_log2 = p.scale * LOG2E;  // softmax scale * log2(e): exp(x*scale) = 2^(x*scale_log2)
    float m_i[2] = {-INFINITY, -INFINITY};  // running max of rows quad_row, quad_row+8 (RAW scores)
    float l_i[2] = {0.f, 0.f};              // this lane's part of the running sum of 2^((score - m_i) * scale_log2)
    float O_acc[O_BLOCKS * 4];              // the warpgroup's [64 rows, 128 dims]: O_acc[4 * db + i] as mma's D
    for (int i = 0; i < O_BLOCKS * 4; ++i) O_acc[i] = 0.f;
    const int first_tile_keys = p.seqlen_k - (num_kv_tiles - 1) * BLOCK_N;  // 1 .. BLOCK_N: K/V tile 0 is the last

    for (int kv_tile = 0; kv_tile < num_kv_tiles; ++kv_tile) {
        // Step 2: refill the slot the previous tile freed (every warp passed the barrier at the end of the
        // last iteration) with the tile STAGES ahead of it.
        const int refill = kv_tile - 1 + STAGES;
        if (threadIdx.x == 0 && kv_tile > 0 && refill < num_kv_tiles) load_kv(refill, (kv_tile - 1) % STAGES);

        // This tile's slot, and the parity of its fill (the slot's n-th use completes phase n).
        const int stage = kv_tile % STAGES;
        const uint32_t parity = (kv_tile / STAGES) % 2;
        const uint32_t K_tile = smem_u32(smem.K[stage]);
        const uint32_t V_tile = smem_u32(smem.V[stage]);
        mbarrier_wait_parity(&smem.K_full[stage], parity);  // K has landed (V may still be on its way)

        // Step 3: S = Q K^T, [64 rows, 128 keys] per warpgroup: 8 wgmma, one per 16-wide k-step of the head
        // dim, reading Q and K straight from shared memory (no ldmatrix, no fragments in registers).
        // The next k-step starts 32 bytes further inside a swizzle atom, or in the other half.
        float S_acc[S_BLOCKS * 4];  // S_acc[4 * nb + i]: key block nb, i as in mma's D fragment
        wgmma_fence();              // S_acc was last read by the softmax: order those reads before the wgmma writes
        for (int kk = 0; kk < QK_STEPS; ++kk) {
            const uint32_t k_offset = kk / KSTEPS_PER_HALF * Q_HALF_BYTES + kk % KSTEPS_PER_HALF * KSTEP_BYTES;
            const uint32_t k_offset_kv = kk / KSTEPS_PER_HALF * KV_HALF_BYTES + kk % KSTEPS_PER_HALF * KSTEP_BYTES;
            wgmma_m64n128k16_ss(S_acc, wgmma_desc_kmajor(Q_rows + k_offset), wgmma_desc_kmajor(K_tile + k_offset_kv), kk > 0);
        }
        wgmma_commit_group();
        wgmma_wait_group<0>();          // S is complete...
        wgmma_fence_operands(S_acc);    // ...and the compiler may not read it any earlier
        // Any seqlen_k: tile 0 may hold fewer than BLOCK_N keys. TMA filled the rest of its K and V with zeros,
        // whose scores (0, not -inf) must not count: they become -inf before the softmax (2^-inf = 0).
        if (kv_tile == 0 && first_tile_keys < BLOCK_N)
            for (int nb = 0; nb < S_BLOCKS; ++nb)
                for (int i = 0; i < 4; ++i)  // S_acc[4 nb + i] is key 8 nb + 2 quad_col + i % 2 (common/wgmma.cuh)
                    if (8 * nb + 2 * quad_col + i % 2 >= first_tile_keys) S_acc[4 * nb + i] = -INFINITY;

        // Step 4: the online-softmax update for this lane's two rows (r = 0: quad_row, r = 1: quad_row + 8),
        // step07's code on the wgmma accumulator layout (the same per warp). Scores become P in place.
        for (int r = 0; r < 2; ++r) {
            float tile_max = -INFINITY;
            for (int nb = 0; nb < S_BLOCKS; ++nb)
                tile_max = fmaxf(tile_max, fmaxf(frag_at(S_acc, nb, r, 0), frag_at(S_acc, nb, r, 1)));
            const float m_new = fmaxf(m_i[r], quad_max(tile_max));
            const float alpha = ex2_approx_ftz((m_i[r] - m_new) * scale_log2);  // 2^-inf = 0 on the first tile
            const float m_scaled = m_new * scale_log2;
            float row_sum = 0.f;
            for (int nb = 0; nb < S_BLOCKS; ++nb) {  // one FFMA + one MUFU.EX2 per element
                frag_at(S_acc, nb, r, 0) = ex2_approx_ftz(fmaf(frag_at(S_acc, nb, r, 0), scale_log2, -m_scaled));
                frag_at(S_acc, nb, r, 1) = ex2_approx_ftz(fmaf(frag_at(S_acc, nb, r, 1), scale_log2, -m_scaled));
                row_sum += frag_at(S_acc, nb, r, 0) + frag_at(S_acc, nb, r, 1);
            }
            l_i[r] = alpha * l_i[r] + row_sum;  // no shuffle: the quad's parts are added once, at the end
            m_i[r] = m_new;
            for (int db = 0; db < O_BLOCKS; ++db) {
                frag_at(O_acc, db, r, 0) *= alpha;
                frag_at(O_acc, db, r, 1) *= alpha;
            }
        }

        // Step 5: O += P V: 8 wgmma, one per 16 keys, with P's A fragments in registers (two neighbouring
        // 8-key blocks of S, rounded to bf16, as in the mma.sync steps) and V read N-major from shared
        // memory: LBO = the distance between V's two 64-dim halves, SBO = one 8-key atom.
        uint32_t P_frag[PV_STEPS][4];
        for (int kk = 0; kk < PV_STEPS; ++kk) {
            P_frag[kk][0] = cvt_rn_bf16x2_f32(frag_at(S_acc, 2 * kk, 0, 0), frag_at(S_acc, 2 * kk, 0, 1));          // row g,   keys +2t
            P_frag[kk][1] = cvt_rn_bf16x2_f32(frag_at(S_acc, 2 * kk, 1, 0), frag_at(S_acc, 2 * kk, 1, 1));          // row g+8, keys +2t
            P_frag[kk][2] = cvt_rn_bf16x2_f32(frag_at(S_acc, 2 * kk + 1, 0, 0), frag_at(S_acc, 2 * kk + 1, 0, 1));  // row g,   keys +8+2t
            P_frag[kk][3] = cvt_rn_bf16x2_f32(frag_at(S_acc, 2 * kk + 1, 1, 0), frag_at(S_acc, 2 * kk + 1, 1, 1));  // row g+8, keys +8+2t
        }
        mbarrier_wait_parity(&smem.V_full[stage], parity);
        wgmma_fence();  // O_acc (rescaled) and P_frag were written by ordinary instructions just now
        for (int kk = 0; kk < PV_STEPS; ++kk)
            wgmma_m64n128k16_rs(O_acc, P_frag[kk], wgmma_desc_nmajor(V_tile + kk * 2 * WGMMA_ATOM_BYTES, KV_HALF_BYTES), 1);
        wgmma_commit_group();
        wgmma_wait_group<0>();          // O is complete and V's slot is no longer read...
        wgmma_fence_operands(O_acc);

        __syncthreads();  // every warp is done reading this slot: it may be refilled (next iteration, Step 2)
    }

    // Step 6: the row sums' quad parts added up, the final normalization, once per row, and the log-sum-exp.
    // Rows past seqlen_q (zeros from TMA) are computed, not stored.
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(l_i[r]);
        const float inv_l = 1.f / l;
        const int64_t q_row = int64_t(q_tile) * BLOCK_M + warp * 16 + quad_row + 8 * r;  // warp w: rows 16w..16w+15
        if (q_row >= p.seqlen_q) continue;
        __nv_bfloat16* O_gmem = row_ptr(static_cast<__nv_bfloat16*>(p.o), p.o_stride, batch, head, q_row);
        for (int db = 0; db < O_BLOCKS; ++db)
            *reinterpret_cast<__nv_bfloat162*>(O_gmem + db * 8 + 2 * quad_col) =
                __floats2bfloat162_rn(frag_at(O_acc, db, r, 0) * inv_l, frag_at(O_acc, db, r, 1) * inv_l);
        if (quad_col == 0)
            p.lse[(int64_t(batch) * p.heads + head) * p.seqlen_q + q_row] = m_i[r] * p.scale + logf(l);
    }
}

}  // namespace

// ---- host launcher: grid, block, shared memory, attributes ----
FLASHLADDER_EXPORT int flashladder_seqlen_multiple_q() { return 1; }  // any seqlen: TMA fills the last tiles with zeros
FLASHLADDER_EXPORT int flashladder_seqlen_multiple_k() { return 1; }
FLASHLADDER_EXPORT int flashladder_tile_q() { return BLOCK_M; }  // the tiles (for tests and tools)
FLASHLADDER_EXPORT int flashladder_tile_k() { return BLOCK_N; }

FLASHLADDER_EXPORT int flashladder_fwd(const FwdParams* params, cudaStream_t stream) {
    // 160 KB of dynamic shared memory is above the 48 KB a block gets without asking (asked once per device).
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
