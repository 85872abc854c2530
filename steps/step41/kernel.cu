// flashladder step41 -- head dim 64 as well as 128: the forward's kernels built for either.
//
// The ladder (docs/ladder.md): 01 plain CUDA -> 02 tensor cores -> 03 cp.async -> 04 swizzle ->
// 05 double buffering -> 06 instruction diet -> 07 two row blocks per warp -> 08 TMA -> 09 wgmma ->
// 10 warp specialization -> 11 ping-pong -> 12 conditional rescale -> 13 intra-warpgroup overlap -> 14 persistent ->
// 15 causal and grouped heads -> 16 CTA pairs -> 17 descriptors built once -> 18 the split order ->
// 19 causal in CTA pairs -> 20 the split tail -> 21 one kernel per mask -> 22 divisions by multiplying ->
// 23 the backward, plainly -> 24 the backward on tensor cores -> 25 dQ added up across CTAs ->
// 26 the backward's loads under its products -> 27 a wider key tile -> 28 the backward on wgmma ->
// 29 the backward's loads by TMA -> 30 the backward's elementwise diet -> 31 the backward's descriptors built once ->
// 32 dQ behind the next scores -> 33 dQ reduced by TMA -> 34 dQ staged without bank conflicts ->
// 35 dQ beside dK -> 36 the backward's warp roles -> 37 dQ added in turn -> 38 tiles of 80 queries ->
// 39 the turns from the last key tile -> 40 fp16 -> 41 head dim 64.
//
// WHAT CHANGED FROM STEP40
//   The forward's kernels take the head dim as a template parameter, D (64 or 128), and the launcher picks one by the
//   call's (FwdParams' head_dim). D sets how many 64-column halves a row has in shared memory (1 or 2: common/swizzle.cuh),
//   the k-steps of S = Q K^T (D / 16), the width of O += P V (wgmma N = D: m64n64k16 at 64) and O's registers (D / 2
//   per thread); tiles, schedule and softmax as they were. At 64 a call runs one CTA per cluster (a pair splits a K/V
//   tile by its two halves). The backward stays at 128: a call at 64 that needs gradients goes to torch.
// WHY: CogVideoX, LTX-Video, SD3 and GPT-OSS pass head dim 64; the drop-in sent every such call back to torch.
// PREDICTION: at 64 a tile holds half the tensor-core work of 128's and the same exponentials: 16384 per CTA tile, 1024
//   cycles of the SM's 16 MUFU lanes, as long as the tile's products at the tensor cores' peak. The exponentials bind:
//   well under 128's rate in TFLOP/s (as FA3's is, in the issue's table). Head dim 128 unchanged.
// MEASURED (results/h200/2026-12-05T04-35-28Z.json, step42's build: this forward): at head dim 64 it makes 438-446
//   TFLOP/s at 4K-16K, 0.86-0.89x FA3 (causal 0.83-0.87x) and 0.95-0.97x SDPA cuDNN. A tile takes ~2400 cycles where its
//   products take 1024 at peak and its exponentials 1024: they barely overlap (FA3: 192-row tiles, three consumers).
// CHECKED: on the GPU, step42's checks (this forward) at 64 and 128, bf16 and fp16, and compute-sanitizer (results/h200/
//   2026-12-05-part4/); in the SASS (test_sass.py), the kernels at 128 are step40's instruction for instruction, those
//   at 64 take half the k-steps of S and one TMA copy per tile, as many exponentials; 0 spills.
#include <climits>

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
// The head dim D (of q, k and v): a template parameter of the forward's kernels, built for 64 and 128.
// A row of D columns sits in shared memory as D / 64 halves of 64 columns (128 bytes: common/swizzle.cuh).
template <int D> constexpr int HALVES = D / TMA_HALF_COLS;  // 64-column halves of a row: 1 or 2
template <int D> constexpr int O_BLOCKS = D / 8;            // O: D / 8 blocks of 8 dims, 4 registers each per thread
template <int D> constexpr int QK_STEPS = D / 16;           // k-steps of S = Q K^T over the head dim
constexpr int PV_STEPS = BLOCK_N / 16;                // k-steps of O += P V over the keys
constexpr int STAGES = 2;                             // K/V ring slots: compute one while the other fills
// FlashAttention-4's conditional rescale: the running max (the shift of the exponentials) moves only when a
// row's new max exceeds it by more than this, in log2 units; P stays <= 2^8 in between.
constexpr float RESCALE_THRESHOLD = 8.f;
// setmaxnreg budgets (per thread): the producer issues TMA copies and needs few; the consumers hold S, P and
// O. 128 x 24 + 2 x 128 x 240 = 64512 of the SM's 65536 registers.
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
// The inputs' and outputs' type, bf16 or fp16: Elem, a template parameter of the kernels (__nv_bfloat16 or __half), one
// build of each for either. Only the MMAs (common/wgmma.cuh) and the conversions from fp32 (common/ptx.cuh) see the
// type; the loads, the stores and the tiles in shared memory move 16-bit elements, whatever they hold.
using Bits16 = uint16_t;
// Byte distances inside a TMA-swizzled [rows, HEAD_DIM] tile (common/swizzle.cuh: two 64-column halves),
// for the wgmma descriptors (common/wgmma.cuh):
constexpr int ROW_BYTES = TMA_HALF_COLS * sizeof(Bits16);         // 128: one row of one half
constexpr int KSTEP_BYTES = 16 * sizeof(Bits16);                  // 32: 16 columns, one k-step of Q K^T
constexpr int KSTEPS_PER_HALF = TMA_HALF_COLS / 16;               // k-steps 0-3 read half 0, 4-7 half 1
constexpr int Q_HALF_BYTES = BLOCK_M * ROW_BYTES, KV_HALF_BYTES = BLOCK_N * ROW_BYTES;
// CTA pairs (PAIRED): the two CTAs of a cluster take neighbouring Q tiles of one head, walk the same K/V tiles, and
// each loads one half of every K/V tile into both (TMA multicast). A call takes them with an even number of Q tiles
// and at least this many keys; causal, with the diagonal at or right of the top-left one and whole quadruples of Q
// tiles in every head (the schedule below). The other calls run one CTA per cluster.
constexpr int PAIR_MIN_SEQLEN_K = 4096;
constexpr int PAIR_CTAS = 2;  // the CTAs of a cluster of the paired kernel
__host__ __device__ constexpr int cluster_ctas(bool paired) { return paired ? PAIR_CTAS : 1; }

// ==== Shared memory, barriers, the ring ====
// The tiles first, each 1024-byte aligned: TMA's 128-byte swizzle is a function of the address bits 4-9, and the
// wgmma descriptors (base offset 0) assume the atoms start on 1024 bytes.
// D = 128: 194 KB; D = 64: 98 KB.
template <int D>
struct alignas(1024) SharedStorage {
    Bits16 Q[BLOCK_M * D];                        // [HALVES, BLOCK_M, 64]
    Bits16 K[STAGES][BLOCK_N * D];                // [HALVES, BLOCK_N, 64] per slot
    Bits16 V[STAGES][BLOCK_N * D];
    Bits16 O[NUM_CONSUMERS][ROWS_PER_WARPGROUP * D];  // each consumer's output tile, [HALVES, 64, 64]
    float sums[CONSUMER_THREADS];                 // PAIRED: row 0's sums, stored to keep its exponentials before a wait
    uint64_t Q_full, Q_empty;                     // Q has landed / both consumers are done with it (a phase per tile)
    uint64_t K_full[STAGES], V_full[STAGES];      // slot s holds its tile: the producer's expect_tx + TMA bytes
    uint64_t K_empty[STAGES], V_empty[STAGES];    // every consumer warp (PAIRED: of both CTAs) is done with slot s
};
template <int D> constexpr int SMEM_BYTES = sizeof(SharedStorage<D>);
constexpr int CONSUMER_WARPS = NUM_CONSUMERS * 4;  // the arrivals that empty a slot
static_assert(NUM_CONSUMERS == 2, "ping-pong alternates exactly two consumer warpgroups");

// Named barriers (ids 1-15; 0 is __syncthreads). EPILOGUE0/1: one consumer warpgroup's own 128 threads,
// around its output tile in shared memory and the split tail's partials.
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
// alone, and no pair spans two heads. PAIRED, causal (whole quadruples of Q tiles in every head): each round the CTAs
// 2c and 2c + 1 of a cluster take two neighbouring pairs of one head, its pairs 2m and 2m + 1 (m counted within the
// head): the Q tiles q - 1 - 2m and q - 2 - 2m first (q tiles in the head), then 2m and 2m + 1: neighbours each time,
// and each CTA of the two the higher one of them once.
struct WorkTile {
    int q_tile, head, batch;
};
// n / d for 0 <= n < 2^31 as a multiply-high, an add and a shift, with d's magic number (Granlund and Montgomery,
// "Division by invariant integers using multiplication", 1994): mul = 2^32 (2^shift - d) / d + 1, shift = ceil(log2 d).
// Made on the host, once per call (make_schedule).
struct FastDiv {
    int d;
    uint32_t mul, shift;
    FastDiv() = default;
    __host__ explicit FastDiv(int d_) : d(d_), shift(0) {  // d >= 1
        while ((1u << shift) < uint32_t(d)) ++shift;
        mul = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d) / d + 1);
    }
    __device__ int div(int n) const { return int((__umulhi(uint32_t(n), mul) + uint32_t(n)) >> shift); }
};
// What the scheduler of one call divides by, and the split tail's counts: made once on the host (make_schedule,
// split_tail) and passed in the kernel's parameters.
struct Schedule {
    int q_tiles;                     // Q tiles per head
    int tiles;                       // work tiles in all
    FastDiv per_head, heads, group;  // work tiles per head (causal: whole pairs of Q tiles), heads, heads per K/V head
    int whole;                       // work tiles [0, whole) run whole: all of them, or (SPLIT) the full rounds'
    FastDiv walk, runs;              // SPLIT: the K/V tiles of a walk, and the tail's runs (a CTA's, PAIRED a pair's)
    int units;                       // SPLIT: the tail's units (a walk's K/V tiles per work tile, or per pair)
};
__host__ Schedule make_schedule(const FwdParams& p) {
    Schedule sched = {};
    sched.q_tiles = ceil_div(p.seqlen_q, BLOCK_M);
    const int per_head = p.causal ? 2 * ceil_div(sched.q_tiles, 2) : sched.q_tiles;  // causal: whole pairs
    sched.tiles = per_head * p.heads * p.batch;
    sched.per_head = FastDiv(per_head), sched.heads = FastDiv(p.heads), sched.group = FastDiv(p.heads / p.heads_k);
    sched.whole = sched.tiles, sched.walk = FastDiv(1), sched.runs = FastDiv(1), sched.units = 0;  // no split tail (split_tail may make one)
    return sched;
}
__device__ __forceinline__ WorkTile work_tile(int t, const FwdParams& p, const Schedule& sched) {
    const int bh = sched.per_head.div(t), batch = sched.heads.div(bh);  // t / tiles_per_head, then / heads
    const int i = t - bh * sched.per_head.d, j = i / 2;
    const int q_tile = !p.causal ? i : i % 2 == 0 ? sched.q_tiles - 1 - j : j < sched.q_tiles - 1 - j ? j : -1;  // long, short, ...
    return {q_tile, bh - batch * sched.heads.d, batch};
}
__host__ __device__ __forceinline__ int tiles_per_round(const FwdParams& p) { return p.causal ? 2 : 1; }  // a pair, or one
// This CTA's work tiles: first_tile(p), then next_tile(t, p), ... while t < s.tiles.
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
// PAIRED: both CTAs of a pair load every K/V tile that either of their neighbouring Q tiles (2i, 2i + 1) sees, which
// are the tiles that the higher one sees (it sees every key the lower one does); the lower one passes over the first
// ones of the walk (causal_offset >= 0 leaves it at least one tile of its own).
template <bool PAIRED>
__device__ __forceinline__ int walk_tiles(const WorkTile& w, const FwdParams& p) {
    return kv_range(PAIRED ? WorkTile{w.q_tile | 1, w.head, w.batch} : w, p).tiles;
}
__device__ __forceinline__ int kv_row(int kv_tile, int num_kv_tiles) { return (num_kv_tiles - 1 - kv_tile) * BLOCK_N; }

