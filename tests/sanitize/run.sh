#!/usr/bin/env bash
# Runs tests against a build of nanoq instrumented with sanitizers; any
# sanitizer report fails the run (non-zero exit).
#
#   tests/sanitize/run.sh address [PYTEST ARGS...]
#       AddressSanitizer + UndefinedBehaviorSanitizer (+ LeakSanitizer for
#       nanoq's own allocations); by default the whole suite (but the
#       end-to-end runs and reports deselected below), in one test
#       process per core (pytest -n auto): first the tests not marked
#       cuda_emulated, then those (the cuda backend's host code and every
#       kernel on the CUDA emulator, whose fiber switches it announces to
#       ASan, and whose device buffers' canaries it poisons, so that a
#       kernel's read or write past a buffer's end is reported at the access).
#   tests/sanitize/run.sh thread [PYTEST ARGS...]
#       ThreadSanitizer on the worker pool, the shared-memory communicator and
#       the trainer's hand-offs; by default test_worker_pool, test_equivalence
#       (1, 2 and 4 devices; not its float32 counting test, below), test_zero
#       and the other defaults below, also under pytest -n auto.
#
# PYTEST ARGS, when given, replace the default test selection (under
# address, its cuda_emulated tests still run apart, as in the default run,
# unless the arguments hold a -m of their own).
# The instrumented build goes to build/sanitize-<kind>/ (pip --target) and is
# put first on PYTHONPATH for the test run only, so the normal install stays as
# it is. Needs the build requirements in this Python (pip install
# scikit-build-core cython scipy-openblas32 cmake ninja) and the test extra.
#
# Why the environment below:
# - Python is not instrumented, so the sanitizer runtime is preloaded, together
#   with libstdc++: ASan/TSan intercept __cxa_throw by looking up the real one
#   when they start, and python does not link libstdc++, so without it the
#   first C++ exception aborts with "CHECK failed: real___cxa_throw".
# - Reports abort the process (halt_on_error, and the build's
#   -fno-sanitize-recover=all). ASan, LSan and TSan also write them to
#   build/sanitize-<kind>/reports/ (log_path), so that one raised in a
#   subprocess of a test, or in a test that expects a failure, is still seen;
#   UBSan (which ignores log_path when combined with ASan) reports on stderr,
#   kept in each run's console log (reports/tests.log, reports/emulated.log).
#   The run fails if pytest fails or if any of these holds an error, a data
#   race, UB, or a leak allocated by nanoq's code.
# - Leaks: CPython does not free everything at exit, and its own leaks are not
#   ours, so leaks count only when their allocation stack is in
#   libnanoq_core.so, libnanoq_cuda_emulated.so or the nanoq._core and
#   nanoq._ops extensions.
#   PYTHONMALLOC=malloc puts Python objects on the malloc heap, where LeakSanitizer sees the references
#   they hold to nanoq's objects. Leak checks run at exit and never change the
#   exit code (LSAN_OPTIONS=exitcode=0); this script judges them.
# - intercept_tls_get_addr=0: LeakSanitizer's at-exit tracer can crash while
#   walking the dynamic TLS blocks of dlopen'ed libraries (Python's extensions,
#   OpenBLAS, MPICH), which aborts a process whose work had succeeded (seen in
#   CI in mpiexec-launched test processes; the sanitizer project's issue 1322
#   names this flag as the cure). The cost is that pointers held only in
#   dynamic TLS are not scanned. Only the CUDA emulator has thread_local
#   objects; those that own memory (a stream worker's block runner and fiber
#   stacks, error texts) die with their thread, which a stream's destruction
#   joins.
# - ThreadSanitizer with OpenMP: GCC's libgomp is not built with TSan, so TSan
#   cannot see the synchronisation inside its barriers and reports every
#   parallel loop's hand-off as a race (seen on the first test).
#   OMP_THREAD_LIMIT=1 (which, unlike OMP_NUM_THREADS, also caps the core's
#   num_threads clauses) runs each parallel loop on its device's worker thread,
#   so what TSan checks is our synchronisation: the worker pool, the
#   communicator and the trainer's calls. No suppressions are needed.
set -euo pipefail
cd "$(dirname "$0")/../.."

