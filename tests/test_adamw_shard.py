"""The whole-shard AdamW (Backend::adamw_shard, op "adamw_shard").

It updates a shard of several parameters (segments with their own weight
decay) in one call and writes the model's weight copy from the updated
master. Its contract is to be bitwise the per-parameter, per-chunk adamw
loop that the trainer ran before it (and still runs with offload): the
default body is that loop, and the cuda override (one kernel) must match it
bit for bit, including the stochastic rounding of bf16 values, whose noise
is keyed by each chunk's start. Here the cpu op is held against that loop
written in Python over the adamw op and against a float64 reference, and
the cuda override (on a GPU when there is one, marked gpu, and on the CPU
emulator everywhere) against its default body in every dtype mix.
"""

import numpy as np
import pytest

import nanoq

from nanoq.testing import OpRunner
from conftest import CUDA_BACKENDS, use_cuda_backend
from test_ops import ref_adamw

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)
SEED = (0x9E3779B97F4A7C15 * 5 + 1234) % 2**64  # a seed using all 64 bits
# A shard of 700 elements: four parameters, the middle two without decay, a
# gap (the padding of a shard) left alone, chunks of 64 elements so that
# segments span several chunks and start mid-chunk.
SEGMENTS = [(0, 150, 1), (150, 37, 0), (187, 300, 0), (487, 180, 1)]
N, CHUNK = 700, 64


def shard_inputs(seed=0):
    rng = np.random.default_rng(seed)
    master = rng.standard_normal(N).astype(np.float32)
    grad = rng.standard_normal(N).astype(np.float32)
    m = (rng.standard_normal(N) * 0.1).astype(np.float32)
    v = (m.astype(np.float64) ** 2 + 0.01).astype(np.float32)
    return master, grad, m, v


def table(segments=SEGMENTS):
    return np.array(segments, dtype=np.float64).reshape(-1, 3)


@pytest.fixture(scope="module")
def cpu():
    return OpRunner("cpu")


@pytest.fixture(params=[pytest.param(name, marks=mark, id=name) for name, mark in CUDA_BACKENDS])
def backend(request):
    return use_cuda_backend(request.param, request)


@pytest.fixture
def cuda(backend):
    return OpRunner(backend)


def per_chunk_loop(runner, master, grad, m, v, *, scale, seed, chunk, **kwargs):
    """The trainer's old optimizer loop: adamw per segment and chunk, the
    chunk's seed = seed + its first element."""
    master, m, v = master.copy(), m.copy(), v.copy()
    for begin, count, decay in SEGMENTS:
        for at in range(begin, begin + count, chunk):
            part = slice(at, min(at + chunk, begin + count))
            hyper = dict(HYPER, weight_decay=HYPER["weight_decay"] if decay else 0.0)
            master[part], m[part], v[part] = runner.adamw(master[part], grad[part], m[part], v[part], scale=scale,
                                                          seed=(seed + at) % 2**64, **hyper, **kwargs)
    return master, m, v


def test_cpu_adamw_shard_is_the_per_parameter_per_chunk_loop_bitwise(cpu):
    master, grad, m, v = shard_inputs()
    got = cpu.adamw_shard(master, grad, m, v, weights=np.zeros(N, np.float32), segments=table(), scale=0.5,
                          seed=SEED, chunk=CHUNK, **HYPER)
    want = per_chunk_loop(cpu, master, grad, m, v, scale=0.5, seed=SEED, chunk=CHUNK)
    for name, a, b in zip(("master", "m", "v"), got[:3], want):
        np.testing.assert_array_equal(a, b, name)
    np.testing.assert_array_equal(got[3][: 487 + 180], got[0][: 487 + 180], "weights are the updated master")
    np.testing.assert_array_equal(got[3][487 + 180:], 0.0, "the padding's weights are left alone")


