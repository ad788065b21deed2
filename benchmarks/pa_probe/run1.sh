#!/bin/bash
# first device call: variant timings, then ncu attempts (baseline and new variant)
export PYTHONPATH=$PWD
out=${OUT:-/tmp/out}; mkdir -p $out
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
timeout 330 python3 benchmarks/pa_probe/variants.py 300 > $out/variants.txt 2>&1; echo "variants rc=$?"
cat $out/variants.txt
for v in "1 1 5"; do set -- $v
  PA_PROBE_QK16=$1 PA_PROBE_VSQ=$2 FLYDSL_BACKENDS_PA_TRITON_STAGES=$3 timeout 90 ncu --clock-control none \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    -k regex:pa_decode_partition -c 1 python3 benchmarks/pa_probe/ncu_one.py > $out/ncu_$1$2$3.txt 2>&1
  echo "ncu $v rc=$?"; grep -v "^==PROF==" $out/ncu_$1$2$3.txt | tail -60
done
