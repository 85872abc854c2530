// flashladder step17 -- the paired kernel's wgmma descriptors built once per tile, and advanced.
//
// The ladder (docs/ladder.md): 01 plain CUDA -> 02 tensor cores -> 03 cp.async -> 04 swizzle ->
// 05 double buffering -> 06 instruction diet -> 07 two row blocks per warp -> 08 TMA -> 09 wgmma ->
// 10 warp specialization -> 11 ping-pong -> 12 conditional rescale -> 13 intra-warpgroup overlap -> 14 persistent ->
// 15 causal and grouped heads -> 16 CTA pairs -> 17 descriptors built once.
//
// WHAT CHANGED FROM STEP16
//   In the paired kernel, issue_qk and issue_pv build each tile's wgmma descriptors once (Q's, K's, V's) and advance
//   them by the k-step's bytes (wgmma_desc_advance: one add to the low word), where step16 encodes a descriptor for
//   every k-step; and the warpgroup's index is read from lane 0 (__shfl_sync), provably the same across the warp, so
//   it lives in a uniform register. A wgmma takes its descriptors from uniform registers: the steady loop now moves
//   none there from the vector registers (R2UR). The kernel of one CTA per cluster keeps step15's code.
// WHY (results/h200/2026-12-01-fa3-recipe/ab-s13split.log): on step13, descriptors built once ran 615.7 against 607.5
//   TFLOP/s at N = 4K and 658.0 against 646.4 at 16K. On the kernel of one CTA per cluster they lost at 2K and 4K
//   (results/h200/2026-12-02-step16/ab-step16.log: 0.991x and 0.992x step15), so that kernel keeps step15's code.
// PREDICTION: +1% in the paired kernel (4K keys and more); nothing below.
// MEASURED (results/h200/2026-12-03T16-19-14Z.json, N = 4K / 8K / 16K): 649.8 / 657.9 / 661.6 TFLOP/s, 0.98 / 0.98 /
//   0.97x step16: the prediction missed, at a higher clock (1740 MHz against 1710 at 16K). Nor does it pay later
//   (results/h200/2026-12-03-ab36/ab-36.log, N = 4K / 16K): step18 677.3 / 704.8 TFLOP/s with it, 684.9 / 704.4
//   without; step22 693.9 / 718.4 with, 688.8 / 716.0 without. It leaves the ladder (docs/design.md).
// CHECKED (results/h200/2026-12-03-part2/checks_step17.log): every check passed. test_sass.py:
//   30 or more fewer R2UR in the paired kernel than in step16's (50 with the nvcc of CI, 13), the other kernel step15's.
// PICTURES: docs/img/descriptor_advance.png, results/h200/timeline/step17.png (measured).
#include "flashladder.cuh"
#include "mbarrier.cuh"
#include "ptx.cuh"
#include "swizzle.cuh"
#include "tma.cuh"
#include "trace.cuh"
#include "wgmma.cuh"

