#!/bin/bash
# The workspace test on the committed binding, then on two broken ones.
set -u
B=common/binding.py
cp $B /tmp/binding.py.orig
T="each_stream_has_a_workspace"
echo "=== as committed"
FLASHLADDER_STEPS=18 timeout 200 python3 -m pytest verify/tests/test_steps_gpu.py -q -p no:cacheprovider -k "$T" 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
for e in 's/key = (device.index, stream)/key = (device.index, 0)/' 's/if workspace_bytes is None or torch.cuda.is_current_stream_capturing():/if workspace_bytes is None:/'; do
    echo "=== $e"
    sed -i "$e" $B
    if cmp -s $B /tmp/binding.py.orig; then echo "PATCH DID NOT APPLY"; continue; fi
    FLASHLADDER_STEPS=18 timeout 200 python3 -m pytest verify/tests/test_steps_gpu.py -q -p no:cacheprovider -k "$T" 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
    cp /tmp/binding.py.orig $B
done
