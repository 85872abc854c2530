#!/bin/bash
# Two broken builds of step20, each beside the SASS check meant to reject it (no GPU: cuobjdump on the built library).
# Run from the repository root: bash results/h200/2026-12-03-step20/broken-sass.sh
set -u
K=steps/step20/kernel.cu
T=divide_by_multiplying
cp $K /tmp/kernel.cu.orig
one() {  # name, sed expression
    echo "=== $1: $2"
    sed -i "$2" $K
    if cmp -s $K /tmp/kernel.cu.orig; then echo "PATCH DID NOT APPLY"; return; fi
    diff /tmp/kernel.cu.orig $K
    python -m pytest verify/tests/test_sass.py -q -p no:cacheprovider -k $T 2>&1 | grep -E "passed|failed|^E +AssertionError" | tail -4
    cp /tmp/kernel.cu.orig $K
}
echo "=== as committed"
python -m pytest verify/tests/test_sass.py -q -p no:cacheprovider -k $T 2>&1 | tail -1
one the-divisions-back 's/const int bh = d.per_head(t), batch = d.heads(bh);/const int bh = t \/ tiles_per_head(p), batch = bh \/ p.heads;/; s/const int kv_head = divs.group(w.head);/const int kv_head = w.head \/ (p.heads \/ p.heads_k);/'
one logf-back 's/lg2_approx_ftz(l) \* LN2;/logf(l);/'
