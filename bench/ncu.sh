#!/usr/bin/env bash
# One training step under Nsight Compute, NVTX-filtered to that step, attributed to layer, op and direction,
# and compared with the built-in profiler's kernel times of the same step.
#
#   bench/ncu.sh                       # d12, B=4, T=64, step 1, into ./ncu_d12
#   MODEL=d12 B=8 T=1024 OUT=ncu_big SET=full bench/ncu.sh
#   PYTHON=python3 CLOCK_CONTROL=base bench/ncu.sh
#   TIME_ONLY=1 bench/ncu.sh           # kernel times only: one ncu pass per kernel
#
# Needs ncu (Nsight Compute) on PATH, a GPU and the cuda extra. Writes:
#   $OUT/builtin/      the built-in profile of steps 0 (warm-up) and 1 (profile.json: kernel order, FLOPs, modules)
#   $OUT/step.ncu-rep  ncu's report of step 1 (NVTX range "Train step 1" of train.py)
#   $OUT/step.csv      the same as CSV (ncu --import ... --csv --page raw)
#   $OUT/kernels.csv   every kernel with step, direction, layer, op, module, ncu's metrics (python -m gpt2np.cli.ncu)
set -euo pipefail
MODEL=${MODEL:-d12}
B=${B:-4}
T=${T:-64}
OUT=${OUT:-ncu_${MODEL}}
SET=${SET:-}                 # empty: the metrics below; "full": ncu's full section set as well
NCU=${NCU:-ncu}
PY=${PYTHON:-python}
# ncu locks the GPU to its base clocks by default; the built-in profile runs at the GPU's own clocks, so the
# comparison uses --clock-control none (CLOCK_CONTROL=base for ncu's reproducible, slower times)
CLOCK_CONTROL=${CLOCK_CONTROL:-none}
command -v "$NCU" >/dev/null || { echo "error: $NCU (Nsight Compute CLI) is not on PATH" >&2; exit 2; }
mkdir -p "$OUT"

# 1. the built-in profile of the same configuration (its step 1 is the kernel sequence ncu will see)
"$PY" -m gpt2np.cli.profile -e "$MODEL" -b "$B" -t "$T" --steps 1 --device cuda --out "$OUT/builtin" \
    --views phases,gpu_activities

# 2. ncu on train.py, kernels inside the push/pop range "Train step 1" only (step 0 is the warm-up); eager launches
#    as in the built-in profile (inside a captured graph cuBLAS picks other GEMM kernels, and the sequences differ)
METRICS=gpu__time_duration.sum,dram__bytes.sum,dram__bytes_read.sum,dram__bytes_write.sum
METRICS+=,sm__sass_thread_inst_executed_op_fadd_pred_on.sum,sm__sass_thread_inst_executed_op_fmul_pred_on.sum
METRICS+=,sm__sass_thread_inst_executed_op_ffma_pred_on.sum,sm__warps_active.avg.pct_of_peak_sustained_active
METRICS+=,sm__throughput.avg.pct_of_peak_sustained_elapsed
METRICS+=,gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size
# TIME_ONLY=1: gpu__time_duration alone (one pass per kernel, no replays: minutes faster on a d12 step)
if [ "${TIME_ONLY:-0}" = 1 ]; then METRICS=gpu__time_duration.sum; fi
EXTRA=()
if [ "$SET" = full ]; then EXTRA=(--set full); fi
"$NCU" --nvtx --nvtx-include "Train step 1/" --metrics "$METRICS" "${EXTRA[@]}" --target-processes all \
    --clock-control "$CLOCK_CONTROL" -o "$OUT/step" -f \
    "$PY" train.py -e "$MODEL" -b "$B" -t "$T" -x 2 -v 0 -s 0 --device cuda --cuda-graphs 0

# 3. CSV, and the attribution (aligned with the built-in profile's step 1)
"$NCU" --import "$OUT/step.ncu-rep" --csv --page raw --print-units base > "$OUT/step.csv"
"$PY" -m gpt2np.cli.ncu "$OUT/step.csv" --records "$OUT/builtin/profile.json" --step 1 \
    --csv "$OUT/kernels.csv" --json "$OUT/kernels.json"
