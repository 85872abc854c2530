"""Rotate the consumer's main loop (steps 12-14): finish the previous block at the top of each iteration."""
import sys

src, dst = sys.argv[1], sys.argv[2]
t = open(src).read()
def rep(old, new):
    global t
    assert t.count(old) == 1, old
    t = t.replace(old, new)
# block 0 no longer makes P itself
rep("""    softmax(S_acc, alpha);
    TRACE_EVENT(TRACE_SOFTMAX_END, 0);
    TRACE_EVENT(TRACE_RESCALE_BEGIN, 0);
    rescale_o_and_make_p(S_acc, alpha);
    TRACE_EVENT(TRACE_RESCALE_END, 0);
""", """    softmax(S_acc, alpha);
    TRACE_EVENT(TRACE_SOFTMAX_END, 0);
""")
persistent = "kv_count" in t
if persistent:
    rep("""    for (int kv_tile = 1; kv_tile < num_kv_tiles; ++kv_tile) {
        const int count = kv_count + kv_tile;
        const int stage = count % STAGES, prev_stage = (count - 1) % STAGES;
""", """#pragma unroll 1
    for (int kv_tile = 1; kv_tile < num_kv_tiles; ++kv_tile) {
        const int count = kv_count + kv_tile;
        const int stage = count % STAGES, prev_stage = (count - 1) % STAGES;
        finish_block(kv_tile);
""")
else:
    rep("""    for (int kv_tile = 1; kv_tile < num_kv_tiles; ++kv_tile) {
        const int stage = kv_tile % STAGES, prev_stage = (kv_tile - 1) % STAGES;
""", """#pragma unroll 1
    for (int kv_tile = 1; kv_tile < num_kv_tiles; ++kv_tile) {
        const int stage = kv_tile % STAGES, prev_stage = (kv_tile - 1) % STAGES;
        finish_block(kv_tile);
""")
rep("""        softmax(S_acc, alpha);          // under the tensor cores' P V
        TRACE_EVENT(TRACE_SOFTMAX_END, kv_tile);
        wgmma_wait_group<0>();          // P V is complete: O and P_frag are free again
        TRACE_EVENT(TRACE_GEMM_WAITED_ALL, kv_tile);
        wgmma_fence_operands(O_acc);
        if (lane == 0) mbarrier_arrive(&smem.V_empty[prev_stage]);  // ... and so is the previous V tile
        TRACE_EVENT(TRACE_RESCALE_BEGIN, kv_tile);
        rescale_o_and_make_p(S_acc, alpha);
        TRACE_EVENT(TRACE_RESCALE_END, kv_tile);
    }
""", """        softmax(S_acc, alpha);          // under the tensor cores' P V
        TRACE_EVENT(TRACE_SOFTMAX_END, kv_tile);
    }
""")
if persistent:
    rep("""    const int last = kv_count + num_kv_tiles - 1;
""", """    const int last = kv_count + num_kv_tiles - 1;
    finish_block(num_kv_tiles);
""")
else:
    rep("""    const int last = num_kv_tiles - 1;
""", """    const int last = num_kv_tiles - 1;
    finish_block(num_kv_tiles);
""")
# the lambda, before S_acc's declaration
anchor = ("    int kv_count = 0;           // K/V tiles consumed so far, over all work tiles: the ring's position\n" if persistent
          else "    float alpha[2];             // this tile's rescale factors of rows quad_row, quad_row + 8\n")
vidx = "kv_count + kv_tile - 2" if persistent else "kv_tile - 2"
rep(anchor, anchor + """    // The end of GEMM block j - 1, at the start of block j: wait for its P V (block 0 has none), release that
    // V tile, rescale O and make the P of the softmax that just ran.
    auto finish_block = [&](int kv_tile) {
        wgmma_wait_group<0>();          // P V is complete: O and P_frag are free again
        TRACE_EVENT(TRACE_GEMM_WAITED_ALL, kv_tile - 1);
        wgmma_fence_operands(O_acc);
        if (lane == 0 && kv_tile >= 2) mbarrier_arrive(&smem.V_empty[(VIDX) % STAGES]);
        TRACE_EVENT(TRACE_RESCALE_BEGIN, kv_tile - 1);
        rescale_o_and_make_p(S_acc, alpha);
        TRACE_EVENT(TRACE_RESCALE_END, kv_tile - 1);
    };
""".replace("VIDX", vidx))
open(dst, "w").write(t)