def test_cpu_adamw_shard_matches_the_float64_reference_with_decay_per_segment(cpu):
    master, grad, m, v = shard_inputs(1)
    got_p, got_m, got_v = cpu.adamw_shard(master, grad, m, v, segments=table(), scale=0.5, seed=SEED,
                                          chunk=CHUNK, **HYPER)[:3]
    for begin, count, decay in SEGMENTS:
        part = slice(begin, begin + count)
        hyper = dict(HYPER, weight_decay=HYPER["weight_decay"] if decay else 0.0)
        rp, rm, rv = ref_adamw(master[part], grad[part].astype(np.float64) * 0.5, m[part], v[part], **hyper)
        np.testing.assert_allclose(got_p[part], rp, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got_m[part], rm, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got_v[part], rv, rtol=1e-5, atol=1e-7)
    gap = slice(487 + 180, N)
    for got, before in ((got_p, master), (got_m, m), (got_v, v)):
        np.testing.assert_array_equal(got[gap], before[gap], "elements in no segment are untouched")


# (master dtype, moments dtype, weight copy dtype or None: the master is the weights)
DTYPES = [("fp32", "fp32", None), ("fp32", "fp32", "bf16"), ("fp32", "bf16", "bf16"), ("bf16", "bf16", None),
          ("bf16", "fp32", "fp32")]


@pytest.mark.parametrize("dtype,state_dtype,weight_dtype", DTYPES)
def test_cuda_adamw_shard_kernel_is_bitwise_its_default_composition(cuda, dtype, state_dtype, weight_dtype):
    master, grad, m, v = shard_inputs(2)
    kwargs = dict(segments=table(), scale=0.5, seed=SEED, chunk=CHUNK, dtype=dtype, state_dtype=state_dtype, **HYPER)
    if weight_dtype:
        kwargs.update(weights=np.full(N, 7.0, np.float32), weight_dtype=weight_dtype)
    own = cuda.adamw_shard(master, grad, m, v, **kwargs)
    default = cuda.adamw_shard(master, grad, m, v, use_default=True, **kwargs)
    for name, a, b in zip(("master", "m", "v", "weights"), own, default):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (
            f"{name}: {int((a != b).sum())} of {N} elements differ from the per-chunk composition")
    # The update happened, the bf16 rounding is the seeded one, and the copy is the master's.
    assert not np.array_equal(own[0], master)
    if weight_dtype:
        assert np.array_equal(own[3][:667] != 7.0, np.ones(667, bool))
        assert np.all(own[3][667:] == 7.0)


def test_cuda_adamw_shard_rounding_noise_follows_the_chunk_seeds(cuda):
    """bf16 everywhere: another seed changes the rounding, and the kernel's
    result equals the per-chunk adamw loop on the same backend."""
    master, grad, m, v = shard_inputs(3)
    kwargs = dict(dtype="bf16", state_dtype="bf16")
    own = cuda.adamw_shard(master, grad, m, v, segments=table(), scale=0.5, seed=SEED, chunk=CHUNK, **HYPER,
                           **kwargs)
    loop = per_chunk_loop(cuda, master, grad, m, v, scale=0.5, seed=SEED, chunk=CHUNK, **kwargs)
    covered = slice(0, 487 + 180)  # the loop leaves the padding as given, unrounded float32
    for name, a, b in zip(("master", "m", "v"), own[:3], loop):
        np.testing.assert_array_equal(a[covered], b[covered], name)
    other = cuda.adamw_shard(master, grad, m, v, segments=table(), scale=0.5, seed=SEED + 1, chunk=CHUNK,
                             **HYPER, **kwargs)
    assert not np.array_equal(other[0], own[0])


def test_cuda_bf16_training_is_bitwise_with_and_without_offload(backend):
    """Without offload the trainer updates each rank's shard in one
    adamw_shard kernel; with the optimizer and master offloaded it streams
    them chunk by chunk (adamw per chunk, then the bf16 weight copy). With
    bf16 weights over a float32 master and bf16 moments (stochastically
    rounded), both give the same bits (on two devices where there are two)."""
    from test_zero import run

    devices = min(2, next(entry for entry in nanoq.backends() if entry["name"] == backend)["devices"])
    overrides = dict(backend=backend, dtype="bf16", master_dtype="fp32", optimizer_dtype="bf16")
    fused = run(devices=devices, steps=2, backend_overrides=overrides)
    streamed = run(devices=devices, steps=2, backend_overrides=overrides, offload=("optimizer", "master"))
    assert fused[0] == streamed[0]
    for name, value in fused[1].items():
        assert np.array_equal(value, streamed[1][name]), name
