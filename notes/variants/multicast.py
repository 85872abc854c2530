"""step14 with K/V shared by the two CTAs of a cluster through TMA multicast: correct, and slower (NOTES.md).

    python notes/variants/multicast.py steps/step14/kernel.cu .scratch/var/multicast/kernel.cu
    python notes/variants/multicast.py steps/step14/kernel.cu .scratch/var/multicast_k/kernel.cu k-only

Measured in results/h200/dev/2026-11-29-multicast.log. k-only: only K is multicast (and only the K slots are
shared by the pair); V is loaded by each CTA as in step14. Two more, to find where the clusters lose:
cluster-only: the clusters, work units and cluster barriers, but every CTA loads whole tiles for itself and
its slots are its own (no multicast, no remote arrive); local-arrive: the full multicast, with a warp's arrive
on its own CTA's empty barrier a plain local one (only the peer's goes through mapa); launch-only: step14
itself with __cluster_dims__(2, 1, 1) and nothing else. A fourth argument, early-exit, lets the producer
warpgroup exit when it is done (as in step14) instead of waiting at the final cluster barrier:

    python notes/variants/multicast.py steps/step14/kernel.cu .scratch/var/mc_multicast_exit/kernel.cu multicast early-exit

Why (NOTES.md, "Where step14's time goes"): the H200 runs these kernels at its power limit, and halving the K/V
loads from L2 measured +2.3 % at N = 4K and 16K. What it changes, all against step14 (commit 1671cb0 or later):
  * __cluster_dims__(2, 1, 1): CTA pairs. A work unit is two neighbouring q tiles of one (batch, head); CTA rank
    r of a cluster takes q tile 2 u + r (past the end when the q tile count is odd: TMA fills its Q with zeros,
    its stores are clipped, its LSE rows skipped, as for any ragged length).
  * Each CTA's producer loads only its half (64 columns) of every K and V tile, multicast into both CTAs' shared
    memory; the full barrier of each CTA still expects the whole tile's bytes, half from each producer.
  * A slot may be refilled only when the consumers of BOTH CTAs are done with it: an empty barrier counts
    2 x 8 consumer warps, each arriving on its own CTA's barrier and on the peer's (mapa + a cluster-scope arrive).
  * The barriers are initialized before a cluster-wide barrier (not __syncthreads), and every thread meets the
    peer once more at the end: no CTA leaves while the other may still write into its shared memory.
  * The grid is 2 x the clusters that fit at once (cudaOccupancyMaxActiveClusters).
"""
import sys
from pathlib import Path

src, dst = sys.argv[1], sys.argv[2]
mode = sys.argv[3] if len(sys.argv) > 3 else "multicast"
assert mode in ("multicast", "k-only", "cluster-only", "local-arrive", "launch-only"), mode
early_exit = sys.argv[4:] == ["early-exit"]
k_only = mode == "k-only"
t = open(src).read()
if mode == "launch-only":  # step14 itself, launched in clusters of 2 that it does not use
    old = "__global__ void __launch_bounds__(NUM_THREADS, 1)"
    assert t.count(old) == 1
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    Path(dst).write_text(t.replace(old, "__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(NUM_THREADS, 1)"))
    sys.exit()


def rep(old, new, n=1):
    global t
    assert t.count(old) == n, (old[:80], t.count(old))
    t = t.replace(old, new)


rep('#include "wgmma.cuh"\n', '''#include "wgmma.cuh"

// ---- clusters (PTX ISA: "barrier.cluster", "mapa", "mbarrier.arrive", "cp.async.bulk.tensor" .multicast) ----
__device__ __forceinline__ int cluster_ctarank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\\n" : "=r"(r));
    return int(r);
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\\nbarrier.cluster.wait.acquire.aligned;\\n" ::: "memory");
}
// Arrive on the barrier at the same shared-memory offset in CTA `rank` of the cluster.
__device__ __forceinline__ void mbarrier_arrive_in_cta(uint64_t* bar, int rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\\n" : "=r"(remote) : "r"(smem_u32(bar)), "r"(rank));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\\n" :: "r"(remote) : "memory");  // as CUTLASS does: .release, .cta scope
}
// A tensor copy written into the same offset of every CTA in cta_mask, completing on each one's barrier there.
__device__ __forceinline__ void cp_async_bulk_tensor_4d_multicast(void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                                                  int c3, uint64_t* bar, uint16_t cta_mask) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\\n"
                 :: "r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "r"(smem_u32(bar)), "h"(cta_mask)
                 : "memory");
}
''')
rep("constexpr int CONSUMER_WARPS = NUM_CONSUMERS * 4;  // the arrivals that empty a slot\n",
    "constexpr int CONSUMER_WARPS = NUM_CONSUMERS * 4;  // the consumer warps of one CTA\n"
    "constexpr int CLUSTER = 2;  // CTAs sharing each K/V tile; an empty barrier counts the consumer warps of all\n")