kind=${1:-}
shift || true
case "$kind" in
  address)
    sanitizers=address,undefined
    runtime=libasan.so
    default_tests=(tests)
    # The cuda backend's code and kernels on the CUDA emulator, in a run of
    # their own (see run_tests below): every kernel and op, and one training
    # run per host path (graphs at ZeRO 2 and 3, two devices, offload, LoRA,
    # fp8, cuDNN's stand-in), without the long runs that repeat them over
    # more steps, stages, shapes or dtypes (under ASan, on two cores, the
    # emulated tests but the first ten of these and four of the options
    # test's five cases took 9.6 minutes: all of them would take some 18, far
    # past CI's budget).
    long_runs=(test_fp32_and_bf16_match_cpu_at_realistic_head_dims
      test_bf16_losses_track_fp32_cpu_and_fall_on_a_learnable_batch test_fp32_ten_adamw_steps_match_cpu
      test_two_identical_runs_are_bitwise_identical test_two_devices_match_one_at_every_stage
      test_stage_three_is_bitwise_stage_two_on_cuda test_cuda_reductions_overlap_the_backward_and_change_no_bit
      test_the_fp8_weight_cache_trains_bitwise_like_quantizing_every_call
      test_forward_maxima_train_bitwise_like_weight_gradients_taking_their_own
      test_producer_maxima_train_bitwise_like_quantizations_taking_their_own
      test_options_on_cuda_match_cpu test_fp32_packed_and_bidirectional_steps_match_cpu
      test_bf16_master_weights_and_bf16_adam_state_train test_cuda_chunk_grows_into_the_device_memory_and_the_plan_knows_it
      test_planning_builds_each_shapes_plans_once_per_process test_packed_training_runs_fused_with_packed_documents
      test_tuned_training_is_bitwise_untuned_training test_cuda_steps_are_queued_and_match_waiting_after_every_step
      test_wide_mlp_bias_gradients_match_cpu)
    # And the runs of the training loop or the CLI on the emulator whose point is what they report (the
    # attention or the packing they name, the demo's command, the op benchmark's table): their calls into the
    # core are those of the training tests above (together 61 of the emulated tests' 830 process-seconds
    # under ASan).
    long_runs+=(test_training_run_says_which_attention_it_uses test_a_packed_training_run_runs_its_documents_fused_and_says_so
      test_nanoq_train_on_the_demo_runs_on_the_cuda_backend test_smoke_on_the_emulated_cuda_backend_times_every_case)
    skipped_runs="(test_captured_steps_train_bitwise_like_uncaptured_ones and (1-device-recompute or zero1-lora))"
    for name in "${long_runs[@]}"; do skipped_runs+=" or $name"; done
    emulated_tests=(tests -k "not ($skipped_runs)")
    # The emulator's canary test: ASan reports that overrun itself (checked below).
    deselect=(--deselect "tests/test_cuda_emulated.py::test_faults_are_launch_errors_naming_the_problem[global_overrun]")
    # The benchmark script's end-to-end runs (torch beside nanoq, in
    # subprocesses) and gpu_check.sh's summary: what they check is the
    # scripts' reports, and the nanoq calls they make are the training tests'
    # (under ASan the three runs took 94 of the CPU tests' 610
    # process-seconds; the rest of their file still runs).
    cpu_deselect=()
    for name in test_smoke_run_end_to_end_on_the_cpu test_a_setting_that_does_not_fit_runs_in_smaller_micro_batches \
                test_profiled_smoke_run_reports_profiles_and_keeps_traces test_gpu_check_summary_lists_every_step; do
      cpu_deselect+=(--deselect "tests/test_bench_gpu.py::$name")
    done
    # Tests of what the Python layer and the CLI say and do, whose calls into
    # the core the other tests make too: the suite's own setup (a pytest run
    # in a subprocess), the README's Python example and the demo's
    # preparation, the CLI's interrupt message and its settings' plumbing,
    # the demo's samples, and the memory estimator's search of every lightest
    # setting (under ASan, together 150 of these tests' 625 process-seconds).
    for test in test_suite_setup.py::test_the_suite_loads_without_pytest_xdist \
                test_readme.py::test_the_readmes_python_example_runs_as_written \
                test_readme.py::test_the_readmes_python_example_under_mpiexec_trains_like_one_process_of_two_devices \
                test_readme.py::test_prepare_reuses_its_own_demo_tokenization_so_the_python_example_can_run_again \
                test_readme.py::test_prepare_refuses_a_directory_that_does_not_hold_its_demo_tokenization \
                test_cli.py::test_an_interrupt_says_whether_there_is_a_checkpoint_to_resume \
                test_cli.py::test_recompute_and_offload_settings_reach_the_trainer_and_change_nothing_but_memory \
                test_samples.py::test_the_demo_shows_samples_of_text_from_an_eval_play \
                test_memory.py::test_nothing_fits_names_the_lightest_setting_the_estimator_finds; do
      cpu_deselect+=(--deselect "tests/$test")
    done
    ;;
  thread)
    sanitizers=thread
    runtime=libtsan.so
    # The CUDA emulator switches stacks by hand (fibers) and does not tell
    # ThreadSanitizer: the TSan build leaves it out, and its tests go.
    deselect=(-m "not cuda_emulated")
    # The float32 counting test (17 micro-batches of 2^20 tokens on one device, one thread: nothing of
    # the pool's or the communicator's hand-offs that the other tests do not make) took 99 of the
    # selection's 150 process-seconds under TSan.
    cpu_deselect=(--deselect tests/test_equivalence.py::test_token_count_and_mean_loss_stay_exact_past_2_pow_24_tokens_per_step)
    emulated_tests=()
    default_tests=(tests/test_worker_pool.py tests/test_equivalence.py tests/test_zero.py tests/test_async_steps.py
                   tests/test_comm_overlap.py tests/test_topology.py)
    ;;
  *)
    echo "usage: $0 address|thread [pytest arguments]" >&2
    exit 2
    ;;
