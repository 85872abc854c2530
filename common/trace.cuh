// flashladder/common/trace.cuh -- measured timelines: per-warp events of one CTA, behind a compile-time switch.
//
// A kernel marks points of its warp roles with one-line TRACE_EVENT(event, argument) calls (argument: the
// K/V tile, or the work tile for Q and the epilogue). In a normal build TRACE_EVENT expands to nothing: its
// arguments are not even evaluated, and the machine code is that of the same source without the lines
// (verify/tests/test_trace.py compares the SASS). Built with -DFLASHLADDER_TRACE (python -m verify.trace
// builds that into build/trace/), lane 0 of each warp of CTA (0, 0, 0) appends an event to its warp's own
// region of a buffer in global memory; every other lane and CTA returns at once. An event is 32 bytes,
// written with two 16-byte stores:
//
//     word 0: clock64()      the SM's cycle counter: fine-grained, and all warps of one CTA share one SM
//     word 1: %globaltimer   nanoseconds, but on some GPUs updated only every ~1 us; verify/trace.py
//                            converts clock64 to ns by the ratio of the two over the whole run
//     word 2: argument << 32 | event << 16 | warp (the warp index in the CTA, = the region's)
//     word 3: %smid          the SM: one for the whole trace (two SMs' clocks are not comparable)
//
// Each recording warp counts its events in shared memory (a load and a store: tens of cycles) rather than
// with an atomicAdd on a global counter, whose round trip to L2 (hundreds of cycles) would sit on the warp's
// path at every event and change the timeline being measured. Shared memory starts undefined (and may hold
// a count left by an earlier launch on this SM), so a count is tagged with %gridid, unique per launch: a
// count with another tag is an old one, and the warp starts from 0. (The counts take 512 bytes of static
// shared memory, 1 KB once the kernel's 1024-byte aligned dynamic shared memory follows them.) The count also
// goes to global memory, a store nobody waits for, for the host. A warp's events past its region's capacity
// are dropped and only counted.
// Host side: flashladder_trace_reset() before the launch to trace, flashladder_trace_counts() and
// flashladder_trace_read_warp() after it has finished; exported by trace builds only.
//
// What a timestamp means: when the warp passed that point of the program as compiled. The reads are
// volatile asm, so they keep their order with the kernel's other volatile asm (wgmma, mbarrier waits,
// bar.sync); ordinary arithmetic (a softmax's first FMNMX or last cvt) may be scheduled across them.
#pragma once

#ifdef FLASHLADDER_TRACE

#include <cstdint>
#include "flashladder.cuh"

// The events. verify/trace.py reads this enum (names and values) from this file: define new ones here only.
enum TraceEvent : uint32_t {
    TRACE_TMA_Q = 1,                   // producer: before it issues the TMA copy of a Q tile (argument: work tile)
    TRACE_TMA_K = 2,                   // producer: before it issues the TMA copy of a K tile
    TRACE_TMA_V = 3,                   // producer: before it issues the TMA copy of a V tile
    TRACE_EMPTY_WAIT_BEGIN = 4,        // producer: before it waits until a slot is empty (may pass at once)
    TRACE_EMPTY_WAIT_END = 5,
    TRACE_FULL_WAIT_BEGIN = 6,         // consumer: before it waits until a tile (Q, K or V) has landed
    TRACE_FULL_WAIT_END = 7,
    TRACE_GEMM_ISSUED = 8,             // consumer: after a wgmma_commit_group: one more commit group on its way
    TRACE_GEMM_WAITED_ALL = 9,         // consumer: after wgmma_wait_group<0>: every group issued so far is complete
    TRACE_GEMM_WAITED_ALL_BUT_1 = 10,  // ... after wgmma_wait_group<1>: all but the newest group are complete
    TRACE_SOFTMAX_BEGIN = 11,          // consumer: the online softmax of a tile (from step13 on: its part on S alone)
    TRACE_SOFTMAX_END = 12,
    TRACE_RESCALE_BEGIN = 13,          // consumer, from step13 on: the softmax's second part (rescale O, P to bf16)
    TRACE_RESCALE_END = 14,
    TRACE_TURN_WAIT_BEGIN = 15,        // consumer, ping-pong: before it waits for its turn on the tensor cores
    TRACE_TURN_WAIT_END = 16,
    TRACE_EPILOGUE_BEGIN = 17,         // consumer: normalization and output stores of a work tile
    TRACE_EPILOGUE_END = 18,
};

constexpr int TRACE_MAX_WARPS = 32;               // 1024 threads: a region for every warp a CTA can have
constexpr int TRACE_EVENTS_PER_WARP = 1 << 14;    // step14 at 1 x 16 x 4096: ~1600 per consumer warp
constexpr int TRACE_WORDS_PER_EVENT = 4;          // uint64 words (the layout above)

__device__ ulonglong2 trace_buffer[TRACE_MAX_WARPS * TRACE_EVENTS_PER_WARP * TRACE_WORDS_PER_EVENT / 2];
__device__ unsigned int trace_counts[TRACE_MAX_WARPS];  // events each warp attempted (may exceed its region)
struct TraceWarpCount {
    uint64_t grid;       // %gridid of the launch that wrote `count`
    unsigned int count;
};
__shared__ TraceWarpCount trace_warp_count[TRACE_MAX_WARPS];

