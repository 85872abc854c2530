// flashladder step13 -- intra-warpgroup overlap (FlashAttention-3): S = Q K^T first, the softmax under its own P V.
//
// The ladder (docs/ladder.md): 01 plain CUDA -> 02 tensor cores -> 03 cp.async -> 04 swizzle ->
// 05 double buffering -> 06 instruction diet -> 07 two row blocks per warp -> 08 TMA -> 09 wgmma ->
// 10 warp specialization -> 11 ping-pong -> 12 conditional rescale -> 13 intra-warpgroup overlap -> 14 persistent.
//
// WHAT CHANGED FROM STEP12
//   In step12 a consumer waits for its whole GEMM block (P V of tile j-1, then S of tile j) before its softmax of tile
//   j starts, though that softmax needs only S_j. Now S_j is issued first and P V of tile j-1 after it, as two commit
//   groups; the softmax starts once the first is done (wgmma.wait_group 1), under this warpgroup's own P V, and only
//   what touches O and P_frag (rescale O, round P to bf16) waits for it (wait_group 0). K's slot is released after
//   wait_group 1, V's after 0.
//       step12:  issue [PV j-1, S j] -> wait all -> softmax j (max, exp, rescale O, P)
//       step13:  issue [S j][PV j-1] -> wait S   -> softmax j (max, exp) -> wait PV -> rescale O, P
//   * One fence after the softmax (keep_work_before_wait(), common/wgmma.cuh): without it ptxas moves the wait for P V
//     up into the row max's shuffles, above all 64 exponentials of a thread (docs/design.md, "The overlap needs a
//     fence, and the conditional rescale before it").
//   * The row max in short chains: written as one loop it is a chain of 16 dependent FMNMX per row that the
//     exponentials wait for; now four independent chains of four per row, both rows' maxima before both quads'
//     shuffles, the longest chain 8. fmax is exact in any order: O and LSE are bitwise what one chain gives. It pays
//     only once the kernel is persistent (docs/design.md, "The row max in short chains"), beside the overlap it serves.
//
// PREDICTION: the exponentials now overlap this warpgroup's own P V as well as the other consumer's block, so the
//   tensor cores have work even when the two consumers drift into step: +5-10% over step12.
// MEASURED (results/h200/2026-12-01T16-28-07Z.json, results/h200/2026-12-01T09-46-07Z-logs/trace.log, N = 4K / 8K / 16K):
//   600.9 / 621.7 / 632.3 -> 632.6 / 659.4 / 659.8 TFLOP/s (1.05 / 1.06 / 1.04x), 1.02 / 1.05 / 1.05x SDPA's cuDNN backend,
//   inside the prediction; in one traced CTA of the build before the short chains a GEMM is in flight 57.8% of the run
//   against step12's 23.2%.
// CHECKED: every GPU check passed; memcheck and racecheck clean (results/h200/2026-12-01T16-28-07Z-logs/checks.log,
//   sanitizer_13_15.txt); test_sass.py counts the MUFU.EX2 between the two waits and the longest FMNMX chain.
#include "flashladder.cuh"
#include "mbarrier.cuh"
#include "ptx.cuh"
#include "swizzle.cuh"
#include "tma.cuh"
#include "trace.cuh"
#include "wgmma.cuh"

