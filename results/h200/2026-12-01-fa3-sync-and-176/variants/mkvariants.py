"""Text patches of steps/step14/kernel.cu, one idea each (and a few together), into .scratch/<name>/kernel.cu."""
import sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
BASE = (ROOT / "steps/step14/kernel.cu").read_text()

def sub(text, old, new, count=1):
    assert text.count(old) == count, (old, text.count(old))
    return text.replace(old, new)

def kfirst(t):
    """The producer loads K one tile ahead of V: K0, K1, V0, K2, V1, ... (the order the consumers need them)."""
    old = t[t.index("        for (int kv_tile = 0; kv_tile < num_kv_tiles; ++kv_tile, ++count) {"):t.index("// Max / sum over") if False else None]
    start = t.index("        for (int kv_tile = 0; kv_tile < num_kv_tiles; ++kv_tile, ++count) {")
    end = t.index("\n    }\n}\n", start)
    new = '''        auto load_k = [&](int kv_tile, int c) {
            const int stage = c % STAGES;
            if (c >= STAGES) mbarrier_wait_parity(&smem.K_empty[stage], empty_parity(c));
            load_tile_tma<BLOCK_N>(smem.K[stage], &K_map, kv_row(kv_tile, num_kv_tiles), tma_coord(p.k_stride[1], w.head),
                                   tma_coord(p.k_stride[0], w.batch), &smem.K_full[stage]);
        };
        load_k(0, count);
        for (int kv_tile = 0; kv_tile < num_kv_tiles; ++kv_tile, ++count) {
            const int stage = count % STAGES, row = kv_row(kv_tile, num_kv_tiles);
            if (kv_tile + 1 < num_kv_tiles) load_k(kv_tile + 1, count + 1);
            if (count >= STAGES) mbarrier_wait_parity(&smem.V_empty[stage], empty_parity(count));
            load_tile_tma<BLOCK_N>(smem.V[stage], &V_map, row, tma_coord(p.v_stride[1], w.head), tma_coord(p.v_stride[0], w.batch),
                                   &smem.V_full[stage]);
        }'''
    return t[:start] + new + t[end:]

def rel1(t):
    """One arrival per warpgroup on the empty barriers (FA3's release), not one per warp."""
    t = sub(t, "constexpr int CONSUMER_WARPS = NUM_CONSUMERS * 4;", "constexpr int CONSUMER_WARPS = NUM_CONSUMERS;")
    t = sub(t, "        if (lane == 0) mbarrier_arrive(empty);", "        if (threadIdx.x % WARPGROUP_THREADS == 0) mbarrier_arrive(empty);")
    return t

def wait0(t):
    """Only consumer 0 waits on the full barriers; consumer 1 issues on its turn, after consumer 0 saw the data."""
    t = sub(t, "        wait_full(&smem.K_full[stage], count, 0);", "        if (index == 0) wait_full(&smem.K_full[stage], count, 0);")
    t = sub(t, "        wait_full(&smem.K_full[stage], count, kv_tile);\n        wait_full(&smem.V_full[prev_stage], count - 1, kv_tile);",
            "        if (index == 0) {\n            wait_full(&smem.K_full[stage], count, kv_tile);\n            wait_full(&smem.V_full[prev_stage], count - 1, kv_tile);\n        }")
    t = sub(t, "        wait_full(&smem.V_full[stage], count, kv_tile);", "        if (index == 0) wait_full(&smem.V_full[stage], count, kv_tile);")
    return t

def psleep(t):
    """The producer's waits carry a suspend-time hint (it sleeps instead of spinning); the consumers' do not."""
    t = sub(t, "__device__ __forceinline__ void wait_full(", '''__device__ __forceinline__ void wait_sleep(uint64_t* bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{\\n.reg .pred p;\\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\\nselp.b32 %0, 1, 0, p;\\n}\\n"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity), "r"(0x989680) : "memory");
}
__device__ __forceinline__ void wait_full(''')
    # every mbarrier_wait_parity in producer_load
    s = t.index("__device__ void producer_load(")
    e = t.index("struct MmaWarpgroup {")
    t = t[:s] + t[s:e].replace("mbarrier_wait_parity(", "wait_sleep(") + t[e:]
    return t

