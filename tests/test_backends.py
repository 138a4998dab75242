"""Backend selection and the cuda library's plumbing, checked on any machine.

CI runs this suite twice: against the CPU-only install of the README and
against an install with the cuda backend built (no GPU, no driver). Each test
asserts what must happen in the configuration it finds itself in.
"""
import numpy as np
import pytest

import nanoq
from nanoq import _core
from nanoq.backends import cuda_architectures, device_count, resolve_backend
from nanoq.trainer import _device_array, _interface_stream

CUDA_BUILT = _core.backend_built("cuda")


def tiny_config():
    return nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4)


def cuda_devices():
    try:
        return device_count("cuda")
    except (ValueError, nanoq.NanoqError):
        return 0


def test_backends_report_cpu_built_with_cores():
    report = {b["name"]: b for b in nanoq.backends()}
    assert set(report) == {"cpu", "cuda", "cuda_emulated"}
    assert report["cpu"]["built"] and report["cpu"]["devices"] >= 1
    assert report["cuda"]["built"] == CUDA_BUILT


@pytest.mark.cuda_emulated
def test_the_emulator_is_built_and_shows_its_devices():
    """Built by default (the ThreadSanitizer build leaves it out and deselects this)."""
    report = {b["name"]: b for b in nanoq.backends()}
    assert report["cuda_emulated"]["built"] and report["cuda_emulated"]["devices"] >= 2
    assert "emulator" in report["cuda_emulated"]["detail"]


def test_the_cuda_backends_architectures_are_said():
    """The CUDA architectures the build compiled (cmake/cuda_architectures.cmake), in
    backends() where the cuda backend is built; none without it."""
    built_for = cuda_architectures()
    cuda = next(b for b in nanoq.backends() if b["name"] == "cuda")
    if not CUDA_BUILT:
        assert built_for == "" and "architectures" not in cuda["detail"]
        return
    assert built_for and f"built for CUDA architectures {built_for}" in cuda["detail"]


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("capability", ["8.0", "8.9"])
def test_a_gpu_the_build_has_no_code_for_is_refused_with_how_to_build_for_it(monkeypatch, capability):
    """The emulated build counts as compiled for sm_90 (with its PTX): a GPU of an older
    compute capability has no code to run, and every kernel launch would fail. The backend
    says so when it starts, before any work, with the architecture to build for."""
    from nanoq.testing import OpRunner
    from conftest import require_cuda_emulator

    require_cuda_emulator()
    monkeypatch.setenv("NANOQ_EMU_COMPUTE_CAPABILITY", capability)
    arch = capability.replace(".", "")
    expected = (rf"has no code for device 0 \(compute capability {capability}\): it was built for CUDA "
                rf"architectures 90\. .*CMAKE_ARGS=\"-DCMAKE_CUDA_ARCHITECTURES={arch}\" NANOQ_CUDA=ON pip install \.")
    with pytest.raises(nanoq.NanoqError, match=expected):
        nanoq.Trainer(tiny_config(), nanoq.TrainOptions(backend="cuda_emulated", seq_len=8))
    with pytest.raises(nanoq.NanoqError, match=expected):
        OpRunner("cuda_emulated")


@pytest.mark.cuda_emulated
def test_a_gpu_older_than_the_backend_supports_is_refused_as_such(monkeypatch):
    """Below compute capability 8.0 there is nothing to rebuild for: the message says the
    oldest supported, the build backend's MIN_COMPUTE_CAPABILITY (the one AUTO builds by)."""
    import importlib.util
    import pathlib
    import sys
    from conftest import require_cuda_emulator

    require_cuda_emulator()
    path = pathlib.Path(__file__).resolve().parents[1] / "build_backend" / "nanoq_build.py"
    spec = importlib.util.spec_from_file_location("nanoq_build_for_minimum", path)
    build = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, build)  # (its dataclass looks its module up)
    spec.loader.exec_module(build)
    major, minor = build.MIN_COMPUTE_CAPABILITY
    monkeypatch.setenv("NANOQ_EMU_COMPUTE_CAPABILITY", "7.5")
    with pytest.raises(nanoq.NanoqError, match=rf"\(compute capability 7\.5\): it was built for CUDA architectures "
                                               rf"90\. The cuda backend supports GPUs of compute capability "
                                               rf"{major}\.{minor} \(Ampere\) and newer") as raised:
        nanoq.Trainer(tiny_config(), nanoq.TrainOptions(backend="cuda_emulated", seq_len=8))
    assert "CMAKE_ARGS" not in str(raised.value)


