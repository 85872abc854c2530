// flashladder step10 -- warp specialization: a producer warp feeds a K/V ring, two consumer warpgroups compute.
//
// The ladder (docs/ladder.md): 01 plain CUDA -> 02 tensor cores -> 03 cp.async -> 04 swizzle ->
// 05 double buffering -> 06 instruction diet -> 07 two row blocks per warp -> 08 TMA -> 09 wgmma ->
// 10 warp specialization -> 11 ping-pong -> 12 conditional rescale -> 13 intra-warpgroup overlap -> 14 persistent.
//
// WHAT CHANGED FROM STEP09
//   The warps split into roles (FlashAttention-3's structure). In step09 every warp computed and, once per tile,
//   stopped at a __syncthreads so that thread 0 could refill the slot everyone had finished with: the block marched in
//   lock-step, each refill waiting for the slowest warp. Now:
//   * warpgroup 0 is the PRODUCER (producer_load): one thread issues every TMA copy, after waiting on the slot's
//     "empty" mbarrier; the copy completes the slot's "full" mbarrier.
//   * warpgroups 1 and 2 are CONSUMERS (consumer_mma), 64 query rows each, step09's math unchanged: they wait on
//     "full", compute, and release the slot on "empty" (one arrival per warp, right after the wgmma that last reads it:
//     K after S = Q K^T, V after O += P V). A consumer's registers and what it does with them are one struct,
//     MmaWarpgroup: each role is a function of its own, which the later steps change.
//   No block-wide barrier remains in the loop; the producer runs up to STAGES tiles ahead of the slower consumer:
//       producer:  wait K_empty[s] -> TMA K -> K_full[s]      wait V_empty[s] -> TMA V -> V_full[s]
//       consumer:  wait K_full[s] -> S = QK^T -> arrive K_empty[s] ... wait V_full[s] -> O += PV -> arrive V_empty[s]
//   * setmaxnreg: the launch bound (384 threads, 1 block per SM) caps every thread at 168 registers; the producer
//     gives its registers back (setmaxnreg.dec to 24) and the consumers take them (setmaxnreg.inc to 240).
//
// PREDICTION: +10-20%: the copies and the refill barrier leave the consumers' path, and the two consumers, no longer
//   in lock-step, overlap one's softmax with the other's wgmma now and then (ping-pong, step11, makes that deliberate).
// MEASURED (results/h200/2026-12-01T09-46-07Z.json, H200, steady state, N = 4K / 8K / 16K):
//   525.9 / 536.3 / 541.5 -> 546.3 / 563.6 / 568.5 TFLOP/s (1.04 / 1.05 / 1.05x), 0.89 / 0.91 / 0.90x SDPA's cuDNN
//   backend. Below the prediction: the refill barrier was cheap, and two free-running consumers fall into step more
//   often than not, their softmaxes side by side (the measured timeline: results/h200/timeline/step10.png).
// CHECKED: every GPU check passed; memcheck and racecheck clean (results/h200/2026-12-01T09-46-07Z-logs/checks.log,
//   sanitizer_08_14.txt); test_sass.py finds setmaxnreg's USETMAXREG.DEALLOC and TRY_ALLOC.
#include "flashladder.cuh"
#include "mbarrier.cuh"
#include "ptx.cuh"
#include "swizzle.cuh"
#include "tma.cuh"
#include "trace.cuh"
#include "wgmma.cuh"

