"""Diagnostic variants of step14 (wrong results on purpose) under .scratch/var/, by text replacement.

    python notes/variants/diagnostics.py SRC.cu [NAME ...]   # SRC: `git show cda9b3d:steps/step14/kernel.cu`
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
base = Path(sys.argv[1]).read_text()
VAR = ROOT / ".scratch/var"

def rep(text, old, new, count=1):
    assert text.count(old) == count, (old, text.count(old))
    return text.replace(old, new)

def write(name, text):
    d = VAR / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "kernel.cu").write_text(text)

variants = {}
variants["base"] = base
# No K/V traffic after each slot's first fill: the producer completes the full barriers with a plain arrive.
K_LOAD = "            load_tile_tma<BLOCK_N>(smem.K[stage], &K_map,"
V_LOAD = "            load_tile_tma<BLOCK_N>(smem.V[stage], &V_map,"
t = rep(base, K_LOAD, "            if (kv_count >= STAGES) mbarrier_arrive(&smem.K_full[stage]); else\n" + K_LOAD)
t = rep(t, V_LOAD, "            if (kv_count >= STAGES) mbarrier_arrive(&smem.V_full[stage]); else\n" + V_LOAD)
variants["diag_noload"] = t
# Half the K/V traffic (what a 2-CTA multicast would read from L2): one 64-column half per tile after the first fill.
HALF = '''
template <int ROWS>
__device__ void load_half_tma(__nv_bfloat16* dst_smem, const CUtensorMap* map, int row, int head, int batch, uint64_t* bar) {
    mbarrier_arrive_expect_tx(bar, ROWS * 64 * sizeof(__nv_bfloat16));
    cp_async_bulk_tensor_4d_global_to_shared(dst_smem, map, 0, row, head, batch, bar);
}
// Max / sum over the 4'''
t = rep(base, "\n// Max / sum over the 4", HALF)
for X, x in (("K", "k"), ("V", "v")):
    t = rep(t, K_LOAD if X == "K" else V_LOAD,
            f"            if (kv_count >= STAGES) load_half_tma<BLOCK_N>(smem.{X}[stage], &{X}_map, kv_tile * BLOCK_N, "
            f"tma_coord(p.{x}_stride[1], w.head), tma_coord(p.{x}_stride[0], w.batch), &smem.{X}_full[stage]); else\n"
            + (K_LOAD if X == "K" else V_LOAD))
variants["diag_halfload"] = t
# No MUFU: the exponential replaced by the identity (wrong numbers, same everything else).
t = rep(base, "S[4 * nb + 2 * r] = on_fma ? exp2_poly3(x0) : ex2_approx_ftz(x0);", "S[4 * nb + 2 * r] = x0;")
t = rep(t, "S[4 * nb + 2 * r + 1] = on_fma ? exp2_poly3(x1) : ex2_approx_ftz(x1);", "S[4 * nb + 2 * r + 1] = x1;")
variants["diag_noexp"] = t
# No softmax at all: P = S rounded to bf16 (the GEMM pipeline, barriers and epilogue alone).
t = rep(base, "        for (int r = 0; r < 2; ++r) {\n            float tile_max",
        "        alpha[0] = alpha[1] = 1.f;\n        for (int r = 0; r < 2 && false; ++r) {\n            float tile_max")
variants["diag_nosoftmax"] = t
for name in (sys.argv[2:] or variants):
    write(name, variants[name])
    print("wrote", name)
