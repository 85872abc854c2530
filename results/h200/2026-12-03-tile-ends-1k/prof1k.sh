#!/bin/bash
# ncu with per-instruction stall sampling: step14, step19 and FA3 dense at 16x16x1024, one call each (run from the repository root on the GPU machine, FA3 installed)
python3 -c "from verify import steps; steps.build(['step14','step19'])" > $OUT/build.log 2>&1 || tail -20 $OUT/build.log
mkdir -p $OUT/keep
for impl in step14 step19 fa3; do
  timeout 150 ncu --clock-control none --profile-from-start off --section SourceCounters --section WarpStateStats \
    --section SchedulerStats --import-source no -f -o $OUT/$impl-1k python3 results/h200/2026-12-03-tile-ends-1k/one.py $impl 0 16 16 1024 > $OUT/keep/$impl-1k.ncu.log 2>&1
  ncu -i $OUT/$impl-1k.ncu-rep --page source --csv --print-source sass > $OUT/keep/$impl-1k.source.csv
  ncu -i $OUT/$impl-1k.ncu-rep --page source --csv --print-source cuda,sass > $OUT/keep/$impl-1k.cudasass.csv 2>$OUT/keep/$impl-1k.cudasass.err
  ncu -i $OUT/$impl-1k.ncu-rep --page details --csv > $OUT/keep/$impl-1k.details.csv
  rm -f $OUT/$impl-1k.ncu-rep
  echo "$impl done $(date +%T)"
done
cd $OUT && tar czf prof-1k.tgz keep && rm -rf keep