# the scheduler: work units of CLUSTER q tiles
rep("""__device__ __forceinline__ WorkTile work_tile(int t, const FwdParams& p) {
    const int q_tiles = ceil_div(p.seqlen_q, BLOCK_M);
    return {t % q_tiles, t / q_tiles % p.heads, t / q_tiles / p.heads};
}
__host__ __device__ __forceinline__ int num_work_tiles(const FwdParams& p) { return ceil_div(p.seqlen_q, BLOCK_M) * p.heads * p.batch; }""",
    """__device__ __forceinline__ WorkTile work_tile(int u, const FwdParams& p, int rank) {  // unit u, this CTA's part
    const int units_per_head = ceil_div(ceil_div(p.seqlen_q, BLOCK_M), CLUSTER);
    return {u % units_per_head * CLUSTER + rank, u / units_per_head % p.heads, u / units_per_head / p.heads};
}
__host__ __device__ __forceinline__ int num_work_units(const FwdParams& p) {
    return ceil_div(ceil_div(p.seqlen_q, BLOCK_M), CLUSTER) * p.heads * p.batch;
}""")
rep("""    for (int t = blockIdx.x; t < num_work_tiles(p); t += gridDim.x, ++iteration) {
        const WorkTile w = work_tile(t, p);""", """    const int rank = cluster_ctarank();
    for (int t = blockIdx.x / CLUSTER; t < num_work_units(p); t += gridDim.x / CLUSTER, ++iteration) {
        const WorkTile w = work_tile(t, p, rank);""")
rep("""    for (int t = blockIdx.x; t < num_work_tiles(p); t += gridDim.x, ++iteration) {
    const WorkTile w = work_tile(t, p);""",
    "    for (int t = blockIdx.x / CLUSTER; t < num_work_units(p); t += gridDim.x / CLUSTER, ++iteration) {\n"
    "    const WorkTile w = work_tile(t, p, rank);")
# producer: this CTA's half of each K/V tile, into both CTAs
rep("""// Max / sum over the 4""", """// This CTA's half (64 columns, by rank) of a [ROWS, HEAD_DIM] tile, into the same place
// in every CTA of the cluster. The barrier expects the whole tile: the other half comes from the peer's producer.
template <int ROWS>
__device__ void load_half_tile_multicast(__nv_bfloat16* dst_smem, const CUtensorMap* map, int row, int head, int batch,
                                         uint64_t* bar, int rank) {
    mbarrier_arrive_expect_tx(bar, ROWS * HEAD_DIM * sizeof(__nv_bfloat16));
    cp_async_bulk_tensor_4d_multicast(dst_smem + rank * ROWS * 64, map, rank * 64, row, head, batch, bar, (1 << CLUSTER) - 1);
}

// Max / sum over the 4""")
rep("""            load_tile_tma<BLOCK_N>(smem.K[stage], &K_map, row, tma_coord(p.k_stride[1], w.head),
                                   tma_coord(p.k_stride[0], w.batch), &smem.K_full[stage]);""",
    """            load_half_tile_multicast<BLOCK_N>(smem.K[stage], &K_map, row, tma_coord(p.k_stride[1], w.head),
                                              tma_coord(p.k_stride[0], w.batch), &smem.K_full[stage], rank);""")
rep("""            load_tile_tma<BLOCK_N>(smem.V[stage], &V_map, row, tma_coord(p.v_stride[1], w.head),
                                   tma_coord(p.v_stride[0], w.batch), &smem.V_full[stage]);""",
    """            load_half_tile_multicast<BLOCK_N>(smem.V[stage], &V_map, row, tma_coord(p.v_stride[1], w.head),
                                              tma_coord(p.v_stride[0], w.batch), &smem.V_full[stage], rank);""")
