"""The test suite's own setup: it runs with and without pytest-xdist (the
README's `pytest -q -n auto`; the GPU machine's `pytest -m gpu` may have no
xdist), and `-n auto` starts as many processes as the machine holds."""

import os
import subprocess
import sys

import conftest


def test_the_suite_loads_without_pytest_xdist():
    # The conftest's xdist hook must not stop pytest where xdist is absent.
    here = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider",
                             "--collect-only", "-q", os.path.join(here, "test_options.py")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tests collected" in result.stdout or "test_options.py::" in result.stdout


def test_auto_workers_are_bounded_by_cores_and_memory(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    workers = conftest.pytest_xdist_auto_num_workers(None)
    assert 1 <= workers <= cores
    # Where memory holds fewer test processes than there are cores, memory decides.
    monkeypatch.setattr(conftest, "_TEST_PROCESS_BYTES", 1 << 50)
    assert conftest.pytest_xdist_auto_num_workers(None) == 1


def test_a_gpu_test_asking_for_more_gpus_than_the_machine_has_is_skipped():
    # On the one-GPU machine, a two-device GPU test is "not here", as a GPU test is without a GPU; the same
    # refusal fails a CPU test, and any other error fails a GPU test. (conftest's report hook, driven as
    # pytest drives a hook wrapper.)
    import types

    def report_of(error, gpu=True):
        item = types.SimpleNamespace(get_closest_marker=lambda name: object() if gpu and name == "gpu" else None,
                                     path="tests/test_x.py", location=("tests/test_x.py", 41, "test_x"))
        call = types.SimpleNamespace(excinfo=types.SimpleNamespace(value=ValueError(error)))
        report = types.SimpleNamespace(passed=False, outcome="failed", longrepr="the error")
        hook = conftest.pytest_runtest_makereport(item, call)
        next(hook)
        try:
            hook.send(types.SimpleNamespace(get_result=lambda: report))
        except StopIteration:
            pass
        return report

    too_few = "asked for 2 cuda device(s), but 1 are available"
    skipped = report_of(too_few)
    assert skipped.outcome == "skipped"
    assert skipped.longrepr == ("tests/test_x.py", 42, "Skipped: needs 2 GPUs, this machine has 1")
    second = report_of("asked for 1 cuda device(s) from device 1, but 1 are available")
    assert second.outcome == "skipped" and second.longrepr[2] == "Skipped: needs 2 GPUs, this machine has 1"
    assert report_of("asked for 1 cuda device(s), but 1 are available").outcome == "failed"
    assert report_of(too_few, gpu=False).outcome == "failed"


def test_a_test_on_the_emulator_without_the_cuda_emulated_marker_fails(monkeypatch):
    # `-m cuda_emulated` must select every test that runs on the emulator (the sanitizer runs and
    # CI's second test run go by the marker): require_cuda_emulator fails a test that lacks it.
    import types

    import pytest

    def item(marked):
        return types.SimpleNamespace(nodeid="tests/test_x.py::test_x",
                                     get_closest_marker=lambda name: object() if marked and name == "cuda_emulated"
                                     else None)

    monkeypatch.setattr(conftest, "_running_test", item(marked=False))
    with pytest.raises(pytest.fail.Exception, match="test_x runs on the CUDA emulator but is not marked cuda_emulated"):
        conftest.require_cuda_emulator()
    monkeypatch.setattr(conftest, "_running_test", item(marked=True))
    conftest.require_cuda_emulator()
