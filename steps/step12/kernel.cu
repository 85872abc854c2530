// flashladder step12 -- intra-warpgroup overlap: S = Q K^T first, so each softmax can run under its own P V.
//
// The ladder (docs/ladder.md): 01 plain CUDA -> 02 tensor cores -> 03 cp.async -> 04 swizzle ->
// 05 double buffering -> 06 instruction diet -> 07 two row blocks per warp -> 08 TMA -> 09 wgmma ->
// 10 warp specialization -> 11 ping-pong -> 12 intra-warpgroup overlap -> 13 FA4 softmax -> 14 persistent.
//
// WHAT CHANGED FROM STEP11
//   In step11 a consumer waits for its whole GEMM block (P V of tile j-1, then S of tile j) before its
//   softmax of tile j starts; only the OTHER consumer's block can hide that softmax. But the softmax of
//   tile j needs only S_j, not the P V: so issue S_j first, then P V of tile j-1, as two commit groups,
//   and start the softmax as soon as the first group is done (wgmma.wait_group 1) while the tensor cores
//   are still on this warpgroup's own P V (FlashAttention-3's intra-warpgroup overlap).
//   The softmax splits in two: the part on S alone (max, exponentials, row sums, alpha) runs under the
//   P V; the part that touches O and P_frag -- rescale O by alpha, round P to bf16 -- waits for the P V to
//   complete (wait_group 0), because that wgmma is still accumulating into O and reading P_frag.
//   The smem slots are released as early as each product allows: K after wait_group 1, V after 0.
//
//       step11:  issue [PV j-1, S j] -> wait all -> softmax j (max, exp, rescale O, P)
//       step12:  issue [S j][PV j-1] -> wait S   -> softmax j (max, exp) -> wait PV -> rescale O, P
//
// WHAT THE SASS SHOWS: less than the above. ptxas moves the wait for P V (WARPGROUP.DEPBAR.LE gsb0, 0x0) up
//   into the row max's shuffles, so the exponentials, the row sums and the O rescale run after the P V has
//   completed: only the max and its shuffles overlap it. What this step gains comes from S arriving first.
//   Keeping the wait below the softmax (step13's one-line fence) does make the exponentials overlap as
//   written, and here it is SLOWER (results/h200/dev/2026-11-29-wait-pinned-fence.log, N = 4K / 16K:
//   612.5 / 637.5 -> 592.8 / 616.5 TFLOP/s). The likely cause (not proven: moving the rescale between the
//   two GEMM issues did not help either, NOTES.md): the unconditional O rescale, 64 FMUL per thread, then
//   waits for the P V alone, where ptxas's order had mixed it with the exponentials. It pays from step13
//   on, where the rescale is rare. (The traced build of verify/trace.py could not show this: its own event
//   writes keep ptxas from moving the wait, so its timeline draws the overlap the source describes.)
//
// PREDICTION: the exponentials of one warpgroup now overlap its own P V as well as the other consumer's
//   block, so even when the two consumers drift into step with each other the tensor cores have work:
//   +5-10% over step11.
// MEASURED (results/h200/2026-11-29T21-28-55Z.json, H200, steady state, N = 4K / 8K / 16K):
//   596.9 / 612.3 / 620.0 -> 606.8 / 625.1 / 634.6 TFLOP/s (1.02x at each N), 0.99 / 1.01 / 1.03x SDPA's
//   cuDNN backend: below the prediction, which assumed the exponentials would overlap the P V (above: in
//   this build they do not).
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
constexpr int NUM_THREADS = (1 + NUM_CONSUMERS) * 128;  // warpgroup 0: the producer
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
constexpr int ROW_BYTES = 64 * sizeof(__nv_bfloat16);        // 128: one row of one half
constexpr int ATOM_BYTES = 8 * ROW_BYTES;                    // 1024: one 8-row swizzle atom (the SBO)
constexpr int KSTEP_BYTES = 16 * sizeof(__nv_bfloat16);      // 32: 16 columns, one k-step of Q K^T
constexpr int KSTEPS_PER_HALF = 64 / 16;                     // k-steps 0-3 read half 0, 4-7 half 1
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
static_assert(NUM_CONSUMERS == 2, "ping-pong alternates exactly two consumer warpgroups");