namespace {

// ==== Sizes ====
constexpr int BLOCK_M = 128;                          // query rows per block
constexpr int BLOCK_N = 128;                          // keys per K/V tile
constexpr int NUM_CONSUMERS = 2;                      // consumer warpgroups, each computes 64 query rows with wgmma
constexpr int NUM_THREADS = (1 + NUM_CONSUMERS) * WARPGROUP_THREADS;  // warpgroup 0: the producer
constexpr int CONSUMER_THREADS = NUM_CONSUMERS * WARPGROUP_THREADS;  // the two that take turns on the tensor cores
constexpr int ROWS_PER_WARPGROUP = BLOCK_M / NUM_CONSUMERS;  // 64: wgmma's M
constexpr int S_BLOCKS = BLOCK_N / 8;                 // S: 16 blocks of 8 keys, 4 registers each per thread
constexpr int O_BLOCKS = HEAD_DIM / 8;                // O: 16 blocks of 8 dims, 4 registers each per thread
constexpr int QK_STEPS = HEAD_DIM / 16;               // k-steps of S = Q K^T over the head dim
constexpr int PV_STEPS = BLOCK_N / 16;                // k-steps of O += P V over the keys
constexpr int STAGES = 2;                             // K/V ring slots: compute one while the other fills
// FlashAttention-4's conditional rescale: the running max (the shift of the exponentials) moves only when a
// row's new max exceeds it by more than this, in log2 units; P stays <= 2^8 in between.
constexpr float RESCALE_THRESHOLD = 8.f;
// setmaxnreg budgets (per thread): the producer issues TMA copies and needs few; the consumers hold S, P and
// O. 128 x 24 + 2 x 128 x 240 = 64512 of the SM's 65536 registers.
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
// Byte distances inside a TMA-swizzled [rows, HEAD_DIM] tile (common/swizzle.cuh: two 64-column halves),
// for the wgmma descriptors (common/wgmma.cuh):
constexpr int ROW_BYTES = TMA_HALF_COLS * sizeof(__nv_bfloat16);  // 128: one row of one half
constexpr int KSTEP_BYTES = 16 * sizeof(__nv_bfloat16);           // 32: 16 columns, one k-step of Q K^T
constexpr int KSTEPS_PER_HALF = TMA_HALF_COLS / 16;               // k-steps 0-3 read half 0, 4-7 half 1
constexpr int Q_HALF_BYTES = BLOCK_M * ROW_BYTES, KV_HALF_BYTES = BLOCK_N * ROW_BYTES;

// ==== Shared memory, barriers, the ring ====
// The tiles first, each 1024-byte aligned: TMA's 128-byte swizzle is a function of the address bits 4-9, and the
// wgmma descriptors (base offset 0) assume the atoms start on 1024 bytes.
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
static_assert(NUM_CONSUMERS == 2, "ping-pong alternates exactly two consumer warpgroups");

// Named barriers (ids 1-15; 0 is __syncthreads).
enum NamedBarrier : int { CONSUMER0_TURN = 1, CONSUMER1_TURN = 2 };

// Ping-pong's turns on the tensor cores. Each consumer has a turn barrier counting both warpgroups' threads:
// it waits on its own (bar.sync) before it issues a GEMM block and arrives on the other's (bar.arrive) once
// the block is issued, so the two consumers' blocks reach the tensor cores alternately.
struct Turn {
    int mine, other;
    __device__ explicit Turn(int consumer)
        : mine(consumer == 0 ? CONSUMER0_TURN : CONSUMER1_TURN), other(consumer == 0 ? CONSUMER1_TURN : CONSUMER0_TURN) {}
    __device__ void take(int kv_tile) const {
        TRACE_SPAN(TRACE_TURN_WAIT_BEGIN, kv_tile);
        named_barrier_sync(mine, CONSUMER_THREADS);
    }
    __device__ void pass() const { named_barrier_arrive(other, CONSUMER_THREADS); }
};

// The ring's phases. A slot's n-th fill (n = count / STAGES, count = K/V tiles through the ring so far)
// completes the full barrier's phase n; the producer's n-th fill waits for the slot's (n-1)-th emptying.
__device__ __forceinline__ uint32_t full_parity(int count) { return uint32_t(count / STAGES) % 2; }
__device__ __forceinline__ uint32_t empty_parity(int count) { return uint32_t(count / STAGES + 1) % 2; }
__device__ __forceinline__ void wait_full(uint64_t* full, int count, int kv_tile) {
    TRACE_SPAN(TRACE_FULL_WAIT_BEGIN, kv_tile);
    mbarrier_wait_parity(full, full_parity(count));
}

// The K/V walk runs from the last tile to the first: the one partial tile (seqlen_k not a multiple of BLOCK_N)
// is the first one, so only the first GEMM block masks.
__device__ __forceinline__ int kv_row(int kv_tile, int num_kv_tiles) { return (num_kv_tiles - 1 - kv_tile) * BLOCK_N; }

// ==== The producer ====
// One thread asks the TMA unit for a [ROWS, HEAD_DIM] tile starting at `row` of (head, batch): two boxes of
// [ROWS, 64] (the two swizzled halves), both completing on `bar`, which first learns how many bytes to expect.
// Rows past the tensor's end arrive as zeros.
template <int ROWS>
__device__ void load_tile_tma(__nv_bfloat16* dst_smem, const CUtensorMap* map, int row, int head, int batch, uint64_t* bar) {
    mbarrier_arrive_expect_tx(bar, ROWS * HEAD_DIM * sizeof(__nv_bfloat16));
    cp_async_bulk_tensor_4d_global_to_shared(dst_smem, map, 0, row, head, batch, bar);
    cp_async_bulk_tensor_4d_global_to_shared(dst_smem + ROWS * TMA_HALF_COLS, map, TMA_HALF_COLS, row, head, batch, bar);
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

// ==== The consumers: the accumulator's rows ====
// An accumulator fragment (common/wgmma.cuh: frag_at) holds two rows of this lane, r = 0 (quad_row) and r = 1
// (quad_row + 8), each spread over the 4 lanes of a quad. Max / sum over those 4 lanes:
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ==== The consumers: GEMM blocks and the online softmax ====
// A consumer warpgroup: 64 query rows of the block's 128, in registers. The tensor-core work between two
// softmaxes is one GEMM block: S = Q K^T of K/V tile j, then O += P V of tile j-1, two commit groups issued on
// this consumer's turn. The first block holds only S of tile 0, the last only the P V of the last tile:
// peeled, so that no wgmma sits on a conditional path (ptxas would serialize it).
struct MmaWarpgroup {
    SharedStorage& smem;
    const FwdParams& p;
    const int index;               // 0 or 1: rows 64 * index .. 64 * index + 63 of the block
    const Turn turn;
    const int lane, warp;          // warp 0-3 of this warpgroup: rows 16 * warp .. 16 * warp + 15 of its 64
    const int quad_row;            // this lane holds rows quad_row and quad_row + 8 of its warp's 16
    const int quad_col;            // ... and columns 2*quad_col, 2*quad_col+1 of every 8-wide block
    const uint32_t Q_rows;         // this warpgroup's 64 rows of Q at k-step 0: the A operand of S = Q K^T
    const float scale_log2;        // softmax scale * log2(e): exp(x * scale) = 2^(x * scale_log2)
    float S_acc[S_BLOCKS * 4];     // S = Q K^T of a K/V tile: frag_at(S_acc, nb, r, i) is key 8 nb + 2 quad_col + i
    float O_acc[O_BLOCKS * 4];     // the warpgroup's [64 rows, 128 dims]: frag_at(O_acc, db, r, i) likewise
    uint32_t P_frag[PV_STEPS][4];  // the last softmax's P in bf16: the A operand of the next O += P V
    float m_i[2];                  // running max of rows quad_row, quad_row+8 (RAW scores)
    float l_i[2];                  // this lane's part of the running sum of 2^((score - m_i) * scale_log2)
    float alpha[2];                // ... and the rescale factor of the last softmax

    __device__ MmaWarpgroup(SharedStorage& smem_, const FwdParams& p_, int index_)
        : smem(smem_), p(p_), index(index_), turn(index_), lane(threadIdx.x % 32), warp(threadIdx.x / 32 % 4), quad_row(lane / 4),
          quad_col(lane % 4), Q_rows(smem_u32(smem_.Q) + index_ * ROWS_PER_WARPGROUP * ROW_BYTES), scale_log2(p_.scale * LOG2E) {}

    // S = Q K^T: 8 SS wgmma, one per 16-wide k-step of the head dim (32 bytes further inside an atom, or in
    // the other half).
    __device__ void issue_qk(int stage) {
        const uint32_t K_tile = smem_u32(smem.K[stage]);
        for (int kk = 0; kk < QK_STEPS; ++kk) {
            const uint32_t half = kk / KSTEPS_PER_HALF, kstep = kk % KSTEPS_PER_HALF * KSTEP_BYTES;
            wgmma_m64n128k16_ss(S_acc, wgmma_desc_kmajor(Q_rows + half * Q_HALF_BYTES + kstep),
                                wgmma_desc_kmajor(K_tile + half * KV_HALF_BYTES + kstep), kk > 0);
        }
    }
    // O += P V: 8 RS wgmma, one per 16 keys, P from registers, V N-major (16 keys = 2 atoms further).
    __device__ void issue_pv(int stage) {
        const uint32_t V_tile = smem_u32(smem.V[stage]);
        for (int kk = 0; kk < PV_STEPS; ++kk)
            wgmma_m64n128k16_rs(O_acc, P_frag[kk], wgmma_desc_nmajor(V_tile + kk * 2 * WGMMA_ATOM_BYTES, KV_HALF_BYTES), 1);
    }
    // The last K/V tile may hold fewer than BLOCK_N keys: TMA filled the rest of its K and V with zeros, whose
    // scores (0, not -inf) must not count, so they become -inf before the softmax (2^-inf = 0).
    __device__ void mask_past_seqlen_k(int keys) {
        for (int nb = 0; nb < S_BLOCKS; ++nb)
            for (int i = 0; i < 4; ++i)  // S_acc[4 nb + i] is key 8 nb + 2 quad_col + i % 2
                if (8 * nb + 2 * quad_col + i % 2 >= keys) S_acc[4 * nb + i] = -INFINITY;
    }
    // The softmax's first half, on S alone (it runs while this warpgroup's P V may still read P and write O):
    // the online-softmax update of this lane's two rows (r = 0: quad_row, r = 1: quad_row + 8) -- the new
    // max, the probabilities in place, the row sums -- and each row's rescale factor alpha.
    __device__ void softmax() {
        // Both rows' maxima first, each in four independent chains (fmax is exact in any order), then both
        // quads' shuffles: the exponentials wait for chains of 4 FMNMX, not for one of 16 per row.
        float row_max[2];
        for (int r = 0; r < 2; ++r) {
            float m[4];
            for (int j = 0; j < 4; ++j) m[j] = fmaxf(frag_at(S_acc, j, r, 0), frag_at(S_acc, j, r, 1));
            for (int nb = 4; nb < S_BLOCKS; ++nb) m[nb % 4] = fmaxf(m[nb % 4], fmaxf(frag_at(S_acc, nb, r, 0), frag_at(S_acc, nb, r, 1)));
            row_max[r] = fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
        }
        for (int r = 0; r < 2; ++r) row_max[r] = quad_max(row_max[r]);
        for (int r = 0; r < 2; ++r) {
            // Conditional rescaling: keep the old shift unless the tile's max is far above it (always moved on
            // the first tile, where m_i = -inf). Exact either way: l and O use the same shift (verify/model.py).
            const bool move = (row_max[r] - m_i[r]) * scale_log2 > RESCALE_THRESHOLD;
            const float m_new = move ? row_max[r] : m_i[r];
            alpha[r] = move ? ex2_approx_ftz((m_i[r] - m_new) * scale_log2) : 1.f;  // 2^-inf = 0 on the first tile
            const float m_scaled = m_new * scale_log2;
            float row_sum = 0.f;
            for (int nb = 0; nb < S_BLOCKS; ++nb) {  // one FFMA + one MUFU.EX2 per element
                frag_at(S_acc, nb, r, 0) = ex2_approx_ftz(fmaf(frag_at(S_acc, nb, r, 0), scale_log2, -m_scaled));
                frag_at(S_acc, nb, r, 1) = ex2_approx_ftz(fmaf(frag_at(S_acc, nb, r, 1), scale_log2, -m_scaled));
                row_sum += frag_at(S_acc, nb, r, 0) + frag_at(S_acc, nb, r, 1);
            }
            l_i[r] = alpha[r] * l_i[r] + row_sum;  // no shuffle: the quad's parts are added once, at the end
            m_i[r] = m_new;
        }
    }
    // The second half, once the previous P V is complete: rescale O (skipped when no row of the warp moved
    // its shift, a warp-uniform branch: after the first few tiles of a row the common case), and P for the
    // next block (two neighbouring 8-key blocks of S, rounded to bf16: mma's A fragment).
    __device__ void rescale_o_and_make_p() {
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
            for (int db = 0; db < O_BLOCKS; ++db) {
                for (int r = 0; r < 2; ++r) {
                    frag_at(O_acc, db, r, 0) *= alpha[r];
                    frag_at(O_acc, db, r, 1) *= alpha[r];
                }
            }
        }
        for (int kk = 0; kk < PV_STEPS; ++kk) {
            P_frag[kk][0] = cvt_rn_bf16x2_f32(frag_at(S_acc, 2 * kk, 0, 0), frag_at(S_acc, 2 * kk, 0, 1));          // row g,   keys +2t
            P_frag[kk][1] = cvt_rn_bf16x2_f32(frag_at(S_acc, 2 * kk, 1, 0), frag_at(S_acc, 2 * kk, 1, 1));          // row g+8, keys +2t
            P_frag[kk][2] = cvt_rn_bf16x2_f32(frag_at(S_acc, 2 * kk + 1, 0, 0), frag_at(S_acc, 2 * kk + 1, 0, 1));  // row g,   keys +8+2t
            P_frag[kk][3] = cvt_rn_bf16x2_f32(frag_at(S_acc, 2 * kk + 1, 1, 0), frag_at(S_acc, 2 * kk + 1, 1, 1));  // row g+8, keys +8+2t
        }
    }
    __device__ void release(uint64_t* empty) const {  // this warp is done with a ring slot
        if (lane == 0) mbarrier_arrive(empty);
    }

    __device__ void start() {
        m_i[0] = m_i[1] = -INFINITY;
        l_i[0] = l_i[1] = 0.f;
        for (int i = 0; i < O_BLOCKS * 4; ++i) O_acc[i] = 0.f;
    }
    // GEMM block 0: S = Q K^T of K/V tile 0 alone. Tile 0 is the last in the sequence (kv_row): the only one
    // that may hold fewer than BLOCK_N keys.
    __device__ void gemm_block_first(int count, int keys) {
        const int stage = count % STAGES;
        wait_full(&smem.K_full[stage], count, 0);
        turn.take(0);
        wgmma_fence();
        issue_qk(stage);
        wgmma_commit_group();
        turn.pass();
        TRACE_EVENT(TRACE_GEMM_ISSUED, 0);
        wgmma_wait_group<0>();
        TRACE_EVENT(TRACE_GEMM_WAITED_ALL, 0);
        wgmma_fence_operands(S_acc);
        release(&smem.K_empty[stage]);
        if (keys < BLOCK_N) mask_past_seqlen_k(keys);
        {
            TRACE_SPAN(TRACE_SOFTMAX_BEGIN, 0);
            softmax();
        }
        TRACE_SPAN(TRACE_RESCALE_BEGIN, 0);
        rescale_o_and_make_p();
    }
    // GEMM blocks 1 .. n-1: S = Q K^T of tile j FIRST, then O += P V of tile j-1, as two commit groups. The
    // softmax of tile j needs only the first: it starts as soon as S is done (wait_group 1) and runs while the
    // tensor cores still work on this warpgroup's own P V (and then on the other consumer's block).
    __device__ void gemm_block_steady(int count, int kv_tile) {
        const int stage = count % STAGES, prev_stage = (count - 1) % STAGES;
        wait_full(&smem.K_full[stage], count, kv_tile);
        wait_full(&smem.V_full[prev_stage], count - 1, kv_tile);
        turn.take(kv_tile);
        wgmma_fence();  // O (rescaled), P and S were last touched by ordinary instructions
        issue_qk(stage);
        wgmma_commit_group();
        issue_pv(prev_stage);
        wgmma_commit_group();
        turn.pass();
        TRACE_EVENT(TRACE_GEMM_ISSUED, kv_tile);
        TRACE_EVENT(TRACE_GEMM_ISSUED, kv_tile);
        wgmma_wait_group<1>();        // S is complete (P V may still run)...
        TRACE_EVENT(TRACE_GEMM_WAITED_ALL_BUT_1, kv_tile);
        wgmma_fence_operands(S_acc);  // ...and the compiler may not read S any earlier
        release(&smem.K_empty[stage]);
        {
            TRACE_SPAN(TRACE_SOFTMAX_BEGIN, kv_tile);
            softmax();                // under the tensor cores' P V...
            keep_work_before_wait();  // ...there, not after the wait below (ptxas would move the wait up)
        }
        wgmma_wait_group<0>();        // P V is complete: O and P are free again
        TRACE_EVENT(TRACE_GEMM_WAITED_ALL, kv_tile);
        wgmma_fence_operands(O_acc);
        release(&smem.V_empty[prev_stage]);
        TRACE_SPAN(TRACE_RESCALE_BEGIN, kv_tile);
        rescale_o_and_make_p();
    }
    // GEMM block n: O += P V of the last tile alone. Consumer 1 hands no turn over after it: consumer 0 has no
    // block left, and an arrival nobody waits for would leave the barrier half-counted at exit.
    __device__ void gemm_block_last(int count, int kv_tile) {
        const int stage = count % STAGES;
        wait_full(&smem.V_full[stage], count, kv_tile);
        turn.take(kv_tile);
        wgmma_fence();
        issue_pv(stage);
        wgmma_commit_group();
        if (index == 0) turn.pass();
        TRACE_EVENT(TRACE_GEMM_ISSUED, kv_tile);
        wgmma_wait_group<0>();
        TRACE_EVENT(TRACE_GEMM_WAITED_ALL, kv_tile);
        wgmma_fence_operands(O_acc);
        release(&smem.V_empty[stage]);
    }

    // The epilogue: the row sums' quad parts added up, the final normalization, once per row, and the
    // log-sum-exp. Rows past seqlen_q (zeros from TMA) are computed, not stored.
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
            if (quad_col == 0) p.lse[(int64_t(batch) * p.heads + head) * p.seqlen_q + q_row] = m_i[r] * p.scale + logf(l);
        }
    }
};

