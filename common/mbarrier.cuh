// flashladder/common/mbarrier.cuh -- the shared-memory barrier that TMA copies complete on (sm_90).
//
// An mbarrier is a 64-bit object in shared memory. It counts two things down in its current PHASE:
// arrivals (set at init) and transaction bytes (announced by arrive.expect_tx, counted off by the TMA unit
// as bytes land). When both reach zero the phase completes: the barrier flips its phase bit and re-arms
// with the same arrival count. Waiters ask "has the phase with parity P completed?" (try_wait.parity), so
// a ring slot used for the n-th time waits on parity n % 2. Picture (one slot of a K/V ring):
//
//     phase 0: expect_tx(32 KB) ... TMA bytes land ... -> complete, parity 0 done -> consumers read
//     phase 1: expect_tx(32 KB) ... (the next tile for this slot) ...      -> parity 1 done -> ...
//
// A waiter on the wrong parity either passes at once (reads a stale tile: a race) or waits forever (a hang):
// verify runs every step's checks in a subprocess with a time limit for that reason.
#pragma once

#include <cstdint>
#include "ptx.cuh"

// Set the arrival count of a fresh barrier (phase 0). PTX ISA: "Parallel Synchronization and
// Communication Instructions: mbarrier.init".
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_u32(bar)), "r"(arrivals) : "memory");
}

// Make the inits above visible to the other threads and to the TMA unit before anyone uses the barriers
// (followed by a __syncthreads). PTX ISA: "Parallel Synchronization and Communication Instructions:
// fence" (fence.mbarrier_init).
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrive once and announce `bytes` more transaction bytes for the current phase (the TMA copies issued
// against this barrier will count them off). PTX ISA: "mbarrier.arrive" (.expect_tx).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}

// Arrive once (a consumer saying "I am done with this slot"). PTX ISA: "mbarrier.arrive".
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_u32(bar)) : "memory");
}

// Has the phase with this parity completed? The instruction may suspend the thread for a while before
// answering false, so a loop around it is not a hot spin. PTX ISA: "mbarrier.test_wait/try_wait" (.parity).
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.b32 %0, 1, 0, p;\n"
                 "}\n"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    return done != 0;
}
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) {
    while (!mbarrier_try_wait_parity(bar, parity)) {
    }
}

// ---- thread-block clusters (sm_90): CTAs on neighbouring SMs that see each other's shared memory ----
// This CTA's rank in its cluster (0 .. cluster size - 1). PTX ISA: "Special Registers: %cluster_ctarank".
__device__ __forceinline__ uint32_t cluster_ctarank() {
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return rank;
}
// The address, in the cluster's shared-memory window, of the object at `p` in the CTA of rank `rank`.
// PTX ISA: "Data Movement and Conversion Instructions: mapa".
__device__ __forceinline__ uint32_t mapa_shared_cluster(const void* p, uint32_t rank) {
    uint32_t addr;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(addr) : "r"(smem_u32(p)), "r"(rank));
    return addr;
}
// Arrive once on a barrier of another CTA of the cluster (its address from mapa_shared_cluster).
// PTX ISA: "mbarrier.arrive" (.shared::cluster).
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t cluster_addr) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" :: "r"(cluster_addr) : "memory");
}
// Every thread of the cluster that has not exited arrives and waits: the cluster-wide __syncthreads (release and
// acquire: shared-memory writes before it, mbarrier inits included, are seen after it by every CTA). Not .aligned:
// it may sit on divergent paths. PTX ISA: "Parallel Synchronization and Communication Instructions: barrier.cluster".
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