// Named barriers (ids 1-15; 0 is __syncthreads). Consumer c waits on its own turn barrier before it issues
// its GEMMs, and arrives on the other's once they are issued; each barrier counts both warpgroups' threads.
enum NamedBarrier : int { CONSUMER0_TURN = 1, CONSUMER1_TURN = 2 };
constexpr int TURN_THREADS = NUM_CONSUMERS * 128;

// One thread asks the TMA unit for a [ROWS, HEAD_DIM] tile starting at `row` of (head, batch): two boxes of
// [ROWS, 64] (the two swizzled halves), both completing on `bar`, which first learns how many bytes to expect.
template <int ROWS>
__device__ void load_tile_tma(__nv_bfloat16* dst_smem, const CUtensorMap* map, int row, int head, int batch, uint64_t* bar) {
    constexpr int HALF = ROWS * 64;  // elements in one half
    mbarrier_arrive_expect_tx(bar, ROWS * HEAD_DIM * sizeof(__nv_bfloat16));
    cp_async_bulk_tensor_4d_global_to_shared(dst_smem, map, 0, row, head, batch, bar);
    cp_async_bulk_tensor_4d_global_to_shared(dst_smem + HALF, map, 64, row, head, batch, bar);
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
    const int num_kv_tiles = p.seqlen_k / BLOCK_N;
    for (int kv_tile = 0; kv_tile < num_kv_tiles; ++kv_tile) {
        const int stage = kv_tile % STAGES;
        // The slot's n-th fill (n = kv_tile / STAGES) needs its (n-1)-th emptying: parity (n - 1) % 2.
        const uint32_t parity = (kv_tile / STAGES + 1) % 2;
        TRACE_EVENT(TRACE_EMPTY_WAIT_BEGIN, kv_tile);
        if (kv_tile >= STAGES) mbarrier_wait_parity(&smem.K_empty[stage], parity);
        TRACE_EVENT(TRACE_EMPTY_WAIT_END, kv_tile);
        TRACE_EVENT(TRACE_TMA_K, kv_tile);
        load_tile_tma<BLOCK_N>(smem.K[stage], &K_map, kv_tile * BLOCK_N, tma_coord(p.k_stride[1], head),
                               tma_coord(p.k_stride[0], batch), &smem.K_full[stage]);
        TRACE_EVENT(TRACE_EMPTY_WAIT_BEGIN, kv_tile);
        if (kv_tile >= STAGES) mbarrier_wait_parity(&smem.V_empty[stage], parity);
        TRACE_EVENT(TRACE_EMPTY_WAIT_END, kv_tile);
        TRACE_EVENT(TRACE_TMA_V, kv_tile);
        load_tile_tma<BLOCK_N>(smem.V[stage], &V_map, kv_tile * BLOCK_N, tma_coord(p.v_stride[1], head),
                               tma_coord(p.v_stride[0], batch), &smem.V_full[stage]);
    }
}

