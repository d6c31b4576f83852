#!/usr/bin/env bash
# The GPU acceptance of gpt2np in one command: every GPU check, each stage with its own log and time limit, a
# summary, and a non-zero exit when any stage failed.
#
#   bash bench/gpu_acceptance.sh                 # --quick (default): fits in ~8 minutes on an H100
#   bash bench/gpu_acceptance.sh --full          # longer runs (d12 parity, 200 training steps, 50 timed steps)
#   bash bench/gpu_acceptance.sh --out DIR --wheels /path/to/wheels --only compare_fp32,train
#   bash bench/gpu_acceptance.sh --dry-run       # print every stage's command, run nothing
#   bash bench/gpu_acceptance.sh --device emu    # a smoke of the stages that can run without a GPU (CPU emulator)
#
# Stages, in order (--only / --skip take their names, comma-separated):
#   preflight     what is there: CuPy with a usable GPU (gpt2np's cuda_problem line), torch with CUDA, NCCL,
#                 pytest, compute-sanitizer; nvidia-smi, versions, the git commit -> preflight.log
#   setup         synthetic token shards and model files (bench/gpu_acceptance.py setup): no data files needed
#   pytest_gpu    python -m pytest -m gpu
#   compare_fp32  python -m gpt2np compare --backend cuda, against the PyTorch reference, exact fp32
#   compare_tf32  the same with --precision tf32 (the TF32 tolerances)
#   compare_bf16  compare --precision bf16: gpt2np's bf16 against PyTorch fp32, within 1.5x the error of
#                 PyTorch autocast bf16 with llm.c's bf16 residual stream (docs/bf16.md)
#   train         python train.py -e d12 -b 4 -t 1024 --device cuda on the synthetic shards, -o train/
#   train_loss    the train loss in train/main.log falls (and stays finite)
#   gpu_step      bench/gpu_step.py: ms/step, tok/s, MFU, per-kernel table, PyTorch eager and torch.compile
#   gpu_step_bf16 the same in bf16 (--precision bf16; PyTorch under bf16 autocast), and at llm.c's B=64 (--full)
#   op_bench      bench/op_bench.py: bf16 LayerNorm backward alone at B=64 T=1024, its finish's threads a column and
#                 its most blocks tried (information: launch settings to tune, not a pass/fail on speed)
#   kernels       python -m gpt2np profile: the kernel table of one step (profile/ has CSV/JSON/trace)
#   plan_measure  python -m gpt2np profile --plan --measure: planned floor vs measured time per op
#   memcheck      compute-sanitizer --tool memcheck over one training step of a tiny model
#   racecheck     compute-sanitizer --tool racecheck over the same step
#   ncu           bench/ncu.sh (TIME_ONLY=1, d12 B=4 T=1024): Nsight Compute's time of every kernel of a step,
#                 attributed and set beside the built-in profiler's (ncu/ has the files)
#   ncu_agrees    the built-in (CUPTI) kernel times agree with ncu's: the step total and the median ratio within
#                 10%
#
# Offline: nothing is downloaded. A missing Python package makes the stages that need it SKIP with one line naming
# the wheel to bring (pip install --no-index --find-links WHEELS PACKAGE); with --wheels DIR the script installs
# them from that folder itself (pip --no-index). Results: DIR/ (default acceptance-YYYYmmdd-HHMMSS/): one log per
# stage, summary.txt and summary.json (PASS/FAIL/SKIP with a reason per stage). Exit status: 1 when any stage
# failed (with --strict: or was skipped), 0 otherwise; 2 on bad flags. Environment: PYTHON (default python),
# SANITIZER_ARGS (more compute-sanitizer options, e.g. "--report-api-errors no").
# The script can be sourced (tests do): then it only defines its functions.

ACC_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$ACC_DIR")
HELPER="$ACC_DIR/gpu_acceptance.py"
PY=${PYTHON:-python}
STAGES="preflight setup pytest_gpu compare_fp32 compare_tf32 compare_bf16 train train_loss gpu_step gpu_step_bf16 op_bench kernels plan_measure memcheck racecheck ncu ncu_agrees"