// ==== The split tail (dense calls, given a workspace) ====
// The grid takes the work tiles in rounds of one per CTA (PAIRED: a pair per cluster), and the last round is rarely
// full: 2048 work tiles on 132 CTAs are 15 rounds and 68 tiles, which leave 64 SMs idle while 68 run a whole tile.
// Here the tiles of that last round are cut along their K/V walks instead, and the pieces dealt out evenly: the tail's
// units (a work tile's K/V tiles, or PAIRED a pair's) in order, tile by tile, each CTA (cluster) a run of about the
// same count, the last CTA the first run (so that a CTA waits only for lower ones, which the GPU starts first; each
// CTA stores its partial before it waits for any). A piece that holds its walk's start (begin 0) comes last in its
// CTA's run; the pieces after it in the walk come first in lower CTAs' runs: they store their partial O, its shifts
// and its row sums in the workspace and raise a flag (begin > 0: a partial piece), and the piece that holds the start
// (its owner) waits for each flag, merges the partials into its registers and stores O and LSE as a whole tile does.
// SPLIT: a kernel of its own (attention_fwd_kernel<PAIRED, true, false>); every other call runs a kernel whose pieces
// are all whole tiles.
constexpr int MAX_SPLIT_CTAS = 512;  // the workspace's flags: one per consumer warpgroup of this many CTAs
constexpr int FLAGS_BYTES = MAX_SPLIT_CTAS * NUM_CONSUMERS * sizeof(int);
constexpr int PARTIAL_FLOAT4S = HEAD_DIM / 8 + 1;  // a consumer thread's partial: O_acc (D = 128's), then m_i[0..1], l_i[0..1]
__host__ __device__ constexpr int64_t workspace_bytes(int ctas) {
    return FLAGS_BYTES + int64_t(ctas) * NUM_CONSUMERS * PARTIAL_FLOAT4S * WARPGROUP_THREADS * sizeof(float4);
}
// The tail to split, if any (the launcher, once `ctas` CTAs are known): a dense call given a workspace whose last
// round is partial, on a grid the flags cover, its unit counts in int arithmetic (units * runs < 2^31). Returns
// whether the call splits it (SPLIT).
__host__ bool split_tail(Schedule& sched, const FwdParams& p, int ctas, bool paired) {
    const int pair = cluster_ctas(paired), walk = ceil_div(p.seqlen_k, BLOCK_N);
    const int64_t units = ctas ? int64_t(sched.tiles % ctas) / pair * walk : 0;
    if (p.causal || p.workspace == nullptr || units == 0 || ctas > MAX_SPLIT_CTAS || units * ctas >= INT_MAX) return false;
    sched.whole = sched.tiles / ctas * ctas, sched.walk = FastDiv(walk), sched.runs = FastDiv(ctas / pair), sched.units = int(units);
    return true;
}
struct Piece {
    int t, begin, end;  // work tile t, positions [begin, end) of its K/V walk (at most the walk's length)
};
// This CTA's share of the tail: its run r covers the tail's units [unit_start(r), unit_start(r + 1)).
struct Tail {
    int whole;           // work tiles [0, whole) run whole: all of them, or (SPLIT) the full rounds'
    int tiles, units;    // the work tiles in all; the tail's units (a walk's K/V tiles per work tile, or per pair)
    FastDiv walk, runs;  // the K/V tiles of a walk; the runs (a CTA's, PAIRED a pair's)
    int run;             // this CTA's run, counted from the last CTA
    __device__ int unit_start(int r) const { return runs.div(r * units); }  // r * units < 2^31 (split_tail)
};
template <bool PAIRED>
__device__ __forceinline__ Tail tail_of(const Schedule& sched) {
    return {sched.whole, sched.tiles, sched.units, sched.walk, sched.runs, sched.runs.d - 1 - int(blockIdx.x) / cluster_ctas(PAIRED)};
}
template <bool PAIRED>
__device__ __forceinline__ Piece tail_piece(const Tail& tail, int walk) {  // the run's part of a walk
    const int lo = tail.unit_start(tail.run) - walk * tail.walk.d, hi = tail.unit_start(tail.run + 1) - walk * tail.walk.d;
    if (hi <= max(lo, 0)) return {tail.tiles, 0, 0};  // the run ends before the walk (or is empty): no piece
    return {tail.whole + walk * cluster_ctas(PAIRED) + int(blockIdx.x) % cluster_ctas(PAIRED), max(lo, 0), min(hi, tail.walk.d)};
}
__device__ __forceinline__ int first_walk(const Tail& tail) { return tail.units > 0 ? tail.walk.div(tail.unit_start(tail.run)) : 0; }
// This CTA's pieces: first_piece, then next_piece, ... while t < s.tiles: its whole tiles (first_tile, next_tile, ...
// while t < whole), then (SPLIT) its run's pieces of the tail, walk by walk.
template <bool PAIRED, bool SPLIT>
__device__ __forceinline__ Piece first_piece(const Tail& tail, const FwdParams& p) {
    const int t = first_tile(p);
    return !SPLIT || t < tail.whole ? Piece{t, 0, INT_MAX} : tail_piece<PAIRED>(tail, first_walk(tail));
}
template <bool PAIRED, bool SPLIT>
__device__ __forceinline__ Piece next_piece(const Piece& c, const Tail& tail, const FwdParams& p) {
    if (SPLIT && c.t >= tail.whole) return tail_piece<PAIRED>(tail, (c.t - tail.whole) / cluster_ctas(PAIRED) + 1);
    const int t = next_tile(c.t, p);
    return !SPLIT || t < tail.whole ? Piece{t, 0, INT_MAX} : tail_piece<PAIRED>(tail, first_walk(tail));
}
// A consumer warpgroup's partial in the workspace: the flags first, then a slot per consumer warpgroup of each CTA,
// float4 e of thread i at e * 128 + i (a warp stores 512 consecutive bytes at a time): O_acc's D / 8, then m_i and l_i
// (a slot has room for D = 128's).
__device__ __forceinline__ int* partial_flag(void* workspace, int cta, int consumer) {
    return static_cast<int*>(workspace) + cta * NUM_CONSUMERS + consumer;
}
__device__ __forceinline__ float4* partial_slot(void* workspace, int cta, int consumer) {
    return reinterpret_cast<float4*>(static_cast<char*>(workspace) + FLAGS_BYTES) +
           (cta * NUM_CONSUMERS + consumer) * PARTIAL_FLOAT4S * WARPGROUP_THREADS + threadIdx.x % WARPGROUP_THREADS;
}
// A partial piece: O unnormalized, with its shifts and this lane's row sums, as they stand after its last P V; then
// its flag, once the whole warpgroup has stored (`barrier`: the warpgroup's own).
// (The CTA's index is read here in a volatile asm, which stays after the P V wait: from blockIdx.x, ptxas computes
// the slot's address ahead of the piece's loop, and the paired split kernel takes 16 instructions more.)
template <int D>
__device__ void store_partial(void* workspace, int consumer, int barrier, const float (&O_acc)[O_BLOCKS<D> * 4],
                              const float (&m_i)[2], const float (&l_i)[2]) {
    uint32_t cta;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(cta));
    float4* slot = partial_slot(workspace, cta, consumer);
    for (int e = 0; e < O_BLOCKS<D>; ++e)
        slot[e * WARPGROUP_THREADS] = make_float4(O_acc[4 * e], O_acc[4 * e + 1], O_acc[4 * e + 2], O_acc[4 * e + 3]);
    slot[O_BLOCKS<D> * WARPGROUP_THREADS] = make_float4(m_i[0], m_i[1], l_i[0], l_i[1]);
    named_barrier_sync(barrier, WARPGROUP_THREADS);  // the warpgroup's stores are done...
    if (threadIdx.x % WARPGROUP_THREADS == 0) store_release_gpu(partial_flag(workspace, cta, consumer), 1);  // ...before its flag
}
// The owner of a split walk (work tile t): each partial of it (the first pieces of the runs after this one, in order)
// merged into its registers, as the softmax's rescale does, with the larger of the two shifts.
template <int D, bool PAIRED>
__device__ void merge_partials(const Tail& tail, int t, void* workspace, int consumer, int barrier, float scale_log2,
                               float (&O_acc)[O_BLOCKS<D> * 4], float (&m_i)[2], float (&l_i)[2]) {
    constexpr int CTAS = cluster_ctas(PAIRED);
    const int runs = tail.runs.d, walk_end = ((t - tail.whole) / CTAS + 1) * tail.walk.d;  // the unit past this walk
    for (int r = tail.run + 1; r < runs && tail.unit_start(r) < walk_end; ++r) {
        if (tail.unit_start(r) == tail.unit_start(r + 1)) continue;  // an empty run (fewer units than runs)
        const int cta = (runs - 1 - r) * CTAS + int(blockIdx.x) % CTAS;
        if (threadIdx.x % WARPGROUP_THREADS == 0) {
            while (load_acquire_gpu(partial_flag(workspace, cta, consumer)) == 0) {}
            *partial_flag(workspace, cta, consumer) = 0;  // zero again for the next call, which the stream runs after this one
        }
        named_barrier_sync(barrier, WARPGROUP_THREADS);  // the partial is there for all
        const float4* slot = partial_slot(workspace, cta, consumer);
        const float4 ml = __ldcg(slot + O_BLOCKS<D> * WARPGROUP_THREADS);  // from L2: written by another SM
        const float m_other[2] = {ml.x, ml.y}, l_other[2] = {ml.z, ml.w};
        float mine[2], other[2];
        for (int r2 = 0; r2 < 2; ++r2) {
            const float m = fmaxf(m_i[r2], m_other[r2]);
            mine[r2] = ex2_approx_ftz((m_i[r2] - m) * scale_log2);
            other[r2] = ex2_approx_ftz((m_other[r2] - m) * scale_log2);
            l_i[r2] = l_i[r2] * mine[r2] + l_other[r2] * other[r2];
            m_i[r2] = m;
        }
        for (int e = 0; e < O_BLOCKS<D>; ++e) {  // O_acc[4 e + 2 r2 + i]: row r2
            const float4 o = __ldcg(slot + e * WARPGROUP_THREADS);
            O_acc[4 * e] = O_acc[4 * e] * mine[0] + o.x * other[0];
            O_acc[4 * e + 1] = O_acc[4 * e + 1] * mine[0] + o.y * other[0];
            O_acc[4 * e + 2] = O_acc[4 * e + 2] * mine[1] + o.z * other[1];
            O_acc[4 * e + 3] = O_acc[4 * e + 3] * mine[1] + o.w * other[1];
        }
    }
}

