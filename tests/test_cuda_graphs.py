"""CUDA graphs: stream capture in the emulator, and the trainer's captured
steps.

The emulator records the work queued on a capturing stream instead of
running it, follows forks and joins through events, and replays a graph in a
random order that honours the recorded dependencies. What CUDA forbids
during a capture (a synchronisation, a host read, a query of a captured
event, pageable copies, calls that may synchronise in the stricter modes, a
fork never joined) fails the call and then the capture, as on a GPU.
"""
import ctypes
import os

import numpy as np
import pytest

import nanoq
from conftest import require_cuda_emulator

pytestmark = pytest.mark.cuda_emulated

UNSUPPORTED = 900       # cudaErrorStreamCaptureUnsupported
INVALIDATED = 901       # cudaErrorStreamCaptureInvalidated
UNJOINED = 904          # cudaErrorStreamCaptureUnjoined
ISOLATION = 905         # cudaErrorStreamCaptureIsolation
CAPTURED_EVENT = 907    # cudaErrorCapturedEvent


@pytest.fixture(scope="module")
def emulator():
    require_cuda_emulator()
    nanoq.backends()  # loads the emulated backend's library through the core
    lib = ctypes.CDLL(os.path.join(os.path.dirname(nanoq._core.__file__), "libnanoq_cuda_emulated.so"))
    lib.nanoq_emu_graph_selftest.restype = ctypes.c_int
    lib.nanoq_emu_graph_selftest.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p,
                                             ctypes.c_int]
    lib.nanoq_emu_graph_counts.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong)]
    return lib


def run_scenario(lib, name):
    out = np.zeros(8, np.int32)
    message = ctypes.create_string_buffer(4096)
    status = lib.nanoq_emu_graph_selftest(name.encode(), out.ctypes.data_as(ctypes.POINTER(ctypes.c_int)),
                                          message, 4096)
    return status, out, message.value.decode()


def graph_counts(lib):
    captured, launched = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    lib.nanoq_emu_graph_counts(ctypes.byref(captured), ctypes.byref(launched))
    return captured.value, launched.value


def test_a_captured_fork_and_join_is_recorded_then_replayed_in_order(emulator):
    before = graph_counts(emulator)
    status, out, message = run_scenario(emulator, "replay")
    assert status == 0, message
    assert out[0] == 0, "the capture ran work instead of recording it"
    # Three replays of (+1, side = 2 * main, +100): dependencies honoured.
    assert out[1] == 303 and out[2] == 2 * 203
    assert out[3] == 1, "the side stream joined the capture through the event"
    assert out[4] == 0, "ending the capture releases the side stream"
    after = graph_counts(emulator)
    assert after[0] - before[0] == 1 and after[1] - before[1] == 3


@pytest.mark.parametrize("scenario, code, words", [
    ("stream_synchronize", UNSUPPORTED, "cudaStreamSynchronize of a stream that is being captured"),
    ("stream_query", UNSUPPORTED, "cudaStreamQuery of a stream that is being captured"),
    ("device_synchronize", UNSUPPORTED, "cudaDeviceSynchronize while a stream"),
    ("event_query", CAPTURED_EVENT, "cudaEventQuery of an event last recorded in a stream capture"),
    ("event_synchronize", CAPTURED_EVENT, "cudaEventSynchronize of an event last recorded"),
    ("memcpy", UNSUPPORTED, "cudaMemcpy is not allowed while a stream is being captured in thread-local mode"),
    ("pageable_copy", UNSUPPORTED, "pageable host memory"),
    ("malloc_global", UNSUPPORTED, "cudaMalloc is not allowed while a stream is being captured in global mode"),
    ("outside_event", ISOLATION, "event recorded outside it"),
])
def test_a_call_cuda_forbids_in_a_capture_fails_and_invalidates_it(emulator, scenario, code, words):
    status, out, message = run_scenario(emulator, scenario)
    assert status == code, message
    assert words in message
    assert out[0] == INVALIDATED and out[1] == 0, "the capture must end invalidated, without a graph"


def test_cudamalloc_is_allowed_in_a_relaxed_capture(emulator):
    status, out, message = run_scenario(emulator, "malloc_relaxed")
    assert status == 0, message
    assert out[0] == 0 and out[1] == 1