namespace {

// ==== Sizes ====
constexpr int BLOCK_M = 128;                          // query rows per work tile
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
// CTA pairs (PAIRED): the two CTAs of a cluster take neighbouring Q tiles of one head, walk the same K/V tiles, and
// each loads one half of every K/V tile into both (TMA multicast). A dense call takes them with an even number of Q
// tiles and at least this many keys. The other calls run one CTA per cluster.
constexpr int PAIR_MIN_SEQLEN_K = 4096;
constexpr int PAIR_CTAS = 2;  // the CTAs of a cluster of the paired kernel
__host__ __device__ constexpr int cluster_ctas(bool paired) { return paired ? PAIR_CTAS : 1; }

// ==== Shared memory, barriers, the ring ====
// The tiles first, each 1024-byte aligned: TMA's 128-byte swizzle is a function of the address bits 4-9, and the
// wgmma descriptors (base offset 0) assume the atoms start on 1024 bytes.
struct alignas(1024) SharedStorage {
    __nv_bfloat16 Q[BLOCK_M * HEAD_DIM];          // [2 halves, BLOCK_M, 64]
    __nv_bfloat16 K[STAGES][BLOCK_N * HEAD_DIM];  // [2 halves, BLOCK_N, 64] per slot
    __nv_bfloat16 V[STAGES][BLOCK_N * HEAD_DIM];
    __nv_bfloat16 O[NUM_CONSUMERS][ROWS_PER_WARPGROUP * HEAD_DIM];  // each consumer's output tile, [2 halves, 64, 64]
    uint64_t Q_full, Q_empty;                     // Q has landed / both consumers are done with it (a phase per tile)
    uint64_t K_full[STAGES], V_full[STAGES];      // slot s holds its tile: the producer's expect_tx + TMA bytes
    uint64_t K_empty[STAGES], V_empty[STAGES];    // every consumer warp (PAIRED: of both CTAs) is done with slot s
};
constexpr int SMEM_BYTES = sizeof(SharedStorage);
constexpr int CONSUMER_WARPS = NUM_CONSUMERS * 4;  // the arrivals that empty a slot
static_assert(NUM_CONSUMERS == 2, "ping-pong alternates exactly two consumer warpgroups");

// Named barriers (ids 1-15; 0 is __syncthreads). EPILOGUE0/1: one consumer warpgroup's own 128 threads,
// around its output tile in shared memory.
enum NamedBarrier : int { CONSUMER0_TURN = 1, CONSUMER1_TURN = 2, EPILOGUE0 = 3, EPILOGUE1 = 4 };

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

// ==== The tile scheduler ====
// Work tile t is (q_tile, head, batch), q_tile fastest: the CTAs that run at the same time work on neighbouring Q
// tiles of the same few (batch, head) pairs, so each K/V tile is read from HBM once and then served from L2. The grid
// has one CTA per SM and takes the work tiles in rounds: CTA b takes tiles b, b + gridDim.x, b + 2 gridDim.x, ...
// PAIRED: the grid is even, so the CTAs 2c and 2c + 1 of a cluster take the tiles 2i and 2i + 1 of one head each round.
// Causal: tiles come in pairs of equal work. Within a head, tile 2i is the i-th longest Q tile and tile 2i + 1 the
// i-th shortest, and CTA b takes the pairs b, b + gridDim.x, ... (both tiles of a pair, one after the other). A head
// with an odd number of Q tiles ends in a pair whose second tile is no tile (q_tile -1, skipped): its middle tile goes
// alone, and no pair spans two heads.
struct WorkTile {
    int q_tile, head, batch;
};
__host__ __device__ __forceinline__ int tiles_per_head(const FwdParams& p) {
    const int q_tiles = ceil_div(p.seqlen_q, BLOCK_M);
    return p.causal ? 2 * ceil_div(q_tiles, 2) : q_tiles;  // causal: whole pairs
}
__host__ __device__ __forceinline__ int num_work_tiles(const FwdParams& p) { return tiles_per_head(p) * p.heads * p.batch; }
__device__ __forceinline__ WorkTile work_tile(int t, const FwdParams& p) {
    const int q_tiles = ceil_div(p.seqlen_q, BLOCK_M), i = t % tiles_per_head(p), j = i / 2;
    const int q_tile = !p.causal ? i : i % 2 == 0 ? q_tiles - 1 - j : j < q_tiles - 1 - j ? j : -1;  // long, short, ...
    return {q_tile, t / tiles_per_head(p) % p.heads, t / tiles_per_head(p) / p.heads};
}
__host__ __device__ __forceinline__ int tiles_per_round(const FwdParams& p) { return p.causal ? 2 : 1; }  // a pair, or one
// This CTA's work tiles: first_tile(p), then next_tile(t, p), ... while t < num_work_tiles(p).
__device__ __forceinline__ int first_tile(const FwdParams& p) { return blockIdx.x * tiles_per_round(p); }
__device__ __forceinline__ int next_tile(int t, const FwdParams& p) {
    const int n = tiles_per_round(p);
    return (t + 1) % n ? t + 1 : t + 1 + (gridDim.x - 1) * n;  // the pair's second tile, or the next round's first
}
// The K/V tiles a work tile visits: `tiles` from key 0 up to the last key that one of its rows sees (0: no row sees a
// key), of which the last `masked` hold keys that some row of it must not see (past seqlen_k, or right of the
// diagonal). The others every row sees whole.
struct KvRange {
    int tiles, masked;
};
__device__ __forceinline__ KvRange kv_range(const WorkTile& w, const FwdParams& p) {
    const int row0 = w.q_tile * BLOCK_M, row_end = min(row0 + BLOCK_M, p.seqlen_q);
    int seen_by_last = p.seqlen_k, seen_by_first = p.seqlen_k;  // keys [0, n) seen by the tile's last row, by its first
    if (p.causal) {
        seen_by_last = max(0, min(seen_by_last, row_end + p.causal_offset));  // row r sees keys 0 .. r + offset
        seen_by_first = max(0, min(seen_by_first, row0 + 1 + p.causal_offset));
    }
    const int tiles = ceil_div(seen_by_last, BLOCK_N);
    return {tiles, tiles - min(tiles, seen_by_first / BLOCK_N)};
}
// The K/V walk runs from the last tile to the first: the tiles that need a mask (the partial tile past seqlen_k, the
// tiles the diagonal crosses) are the first ones, so only the first GEMM blocks mask.
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
// PAIRED: a K or V tile for both CTAs of the pair. This CTA's barrier expects the whole tile, as before; this CTA's
// producer loads one 64-column half (rank r: half r) into both CTAs, the peer's producer the other half.
template <int ROWS>
__device__ void load_tile_pair(__nv_bfloat16* dst_smem, const CUtensorMap* map, int row, int head, int batch, uint64_t* bar) {
    const uint32_t rank = cluster_ctarank();
    mbarrier_arrive_expect_tx(bar, ROWS * HEAD_DIM * sizeof(__nv_bfloat16));
    cp_async_bulk_tensor_4d_global_to_shared_multicast(dst_smem + rank * ROWS * TMA_HALF_COLS, map, rank * TMA_HALF_COLS, row, head,
                                                       batch, bar, 0b11);
}
template <bool PAIRED>
__device__ void load_kv_tile(__nv_bfloat16* dst_smem, const CUtensorMap* map, int row, int head, int batch, uint64_t* bar) {
    if constexpr (PAIRED) load_tile_pair<BLOCK_N>(dst_smem, map, row, head, batch, bar);
    else load_tile_tma<BLOCK_N>(dst_smem, map, row, head, batch, bar);
}

// The producer: one thread keeps the ring full, across all the work tiles of this CTA. For each tile: Q, once both
// consumers are done with the previous tile's Q; then each of its K/V tiles, each into the next ring slot once it is
// empty. The ring's count runs on across work tiles, and so do the slots' phases.
template <bool PAIRED>
__device__ void producer_load(SharedStorage& smem, const FwdParams& p, const CUtensorMap& Q_map, const CUtensorMap& K_map,
                              const CUtensorMap& V_map) {
    prefetch_tensormap(&Q_map), prefetch_tensormap(&K_map), prefetch_tensormap(&V_map);
    int count = 0, iteration = 0;  // iteration: the work tiles that loaded a Q (those whose rows see a key)
    for (int t = first_tile(p); t < num_work_tiles(p); t = next_tile(t, p)) {
        const WorkTile w = work_tile(t, p);
        if (w.q_tile < 0) continue;  // the empty half of a head's last pair
        const int num_kv_tiles = kv_range(w, p).tiles;
        if (num_kv_tiles == 0) continue;  // no row sees a key: nothing to load
        const int kv_head = w.head / (p.heads / p.heads_k);  // grouped heads share a K/V head
        if (iteration > 0) {
            TRACE_SPAN(TRACE_EMPTY_WAIT_BEGIN, t);
            mbarrier_wait_parity(&smem.Q_empty, (iteration - 1) % 2);
        }
        TRACE_EVENT(TRACE_TMA_Q, t);
        load_tile_tma<BLOCK_M>(smem.Q, &Q_map, w.q_tile * BLOCK_M, tma_coord(p.q_stride[1], w.head),
                               tma_coord(p.q_stride[0], w.batch), &smem.Q_full);
        ++iteration;
        for (int kv_tile = 0; kv_tile < num_kv_tiles; ++kv_tile, ++count) {
            const int stage = count % STAGES, row = kv_row(kv_tile, num_kv_tiles);
            if (count >= STAGES) {
                TRACE_SPAN(TRACE_EMPTY_WAIT_BEGIN, kv_tile);
                mbarrier_wait_parity(&smem.K_empty[stage], empty_parity(count));
            }
            TRACE_EVENT(TRACE_TMA_K, kv_tile);
            load_kv_tile<PAIRED>(smem.K[stage], &K_map, row, tma_coord(p.k_stride[1], kv_head), tma_coord(p.k_stride[0], w.batch),
                                 &smem.K_full[stage]);
            if (count >= STAGES) {
                TRACE_SPAN(TRACE_EMPTY_WAIT_BEGIN, kv_tile);
                mbarrier_wait_parity(&smem.V_empty[stage], empty_parity(count));
            }
            TRACE_EVENT(TRACE_TMA_V, kv_tile);
            load_kv_tile<PAIRED>(smem.V[stage], &V_map, row, tma_coord(p.v_stride[1], kv_head), tma_coord(p.v_stride[0], w.batch),
                                 &smem.V_full[stage]);
        }
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
// A consumer warpgroup: 64 query rows of every work tile, in registers. The tensor-core work between two
// softmaxes is one GEMM block: S = Q K^T of K/V tile j, then O += P V of tile j-1, two commit groups issued on
// this consumer's turn. The first block holds only S of tile 0, the last only the P V of the last tile:
// peeled, so that no wgmma sits on a conditional path inside a block (ptxas would serialize it; the blocks of a
// work tile sit under one branch, the tile having K/V at all, which ptxas leaves alone: no serialization warning).
template <bool PAIRED>
struct MmaWarpgroup {
    SharedStorage& smem;
    const FwdParams& p;
    const int index;               // 0 or 1: rows 64 * index .. 64 * index + 63 of the work tile
    const Turn turn;
    const int barrier;             // EPILOGUE0 or EPILOGUE1: this warpgroup's own named barrier
    const int lane, warp;          // warp 0-3 of this warpgroup: rows 16 * warp .. 16 * warp + 15 of its 64
    const int quad_row;            // this lane holds rows quad_row and quad_row + 8 of its warp's 16
    const int quad_col;            // ... and columns 2*quad_col, 2*quad_col+1 of every 8-wide block
    const uint32_t Q_rows;         // this warpgroup's 64 rows of Q at k-step 0: the A operand of S = Q K^T
    const float scale_log2;        // softmax scale * log2(e): exp(x * scale) = 2^(x * scale_log2)
    const uint32_t peer_smem;      // PAIRED: the peer CTA's shared memory as this CTA addresses it (mapa, once)
    float S_acc[S_BLOCKS * 4];     // S = Q K^T of a K/V tile: frag_at(S_acc, nb, r, i) is key 8 nb + 2 quad_col + i
    float O_acc[O_BLOCKS * 4];     // the warpgroup's [64 rows, 128 dims]: frag_at(O_acc, db, r, i) likewise
    uint32_t P_frag[PV_STEPS][4];  // the last softmax's P in bf16: the A operand of the next O += P V
    float m_i[2];                  // running max of rows quad_row, quad_row+8 (RAW scores)
    float l_i[2];                  // this lane's part of the running sum of 2^((score - m_i) * scale_log2)
    float alpha[2];                // ... and the rescale factor of the last softmax

    __device__ MmaWarpgroup(SharedStorage& smem_, const FwdParams& p_, int index_)
        : smem(smem_), p(p_), index(index_), turn(index_), barrier(index_ == 0 ? EPILOGUE0 : EPILOGUE1), lane(threadIdx.x % 32),
          warp(threadIdx.x / 32 % 4), quad_row(lane / 4), quad_col(lane % 4),
          Q_rows(smem_u32(smem_.Q) + index_ * ROWS_PER_WARPGROUP * ROW_BYTES), scale_log2(p_.scale * LOG2E),
          peer_smem(PAIRED ? mapa_shared_cluster(&smem_, cluster_ctarank() ^ 1) : 0) {}

    // S = Q K^T: 8 SS wgmma, one per 16-wide k-step of the head dim (32 bytes further inside an atom, or in
    // the other half). PAIRED: the descriptors are built once per tile and advanced, fewer instructions per key.
    __device__ void issue_qk(int stage) {
        const uint32_t K_tile = smem_u32(smem.K[stage]);
        const uint64_t Q_desc = wgmma_desc_kmajor(Q_rows), K_desc = wgmma_desc_kmajor(K_tile);
        for (int kk = 0; kk < QK_STEPS; ++kk) {
            const uint32_t half = kk / KSTEPS_PER_HALF, kstep = kk % KSTEPS_PER_HALF * KSTEP_BYTES;
            if constexpr (PAIRED)
                wgmma_m64n128k16_ss(S_acc, wgmma_desc_advance(Q_desc, half * Q_HALF_BYTES + kstep),
                                    wgmma_desc_advance(K_desc, half * KV_HALF_BYTES + kstep), kk > 0);
            else
                wgmma_m64n128k16_ss(S_acc, wgmma_desc_kmajor(Q_rows + half * Q_HALF_BYTES + kstep),
                                    wgmma_desc_kmajor(K_tile + half * KV_HALF_BYTES + kstep), kk > 0);
        }
    }
    // O += P V: 8 RS wgmma, one per 16 keys, P from registers, V N-major (16 keys = 2 atoms further).
    __device__ void issue_pv(int stage) {
        const uint32_t V_tile = smem_u32(smem.V[stage]);
        const uint64_t V_desc = wgmma_desc_nmajor(V_tile, KV_HALF_BYTES);
        for (int kk = 0; kk < PV_STEPS; ++kk)
            wgmma_m64n128k16_rs(O_acc, P_frag[kk],
                                PAIRED ? wgmma_desc_advance(V_desc, kk * 2 * WGMMA_ATOM_BYTES)
                                       : wgmma_desc_nmajor(V_tile + kk * 2 * WGMMA_ATOM_BYTES, KV_HALF_BYTES), 1);
    }
    // The scores of the keys a row must not see become -inf before the softmax (2^-inf = 0): keys past seqlen_k
    // (TMA filled the last tile's K and V with zeros, whose scores are 0, not -inf) and, causal, keys right of the
    // diagonal. `kv_row`: the tile's first key; `q_row`: this warpgroup's first query row.
    __device__ void mask(int kv_row, int q_row) {
        for (int r = 0; r < 2; ++r) {
            const int row = q_row + warp * 16 + quad_row + 8 * r;
            int seen = p.seqlen_k;  // keys [0, seen) of this row
            if (p.causal) seen = min(seen, row + 1 + p.causal_offset);
            const int cols = seen - kv_row - 2 * quad_col;  // ... as this lane's columns of the tile
            for (int nb = 0; nb < S_BLOCKS; ++nb)
                for (int i = 0; i < 2; ++i)
                    if (8 * nb + i >= cols) frag_at(S_acc, nb, r, i) = -INFINITY;
        }
    }
    // The softmax's first half, on S alone (it runs while this warpgroup's P V may still read P and write O):
    // the online-softmax update of this lane's two rows (r = 0: quad_row, r = 1: quad_row + 8) -- the new
    // max, the probabilities in place, the row sums -- and each row's rescale factor alpha. MASKED: a row may have
    // no key left in this tile (max -inf), nor before it: its shift stays 0 rather than -inf (2^(-inf + inf) is NaN).
    template <bool MASKED>
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
            const float m_scaled = MASKED && m_new == -INFINITY ? 0.f : m_new * scale_log2;
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
    __device__ void release(uint64_t* empty) const {  // this warp is done with Q
        if (lane == 0) mbarrier_arrive(empty);
    }
    __device__ void release_kv(uint64_t* empty) const {  // ... with a ring slot (PAIRED: which both CTAs' producers refill)
        if (lane == 0) {
            mbarrier_arrive(empty);
            if constexpr (PAIRED) mbarrier_arrive_cluster(peer_smem + (smem_u32(empty) - smem_u32(&smem)));  // the peer's twin
        }
    }

    // A new work tile starts from scratch.
    __device__ void start_tile() {
        m_i[0] = m_i[1] = -INFINITY;
        l_i[0] = l_i[1] = 0.f;
        for (int i = 0; i < O_BLOCKS * 4; ++i) O_acc[i] = 0.f;
    }
    // GEMM block 0: S = Q K^T of K/V tile 0 alone. Tile 0 is the last in the sequence (kv_row): the one that may
    // hold fewer than BLOCK_N keys, and the first the diagonal crosses. `kv_row`, `q_row`: as mask() takes them.
    __device__ void gemm_block_first(int count, bool masked, int kv_row, int q_row) {
        const int stage = count % STAGES;
        wait_full(&smem.K_full[stage], count, 0);
        turn.take(0);
        wgmma_fence();  // S was last read by ordinary instructions (the previous work tile's softmax)
        issue_qk(stage);
        wgmma_commit_group();
        turn.pass();
        TRACE_EVENT(TRACE_GEMM_ISSUED, 0);
        wgmma_wait_group<0>();
        TRACE_EVENT(TRACE_GEMM_WAITED_ALL, 0);
        wgmma_fence_operands(S_acc);
        release_kv(&smem.K_empty[stage]);
        if (masked) mask(kv_row, q_row);
        {
            TRACE_SPAN(TRACE_SOFTMAX_BEGIN, 0);
            softmax<true>();
        }
        TRACE_SPAN(TRACE_RESCALE_BEGIN, 0);
        rescale_o_and_make_p();
    }
    // GEMM blocks 1 .. n-1: S = Q K^T of tile j FIRST, then O += P V of tile j-1, as two commit groups. The
    // softmax of tile j needs only the first: it starts as soon as S is done (wait_group 1) and runs while the
    // tensor cores still work on this warpgroup's own P V (and then on the other consumer's block).
    // MASKED: a tile the diagonal crosses (mask() before the softmax).
    template <bool MASKED>
    __device__ void gemm_block_steady(int count, int kv_tile, int kv_row = 0, int q_row = 0) {
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
        release_kv(&smem.K_empty[stage]);
        if (MASKED) mask(kv_row, q_row);
        {
            TRACE_SPAN(TRACE_SOFTMAX_BEGIN, kv_tile);
            softmax<MASKED>();        // under the tensor cores' P V...
            keep_work_before_wait();  // ...there, not after the wait below (ptxas would move the wait up)
        }
        wgmma_wait_group<0>();        // P V is complete: O and P are free again
        TRACE_EVENT(TRACE_GEMM_WAITED_ALL, kv_tile);
        wgmma_fence_operands(O_acc);
        release_kv(&smem.V_empty[prev_stage]);
        TRACE_SPAN(TRACE_RESCALE_BEGIN, kv_tile);
        rescale_o_and_make_p();
    }
    // GEMM block n: O += P V of the last tile alone. Consumer 1 hands no turn over after it: consumer 0 has no
    // block left in this work tile, and takes the first turn of the next one that has K/V tiles from consumer 1's
    // opening arrival.
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
        release_kv(&smem.V_empty[stage]);
    }

    // ==== The epilogue ====
    // Through shared memory: the normalized O goes into this warpgroup's output tile in TMA's swizzled layout, and
    // one thread stores it with two bulk tensor copies (one per 64-column half), which run on while the warpgroup
    // starts its next work tile; TMA leaves out rows past seqlen_q. Before the tile is overwritten, the previous
    // tile's store must have read it. LSE goes straight to global memory.
    __device__ void epilogue(const WorkTile& w, const CUtensorMap& O_map, int t) {
        TRACE_SPAN(TRACE_EPILOGUE_BEGIN, t);
        const bool elected = threadIdx.x % WARPGROUP_THREADS == 0;  // the thread that issues the TMA stores
        __nv_bfloat16* O_tile = smem.O[index];
        if (elected) cp_async_bulk_wait_group_read<0>();
        named_barrier_sync(barrier, WARPGROUP_THREADS);  // the whole warpgroup knows O_tile is free
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(l_i[r]);
            const float inv_l = l > 0.f ? 1.f / l : 0.f;  // l = 0: a row that sees no key, O = 0 (and LSE = -inf + log 0)
            const int row = warp * 16 + quad_row + 8 * r;  // in this warpgroup's 64 rows
            for (int db = 0; db < O_BLOCKS; ++db)
                *reinterpret_cast<__nv_bfloat162*>(O_tile + swizzle_tma_128b<ROWS_PER_WARPGROUP>(row, db * 8 + 2 * quad_col)) =
                    __floats2bfloat162_rn(frag_at(O_acc, db, r, 0) * inv_l, frag_at(O_acc, db, r, 1) * inv_l);
            const int64_t q_row = int64_t(w.q_tile) * BLOCK_M + index * ROWS_PER_WARPGROUP + row;
            if (quad_col == 0 && q_row < p.seqlen_q)  // rows past seqlen_q (zeros from TMA) are computed, not stored
                p.lse[(int64_t(w.batch) * p.heads + w.head) * p.seqlen_q + q_row] = m_i[r] * p.scale + logf(l);
        }
        fence_proxy_async_shared_cta();            // this thread's stores are visible to the TMA unit...
        named_barrier_sync(barrier, WARPGROUP_THREADS);  // ...and so are everyone else's
        if (elected) {
            const int row0 = w.q_tile * BLOCK_M + index * ROWS_PER_WARPGROUP;
            const int head = tma_coord(p.o_stride[1], w.head), batch = tma_coord(p.o_stride[0], w.batch);
            cp_async_bulk_tensor_4d_shared_to_global(&O_map, 0, row0, head, batch, O_tile);
            cp_async_bulk_tensor_4d_shared_to_global(&O_map, TMA_HALF_COLS, row0, head, batch, O_tile + ROWS_PER_WARPGROUP * TMA_HALF_COLS);
            cp_async_bulk_commit_group();
        }
    }
    // The last stores are done before the CTA (and its shared memory) goes.
    __device__ void finish() const {
        if (threadIdx.x % WARPGROUP_THREADS == 0) cp_async_bulk_wait_group<0>();
    }
};

// A consumer's work: the work tiles of this CTA (the producer walks the same list), each a sequence of GEMM blocks on
// this consumer's turns. The ring's count runs on across work tiles, as the producer's does.
template <bool PAIRED>
__device__ void consumer_mma(SharedStorage& smem, const FwdParams& p, const CUtensorMap& O_map, int index) {
    MmaWarpgroup<PAIRED> wg(smem, p, index);
    int count = 0, iteration = 0;  // iteration: the work tiles that loaded a Q, as the producer counts them
    for (int t = first_tile(p); t < num_work_tiles(p); t = next_tile(t, p)) {
        const WorkTile w = work_tile(t, p);
        if (w.q_tile < 0) continue;  // the empty half of a head's last pair
        const KvRange kv = kv_range(w, p);
        const int q_row = w.q_tile * BLOCK_M + index * ROWS_PER_WARPGROUP;
        wg.start_tile();
        if (kv.tiles > 0) {  // else no row sees a key: no Q, no turns, and the epilogue stores O = 0, LSE = -inf
            {
                TRACE_SPAN(TRACE_FULL_WAIT_BEGIN, t);
                mbarrier_wait_parity(&smem.Q_full, iteration % 2);  // this tile's Q
            }
            ++iteration;
            if (index == 1) wg.turn.pass();  // consumer 0 takes the first turn of every work tile
            wg.gemm_block_first(count, kv.masked > 0, kv_row(0, kv.tiles), q_row);
            int kv_tile = 1;
            for (; kv_tile < kv.masked; ++kv_tile)
                wg.template gemm_block_steady<true>(count + kv_tile, kv_tile, kv_row(kv_tile, kv.tiles), q_row);
            for (; kv_tile < kv.tiles; ++kv_tile) wg.template gemm_block_steady<false>(count + kv_tile, kv_tile);
            wg.release(&smem.Q_empty);  // every S = Q K^T of this tile has completed: the producer may load the next Q
            wg.gemm_block_last(count + kv.tiles - 1, kv.tiles);
            count += kv.tiles;
        }
        wg.epilogue(w, O_map, t);
    }
    wg.finish();
}

// ==== The kernel ====
// Set up the barriers, then split by warpgroup into the two roles. The tensor maps are kernel parameters
// (__grid_constant__): the TMA unit reads them from parameter memory. One block per SM; the (threads, 1) launch bound
// caps registers at kernel entry (168), which setmaxnreg then redistributes.
// PAIRED runs in clusters of two CTAs (the launch's cluster dimension).
template <bool PAIRED>
__global__ void __launch_bounds__(NUM_THREADS, 1)
    attention_fwd_kernel(const FwdParams p, const __grid_constant__ CUtensorMap Q_map, const __grid_constant__ CUtensorMap K_map,
                         const __grid_constant__ CUtensorMap V_map, const __grid_constant__ CUtensorMap O_map) {
    constexpr int CTAS = cluster_ctas(PAIRED);
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

    // One thread initializes the barriers: a full barrier completes on its producer's expect_tx plus the TMA
    // bytes (1 arrival), an empty barrier on one arrival from every consumer warp (PAIRED: of both CTAs).
    if (threadIdx.x == 0) {
        mbarrier_init(&smem.Q_full, 1);
        mbarrier_init(&smem.Q_empty, CONSUMER_WARPS);
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&smem.K_full[s], 1), mbarrier_init(&smem.V_full[s], 1);
            mbarrier_init(&smem.K_empty[s], CTAS * CONSUMER_WARPS), mbarrier_init(&smem.V_empty[s], CTAS * CONSUMER_WARPS);
        }
        fence_mbarrier_init();  // the inits are visible to the TMA unit before the first copy completes on them
    }
    // No thread waits on a barrier before it is initialized (PAIRED: nor arrives on, nor copies into, the peer's).
    if constexpr (PAIRED) cluster_sync();
    else __syncthreads();  // the last block-wide barrier

    // The roles. Each setmaxnreg is executed by a whole warpgroup. PAIRED: the warpgroup's index is read from lane 0,
    // provably the same across the warp, so it lives in a uniform register (no R2UR moves in the loop).
    const int warpgroup = PAIRED ? __shfl_sync(0xffffffffu, threadIdx.x / WARPGROUP_THREADS, 0) : threadIdx.x / WARPGROUP_THREADS;
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) producer_load<PAIRED>(smem, p, Q_map, K_map, V_map);  // the other 127 threads are done
        if (PAIRED && threadIdx.x == 0) cluster_sync();  // PAIRED: neither CTA leaves while the other may still
    } else {                                             // arrive on its barriers or copy into its shared memory
        setmaxnreg_inc<CONSUMER_REGS>();
        consumer_mma<PAIRED>(smem, p, O_map, warpgroup - 1);
        if (PAIRED) cluster_sync();
    }
}

