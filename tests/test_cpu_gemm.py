"""The cpu backend's portable sgemm, the one it runs without OpenBLAS.

Every build compiles it; NANOQ_CPU_GEMM=portable, read by each cpu backend
when it is created, selects it, so these tests run where OpenBLAS is present
too. Against float64 numpy for every transpose/accumulate combination and
shapes that cut its blocking (M, N, K of 1, odd sizes, sizes past the
6 x 16 micro-tile and the 120 / 2048 / 256 blocks of M / N / K); a short
training run that must match the OpenBLAS one to fp32 rounding; and what
`nanoq info` says about the GEMM in use.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from nanoq import _core
from nanoq.testing import OpRunner
from conftest import open_trainer
from test_equivalence import ROW_MASKS, assert_runs_match, masked_batch, train
from test_ops import check_matmul

OPENBLAS_BUILT = _core.cpu_gemm()["openblas_built"]


def runner_with(gemm, threads):
    """A cpu OpRunner created while NANOQ_CPU_GEMM=gemm (the switch is read
    once, at creation: the runner keeps its GEMM after the variable goes)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NANOQ_CPU_GEMM", gemm)
        assert _core.cpu_gemm()["name"] == gemm
        return OpRunner("cpu", 0, threads)


@pytest.fixture(scope="module")
def portable():
    return runner_with("portable", threads=1)


SHAPES = [
    (1, 1, 1),
    (1, 67, 300),  # one row; K past one K block
    (67, 1, 5),  # one column
    (7, 13, 1),  # K = 1
    (127, 35, 257),  # M past one M block, K one past a K block
    (3, 2101, 9),  # N past one N block
    (250, 301, 517),  # all odd, several blocks of each
]


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("mnk", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_portable_gemm_against_float64(portable, trans_a, trans_b, accumulate, mnk):
    check_matmul(portable, *mnk, trans_a, trans_b, accumulate)


@pytest.mark.parametrize("mnk", [(130, 70, 300), (40, 200, 33)], ids=["split_m", "split_n"])
def test_portable_gemm_is_bitwise_the_same_on_any_thread_count(portable, mnk):
    """The backend splits a matmul over its threads along M or N; every
    element still sums K in one order, so the split changes no bit."""
    two = runner_with("portable", threads=2)
    for trans_a, trans_b in [(False, False), (True, False), (False, True), (True, True)]:
        one_thread = check_matmul(portable, *mnk, trans_a, trans_b, True)
        two_threads = check_matmul(two, *mnk, trans_a, trans_b, True)
        assert np.array_equal(one_thread, two_threads), f"trans_a={trans_a} trans_b={trans_b}"


def test_the_switch_refuses_what_this_build_cannot_do(monkeypatch):
    monkeypatch.setenv("NANOQ_CPU_GEMM", "fast")
    with pytest.raises(ValueError, match='NANOQ_CPU_GEMM must be "openblas", "portable" or unset, got "fast"'):
        OpRunner("cpu")
    monkeypatch.setenv("NANOQ_CPU_GEMM", "openblas")
    if OPENBLAS_BUILT:
        check_matmul(OpRunner("cpu"), 5, 6, 7, False, False, False)
    else:
        with pytest.raises(ValueError, match="this build of nanoq has no OpenBLAS"):
            OpRunner("cpu")


def test_training_with_the_portable_gemm_matches_openblas(checkpoints, monkeypatch):
    """Two devices (each backend reads the switch in its worker) through
    three optimizer steps: only fp32 rounding may differ."""
    if not OPENBLAS_BUILT:
        pytest.skip("this build has no OpenBLAS to compare with (CI's builds always have it)")
    rng = np.random.default_rng(31)
    batches = [masked_batch(rng, ROW_MASKS) for _ in range(3)]
    runs = {}
    for gemm in ("openblas", "portable"):
        monkeypatch.setenv("NANOQ_CPU_GEMM", gemm)
        with open_trainer(checkpoints.path("llama"), devices=2, batch_size=3) as tr:
            runs[gemm] = train(tr, batches, parts=1)
    assert_runs_match(runs["portable"], runs["openblas"], "portable vs OpenBLAS")


def nanoq_info(**env):
    environment = {k: v for k, v in os.environ.items() if k != "NANOQ_CPU_GEMM"}
    result = subprocess.run([sys.executable, "-m", "nanoq_cli.main", "info"], env=dict(environment, **env),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return next(line for line in result.stdout.splitlines() if line.startswith("backend cpu: "))


def test_nanoq_info_names_the_gemm():
    default = "GEMM: OpenBLAS (scipy-openblas32)" if OPENBLAS_BUILT else \
        "GEMM: portable fallback (this build has no OpenBLAS)"
    assert nanoq_info().endswith(default)
    forced = "NANOQ_CPU_GEMM=portable" if OPENBLAS_BUILT else "this build has no OpenBLAS"
    assert nanoq_info(NANOQ_CPU_GEMM="portable").endswith(f"GEMM: portable fallback ({forced})")
