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
