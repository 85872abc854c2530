// Microbenchmark: the throughput of wgmma shapes the backward uses, 2 warpgroups a CTA, one CTA an SM.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#include "wgmma.cuh"
constexpr int ITER = 2048, KSTEPS = 8;
template <int MODE>  // 0: m64n64k16 SS, 1: m64n128k16 SS, 2: m64n128k16 RS, 3: m64n64k16 SS + STS traffic
__global__ void __launch_bounds__(256, 1) bench(float* out, long long* cycles) {
    extern __shared__ __align__(1024) char smem[];
    for (int i = threadIdx.x; i < 96 * 1024 / 4; i += 256) reinterpret_cast<float*>(smem)[i] = 0.f;
    __syncthreads();
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    const uint64_t da = wgmma_desc_kmajor(base + wg * 16384), db = wgmma_desc_kmajor(base + 32768 + wg * 16384);
    float acc[64] = {};
    auto& acc32 = reinterpret_cast<float (&)[32]>(acc);
    uint32_t a[4] = {0, 0, 0, 0};
    const long long t0 = clock64();
    for (int it = 0; it < ITER; ++it) {
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < KSTEPS; ++k) {
            if constexpr (MODE == 0 || MODE == 3) wgmma_m64n64k16_ss<0, 0>(acc32, wgmma_desc_advance(da, k * 32), wgmma_desc_advance(db, k * 32), 1);
            if constexpr (MODE == 1) wgmma_m64n128k16_ss(acc, wgmma_desc_advance(da, k * 32), wgmma_desc_advance(db, k * 32), 1);
            if constexpr (MODE == 2) wgmma_m64n128k16_rs(acc, a, wgmma_desc_advance(db, k * 32), 1);
        }
        wgmma_commit_group();
        if constexpr (MODE == 3) {  // 64 bytes a thread of stores per 8 wgmmas: 16 KB a CTA-iteration
            float4* dst = reinterpret_cast<float4*>(smem + 65536) + threadIdx.x;
#pragma unroll
            for (int i = 0; i < 4; ++i) dst[i * 256] = make_float4(it, it, it, it);
        }
        wgmma_wait_group<1>();
    }
    wgmma_wait_group<0>();
    const long long t1 = clock64();
    float s = 0.f;
    for (int i = 0; i < 64; ++i) s += acc[i];
    out[blockIdx.x * 256 + threadIdx.x] = s;
    if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
template <int MODE>
void run(const char* name, double macs_per_wgmma, float* out, long long* cyc, int sms) {
    cudaFuncSetAttribute(bench<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024);
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    bench<MODE><<<sms, 256, 96 * 1024>>>(out, cyc);
    cudaEventRecord(e0);
    bench<MODE><<<sms, 256, 96 * 1024>>>(out, cyc);
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    long long c; cudaMemcpy(&c, cyc, sizeof c, cudaMemcpyDeviceToHost);
    const double wgmmas = 2.0 * ITER * KSTEPS;  // per CTA
    printf("%-34s %7.1f TFLOP/s  %6.1f cycles a wgmma (2 warpgroups)  %6.0f MAC/clk/SM  err=%s\n", name,
           2 * macs_per_wgmma * wgmmas * sms / (ms * 1e-3) / 1e12, double(c) / wgmmas, macs_per_wgmma * wgmmas / c,
           cudaGetErrorString(cudaGetLastError()));
}
int main() {
    int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    float* out; long long* cyc; cudaMalloc(&out, sms * 256 * 4); cudaMalloc(&cyc, sms * 8);
    for (int rep = 0; rep < 2; ++rep) {
        run<0>("m64n64k16 SS", 64.0 * 64 * 16, out, cyc, sms);
        run<1>("m64n128k16 SS", 64.0 * 128 * 16, out, cyc, sms);
        run<2>("m64n128k16 RS", 64.0 * 128 * 16, out, cyc, sms);
        run<3>("m64n64k16 SS + 16 KB STS per 8", 64.0 * 64 * 16, out, cyc, sms);
    }
}
