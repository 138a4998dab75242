"""Gradient reductions overlapped with the backward (ZeRO stages 1 and 2).

Each layer's reduction is issued as soon as its backward is done and the
compute waits for it only later (stage 2: when its buffer is reused; both:
at the end of the backward), so it runs while the layers below compute. The
communication trace (a test hook) records, per device and in the order it
happened, when each layer's backward finished and when each reduction was
issued and waited for (and, on cpu, when the communication thread ran it).
The overlapped run is compared bitwise with the synchronous path it replaced
(kept behind ``nanoq.testing.synchronous_reductions``: stage 1 reduce-scatters everything in
update(), stage 2 reduces each layer before the next one computes).
"""
import numpy as np
import pytest

import nanoq
from nanoq import testing
from conftest import CUDA_BACKENDS, use_cuda_backend

CONFIG = nanoq.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, qkv_bias=True, tie_word_embeddings=False)
SEQ, ROWS_PER_DEVICE, STEPS = 8, 2, 2
LAYERS = CONFIG.num_hidden_layers
HEAD = LAYERS  # the trace's label of the final norm and lm_head


def batch(devices, step, micro):
    rows = ROWS_PER_DEVICE * devices
    tokens = np.random.default_rng(100 * step + micro).integers(0, CONFIG.vocab_size, (rows, SEQ + 1),
                                                                   dtype=np.int32)
    targets = np.ascontiguousarray(tokens[:, 1:])
    targets[:, :micro] = -100
    return np.ascontiguousarray(tokens[:, :-1]), targets


def train(backend, devices, stage, grad_accum, offload=(), overlap=True):
    """Losses, weights, the gradients before the last update and each
    device's trace of every micro-batch, per optimizer step."""
    options = nanoq.TrainOptions(backend=backend, devices=devices, batch_size=ROWS_PER_DEVICE, seq_len=SEQ,
                                 grad_accum=grad_accum, zero_stage=stage, offload=offload, seed=3)
    with nanoq.Trainer(CONFIG, options) as trainer:
        testing.synchronous_reductions(trainer, not overlap)
        testing.trace_communication(trainer)
        losses, traces, gradients = [], [], None
        for step in range(STEPS):
            micro_traces = []
            for micro in range(grad_accum):
                trainer.step(*batch(devices, step, micro))
                micro_traces.append([testing.communication_trace(trainer, d) for d in range(devices)])
            if step == STEPS - 1:
                gradients = trainer.get_gradients()
            losses.append(trainer.update(lr=1e-2, weight_decay=0.1, grad_clip=1.0).loss)
            traces.append(micro_traces)
        return losses, trainer.get_weights(), gradients, traces


def position(trace, what, layer):
    found = [i for i, (w, l, _) in enumerate(trace) if w == what and l == layer]
    assert len(found) == 1, f"{what} of layer {layer}: {len(found)} times in {trace}"
    return found[0]


def assert_overlapped(trace, stage, on_cpu):
    """Layer L's reduction was issued before layer L-1's backward finished,
    and the compute first waited for it after that; the embedding's and the
    head's reductions were issued and waited for too."""
    for layer in range(LAYERS - 1, 0, -1):
        issued = position(trace, "issue", layer)
        below_done = position(trace, "backward", layer - 1)
        waited = position(trace, "wait", layer)
        assert position(trace, "backward", layer) < issued < below_done < waited, (layer, trace)
    # Stage 2 reuses a buffer two layers on: layer L's reduction is waited
    # for before layer L-2's backward, never before L-1's.
    if stage == 2:
        for layer in range(LAYERS - 1, 1, -1):
            assert position(trace, "wait", layer) < position(trace, "backward", layer - 2), (layer, trace)
    for label in (-1, HEAD):
        assert position(trace, "issue", label) < position(trace, "wait", label), (label, trace)
    tickets = {ticket for what, _, ticket in trace if what == "issue"}
    assert len(tickets) == LAYERS + 2
    ran = [ticket for what, _, ticket in trace if what == "comm-start"]
    if on_cpu:
        # Every reduction ran on the communication thread, not the worker's.
        assert tickets <= set(ran), trace
    else:
        assert not ran  # the cuda communicator runs collectives on a stream, not a thread
        # The compute stream was first made to wait for layer L's reduction
        # after layer L-1's backward had been queued.
        issue_ticket = {layer: ticket for what, layer, ticket in trace if what == "issue"}
        stream_waits = [(i, ticket) for i, (what, _, ticket) in enumerate(trace) if what == "compute-waits"]
        for layer in range(LAYERS - 1, 0, -1):
            first = min(i for i, ticket in stream_waits if ticket >= issue_ticket[layer])
            assert first > position(trace, "backward", layer - 1), (layer, trace)


