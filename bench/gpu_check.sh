#!/usr/bin/env bash
# The whole GPU check in one device call: build the CUDA backend on the GPU
# machine, run the GPU tests, run the GPU benchmark, and leave a log and a
# summary under $OUT. Meant for the device tool (one H200, 16 cores, Python
# 3.12, no network; see the team notes on the GPU machine), from the repo root:
#
#   run(command="NANOQ_COMMIT=<git rev-parse --short HEAD here> bash bench/gpu_check.sh",
#       carry=[".device_wheels"], timeout_s=480)
#
# .device_wheels/ is ignored through .git/info/exclude, so the call must name
# it in `carry`. It holds the wheels the machine lacks (for CPython 3.12,
# manylinux x86_64): scipy-openblas32 (needed to build and to import nanoq),
# plus cython and scikit-build-core, installed only when the machine's own
# are missing or older than pyproject.toml asks. Fetch them here with
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     -d .device_wheels scipy-openblas32 cython==3.3.1 scikit-build-core==1.1.2
#
# Every step runs under its own time limit inside an overall deadline
# (NANOQ_CHECK_DEADLINE seconds, default 450: with the machine's start the
# call stays near 8 minutes and a shorter rerun still fits the budget), and a
# failed step does not stop the later ones, so summary.txt is always written.
# Files under $OUT (flat): gpu_check.log (everything), summary.txt,
# pytest_gpu.xml (junit), bench_gpu.json, bench_gpu.txt.
# Exit status: 0 when every step passed, 1 otherwise.
set -euo pipefail

OUT=${OUT:-/tmp/nanoq_gpu_check}
PY=${PYTHON:-python3}
DEADLINE=${NANOQ_CHECK_DEADLINE:-450}
WHEELS=.device_wheels
# No network there: pip must not look for an index or a newer pip.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1
# Where packages go if the machine's Python environment refuses installs
# (then every later step puts it on PYTHONPATH).
FALLBACK_SITE=/tmp/nanoq_site
if [[ -d $FALLBACK_SITE ]]; then export PYTHONPATH=$FALLBACK_SITE${PYTHONPATH:+:$PYTHONPATH}; fi
SCRIPT=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
mkdir -p "$OUT"
cd "$(dirname "$SCRIPT")/.."

declare -A STATUS DURATION

# run_step NAME CAP_SECONDS FUNCTION: runs FUNCTION (one of those below) in a
# fresh `bash $SCRIPT --step FUNCTION` under `timeout`, with the smaller of
# CAP_SECONDS and the time left before the deadline (passed on as
# STEP_LIMIT); records its status ("ok", "failed (rc N)", "timed out after
# Ns", "skipped: ...") and duration.
run_step() {
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE - SECONDS - 20))
    local limit=$((cap < left ? cap : left))
    echo
    echo "=== $name (limit ${limit}s, ${SECONDS}s elapsed) ==="
    if ((limit < 30)); then
        STATUS[$name]="skipped: out of time"
        DURATION[$name]=0
        echo "skipped: only ${left}s left before the ${DEADLINE}s deadline"
        return 0
    fi
    local start=$SECONDS rc=0
    if STEP_LIMIT=$limit timeout --kill-after=10 "$limit" bash "$SCRIPT" --step "$@"; then rc=0; else rc=$?; fi
    DURATION[$name]=$((SECONDS - start))
    case $rc in
        0) STATUS[$name]="ok" ;;
        124 | 137) STATUS[$name]="timed out after ${limit}s" ;;
        *) STATUS[$name]="failed (rc $rc)" ;;
    esac
    echo "=== $name: ${STATUS[$name]} in ${DURATION[$name]}s ==="
}

skip_step() {
    STATUS[$1]="skipped: $2"
    DURATION[$1]=0
    echo
    echo "=== $1: skipped: $2 ==="
}

environment() {
    nvidia-smi || echo "nvidia-smi failed"
    echo "nproc: $(nproc)"
    command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
    nvcc --version | tail -2 || echo "no nvcc on PATH"
    "$PY" - <<'EOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "cupy-cuda13x", "numpy", "cython", "scikit-build-core", "cmake", "ninja",
             "pytest", "pytest-timeout", "nvidia-ml-py", "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-nccl-cu13",
             "cuda-pathfinder", "safetensors", "scipy-openblas32"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name}: NOT INSTALLED")
import torch
print("torch.cuda:", torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count())
EOF
}

