#!/bin/bash
# Four broken builds of step18, each with the GPU checks meant to reject it. Run from the repo root on the GPU machine.
set -u
K=steps/step18/kernel.cu B=common/binding.py
cp $K /tmp/kernel.cu.orig; cp $B /tmp/binding.py.orig
one() {  # name, file, sed expression, pytest -k
    echo "=== $1: $3"
    sed -i "$3" $2
    if cmp -s $2 /tmp/$(basename $2).orig; then echo "PATCH DID NOT APPLY"; return; fi
    diff /tmp/$(basename $2).orig $2
    FLASHLADDER_STEPS=18 timeout 300 python3 -m pytest verify/tests/test_steps_gpu.py -q -x -p no:cacheprovider -k "$4" 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
    cp /tmp/kernel.cu.orig $K; cp /tmp/binding.py.orig $B
}
one never-split $K 's/const bool split = !p.causal \&\& /const bool split = false \&\& !p.causal \&\& /' "last_turn_is_split"
one no-flag-wait $K 's/while (load_acquire_gpu(partial_flag(cta)) == 0) {}/;/' "split_tail_is_deterministic or test_split_tail["
one one-workspace $B 's/key = (device.index, stream)/key = (device.index, 0)/' "two_streams"
one long-from-8k $K 's/p.seqlen_k >= LONG_MIN_SEQLEN_K;/p.seqlen_k >= 2 * LONG_MIN_SEQLEN_K;/' "launcher_picks"
