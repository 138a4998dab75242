#!/usr/bin/env bash
# The whole GPU check in one device call: build the CUDA backend on the GPU
# machine, run the GPU benchmark, run the GPU tests, and leave a log and a
# summary under $OUT. Meant for the device tool (one H100 or H200, 16 cores,
# Python 3.12, no network; see the team notes on the GPU machine), from the repo root:
#
#   run(command="NANOQ_COMMIT=<short hash> bash bench/gpu_check.sh", carry=[".device_wheels"], timeout_s=480)
#
# with <short hash> from `git rev-parse --short HEAD`. It needs nothing the
# machine lacks: the build and `import nanoq` use only its own packages
# (without scipy-openblas32 the cpu backend, the GPU tests' reference, runs
# nanoq's portable sgemm). A folder .device_wheels/ (ignored through
# .gitignore), named in the call as carry=[".device_wheels"], may add
# optional parts: each wheel in it whose package the machine lacks is
# installed (cython / scikit-build-core also when older than pyproject.toml
# asks), nothing the machine has is replaced. Useful ones (CPython 3.12,
# manylinux x86_64): scipy-openblas32 (OpenBLAS for the cpu backend),
# pytest-timeout (a per-test time limit, with stacks of a hung test) and
# nvidia-cudnn-frontend (the cuDNN frontend's headers: without them the cuda
# backend builds without cuDNN's fused attention):
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     -d .device_wheels scipy-openblas32 pytest-timeout nvidia-cudnn-frontend
#
# summary.txt says which optional parts the run went without.
#
# Every step runs under its own time limit inside an overall deadline
# (NANOQ_CHECK_DEADLINE seconds, default 450: with the machine's start the
# call stays near 8 minutes and a shorter rerun still fits the budget), and a
# failed step does not stop the later ones, so summary.txt is always written
# (after every step too: a call cut off at the device's limit still leaves one).
# Steps after the build, most valuable first: bench_0.5b (bench_gpu.py,
# Qwen2.5-0.5B at B=8: nanoq bf16, torch, nanoq fp8), which keeps time back
# for tests (pytest -m gpu, this GPU path's test files first); then bench_1.5b (the same at 1.5B), ops
# (bench_ops.py) and bench_llmq (llm.q's B=32 x 16 settings, both models),
# each with what is left. NANOQ_CHECK_STEPS picks steps for a rerun (below);
# NANOQ_BUILD_LIMIT (default 240 s) is for simulating the machine on fewer
# cores. Files under $OUT: gpu_check.log (everything), summary.txt,
# backends.json, pytest_gpu.log, pytest_gpu.xml (junit),
# bench_0.5b/ bench_1.5b/ bench_llmq/ (bench_gpu.json, bench_gpu.txt; the first two also
# trace_*.json.gz, the profiled steps),
# ops/ (bench_ops.json, bench_ops.txt), and wheels_added.txt when wheels
# were carried.
# Exit status: 0 when every step ran and passed (the wheels step may be skipped; a benchmark
# may be partial: its time limit skipped some of it, as summary.txt says), 1 otherwise.
set -euo pipefail

OUT=${OUT:-/tmp/nanoq_gpu_check}
PY=${PYTHON:-python3}
DEADLINE=${NANOQ_CHECK_DEADLINE:-450}
WHEELS=.device_wheels
STEPS=(environment wheels build backends bench_0.5b tests bench_1.5b ops bench_llmq)
# No network there: pip must not look for an index or a newer pip.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1
# Where packages go if the machine's Python environment refuses installs
# (then every later step puts it on PYTHONPATH).
FALLBACK_SITE=/tmp/nanoq_site
use_fallback_site() {
    if [[ -d $FALLBACK_SITE && :${PYTHONPATH:-}: != *:$FALLBACK_SITE:* ]]; then
        export PYTHONPATH=$FALLBACK_SITE${PYTHONPATH:+:$PYTHONPATH}
    fi
}
use_fallback_site
SCRIPT=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
mkdir -p "$OUT"
cd "$(dirname "$SCRIPT")/.."

