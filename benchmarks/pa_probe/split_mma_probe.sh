#!/usr/bin/env bash
# 2026-12-04 (third session). Two questions, one device call (repo root, GPU machine):
# 1. the queue kernel's split: more, shorter tasks (the FEW / programs-per-SM targets) at B=81/8k and
#    B=200/32k — a dynamic queue's tail is about one task, and a B=200 task is ~1500 tokens today;
# 2. Triton's MMA v2 (mma.sync, registers only; DISABLE_MMA_V3=1, a cache-invalidating Triton variable)
#    for the M = 64 decode program (ql 4) and the prefill program, which use wgmma (operand B staged
#    through shared memory after the FP8 -> FP16 widening).
# Settings: pps/warps/stages/bt[/few] (warps_probe.py). Output: one text stream.
set -u
w=benchmarks/pa_probe/warps_probe.py
PROBE_CONFIGS=0 PROBE_SETTINGS="default;32/1/5/16/12;32/1/5/16/16;32/1/5/16/24" timeout 90 python3 $w 70
PROBE_CONFIGS=1 PROBE_SETTINGS="default;48/1/5/16;64/1/5/16/64;96/1/5/16/96" timeout 110 python3 $w 90
DISABLE_MMA_V3=1 PROBE_CONFIGS=2 PROBE_SETTINGS="default;16/4/4/32;16/8/5/64" timeout 130 python3 $w 110
DISABLE_MMA_V3=1 SWEEP_CONFIGS= SWEEP_PREFILL_CONFIGS=0 SWEEP_PM=128,256 SWEEP_PBT=64 SWEEP_PWARPS=4,8 \
  SWEEP_PSTAGES=2 timeout 100 python3 benchmarks/sweep_pa_triton.py 80