namespace {

constexpr int BLOCK_M = 128;                          // query rows per block
constexpr int BLOCK_N = 128;                          // keys per K/V tile
constexpr int NUM_CONSUMERS = 2;                      // consumer warpgroups, each computes 64 query rows with wgmma
constexpr int NUM_THREADS = (1 + NUM_CONSUMERS) * WARPGROUP_THREADS;  // warpgroup 0: the producer
constexpr int ROWS_PER_WARPGROUP = BLOCK_M / NUM_CONSUMERS;  // 64: wgmma's M
constexpr int S_BLOCKS = BLOCK_N / 8;                 // S: 16 blocks of 8 keys, 4 registers each per thread
constexpr int O_BLOCKS = HEAD_DIM / 8;                // O: 16 blocks of 8 dims, 4 registers each per thread
constexpr int QK_STEPS = HEAD_DIM / 16;               // k-steps of S = Q K^T over the head dim
constexpr int PV_STEPS = BLOCK_N / 16;                // k-steps of O += P V over the keys
constexpr int STAGES = 2;                             // K/V ring slots: compute one while the other fills
// setmaxnreg budgets (per thread): the producer issues TMA copies and needs few; the consumers hold S, P and
// O. 128 x 24 + 2 x 128 x 240 = 64512 of the SM's 65536 registers.
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
// Byte distances inside a TMA-swizzled [rows, HEAD_DIM] tile (common/swizzle.cuh: two 64-column halves),
// for the wgmma descriptors (common/wgmma.cuh):
constexpr int ROW_BYTES = TMA_HALF_COLS * sizeof(__nv_bfloat16);  // 128: one row of one half
constexpr int KSTEP_BYTES = 16 * sizeof(__nv_bfloat16);           // 32: 16 columns, one k-step of Q K^T
constexpr int KSTEPS_PER_HALF = TMA_HALF_COLS / 16;               // k-steps 0-3 read half 0, 4-7 half 1
constexpr int Q_HALF_BYTES = BLOCK_M * ROW_BYTES, KV_HALF_BYTES = BLOCK_N * ROW_BYTES;

// Shared memory. The tiles first, each 1024-byte aligned: TMA's 128-byte swizzle is a function of the
// address bits 4-9, and the wgmma descriptors (base offset 0) assume the atoms start on 1024 bytes.
struct alignas(1024) SharedStorage {
    __nv_bfloat16 Q[BLOCK_M * HEAD_DIM];          // [2 halves, BLOCK_M, 64]
    __nv_bfloat16 K[STAGES][BLOCK_N * HEAD_DIM];  // [2 halves, BLOCK_N, 64] per slot
    __nv_bfloat16 V[STAGES][BLOCK_N * HEAD_DIM];
    uint64_t Q_full;                              // Q has landed (one phase)
    uint64_t K_full[STAGES], V_full[STAGES];      // slot s holds its tile: the producer's expect_tx + TMA bytes
    uint64_t K_empty[STAGES], V_empty[STAGES];    // every consumer warp is done with slot s: it may be refilled
};
constexpr int SMEM_BYTES = sizeof(SharedStorage);
constexpr int CONSUMER_WARPS = NUM_CONSUMERS * 4;  // the arrivals that empty a slot

// The ring's phases. A slot's n-th fill (n = count / STAGES, count = K/V tiles through the ring so far)
// completes the full barrier's phase n; the producer's n-th fill waits for the slot's (n-1)-th emptying.
__device__ __forceinline__ uint32_t full_parity(int count) { return uint32_t(count / STAGES) % 2; }
__device__ __forceinline__ uint32_t empty_parity(int count) { return uint32_t(count / STAGES + 1) % 2; }
__device__ __forceinline__ void wait_full(uint64_t* full, int count, int kv_tile) {
    TRACE_SPAN(TRACE_FULL_WAIT_BEGIN, kv_tile);
    mbarrier_wait_parity(full, full_parity(count));
}

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

// The producer: one thread keeps the ring full. Q once, then for every K/V tile: wait until the slot is
// empty (all consumer warps released its previous tile), then refill it. It runs ahead of the consumers by
// up to STAGES tiles, and nothing else in the block waits for it except through the full barriers.
__device__ void producer_load(SharedStorage& smem, const FwdParams& p, const CUtensorMap& Q_map, const CUtensorMap& K_map,
                              const CUtensorMap& V_map) {
    const int q_tile = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    prefetch_tensormap(&Q_map), prefetch_tensormap(&K_map), prefetch_tensormap(&V_map);
    TRACE_EVENT(TRACE_TMA_Q, q_tile);
    load_tile_tma<BLOCK_M>(smem.Q, &Q_map, q_tile * BLOCK_M, tma_coord(p.q_stride[1], head), tma_coord(p.q_stride[0], batch),
                           &smem.Q_full);
    const int num_kv_tiles = ceil_div(p.seqlen_k, BLOCK_N);
    for (int kv_tile = 0; kv_tile < num_kv_tiles; ++kv_tile) {
        const int stage = kv_tile % STAGES, row = kv_row(kv_tile, num_kv_tiles);
        if (kv_tile >= STAGES) {
            TRACE_SPAN(TRACE_EMPTY_WAIT_BEGIN, kv_tile);
            mbarrier_wait_parity(&smem.K_empty[stage], empty_parity(kv_tile));
        }
        TRACE_EVENT(TRACE_TMA_K, kv_tile);
        load_tile_tma<BLOCK_N>(smem.K[stage], &K_map, row, tma_coord(p.k_stride[1], head), tma_coord(p.k_stride[0], batch),
                               &smem.K_full[stage]);
        if (kv_tile >= STAGES) {
            TRACE_SPAN(TRACE_EMPTY_WAIT_BEGIN, kv_tile);
            mbarrier_wait_parity(&smem.V_empty[stage], empty_parity(kv_tile));
        }
        TRACE_EVENT(TRACE_TMA_V, kv_tile);
        load_tile_tma<BLOCK_N>(smem.V[stage], &V_map, row, tma_coord(p.v_stride[1], head), tma_coord(p.v_stride[0], batch),
                               &smem.V_full[stage]);
    }
}

// A consumer warpgroup: 64 query rows of the block's 128, step09's math. Its state lives in registers for
// the whole kernel: O, and each lane's two rows' running max and sum. It waits for a slot to be full,
// computes, and releases the slot (one arrival per warp, as soon as its last wgmma reading the tile has
// completed).
struct MmaWarpgroup {
    SharedStorage& smem;
    const FwdParams& p;
    const int index;               // 0 or 1: rows 64 * index .. 64 * index + 63 of the block
    const int lane, warp;          // warp 0-3 of this warpgroup: rows 16 * warp .. 16 * warp + 15 of its 64
    const int quad_row;            // this lane holds rows quad_row and quad_row + 8 of its warp's 16
    const int quad_col;            // ... and columns 2*quad_col, 2*quad_col+1 of every 8-wide block
    const uint32_t Q_rows;         // this warpgroup's 64 rows of Q at k-step 0: the A operand of S = Q K^T
    const float scale_log2;        // softmax scale * log2(e): exp(x*scale) = 2^(x*scale_log2)
    float m_i[2];                  // running max of rows quad_row, quad_row+8 (RAW scores)
    float l_i[2];                  // this lane's part of the running sum of 2^((score - m_i) * scale_log2)
    float O_acc[O_BLOCKS * 4];     // the warpgroup's [64 rows, 128 dims]: O_acc[4 * db + i] as mma's D

