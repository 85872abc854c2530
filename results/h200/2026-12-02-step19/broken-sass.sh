#!/bin/bash
# Two broken builds of step19, each beside the SASS check meant to reject it (no GPU: cuobjdump on the built library).
# Run from the repository root: bash results/h200/2026-12-02-step19/broken-sass.sh
set -u
K=steps/step19/kernel.cu
cp $K /tmp/kernel.cu.orig
one() {  # name, sed expression
    echo "=== $1: $2"
    sed -i "$2" $K
    if cmp -s $K /tmp/kernel.cu.orig; then echo "PATCH DID NOT APPLY"; return; fi
    diff /tmp/kernel.cu.orig $K
    python -m pytest verify/tests/test_sass.py -q -p no:cacheprovider -k "causal_kernels_are_step18s" 2>&1 | grep -E "passed|failed|^E +AssertionError" | tail -4
    cp /tmp/kernel.cu.orig $K
}
echo "=== as committed"
python -m pytest verify/tests/test_sass.py -q -p no:cacheprovider -k "causal_kernels_are_step18s" 2>&1 | tail -1
one dense-keeps-the-causal-paths 's/const FwdParams\& p = CAUSAL ? params : dense;/const FwdParams\& p = params;/'
one causal-loses-them 's/const FwdParams\& p = CAUSAL ? params : dense;/const FwdParams\& p = dense;/'