declare -A STATUS DURATION
# NANOQ_CHECK_STEPS: the steps to run (names as in STEPS, space-separated;
# default all), e.g. for a rerun on a machine still warm from a first call:
# NANOQ_CHECK_STEPS="bench_1.5b ops bench_llmq" (nanoq stays installed there).
WANTED=${NANOQ_CHECK_STEPS:-all}
wanted() { [[ $WANTED == all || " $WANTED " == *" $1 "* ]]; }

# run_step NAME CAP RESERVE FUNCTION: runs FUNCTION (one of those below) in
# a fresh `bash $SCRIPT --step FUNCTION` under `timeout`, for at most CAP
# seconds and never into the RESERVE seconds kept for later steps before the
# deadline, though it always gets half of the time left (the limit is passed
# on as STEP_LIMIT); records its status ("ok", "failed (rc N)", "timed out
# after Ns", "skipped: ...") and duration.
run_step() {
    local name=$1 cap=$2 reserve=$3
    shift 3
    local left=$((DEADLINE - SECONDS - 20))
    ((reserve <= left / 2)) || reserve=$((left / 2))
    left=$((left - reserve))
    local limit=$((cap < left ? cap : left))
    echo
    echo "=== $name (limit ${limit}s, ${SECONDS}s elapsed) ==="
    if ! wanted "$name"; then
        skip_step "$name" "not in NANOQ_CHECK_STEPS ($WANTED)"
        return 0
    fi
    if ((limit < 30)); then
        skip_step "$name" "out of time (${limit}s left for it before the ${DEADLINE}s deadline)"
        return 0
    fi
    local start=$SECONDS rc=0
    if STEP_LIMIT=$limit timeout --kill-after=10 "$limit" bash "$SCRIPT" --step "$@"; then rc=0; else rc=$?; fi
    DURATION[$name]=$((SECONDS - start))
    case $rc in
        0) STATUS[$name]="ok" ;;
        # The benchmarks' EXIT_PARTIAL (bench_gpu.py): some ran, none failed, the time limit left
        # the rest out. (To pytest, 3 is an internal error.)
        3) if [[ $name == bench_* || $name == ops ]]; then
               STATUS[$name]="ok, partly: its time limit skipped some configurations or cases"
           else
               STATUS[$name]="failed (rc 3)"
           fi ;;
        124 | 137) STATUS[$name]="timed out after ${limit}s" ;;
        *) STATUS[$name]="failed (rc $rc)" ;;
    esac
    echo "=== $name: ${STATUS[$name]} in ${DURATION[$name]}s ==="
    # After every step, so that a call cut off at the device's limit still leaves one.
    write_summary >/dev/null 2>&1 || true
}

skip_step() {
    STATUS[$1]="skipped: $2"
    DURATION[$1]=0
    echo "=== $1: skipped: $2 ==="
}

environment() {
    nvidia-smi || echo "nvidia-smi failed"
    echo "nproc: $(nproc)"
    command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
    nvcc --version | tail -2 || echo "no nvcc on PATH"
    # What a plain `pip install .` (the Quickstart's, NANOQ_CUDA unset) decides here:
    # build_backend/nanoq_build.py's NVML and nvcc detection, which no CPU machine can try.
    env -u NANOQ_CUDA "$PY" -c "import os, sys; sys.path.insert(0, 'build_backend'); import nanoq_build as b; \
c = b.cuda_choice(os.environ); print('pip install . here:', c); \
print('  for CUDA architectures:', b.cuda_architectures(c.gpus, c.nvcc) or 'the default')" \
        || echo "the build backend's choice failed"
    "$PY" - <<'EOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "cupy-cuda13x", "numpy", "cython", "scikit-build-core", "cmake", "ninja",
             "pytest", "pytest-timeout", "nvidia-ml-py", "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-nccl-cu13",
             "cuda-pathfinder", "nvidia-cudnn-cu13", "nvidia-cudnn-frontend", "nvidia-cuda-nvrtc", "safetensors",
             "tokenizers", "click", "tqdm", "scipy-openblas32"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name}: NOT INSTALLED")