// A consumer's work: Q, then the GEMM blocks on this consumer's turns, then the epilogue.
__device__ void consumer_mma(SharedStorage& smem, const FwdParams& p, int index) {
    MmaWarpgroup wg(smem, p, index);
    const int num_kv_tiles = ceil_div(p.seqlen_k, BLOCK_N);
    const int first_tile_keys = p.seqlen_k - (num_kv_tiles - 1) * BLOCK_N;  // 1 .. BLOCK_N: K/V tile 0 is the last
    wg.start();
    {
        TRACE_SPAN(TRACE_FULL_WAIT_BEGIN, blockIdx.x);
        mbarrier_wait_parity(&smem.Q_full, 0);  // Q's one and only phase
    }
    if (index == 1) wg.turn.pass();  // consumer 0 takes the first turn
    wg.gemm_block_first(0, first_tile_keys);
    for (int kv_tile = 1; kv_tile < num_kv_tiles; ++kv_tile) wg.gemm_block_steady(kv_tile, kv_tile);
    wg.gemm_block_last(num_kv_tiles - 1, num_kv_tiles);
    wg.epilogue();
}

// ==== The kernel ====
// Set up the barriers, then split by warpgroup into the two roles. The tensor maps are kernel parameters
// (__grid_constant__): the TMA unit reads them from parameter memory. One block per SM; the (threads, 1) launch bound
// caps registers at kernel entry (168), which setmaxnreg then redistributes.
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

// ==== The host: exports and the launcher ====
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