// A consumer warpgroup: 64 query rows, step10's math in a new order. The tensor-core work between two
// softmaxes is one "GEMM block": O += P V of the previous tile, then S = Q K^T of this one. Ping-pong: a
// consumer issues its block only on its turn and hands the turn over once the block is issued, so the two
// consumers' blocks reach the tensor cores alternately and each one's softmax runs under the other's block.
__device__ void consumer_mma(SharedStorage& smem, const FwdParams& p, int consumer) {
    const int q_tile = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const int warp = threadIdx.x / 32 - 4, lane = threadIdx.x % 32;  // warp 0-7 among the consumers
    const int quad_row = lane / 4;   // this lane holds rows quad_row and quad_row + 8 of its warp's 16
    const int quad_col = lane % 4;   // ... and columns 2*quad_col, 2*quad_col+1 of every 8-wide block
    const int num_kv_tiles = p.seqlen_k / BLOCK_N;
    const int my_turn = consumer == 0 ? CONSUMER0_TURN : CONSUMER1_TURN;
    const int other_turn = consumer == 0 ? CONSUMER1_TURN : CONSUMER0_TURN;
    TRACE_EVENT(TRACE_FULL_WAIT_BEGIN, q_tile);
    mbarrier_wait_parity(&smem.Q_full, 0);  // Q's one and only phase
    TRACE_EVENT(TRACE_FULL_WAIT_END, q_tile);

    // This warpgroup's 64 rows of Q, at k-step 0: the A operand of S = Q K^T, K-major, 128-byte swizzle.
    const uint32_t Q_rows = smem_u32(smem.Q) + consumer * ROWS_PER_WARPGROUP * ROW_BYTES;
    const float scale_log2 = p.scale * 1.4426950408889634f;  // softmax scale * log2(e): exp(x*scale) = 2^(x*scale_log2)
    float m_i[2] = {-INFINITY, -INFINITY};  // running max of rows quad_row, quad_row+8 (RAW scores)
    float l_i[2] = {0.f, 0.f};              // this lane's part of the running sum of 2^((score - m_i) * scale_log2)
    float O_acc[O_BLOCKS * 4];              // the warpgroup's [64 rows, 128 dims]: O_acc[4 * db + i] as mma's D
    for (int i = 0; i < O_BLOCKS * 4; ++i) O_acc[i] = 0.f;
    uint32_t P_frag[PV_STEPS][4];           // the previous tile's P: the A operand of the next GEMM block

    // The pieces of the loop, each used in more than one place below (the first and the last GEMM block
    // hold one product each; peeling them keeps every wgmma off a conditional path, which ptxas would
    // otherwise serialize).
    auto issue_qk = [&](float (&S)[S_BLOCKS * 4], int stage) {  // S = Q K^T: step10's 8 SS wgmma
        const uint32_t K_tile = smem_u32(smem.K[stage]);
        for (int kk = 0; kk < QK_STEPS; ++kk) {
            const uint32_t k_offset = kk / KSTEPS_PER_HALF * Q_HALF_BYTES + kk % KSTEPS_PER_HALF * KSTEP_BYTES;
            const uint32_t k_offset_kv = kk / KSTEPS_PER_HALF * KV_HALF_BYTES + kk % KSTEPS_PER_HALF * KSTEP_BYTES;
            wgmma_m64n128k16_ss(S, wgmma_desc(Q_rows + k_offset, 16, ATOM_BYTES),
                                wgmma_desc(K_tile + k_offset_kv, 16, ATOM_BYTES), kk > 0);
        }
    };
    auto issue_pv = [&](int stage) {  // O += P V: step10's 8 RS wgmma, P from the previous softmax
        const uint32_t V_tile = smem_u32(smem.V[stage]);
        for (int kk = 0; kk < PV_STEPS; ++kk)
            wgmma_m64n128k16_rs(O_acc, P_frag[kk], wgmma_desc(V_tile + kk * 2 * ATOM_BYTES, KV_HALF_BYTES, ATOM_BYTES), 1);
    };
    // The softmax in two halves. First the online-softmax update of this lane's two rows (r = 0: quad_row,
    // r = 1: quad_row + 8) on S alone: the new max, the probabilities in place, the row sums; it returns each
    // row's rescale factor alpha. It touches neither O nor P_frag, which the previous tile's P V may still
    // be reading or writing.
    auto softmax = [&](float (&S)[S_BLOCKS * 4], float (&alpha)[2]) {
        for (int r = 0; r < 2; ++r) {
            float tile_max = -INFINITY;
            for (int nb = 0; nb < S_BLOCKS; ++nb)
                tile_max = fmaxf(tile_max, fmaxf(S[4 * nb + 2 * r], S[4 * nb + 2 * r + 1]));
            const float m_new = fmaxf(m_i[r], quad_max(tile_max));
            alpha[r] = ex2_approx_ftz((m_i[r] - m_new) * scale_log2);  // 2^-inf = 0 on the first tile
            const float m_scaled = m_new * scale_log2;
            float row_sum = 0.f;
            for (int nb = 0; nb < S_BLOCKS; ++nb) {  // one FFMA + one MUFU.EX2 per element
                S[4 * nb + 2 * r] = ex2_approx_ftz(fmaf(S[4 * nb + 2 * r], scale_log2, -m_scaled));
                S[4 * nb + 2 * r + 1] = ex2_approx_ftz(fmaf(S[4 * nb + 2 * r + 1], scale_log2, -m_scaled));
                row_sum += S[4 * nb + 2 * r] + S[4 * nb + 2 * r + 1];
            }
            l_i[r] = alpha[r] * l_i[r] + row_sum;  // no shuffle: the quad's parts are added once, at the end
            m_i[r] = m_new;
        }
    };
    // Then, once the previous P V is complete: rescale O, and P for the next block (two neighbouring 8-key
    // blocks of S, rounded to bf16).
    auto rescale_o_and_make_p = [&](const float (&S)[S_BLOCKS * 4], const float (&alpha)[2]) {
        for (int db = 0; db < O_BLOCKS; ++db) {
            for (int r = 0; r < 2; ++r) {
                O_acc[4 * db + 2 * r] *= alpha[r];
                O_acc[4 * db + 2 * r + 1] *= alpha[r];
            }
        }
        for (int kk = 0; kk < PV_STEPS; ++kk) {
            P_frag[kk][0] = cvt_rn_bf16x2_f32(S[8 * kk + 0], S[8 * kk + 1]);  // row g,   keys +2t
            P_frag[kk][1] = cvt_rn_bf16x2_f32(S[8 * kk + 2], S[8 * kk + 3]);  // row g+8, keys +2t
            P_frag[kk][2] = cvt_rn_bf16x2_f32(S[8 * kk + 4], S[8 * kk + 5]);  // row g,   keys +8+2t
            P_frag[kk][3] = cvt_rn_bf16x2_f32(S[8 * kk + 6], S[8 * kk + 7]);  // row g+8, keys +8+2t
        }
    };
    // A slot's n-th use completes its phase n: the parity to wait on for tile j.
    auto parity = [](int kv_tile) { return uint32_t(kv_tile / STAGES) % 2; };

    // Step 3: the GEMM blocks, each on this consumer's turn: wait for the turn, issue, hand the turn over
    // once the block is issued, then wait for the block and do the softmax while the other consumer's
    // block runs on the tensor cores. Consumer 0 takes the first turn.
    if (consumer == 1) named_barrier_arrive(CONSUMER0_TURN, TURN_THREADS);
    float S_acc[S_BLOCKS * 4];  // S_acc[4 * nb + i]: key block nb, i as in mma's D fragment
    float alpha[2];             // this tile's rescale factors of rows quad_row, quad_row + 8

    // Block 0: S = Q K^T of tile 0 alone.
    TRACE_EVENT(TRACE_FULL_WAIT_BEGIN, 0);
    mbarrier_wait_parity(&smem.K_full[0], 0);
    TRACE_EVENT(TRACE_FULL_WAIT_END, 0);
    TRACE_EVENT(TRACE_TURN_WAIT_BEGIN, 0);
    named_barrier_sync(my_turn, TURN_THREADS);
    TRACE_EVENT(TRACE_TURN_WAIT_END, 0);
    wgmma_fence();
    issue_qk(S_acc, 0);
    wgmma_commit_group();
    named_barrier_arrive(other_turn, TURN_THREADS);
    TRACE_EVENT(TRACE_GEMM_ISSUED, 0);
    wgmma_wait_group<0>();
    TRACE_EVENT(TRACE_GEMM_WAITED_ALL, 0);
    wgmma_fence_operands(S_acc);
    if (lane == 0) mbarrier_arrive(&smem.K_empty[0]);  // this warp is done with the K tile
    TRACE_EVENT(TRACE_SOFTMAX_BEGIN, 0);
    softmax(S_acc, alpha);
    TRACE_EVENT(TRACE_SOFTMAX_END, 0);
    TRACE_EVENT(TRACE_RESCALE_BEGIN, 0);
    rescale_o_and_make_p(S_acc, alpha);
    TRACE_EVENT(TRACE_RESCALE_END, 0);

    // Blocks 1 .. n-1: S = Q K^T of tile j FIRST, then O += P V of tile j-1, as two commit groups. The
    // softmax of tile j needs only the first: it starts as soon as S is done (wait_group<1>) and runs while
    // the tensor cores still work on this warpgroup's own P V (and then on the other consumer's block).
    for (int kv_tile = 1; kv_tile < num_kv_tiles; ++kv_tile) {
        const int stage = kv_tile % STAGES, prev_stage = (kv_tile - 1) % STAGES;
        TRACE_EVENT(TRACE_FULL_WAIT_BEGIN, kv_tile);
        mbarrier_wait_parity(&smem.K_full[stage], parity(kv_tile));
        mbarrier_wait_parity(&smem.V_full[prev_stage], parity(kv_tile - 1));
        TRACE_EVENT(TRACE_FULL_WAIT_END, kv_tile);
        TRACE_EVENT(TRACE_TURN_WAIT_BEGIN, kv_tile);
        named_barrier_sync(my_turn, TURN_THREADS);
        TRACE_EVENT(TRACE_TURN_WAIT_END, kv_tile);
        wgmma_fence();  // O_acc (rescaled), P_frag and S_acc were last touched by ordinary instructions
        issue_qk(S_acc, stage);
        wgmma_commit_group();
        issue_pv(prev_stage);
        wgmma_commit_group();
        named_barrier_arrive(other_turn, TURN_THREADS);
        TRACE_EVENT(TRACE_GEMM_ISSUED, kv_tile);
        TRACE_EVENT(TRACE_GEMM_ISSUED, kv_tile);
        wgmma_wait_group<1>();          // S is complete (P V may still run)...
        TRACE_EVENT(TRACE_GEMM_WAITED_ALL_BUT_1, kv_tile);
        wgmma_fence_operands(S_acc);    // ...and the compiler may not read S any earlier
        if (lane == 0) mbarrier_arrive(&smem.K_empty[stage]);  // this warp is done with the K tile
        TRACE_EVENT(TRACE_SOFTMAX_BEGIN, kv_tile);
        softmax(S_acc, alpha);          // under the tensor cores' P V
        TRACE_EVENT(TRACE_SOFTMAX_END, kv_tile);
        wgmma_wait_group<0>();          // P V is complete: O and P_frag are free again
        TRACE_EVENT(TRACE_GEMM_WAITED_ALL, kv_tile);
        wgmma_fence_operands(O_acc);
        if (lane == 0) mbarrier_arrive(&smem.V_empty[prev_stage]);  // ... and so is the previous V tile
        TRACE_EVENT(TRACE_RESCALE_BEGIN, kv_tile);
        rescale_o_and_make_p(S_acc, alpha);
        TRACE_EVENT(TRACE_RESCALE_END, kv_tile);
    }

    // Block n: O += P V of the last tile alone. Consumer 1 hands no turn over after it: consumer 0 has no
    // block left, and an arrival nobody waits for would leave the barrier half-counted at exit.
    const int last = num_kv_tiles - 1;
    TRACE_EVENT(TRACE_FULL_WAIT_BEGIN, num_kv_tiles);
    mbarrier_wait_parity(&smem.V_full[last % STAGES], parity(last));
    TRACE_EVENT(TRACE_FULL_WAIT_END, num_kv_tiles);
    TRACE_EVENT(TRACE_TURN_WAIT_BEGIN, num_kv_tiles);
    named_barrier_sync(my_turn, TURN_THREADS);
    TRACE_EVENT(TRACE_TURN_WAIT_END, num_kv_tiles);
    wgmma_fence();
    issue_pv(last % STAGES);
    wgmma_commit_group();
    if (consumer == 0) named_barrier_arrive(other_turn, TURN_THREADS);
    TRACE_EVENT(TRACE_GEMM_ISSUED, num_kv_tiles);
    wgmma_wait_group<0>();
    TRACE_EVENT(TRACE_GEMM_WAITED_ALL, num_kv_tiles);
    wgmma_fence_operands(O_acc);
    if (lane == 0) mbarrier_arrive(&smem.V_empty[last % STAGES]);

    // Step 6: the row sums' quad parts added up, the final normalization, once per row, and the log-sum-exp.
    TRACE_EVENT(TRACE_EPILOGUE_BEGIN, q_tile);
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(l_i[r]);
        const float inv_l = 1.f / l;
        const int64_t q_row = int64_t(q_tile) * BLOCK_M + warp * 16 + quad_row + 8 * r;  // consumer warp w: rows 16w..
        __nv_bfloat16* O_gmem = row_ptr(static_cast<__nv_bfloat16*>(p.o), p.o_stride, batch, head, q_row);
        for (int db = 0; db < O_BLOCKS; ++db)
            *reinterpret_cast<__nv_bfloat162*>(O_gmem + db * 8 + 2 * quad_col) =
                __floats2bfloat162_rn(O_acc[4 * db + 2 * r] * inv_l, O_acc[4 * db + 2 * r + 1] * inv_l);
        if (quad_col == 0)
            p.lse[(int64_t(batch) * p.heads + head) * p.seqlen_q + q_row] = m_i[r] * p.scale + logf(l);
    }
    TRACE_EVENT(TRACE_EPILOGUE_END, q_tile);
}