# cuDNN compiles its Hopper attention engines with NVRTC at run time: without it every plan is refused.
try:
    from cuda.pathfinder import load_nvidia_dynamic_lib
    print("nvrtc:", load_nvidia_dynamic_lib("nvrtc").abs_path)
except Exception as e:  # noqa: BLE001 - a report line, whatever failed
    print(f"nvrtc: NOT FOUND through cuda.pathfinder ({e}); cuDNN may still find the toolkit's")
import torch
print("torch.cuda:", torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count())
EOF
}

# The carried wheels whose package the machine lacks (cython and
# scikit-build-core also when older than pyproject.toml asks); the machine's
# own packages are never replaced.
install_wheels() {
    ls -l "$WHEELS"
    local wanted
    wanted=$("$PY" - "$WHEELS" <<'EOF'
import glob, importlib.metadata as md, os, re, sys
from packaging.version import Version
minimum = {"cython": "3.0", "scikit-build-core": "0.10"}
for wheel in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
    name = re.sub(r"[-_.]+", "-", os.path.basename(wheel).split("-")[0]).lower()
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is None or (name in minimum and Version(have) < Version(minimum[name])):
        print(f"{name}: installing the carried wheel (the machine has {have or 'none'})", file=sys.stderr)
        print(wheel)
    else:
        print(f"{name}: the machine has {have}; the carried wheel is not needed", file=sys.stderr)
EOF
)
    if [[ -z $wanted ]]; then
        echo "nothing to install"
        return 0
    fi
    # shellcheck disable=SC2086 # $wanted is a list of paths without spaces
    if ! "$PY" -m pip install --no-index --no-deps --no-cache-dir $wanted; then
        echo "installing into the environment failed: using --target $FALLBACK_SITE"
        "$PY" -m pip install --no-index --no-deps --no-cache-dir --target "$FALLBACK_SITE" $wanted
    fi
    local wheel
    for wheel in $wanted; do basename "$wheel"; done >"$OUT/wheels_added.txt"
}

build() {
    command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
    # scikit-build-core appends $CMAKE_ARGS to the CMake configure command;
    # one architecture (sm_90, H100/H200) halves the nvcc time, and, named,
    # the build backend asks NVML nothing (its reading is the environment
    # step's and the tests' to check, not the build's to depend on). The CUDA
    # emulator (its tests run in CI, not here) is left out: nothing the GPU
    # check runs needs it, and it is one build step fewer that could fail.
    local target=()
    if [[ -d $FALLBACK_SITE ]]; then target=(--target "$FALLBACK_SITE" --upgrade); fi
    CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DNANOQ_CUDA_EMULATOR=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) NANOQ_CUDA=ON \
        "$PY" -m pip install --no-index --no-build-isolation --no-deps --no-cache-dir -v "${target[@]}" .
}

# Fails unless the cuda backend is built and sees a GPU.
backends() {
    "$PY" - "$OUT/backends.json" <<'EOF'
import json, sys
import nanoq
report = nanoq.backends()
text = json.dumps(report, indent=1)
print(text)
open(sys.argv[1], "w").write(text + "\n")
cuda = next(b for b in report if b["name"] == "cuda")
sys.exit(0 if cuda["built"] and cuda["devices"] > 0 else 1)
EOF
}

