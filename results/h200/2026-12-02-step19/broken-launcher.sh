#!/bin/bash
# A broken launcher beside the GPU check meant to reject it: dense calls sent to the kernel with the causal paths.
# Its numbers stay right (CAUSAL only keeps p.causal as given, and it is 0), so only the kernel's name can tell.
# Run from the repository root on the GPU machine: bash results/h200/2026-12-02-step19/broken-launcher.sh
set -u
K=steps/step19/kernel.cu
cp $K /tmp/kernel.cu.orig
run() { FLASHLADDER_STEPS=19 timeout 300 python3 -m pytest verify/tests/test_steps_gpu.py -q -x -p no:cacheprovider \
        -k launcher_picks 2>&1 | grep -E "passed|failed|^E +(AssertionError|assert)" | tail -4; }
echo "=== as committed"; run
echo "=== dense calls on the causal kernel"
sed -i 's/const auto kernel = p.causal ? attention_fwd_kernel<LONG, false, true>/const auto kernel = true ? attention_fwd_kernel<LONG, false, true>/' $K
if cmp -s $K /tmp/kernel.cu.orig; then echo "PATCH DID NOT APPLY"; else diff /tmp/kernel.cu.orig $K; run; fi
cp /tmp/kernel.cu.orig $K