// The launcher's choice of kernel: which calls run in CTA pairs.
bool takes_pairs(const FwdParams& p) {
    const int q_tiles = ceil_div(p.seqlen_q, BLOCK_M);
    return !p.causal && q_tiles % 2 == 0 && p.seqlen_k >= PAIR_MIN_SEQLEN_K;
}

}  // namespace

// ==== The host: exports and the launcher ====
FLASHLADDER_EXPORT int flashladder_seqlen_multiple_q() { return 1; }  // any seqlen: TMA fills and clips the last tiles
FLASHLADDER_EXPORT int flashladder_seqlen_multiple_k() { return 1; }
FLASHLADDER_EXPORT int flashladder_tile_q() { return BLOCK_M; }  // the work tiles (for tests and tools)
FLASHLADDER_EXPORT int flashladder_tile_k() { return BLOCK_N; }
// The keys from which dense (causal = 0) or causal (causal = 1) calls may run in CTA pairs (takes_pairs), 0: never.
FLASHLADDER_EXPORT int flashladder_pair_min_seqlen_k(int causal) { return causal ? 0 : PAIR_MIN_SEQLEN_K; }
FLASHLADDER_EXPORT int flashladder_features() { return FLASHLADDER_FEATURE_CAUSAL | FLASHLADDER_FEATURE_GQA; }

