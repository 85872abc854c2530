#!/bin/bash
# ncu with per-instruction stall sampling: step14 and step15 non-causal at 16x16x1024
python3 -c "from verify import steps; steps.build(['step14','step15'])" > $OUT/build.log 2>&1 || tail -20 $OUT/build.log
mkdir -p $OUT/keep
for impl in step14 step15; do
  timeout 120 ncu --clock-control none --profile-from-start off --section SourceCounters --section WarpStateStats \
    --section SchedulerStats --import-source no -f -o $OUT/$impl-1k python3 results/h200/2026-12-01-source-stalls/one.py $impl 0 16 16 1024 > $OUT/keep/$impl-1k.ncu.log 2>&1
  ncu -i $OUT/$impl-1k.ncu-rep --page source --csv --print-source sass > $OUT/keep/$impl-1k.source.csv
  ncu -i $OUT/$impl-1k.ncu-rep --page details --csv > $OUT/keep/$impl-1k.details.csv
  rm -f $OUT/$impl-1k.ncu-rep
done
cd $OUT && tar czf prof-1k.tgz keep && rm -rf keep
