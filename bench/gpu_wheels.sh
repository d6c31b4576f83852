#!/usr/bin/env bash
# The wheels an offline GPU machine that has CuPy, PyTorch and pytest (a typical CUDA image) still lacks for
# gpt2np's fast path, downloaded here (online) for carrying there: nvtx (NVTX ranges), cupti-python (+ pyelftools:
# the profiler's device times), nvmath-python (cuBLASLt: GEMM epilogues, GEMMs in CUDA graphs).
#
#   bash bench/gpu_wheels.sh DIR [--python 3.12] [--dry-run]
#   # there: bash bench/gpu_acceptance.sh --wheels DIR   (installs what its preflight finds missing from DIR)
#
# Binary wheels only, for x86-64 Linux (manylinux) and the target's CPython (--python, default 3.12); without their
# dependencies (--no-deps: the image has cuda-bindings, cuda-core, cuda-pathfinder, numpy).
set -euo pipefail
DIR="" PYV=3.12 DRY=0
while [ $# -gt 0 ]; do
    case $1 in
        --python) PYV=${2:?--python needs a version, e.g. 3.12}; shift ;;
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
        *) DIR=$1 ;;
    esac
    shift
done
[ -n "$DIR" ] || { echo "error: give the folder to download into (see --help)" >&2; exit 2; }
[[ "$PYV" =~ ^3\.[0-9]+$ ]] || { echo "error: --python $PYV: a CPython version like 3.12" >&2; exit 2; }
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64; do
    PLATFORMS+=(--platform "$tag")
done
cmd=(python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp
     "${PLATFORMS[@]}" -d "$DIR" "nvtx>=0.2.12" "cupti-python>=13" "nvmath-python>=1.0,<2" pyelftools)
if [ "$DRY" = 1 ]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
mkdir -p "$DIR"
"${cmd[@]}"
ls -1 "$DIR"
