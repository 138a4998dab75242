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
