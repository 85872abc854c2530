"""FA3 placement: O's rescale between the S and the P V issue; make P alone after the wait; pin with PIN."""
import sys

src, dst, pin = sys.argv[1], sys.argv[2], sys.argv[3]
PINS = {"fence": '        asm volatile("fence.acq_rel.cta;" ::: "memory");\n', "none": "",
        "bar": '        named_barrier_sync(3 + consumer, 128);\n'}
t = open(src).read()
def rep(old, new, n=1):
    global t
    assert t.count(old) == n, (old, t.count(old))
    t = t.replace(old, new)
# split the lambda
rep("    auto rescale_o_and_make_p = [&](const float (&S)[S_BLOCKS * 4], const float (&alpha)[2]) {\n",
    "    auto rescale_o = [&](const float (&alpha)[2]) {\n")
rep("""        for (int kk = 0; kk < PV_STEPS; ++kk) {
            P_frag[kk][0] = cvt_rn_bf16x2_f32""", """    };
    auto make_p = [&](const float (&S)[S_BLOCKS * 4]) {
        for (int kk = 0; kk < PV_STEPS; ++kk) {
            P_frag[kk][0] = cvt_rn_bf16x2_f32""")
rep("\n    rescale_o_and_make_p(S_acc, alpha);\n", "\n    make_p(S_acc);\n")   # block 0
rep("""        issue_qk(S_acc, stage);
        wgmma_commit_group();
        issue_pv(prev_stage);""", """        issue_qk(S_acc, stage);
        wgmma_commit_group();
        rescale_o(alpha);  // under S = Q K^T: the previous P V is complete
        wgmma_fence();
        issue_pv(prev_stage);""")
rep("        softmax(S_acc, alpha);          // under the tensor cores' P V\n",
    "        softmax(S_acc, alpha);          // under the tensor cores' P V\n" + PINS[pin])
rep("        rescale_o_and_make_p(S_acc, alpha);\n", "        make_p(S_acc);\n")
rep("""    wgmma_fence();
    issue_pv(last % STAGES);""", """    rescale_o(alpha);
    wgmma_fence();
    issue_pv(last % STAGES);""")
open(dst, "w").write(t)