install_wheels() {
    ls -l "$WHEELS"/*.whl
    local wanted
    # scipy-openblas32 always; cython / scikit-build-core only when missing or too old.
    wanted=$("$PY" - "$WHEELS" <<'EOF'
import glob, importlib.metadata as md, sys
from packaging.version import Version
minimum = {"cython": "3.0", "scikit-build-core": "0.10"}
wheels = [glob.glob(f"{sys.argv[1]}/scipy_openblas32-*.whl")[0]]
for name, least in minimum.items():
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is None or Version(have) < Version(least):
        print(f"{name} {have} < {least}: installing the carried wheel", file=sys.stderr)
        wheels += glob.glob(f"{sys.argv[1]}/{name.replace('-', '_')}-*.whl")
print(" ".join(wheels))
EOF
)
    # shellcheck disable=SC2086 # $wanted is a list of paths without spaces
    if ! "$PY" -m pip install --no-index --no-deps --no-cache-dir $wanted; then
        echo "installing into the environment failed: using --target $FALLBACK_SITE"
        "$PY" -m pip install --no-index --no-deps --no-cache-dir --target "$FALLBACK_SITE" $wanted
    fi
}

build() {
    command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
    # scikit-build-core appends $CMAKE_ARGS to the CMake configure command;
    # one architecture (sm_90, H100/H200) halves the nvcc time.
    local target=()
    if [[ -d $FALLBACK_SITE ]]; then target=(--target "$FALLBACK_SITE" --upgrade); fi
    CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90" CMAKE_BUILD_PARALLEL_LEVEL=16 NANOQ_CUDA=ON \
        "$PY" -m pip install --no-index --no-build-isolation --no-deps --no-cache-dir -v "${target[@]}" .
}

backends() {
    "$PY" -c "import json, nanoq; print(json.dumps(nanoq.backends(), indent=1))"
}

gpu_tests() {
    local extra=()
    # pytest-timeout's thread method dumps every stack and ends the run when
    # one test hangs (a hung kernel never returns to Python for a signal).
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then extra=(--timeout=120 --timeout-method=thread); fi
    # A test module whose CPU-only dependencies (peft, hypothesis) are missing
    # on the machine must not stop the GPU tests of the other modules.
    "$PY" -m pytest -m gpu -v -rfEs --durations=15 -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml" \
        --continue-on-collection-errors "${extra[@]}" tests
}

bench() {
    # Each trainer's process gets half of what is left after building the model.
    local worker_timeout=$(((STEP_LIMIT - 40) / 2))
    "$PY" bench/bench_gpu.py --out "$OUT" --worker-timeout "$worker_timeout"
}

write_summary() {
    {
        echo "nanoq GPU check"
        echo "commit: ${NANOQ_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
        echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
        echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo none)"
        echo "total: ${SECONDS}s"
        for step in environment wheels build backends tests bench; do
            printf '%-12s %s (%ss)\n' "$step:" "${STATUS[$step]:-not run}" "${DURATION[$step]:-0}"
        done
        "$PY" - "$OUT/pytest_gpu.xml" <<'EOF' || echo "tests: no junit report"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
print(f"tests: {passed} passed, {count['failures']} failed, {count['errors']} errors, {count['skipped']} skipped")
for suite in suites:
    for case in suite.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            message = (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else ""
            print(f"  FAIL {case.get('classname')}::{case.get('name')}: {message}")
EOF
        echo "bench:"
        sed 's/^/  /' "$OUT/bench_gpu.txt" 2>/dev/null || echo "  no bench_gpu.txt"
    } >"$OUT/summary.txt"
    echo
    echo "=== summary ($OUT/summary.txt) ==="
    cat "$OUT/summary.txt"
}

main() {
    echo "nanoq GPU check, $(date -u), deadline ${DEADLINE}s, OUT=$OUT"
    run_step environment 60 environment
    if [[ -d $WHEELS ]]; then
        run_step wheels 60 install_wheels
    else
        skip_step wheels "no $WHEELS folder (the call must carry it)"
    fi
    run_step build 240 build
    if [[ ${STATUS[build]} == ok ]]; then
        run_step backends 60 backends
        run_step tests 180 gpu_tests
    else
        skip_step backends "build failed"
        skip_step tests "build failed"
    fi
    # The benchmark runs even when nanoq did not build: torch's figures still count.
    run_step bench 200 bench
    write_summary
    for step in environment wheels build backends tests bench; do
        [[ ${STATUS[$step]:-} == ok ]] || return 1
    done
}

if [[ ${1:-} == --step ]]; then
    "$2"
    exit
fi
main 2>&1 | tee "$OUT/gpu_check.log"