    __device__ MmaWarpgroup(SharedStorage& smem_, const FwdParams& p_, int index_)
        : smem(smem_), p(p_), index(index_), lane(threadIdx.x % 32), warp(threadIdx.x / 32 % 4), quad_row(lane / 4),
          quad_col(lane % 4), Q_rows(smem_u32(smem_.Q) + index_ * ROWS_PER_WARPGROUP * ROW_BYTES), scale_log2(p_.scale * LOG2E) {}
    __device__ void release(uint64_t* empty) const {  // this warp is done with a ring slot
        if (lane == 0) mbarrier_arrive(empty);
    }

    __device__ void start() {
        m_i[0] = m_i[1] = -INFINITY;
        l_i[0] = l_i[1] = 0.f;
        for (int i = 0; i < O_BLOCKS * 4; ++i) O_acc[i] = 0.f;
    }
    // One K/V tile (`keys` of them valid: BLOCK_N but in the last tile of the sequence).
    __device__ void compute_tile(int kv_tile, int keys) {
        const int stage = kv_tile % STAGES;
        const uint32_t K_tile = smem_u32(smem.K[stage]);
        const uint32_t V_tile = smem_u32(smem.V[stage]);
        wait_full(&smem.K_full[stage], kv_tile, kv_tile);  // K has landed (V may still be on its way)

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
        TRACE_EVENT(TRACE_GEMM_ISSUED, kv_tile);
        wgmma_wait_group<0>();          // S is complete...
        TRACE_EVENT(TRACE_GEMM_WAITED_ALL, kv_tile);
        wgmma_fence_operands(S_acc);    // ...and the compiler may not read it any earlier
        release(&smem.K_empty[stage]);  // this warp is done with the K tile
        // Any seqlen_k: tile 0 may hold fewer than BLOCK_N keys. TMA filled the rest of its K and V with zeros,
        // whose scores (0, not -inf) must not count: they become -inf before the softmax (2^-inf = 0).
        if (keys < BLOCK_N)
            for (int nb = 0; nb < S_BLOCKS; ++nb)
                for (int i = 0; i < 4; ++i)  // S_acc[4 nb + i] is key 8 nb + 2 quad_col + i % 2 (common/wgmma.cuh)
                    if (8 * nb + 2 * quad_col + i % 2 >= keys) S_acc[4 * nb + i] = -INFINITY;

        // Step 4: the online-softmax update for this lane's two rows (r = 0: quad_row, r = 1: quad_row + 8),
        // step07's code on the wgmma accumulator layout (the same per warp). Scores become P in place.
        TRACE_SPAN(TRACE_SOFTMAX_BEGIN, kv_tile);
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
        wait_full(&smem.V_full[stage], kv_tile, kv_tile);
        wgmma_fence();  // O_acc (rescaled) and P_frag were written by ordinary instructions just now
        for (int kk = 0; kk < PV_STEPS; ++kk)
            wgmma_m64n128k16_rs(O_acc, P_frag[kk], wgmma_desc_nmajor(V_tile + kk * 2 * WGMMA_ATOM_BYTES, KV_HALF_BYTES), 1);
        wgmma_commit_group();
        TRACE_EVENT(TRACE_GEMM_ISSUED, kv_tile);
        wgmma_wait_group<0>();          // O is complete and V's slot is no longer read...
        TRACE_EVENT(TRACE_GEMM_WAITED_ALL, kv_tile);
        wgmma_fence_operands(O_acc);
        release(&smem.V_empty[stage]);  // ...so this warp is done with the V tile
    }