esac
# The default selection runs in one test process per core (pytest-xdist's -n
# auto, as the README's test command): each process is instrumented alike and
# writes its own reports (log_path adds the pid).
args=("$@")

root=$PWD/build/sanitize-$kind
target=$root/install
reports=$root/reports
cxx=${CXX:-c++}

start=$SECONDS
echo "== sanitize $kind: building nanoq with -fsanitize=$sanitizers into $target"
rm -rf "$target" "$reports"
mkdir -p "$reports"
NANOQ_CUDA=OFF NANOQ_SANITIZE=$sanitizers pip install --no-build-isolation --no-deps --quiet \
  --target "$target" -Cbuild-dir="$root/cmake" -Cinstall.strip=false .
echo "== sanitize $kind: built in $((SECONDS - start)) s"

# The interpreter itself, not a wrapper such as a pyenv shim (a shell script
# whose helpers would run with the sanitizer preloaded).
python=$(python -c 'import sys; print(sys.executable)')
preload="$("$cxx" -print-file-name="$runtime") $("$cxx" -print-file-name=libstdc++.so)"
common=halt_on_error=1:abort_on_error=1:print_stacktrace=1
asan_options="$common:detect_leaks=1:detect_stack_use_after_return=1:intercept_tls_get_addr=0:log_path=$reports/asan"
sanitizer_env=(
  PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
  LD_PRELOAD="$preload"
  PYTHONMALLOC=malloc
  ASAN_OPTIONS="$asan_options"
  LSAN_OPTIONS=exitcode=0
  UBSAN_OPTIONS="$common"
  TSAN_OPTIONS="$common:second_deadlock_stack=1:log_path=$reports/tsan"
)
if [ "$kind" = thread ]; then sanitizer_env+=(OMP_THREAD_LIMIT=1); fi

# The instrumented build, not the normal install, must be the one imported.
env "${sanitizer_env[@]}" "$python" -c "
import nanoq, nanoq._ops
for module in (nanoq._core, nanoq._ops):
    assert module.__file__.startswith('$target/'), f'imported {module.__file__}, not the sanitizer build in $target'
maps = open('/proc/self/maps').read()
assert '$runtime'.removesuffix('.so') in maps, 'the sanitizer runtime is not loaded'
"