# bench_gpu.py for one model: nanoq bf16, torch, nanoq fp8 at B=8, each
# trainer's process within half of the step's limit (less 30 s for the
# model's build; nanoq's first run on a GPU compiles cuDNN's plans, times
# cuBLASLt's algorithms and captures its graphs before its first timed step,
# so half rather than a third: a slow first trainer leaves the last one less,
# or none, within --time-limit), its own files under $OUT/bench_<model>/;
# then, in the budget each has left, two steps under torch.profiler: where
# the GPU time goes (bench_gpu.txt, and the traces trace_*.json.gz).
bench_model() {
    local model=$1 budget=$(((STEP_LIMIT - 30) / 2))
    "$PY" bench/bench_gpu.py --model "$model" --matmul-dtype bf16 fp8 --settings b8 --out "$OUT/bench_$model" \
        --budget "$budget" --time-limit $((STEP_LIMIT - 30)) --profile-steps 2
}
bench_05b() { bench_model 0.5b; }
bench_15b() { bench_model 1.5b; }

# llm.q's settings (B=32 x 16 micro-batches per step), both models, bf16 and
# fp8: the costliest figures (two warm-up steps and one timed step of 16
# micro-batches each, 80 s per trainer), so the last step; what does not fit
# its limit is recorded as skipped.
bench_llmq() {
    local budget=80
    "$PY" bench/bench_gpu.py --model 0.5b 1.5b --matmul-dtype bf16 fp8 --settings llmq --out "$OUT/bench_llmq" \
        --budget "$budget" --time-limit $((STEP_LIMIT - 40))
}

# Every op of the op table against PyTorch at the 0.5B shapes.
ops() {
    "$PY" bench/bench_ops.py --out "$OUT/ops" --time-limit $((STEP_LIMIT - 30))
}

# Test modules that import, at their top level, a package the machine lacks
# (directly or through another test module): "path<TAB>packages<TAB>what
# that costs" lines. They are left out of the run rather than failing its
# collection.
uncollectable() {
    "$PY" - <<'EOF'
import ast, importlib.util, pathlib
modules = {p.stem: p for p in pathlib.Path("tests").glob("*.py")}
# Folders of tests/ (helper packages such as processes/) import as pytest puts tests/ on the path.
local = {p.name for p in pathlib.Path("tests").iterdir() if p.is_dir()}
needs = {}
for stem, path in modules.items():
    tops = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    needs[stem] = tops
def missing(stem, seen=()):
    out = set()
    for top in needs[stem]:
        if top in modules:
            if top not in seen:
                out |= missing(top, seen + (stem,))
        elif top not in local and importlib.util.find_spec(top) is None:
            out.add(top)
    return out
for stem in sorted(modules):
    lacking = missing(stem)
    if stem.startswith("test_") and lacking:
        text = modules[stem].read_text()  # GPU tests: marked, or made by conftest's cuda_cases()
        cost = "its GPU tests did not run" if "mark.gpu" in text or "cuda_cases(" in text else "it has no GPU tests"
        print(f"{modules[stem]}\t{' '.join(sorted(lacking))}\t{cost}")
EOF
}

gpu_tests() {
    local extra=()
    # pytest-timeout's thread method dumps every stack and ends the run when
    # one test hangs (a hung kernel never returns to Python for a signal).
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then extra=(--timeout=120 --timeout-method=thread); fi
    local path packages cost left_out=" "
    while IFS=$'\t' read -r path packages cost; do
        echo "not collected: $path (needs $packages; $cost)"
        left_out+="$path "
    done < <(uncollectable)
    # The files of this GPU path first (cuDNN, fp8, graphs, training, the Quickstart's `nanoq train`), then the rest in name
    # order (pytest keeps the order of the files it is given): a run its time limit stops
    # has checked what only a GPU can check.
    local first=(test_fused_attention test_fp8 test_cuda_graphs test_gpu_training test_quickstart test_cublaslt test_gpu_options
                 test_build_backend test_classifier_chunks test_adamw_shard test_memory) files=() name
    for name in "${first[@]}"; do [[ ! -f tests/$name.py ]] || files+=("tests/$name.py"); done
    for path in tests/test_*.py; do
        [[ " ${files[*]} " == *" $path "* ]] || files+=("$path")
    done
    local collected=()
    for path in "${files[@]}"; do
        [[ $left_out == *" $path "* ]] || collected+=("$path")
    done
    # Unbuffered, so that pytest_gpu.log shows how far a run got that its time limit stopped.
    PYTHONUNBUFFERED=1 "$PY" -m pytest -m gpu -v -rfEs --durations=15 -p no:cacheprovider \
        --junitxml="$OUT/pytest_gpu.xml" --continue-on-collection-errors "${extra[@]}" "${collected[@]}" 2>&1 |
        tee "$OUT/pytest_gpu.log"
}