# consumers: release slots in both CTAs
rep("""    const bool elected = threadIdx.x % 128 == 0;  // the warpgroup's thread that issues its TMA stores
""", """    const bool elected = threadIdx.x % 128 == 0;  // the warpgroup's thread that issues its TMA stores
    const int rank = cluster_ctarank();
    auto release = [&](uint64_t* empty) {  // this warp is done with a K or V slot: tell both CTAs' producers
        if (lane == 0) {
            for (int cta = 0; cta < CLUSTER; ++cta) mbarrier_arrive_in_cta(empty, cta);
        }
    };
""")
rep("    if (lane == 0) mbarrier_arrive(&smem.K_empty[kv_count % STAGES]);", "    release(&smem.K_empty[kv_count % STAGES]);")
rep("        if (lane == 0) mbarrier_arrive(&smem.K_empty[stage]);", "        release(&smem.K_empty[stage]);")
rep("        if (lane == 0) mbarrier_arrive(&smem.V_empty[prev_stage]);", "        release(&smem.V_empty[prev_stage]);")
rep("    if (lane == 0) mbarrier_arrive(&smem.V_empty[last % STAGES]);", "    release(&smem.V_empty[last % STAGES]);")
# kernel: cluster dims, barrier counts, cluster-wide syncs
rep("__global__ void __launch_bounds__(NUM_THREADS, 1)",
    "__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(NUM_THREADS, 1)")
rep("            mbarrier_init(&smem.K_empty[s], CONSUMER_WARPS), mbarrier_init(&smem.V_empty[s], CONSUMER_WARPS);",
    "            mbarrier_init(&smem.K_empty[s], CLUSTER * CONSUMER_WARPS), mbarrier_init(&smem.V_empty[s], CLUSTER * CONSUMER_WARPS);")
rep("""    __syncthreads();  // no thread waits on a barrier before it is initialized; the last block-wide barrier
""", """    cluster_sync();  // no thread, here or in the peer, uses a barrier before it is initialized
""")
rep("""        if (threadIdx.x == 0) producer_load(smem, p, Q_map, K_map, V_map);  // the other 127 threads are done
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        consumer_mma(smem, p, O_map, warpgroup - 1);
    }
}""", """        if (threadIdx.x == 0) producer_load(smem, p, Q_map, K_map, V_map);  // the other 127 threads wait below
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        consumer_mma(smem, p, O_map, warpgroup - 1);
    }
    __syncwarp();    // barrier.cluster's .aligned form wants whole warps
    cluster_sync();  // the peer may still arrive on this CTA's barriers: neither CTA leaves before both are done
}""")
# host: 2 x the clusters that fit at once
rep("""    const int tiles = num_work_tiles(p);
    const dim3 grid(tiles < sms ? tiles : sms);
    attention_fwd_kernel<<<grid, NUM_THREADS, SMEM_BYTES, stream>>>(p, Q_map, K_map, V_map, O_map);""",
    """    static int max_clusters[MAX_DEVICES] = {};
    int clusters = device < MAX_DEVICES ? max_clusters[device] : 0;
    if (clusters == 0) {
        cudaLaunchConfig_t config = {};
        cudaLaunchAttribute attribute;
        attribute.id = cudaLaunchAttributeClusterDimension;
        attribute.val.clusterDim.x = CLUSTER, attribute.val.clusterDim.y = 1, attribute.val.clusterDim.z = 1;
        config.gridDim = dim3(sms / CLUSTER * CLUSTER), config.blockDim = dim3(NUM_THREADS);
        config.dynamicSmemBytes = SMEM_BYTES, config.attrs = &attribute, config.numAttrs = 1;
        if ((err = cudaOccupancyMaxActiveClusters(&clusters, attention_fwd_kernel, &config)) != cudaSuccess) return err;
        if (clusters == 0) return cudaErrorInvalidConfiguration;
        if (device < MAX_DEVICES) max_clusters[device] = clusters;
    }
    const int units = num_work_units(p);
    const dim3 grid(CLUSTER * (units < clusters ? units : clusters));
    attention_fwd_kernel<<<grid, NUM_THREADS, SMEM_BYTES, stream>>>(p, Q_map, K_map, V_map, O_map);""")
