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
from nanoq.backends import device_count
from conftest import require_cuda_emulator

# Every test here runs on the emulator (cuda_emulated) but the GPU one.
emulated = pytest.mark.cuda_emulated

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


@emulated
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


@emulated
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
    assert out[2] == 0, "the failed capture still holds the work it recorded"


@emulated
def test_cudamalloc_is_allowed_in_a_relaxed_capture(emulator):
    status, out, message = run_scenario(emulator, "malloc_relaxed")
    assert status == 0, message
    assert out[0] == 0 and out[1] == 1
    assert out[2] == 0, "a destroyed graph still holds its work"


@emulated
def test_a_capture_whose_fork_is_never_joined_fails_to_end(emulator):
    status, out, message = run_scenario(emulator, "unjoined")
    assert status == 0, message
    assert out[0] == UNJOINED and out[1] == 0
    # Events recorded in it (the fork) still name the capture; its work is let go all the same (it held
    # the communicators of captured collectives: an abort after a step that failed mid-capture waited).
    assert out[2] == 0, "the failed capture still holds the work it recorded"


# ---- the trainer's captured steps ---------------------------------------------
# A tiny Qwen3-like model (q/k norms, biases, GQA) so that every op runs in
# the captured work; grad_accum 2, so both kinds of micro-batch (the last
# starts the ZeRO reductions) are captured and replayed, and the values that
# change from step to step (the dropout seed, lr, the gradient clip, the
# AdamW step) do so under the graphs: the clip is off at the step that
# captures and tiny (so that it clips) at the one that replays. Each run captures, per device, the two kinds of
# micro-batch, the update's work before and after the optimizer, and
# validate: five graphs, each called once per optimizer step: the first
# call runs uncaptured (the warm-up), the second captures and launches the
# graph, the third replays it.
GRAPH_CONFIG = nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8, qkv_bias=True,
                                 qk_norm=True)
GRAPH_SEQ, GRAPH_ROWS, GRAPH_STEPS, GRAPH_ACCUM = 8, 4, 3, 2
GRAPH_CLIPS = (0.5, 0.0, 1e-3)
GRAPHS_PER_DEVICE = 5
LAUNCHES_PER_DEVICE = GRAPHS_PER_DEVICE * (GRAPH_STEPS - 1)


def graph_batch(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, GRAPH_CONFIG.vocab_size, (GRAPH_ROWS, GRAPH_SEQ + 1), dtype=np.int32)
    targets = np.ascontiguousarray(tokens[:, 1:])
    targets[rng.random(targets.shape) < 0.2] = -100
    return np.ascontiguousarray(tokens[:, :-1]), targets


def train(backend, cuda_graphs, devices=1, **options):
    """The statistics of every update and validate and the weights after
    GRAPH_STEPS optimizer steps; on cuda_emulated also the graphs captured
    and launched meanwhile (else None)."""
    from nanoq.lora import LoraConfig

    if "lora" in options:
        options["lora"] = LoraConfig(**options["lora"])
    opts = nanoq.TrainOptions(backend=backend, dtype="fp32", devices=devices, batch_size=GRAPH_ROWS // devices,
                              seq_len=GRAPH_SEQ, grad_accum=GRAPH_ACCUM, seed=5, z_loss=1e-3,
                              cuda_graphs=cuda_graphs, **options)
    counts = None
    if backend == "cuda_emulated":
        lib = ctypes.CDLL(os.path.join(os.path.dirname(nanoq._core.__file__), "libnanoq_cuda_emulated.so"))
        lib.nanoq_emu_graph_counts.argtypes = [ctypes.POINTER(ctypes.c_ulonglong),
                                               ctypes.POINTER(ctypes.c_ulonglong)]
        counts = lambda: graph_counts(lib)  # noqa: E731
    with nanoq.Trainer(GRAPH_CONFIG, opts) as trainer:
        trainer.init_weights(seed=7)
        if opts.lora is not None:
            trainer.init_adapters(seed=8)
        before = counts() if counts else None
        stats = []
        for step in range(GRAPH_STEPS):
            for micro in range(GRAPH_ACCUM):
                trainer.step(*graph_batch(100 * step + micro))
            result = trainer.update(lr=1e-2 / (step + 1), grad_clip=GRAPH_CLIPS[step])
            check = trainer.validate(*graph_batch(1000 + step))
            stats.append((result.loss, result.grad_norm, check.loss, check.tokens))
        after = counts() if counts else None
        weights = trainer.get_weights(trainable_only=opts.lora is not None)
    launched = (after[0] - before[0], after[1] - before[1]) if counts else None
    return stats, weights, launched


# ZeRO stage 1 runs with LoRA (its adapters are the sharded parameters).
GRAPH_CASES = [
    (1, {"recompute": ("block",)}),
    (2, {"zero_stage": 1, "lora": {"rank": 2, "alpha": 4.0, "dropout": 0.25, "targets": "all"}}),
    (2, {"zero_stage": 2}),
    (2, {"zero_stage": 3}),
]
GRAPH_IDS = ["1-device-recompute", "2-devices-zero1-lora-dropout", "2-devices-zero2", "2-devices-zero3"]


def assert_bitwise_same_training(a, b):
    (stats, weights, _), (other_stats, other_weights, _) = a, b
    assert stats == other_stats
    assert sorted(weights) == sorted(other_weights)
    for name in weights:
        assert np.array_equal(weights[name], other_weights[name]), name


@emulated
@pytest.mark.parametrize("devices, options", GRAPH_CASES, ids=GRAPH_IDS)
def test_captured_steps_train_bitwise_like_uncaptured_ones(devices, options, emulator):
    require_cuda_emulator()
    emulator.nanoq_emu_nccl_teardowns_under_graphs.restype = ctypes.c_ulonglong
    teardowns_under_graphs = emulator.nanoq_emu_nccl_teardowns_under_graphs()
    captured = train("cuda_emulated", True, devices, **dict(options))
    # Closing destroyed each device's graphs before finalizing its NCCL
    # communicator (the real library's finalize waits for ever on a graph
    # that holds one of its collectives; the emulated one refuses).
    assert emulator.nanoq_emu_nccl_teardowns_under_graphs() == teardowns_under_graphs
    plain = train("cuda_emulated", False, devices, **dict(options))
    assert_bitwise_same_training(captured, plain)
    # Each graph captured once per device and launched at every call after
    # the warm-up. Without graphs: none at all.
    assert captured[2] == (GRAPHS_PER_DEVICE * devices, LAUNCHES_PER_DEVICE * devices)
    assert plain[2] == (0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("devices, options", GRAPH_CASES, ids=GRAPH_IDS)
def test_captured_steps_train_bitwise_like_uncaptured_ones_on_the_gpu(devices, options, cuda_device):
    if devices > device_count("cuda"):
        pytest.skip(f"needs {devices} GPUs")
    assert_bitwise_same_training(train("cuda", True, devices, **dict(options)),
                                 train("cuda", False, devices, **dict(options)))