def k3(t):
    """Three K slots (V keeps two): Q 32 + K 96 + V 64 + O 32 = 224 KB. Needs kfirst to use the extra slot."""
    t = sub(t, "constexpr int STAGES = 2;                             // K/V ring slots: compute one while the other fills",
            "constexpr int STAGES = 2;                             // V ring slots\nconstexpr int K_STAGES = 3;                           // K ring slots")
    t = sub(t, "    __nv_bfloat16 K[STAGES][BLOCK_N * HEAD_DIM];", "    __nv_bfloat16 K[K_STAGES][BLOCK_N * HEAD_DIM];")
    t = sub(t, "    uint64_t K_full[STAGES], V_full[STAGES];", "    uint64_t K_full[K_STAGES], V_full[STAGES];")
    t = sub(t, "    uint64_t K_empty[STAGES], V_empty[STAGES];", "    uint64_t K_empty[K_STAGES], V_empty[STAGES];")
    t = sub(t, "__device__ __forceinline__ void wait_full(uint64_t* full, int count, int kv_tile) {",
            '''__device__ __forceinline__ uint32_t kfull_parity(int count) { return uint32_t(count / K_STAGES) % 2; }
__device__ __forceinline__ uint32_t kempty_parity(int count) { return uint32_t(count / K_STAGES + 1) % 2; }
__device__ __forceinline__ void wait_full(uint64_t* full, int count, int kv_tile) {''')
    # producer (kfirst form)
    t = sub(t, "            const int stage = c % STAGES;\n            if (c >= STAGES) mbarrier_wait_parity(&smem.K_empty[stage], empty_parity(c));",
            "            const int stage = c % K_STAGES;\n            if (c >= K_STAGES) mbarrier_wait_parity(&smem.K_empty[stage], kempty_parity(c));")
    # consumers: K stage and parity
    t = sub(t, "    __device__ void gemm_block_first(int count, int keys) {\n        const int stage = count % STAGES;\n        wait_full(&smem.K_full[stage], count, 0);",
            "    __device__ void gemm_block_first(int count, int keys) {\n        const int stage = count % K_STAGES;\n        mbarrier_wait_parity(&smem.K_full[stage], kfull_parity(count));")
    t = sub(t, "        const int stage = count % STAGES, prev_stage = (count - 1) % STAGES;\n        wait_full(&smem.K_full[stage], count, kv_tile);",
            "        const int stage = count % K_STAGES, prev_stage = (count - 1) % STAGES;\n        mbarrier_wait_parity(&smem.K_full[stage], kfull_parity(count));")
    t = sub(t, "        for (int s = 0; s < STAGES; ++s) {\n            mbarrier_init(&smem.K_full[s], 1), mbarrier_init(&smem.V_full[s], 1);\n            mbarrier_init(&smem.K_empty[s], CONSUMER_WARPS), mbarrier_init(&smem.V_empty[s], CONSUMER_WARPS);\n        }",
            "        for (int s = 0; s < STAGES; ++s) mbarrier_init(&smem.V_full[s], 1), mbarrier_init(&smem.V_empty[s], CONSUMER_WARPS);\n        for (int s = 0; s < K_STAGES; ++s) mbarrier_init(&smem.K_full[s], 1), mbarrier_init(&smem.K_empty[s], CONSUMER_WARPS);")
    return t

VARIANTS = {
    "kfirst": [kfirst],
    "rel1": [rel1],
    "wait0": [wait0],
    "psleep": [psleep],
    "kfirst_k3": [kfirst, k3],
    "kfirst_rel1_wait0": [kfirst, rel1, wait0],
}
for name, fs in VARIANTS.items():
    t = BASE
    for f in fs:
        t = f(t)
    d = ROOT / ".scratch" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "kernel.cu").write_text(t)
    print("wrote", d)