usage() { sed -n '2,/^# The script can be sourced/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

# ---- results -------------------------------------------------------------------------------------------------
acc_init() {        # acc_init DIR: the results folder and an empty stage table
    OUT=$1
    mkdir -p "$OUT" || { echo "error: cannot create $OUT" >&2; return 2; }
    OUT=$(cd "$OUT" && pwd)
    : > "$OUT/stages.tsv"
    ACC_T0=$SECONDS
}

acc_record() {      # acc_record NAME STATUS SECONDS REASON LOG COMMAND: one line of stages.tsv, one on stdout
    local name=$1 status=$2 secs=$3 reason=${4//$'\t'/ } log=$5 cmd=${6//$'\t'/ }
    reason=${reason//$'\n'/ }
    cmd=${cmd//$'\n'/ }
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "$reason" "$log" "$cmd" >> "$OUT/stages.tsv"
    printf '[%s] %-13s %-4s %5ss  %s\n' "$(date +%H:%M:%S)" "$name" "$status" "$secs" "${reason:-$log}"
}

acc_selected() {    # acc_selected NAME: whether --only/--skip let the stage run
    local name=$1
    if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then return 1; fi
    if [ -n "${SKIP_STAGES:-}" ] && [[ ",$SKIP_STAGES," == *",$name,"* ]]; then return 1; fi
    return 0
}

acc_skip() {        # acc_skip NAME REASON
    acc_selected "$1" || return 0
    acc_record "$1" SKIP 0 "$2" "" ""
}

acc_run() {         # acc_run NAME TIMEOUT CMD...: run CMD with its output in NAME.log; PASS on exit 0
    local name=$1 limit=$2
    shift 2
    acc_selected "$name" || return 0
    local cmd
    cmd=$(printf '%q ' "$@")
    cmd=${cmd% }
    if [ "${DRY_RUN:-0}" = 1 ]; then
        echo "$name: $cmd"
        acc_record "$name" SKIP 0 "dry run" "" "$cmd"
        return 0
    fi
    local left=$(( ${BUDGET:-100000} - (SECONDS - ACC_T0) ))
    if [ "$left" -lt 15 ]; then
        acc_record "$name" SKIP 0 "out of the time budget (--budget ${BUDGET}s)" "" "$cmd"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local log="$OUT/$name.log" t0=$SECONDS rc
    { echo "\$ $cmd"; echo "# stage $name, time limit ${limit}s, started $(date -u +%FT%TZ)"; } > "$log"
    ( cd "$REPO" && exec timeout --kill-after=10 "$limit" "$@" ) >> "$log" 2>&1 < /dev/null
    rc=$?
    local secs=$(( SECONDS - t0 ))
    echo "# exit status $rc after ${secs}s" >> "$log"
    if [ "$rc" = 0 ]; then
        acc_record "$name" PASS "$secs" "" "$name.log" "$cmd"
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        acc_record "$name" FAIL "$secs" "timed out after ${limit}s" "$name.log" "$cmd"
    else
        local last
        last=$(grep -v '^#' "$log" | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c1-200)
        acc_record "$name" FAIL "$secs" "exit status $rc: $last" "$name.log" "$cmd"
    fi
}

acc_finish() {      # acc_finish: summary.txt/summary.json; the exit status (1: a stage failed)
    "$PY" "$HELPER" summary "$OUT" || echo "warning: could not write the summary" >&2
    echo "results: $OUT"
    if grep -q $'\tFAIL\t' "$OUT/stages.tsv"; then return 1; fi
    if [ "${STRICT:-0}" = 1 ] && grep -v $'\tdry run\t' "$OUT/stages.tsv" | grep -q $'\tSKIP\t'; then return 1; fi
    return 0
}

# ---- the stages ----------------------------------------------------------------------------------------------
acc_find_sanitizer() {   # compute-sanitizer on PATH, else in the usual CUDA folders (then put on PATH)
    command -v compute-sanitizer >/dev/null 2>&1 && return 0
    local d
    for d in /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer /opt/nvidia/compute-sanitizer; do
        if [ -x "$d/compute-sanitizer" ]; then PATH="$d:$PATH"; export PATH; return 0; fi
    done
    return 1
}

acc_find_ncu() {         # Nsight Compute's ncu on PATH, else in the usual CUDA folders (then put on PATH)
    command -v ncu >/dev/null 2>&1 && return 0
    local d
    for d in /usr/local/cuda/bin /usr/local/cuda/nsight-compute /opt/nvidia/nsight-compute; do
        if [ -x "$d/ncu" ]; then PATH="$d:$PATH"; export PATH; return 0; fi
    done
    return 1
}

acc_preflight() {   # the tool checks -> CUDA_OK TORCH_OK TORCH_CPU_OK PYTEST_OK NCCL_OK SAN_OK NCU_OK (+ _WHY)
    local log="$OUT/preflight.log" t0=$SECONDS
    {
        echo "# gpt2np GPU acceptance, $(date -u +%FT%TZ), mode $MODE, device $DEVICE"
        echo "# git: $(git -C "$REPO" rev-parse HEAD 2>/dev/null) $(git -C "$REPO" status --porcelain 2>/dev/null | wc -l) changed files"
        echo "# python: $(command -v "$PY") $("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1)"
        command -v nvidia-smi >/dev/null && nvidia-smi 2>&1
        "$PY" -m pip list 2>/dev/null | grep -iE '^(cupy|torch|nvidia-|cupti|numpy|pytest|gpt2np)'
    } > "$log" 2>&1
    local checks
    checks=$("$PY" "$HELPER" preflight --device "$DEVICE" 2>>"$log") || checks="CUDA_OK=0; CUDA_WHY='the preflight check itself failed (see preflight.log)'; TORCH_OK=0; TORCH_WHY=\$CUDA_WHY; TORCH_CPU_OK=0; TORCH_CPU_WHY=\$CUDA_WHY; PYTEST_OK=0; PYTEST_WHY=\$CUDA_WHY; NCCL_OK=0; NCCL_WHY=\$CUDA_WHY; WHEELS_NEEDED="
    eval "$checks"
    if [ -n "${WHEELS_NEEDED:-}" ] && [ -n "${WHEELS:-}" ] && [ "${DRY_RUN:-0}" != 1 ]; then
        echo "\$ $PY -m pip install --no-index --find-links $WHEELS $WHEELS_NEEDED" >> "$log"
        # shellcheck disable=SC2086
        # with their dependencies where the folder has them, else the named wheels alone (a carried wheel's pins,
        # e.g. cupti-python's on nvidia-cuda-cupti, need not match what the machine has and works with)
        "$PY" -m pip install --no-index --find-links "$WHEELS" $WHEELS_NEEDED >> "$log" 2>&1 \
            || "$PY" -m pip install --no-index --no-deps --find-links "$WHEELS" $WHEELS_NEEDED >> "$log" 2>&1 \
            || echo "# pip could not install every wheel from $WHEELS" >> "$log"
        checks=$("$PY" "$HELPER" preflight --device "$DEVICE" 2>>"$log") && eval "$checks"
    fi
    if acc_find_sanitizer; then
        SAN_OK=1; SAN_WHY=""
        echo "# compute-sanitizer: $(command -v compute-sanitizer)" >> "$log"
    else
        SAN_OK=0; SAN_WHY="compute-sanitizer is not on PATH (nor in /usr/local/cuda/bin): it comes with the CUDA toolkit"
    fi
    if acc_find_ncu; then
        NCU_OK=1; NCU_WHY=""
        echo "# ncu: $(command -v ncu)" >> "$log"
    else
        NCU_OK=0; NCU_WHY="ncu (Nsight Compute) is not on PATH (nor in /usr/local/cuda/bin): it comes with the CUDA toolkit"
    fi
    echo "$checks" >> "$log"
    local missing=()
    [ "$CUDA_OK" = 1 ] || missing+=("GPU: $CUDA_WHY")
    [ "$TORCH_OK" = 1 ] || missing+=("PyTorch: $TORCH_WHY")
    [ "$PYTEST_OK" = 1 ] || missing+=("pytest: $PYTEST_WHY")
    [ "$NCCL_OK" = 1 ] || missing+=("NCCL: $NCCL_WHY")
    [ "${EXTRAS_OK:-1}" = 1 ] || missing+=("$EXTRAS_WHY")
    [ "$SAN_OK" = 1 ] || [ "$DEVICE" = emu ] || missing+=("$SAN_WHY")
    local bring=""
    if [ -n "${WHEELS_NEEDED:-}" ]; then
        bring="; bring wheels: pip install --no-index --find-links WHEELS $WHEELS_NEEDED (or --wheels DIR)"
    fi
    local what="" item
    for item in "${missing[@]}"; do what+="${what:+; }$item"; done
    if [ ${#missing[@]} = 0 ]; then
        acc_record preflight PASS $(( SECONDS - t0 )) "" preflight.log ""
    elif [ "$DEVICE" = emu ]; then
        acc_record preflight PASS $(( SECONDS - t0 )) "--device emu: no GPU checks${bring}" preflight.log ""
    elif [ "$CUDA_OK" = 1 ]; then          # the GPU works: the stages that need what is missing skip
        acc_record preflight PASS $(( SECONDS - t0 )) "GPU usable; missing: ${what}${bring}" preflight.log ""
    else
        acc_record preflight SKIP $(( SECONDS - t0 )) "missing: ${what}${bring}" preflight.log ""
    fi
}

acc_stages() {      # every stage after the preflight, by MODE (quick/full) and DEVICE (cuda/emu)
    local data="$OUT/data" full=() pyt
    [ "$MODE" = full ] && full=(--full)
    if [ "$DEVICE" = emu ]; then
        acc_run setup 300 "$PY" "$HELPER" setup "$data" "${full[@]}"
        acc_skip pytest_gpu "--device emu: the GPU tests need a GPU (python -m pytest runs the emulator tests)"
        if [ "$TORCH_CPU_OK" = 1 ]; then
            acc_run compare_fp32 300 "$PY" -m gpt2np compare -e "$data/tiny.bin" --backend emu -b 2 -t 32 --steps 2
            acc_run compare_tf32 300 "$PY" -m gpt2np compare -e "$data/tiny.bin" --backend emu -b 2 -t 32 --steps 2 \
                --precision tf32
            acc_run compare_bf16 300 "$PY" -m gpt2np compare -e "$data/tiny.bin" --backend emu -b 2 -t 32 \
                --precision bf16
        else
            acc_skip compare_fp32 "$TORCH_CPU_WHY"
            acc_skip compare_tf32 "$TORCH_CPU_WHY"
            acc_skip compare_bf16 "$TORCH_CPU_WHY"
        fi
        acc_run train 300 "$PY" train.py -e "$data/tiny.bin" -i "$data/train_*.bin" -j "$data/val_*.bin" \
            -b 4 -t 32 -x 20 -v 10 -m 2 -s 0 -l 3e-3 -o "$OUT/train" --device emu
        acc_run train_loss 60 "$PY" "$HELPER" loss-falls "$OUT/train/main.log" --min-drop 0.5
        acc_run gpu_step 300 "$PY" bench/gpu_step.py --runtime emu --model tiny -b 2 -t 8 --steps 1 --warmup 0 --top 10
        acc_run gpu_step_bf16 300 "$PY" bench/gpu_step.py --runtime emu --model tiny -b 2 -t 8 --steps 1 --warmup 0 \
            --top 10 --precision bf16
        acc_run op_bench 300 "$PY" bench/op_bench.py layernorm_backward --runtime emu -b 2 -t 8 -c 64 --reps 2 \
            --precision bf16 --set layernorm_finish_threads=1,32
        acc_run kernels 300 "$PY" -m gpt2np profile -e "$data/tiny.bin" -b 2 -t 16 --steps 1 \
            --device emu --out "$OUT/profile" --views gpu_activities,kernels
        acc_run plan_measure 300 "$PY" -m gpt2np profile -e "$data/tiny.bin" -b 2 -t 16 --plan --measure \
            --device emu --gpu H100 --out "$OUT/plan"
        acc_skip memcheck "--device emu: compute-sanitizer needs a GPU (the emulator's guard pages stand in: tests/test_emulator.py)"
        acc_skip racecheck "--device emu: compute-sanitizer needs a GPU (the emulator's reverse schedule stands in)"
        acc_skip ncu "--device emu: Nsight Compute needs a GPU"
        acc_skip ncu_agrees "--device emu: Nsight Compute needs a GPU"
        return
    fi

    local steps=20 gsteps=5 gwarm=2 pytest_limit=240 torch_modes=eager,compile
    if [ "$MODE" = full ]; then steps=200; gsteps=50; gwarm=5; pytest_limit=1200; fi
    acc_run setup 300 "$PY" "$HELPER" setup "$data" "${full[@]}"
    if [ "$CUDA_OK" != 1 ]; then
        local stage
        for stage in pytest_gpu compare_fp32 compare_tf32 compare_bf16 train train_loss gpu_step gpu_step_bf16 op_bench \
                     kernels plan_measure memcheck racecheck ncu ncu_agrees; do
            acc_skip "$stage" "no usable GPU: $CUDA_WHY"
        done
        return
    fi
    if [ "$PYTEST_OK" = 1 ]; then
        pyt=(-m gpu -q -rs -p no:cacheprovider)
        acc_run pytest_gpu "$pytest_limit" "$PY" -m pytest "${pyt[@]}"
    else
        acc_skip pytest_gpu "$PYTEST_WHY (bring it: pip install --no-index --find-links WHEELS pytest)"
    fi
    if [ "$TORCH_CPU_OK" = 1 ]; then      # the reference runs in PyTorch on the CPU: a CPU build is enough
        local cmp=("$PY" -m gpt2np compare -e "$data/small.bin" --backend cuda -b 4 -t 64 --steps 5)
        [ "$MODE" = full ] && cmp=("$PY" -m gpt2np compare -e "$data/small.bin" --backend cuda -b 4 -t 256 --steps 10)
        acc_run compare_fp32 600 "${cmp[@]}"
        acc_run compare_tf32 600 "${cmp[@]}" --precision tf32
        acc_run compare_bf16 600 "${cmp[@]}" --precision bf16
    else
        acc_skip compare_fp32 "$TORCH_CPU_WHY (bring it: pip install --no-index --find-links WHEELS torch)"
        acc_skip compare_tf32 "$TORCH_CPU_WHY (bring it: pip install --no-index --find-links WHEELS torch)"
        acc_skip compare_bf16 "$TORCH_CPU_WHY (bring it: pip install --no-index --find-links WHEELS torch)"
    fi
    acc_run train 600 "$PY" train.py -e d12 -i "$data/train_*.bin" -j "$data/val_*.bin" -b 4 -t 1024 \
        -x "$steps" -v 10 -m 2 -s 0 -o "$OUT/train" --device cuda
    acc_run train_loss 60 "$PY" "$HELPER" loss-falls "$OUT/train/main.log" --min-drop 1.0
    [ "$TORCH_OK" = 1 ] || torch_modes=none
    acc_run gpu_step 600 "$PY" bench/gpu_step.py --model d12 -b 4 -t 1024 --steps "$gsteps" --warmup "$gwarm" \
        --precision tf32 --torch "$torch_modes"
    local bf16_b=4
    [ "$MODE" = full ] && bf16_b=64                     # llm.c's usual d12 batch: its tokens/s is the yardstick
    acc_run gpu_step_bf16 600 "$PY" bench/gpu_step.py --model d12 -b "$bf16_b" -t 1024 --steps "$gsteps" \
        --warmup "$gwarm" --precision bf16 --torch "$torch_modes"
    acc_run op_bench 300 "$PY" bench/op_bench.py layernorm_backward -b 64 -t 1024 --precision bf16 \
        --set layernorm_max_blocks=512,1000000 --set layernorm_finish_threads=1,8,32
    if [ "$TORCH_OK" != 1 ]; then
        echo "# PyTorch side not run: $TORCH_WHY" >> "$OUT/gpu_step.log"
    fi
    acc_run kernels 300 "$PY" -m gpt2np profile -e d12 -b 4 -t 1024 --steps 1 --device cuda \
        --out "$OUT/profile" --views gpu_activities,kernels
    acc_run plan_measure 300 "$PY" -m gpt2np profile -e d12 -b 4 -t 1024 --plan --measure \
        --device cuda --out "$OUT/plan"
    if [ "$SAN_OK" = 1 ]; then
        local step=("$PY" train.py -e "$data/tiny.bin" -i "$data/train_*.bin" -j "$data/val_*.bin" -b 2 -t 32
                    -x 1 -v 0 -s 0 --device cuda)
        # SANITIZER_ARGS: more compute-sanitizer options for both, e.g. "--report-api-errors no"
        # shellcheck disable=SC2206
        local san=(compute-sanitizer ${SANITIZER_ARGS:-})
        acc_run memcheck 300 "${san[@]}" --tool memcheck --error-exitcode 99 --leak-check no "${step[@]}"
        acc_run racecheck 300 "${san[@]}" --tool racecheck --error-exitcode 99 "${step[@]}"
    else
        acc_skip memcheck "$SAN_WHY"
        acc_skip racecheck "$SAN_WHY"
    fi
    if [ "${NCU_OK:-0}" = 1 ]; then
        # kernel times only (one ncu pass a kernel), eager launches, ncu's clocks unlocked: see bench/ncu.sh
        acc_run ncu 420 env PYTHON="$PY" TIME_ONLY=1 MODEL=d12 B=4 T=1024 OUT="$OUT/ncu" bash "$ACC_DIR/ncu.sh"
        acc_run ncu_agrees 60 "$PY" "$HELPER" ncu-agrees "$OUT/ncu.log" --tolerance 0.10
    else
        acc_skip ncu "${NCU_WHY:-ncu not found}"
        acc_skip ncu_agrees "${NCU_WHY:-ncu not found}"
    fi
}

acc_main() {
    MODE=quick DEVICE=cuda OUT_DIR="" WHEELS="" DRY_RUN=0 STRICT=0 ONLY="" SKIP_STAGES="" BUDGET=""
    while [ $# -gt 0 ]; do
        case $1 in
            --quick) MODE=quick ;;
            --full) MODE=full ;;
            --out) OUT_DIR=${2:?--out needs a folder}; shift ;;
            --wheels) WHEELS=${2:?--wheels needs a folder}; shift ;;
            --device) DEVICE=${2:?--device needs cuda or emu}; shift ;;
            --only) ONLY=${2:?--only needs stage names}; shift ;;
            --skip) SKIP_STAGES=${2:?--skip needs stage names}; shift ;;
            --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
            --dry-run) DRY_RUN=1 ;;
            --strict) STRICT=1 ;;
            -h|--help) usage; return 0 ;;
            *) echo "error: unknown argument $1 (see --help)" >&2; return 2 ;;
        esac
        shift
    done
    case $DEVICE in cuda|emu) ;; *) echo "error: --device $DEVICE: cuda or emu" >&2; return 2 ;; esac
    local name
    for name in ${ONLY//,/ } ${SKIP_STAGES//,/ }; do
        [[ " $STAGES " == *" $name "* ]] || { echo "error: unknown stage $name (stages: $STAGES)" >&2; return 2; }
    done
    if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then echo "error: --wheels $WHEELS is not a folder" >&2; return 2; fi
    [[ "$BUDGET" =~ ^[0-9]*$ ]] || { echo "error: --budget $BUDGET: seconds" >&2; return 2; }
    if [ -z "$BUDGET" ]; then if [ "$MODE" = quick ]; then BUDGET=540; else BUDGET=100000; fi; fi
    [ -n "$WHEELS" ] && WHEELS=$(cd "$WHEELS" && pwd)
    acc_init "${OUT_DIR:-acceptance-$(date +%Y%m%d-%H%M%S)}" || return 2
    "$PY" - "$OUT/meta.json" "$MODE" "$DEVICE" "$REPO" <<'PY' 2>/dev/null
import json, subprocess, sys, time
path, mode, device, repo = sys.argv[1:]
try:
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    commit = ""
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.SubprocessError):
    gpu = ""
json.dump({"mode": mode, "device": device, "gpu": gpu or "none seen", "commit": commit,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, open(path, "w"), indent=2)
PY
    echo "gpt2np GPU acceptance ($MODE, --device $DEVICE), results in $OUT"
    if [ "$DRY_RUN" = 1 ]; then            # print every stage's command as on a machine with everything
        CUDA_OK=1 TORCH_OK=1 TORCH_CPU_OK=1 PYTEST_OK=1 NCCL_OK=1 SAN_OK=1 NCU_OK=1
        acc_record preflight SKIP 0 "dry run" "" ""
    else
        acc_preflight
    fi
    acc_stages
    acc_finish
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    acc_main "$@"
    exit $?
fi