def test_a_capture_whose_fork_is_never_joined_fails_to_end(emulator):
    status, out, message = run_scenario(emulator, "unjoined")
    assert status == 0, message
    assert out[0] == UNJOINED and out[1] == 0


# ---- the trainer's captured steps ---------------------------------------------
# A tiny Qwen3-like model (q/k norms, biases, GQA) so that every op runs in
# the captured step; grad_accum 2, so both kinds of micro-batch (the last
# starts the ZeRO reductions) are captured and replayed, and the per-step
# values (the dropout seed) change under the graphs.
GRAPH_CONFIG = nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, qkv_bias=True,
                                 qk_norm=True)
GRAPH_SEQ, GRAPH_ROWS, GRAPH_STEPS, GRAPH_ACCUM = 8, 4, 3, 2


def train_emulated(cuda_graphs, devices=1, **options):
    """Losses, gradient norms and weights after GRAPH_STEPS optimizer steps
    of grad_accum 2 on cuda_emulated, and the graphs captured and launched."""
    from nanoq.lora import LoraConfig

    if "lora" in options:
        options["lora"] = LoraConfig(**options["lora"])
    opts = nanoq.TrainOptions(backend="cuda_emulated", dtype="fp32", devices=devices,
                              batch_size=GRAPH_ROWS // devices, seq_len=GRAPH_SEQ, grad_accum=GRAPH_ACCUM, seed=5,
                              z_loss=1e-3, cuda_graphs=cuda_graphs, **options)
    lib = ctypes.CDLL(os.path.join(os.path.dirname(nanoq._core.__file__), "libnanoq_cuda_emulated.so"))
    lib.nanoq_emu_graph_counts.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong)]
    with nanoq.Trainer(GRAPH_CONFIG, opts) as trainer:
        trainer.init_weights(seed=7)
        if opts.lora is not None:
            trainer.init_adapters(seed=8)
        before = graph_counts(lib)
        stats = []
        for step in range(GRAPH_STEPS):
            for micro in range(GRAPH_ACCUM):
                rng = np.random.default_rng(100 * step + micro)
                tokens = rng.integers(0, GRAPH_CONFIG.vocab_size, (GRAPH_ROWS, GRAPH_SEQ + 1), dtype=np.int32)
                targets = np.ascontiguousarray(tokens[:, 1:])
                targets[rng.random(targets.shape) < 0.2] = -100
                trainer.step(np.ascontiguousarray(tokens[:, :-1]), targets)
            result = trainer.update(lr=1e-2 / (step + 1), grad_clip=0.5)
            stats.append((result.loss, result.grad_norm))
        after = graph_counts(lib)
        weights = trainer.get_weights(trainable_only=opts.lora is not None)
    return stats, weights, (after[0] - before[0], after[1] - before[1])


GRAPH_CASES = [
    pytest.param(1, {}, id="1-device"),
    pytest.param(2, {"zero_stage": 1}, id="2-devices-zero1"),
    pytest.param(2, {"zero_stage": 2}, id="2-devices-zero2"),
    pytest.param(2, {"zero_stage": 3}, id="2-devices-zero3"),
    pytest.param(2, {"lora": {"rank": 2, "alpha": 4.0, "dropout": 0.25, "targets": "all"}}, id="lora-dropout"),
    pytest.param(1, {"recompute": ("block",)}, id="recompute"),
]


@pytest.mark.parametrize("devices, options", GRAPH_CASES)
def test_captured_steps_train_bitwise_like_uncaptured_ones(devices, options):
    require_cuda_emulator()
    stats, weights, (captured, launched) = train_emulated(True, devices, **dict(options))
    plain_stats, plain_weights, (plain_captured, plain_launched) = train_emulated(False, devices, **dict(options))
    assert stats == plain_stats
    assert sorted(weights) == sorted(plain_weights)
    for name in weights:
        assert np.array_equal(weights[name], plain_weights[name]), name
    # One graph per kind of micro-batch and device, launched for every
    # micro-batch: the later ones are replays. Without graphs: none at all.
    assert captured == 2 * devices
    assert launched == GRAPH_STEPS * GRAPH_ACCUM * devices
    assert (plain_captured, plain_launched) == (0, 0)