// ==== The producer ====
// One thread asks the TMA unit for a [ROWS, D] tile starting at `row` of (head, batch): a box of [ROWS, 64] per
// swizzled half (D / 64 of them), all completing on `bar`, which first learns how many bytes to expect.
// Rows past the tensor's end arrive as zeros.
template <int ROWS, int D = HEAD_DIM>  // (the backward's tiles: HEAD_DIM)
__device__ void load_tile_tma(Bits16* dst_smem, const CUtensorMap* map, int row, int head, int batch, uint64_t* bar) {
    mbarrier_arrive_expect_tx(bar, ROWS * D * sizeof(Bits16));
    for (int half = 0; half < HALVES<D>; ++half)
        cp_async_bulk_tensor_4d_global_to_shared(dst_smem + half * ROWS * TMA_HALF_COLS, map, half * TMA_HALF_COLS, row, head,
                                                 batch, bar);
}
// PAIRED (D = 128 alone): a K or V tile for both CTAs of the pair. This CTA's barrier expects the whole tile, as before;
// this CTA's producer loads one 64-column half (rank r: half r) into both CTAs, the peer's producer the other half.
template <int ROWS>
__device__ void load_tile_pair(Bits16* dst_smem, const CUtensorMap* map, int row, int head, int batch, uint64_t* bar) {
    const uint32_t rank = cluster_ctarank();
    mbarrier_arrive_expect_tx(bar, ROWS * 128 * sizeof(Bits16));
    cp_async_bulk_tensor_4d_global_to_shared_multicast(dst_smem + rank * ROWS * TMA_HALF_COLS, map, rank * TMA_HALF_COLS, row, head,
                                                       batch, bar, 0b11);
}
template <int D, bool PAIRED>
__device__ void load_kv_tile(Bits16* dst_smem, const CUtensorMap* map, int row, int head, int batch, uint64_t* bar) {
    static_assert(!PAIRED || D == 128, "a pair splits a K/V tile by its two halves: D = 128 alone");
    if constexpr (PAIRED) load_tile_pair<BLOCK_N>(dst_smem, map, row, head, batch, bar);
    else load_tile_tma<BLOCK_N, D>(dst_smem, map, row, head, batch, bar);
}