// The kernel: set up the barriers, then split by warpgroup into the two roles. The tensor maps are
// kernel parameters (__grid_constant__): the TMA unit reads them from parameter memory. One block per SM;
// the (threads, 1) launch bound caps registers at kernel entry (168), which setmaxnreg then redistributes.
__global__ void __launch_bounds__(NUM_THREADS, 1)
    attention_fwd_kernel(const FwdParams p, const __grid_constant__ CUtensorMap Q_map,
                         const __grid_constant__ CUtensorMap K_map, const __grid_constant__ CUtensorMap V_map) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

    // Step 1: one thread initializes the barriers: a full barrier completes on its producer's expect_tx
    // plus the TMA bytes (1 arrival), an empty barrier on one arrival from every consumer warp.
    if (threadIdx.x == 0) {
        mbarrier_init(&smem.Q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&smem.K_full[s], 1), mbarrier_init(&smem.V_full[s], 1);
            mbarrier_init(&smem.K_empty[s], CONSUMER_WARPS), mbarrier_init(&smem.V_empty[s], CONSUMER_WARPS);
        }
        fence_mbarrier_init();  // the inits are visible to the TMA unit before the first copy completes on them
    }
    __syncthreads();  // no thread waits on a barrier before it is initialized; the last block-wide barrier

    // Step 2: the roles. Each setmaxnreg is executed by a whole warpgroup.
    const int warpgroup = threadIdx.x / 128;
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
FLASHLADDER_EXPORT int flashladder_seqlen_multiple_q() { return BLOCK_M; }  // one block per BLOCK_M query rows
FLASHLADDER_EXPORT int flashladder_seqlen_multiple_k() { return BLOCK_N; }  // whole K/V tiles only