__device__ __forceinline__ void trace_event(uint32_t event, int argument) {
    if (threadIdx.x % 32 != 0 || (blockIdx.x | blockIdx.y | blockIdx.z) != 0) return;  // lane 0 of CTA 0 only
    const unsigned int warp = threadIdx.x / 32;
    uint64_t clock, globaltimer, grid;
    uint32_t smid;
    // Volatile with a memory clobber: kept in program order with the kernel's volatile asm and memory accesses.
    asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(clock) :: "memory");
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(globaltimer) :: "memory");
    asm("mov.u32 %0, %%smid;\n" : "=r"(smid));
    asm("mov.u64 %0, %%gridid;\n" : "=l"(grid));
    const TraceWarpCount seen = trace_warp_count[warp];
    const unsigned int slot = seen.grid == grid ? seen.count : 0;  // another launch's count: start from 0
    trace_warp_count[warp] = {grid, slot + 1};
    trace_counts[warp] = slot + 1;
    if (slot < TRACE_EVENTS_PER_WARP) {
        const uint64_t info = uint64_t(uint32_t(argument)) << 32 | uint64_t(event) << 16 | warp;
        ulonglong2* dst = trace_buffer + (size_t(warp) * TRACE_EVENTS_PER_WARP + slot) * (TRACE_WORDS_PER_EVENT / 2);
        dst[0] = make_ulonglong2(clock, globaltimer);
        dst[1] = make_ulonglong2(info, smid);
    }
}

#define TRACE_EVENT(event, argument) trace_event((event), (argument))

// A span: TRACE_SPAN(TRACE_X_BEGIN, argument) records TRACE_X_BEGIN where it stands and TRACE_X_END (the
// next value of the enum) where its scope closes, so a phase is traced by one line at its top.
struct TraceSpan {
    uint32_t end;
    int argument;
    __device__ __forceinline__ TraceSpan(uint32_t begin, int arg) : end(begin + 1), argument(arg) { trace_event(begin, arg); }
    __device__ __forceinline__ ~TraceSpan() { trace_event(end, argument); }
};
#define TRACE_SPAN_NAME(line) trace_span_##line
#define TRACE_SPAN_AT(line, event, argument) TraceSpan TRACE_SPAN_NAME(line)((event), (argument))
#define TRACE_SPAN(event, argument) TRACE_SPAN_AT(__LINE__, event, argument)

// ---- host side (trace builds only): the buffer's shape, and reading it back; each returns a cudaError_t ----
FLASHLADDER_EXPORT int flashladder_trace_max_warps() { return TRACE_MAX_WARPS; }
FLASHLADDER_EXPORT int flashladder_trace_events_per_warp() { return TRACE_EVENTS_PER_WARP; }
FLASHLADDER_EXPORT int flashladder_trace_words_per_event() { return TRACE_WORDS_PER_EVENT; }

// Before the launch to trace: zero the counts (a warp that records nothing reads back 0) and the events (a
// slot that no event wrote reads back as event 0, which verify/trace.py rejects); done when it returns.
FLASHLADDER_EXPORT int flashladder_trace_reset() {
    void* buffer = nullptr;
    cudaError_t err = cudaGetSymbolAddress(&buffer, trace_buffer);
    if (err == cudaSuccess) err = cudaMemset(buffer, 0, sizeof(trace_buffer));
    const unsigned int zeros[TRACE_MAX_WARPS] = {};
    if (err == cudaSuccess) err = cudaMemcpyToSymbol(trace_counts, zeros, sizeof(zeros));
    return err == cudaSuccess ? cudaDeviceSynchronize() : err;
}
// counts[TRACE_MAX_WARPS]: the events each warp attempted. Call once the traced kernel has finished
// (cudaMemcpyFromSymbol orders itself after the legacy default stream only).
FLASHLADDER_EXPORT int flashladder_trace_counts(unsigned int* counts) {
    return cudaMemcpyFromSymbol(counts, trace_counts, sizeof(trace_counts));
}
// dst[events][TRACE_WORDS_PER_EVENT]: the first `events` events of warp `warp` (events <= its count and
// <= TRACE_EVENTS_PER_WARP).
FLASHLADDER_EXPORT int flashladder_trace_read_warp(int warp, uint64_t* dst, int events) {
    if (warp < 0 || warp >= TRACE_MAX_WARPS || events < 0 || events > TRACE_EVENTS_PER_WARP) return cudaErrorInvalidValue;
    constexpr size_t EVENT_BYTES = TRACE_WORDS_PER_EVENT * sizeof(uint64_t);
    return cudaMemcpyFromSymbol(dst, trace_buffer, events * EVENT_BYTES, size_t(warp) * TRACE_EVENTS_PER_WARP * EVENT_BYTES);
}

#else

#define TRACE_EVENT(event, argument) \
    do {                             \
    } while (0)
#define TRACE_SPAN(event, argument) \
    do {                            \
    } while (0)

#endif  // FLASHLADDER_TRACE