# Under ASan the emulator's device buffers are instrumented: the 4 KiB of
# canaries after each one are poisoned, so a kernel that reads or writes one
# int past a buffer's end (emulator/selftest.cpp) must be reported by
# AddressSanitizer (as a "use-after-poison"), at the access, in the kernel's
# code. These reports go to files of their own, which the judgement below
# does not read.
if [ "$kind" = address ]; then
  for fault in global_overread:READ global_overrun:WRITE; do
    name=${fault%%:*} access=${fault##*:}
    log=$root/deliberate-$name
    rm -f "$log".*
    set +e
    env "${sanitizer_env[@]}" ASAN_OPTIONS="$common:detect_leaks=0:log_path=$log" "$python" -c "
import ctypes, os, numpy as np, nanoq
nanoq.backends()
lib = ctypes.CDLL(os.path.join(os.path.dirname(nanoq._core.__file__), 'libnanoq_cuda_emulated.so'))
out, message = np.zeros(64, np.int32), ctypes.create_string_buffer(512)
lib.nanoq_emu_selftest(b'$name', 1, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int)), 64, message, 512)
" >/dev/null 2>&1
    fault_status=$?
    set -e
    if [ "$fault_status" -eq 0 ] || ! grep -qs "ERROR: AddressSanitizer: use-after-poison" "$log".* ||
       ! grep -qs "$access of size 4" "$log".* || ! grep -qs "${name}_kernel" "$log".*; then
      echo "== sanitize address: the emulator's $name kernel was not reported as a use-after-poison $access" \
           "in ${name}_kernel (exit $fault_status); its log:" >&2
      cat "$log".* >&2 2>/dev/null || echo "(no report written)" >&2
      exit 1
    fi
    echo "== sanitize address: AddressSanitizer reported the emulated kernel's deliberate $name ($access past the end)"
  done
fi