rep("// flashladder step14 --", "// flashladder step14 + TMA multicast of K/V in 2-CTA clusters (notes/variants/multicast.py) --")
if k_only:
    rep("""            load_half_tile_multicast<BLOCK_N>(smem.V[stage], &V_map, row, tma_coord(p.v_stride[1], w.head),
                                              tma_coord(p.v_stride[0], w.batch), &smem.V_full[stage], rank);""",
        """            load_tile_tma<BLOCK_N>(smem.V[stage], &V_map, row, tma_coord(p.v_stride[1], w.head),
                                   tma_coord(p.v_stride[0], w.batch), &smem.V_full[stage]);""")
    rep("        release(&smem.V_empty[prev_stage]);", "        if (lane == 0) mbarrier_arrive(&smem.V_empty[prev_stage]);")
    rep("    release(&smem.V_empty[last % STAGES]);", "    if (lane == 0) mbarrier_arrive(&smem.V_empty[last % STAGES]);")
    rep("mbarrier_init(&smem.V_empty[s], CLUSTER * CONSUMER_WARPS);", "mbarrier_init(&smem.V_empty[s], CONSUMER_WARPS);")
    rep("TMA multicast of K/V in 2-CTA clusters", "TMA multicast of K only in 2-CTA clusters")
if mode == "cluster-only":
    for X, x in (("K", "k"), ("V", "v")):
        rep(f"""            load_half_tile_multicast<BLOCK_N>(smem.{X}[stage], &{X}_map, row, tma_coord(p.{x}_stride[1], w.head),
                                              tma_coord(p.{x}_stride[0], w.batch), &smem.{X}_full[stage], rank);""",
            f"""            load_tile_tma<BLOCK_N>(smem.{X}[stage], &{X}_map, row, tma_coord(p.{x}_stride[1], w.head),
                                   tma_coord(p.{x}_stride[0], w.batch), &smem.{X}_full[stage]);""")
    rep("            for (int cta = 0; cta < CLUSTER; ++cta) mbarrier_arrive_in_cta(empty, cta);", "            mbarrier_arrive(empty);")
    rep("mbarrier_init(&smem.K_empty[s], CLUSTER * CONSUMER_WARPS), mbarrier_init(&smem.V_empty[s], CLUSTER * CONSUMER_WARPS);",
        "mbarrier_init(&smem.K_empty[s], CONSUMER_WARPS), mbarrier_init(&smem.V_empty[s], CONSUMER_WARPS);")
    rep("TMA multicast of K/V in 2-CTA clusters", "2-CTA clusters without multicast")
if mode == "local-arrive":
    rep("            for (int cta = 0; cta < CLUSTER; ++cta) mbarrier_arrive_in_cta(empty, cta);",
        "            mbarrier_arrive(empty), mbarrier_arrive_in_cta(empty, rank ^ 1);")
    rep("TMA multicast of K/V in 2-CTA clusters", "TMA multicast of K/V in 2-CTA clusters, local arrives local")
if early_exit:  # the producer warpgroup leaves when done, as in step14, instead of waiting at the last cluster barrier
    rep("""        if (threadIdx.x == 0) producer_load(smem, p, Q_map, K_map, V_map);  // the other 127 threads wait below
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        consumer_mma(smem, p, O_map, warpgroup - 1);
    }
    __syncwarp();    // barrier.cluster's .aligned form wants whole warps
    cluster_sync();  // the peer may still arrive on this CTA's barriers: neither CTA leaves before both are done""",
        """        if (threadIdx.x == 0) producer_load(smem, p, Q_map, K_map, V_map);
        return;  // an exited thread counts as arrived at barrier.cluster (PTX ISA, exit): the producer warps leave
    }
    setmaxnreg_inc<CONSUMER_REGS>();
    consumer_mma(smem, p, O_map, warpgroup - 1);
    cluster_sync();  // the peer may still arrive on this CTA's barriers: the consumers wait for both CTAs' consumers""")
Path(dst).parent.mkdir(parents=True, exist_ok=True)
Path(dst).write_text(t)