@pytest.mark.cuda_emulated
def test_a_newer_gpu_runs_the_build_through_its_ptx(monkeypatch):
    """Compute capability 10.0 (Blackwell) on the sm_90 build: the driver compiles the PTX."""
    from conftest import require_cuda_emulator

    require_cuda_emulator()
    monkeypatch.setenv("NANOQ_EMU_COMPUTE_CAPABILITY", "10.0")
    tokens = np.random.default_rng(0).integers(0, 64, (1, 8), dtype=np.int32)
    with nanoq.Trainer(tiny_config(), nanoq.TrainOptions(backend="cuda_emulated", batch_size=1, seq_len=8)) as t:
        t.step(tokens, tokens)
        assert np.isfinite(t.update(lr=1e-3).loss)


def test_auto_never_picks_the_emulator():
    assert resolve_backend("auto") != "cuda_emulated"


def test_auto_picks_cpu_without_a_usable_gpu():
    expected = "cuda" if CUDA_BUILT and cuda_devices() > 0 else "cpu"
    assert resolve_backend("auto") == expected
    with nanoq.Trainer(tiny_config(), nanoq.TrainOptions(backend="auto", seq_len=8)) as trainer:
        assert trainer.backend == expected
        assert trainer.dtype == ("bf16" if expected == "cuda" else "fp32")


def test_cuda_request_fails_clearly_without_gpu_or_build():
    if CUDA_BUILT and cuda_devices() > 0:
        pytest.skip("a GPU is usable here: the failure paths cannot occur")
    options = nanoq.TrainOptions(backend="cuda", seq_len=8)
    if CUDA_BUILT:
        # The library loads (its CUDA libraries resolve) but finds no device.
        with pytest.raises(nanoq.NanoqError, match="no usable GPU"):
            nanoq.Trainer(tiny_config(), options)
    else:
        with pytest.raises(ValueError, match="NANOQ_CUDA=ON"):
            nanoq.Trainer(tiny_config(), options)


def test_cuda_library_loads_without_a_driver_when_built():
    """Loading libnanoq_cuda.so needs only the CUDA libraries, not a driver:
    the device count is then 0 rather than a crash."""
    if not CUDA_BUILT:
        with pytest.raises(ValueError, match="not built"):
            device_count("cuda")
    else:
        assert device_count("cuda") >= 0
        assert _core.backend_built("cuda")


def test_the_cuda_library_names_every_library_it_calls():
    """libnanoq_cuda.so loads (RTLD_NOW) with none of the nvidia libraries
    loaded before it: each one whose symbols it uses (nvrtc, called by the
    cuDNN frontend, included) is a dependency its run path finds, not left
    for nanoq.backends' preloading to have supplied."""
    import subprocess
    import sys

    code = "from nanoq import _core; print(_core.device_count('cuda'))"  # _core alone: no preloading
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if CUDA_BUILT:  # (CI's cuda build phase, and the GPU machine)
        assert done.returncode == 0 and done.stdout.strip().isdigit(), done.stdout + done.stderr
    else:
        assert done.returncode == 1 and "not built" in done.stderr, done.stdout + done.stderr


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend"):
        nanoq.TrainOptions(backend="tpu")
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("tpu")


@pytest.mark.parametrize("field", ["dtype", "master_dtype", "optimizer_dtype"])
def test_cpu_backend_refuses_bf16(field):
    with pytest.raises(ValueError, match="fp32"):
        nanoq.Trainer(tiny_config(), nanoq.TrainOptions(backend="cpu", seq_len=8, **{field: "bf16"}))


def test_bad_dtype_names_are_rejected():
    with pytest.raises(ValueError, match="dtype"):
        nanoq.TrainOptions(dtype="fp16")


