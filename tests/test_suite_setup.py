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


def test_a_gpu_test_asking_for_more_gpus_than_the_machine_has_is_skipped(tmp_path):
    # On the one-GPU machine, a two-device GPU test is "not here", as a GPU test is without a GPU; the same
    # refusal fails a CPU test, and any other error fails a GPU test.
    (tmp_path / "test_gpus.py").write_text(
        "import pytest\n"
        "TOO_FEW = 'asked for 2 cuda device(s), but 1 are available'\n"
        "@pytest.mark.gpu\n"
        "def test_two_gpus():\n    raise ValueError(TOO_FEW)\n"
        "@pytest.mark.gpu\n"
        "def test_another_error():\n    raise ValueError('asked for 1 cuda device(s), but 1 are available')\n"
        "@pytest.mark.gpu\n"
        "def test_second_gpu():\n    raise ValueError('asked for 1 cuda device(s) from device 1, but 1 are available')\n"
        "def test_on_the_cpu():\n    raise ValueError(TOO_FEW)\n")
    here = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-p",
                             "no:xdist", "-rfs", "-q", str(tmp_path / "test_gpus.py")],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=dict(os.environ, PYTHONPATH=here, NANOQ_NO_CPU_SKIPS="0"))
    assert "2 failed, 2 skipped" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    assert "test_gpus.py:3: needs 2 GPUs, this machine has 1" in result.stdout  # (the test's first line)
    assert "test_gpus.py:9: needs 2 GPUs, this machine has 1" in result.stdout
    assert "FAILED test_gpus.py::test_another_error" in result.stdout
    assert "FAILED test_gpus.py::test_on_the_cpu" in result.stdout