# run_tests LABEL ENV... -- PYTEST ARGS...: one pytest run under the
# sanitizer environment (with ENV added), its console in reports/LABEL.log;
# adds its failure to $status.
# --capture=sys: pytest captures what Python writes but not what the sanitizer
# runtimes write to file descriptor 2, which would otherwise be lost when a
# report aborts the process. The console log is scanned for reports too.
#
# LeakSanitizer's own at-exit tracer sometimes crashes ("Tracer caught signal
# 11 ... LeakSanitizer has encountered a fatal error", seen in a fresh venv),
# which aborts a process whose tests all passed. That is no finding about
# nanoq: accept it with a warning when pytest reported no failure. Every other
# report is still judged below.
# The same crash in a test's subprocess (an mpiexec-launched process that
# finished its work) fails that test: when the reports hold the crash, the
# failed tests run once more, and their second result is the one judged.
status=0
run_tests() {
  local label=$1 extra=() run_status failed_tests summary started=$SECONDS
  shift
  while [ "$1" != -- ]; do extra+=("$1"); shift; done
  shift
  local console="$reports/$label.log"
  set +e
  env "${sanitizer_env[@]}" "${extra[@]}" "$python" -m pytest -q -p no:cacheprovider --capture=sys "$@" 2>&1 |
    tee "$console"
  run_status=${PIPESTATUS[0]}
  set -e
  echo "== sanitize $kind: $label ran in $((SECONDS - started)) s (pytest exit $run_status)"
  # One part of a split selection (below) may hold none of its tests: judged after both parts.
  if [ "$run_status" -eq 5 ] && [ -n "${empty_ok:-}" ]; then
    echo "== sanitize $kind: $label: the selection has no tests here"
    empty_parts=$((empty_parts + 1))
    run_status=0
  fi
  failed_tests=$(sed -n 's/^FAILED \([^ ]*\).*/\1/p' "$console" | sort -u)
  if [ "$run_status" -ne 0 ] && [ -n "$failed_tests" ] &&
     grep -qs "LeakSanitizer has encountered a fatal error" "$reports"/asan.*; then
    echo "== warning: LeakSanitizer crashed at exit in some process; running the failed tests again:" $failed_tests
    mkdir -p "$reports/first-try"
    mv "$reports"/asan.* "$reports/first-try/" 2>/dev/null || true
    mv "$console" "$reports/first-try/$label-first-try.log"
    set +e
    # shellcheck disable=SC2086
    env "${sanitizer_env[@]}" "${extra[@]}" "$python" -m pytest -q -p no:cacheprovider --capture=sys \
      $failed_tests 2>&1 | tee "$console"
    run_status=${PIPESTATUS[0]}
    set -e
    # What the first try reported, other than the tracer's crash, still counts.
    for path in "$reports"/first-try/*; do
      grep -qs "LeakSanitizer has encountered a fatal error" "$path" || mv "$path" "$reports/"
    done
    rm -rf "$reports/first-try"
  fi
  summary=$(grep -E "^[0-9]+ (passed|failed)|[0-9]+ passed" "$console" | tail -n 1 || true)
  if [ "$run_status" -ne 0 ] && grep -qs "LeakSanitizer has encountered a fatal error" "$reports"/asan.* &&
     [[ $summary =~ [0-9]+\ passed ]] && ! [[ $summary =~ failed|error ]]; then
    echo "== warning: LeakSanitizer crashed at exit after the tests passed ($summary); leaks were not checked in that process"
    run_status=0
  fi
  if [ "$run_status" -ne 0 ]; then status=1; fi
}

# The emulated tests run with stack-use-after-return off: ASan would give
# every CUDA thread (fiber) a fake stack of its own, mapped and unmapped per
# thread of each block (45 times slower than without, measured on the
# emulator's own tests).
emulated_asan_options=${asan_options/detect_stack_use_after_return=1/detect_stack_use_after_return=0}
empty_parts=0
if [ ${#args[@]} -gt 0 ] && [ "$kind" = address ] && [[ " ${args[*]} " != *" -m"* ]]; then
  # Given tests are split as the default run's are (a -m of the caller's own
  # would override ours: then they run in one part, at the slower setting).
  empty_ok=1 run_tests tests -- -m "not cuda_emulated" "${deselect[@]}" "${args[@]}"
  empty_ok=1 run_tests emulated ASAN_OPTIONS="$emulated_asan_options" -- -m cuda_emulated "${deselect[@]}" "${args[@]}"
  if [ "$empty_parts" -eq 2 ]; then
    echo "== sanitize $kind: no tests were selected by: ${args[*]}"
    status=1
  fi
elif [ ${#args[@]} -gt 0 ]; then
  run_tests tests -- "${deselect[@]}" "${args[@]}"
else
  run_tests tests -- -n auto -m "not cuda_emulated" "${cpu_deselect[@]}" "${default_tests[@]}"
  if [ ${#emulated_tests[@]} -gt 0 ]; then
    run_tests emulated ASAN_OPTIONS="$emulated_asan_options" \
      -- -n auto -m cuda_emulated "${deselect[@]}" "${emulated_tests[@]}"
  fi
fi

# Judge the report files (one per process that reported, and the console log).
"$python" - "$reports" <<'PY' || status=1
import pathlib, re, sys

ours = re.compile(r"libnanoq_core\.so|libnanoq_cuda_emulated\.so|/nanoq/_(core|ops)\.cpython|nanoq(_emu)?::")
failed, ignored = [], 0
for path in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    text = path.read_text(errors="replace")
    # Leak records are blocks between blank lines; one counts only if its
    # allocation stack is in nanoq's code. Any other report is a failure.
    blocks = re.split(r"\n\s*\n", text)
    leaks = [b for b in blocks if re.search(r"^(Direct|Indirect) leak of", b, re.M)]
    our_leaks = [b for b in leaks if ours.search(b)]
    errors = re.search(r"ERROR: (AddressSanitizer|ThreadSanitizer)|WARNING: ThreadSanitizer|: runtime error: ", text)
    if errors or our_leaks:
        failed.append(path)
        if path.suffix != ".log":  # a console log: already on the console
            print(f"==== {path}\n{text if errors else chr(10).join(our_leaks)}", file=sys.stderr)
    else:
        ignored += len(leaks)
print(f"== sanitizer reports: {len(failed)} failing; {ignored} leak record(s) outside nanoq's code ignored")
sys.exit(1 if failed else 0)
PY
exit $status