# What this run went without, one line each.
missing_parts() {
    "$PY" - <<'EOF'
import importlib.metadata, importlib.util
if importlib.util.find_spec("scipy_openblas32") is None:
    print("scipy-openblas32: the cpu backend (the GPU tests' reference) runs nanoq's portable sgemm")
if importlib.util.find_spec("pytest_timeout") is None:
    print("pytest-timeout: no per-test time limit (only the tests step's own)")
try:
    importlib.metadata.distribution("nvidia-cudnn-frontend")
except importlib.metadata.PackageNotFoundError:
    print("nvidia-cudnn-frontend: the cuda backend was built without cuDNN (native attention; cuDNN tests skip)")
EOF
    # The build's own word on cuDNN (CMake's notice: why it went without).
    grep -h -o "nanoq: building the cuda backend without cuDNN.*" "$OUT/gpu_check.log" 2>/dev/null | tail -1 |
        sed 's/^nanoq: /cuDNN: the build said: /' || true
    local path packages cost
    while IFS=$'\t' read -r path packages cost; do
        echo "$packages: $path not collected ($cost)"
    done < <(uncollectable)
}

write_summary() {
    {
        echo "nanoq GPU check"
        echo "commit: ${NANOQ_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
        echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
        echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo none)"
        echo "total: ${SECONDS}s (deadline ${DEADLINE}s)"
        echo "steps:"
        for step in "${STEPS[@]}"; do
            printf '  %-12s %s (%ss)\n' "$step:" "${STATUS[$step]:-not run}" "${DURATION[$step]:-0}"
        done
        echo "added from $WHEELS: $(paste -sd' ' "$OUT/wheels_added.txt" 2>/dev/null | grep . || echo nothing)"
        echo "ran without (optional parts the machine lacks; carry them in $WHEELS to add them):"
        missing_parts | sed 's/^/  /' | grep . || echo "  nothing"
        "$PY" - "$OUT/backends.json" <<'EOF' || echo "backends: no report"
import json, sys
for b in json.load(open(sys.argv[1])):
    state = f"{b['devices']} device(s)" if b["built"] else "not built"
    print(f"backend {b['name']}: {state}" + (f" - {b['detail']}" if b["detail"] else ""))
EOF
        "$PY" - "$OUT/pytest_gpu.xml" "$OUT/pytest_gpu.log" <<'EOF' || echo "tests: no report"
import collections, os, re, sys
import xml.etree.ElementTree as ET
xml_path, log_path = sys.argv[1:3]
outcomes, skips, fails = collections.Counter(), collections.Counter(), []
if os.path.exists(xml_path):
    root = ET.parse(xml_path).getroot()
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            outcomes["failed" if bad.tag == "failure" else "errors"] += 1
            fails.append(f"{name}: {(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}")
        elif skipped is not None:
            outcomes["skipped"] += 1
            skips[(skipped.get("message") or "").splitlines()[0][:160] if skipped.get("message") else ""] += 1
        else:
            outcomes["passed"] += 1
    source = ""
elif os.path.exists(log_path):  # stopped before pytest wrote its junit report: count its -v lines
    running = None
    for line in open(log_path, errors="replace"):
        m = re.match(r"(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)\b", line)
        if m:
            outcomes[{"FAILED": "failed", "ERROR": "errors"}.get(m[2], m[2].lower())] += 1
            if m[2] in ("FAILED", "ERROR"):  # (-v cuts skip reasons short: not listed)
                fails.append(m[1])
            running = None
        elif re.match(r"tests/\S+::\S+", line):
            running = line.split()[0]
    source = " (from pytest_gpu.log: pytest was stopped before its report" + (
        f"; running then: {running})" if running else ")")
else:
    print("tests: not run")
    sys.exit(0)
print("tests: " + ", ".join(f"{outcomes[k]} {k}" for k in ("passed", "failed", "errors", "skipped")) + source)
for fail in fails:
    print(f"  FAIL {fail}")
for reason, count in skips.most_common():
    print(f"  SKIP x{count}: {reason}")
EOF
        local part
        for part in bench_0.5b bench_1.5b bench_llmq; do
            echo "$part:"
            sed 's/^/  /' "$OUT/$part/bench_gpu.txt" 2>/dev/null || echo "  no $part/bench_gpu.txt"
        done
        echo "ops:"
        sed 's/^/  /' "$OUT/ops/bench_ops.txt" 2>/dev/null || echo "  no ops/bench_ops.txt"
    } >"$OUT/summary.txt"
    echo
    echo "=== summary ($OUT/summary.txt) ==="
    cat "$OUT/summary.txt"
}

