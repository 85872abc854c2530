#!/bin/bash
# ncu with per-instruction stall sampling: step14 and fa3 dense 2x16x8192, step15 and fa3 causal 4x16x8192
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-fa3/*.whl
export PYTHONPATH=/tmp/site
python3 -c "from verify import steps; steps.build(['step14','step15'])" > $OUT/build.log 2>&1 || tail -20 $OUT/build.log
run() { name=$1; shift
  timeout 120 ncu --clock-control none --profile-from-start off --section SourceCounters --section WarpStateStats \
    --section SchedulerStats --import-source no -f -o $OUT/$name python3 results/h200/2026-12-01-source-stalls/one.py "$@" > $OUT/$name.ncu.log 2>&1
  tail -3 $OUT/$name.ncu.log
  ncu -i $OUT/$name.ncu-rep --page source --csv --print-source sass > $OUT/$name.source.csv 2> $OUT/$name.source.err \
    || ncu -i $OUT/$name.ncu-rep --page source --csv > $OUT/$name.source.csv 2>> $OUT/$name.source.err
  ncu -i $OUT/$name.ncu-rep --page details --csv > $OUT/$name.details.csv 2>&1
  ls -la $OUT/$name.*; head -c 600 $OUT/$name.source.err
}
run s14 step14 0 2 16 8192
run fa3d fa3 0 2 16 8192
run s15c step15 1 4 16 8192
run fa3c fa3 1 4 16 8192
cd $OUT && mkdir -p keep && mv *.csv *.log *.err keep/ 2>/dev/null; tar czf prof.tgz keep && rm -rf keep; du -sh $OUT/*