class FakeDeviceArray:
    """Carries only __cuda_array_interface__, as a foreign GPU array would."""

    def __init__(self, typestr="<i4", shape=(2, 8), strides=None, **extra):
        self.__cuda_array_interface__ = dict(typestr=typestr, shape=shape, strides=strides, data=(0, False),
                                             version=3, **extra)


def test_device_arrays_need_the_cuda_backend():
    with nanoq.Trainer(tiny_config(), nanoq.TrainOptions(backend="cpu", batch_size=2, seq_len=8)) as trainer:
        with pytest.raises(TypeError, match="cuda backend"):
            trainer.step(FakeDeviceArray(), FakeDeviceArray())
        host = np.zeros((2, 8), np.int32)
        with pytest.raises(TypeError, match="both"):
            trainer.step(host, FakeDeviceArray())


@pytest.mark.parametrize(
    "array, error, fragment",
    [
        (FakeDeviceArray(typestr="<i8"), TypeError, "int32"),
        (FakeDeviceArray(shape=(3, 8)), ValueError, "shape"),
        (FakeDeviceArray(strides=(4, 16)), ValueError, "contiguous"),
    ],
    ids=["int64", "shape", "strides"],
)
def test_device_array_checks_happen_before_any_pointer_is_used(array, error, fragment):
    with pytest.raises(error, match=fragment):
        _device_array("inputs", array, (2, 8))


# CUDA Array Interface v3: `stream` is where the producer's writes are
# queued; the core waits for it. None (or no entry, as in v2) needs no wait
# and becomes 0; 1 and 2 are the legacy and per-thread default streams.
@pytest.mark.parametrize("stream, expected", [(None, 0), (1, 1), (2, 2), (0x7F12_3456_7800, 0x7F12_3456_7800),
                                              (np.uint64(2**64 - 1), 2**64 - 1)],
                         ids=["none", "legacy", "per-thread", "handle", "numpy-handle"])
def test_device_array_streams_are_passed_on(stream, expected):
    assert _device_array("inputs", FakeDeviceArray(stream=stream), (2, 8)) == (0, expected)


def test_device_array_without_a_stream_entry_needs_no_wait():
    assert _interface_stream("inputs", dict(version=2)) == 0


@pytest.mark.parametrize("stream, error, fragment", [
    (0, ValueError, "disallows"),  # ambiguous between None and the default streams: the spec forbids it
    (-5, ValueError, "not a stream handle"),
    (2**64, ValueError, "not a stream handle"),
    (True, TypeError, "None or an int"),
    ("1", TypeError, "None or an int"),
    (1.0, TypeError, "None or an int"),
], ids=["zero", "negative", "too-large", "bool", "str", "float"])
def test_device_array_bad_streams_are_rejected(stream, error, fragment):
    with pytest.raises(error, match=fragment):
        _device_array("targets", FakeDeviceArray(stream=stream), (2, 8))


def test_device_batch_streams_reach_the_core(monkeypatch):
    """Trainer.step hands each array's stream to the core with the pointers
    (the cuda backend and the GPU-side token check are stood in for)."""
    calls = []

    class Core:
        micro_steps = 0
        world_size = 1
        vocab_size = tiny_config().vocab_size

        def wait_ready(self, milliseconds, for_step):
            return True

        def step_device(self, *args):
            calls.append(("step",) + args)

        def queue_validate_device(self, *args):
            calls.append(("validate",) + args)

        def validate_result(self):
            return dict(loss=0.0, loss_1k=0.0, z_loss=0.0, grad_norm=0.0, lse_max=0.0, lse_mean=0.0, tokens=0)

    monkeypatch.setattr("nanoq.trainer._check_device_tokens", lambda name, array, stream, vocab, ignore: 0)
    with nanoq.Trainer(tiny_config(), nanoq.TrainOptions(backend="cpu", batch_size=2, seq_len=8)) as trainer:
        core = trainer._core
        trainer.backend, trainer._core = "cuda", Core()
        try:
            trainer.step(FakeDeviceArray(stream=0x5000), FakeDeviceArray(stream=None))
            trainer.validate(FakeDeviceArray(stream=1), FakeDeviceArray(stream=2))
        finally:
            trainer._core = core
    assert calls == [("step", 0, 0, 0, 0x5000, 0), ("validate", 0, 0, 0, 1, 2)]