namespace {
// One kernel's launch: its tensor maps, and its persistent grid, one CTA per SM, or fewer when there are fewer rounds
// (work tiles, or causal pairs of them); PAIRED: an even count, in clusters of two.
template <bool PAIRED>
cudaError_t launch(const FwdParams& p, int sms, cudaStream_t stream) {
    // 194 KB of dynamic shared memory is above the 48 KB a block gets without asking (asked once per device and kernel).
    cudaError_t err = raise_smem_limit_once<attention_fwd_kernel<PAIRED>>(SMEM_BYTES);
    if (err != cudaSuccess) return err;
    // The tensor maps, encoded on the host for every call (host work only, no round trip to the GPU); they travel to
    // the GPU inside the launch's parameters.
    CUtensorMap Q_map, K_map, V_map, O_map;  // O: written in boxes of one consumer's 64 rows
    if (encode_tile_map(&Q_map, p.q, p.q_stride, p.seqlen_q, p.heads, p.batch, BLOCK_M) != CUDA_SUCCESS ||
        encode_tile_map(&K_map, p.k, p.k_stride, p.seqlen_k, p.heads_k, p.batch, BLOCK_N) != CUDA_SUCCESS ||
        encode_tile_map(&V_map, p.v, p.v_stride, p.seqlen_k, p.heads_k, p.batch, BLOCK_N) != CUDA_SUCCESS ||
        encode_tile_map(&O_map, p.o, p.o_stride, p.seqlen_q, p.heads, p.batch, ROWS_PER_WARPGROUP) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;  // a layout the TMA unit cannot describe (the binding's checks should prevent it)
    constexpr int CTAS = cluster_ctas(PAIRED);
    const int rounds = ceil_div(num_work_tiles(p), tiles_per_round(p));  // a CTA's work tiles come one or two at a time
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3((rounds < sms ? rounds : sms) / CTAS * CTAS);
    config.blockDim = dim3(NUM_THREADS);
    config.dynamicSmemBytes = SMEM_BYTES;
    config.stream = stream;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = CTAS, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = PAIRED ? 1 : 0;
    return cudaLaunchKernelEx(&config, attention_fwd_kernel<PAIRED>, p, Q_map, K_map, V_map, O_map);
}
}  // namespace

FLASHLADDER_EXPORT int flashladder_fwd(const FwdParams* params, cudaStream_t stream) {
    // The SM count, read once per device.
    constexpr int MAX_DEVICES = 64;
    static int sm_count[MAX_DEVICES] = {};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    int sms = device < MAX_DEVICES ? sm_count[device] : 0;
    if (sms == 0) {
        if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return err;
        if (device < MAX_DEVICES) sm_count[device] = sms;
    }
    return takes_pairs(*params) ? launch<true>(*params, sms, stream) : launch<false>(*params, sms, stream);
}