main() {
    echo "nanoq GPU check, $(date -u), deadline ${DEADLINE}s, OUT=$OUT"
    rm -rf "$OUT"/{pytest_gpu.xml,pytest_gpu.log,backends.json,wheels_added.txt,bench_0.5b,bench_1.5b,bench_llmq,ops}
    run_step environment 30 0 environment
    if [[ -d $WHEELS ]]; then
        run_step wheels 60 0 install_wheels
        use_fallback_site
    else
        skip_step wheels "nothing carried (no $WHEELS folder; it is optional)"
    fi
    run_step build "${NANOQ_BUILD_LIMIT:-240}" 0 build
    # A build not asked for (a rerun) counts when nanoq is installed.
    local nanoq_ready=${STATUS[build]}
    if [[ $nanoq_ready == skipped:* ]] && "$PY" -c "import nanoq" 2>/dev/null; then nanoq_ready=ok; fi
    # The most valuable figures first: the 0.5B comparison (bf16, fp8,
    # torch), then the GPU tests (the benchmark keeps 150 s, at most half of
    # what is left, for them); the 1.5B comparison, the op benchmark and
    # llm.q's settings get what is left (all of it in a rerun that asks for
    # them alone).
    if [[ $nanoq_ready == ok ]]; then
        run_step backends 30 0 backends
        run_step bench_0.5b 150 150 bench_05b
        run_step tests 240 0 gpu_tests
    else
        skip_step backends "build failed"
        # The benchmarks run even when nanoq did not build: torch's figures still count.
        run_step bench_0.5b 150 0 bench_05b
        skip_step tests "build failed"
    fi
    run_step bench_1.5b 150 60 bench_15b
    if [[ $nanoq_ready == ok ]]; then
        run_step ops 90 0 ops
    else
        skip_step ops "build failed"
    fi
    run_step bench_llmq 240 0 bench_llmq
    write_summary
    local step
    for step in "${STEPS[@]}"; do  # only the optional wheels step and steps not asked for may be skipped
        [[ ${STATUS[$step]:-} == ok || ${STATUS[$step]:-} == "ok, partly"* ||
            ($step == wheels && ${STATUS[$step]:-} == skipped:*) ||
            ${STATUS[$step]:-} == "skipped: not in NANOQ_CHECK_STEPS"* ]] || return 1
    done
}

if [[ ${1:-} == --step ]]; then
    "$2"
    exit
fi
main 2>&1 | tee "$OUT/gpu_check.log"