def assert_synchronous(trace, stage):
    if stage == 1:  # everything waits for update()
        assert not [e for e in trace if e[0] in ("issue", "wait", "backward")], trace
        return
    for layer in range(LAYERS - 1, 0, -1):
        assert position(trace, "wait", layer) < position(trace, "backward", layer - 1), (layer, trace)
    assert not [e for e in trace if e[0] == "comm-start"], trace


def assert_same_run(overlapped, synchronous, label):
    losses, weights, gradients, _ = overlapped
    base_losses, base_weights, base_gradients, _ = synchronous
    assert losses == base_losses, label
    for name in base_weights:
        assert np.array_equal(weights[name], base_weights[name]), (label, name)
        assert np.array_equal(gradients[name], base_gradients[name]), (label, name)


def check_overlap(backend, devices, stage, grad_accum, offload=()):
    overlapped = train(backend, devices, stage, grad_accum, offload)
    synchronous = train(backend, devices, stage, grad_accum, offload, overlap=False)
    assert_same_run(overlapped, synchronous, f"{backend}, {devices} devices, stage {stage}, accum {grad_accum}")
    for micro_traces, sync_micro_traces in zip(overlapped[3], synchronous[3]):
        for micro in range(grad_accum):
            for device in range(devices):
                trace, sync_trace = micro_traces[micro][device], sync_micro_traces[micro][device]
                if stage == 1 and micro < grad_accum - 1:
                    # Gradients are not final before the last micro-batch: nothing is reduced.
                    assert not [e for e in trace if e[0] in ("issue", "comm-start")], trace
                else:
                    assert_overlapped(trace, stage, on_cpu=backend == "cpu")
                assert_synchronous(sync_trace, stage)


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("grad_accum", [1, 3])
def test_reductions_overlap_the_backward_and_change_no_bit(devices, stage, grad_accum):
    check_overlap("cpu", devices, stage, grad_accum)


@pytest.mark.parametrize("devices", [2, 3])
def test_overlap_with_offloaded_gradients_changes_no_bit(devices):
    check_overlap("cpu", devices, 2, 3, offload=("gradients",))


def test_an_early_update_reduces_the_whole_buffer_at_stage_one():
    """update() after fewer than grad_accum micro-batches: no backward
    reduced anything, update() reduce-scatters the whole buffer, and the
    result is the synchronous path's."""
    runs = []
    for overlap in (True, False):
        options = nanoq.TrainOptions(backend="cpu", devices=2, batch_size=ROWS_PER_DEVICE, seq_len=SEQ,
                                     grad_accum=3, seed=3)
        with nanoq.Trainer(CONFIG, options) as trainer:
            testing.synchronous_reductions(trainer, not overlap)
            testing.trace_communication(trainer)
            losses = []
            for step in range(2):
                for micro in range(2):
                    trainer.step(*batch(2, step, micro))
                assert not [e for e in testing.communication_trace(trainer, 0) if e[0] == "issue"]
                losses.append(trainer.update(lr=1e-2).loss)
            runs.append((losses, trainer.get_weights()))
    assert runs[0][0] == runs[1][0]
    for name, value in runs[0][1].items():
        assert np.array_equal(value, runs[1][1][name]), name


def test_a_worker_failing_while_reductions_are_in_flight_fails_the_step_cleanly():
    """Rank 1 fails at the start of a step while rank 0's reductions of that
    step wait for it on the communication thread: the next waiting call
    raises rank 1's error (not a hang, not the abandoned collectives), the
    trainer refuses further work and closes."""
    options = nanoq.TrainOptions(backend="cpu", devices=2, batch_size=ROWS_PER_DEVICE, seq_len=SEQ, zero_stage=2)
    trainer = nanoq.Trainer(CONFIG, options)
    trainer.step(*batch(2, 0, 0))
    trainer.update(lr=1e-2)
    testing.fail_next_step(trainer, 1)
    with pytest.raises(nanoq.NanoqError, match="injected fault in worker 1"):
        trainer.step(*batch(2, 1, 0))
        trainer.update(lr=1e-2)  # steps are asynchronous: the failure surfaces by this wait at the latest
    with pytest.raises(nanoq.NanoqError, match="stopped after a worker failure"):
        trainer.validate(*batch(2, 1, 0))
    trainer.close()


CUDA = [pytest.param(name, marks=mark, id=name) for name, mark in CUDA_BACKENDS]


@pytest.mark.parametrize("backend", CUDA)
@pytest.mark.parametrize("stage, grad_accum, offload", [(1, 1, ()), (1, 3, ()), (2, 3, ("gradients",))])
def test_cuda_reductions_overlap_the_backward_and_change_no_bit(request, backend, stage, grad_accum, offload):
    use_cuda_backend(backend, request)
    if nanoq._core.device_count(backend) < 2:
        pytest.skip("needs 2 GPUs")  # the emulator has 4 devices: never skipped there
    check_overlap(backend, 2, stage, grad_accum, offload)