// The producer: one thread keeps the ring full, across all the pieces of this CTA. For each piece: Q, once both
// consumers are done with the previous piece's Q; then each of its K/V tiles, each into the next ring slot once it is
// empty. The ring's count runs on across pieces, and so do the slots' phases.
template <int D, bool PAIRED, bool SPLIT>
__device__ void producer_load(SharedStorage<D>& smem, const FwdParams& p, const Schedule& sched, const CUtensorMap& Q_map,
                              const CUtensorMap& K_map, const CUtensorMap& V_map) {
    prefetch_tensormap(&Q_map), prefetch_tensormap(&K_map), prefetch_tensormap(&V_map);
    int count = 0, iteration = 0;  // iteration: the pieces that loaded a Q (those whose rows see a key)
    const Tail tail = tail_of<PAIRED>(sched);
    for (Piece c = first_piece<PAIRED, SPLIT>(tail, p); c.t < sched.tiles; c = next_piece<PAIRED, SPLIT>(c, tail, p)) {
        const int t = c.t;
        const WorkTile w = work_tile(t, p, sched);
        if (w.q_tile < 0) continue;  // the empty half of a head's last pair
        const int num_kv_tiles = walk_tiles<PAIRED>(w, p), end = min(c.end, num_kv_tiles);  // PAIRED: the pair's walk
        if (end <= c.begin) continue;  // no row sees a key: nothing to load
        const int kv_head = sched.group.div(w.head);  // grouped heads share a K/V head
        if (iteration > 0) {
            TRACE_SPAN(TRACE_EMPTY_WAIT_BEGIN, t);
            mbarrier_wait_parity(&smem.Q_empty, (iteration - 1) % 2);
        }
        TRACE_EVENT(TRACE_TMA_Q, t);
        load_tile_tma<BLOCK_M, D>(smem.Q, &Q_map, w.q_tile * BLOCK_M, tma_coord(p.q_stride[1], w.head),
                               tma_coord(p.q_stride[0], w.batch), &smem.Q_full);
        ++iteration;
        for (int kv_tile = c.begin; kv_tile < end; ++kv_tile, ++count) {
            const int stage = count % STAGES, row = kv_row(kv_tile, num_kv_tiles);
            if (count >= STAGES) {
                TRACE_SPAN(TRACE_EMPTY_WAIT_BEGIN, kv_tile);
                mbarrier_wait_parity(&smem.K_empty[stage], empty_parity(count));
            }
            TRACE_EVENT(TRACE_TMA_K, kv_tile);
            load_kv_tile<D, PAIRED>(smem.K[stage], &K_map, row, tma_coord(p.k_stride[1], kv_head), tma_coord(p.k_stride[0], w.batch),
                                 &smem.K_full[stage]);
            if (count >= STAGES) {
                TRACE_SPAN(TRACE_EMPTY_WAIT_BEGIN, kv_tile);
                mbarrier_wait_parity(&smem.V_empty[stage], empty_parity(count));
            }
            TRACE_EVENT(TRACE_TMA_V, kv_tile);
            load_kv_tile<D, PAIRED>(smem.V[stage], &V_map, row, tma_coord(p.v_stride[1], kv_head), tma_coord(p.v_stride[0], w.batch),
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
template <typename Elem, int D, bool PAIRED>
struct MmaWarpgroup {
    SharedStorage<D>& smem;
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
    float O_acc[O_BLOCKS<D> * 4];  // the warpgroup's [64 rows, D dims]: frag_at(O_acc, db, r, i) likewise
    uint32_t P_frag[PV_STEPS][4];  // the last softmax's P in Elem: the A operand of the next O += P V
    float m_i[2];                  // running max of rows quad_row, quad_row+8 (RAW scores)
    float l_i[2];                  // this lane's part of the running sum of 2^((score - m_i) * scale_log2)
    float alpha[2];                // ... and the rescale factor of the last softmax

    __device__ MmaWarpgroup(SharedStorage<D>& smem_, const FwdParams& p_, int index_)
        : smem(smem_), p(p_), index(index_), turn(index_), barrier(index_ == 0 ? EPILOGUE0 : EPILOGUE1), lane(threadIdx.x % 32),
          warp(threadIdx.x / 32 % 4), quad_row(lane / 4), quad_col(lane % 4),
          Q_rows(smem_u32(smem_.Q) + index_ * ROWS_PER_WARPGROUP * ROW_BYTES), scale_log2(p_.scale * LOG2E),
          peer_smem(PAIRED ? mapa_shared_cluster(&smem_, cluster_ctarank() ^ 1) : 0) {}

    // S = Q K^T: D / 16 SS wgmma, one per 16-wide k-step of the head dim (32 bytes further inside an atom, or in
    // the other half). PAIRED: the descriptors are built once per tile and advanced, fewer instructions per key.
    __device__ void issue_qk(int stage) {
        const uint32_t K_tile = smem_u32(smem.K[stage]);
        const uint64_t Q_desc = wgmma_desc_kmajor(Q_rows), K_desc = wgmma_desc_kmajor(K_tile);
        for (int kk = 0; kk < QK_STEPS<D>; ++kk) {
            const uint32_t half = kk / KSTEPS_PER_HALF, kstep = kk % KSTEPS_PER_HALF * KSTEP_BYTES;
            if constexpr (PAIRED)
                wgmma_m64n128k16_ss<Elem>(S_acc, wgmma_desc_advance(Q_desc, half * Q_HALF_BYTES + kstep),
                                          wgmma_desc_advance(K_desc, half * KV_HALF_BYTES + kstep), kk > 0);
            else
                wgmma_m64n128k16_ss<Elem>(S_acc, wgmma_desc_kmajor(Q_rows + half * Q_HALF_BYTES + kstep),
                                          wgmma_desc_kmajor(K_tile + half * KV_HALF_BYTES + kstep), kk > 0);
        }
    }
    // O += P V: 8 RS wgmma, one per 16 keys, P from registers, V N-major (16 keys = 2 atoms further); N = D.
    __device__ void issue_pv(int stage) {
        const uint32_t V_tile = smem_u32(smem.V[stage]);
        const uint64_t V_desc = wgmma_desc_nmajor(V_tile, KV_HALF_BYTES);
        for (int kk = 0; kk < PV_STEPS; ++kk) {
            const uint64_t V_kk = PAIRED ? wgmma_desc_advance(V_desc, kk * 2 * WGMMA_ATOM_BYTES)
                                         : wgmma_desc_nmajor(V_tile + kk * 2 * WGMMA_ATOM_BYTES, KV_HALF_BYTES);
            if constexpr (D == 128) wgmma_m64n128k16_rs<Elem>(O_acc, P_frag[kk], V_kk, 1);
            else wgmma_m64n64k16_rs<Elem>(O_acc, P_frag[kk], V_kk, 1);  // one half: the halves' distance goes unread
        }
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
    // the online-softmax update of this lane's two rows -- the new max and each row's rescale factor alpha
    // (softmax_max), then the probabilities in place and the row sums (softmax_exp, a row at a time: PAIRED splits the
    // two rows around a wait). MASKED: a row may have no key left in this tile (max -inf), nor before it: its shift
    // stays 0 rather than -inf (2^(-inf + inf) is NaN).
    template <bool MASKED>
    __device__ void softmax_max() {
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
            m_i[r] = m_new;
        }
    }
    template <bool MASKED>
    __device__ float shift(int r) const { return MASKED && m_i[r] == -INFINITY ? 0.f : m_i[r] * scale_log2; }
    // Row r's probabilities in place and its sum, with the shift m_scaled = shift(r).
    __device__ void softmax_exp(int r, float m_scaled) {
        float row_sum = 0.f;
        for (int nb = 0; nb < S_BLOCKS; ++nb) {  // one FFMA + one MUFU.EX2 per element
            frag_at(S_acc, nb, r, 0) = ex2_approx_ftz(fmaf(frag_at(S_acc, nb, r, 0), scale_log2, -m_scaled));
            frag_at(S_acc, nb, r, 1) = ex2_approx_ftz(fmaf(frag_at(S_acc, nb, r, 1), scale_log2, -m_scaled));
            row_sum += frag_at(S_acc, nb, r, 0) + frag_at(S_acc, nb, r, 1);
        }
        l_i[r] = alpha[r] * l_i[r] + row_sum;  // no shuffle: the quad's parts are added once, at the end
    }
    template <bool MASKED>
    __device__ void softmax() {
        softmax_max<MASKED>();
        softmax_exp(0, shift<MASKED>(0));
        softmax_exp(1, shift<MASKED>(1));
    }
    // The second half, once the previous P V is complete: rescale O (skipped when no row of the warp moved
    // its shift, a warp-uniform branch: after the first few tiles of a row the common case), and make P for the
    // next block (two neighbouring 8-key blocks of S, rounded to Elem), a row at a time.
    __device__ void rescale_o() {
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
            for (int db = 0; db < O_BLOCKS<D>; ++db) {
                for (int r = 0; r < 2; ++r) {
                    frag_at(O_acc, db, r, 0) *= alpha[r];
                    frag_at(O_acc, db, r, 1) *= alpha[r];
                }
            }
        }
    }
    __device__ void make_p(int r) {  // row r's P: registers r and 2 + r of each 16-key step (mma's A fragment)
        for (int kk = 0; kk < PV_STEPS; ++kk) {
            P_frag[kk][r] = cvt_rn_x2_f32<Elem>(frag_at(S_acc, 2 * kk, r, 0), frag_at(S_acc, 2 * kk, r, 1));  // keys +2t
            P_frag[kk][2 + r] =
                cvt_rn_x2_f32<Elem>(frag_at(S_acc, 2 * kk + 1, r, 0), frag_at(S_acc, 2 * kk + 1, r, 1));      // keys +8+2t
        }
    }
    __device__ void rescale_o_and_make_p() {
        rescale_o();
        make_p(0);
        make_p(1);
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

    // PAIRED, causal: a K/V tile of the walk that only the peer's Q tile sees, waited for and released, not computed.
    __device__ void pass_over(int count) const {
        const int stage = count % STAGES;
        wait_full(&smem.K_full[stage], count, 0);
        release_kv(&smem.K_empty[stage]);
        wait_full(&smem.V_full[stage], count, 0);
        release_kv(&smem.V_empty[stage]);
    }
    // A new work tile starts from scratch.
    __device__ void start_tile() {
        m_i[0] = m_i[1] = -INFINITY;
        l_i[0] = l_i[1] = 0.f;
        for (int i = 0; i < O_BLOCKS<D> * 4; ++i) O_acc[i] = 0.f;
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
    // PAIRED: the split order. V is waited for under S = Q K^T, off the turn's path; then row 0's exponentials run
    // under this warpgroup's P V and row 1's after its wait, beside the rescale of O and the conversion to P.
    template <bool MASKED>
    __device__ void gemm_block_steady(int count, int kv_tile, int kv_row = 0, int q_row = 0) {
        const int stage = count % STAGES, prev_stage = (count - 1) % STAGES;
        wait_full(&smem.K_full[stage], count, kv_tile);
        if (!PAIRED) wait_full(&smem.V_full[prev_stage], count - 1, kv_tile);
        turn.take(kv_tile);
        wgmma_fence();  // O (rescaled), P and S were last touched by ordinary instructions
        issue_qk(stage);
        wgmma_commit_group();
        if (PAIRED) {
            wait_full(&smem.V_full[prev_stage], count - 1, kv_tile);
            wgmma_fence();  // the wait's loop runs between two wgmma (ptxas would insert this fence itself, and say so)
        }
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
        if constexpr (PAIRED) {
            {
                TRACE_SPAN(TRACE_SOFTMAX_BEGIN, kv_tile);
                softmax_max<MASKED>();
                softmax_exp(0, shift<MASKED>(0));  // under the tensor cores' P V, kept there by a store of its sums
                smem.sums[threadIdx.x - WARPGROUP_THREADS] = l_i[0];  // (a store may not sink below the fence)
                keep_work_before_wait();
            }
            wgmma_wait_group<0>();
            TRACE_EVENT(TRACE_GEMM_WAITED_ALL, kv_tile);
            wgmma_fence_operands(O_acc);
            release_kv(&smem.V_empty[prev_stage]);
            TRACE_SPAN(TRACE_RESCALE_BEGIN, kv_tile);
            make_p(0);
            // Row 1's exponentials after the wait: their shift depends on O (x * 0 + shift, which ptxas cannot fold)
            softmax_exp(1, fmaf(O_acc[0], 0.f, shift<MASKED>(1)));
            make_p(1);
            rescale_o();
        } else {
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
    // one thread stores it with a bulk tensor copy per 64-column half, which run on while the warpgroup
    // starts its next work tile; TMA leaves out rows past seqlen_q. Before the tile is overwritten, the previous
    // tile's store must have read it. LSE goes straight to global memory.
    __device__ void epilogue(const WorkTile& w, const CUtensorMap& O_map, int t) {
        TRACE_SPAN(TRACE_EPILOGUE_BEGIN, t);
        const bool elected = threadIdx.x % WARPGROUP_THREADS == 0;  // the thread that issues the TMA stores
        Bits16* O_tile = smem.O[index];
        if (elected) cp_async_bulk_wait_group_read<0>();
        named_barrier_sync(barrier, WARPGROUP_THREADS);  // the whole warpgroup knows O_tile is free
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(l_i[r]);
            const float inv_l = l > 0.f ? rcp_approx_ftz(l) : 0.f;  // l = 0: a row that sees no key, O = 0 (LSE -inf)
            const int row = warp * 16 + quad_row + 8 * r;  // in this warpgroup's 64 rows
            for (int db = 0; db < O_BLOCKS<D>; ++db)
                *reinterpret_cast<uint32_t*>(O_tile + swizzle_tma_128b<ROWS_PER_WARPGROUP>(row, db * 8 + 2 * quad_col)) =
                    cvt_rn_x2_f32<Elem>(frag_at(O_acc, db, r, 0) * inv_l, frag_at(O_acc, db, r, 1) * inv_l);
            const int64_t q_row = int64_t(w.q_tile) * BLOCK_M + index * ROWS_PER_WARPGROUP + row;
            if (quad_col == 0 && q_row < p.seqlen_q)  // rows past seqlen_q (zeros from TMA) are computed, not stored
                p.lse[(int64_t(w.batch) * p.heads + w.head) * p.seqlen_q + q_row] = m_i[r] * p.scale + lg2_approx_ftz(l) * LN2;
        }
        fence_proxy_async_shared_cta();            // this thread's stores are visible to the TMA unit...
        named_barrier_sync(barrier, WARPGROUP_THREADS);  // ...and so are everyone else's
        if (elected) {
            const int row0 = w.q_tile * BLOCK_M + index * ROWS_PER_WARPGROUP;
            const int head = tma_coord(p.o_stride[1], w.head), batch = tma_coord(p.o_stride[0], w.batch);
            for (int half = 0; half < HALVES<D>; ++half)
                cp_async_bulk_tensor_4d_shared_to_global(&O_map, half * TMA_HALF_COLS, row0, head, batch,
                                                         O_tile + half * ROWS_PER_WARPGROUP * TMA_HALF_COLS);
            cp_async_bulk_commit_group();
        }
    }
    // The last stores are done before the CTA (and its shared memory) goes.
    __device__ void finish() const {
        if (threadIdx.x % WARPGROUP_THREADS == 0) cp_async_bulk_wait_group<0>();
    }
};

// A consumer's work: the pieces of this CTA (the producer walks the same list), each a sequence of GEMM blocks on this
// consumer's turns. The ring's count runs on across pieces, as the producer's does.
template <typename Elem, int D, bool PAIRED, bool SPLIT>
__device__ void consumer_mma(SharedStorage<D>& smem, const FwdParams& p, const Schedule& sched, const CUtensorMap& O_map, int index) {
    MmaWarpgroup<Elem, D, PAIRED> wg(smem, p, index);
    int count = 0, iteration = 0;  // iteration: the pieces that loaded a Q, as the producer counts them
    const Tail tail = tail_of<PAIRED>(sched);
    for (Piece c = first_piece<PAIRED, SPLIT>(tail, p); c.t < sched.tiles; c = next_piece<PAIRED, SPLIT>(c, tail, p)) {
        const int t = c.t;
        const WorkTile w = work_tile(t, p, sched);
        if (w.q_tile < 0) continue;  // the empty half of a head's last pair
        const KvRange kv = kv_range(w, p);
        const int q_row = w.q_tile * BLOCK_M + index * ROWS_PER_WARPGROUP, begin = c.begin, end = min(c.end, kv.tiles);
        const bool partial = begin > 0, owner = !partial && end < kv.tiles;  // a tail piece's part in its walk
        wg.start_tile();
        if (end > begin) {  // else no row sees a key: no Q, no turns, and the epilogue stores O = 0, LSE = -inf
            if constexpr (PAIRED)
                for (int skip = walk_tiles<PAIRED>(w, p) - kv.tiles; skip > 0; --skip) wg.pass_over(count++);
            {
                TRACE_SPAN(TRACE_FULL_WAIT_BEGIN, t);
                mbarrier_wait_parity(&smem.Q_full, iteration % 2);  // this tile's Q
            }
            ++iteration;
            if (index == 1) wg.turn.pass();  // consumer 0 takes the first turn of every piece
            wg.gemm_block_first(count, begin < kv.masked, kv_row(begin, kv.tiles), q_row);
            int kv_tile = begin + 1;
            for (; kv_tile < min(kv.masked, end); ++kv_tile)
                wg.template gemm_block_steady<true>(count + kv_tile - begin, kv_tile, kv_row(kv_tile, kv.tiles), q_row);
            for (; kv_tile < end; ++kv_tile) wg.template gemm_block_steady<false>(count + kv_tile - begin, kv_tile);
            wg.release(&smem.Q_empty);  // every S = Q K^T of this piece has completed: the producer may load the next Q
            wg.gemm_block_last(count + end - begin - 1, end);
            count += end - begin;
        }
        if (partial) {  // a partial piece of the tail: stored for the piece that owns its walk
            store_partial<D>(p.workspace, index, wg.barrier, wg.O_acc, wg.m_i, wg.l_i);
            continue;
        }
        if (owner)  // the tail piece that owns its walk: the rest comes from others
            merge_partials<D, PAIRED>(tail, t, p.workspace, index, wg.barrier, wg.scale_log2, wg.O_acc, wg.m_i, wg.l_i);
        wg.epilogue(w, O_map, t);
    }
    wg.finish();
}

// ==== The kernel ====
// Set up the barriers, then split by warpgroup into the two roles. The tensor maps are kernel parameters
// (__grid_constant__): the TMA unit reads them from parameter memory. One block per SM; the (threads, 1) launch bound
// caps registers at kernel entry (168), which setmaxnreg then redistributes.
// PAIRED runs in clusters of two CTAs (the launch's cluster dimension); SPLIT splits the tail; CAUSAL: the calls with
// a mask (p.causal = 1), the others dense (p.causal = 0), each kernel built for one of the two. Elem: bf16 or fp16;
// D: the head dim, 64 or 128.
template <typename Elem, int D, bool PAIRED, bool SPLIT, bool CAUSAL>
__global__ void __launch_bounds__(NUM_THREADS, 1)
    attention_fwd_kernel(const FwdParams params, const Schedule sched, const __grid_constant__ CUtensorMap Q_map,
                         const __grid_constant__ CUtensorMap K_map, const __grid_constant__ CUtensorMap V_map,
                         const __grid_constant__ CUtensorMap O_map) {
    static_assert(!(SPLIT && CAUSAL), "the split tail is for dense calls only");
    FwdParams p = params;
    p.causal = CAUSAL;  // what the launcher checked (flashladder_fwd), now a constant: the compiler folds every test of it
    constexpr int CTAS = cluster_ctas(PAIRED);
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    SharedStorage<D>& smem = *reinterpret_cast<SharedStorage<D>*>(smem_raw);

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
        if (threadIdx.x == 0) producer_load<D, PAIRED, SPLIT>(smem, p, sched, Q_map, K_map, V_map);  // the other 127 threads are done
        if (PAIRED && threadIdx.x == 0) cluster_sync();  // PAIRED: neither CTA leaves while the other may still
    } else {                                             // arrive on its barriers or copy into its shared memory
        setmaxnreg_inc<CONSUMER_REGS>();
        consumer_mma<Elem, D, PAIRED, SPLIT>(smem, p, sched, O_map, warpgroup - 1);
        if (PAIRED) cluster_sync();
    }
}

// The launcher's choice of kernel: which calls run in CTA pairs (of head dim 128).
bool takes_pairs(const FwdParams& p) {
    const int q_tiles = ceil_div(p.seqlen_q, BLOCK_M);
    return (!p.causal || (p.causal_offset >= 0 && q_tiles % 4 == 0)) && q_tiles % 2 == 0 && p.seqlen_k >= PAIR_MIN_SEQLEN_K;
}

}  // namespace

// ==== The host: exports and the launcher ====
FLASHLADDER_EXPORT int flashladder_seqlen_multiple_q() { return 1; }  // any seqlen: TMA fills and clips the last tiles
FLASHLADDER_EXPORT int flashladder_seqlen_multiple_k() { return 1; }
FLASHLADDER_EXPORT int flashladder_tile_q() { return BLOCK_M; }  // the work tiles (for tests and tools)
FLASHLADDER_EXPORT int flashladder_tile_k() { return BLOCK_N; }
// The keys from which dense (causal = 0) or causal (causal = 1) calls may run in CTA pairs (takes_pairs), 0: never.
FLASHLADDER_EXPORT int flashladder_pair_min_seqlen_k(int /*causal*/) { return PAIR_MIN_SEQLEN_K; }  // causal calls too
// The split tail's workspace for a GPU of `sms` SMs: the flags, then a slot per consumer warpgroup of each CTA.
FLASHLADDER_EXPORT int64_t flashladder_workspace_bytes(int sms) { return workspace_bytes(sms); }
FLASHLADDER_EXPORT int flashladder_features() {
    return FLASHLADDER_FEATURE_CAUSAL | FLASHLADDER_FEATURE_GQA | FLASHLADDER_FEATURE_FP16;
}
// The head dims of q, k and v (FwdParams' head_dim): 64 and 128 in the forward, 128 in the backward.
FLASHLADDER_EXPORT int flashladder_head_dims() { return flashladder_head_dim_bit(64) | flashladder_head_dim_bit(128); }
FLASHLADDER_EXPORT int flashladder_bwd_head_dims() { return flashladder_head_dim_bit(128); }

namespace {
// One kernel's launch: its tensor maps, and its persistent grid, one CTA per SM, or fewer when there are fewer rounds
// (work tiles, or causal pairs of them); PAIRED: an even count, in clusters of two.
template <typename Elem, int D, bool PAIRED>
cudaError_t launch(const FwdParams& p, int sms, cudaStream_t stream) {
    // 194 KB (D = 64: 98 KB) of dynamic shared memory is above the 48 KB a block gets without asking (asked once per
    // device and kernel).
    constexpr int SMEM = SMEM_BYTES<D>;
    cudaError_t err = raise_smem_limit_once<attention_fwd_kernel<Elem, D, PAIRED, false, false>>(SMEM);
    if (err == cudaSuccess) err = raise_smem_limit_once<attention_fwd_kernel<Elem, D, PAIRED, true, false>>(SMEM);
    if (err == cudaSuccess) err = raise_smem_limit_once<attention_fwd_kernel<Elem, D, PAIRED, false, true>>(SMEM);
    if (err != cudaSuccess) return err;
    // The tensor maps, encoded on the host for every call (host work only, no round trip to the GPU); they travel to
    // the GPU inside the launch's parameters.
    CUtensorMap Q_map, K_map, V_map, O_map;  // O: written in boxes of one consumer's 64 rows
    constexpr CUtensorMapDataType TYPE = tma_type<Elem>;
    if (encode_tile_map(&Q_map, p.q, p.q_stride, p.seqlen_q, p.heads, p.batch, BLOCK_M, TYPE, D) != CUDA_SUCCESS ||
        encode_tile_map(&K_map, p.k, p.k_stride, p.seqlen_k, p.heads_k, p.batch, BLOCK_N, TYPE, D) != CUDA_SUCCESS ||
        encode_tile_map(&V_map, p.v, p.v_stride, p.seqlen_k, p.heads_k, p.batch, BLOCK_N, TYPE, D) != CUDA_SUCCESS ||
        encode_tile_map(&O_map, p.o, p.o_stride, p.seqlen_q, p.heads, p.batch, ROWS_PER_WARPGROUP, TYPE, D) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;  // a layout the TMA unit cannot describe (the binding's checks should prevent it)
    constexpr int CTAS = cluster_ctas(PAIRED);
    Schedule sched = make_schedule(p);
    const int rounds = ceil_div(sched.tiles, tiles_per_round(p));  // a CTA's work tiles come one or two at a time
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3((rounds < sms ? rounds : sms) / CTAS * CTAS);
    const bool split = split_tail(sched, p, int(config.gridDim.x), PAIRED);
    config.blockDim = dim3(NUM_THREADS);
    config.dynamicSmemBytes = SMEM;
    config.stream = stream;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = CTAS, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = PAIRED ? 1 : 0;
    const auto kernel = p.causal ? attention_fwd_kernel<Elem, D, PAIRED, false, true>
                        : split  ? attention_fwd_kernel<Elem, D, PAIRED, true, false>
                                 : attention_fwd_kernel<Elem, D, PAIRED, false, false>;
    return cudaLaunchKernelEx(&config, kernel, p, sched, Q_map, K_map, V_map, O_map);
}
// The kernels of one type, by the call's head dim: at 128 in CTA pairs or alone; at 64 alone (a pair splits each K/V
// tile by its two 64-column halves, and a row of 64 has one).
template <typename Elem>
cudaError_t launch_head_dim(const FwdParams& p, int sms, cudaStream_t stream) {
    if (p.head_dim_v != p.head_dim) return cudaErrorInvalidValue;  // the binding passes v's equal to q's
    if (p.head_dim == 64) return launch<Elem, 64, false>(p, sms, stream);
    if (p.head_dim != 128) return cudaErrorInvalidValue;  // the binding passes the head dims of flashladder_head_dims
    return takes_pairs(p) ? launch<Elem, 128, true>(p, sms, stream) : launch<Elem, 128, false>(p, sms, stream);
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
    const FwdParams& p = *params;
    if (p.dtype == FLASHLADDER_FP16) return launch_head_dim<__half>(p, sms, stream);
    if (p.dtype != FLASHLADDER_BF16) return cudaErrorInvalidValue;  // the binding passes one of the two
    return launch_head_dim<__nv_bfloat16>(p, sms, stream);
}

// ==== The backward: recomputation, on the tensor cores, dQ added up in an fp32 accumulator ====
// Three kernels on the launching stream, one after another:
//   bwd_delta_kernel    D_i = sum_c dO_ic O_ic - dLSE_i, one warp per row; the row of the dQ accumulator zeroed, and
//                       (deterministic) the query tiles' turn counters
//   bwd_dkdv_kernel     one CTA per KEY_TILE keys of one K/V head: a producer warpgroup (the loads, the LSE and D, dQ's
//                       reductions) and two consumer warpgroups of 64 keys, which for each query head that reads the
//                       keys and each tile of BWD_TILE queries that sees one compute S^T, dP^T, P^T, dS^T, dV, dK
//                       and dQ^T = K^T dS^T on wgmma; each tile's dQ staged in shared memory and added to the
//                       accumulator by TMA. ORDERED (deterministic): the CTAs add a query tile's dQ in a fixed order
//                       of their keys (causal: from the last key tile down, FROM_LAST).
//   bwd_dq_convert_kernel  dQ = scale * accumulator, rounded to Elem (bf16 or fp16, as the forward's kernels)
namespace {

constexpr int BWD_TILE = 80;                        // queries per tile
constexpr int BWD_THREADS = 128;                    // the delta and convert kernels' CTA
// The dK/dV kernel's CTA: 128 keys, two warpgroups of 64 keys each (wgmma's M), against query tiles of BWD_TILE.
// Its tiles sit in shared memory in TMA's 128-byte-swizzle layout (common/swizzle.cuh: swizzle_tma_128b), the layout
// wgmma's descriptors read: a [rows, 128] tile of 16-bit elements as two [rows, 64] halves of 128-byte rows.
constexpr int KEY_TILE = 128;
constexpr int DKDV_WARPS = KEY_TILE / 16;
constexpr int DKDV_THREADS = DKDV_WARPS * 32;       // 256: two warpgroups
constexpr int Q_TILE_ELEMS = BWD_TILE * HEAD_DIM;   // a Q or dO tile: 20 KB, its halves 10 KB apart
constexpr int QT_HALF_BYTES = BWD_TILE * ROW_BYTES;
constexpr int KEY_TILE_ELEMS = KEY_TILE * HEAD_DIM; // K or V: 32 KB, its halves 16 KB apart
constexpr int KEY_HALF_BYTES = KEY_TILE * ROW_BYTES;
constexpr int ROWS16_BYTES = 2 * WGMMA_ATOM_BYTES;  // 16 rows further along an MN-major operand's k (KSTEP_BYTES,
                                                    // the forward's: 16 columns further along a K-major one)
// Two slots of Q, dO, LSE and D (tile j + 1 lands in one while tile j's products read the other), K, V, two buffers
// of dS ([80 queries, 128 keys] in TMA's layout, as Q: the K-major B operand of dQ^T = K^T dS^T; tile j's written
// while the other warpgroup's dQ(j - 1) may still read the other), a tile of dQ in fp32 (staged for the TMA unit to
// add to the accumulator: four [80 queries, 32 dims] boxes of 128-byte rows, swizzled), and five mbarriers: 225 KB
// of the 227 a CTA may have, one CTA per SM. (A third slot, step37's, would need 40 KB more.)
constexpr int BWD_SLOTS = 2;
constexpr int DS_TILE_ELEMS = BWD_TILE * KEY_TILE;
constexpr int DS_HALF_BYTES = BWD_TILE * ROW_BYTES;   // a dS buffer's halves: keys 0-63 and 64-127
constexpr int DQ_STAGE_FLOATS = BWD_TILE * HEAD_DIM;  // 40 KB
constexpr int DQ_BOX_FLOATS = BWD_TILE * 32;          // one box: 80 rows of 32 floats (128 bytes)
constexpr int DKDV_SMEM_BYTES = (2 * BWD_SLOTS * Q_TILE_ELEMS + 2 * KEY_TILE_ELEMS + 2 * DS_TILE_ELEMS) *
                                int(sizeof(Bits16)) + (DQ_STAGE_FLOATS + 2 * BWD_SLOTS * BWD_TILE) * int(sizeof(float)) +
                                (2 * BWD_SLOTS + 3) * int(sizeof(uint64_t));
constexpr int SCORE_BLOCKS = BWD_TILE / 8;          // a warp's 16 x 80 scores: 10 blocks of 8 columns, 4 registers each
constexpr int DIM_BLOCKS = HEAD_DIM / 8;            // a warp's 16 x 128 gradient rows: 16 blocks of 8 dims
constexpr int DIM_STEPS = HEAD_DIM / 16;            // k-steps of a product over the head dim
constexpr int TILE_STEPS = BWD_TILE / 16;           // k-steps of a product over a tile's 80 rows

// Slot s: Q at q + s * 2 * Q_TILE_ELEMS, dO Q_TILE_ELEMS after it; its LSE at stats + s * 2 * BWD_TILE, D after.
// dS buffer i at ds + i * DS_TILE_ELEMS. Every tile starts on a 1024-byte boundary (the swizzle's atom), as the XOR
// needs. full[s]: slot s's Q and dO have landed (two TMA tiles, two arrivals); kv_full: K and V have.
struct DkdvTiles {
    Bits16 *q, *k, *v, *ds;
    float *dq_stage, *stats;
    uint64_t *full, *empty, *kv_full, *stage_free, *dq_full;
    __device__ Bits16* q_of(int s) const { return q + s * 2 * Q_TILE_ELEMS; }
    __device__ Bits16* d_o_of(int s) const { return q + (s * 2 + 1) * Q_TILE_ELEMS; }
    __device__ float* lse_of(int s) const { return stats + s * 2 * BWD_TILE; }
    __device__ float* delta_of(int s) const { return stats + (s * 2 + 1) * BWD_TILE; }
};

__device__ DkdvTiles dkdv_tiles(char* smem) {
    DkdvTiles t;
    t.q = reinterpret_cast<Bits16*>(smem);
    t.k = t.q + 2 * BWD_SLOTS * Q_TILE_ELEMS;
    t.v = t.k + KEY_TILE_ELEMS;
    t.ds = t.v + KEY_TILE_ELEMS;
    t.dq_stage = reinterpret_cast<float*>(t.ds + 2 * DS_TILE_ELEMS);
    t.stats = t.dq_stage + DQ_STAGE_FLOATS;
    t.full = reinterpret_cast<uint64_t*>(t.stats + 2 * BWD_SLOTS * BWD_TILE);
    t.empty = t.full + BWD_SLOTS;
    t.kv_full = t.empty + BWD_SLOTS;
    t.stage_free = t.kv_full + 1;
    t.dq_full = t.stage_free + 1;
    return t;
}

// A query row's (LSE * log2(e), D) for the dK/dV kernel: P = 2^(S * scale * log2(e) - LSE * log2(e)), one FFMA and one
// ex2. (+inf, 0) past the end or for a row that sees no key: P = 0 in every column.
__device__ float2 row_stats(const BwdParams& p, int b, int h, int q) {
    if (q >= p.seqlen_q) return make_float2(INFINITY, 0.f);
    const int64_t row = (int64_t(b) * p.heads + h) * p.seqlen_q + q;
    const float lse = p.lse[row];
    return lse != -INFINITY ? make_float2(lse * LOG2E, p.delta[row]) : make_float2(INFINITY, 0.f);
}

// Rows (of the warp's 16, g and g + 8) of a [rows, HEAD_DIM] gradient from out[db]: two Elem a store, times `scale`.
template <typename Elem>
__device__ void store_rows(void* base, const int64_t stride[3], int b, int h, int row0, int rows,
                           const float (&out)[DIM_BLOCKS][4], float scale) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = row0 + g + 8 * half;
        if (row >= rows) continue;
        auto* dst = row_ptr(static_cast<Bits16*>(base), stride, b, h, row);
#pragma unroll
        for (int db = 0; db < DIM_BLOCKS; ++db)
            *reinterpret_cast<uint32_t*>(dst + db * 8 + 2 * t) =
                cvt_rn_x2_f32<Elem>(out[db][2 * half] * scale, out[db][2 * half + 1] * scale);
    }
}

// deterministic=True: the turn counter of query tile qt of (b, h), an int after the accumulator's floats (the binding
// makes room for them: flashladder_bwd_dq_turns). It counts the CTAs that have added their share of the tile's dQ.
// The CTAs that add to a query tile are always key tiles 0, 1, .., last (causal: those whose keys some query of the
// tile sees), and they take turns in a fixed order, so the sums come in one order every call:
//   dense: from key tile 0 up (step37's): key tile n waits for the counter to read n, adds, sets it to n + 1;
//   causal: from the last down: key tile n waits for last - n. Each CTA starts its walk at its diagonal, where it is
//   the last key tile that sees the query tile: its turn comes at once, and at each later tile the CTAs of the keys
//   after it, which started there, have gone by. (From key tile 0 up, CTA n waited at its diagonal for n others.) Key
//   tiles that query 0 already sees whole (bottom-right, more keys than queries) all start at tile 0 and take turns.
// A CTA may only wait for CTAs that started before it (else, with more CTAs than fit at once, every resident one could
// wait for one that cannot start), and CTAs start in the order of blockIdx.x (what the hardware does, not a promise of
// CUDA's; step37's order leaned on it too): so the causal order runs the grid's x backwards, key tile
// gridDim.x - 1 - blockIdx.x. FROM_LAST, a template parameter (the kernel's third build): decided
// at run time, the key tile costs the consumers registers they do not have (ptxas spills, and serializes the wgmmas).
template <bool FROM_LAST>
__device__ int key_tile_of() {
    return FROM_LAST ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
}
template <bool FROM_LAST>
__device__ int turns_before(const BwdParams& p, int key_tile, int q0) {
    if (!FROM_LAST) return key_tile;
    // The last key tile some query of the tile sees: the last whose walk, from its diagonal, reaches the tile.
    const int last = min(int(gridDim.x) - 1, (q0 + BWD_TILE - 1 + p.causal_offset) / KEY_TILE);
    return last - key_tile;
}
__device__ int* turn_of(const BwdParams& p, int b, int h, int qt) {
    const int64_t accum_floats = int64_t(p.batch) * p.heads * p.seqlen_q * HEAD_DIM;
    const int q_tiles = (p.seqlen_q + BWD_TILE - 1) / BWD_TILE;
    return reinterpret_cast<int*>(p.dq_accum + accum_floats) + (int64_t(b) * p.heads + h) * q_tiles + qt;
}

template <typename Elem>
__global__ void __launch_bounds__(BWD_THREADS) bwd_delta_kernel(const BwdParams p) {
    const int64_t row = (int64_t(blockIdx.x) * BWD_THREADS + threadIdx.x) / 32;  // [batch, heads, seqlen_q], flat
    const int lane = threadIdx.x % 32;
    if (row >= int64_t(p.batch) * p.heads * p.seqlen_q) return;
    const int i = int(row % p.seqlen_q), h = int(row / p.seqlen_q % p.heads), b = int(row / p.seqlen_q / p.heads);
    const auto* o = row_ptr(static_cast<const Elem*>(p.o), p.o_stride, b, h, i);
    const auto* d_o = row_ptr(static_cast<const Elem*>(p.d_o), p.do_stride, b, h, i);
    float sum = 0.f;
    for (int c = lane; c < HEAD_DIM; c += 32) sum += to_f32(o[c]) * to_f32(d_o[c]);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) p.delta[row] = sum - (p.d_lse ? p.d_lse[row] : 0.f);
    reinterpret_cast<float4*>(p.dq_accum + row * HEAD_DIM)[lane] = make_float4(0.f, 0.f, 0.f, 0.f);  // the accumulator's row
    if (p.deterministic && i % BWD_TILE == 0 && lane == 0) *turn_of(p, b, h, i / BWD_TILE) = 0;  // a query tile's first
}

// ---- the dK/dV kernel's products on wgmma: each by one warpgroup, its operands in shared memory by descriptor ----
// acc = X Y^T: X the warpgroup's 64 rows of K (or V), Y a query tile's Q (or dO), both by their descriptors (K-major,
// built once): S^T = K Q^T and dP^T = V dO^T, keys x queries, 8 k-steps over the head dim, each operand 32 bytes
// further inside an atom or in the other half: the descriptor advanced, one add (step17's idea). The accumulator's
// layout is mma.m16n8k16's per warp (common/wgmma.cuh), as step27's warps held S^T: the code that turns it into P^T
// and dS^T is unchanged.
template <typename Elem>
__device__ void issue_rows_times_rows(float (&acc)[SCORE_BLOCKS][4], uint64_t x_desc, uint64_t y_desc) {
    auto& d = reinterpret_cast<float (&)[SCORE_BLOCKS * 4]>(acc);
#pragma unroll
    for (int kk = 0; kk < DIM_STEPS; ++kk) {
        const uint32_t half = kk / KSTEPS_PER_HALF, kstep = kk % KSTEPS_PER_HALF * KSTEP_BYTES;
        wgmma_m64n80k16_ss<0, 0, Elem>(d, wgmma_desc_advance(x_desc, half * KEY_HALF_BYTES + kstep),
                                       wgmma_desc_advance(y_desc, half * QT_HALF_BYTES + kstep), kk > 0);
    }
}

// out += A . Y: A [64 keys, 80 queries] from registers (P^T or dS^T in Elem, a[kk] the A fragment of queries
// 16 kk..16 kk + 15), Y a query tile (dO or Q) read along its rows by its N-major descriptor, advanced 16 rows = 2
// atoms a k-step: dV += P^T dO and dK += dS^T Q, 5 k-steps.
template <typename Elem>
__device__ void issue_frags_times_rows(float (&out)[DIM_BLOCKS][4], const uint32_t (&a)[TILE_STEPS][4], uint64_t y_desc) {
    auto& d = reinterpret_cast<float (&)[DIM_BLOCKS * 4]>(out);
#pragma unroll
    for (int kk = 0; kk < TILE_STEPS; ++kk)
        wgmma_m64n128k16_rs<Elem>(d, a[kk], wgmma_desc_advance(y_desc, kk * ROWS16_BYTES), 1);
}

// The A fragments of a [64 keys, 80 queries] accumulator in Elem: two neighbouring 8-column blocks are one k-step's.
template <typename Elem>
__device__ void to_frags(uint32_t (&a)[TILE_STEPS][4], const float (&s)[SCORE_BLOCKS][4]) {
#pragma unroll
    for (int kk = 0; kk < TILE_STEPS; ++kk) {
        a[kk][0] = cvt_rn_x2_f32<Elem>(s[2 * kk][0], s[2 * kk][1]);          // row g,   columns 16kk + 2t
        a[kk][1] = cvt_rn_x2_f32<Elem>(s[2 * kk][2], s[2 * kk][3]);          // row g+8, columns 16kk + 2t
        a[kk][2] = cvt_rn_x2_f32<Elem>(s[2 * kk + 1][0], s[2 * kk + 1][1]);  // row g,   columns 16kk + 8 + 2t
        a[kk][3] = cvt_rn_x2_f32<Elem>(s[2 * kk + 1][2], s[2 * kk + 1][3]);  // row g+8, columns 16kk + 8 + 2t
    }
}

template <int N>
__device__ void fence_frags(uint32_t (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) wgmma_fence_operands(a[i]);
}
template <int N>
__device__ void fence_acc(float (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) wgmma_fence_operands(a[i]);
}

template <typename Elem, bool ORDERED, bool FROM_LAST = false>
__global__ void __launch_bounds__(DKDV_THREADS + WARPGROUP_THREADS, 1)
    bwd_dkdv_kernel(const BwdParams p, const __grid_constant__ CUtensorMap Q_map, const __grid_constant__ CUtensorMap dO_map,
                    const __grid_constant__ CUtensorMap K_map, const __grid_constant__ CUtensorMap V_map,
                    const __grid_constant__ CUtensorMap dQ_map) {
    extern __shared__ __align__(1024) char dkdv_smem[];  // 1024-byte aligned: the swizzle's atoms
    const DkdvTiles t = dkdv_tiles(dkdv_smem);
    const int key_tile = key_tile_of<FROM_LAST>(), k0 = key_tile * KEY_TILE, hk = blockIdx.y, b = blockIdx.z;
    // Warpgroup 0: the producer (its warp 0 loads Q and dO, warp 1 the LSE and D, warp 2 adds dQ to the
    // accumulator; warp 3 has nothing to do). Warpgroups 1 and 2: the consumers, whose warp w is step35's warp w. The
    // role read from lane 0 by a shuffle: the same in every thread of a warp by construction, so the descriptors
    // built from it live in uniform registers (as the forward's, step10).
    const int role = __shfl_sync(0xffffffffu, threadIdx.x / WARPGROUP_THREADS, 0);
    const int warp = (int(threadIdx.x) - WARPGROUP_THREADS) / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int wg = role - 1;                             // this consumer's 64 keys: k0 + 64 wg ..
    const int key0 = k0 + warp * 16;                     // this warp's 16 of them: rows of S^T
    float dk[DIM_BLOCKS][4] = {}, dv[DIM_BLOCKS][4] = {};
    const int q_first = p.causal ? max(0, k0 - p.causal_offset) / BWD_TILE * BWD_TILE : 0;
    const int group = p.heads / p.heads_k;
    // The walk: tile j is query tile q_first / BWD_TILE + j % q_tiles of query head hk * group + j / q_tiles.
    // (Not ceil_div: a call of it here changes how the forward's kernels compile, by 8 instructions; test_sass.py.)
    const int q_tiles = max(0, (p.seqlen_q - q_first + BWD_TILE - 1) / BWD_TILE), walk = group * q_tiles;
    auto head_of = [&](int j) { return hk * group + j / q_tiles; };
    auto q0_of = [&](int j) { return q_first + j % q_tiles * BWD_TILE; };
    // The copies, by one thread: TMA (step08's idea, here in the backward) writes a tile in the swizzle wgmma reads,
    // rows past the end as zeros, and signals the slot's mbarrier when its bytes have landed.
    auto issue = [&](int j, int slot) {                  // tile j's Q and dO into `slot`, by the producer's loader
        const int h = head_of(j), q0 = q0_of(j);
        load_tile_tma<BWD_TILE>(t.q_of(slot), &Q_map, q0, tma_coord(p.q_stride[1], h), tma_coord(p.q_stride[0], b), &t.full[slot]);
        load_tile_tma<BWD_TILE>(t.d_o_of(slot), &dO_map, q0, tma_coord(p.do_stride[1], h), tma_coord(p.do_stride[0], b),
                                &t.full[slot]);
    };
    // The mbarriers. full[s]: slot s's Q and dO have landed (two TMA tiles) and its LSE and D are stored (warp 1's 32
    // lanes); empty[s]: the consumers are done with it (every consumer thread); dq_full: dQ(j) is staged
    // (every consumer thread); stage_free: the TMA unit has read the staged dQ (the reducer).
    if (threadIdx.x == 0) {
        for (int i = 0; i < BWD_SLOTS; ++i) mbarrier_init(&t.full[i], 2 + 32), mbarrier_init(&t.empty[i], DKDV_THREADS);
        mbarrier_init(t.kv_full, 2), mbarrier_init(t.stage_free, 1), mbarrier_init(t.dq_full, DKDV_THREADS);
        fence_mbarrier_init();                           // the inits are visible to the TMA unit
    }
    __syncthreads();                                     // the barriers initialized: the last block-wide barrier
    if (role == 0) {                                     // the producer
        setmaxnreg_dec<PRODUCER_REGS>();
        const int pwarp = threadIdx.x / 32;
        if (pwarp == 0 && lane == 0) {                   // the loads, up to BWD_SLOTS tiles ahead
            load_tile_tma<KEY_TILE>(t.k, &K_map, k0, tma_coord(p.k_stride[1], hk), tma_coord(p.k_stride[0], b), t.kv_full);
            load_tile_tma<KEY_TILE>(t.v, &V_map, k0, tma_coord(p.v_stride[1], hk), tma_coord(p.v_stride[0], b), t.kv_full);
            for (int j = 0; j < walk; ++j) {
                if (j >= BWD_SLOTS) mbarrier_wait_parity(&t.empty[j % BWD_SLOTS], (j / BWD_SLOTS - 1) % 2);
                issue(j, j % BWD_SLOTS);
            }
        } else if (pwarp == 1) {                         // the LSE and D, up to three rows a lane
            for (int j = 0; j < walk; ++j) {
                const int slot = j % BWD_SLOTS;
                if (j >= BWD_SLOTS) mbarrier_wait_parity(&t.empty[slot], (j / BWD_SLOTS - 1) % 2);
#pragma unroll
                for (int r = lane; r < BWD_TILE; r += 32) {
                    const float2 st = row_stats(p, b, head_of(j), q0_of(j) + r);
                    t.lse_of(slot)[r] = st.x, t.delta_of(slot)[r] = st.y;
                }
                mbarrier_arrive(&t.full[slot]);
            }
        } else if (pwarp == 2 && lane == 0) {            // the reducer
            for (int j = 0; j < walk; ++j) {
                mbarrier_wait_parity(t.dq_full, j % 2);
                const int h = head_of(j), q0 = q0_of(j);
                int* const turn = ORDERED ? turn_of(p, b, h, q0 / BWD_TILE) : nullptr;
                const int ahead = ORDERED ? turns_before<FROM_LAST>(p, key_tile, q0) : 0;  // the key tiles adding first
                if constexpr (ORDERED) {                 // this key tile's turn at the query tile
                    while (load_acquire_gpu(turn) != ahead) __nanosleep(64);
                    fence_proxy_async_global();          // their sums, seen by the TMA unit's reduction that follows
                }
#pragma unroll
                for (int box = 0; box < HEAD_DIM / 32; ++box)
                    cp_reduce_async_bulk_tensor_4d_add(&dQ_map, box * 32, q0, h, b, t.dq_stage + box * DQ_BOX_FLOATS);
                cp_async_bulk_commit_group();
                if constexpr (ORDERED) {                 // the sums done in memory, then the next key tile's turn
                    cp_async_bulk_wait_group<0>();
                    fence_proxy_async_global();
                    store_release_gpu(turn, ahead + 1);
                } else {
                    cp_async_bulk_wait_group_read<0>();
                }
                mbarrier_arrive(t.stage_free);
            }
            cp_async_bulk_wait_group<0>();               // done before the CTA's memory goes
        }
        return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();                    // 240: step35 needs no more than 224 (ptxas, __maxnreg__)
    // The products' descriptors, built once: K's and V's rows of this warpgroup (K-major, for S^T and dP^T), K's half
    // of this warpgroup's dims (M-major, for dQ^T) and dS's first buffer (K-major, for dQ^T), and slot 0's Q and dO
    // both ways; slot s's are s * 2 * Q_TILE_ELEMS further, an advance.
    const uint64_t k_desc = wgmma_desc_kmajor(smem_u32(t.k) + wg * 64 * ROW_BYTES);
    const uint64_t v_desc = wgmma_desc_kmajor(smem_u32(t.v) + wg * 64 * ROW_BYTES);
    const uint64_t k_half_desc = wgmma_desc_nmajor(smem_u32(t.k) + wg * KEY_HALF_BYTES, KEY_HALF_BYTES);
    const uint64_t ds_desc = wgmma_desc_kmajor(smem_u32(t.ds));
    const uint64_t q_desc = wgmma_desc_kmajor(smem_u32(t.q_of(0))), d_o_desc = wgmma_desc_kmajor(smem_u32(t.d_o_of(0)));
    const uint64_t q_rows_desc = wgmma_desc_nmajor(smem_u32(t.q_of(0)), QT_HALF_BYTES);
    const uint64_t d_o_rows_desc = wgmma_desc_nmajor(smem_u32(t.d_o_of(0)), QT_HALF_BYTES);
    constexpr uint32_t SLOT_BYTES = 2 * Q_TILE_ELEMS * sizeof(Bits16);
    const float scale_log2 = p.scale * LOG2E;
    // The order of tile j (FlashAttention-3's): dQ(j)^T = K^T dS^T is issued behind dV, after the barrier that makes
    // dS(j) whole, and runs beside dK; it is staged while dK runs, and its accumulator is free again before the
    // next tile's S^T and dP^T.
    //   S^T, dP^T  ->  P^T  ->  dS^T  ->  dV  ->  dS stored, barrier  ->  dQ^T, dK  ->  dQ staged
    // wgmma's groups complete in order, and each tile commits the same five,
    // so each wait_group<N> below names one of them. No group is left running from one tile into the next: ptxas
    // cannot follow one across the loop's back edge, and serializes every wgmma if asked to.
    float s[SCORE_BLOCKS][4], dp[SCORE_BLOCKS][4], dqt[SCORE_BLOCKS][4];
    auto& dqt_flat = reinterpret_cast<float (&)[SCORE_BLOCKS * 4]>(dqt);
    auto issue_dq = [&](int j) {                         // dQ(j)^T = K^T dS^T, dS from the buffer tile j wrote
        // 80 queries are no multiple of wgmma's M = 64, so dQ is computed transposed, dims x queries: each warpgroup
        // one half of the head dim (K's half read M-major: M = 64 dims) against the tile's 80 queries (N = 80), 8
        // k-steps of 16 keys; dS read K-major, as Q is in S^T = K Q^T (keys 0-63 in its first half, 64-127 next).
        const uint64_t ds_buffer = wgmma_desc_advance(ds_desc, j % 2 * DS_TILE_ELEMS * sizeof(Bits16));
        wgmma_fence();                                   // dQ's registers last read by the stores (ptxas asks here)
#pragma unroll
        for (int kk = 0; kk < KEY_TILE / 16; ++kk) {
            const uint32_t half = kk / KSTEPS_PER_HALF, kstep = kk % KSTEPS_PER_HALF * KSTEP_BYTES;
            wgmma_m64n80k16_ss<1, 0, Elem>(dqt_flat, wgmma_desc_advance(k_half_desc, kk * ROWS16_BYTES),
                                           wgmma_desc_advance(ds_buffer, half * DS_HALF_BYTES + kstep), kk > 0);
        }
    };
    // dQ(j) in shared memory, for the producer's reducer to add to the accumulator by TMA once every consumer thread
    // has said so on dq_full. The staging tile is read by the previous tile's reduction until the reducer has seen it
    // read (cp.async.bulk.wait_group.read) and said so on stage_free, which every thread waits for (its `uses`-th
    // phase) before writing. The accumulator is [queries, dims] and the thread holds dQ^T: element (dim
    // 64 wg + 16 (warp % 4) + g + 8 (r / 2), query 8 nb + 2 tq + r % 2), so each float goes alone, into the four
    // [80, 32] boxes of the 128-byte swizzle (16-byte chunk c of row r at c ^ r % 8). A store's 32 lanes write 8 dims
    // (two chunks) of 4 queries 2 apart, whose rows' XORs move the two chunks to 8 different ones: 32 banks, one
    // wavefront (step34's stores of two floats needed the same 32 wavefronts for 64 queries as these 40 for 80).
    auto stage_dq = [&](int uses) {
        if (uses > 0) mbarrier_wait_parity(t.stage_free, (uses - 1) % 2);
        fence_acc(dqt);
        const int dim0 = wg * 64 + warp % 4 * 16 + g;    // its dims: dim0 and dim0 + 8
#pragma unroll
        for (int nb = 0; nb < SCORE_BLOCKS; ++nb)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int dim = dim0 + 8 * (r / 2), query = nb * 8 + 2 * tq + r % 2;
                const int chunk = (dim % 32 / 4) ^ (query % 8);
                t.dq_stage[dim / 32 * DQ_BOX_FLOATS + query * 32 + chunk * 4 + dim % 4] = dqt[nb][r];
            }
    };
    for (int j = 0; j < walk; ++j) {
        const int slot = j % BWD_SLOTS, q0 = q0_of(j);
        // Tile j's slot was refilled by the producer once every consumer thread had said on `empty` that it was done
        // with tile j - 2 there (two slots: tile j + 1 lands in the other while tile j's products run).
        if (j == 0) mbarrier_wait_parity(t.kv_full, 0);  // K and V have landed
        mbarrier_wait_parity(&t.full[slot], j / BWD_SLOTS % 2);  // tile j has: the slot's (j / 2)-th fill
        const uint32_t slot_bytes = slot * SLOT_BYTES;
        const float *lse = t.lse_of(slot), *delta = t.delta_of(slot);
        wgmma_fence();
        issue_rows_times_rows<Elem>(s, k_desc, wgmma_desc_advance(q_desc, slot_bytes));       // S^T = K Q^T: keys x queries
        wgmma_commit_group();
        issue_rows_times_rows<Elem>(dp, v_desc, wgmma_desc_advance(d_o_desc, slot_bytes));    // dP^T = V dO^T
        wgmma_commit_group();
        wgmma_wait_group<1>();                           // S^T is in; dP^T may still be running
        fence_acc(s);
        // P^T, element (key g + 8 (r / 2), query 8 nb + 2 tq + r % 2): one FFMA and one ex2 (its query's LSE, in
        // log2 units, read two at a time). Only a warp whose 16 keys cross the end of the keys or the causal diagonal
        // tests each element (a branch the whole warp takes one way).
        const bool edge = key0 + 16 > p.seqlen_k || (p.causal && key0 + 15 > q0 + p.causal_offset);
#pragma unroll
        for (int nb = 0; nb < SCORE_BLOCKS; ++nb) {
            const float2 l = *reinterpret_cast<const float2*>(lse + nb * 8 + 2 * tq);
#pragma unroll
            for (int r = 0; r < 4; ++r) s[nb][r] = ex2_approx_ftz(fmaf(s[nb][r], scale_log2, -(r % 2 ? l.y : l.x)));
        }
        if (edge) {
#pragma unroll
            for (int nb = 0; nb < SCORE_BLOCKS; ++nb)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int key = key0 + g + 8 * (r / 2), query = q0 + nb * 8 + 2 * tq + r % 2;
                    if (key >= p.seqlen_k || (p.causal && key > query + p.causal_offset)) s[nb][r] = 0.f;
                }
        }
        wgmma_wait_group<0>();                           // dP^T is in (P^T stays fp32 till dS^T is made: registers)
        fence_acc(dp);
#pragma unroll
        for (int nb = 0; nb < SCORE_BLOCKS; ++nb) {
            const float2 d = *reinterpret_cast<const float2*>(delta + nb * 8 + 2 * tq);
#pragma unroll
            for (int r = 0; r < 4; ++r) dp[nb][r] = s[nb][r] * (dp[nb][r] - (r % 2 ? d.y : d.x));  // dS^T
        }
        uint32_t p_frags[TILE_STEPS][4], ds_frags[TILE_STEPS][4];
        to_frags<Elem>(p_frags, s);
        to_frags<Elem>(ds_frags, dp);
        wgmma_fence();
        issue_frags_times_rows<Elem>(dv, p_frags, wgmma_desc_advance(d_o_rows_desc, slot_bytes));  // dV += P^T dO
        wgmma_commit_group();
        {
            // dS into buffer j % 2 ([80 queries, 128 keys], TMA's layout): the B operand of dQ(j)^T = K^T dS^T, read
            // K-major. The warp holds dS^T's fragments (its 16 keys x 80 queries); stmatrix .trans writes each 8 x 8
            // block transposed: a query's 8 keys as one 16-byte chunk, whose address lane 8 i + c gives for
            // ds_frags[kk][i] (keys 8 (i % 2) .., queries 16 kk + 8 (i / 2) ..), query c of them. The 8 queries'
            // chunks are swizzled apart: 32 banks. Tile j - 2's dQ read the buffer last: every warp waited for that
            // before the barrier of tile j - 1.
            const uint32_t ds = smem_u32(t.ds + j % 2 * DS_TILE_ELEMS);
            const int i = lane / 8, c = lane % 8;
#pragma unroll
            for (int kk = 0; kk < TILE_STEPS; ++kk) {
                const int query = 16 * kk + 8 * (i / 2) + c, key = warp * 16 + 8 * (i % 2);
                stmatrix_x4_trans(ds + swizzle_tma_128b<BWD_TILE>(query, key) * sizeof(Bits16), ds_frags[kk]);
            }
            fence_proxy_async_shared_cta();              // dS, for wgmma
        }
        named_barrier_sync(1, DKDV_THREADS);              // dS(j) whole: the consumers only
        issue_dq(j);                                     // dQ(j)^T = K^T dS^T, behind dV
        wgmma_commit_group();
        issue_frags_times_rows<Elem>(dk, ds_frags, wgmma_desc_advance(q_rows_desc, slot_bytes));   // dK += dS^T Q, behind dQ
        wgmma_commit_group();
        wgmma_wait_group<1>();                           // dV and dQ(j) are in; dK runs on
        {
            stage_dq(j);
            fence_proxy_async_shared_cta();              // the staged dQ, for the TMA unit
            mbarrier_arrive(t.dq_full);
        }
        wgmma_wait_group<0>();                           // dK is in
        fence_frags(p_frags);                            // the A fragments stay live until their wgmma is done
        fence_frags(ds_frags);
        mbarrier_arrive(&t.empty[slot]);                 // this thread is done with the slot (its LSE, D, Q, dO)
    }
    fence_acc(dk);
    fence_acc(dv);
    store_rows<Elem>(p.dk, p.dk_stride, b, hk, key0, p.seqlen_k, dk, p.scale);
    store_rows<Elem>(p.dv, p.dv_stride, b, hk, key0, p.seqlen_k, dv, 1.f);
}

// dQ = scale * accumulator, in Elem: 4 elements a thread.
template <typename Elem>
__global__ void __launch_bounds__(BWD_THREADS) bwd_dq_convert_kernel(const BwdParams p) {
    constexpr int QUADS = HEAD_DIM / 4;
    const int64_t e = int64_t(blockIdx.x) * BWD_THREADS + threadIdx.x, row = e / QUADS;
    if (row >= int64_t(p.batch) * p.heads * p.seqlen_q) return;
    const int i = int(row % p.seqlen_q), h = int(row / p.seqlen_q % p.heads), b = int(row / p.seqlen_q / p.heads);
    const float4 x = reinterpret_cast<const float4*>(p.dq_accum + row * HEAD_DIM)[e % QUADS];
    auto* dst = row_ptr(static_cast<Bits16*>(p.dq), p.dq_stride, b, h, i) + e % QUADS * 4;
    *reinterpret_cast<uint2*>(dst) = make_uint2(cvt_rn_x2_f32<Elem>(x.x * p.scale, x.y * p.scale),
                                                cvt_rn_x2_f32<Elem>(x.z * p.scale, x.w * p.scale));
}

}  // namespace

// The binding compares this with ctypes.sizeof of its mirror of BwdParams when it loads the library.
FLASHLADDER_EXPORT int flashladder_bwd_params_size() { return static_cast<int>(sizeof(BwdParams)); }

// dQ, dK, dV of one call on `stream` (params->delta: the caller's fp32 scratch of one float per query row).
// The binding launches nothing for empty calls (no query or no key).
// Its presence tells the binding to pass dq_accum: fp32 scratch of q's shape (the delta kernel zeroes it).
FLASHLADDER_EXPORT int flashladder_bwd_accumulates_dq() { return 1; }
// Its presence tells the binding to pass dq_accum for deterministic calls too, with room after it for this many ints:
// the query tiles' turn counters (turn_of).
FLASHLADDER_EXPORT int64_t flashladder_bwd_dq_turns(int batch, int heads, int seqlen_q) {
    return int64_t(batch) * heads * ((seqlen_q + BWD_TILE - 1) / BWD_TILE);
}

namespace {
// One call's three kernels, built for its type.
template <typename Elem>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
    cudaError_t err = raise_smem_limit_once<bwd_dkdv_kernel<Elem, false>>(DKDV_SMEM_BYTES);
    if (err == cudaSuccess) err = raise_smem_limit_once<bwd_dkdv_kernel<Elem, true>>(DKDV_SMEM_BYTES);
    if (err == cudaSuccess) err = raise_smem_limit_once<bwd_dkdv_kernel<Elem, true, true>>(DKDV_SMEM_BYTES);
    if (err != cudaSuccess) return err;
    const int64_t rows = int64_t(p.batch) * p.heads * p.seqlen_q;
    const int64_t rows_per_block = BWD_THREADS / 32;
    bwd_delta_kernel<Elem><<<unsigned((rows + rows_per_block - 1) / rows_per_block), BWD_THREADS, 0, stream>>>(p);
    const dim3 key_tiles(ceil_div(p.seqlen_k, KEY_TILE), p.heads_k, p.batch);
    // The dK/dV kernel's tensor maps, as the forward's (dO's strides the binding keeps TMA-friendly, as q's), and dQ's
    // fp32 accumulator's, added to by TMA (the binding makes it contiguous, q's shape).
    CUtensorMap Q_map, dO_map, K_map, V_map, dQ_map;
    constexpr CUtensorMapDataType TYPE = tma_type<Elem>;
    if (encode_tile_map(&Q_map, p.q, p.q_stride, p.seqlen_q, p.heads, p.batch, BWD_TILE, TYPE) != CUDA_SUCCESS ||
        encode_tile_map(&dO_map, p.d_o, p.do_stride, p.seqlen_q, p.heads, p.batch, BWD_TILE, TYPE) != CUDA_SUCCESS ||
        encode_tile_map(&K_map, p.k, p.k_stride, p.seqlen_k, p.heads_k, p.batch, KEY_TILE, TYPE) != CUDA_SUCCESS ||
        encode_tile_map(&V_map, p.v, p.v_stride, p.seqlen_k, p.heads_k, p.batch, KEY_TILE, TYPE) != CUDA_SUCCESS ||
        encode_accum_map(&dQ_map, p.dq_accum, p.seqlen_q, p.heads, p.batch, BWD_TILE) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;
    const auto kernel = p.deterministic && p.causal ? bwd_dkdv_kernel<Elem, true, true>  // the turns from the last key
                        : p.deterministic           ? bwd_dkdv_kernel<Elem, true>        // tile down (turns_before)
                                                    : bwd_dkdv_kernel<Elem, false>;
    kernel<<<key_tiles, DKDV_THREADS + WARPGROUP_THREADS, DKDV_SMEM_BYTES, stream>>>(p, Q_map, dO_map, K_map, V_map, dQ_map);
    const int64_t quads = rows * (HEAD_DIM / 4);
    bwd_dq_convert_kernel<Elem><<<unsigned((quads + BWD_THREADS - 1) / BWD_THREADS), BWD_THREADS, 0, stream>>>(p);
    return cudaGetLastError();
}
}  // namespace

FLASHLADDER_EXPORT int flashladder_bwd(const BwdParams* params, cudaStream_t stream) {
    const BwdParams& p = *params;
    if (!p.dq_accum) return cudaErrorInvalidValue;       // the binding passes it (flashladder_bwd_accumulates_dq)
    if (p.head_dim != HEAD_DIM || p.head_dim_v != HEAD_DIM) return cudaErrorInvalidValue;  // flashladder_bwd_head_dims
    if (p.dtype == FLASHLADDER_FP16) return launch_bwd<__half>(p, stream);
    if (p.dtype != FLASHLADDER_BF16) return cudaErrorInvalidValue;  // the binding passes one of the two
    return launch_bwd<__nv_bfloat16>(p, stream);
}
