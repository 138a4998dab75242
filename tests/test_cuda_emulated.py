"""The CPU emulator of CUDA itself (cuda_core/cuda/emulator), and the
kernel properties the parity tests in test_gpu_ops.py do not pin down.

The emulator's own kernels (emulator/selftest.cpp) check that warp
intrinsics honour widths and masks, that block votes combine the block, and
that every fault the emulator promises to report is reported as an error of
the launch: barriers not reached by every thread or at different call
sites, threads exiting while others wait, shared-memory accesses out of
bounds, bad masks, and writes past the end of a device buffer. A race (a
missing barrier) shows under some schedules and replays exactly under the
same seed. All tests are marked cuda_emulated: CPU tests, never skipped.
"""
import ctypes
import os

import numpy as np
import pytest

import nanoq
from nanoq.testing import OpRunner
from conftest import require_cuda_emulator

pytestmark = pytest.mark.cuda_emulated

LAUNCH_FAILURE = 719  # cudaErrorLaunchFailure
INVALID_CONFIGURATION = 9


@pytest.fixture(scope="module")
def selftest():
    require_cuda_emulator()
    nanoq.backends()  # loads the emulated backend's library through the core
    lib = ctypes.CDLL(os.path.join(os.path.dirname(nanoq._core.__file__), "libnanoq_cuda_emulated.so"))
    run = lib.nanoq_emu_selftest
    run.restype = ctypes.c_int
    run.argtypes = [ctypes.c_char_p, ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                    ctypes.c_char_p, ctypes.c_int]

    def call(name, n=1024, seed=1):
        out = np.zeros(n, np.int32)
        message = ctypes.create_string_buffer(4096)
        status = run(name.encode(), seed, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int)), n, message, 4096)
        return status, out, message.value.decode()

    return call