    // Step 6: the row sums' quad parts added up, the final normalization, once per row, and the log-sum-exp.
    // Rows past seqlen_q (zeros from TMA) are computed, not stored.
    __device__ void epilogue() {
        const int q_tile = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
        TRACE_SPAN(TRACE_EPILOGUE_BEGIN, q_tile);
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(l_i[r]);
            const float inv_l = 1.f / l;
            const int64_t q_row = int64_t(q_tile) * BLOCK_M + index * ROWS_PER_WARPGROUP + warp * 16 + quad_row + 8 * r;
            if (q_row >= p.seqlen_q) continue;
            __nv_bfloat16* O_gmem = row_ptr(static_cast<__nv_bfloat16*>(p.o), p.o_stride, batch, head, q_row);
            for (int db = 0; db < O_BLOCKS; ++db)
                *reinterpret_cast<__nv_bfloat162*>(O_gmem + db * 8 + 2 * quad_col) =
                    __floats2bfloat162_rn(frag_at(O_acc, db, r, 0) * inv_l, frag_at(O_acc, db, r, 1) * inv_l);
            if (quad_col == 0)
                p.lse[(int64_t(batch) * p.heads + head) * p.seqlen_q + q_row] = m_i[r] * p.scale + logf(l);
        }
    }
};

// A consumer's work: Q, then every K/V tile in turn, then the epilogue.
__device__ void consumer_mma(SharedStorage& smem, const FwdParams& p, int index) {
    MmaWarpgroup wg(smem, p, index);
    const int num_kv_tiles = ceil_div(p.seqlen_k, BLOCK_N);
    const int first_tile_keys = p.seqlen_k - (num_kv_tiles - 1) * BLOCK_N;  // 1 .. BLOCK_N: K/V tile 0 is the last
    wg.start();
    {
        TRACE_SPAN(TRACE_FULL_WAIT_BEGIN, blockIdx.x);
        mbarrier_wait_parity(&smem.Q_full, 0);  // Q's one and only phase
    }
    for (int kv_tile = 0; kv_tile < num_kv_tiles; ++kv_tile) wg.compute_tile(kv_tile, kv_tile == 0 ? first_tile_keys : BLOCK_N);
    wg.epilogue();
}

// The kernel: set up the barriers, then split by warpgroup into the two roles. The tensor maps are
// kernel parameters (__grid_constant__): the TMA unit reads them from parameter memory. One block per SM;
// the (threads, 1) launch bound caps registers at kernel entry (168), which setmaxnreg then redistributes.
__global__ void __launch_bounds__(NUM_THREADS, 1)
    attention_fwd_kernel(const FwdParams p, const __grid_constant__ CUtensorMap Q_map,
                         const __grid_constant__ CUtensorMap K_map, const __grid_constant__ CUtensorMap V_map) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

    // One thread initializes the barriers: a full barrier completes on its producer's expect_tx plus the TMA
    // bytes (1 arrival), an empty barrier on one arrival from every consumer warp.
    if (threadIdx.x == 0) {
        mbarrier_init(&smem.Q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&smem.K_full[s], 1), mbarrier_init(&smem.V_full[s], 1);
            mbarrier_init(&smem.K_empty[s], CONSUMER_WARPS), mbarrier_init(&smem.V_empty[s], CONSUMER_WARPS);
        }
        fence_mbarrier_init();  // the inits are visible to the TMA unit before the first copy completes on them
    }
    __syncthreads();  // no thread waits on a barrier before it is initialized; the last block-wide barrier

    // The roles. Each setmaxnreg is executed by a whole warpgroup.
    const int warpgroup = threadIdx.x / WARPGROUP_THREADS;
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) producer_load(smem, p, Q_map, K_map, V_map);  // the other 127 threads are done
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        consumer_mma(smem, p, warpgroup - 1);
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
