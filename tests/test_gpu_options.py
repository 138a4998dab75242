"""The memory options on the cuda backend's code: ZeRO stages 1-3, offload
and recomputation train like the cpu backend in fp32 on 1 and 2 devices,
and stage 3 is bitwise stage 2 (the same arithmetic on gathered copies).

Each test runs on a GPU ("cuda", marked gpu, skipped without one) and on the
CPU emulator of CUDA ("cuda_emulated", marked cuda_emulated, everywhere; its
NCCL stand-in carries the collectives between the emulated devices)."""
import numpy as np
import pytest

import nanoq
from conftest import CUDA_BACKENDS, use_cuda_backend
from test_zero import CONFIG, run


@pytest.fixture(params=[pytest.param(name, marks=mark, id=name) for name, mark in CUDA_BACKENDS])
def backend(request):
    return use_cuda_backend(request.param, request)


def device_count(backend):
    return next(entry for entry in nanoq.backends() if entry["name"] == backend)["devices"]


def cuda_run(backend, devices=1, **options):
    return run(devices=devices, backend_overrides=dict(backend=backend, dtype="fp32"), **options)


@pytest.mark.parametrize("options", [
    dict(zero_stage=2), dict(zero_stage=3), dict(offload=("optimizer", "master")),
    dict(zero_stage=3, offload=("optimizer", "master", "gradients"), recompute=("block",)),
    dict(recompute=("ffn", "norms")),
], ids=["stage2", "stage3", "offload", "stage3-offload-recompute", "recompute"])
def test_options_on_cuda_match_cpu(backend, options):
    gpu_losses, gpu_weights, _ = cuda_run(backend, **options)
    cpu_losses, cpu_weights, _ = run(**options)
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4)
    for name, value in gpu_weights.items():
        np.testing.assert_allclose(value, cpu_weights[name], rtol=1e-3, atol=2e-4, err_msg=name)


def test_stage_three_is_bitwise_stage_two_on_cuda(backend):
    stage2 = cuda_run(backend, zero_stage=2)
    stage3 = cuda_run(backend, zero_stage=3, offload=("optimizer", "master", "gradients"), recompute=("block",))
    assert stage2[0] == stage3[0]
    for name in stage2[1]:
        assert np.array_equal(stage2[1][name], stage3[1][name]), name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_devices_match_one_at_every_stage(backend, stage):
    if device_count(backend) < 2:
        pytest.skip("needs 2 GPUs")  # the emulator has 4 devices: never skipped there
    one = cuda_run(backend, devices=1, zero_stage=stage)
    two = cuda_run(backend, devices=2, zero_stage=stage)
    np.testing.assert_allclose(two[0], one[0], rtol=1e-5)
    for name, value in two[1].items():
        np.testing.assert_allclose(value, one[1][name], rtol=1e-3, atol=2e-4, err_msg=name)
    cpu_two = run(devices=2, zero_stage=stage)
    np.testing.assert_allclose(two[0], cpu_two[0], rtol=1e-4)