def test_warp_shuffles_and_votes_honour_width_and_mask(selftest):
    status, out, message = selftest("shuffle", n=64 * 11)
    assert status == 0, message
    rows = out.reshape(11, 64)
    t = np.arange(64)
    lane, base = t % 32, t - t % 32
    v = 100 * t
    expected = [
        100 * (base + (lane + 3) % 32),                                   # __shfl_sync
        100 * (base + (lane & ~7) + ((lane + 3) & 7)),                    # width 8
        np.where(lane % 16 >= 2, 100 * (t - 2), v),                       # up 2, width 16
        np.where(lane % 8 + 3 < 8, 100 * (t + 3), v),                     # down 3, width 8
        100 * (base + (lane ^ 5)),                                        # xor 5
        np.where((lane ^ 4) // 4 > lane // 4, v, 100 * (base + (lane ^ 4))),  # xor 4, width 4
        np.full(64, sum(1 << i for i in range(32) if i % 3 == 0) - (1 << 32)),  # ballot (as int32)
        np.where(t < 32, 0, 1),                                           # any: lane 40 is in warp 1
        np.where(t < 32, 1, 0),                                           # all
        np.where(lane < 16, 100 * (base + (lane ^ 1)),                    # half-warp masks
                 np.where(lane % 16 + 1 < 16, 100 * (t + 1), v)),
        (1.5 * (base + 31 - lane)).astype(int),                           # a double
    ]
    for i, want in enumerate(expected):
        assert np.array_equal(rows[i], np.asarray(want, np.int64).astype(np.int32)), f"row {i}: {rows[i]} != {want}"


def test_block_votes_and_block_sum_cover_the_block(selftest):
    status, out, message = selftest("vote", n=4 * 96)
    assert status == 0, message
    votes = out.reshape(96, 4)
    assert np.all(votes == [20, 1, 1, 0])
    for seed in range(1, 9):  # both schedules
        status, out, message = selftest("block_sum", n=512, seed=seed)
        assert status == 0, message
        assert np.all(out[0::2] == sum(range(256))) and np.all(out[1::2] == sum(t % 7 for t in range(256)))


def test_dynamic_shared_memory(selftest):
    status, out, message = selftest("dynamic_shared", n=64)
    assert status == 0, message
    assert np.array_equal(out, 2 * (63 - np.arange(64)))


FAULTS = [
    ("divergent_barrier", "is not reached by every thread"),
    ("two_barriers", "different barriers"),
    ("exit_before_barrier", "is not reached by every thread"),
    ("shared_overflow", "shared memory access out of bounds: index 32 of an array of 32"),
    ("shared_pointer_overflow", "shared memory access out of bounds: index 3"),  # 32..47, whichever runs first
    ("dynamic_overflow", "shared memory access out of bounds: index 64 of an array of 64"),
    ("shuffle_outside_mask", "leaves out the calling lane"),
    ("shuffle_reads_outside_mask", "reads lane 20, which is not in the mask"),
    ("shuffle_exited_lane", "exit"),
    ("global_overrun", "out-of-bounds write: byte 0 past the end of a 4096-byte device buffer"),
]


# Test ids are the fault's name: tests/sanitize/run.sh deselects global_overrun
# under AddressSanitizer, which reports that overrun itself.
@pytest.mark.parametrize("name, words", FAULTS, ids=[name for name, _ in FAULTS])
def test_faults_are_launch_errors_naming_the_problem(selftest, name, words):
    status, _, message = selftest(name, n=1024)
    assert status == LAUNCH_FAILURE, (name, status, message)
    assert words in message, message
    assert "emulator seed" in message and "kernel launched at" in message, message


def test_exit_at_a_barrier_is_reported_under_every_schedule(selftest):
    for seed in range(1, 30):
        status, _, message = selftest("exit_before_barrier", seed=seed)
        assert status == LAUNCH_FAILURE, f"seed {seed}: {message}"


def test_bad_launch_configuration_is_refused_at_launch(selftest):
    status, _, message = selftest("bad_block", n=64 * 11)
    assert status == INVALID_CONFIGURATION
    assert "invalid block (2048, 1, 1)" in message


def test_a_missing_barrier_shows_under_some_seeds_and_a_seed_replays(selftest):
    expected = (np.arange(128) + 1) % 128
    outcomes = {}
    for seed in range(1, 40):
        status, out, message = selftest("neighbour", n=128, seed=seed)
        assert status == 0, message
        outcomes[seed] = out.copy()
    wrong = [seed for seed, out in outcomes.items() if not np.array_equal(out, expected)]
    assert wrong, "no schedule exposed the race"
    distinct = {out.tobytes() for out in outcomes.values()}
    assert len(distinct) > 1, "the outcome does not depend on the schedule"
    seed = wrong[0]
    assert np.array_equal(selftest("neighbour", n=128, seed=seed)[1], outcomes[seed]), "a seed must replay"
    for seed in range(1, 40):
        assert np.array_equal(selftest("neighbour_synced", n=128, seed=seed)[1], expected)


# --------------------------------------------------------------------------
# Kernel properties beyond parity with the cpu backend
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def emulated():
    require_cuda_emulator()
    return OpRunner("cuda_emulated")


@pytest.fixture(scope="module")
def cpu():
    return OpRunner("cpu")


def splitmix64(x):
    """kernel_utils.cuh's splitmix64 (golden-ratio increment first), on uint64 arrays."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def stochastic_bf16(x, random16):
    """bf16 stochastic rounding as specified in kernel_utils.cuh: add a
    uniform 16-bit draw to the low half of the fp32 pattern, truncate."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + random16) >> np.uint64(16)) << np.uint64(16)
    return (rounded & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)


def test_adamw_stochastic_rounding_gives_the_reference_bits(cpu, emulated):
    """bf16 parameter and moments: the exact bits of the fp32 AdamW step
    (the cpu backend's, the same fp32 expressions) rounded with the
    counter-based hash of (seed, step, index)."""
    rng = np.random.default_rng(21)
    n, seed, step = 5003, 77, 3
    to_bf16 = lambda x: stochastic_bf16(np.asarray(x, np.float32), np.uint64(0x8000))  # noqa: E731 - ties: any
    param = to_bf16(rng.standard_normal(n))
    m = to_bf16(rng.standard_normal(n) * 0.1)
    v = to_bf16(m.astype(np.float64) ** 2 + 0.01)
    grad = rng.standard_normal(n).astype(np.float32)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
    exact = cpu.adamw(param, grad, m, v, scale=0.5, **hyper)
    got = emulated.adamw(param, grad, m, v, scale=0.5, seed=seed, dtype="bf16", state_dtype="bf16", **hyper)
    step_key = splitmix64(np.array([step], np.uint64))[0]
    stream_key = splitmix64(np.array([np.uint64(seed) ^ step_key], np.uint64))[0]
    with np.errstate(over="ignore"):
        random = splitmix64(stream_key + np.arange(n, dtype=np.uint64))
    for slot, (name, value, want) in enumerate(zip(("param", "m", "v"), got, exact)):
        draw = (random >> np.uint64(16 * slot)) & np.uint64(0xFFFF)
        reference = stochastic_bf16(want, draw)
        assert np.array_equal(value.view(np.uint32), reference.view(np.uint32)), (
            f"{name}: {int((value != reference).sum())} of {n} elements differ from the reference rounding")


def round_nearest_even(x):
    """x rounded to bf16, ties to even (CUDA's __float2bfloat16_rn), as float32."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def test_bf16_outputs_are_fp32_results_rounded_to_nearest_even(emulated):
    """Elementwise kernels compute in fp32 and round once: the bits must be
    the numpy fp32 result rounded to nearest even."""
    rng = np.random.default_rng(23)
    a, b = (round_nearest_even(rng.standard_normal(70_001) * 3) for _ in range(2))
    got = emulated.add(a, b, dtype="bf16")
    assert np.array_equal(got.view(np.uint32), round_nearest_even(a + b).view(np.uint32))
    got = emulated.accumulate(a, b, dtype="bf16")
    assert np.array_equal(got.view(np.uint32), round_nearest_even(a + b).view(np.uint32))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("drop", [0.0, 0.1, 0.5])
def test_scale_dropout_draws_the_mask_of_dropout_h(cpu, emulated, dtype, drop):
    """The cpu backend draws its mask from dropout.h; the kernel must draw the same one."""
    rng = np.random.default_rng(22)
    x = rng.standard_normal(70_001).astype(np.float32)
    if dtype == "bf16":
        x = stochastic_bf16(x, np.uint64(0))
    got = emulated.scale_dropout(x, scale=0.75, drop=drop, seed=1234, dtype=dtype)
    want = cpu.scale_dropout(x, scale=0.75, drop=drop, seed=1234)
    assert np.array_equal(got == 0, want == 0), "a different mask"
    if dtype == "fp32":
        assert np.array_equal(got, want)
    else:
        assert np.abs(got - want).max() <= 2**-7 * np.abs(want).max()
