#!/usr/bin/env bash
# Every GPU check of memkernels in one command, for the first machine that has a GPU.
#
#   benchmarks/gpu_check.sh [RESULTS_FILE]        (default: gpu_check_results.txt)
#
# Needs a CUDA build of PyTorch and Triton already installed; no package index is used. The
# build requirements (setuptools, wheel, pybind11, ninja) come from wheels in
# $MEMKERNELS_WHEELS (default benchmarks/wheels; fill it elsewhere with
# `pip download -d benchmarks/wheels setuptools wheel pybind11 ninja`) unless already installed.
# Steps, all written to one results file:
#   1. build and install this working tree: pip install --no-build-isolation --no-deps
#   2. the test suite without the Triton interpreter: the kernels run on the GPU
#      (tests/backends.py puts the "triton" tests' tensors on CUDA), on $MEMKERNELS_GPU_CHECK_WORKERS
#      xdist workers (default 8): on the H200 the kernel test files alone ran past 4 minutes on 10
#      workers (Triton compiles every variant, the GEMMs autotune). Each failure is appended to
#      RESULTS_FILE.failures as it happens (MEMKERNELS_FAILURE_LOG): a lease that ends mid-run
#      loses pytest's summary, not the failures.
#   3. the allocator and offload tests with MEMKERNELS_DEVICE=cuda (the real CUDA runtime where a
#      test does not select the simulated device itself)
#   4. every benchmark: each GPU timing section prints the audit's model prediction at its own
#      shape under each measured time (gpu_audit.prediction_line); then the audit's full table
#      (python -m memkernels.tools.gpu_audit)
# Without a GPU it says so and exits 0. Exit status: the number of failed steps.
set -u
cd "$(dirname "$0")/.."
RESULTS=${1:-gpu_check_results.txt}
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU is visible to PyTorch on this machine, so there is nothing to check; exiting 0."
    echo "gpu_check: run benchmarks/gpu_check.sh on a machine with a GPU and put its figures in docs/kernels.md."
    exit 0
fi
unset TRITON_INTERPRET
failed=0
step() {  # step LABEL COMMAND...: run it, log it, count a failure
    echo
    echo "== $1: ${*:2}"
    "${@:2}" || { echo "== FAILED: $1"; failed=$((failed + 1)); }
}
{
    echo "memkernels gpu_check, $(date -u)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
    python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, torch.cuda.get_device_name())"
    WHEELS=${MEMKERNELS_WHEELS:-benchmarks/wheels}
    if [ -d "$WHEELS" ]; then
        step "build requirements" pip install --no-index --find-links "$WHEELS" setuptools wheel pybind11 ninja
    fi
    step "install" pip install --no-build-isolation --no-deps -e .
    export MEMKERNELS_FAILURE_LOG="$RESULTS.failures"
    : > "$MEMKERNELS_FAILURE_LOG"
    WORKERS=${MEMKERNELS_GPU_CHECK_WORKERS:-8}
    step "tests on the GPU" python -m pytest tests -q -p no:randomly -n "$WORKERS"
    step "allocator and offload on CUDA" env MEMKERNELS_DEVICE=cuda python -m pytest -q -p no:randomly -n "$WORKERS" \
        tests/test_allocator.py tests/test_allocator_install.py tests/test_offload.py tests/test_offload_engine.py
    for bench in benchmarks/bench_*.py; do
        step "$(basename "$bench")" python "$bench"
    done
    step "model prediction" python -m memkernels.tools.gpu_audit
    echo
    echo "gpu_check: $failed step(s) failed"
} 2>&1 | tee "$RESULTS"
echo "gpu_check: results in $RESULTS"
exit "$(grep -c '^== FAILED' "$RESULTS")"