FLASHLADDER_EXPORT int flashladder_fwd(const FwdParams* params, cudaStream_t stream) {
    // 160 KB of dynamic shared memory is above the 48 KB a block gets without asking (asked once per device).
    const cudaError_t err = raise_smem_limit_once<attention_fwd_kernel>(SMEM_BYTES);
    if (err != cudaSuccess) return err;
    // The tensor maps, encoded on the host for every call (host work only, no round trip to the GPU; the
    // cost is measured in NOTES.md); they travel to the GPU inside the launch's parameters.
    const FwdParams& p = *params;
    CUtensorMap Q_map, K_map, V_map;
    if (encode_tile_map(&Q_map, p.q, p.q_stride, p.seqlen_q, p.heads, p.batch, BLOCK_M) != CUDA_SUCCESS ||
        encode_tile_map(&K_map, p.k, p.k_stride, p.seqlen_k, p.heads, p.batch, BLOCK_N) != CUDA_SUCCESS ||
        encode_tile_map(&V_map, p.v, p.v_stride, p.seqlen_k, p.heads, p.batch, BLOCK_N) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;  // a layout the TMA unit cannot describe (the binding's checks should prevent it)
    const dim3 grid(p.seqlen_q / BLOCK_M, p.heads, p.batch);
    attention_fwd_kernel<<<grid, NUM_THREADS, SMEM_BYTES, stream>>>(p, Q_map, K_map, V_map);
    return cudaGetLastError();
}
