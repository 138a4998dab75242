"""Fused attention (cuDNN's SDPA) in the cuda backend, TrainOptions.attention.

The emulator cannot run cuDNN, so the emulated build links a stand-in engine
(cuda_core/cuda/emulator/emu_attention.cpp: a float64 reference on the
stream) behind the same host path as cuDNN: the choice between fused and
native attention, the plans built once per shape and pass, and the workspace
reserved through the named allocator. The ``cuda_emulated`` tests check that
path and the stand-in's numbers against the native kernel and the cpu
backend; the ``gpu`` tests check cuDNN itself against PyTorch's SDPA in
float64 and whole training steps against the native kernel (bench/gpu_check.sh
runs them on a GPU).

Tolerances: bf16 outputs against an fp32/float64 reference within 2e-2 of the
output's max |value| (test_gpu_ops.py's bound: the output is rounded to bf16,
relative step 2^-8, and cuDNN sums in fp32 in its own order); lse (fp32)
within 1e-4 on the emulator (both sides compute in fp32 or better) and 2e-3 on
a GPU (cuDNN's fp32 exponentials are approximate). Training losses of fused
and native attention in bf16 within 2e-2 of each other over a few steps, the
bound test_gpu_training.py uses for bf16 against fp32.
"""

import dataclasses
import math

import numpy as np
import pytest

import nanoq
from nanoq.backends import attention_library
from nanoq.memory import _planned_options
from nanoq.testing import OpRunner
from conftest import (
    assert_array_close,
    assert_tensors_close,
    random_batch,
    require_cuda_emulator,
)

BF16_REL = 2e-2
LSE_REL_EMULATED = 1e-4
STANDIN = "cuDNN stand-in"

emulated = pytest.mark.cuda_emulated
gpu = pytest.mark.gpu


def to_bf16(x):
    """x rounded to the nearest bf16 (ties to even), as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def attention_inputs(seed, shape):
    B, T, H, K, D = shape
    rng = np.random.default_rng(seed)
    q = to_bf16(rng.standard_normal((B, T, H, D)) * 2.0)
    k = to_bf16(rng.standard_normal((B, T, K, D)) * 2.0)
    v = to_bf16(rng.standard_normal((B, T, K, D)))
    dout = to_bf16(rng.standard_normal((B, T, H, D)))
    return q, k, v, dout


@pytest.fixture(scope="module")
def cpu():
    return OpRunner("cpu")


@pytest.fixture(scope="module")
def emulated_ops():
    require_cuda_emulator()
    return OpRunner("cuda_emulated", 0)


# --------------------------------------------------------------------------
# The emulated build: the host path around the engine, and the stand-in
# --------------------------------------------------------------------------

# GQA groups 1, 2 and 4, head_dim 64 and 128, T off the native kernel's tiles.
EMULATED_SHAPES = [(1, 33, 4, 2, 64), (2, 17, 2, 2, 128), (1, 20, 8, 2, 64)]


def packed_positions(T, *rows):
    """positions [len(rows), T]: row r packs documents of the lengths rows[r]
    in turn (the last one cut at T), so that rows differ."""
    out = []
    for lengths in rows:
        row, n = [], 0
        while len(row) < T:
            row.extend(range(lengths[n % len(lengths)]))
            n += 1
        out.append(row[:T])
    return np.array(out, np.int32)


# Documents of one token, ones that start inside and at the edge of the
# native kernel's 32-key tiles, and one longer than a tile.
PACKED_ROWS = ([10, 23, 1, 40], [1, 32, 7], [33, 5])


@emulated
def test_packed_documents_run_fused_with_their_mask(cpu, emulated_ops):
    """With positions (the harness reserves their mask, as packed_documents
    does) the fused plans take the documents' mask as their bias: forward
    and backward match the cpu's masked attention within bf16, differ from
    the fused causal attention over whole rows, and came from the engine
    (its float64 reference), not the native kernels."""
    shape = (3, 48, 4, 2, 64)  # T a multiple of 8: the mask's rows 16-byte aligned, as cuDNN assumes
    q, k, v, dout = attention_inputs(21, shape)
    args = {"positions": packed_positions(48, *PACKED_ROWS)}
    fused_out, fused_lse = emulated_ops.attention_forward(q, k, v, dtype="bf16", fused=True, **args)
    native_out, _ = emulated_ops.attention_forward(q, k, v, dtype="bf16", **args)
    cpu_out, cpu_lse = cpu.attention_forward(q, k, v, **args)
    assert_array_close(fused_out, cpu_out, BF16_REL, "masked fused out vs cpu")
    assert_array_close(fused_lse, cpu_lse, LSE_REL_EMULATED, "masked fused lse vs cpu")
    assert not np.array_equal(fused_out, native_out)
    causal_out, _ = emulated_ops.attention_forward(q, k, v, dtype="bf16", fused=True)
    assert np.abs(causal_out - fused_out).max() > 0.1 * np.abs(cpu_out).max()
    out, lse = cpu.attention_forward(q, k, v, **args)
    fused = emulated_ops.attention_backward(dout, to_bf16(out), lse, q, k, v, dtype="bf16", fused=True, **args)
    expected = cpu.attention_backward(dout, to_bf16(out), lse, q, k, v, **args)
    for name, f, e in zip(("dq", "dk", "dv"), fused, expected):
        assert_array_close(f, e, BF16_REL, f"masked fused {name} vs cpu")


@emulated
def test_an_announced_mask_serves_its_positions_only(cpu):
    """The documents' mask written once for announced positions
    (positions_changed, as the trainer does per batch) serves the calls
    with those positions; a call with other positions writes its own, and
    the announced ones then get theirs written again (3 masks in all)."""
    import ctypes
    import os

    require_cuda_emulator()
    lib = ctypes.CDLL(os.path.join(os.path.dirname(nanoq._core.__file__), "libnanoq_cuda_emulated.so"))
    shape = (2, 40, 2, 2, 64)
    B, T, H, _, D = shape
    q, k, v, _ = attention_inputs(31, shape)
    first, second = packed_positions(T, [10, 23], [1, 32, 7]), packed_positions(T, [33, 5], [4])
    out = np.zeros((3, B, T, H, D), np.float32)
    masks = ctypes.c_longlong(0)
    message = ctypes.create_string_buffer(4096)
    floats = [a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) for a in (q, k, v, out)]
    ints = [a.ctypes.data_as(ctypes.POINTER(ctypes.c_int)) for a in (first, second)]
    status = lib.nanoq_emu_document_mask_reuse(B, T, H, D, *floats[:3], *ints, floats[3], ctypes.byref(masks),
                                               message, len(message))
    assert status == 0, message.value.decode()
    for call, positions in enumerate((first, second, first)):
        expected, _ = cpu.attention_forward(q, k, v, positions=positions)
        assert_array_close(out[call], expected, BF16_REL, f"call {call}: masked fused out vs cpu")
    assert np.array_equal(out[2], out[0])
    assert masks.value == 3


@emulated
def test_bidirectional_attention_runs_fused_without_the_causal_mask(cpu, emulated_ops):
    """causal=False is part of the fused plan (cuDNN's SDPA without its
    causal mask): forward and backward match the cpu's bidirectional
    attention and the native kernels within bf16, and differ from the causal
    plan."""
    shape = (1, 33, 4, 2, 64)
    q, k, v, dout = attention_inputs(22, shape)
    fused_out, fused_lse = emulated_ops.attention_forward(q, k, v, dtype="bf16", fused=True, causal=False)
    native_out, _ = emulated_ops.attention_forward(q, k, v, dtype="bf16", causal=False)
    cpu_out, cpu_lse = cpu.attention_forward(q, k, v, causal=False)
    assert_array_close(fused_out, cpu_out, BF16_REL, "bidirectional fused out vs cpu")
    assert_array_close(fused_out, native_out, BF16_REL, "bidirectional fused out vs native")
    assert not np.array_equal(fused_out, native_out)  # the engine ran (its float64 reference), not the kernels
    assert_array_close(fused_lse, cpu_lse, LSE_REL_EMULATED, "bidirectional fused lse vs cpu")
    causal_out, _ = emulated_ops.attention_forward(q, k, v, dtype="bf16", fused=True)
    assert np.abs(causal_out - fused_out).max() > 0.1 * np.abs(cpu_out).max()
    out, lse = cpu.attention_forward(q, k, v, causal=False)
    fused = emulated_ops.attention_backward(dout, to_bf16(out), lse, q, k, v, dtype="bf16", fused=True, causal=False)
    expected = cpu.attention_backward(dout, to_bf16(out), lse, q, k, v, causal=False)
    for name, f, e in zip(("dq", "dk", "dv"), fused, expected):
        assert_array_close(f, e, BF16_REL, f"bidirectional fused {name} vs cpu")


@emulated
@pytest.mark.parametrize("shape", EMULATED_SHAPES)
def test_fused_attention_forward_matches_native_kernel_and_cpu(cpu, emulated_ops, shape):
    q, k, v, _ = attention_inputs(1, shape)
    fused_out, fused_lse = emulated_ops.attention_forward(q, k, v, dtype="bf16", fused=True)
    native_out, native_lse = emulated_ops.attention_forward(q, k, v, dtype="bf16")
    cpu_out, cpu_lse = cpu.attention_forward(q, k, v)
    assert_array_close(fused_out, cpu_out, BF16_REL, "fused out vs cpu fp32")
    assert_array_close(fused_out, native_out, BF16_REL, "fused out vs native kernel")
    assert_array_close(fused_lse, cpu_lse, LSE_REL_EMULATED, "fused lse vs cpu fp32")
    assert_array_close(fused_lse, native_lse, LSE_REL_EMULATED, "fused lse vs native kernel")


@emulated
@pytest.mark.parametrize("shape", EMULATED_SHAPES)
def test_fused_attention_backward_matches_native_kernel_and_cpu(cpu, emulated_ops, shape):
    q, k, v, dout = attention_inputs(2, shape)
    out, lse = cpu.attention_forward(q, k, v)
    out = to_bf16(out)
    fused = emulated_ops.attention_backward(dout, out, lse, q, k, v, dtype="bf16", fused=True)
    native = emulated_ops.attention_backward(dout, out, lse, q, k, v, dtype="bf16")
    expected = cpu.attention_backward(dout, out, lse, q, k, v)
    for name, f, n, e in zip(("dq", "dk", "dv"), fused, native, expected):
        assert_array_close(f, e, BF16_REL, f"fused {name} vs cpu fp32")
        assert_array_close(f, n, BF16_REL, f"fused {name} vs native kernel")
    again = emulated_ops.attention_backward(dout, out, lse, q, k, v, dtype="bf16", fused=True)
    for name, f, g in zip(("dq", "dk", "dv"), fused, again):
        assert np.array_equal(f, g), f"fused {name}: two runs differ"


@emulated
def test_fused_attention_forward_feeds_native_backward(emulated_ops):
    """Both write the same lse (natural-log log-sum-exp of the scaled
    scores), so either forward can feed either backward."""
    shape = (1, 24, 4, 2, 64)
    q, k, v, dout = attention_inputs(3, shape)
    out, lse = emulated_ops.attention_forward(q, k, v, dtype="bf16", fused=True)
    mixed = emulated_ops.attention_backward(dout, out, lse, q, k, v, dtype="bf16")
    fused = emulated_ops.attention_backward(dout, out, lse, q, k, v, dtype="bf16", fused=True)
    for name, m, f in zip(("dq", "dk", "dv"), mixed, fused):
        assert_array_close(m, f, BF16_REL, f"native {name} from the fused forward")


@emulated
@pytest.mark.parametrize("dtype, head_dim, why", [("fp32", 64, "bf16 only"), ("bf16", 12, "head_dim")])
def test_fused_attention_refuses_what_cudnn_cannot_run(emulated_ops, dtype, head_dim, why):
    q, k, v, _ = attention_inputs(4, (1, 8, 2, 1, head_dim))
    with pytest.raises(ValueError, match=why):
        emulated_ops.attention_forward(q, k, v, dtype=dtype, fused=True)


def tiny_config(head_dim=16, heads=4, kv_heads=2):
    return nanoq.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                             rope_theta=1e4)


def emulated_options(attention, dtype="bf16", batch_size=2, seq_len=32):
    return nanoq.TrainOptions(backend="cuda_emulated", dtype=dtype, batch_size=batch_size, seq_len=seq_len,
                              attention=attention)


def train(checkpoint, options, batches, lr=3e-3):
    """Losses and the first step's gradients of a few AdamW steps, and the
    trainer's attention info at the end."""
    trainer = nanoq.Trainer(nanoq.ModelConfig.from_pretrained(checkpoint), options)
    with trainer:
        trainer.import_weights(checkpoint)
        losses, gradients = [], None
        for inputs, targets in batches:
            trainer.step(inputs, targets)
            if gradients is None:
                gradients = trainer.get_gradients()
            losses.append(trainer.update(lr=lr).loss)
        validation = trainer.validate(*batches[0]).loss
        return losses, gradients, validation, trainer.get_attention_info(0)


@emulated
@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_training_with_attention_cudnn_matches_native_on_the_emulator(checkpoints, variant):
    """O(1) random weights (conftest.randomize_), so attention is far from
    uniform and a wrong fused forward or backward would show."""
    require_cuda_emulator()
    rng = np.random.default_rng(5)
    batches = [random_batch(rng, rows=2) for _ in range(3)]
    path = checkpoints.path(variant)
    seq_len = batches[0][0].shape[1]
    native = train(path, emulated_options("native", seq_len=seq_len), batches)
    fused = train(path, emulated_options("cudnn", seq_len=seq_len), batches)
    for step, (f, n) in enumerate(zip(fused[0], native[0])):
        assert abs(f - n) <= BF16_REL * abs(n), f"{variant} step {step}: fused loss {f} vs native {n}"
    assert_tensors_close(fused[1], native[1], 5e-2, f"{variant} fused-attention gradients")
    assert abs(fused[2] - native[2]) <= BF16_REL * abs(native[2]), "validate"
    assert native[3] == dict(implementation="native", plans=0, documents="native", document_masks=0,
                             deterministic=True)
    # One plan per pass for the run's one shape, however many steps and validations ran.
    assert fused[3]["implementation"].startswith(STANDIN) and fused[3]["plans"] == 2, fused[3]


@emulated
def test_a_non_deterministic_backward_reaches_the_librarys_plans(checkpoints):
    """attention_deterministic=False builds the library's backward plan with
    its other algorithm (the stand-in refuses a call that asks for another
    algorithm than its plan's) and get_attention_info says so. The stand-in
    computes alike either way, so the losses are the deterministic run's;
    nanoq's own kernels are deterministic whatever the option. The
    workspace planned without a device then holds no dP (its bound shrinks)."""
    require_cuda_emulator()
    rng = np.random.default_rng(11)
    batches = [random_batch(rng, rows=2) for _ in range(2)]
    path = checkpoints.path("llama")
    seq_len = batches[0][0].shape[1]
    options = emulated_options("cudnn", seq_len=seq_len)
    deterministic = train(path, options, batches)
    atomic = train(path, dataclasses.replace(options, attention_deterministic=False), batches)
    assert deterministic[3]["deterministic"] and deterministic[3]["plans"] == 2, deterministic[3]
    assert not atomic[3]["deterministic"] and atomic[3]["plans"] == 2, atomic[3]
    assert atomic[0] == deterministic[0] and atomic[2] == deterministic[2]
    native = train(path, dataclasses.replace(options, attention="native", attention_deterministic=False), batches)
    assert native[3]["deterministic"]
    config = nanoq.ModelConfig.from_pretrained(path)

    def bound(**more):
        planned = nanoq._core.plan_memory(config.to_core(), _planned_options(dataclasses.replace(options, **more)),
                                          False)
        (workspace,) = [a for a in planned[0]["allocations"] if a["name"] == "cudnn-attention-workspace"]
        return workspace["bytes"]

    B, H = options.batch_size, config.num_attention_heads
    padded = -(-seq_len // 128) * 128
    assert bound() - bound(attention_deterministic=False) == 2 * B * H * padded * padded
    with pytest.raises(TypeError, match="attention_deterministic must be True or False"):
        dataclasses.replace(options, attention_deterministic=0)


def train_packed(config_or_path, options, batches, positions, lr=3e-3):
    """train() with the batches packed by `positions` (one array for all, or
    a list of one per batch; the validation takes the first batch's); also
    the trainer's allocations."""
    if not isinstance(positions, list):
        positions = [positions] * len(batches)
    path = config_or_path if isinstance(config_or_path, str) else None
    config = nanoq.ModelConfig.from_pretrained(path) if path else config_or_path
    with nanoq.Trainer(config, options) as trainer:
        if path:
            trainer.import_weights(path)
        losses, gradients = [], None
        for (inputs, targets), packed in zip(batches, positions):
            trainer.step(inputs, targets, packed)
            if gradients is None:
                gradients = trainer.get_gradients()
            losses.append(trainer.update(lr=lr).loss)
        validation = trainer.validate(*batches[0], positions[0]).loss
        return losses, gradients, validation, trainer.get_attention_info(0), trainer.get_allocations(0)


def masks(allocations):
    return [a for a in allocations if a["name"] == "attention-document-mask"]


@emulated
@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_packed_training_runs_fused_with_packed_documents(checkpoints, variant, capfd):
    """packed_documents reserves the documents' mask (bf16 [B,1,T,T], in
    the plan too) and the packed steps, their recomputation-free backward
    and validate run in the fused plans with a bias: losses and gradients
    match the native kernels' within bf16 and the cpu's within the bf16
    bound, and 4 plans were built (with and without a bias, per pass).
    Without packed_documents the same packed steps run the native kernels,
    bitwise, and say so once. Each step packs other documents (its call
    writes their mask, also where CUDA graphs replay it)."""
    require_cuda_emulator()
    rng = np.random.default_rng(8)
    batches = [random_batch(rng, rows=3) for _ in range(3)]
    B, T = batches[0][0].shape
    positions = [packed_positions(T, [5, 11], [1, 7, 8], [16]), packed_positions(T, [16], [9, 7], [2, 3]),
                 packed_positions(T, [1], [4, 12], [15, 1])]
    path = checkpoints.path(variant)

    def options(attention, **more):
        return nanoq.TrainOptions(backend="cuda_emulated", dtype="bf16", batch_size=B, seq_len=T,
                                  attention=attention, **more)

    native = train_packed(path, options("native"), batches, positions)
    fused = train_packed(path, options("cudnn", packed_documents=True), batches, positions)
    reference = train_packed(path, nanoq.TrainOptions(backend="cpu", batch_size=B, seq_len=T), batches, positions)
    for step, (f, n, r) in enumerate(zip(fused[0], native[0], reference[0])):
        assert abs(f - n) <= BF16_REL * abs(n), f"{variant} step {step}: fused loss {f} vs native {n}"
        assert abs(f - r) <= BF16_REL * abs(r), f"{variant} step {step}: fused loss {f} vs cpu {r}"
    assert_tensors_close(fused[1], native[1], 5e-2, f"{variant} masked fused-attention gradients")
    assert abs(fused[2] - native[2]) <= BF16_REL * abs(native[2]), "validate"
    # The engine ran (its float64 reference, not the native kernels).
    assert not all(np.array_equal(fused[1][name], native[1][name]) for name in native[1])
    assert fused[3]["implementation"].startswith(STANDIN) and fused[3]["plans"] == 4, fused[3]
    assert fused[3]["documents"] == fused[3]["implementation"]
    # Written once per batch (3 steps, 1 validate), not by each layer's forward and backward.
    assert fused[3]["document_masks"] == len(batches) + 1, fused[3]
    (mask,) = masks(fused[4])
    assert mask["bytes"] == 2 * B * T * T and mask["context"] == "workspace"
    estimate = nanoq.estimate_memory(nanoq.ModelConfig.from_pretrained(path),
                                     options("cudnn", packed_documents=True))
    assert [a.bytes for a in estimate.allocations if a.name == "attention-document-mask"] == [mask["bytes"]]
    assert masks(native[4]) == []
    capfd.readouterr()
    unmasked = train_packed(path, options("cudnn"), batches, positions)
    assert unmasked[0] == native[0] and unmasked[2] == native[2]
    assert masks(unmasked[4]) == [] and unmasked[3]["plans"] == 2 and unmasked[3]["document_masks"] == 0
    assert unmasked[3]["documents"] == "native" and unmasked[3]["implementation"].startswith(STANDIN)
    err = capfd.readouterr().err
    assert err.count("positions (packed documents) run in nanoq's own attention kernels") == 1, err
    assert "TrainOptions.packed_documents" in err


@emulated
def test_packed_training_on_two_devices_runs_each_devices_rows_with_its_own_mask(checkpoints):
    """Two devices (ZeRO-1): each reserves its mask and writes it from its
    own rows' positions; the run tracks the native kernels' within bf16."""
    require_cuda_emulator()
    rng = np.random.default_rng(12)
    batches = [random_batch(rng, rows=4) for _ in range(2)]
    T = batches[0][0].shape[1]
    positions = [packed_positions(T, [5, 11], [16], [1, 15], [8, 8]), packed_positions(T, [3], [16], [7, 9], [2])]
    path = checkpoints.path("llama")

    def options(attention, **more):
        return nanoq.TrainOptions(backend="cuda_emulated", dtype="bf16", devices=2, batch_size=2, seq_len=T,
                                  attention=attention, **more)

    native = train_packed(path, options("native"), batches, positions)
    with nanoq.Trainer(nanoq.ModelConfig.from_pretrained(path), options("cudnn", packed_documents=True)) as trainer:
        assert all(len(masks(trainer.get_allocations(device))) == 1 for device in range(2))
    fused = train_packed(path, options("cudnn", packed_documents=True), batches, positions)
    for step, (f, n) in enumerate(zip(fused[0], native[0])):
        assert abs(f - n) <= BF16_REL * abs(n), f"step {step}: fused loss {f} vs native {n}"
    assert_tensors_close(fused[1], native[1], 5e-2, "two devices: masked fused-attention gradients")
    assert fused[3]["plans"] == 4 and fused[3]["document_masks"] == len(batches) + 1, fused[3]


@emulated
def test_a_library_that_refuses_the_documents_mask(capfd, monkeypatch):
    """attention="cudnn" with packed_documents insists: a library that
    cannot build the plans with a bias is an error at Trainer creation (and
    in the memory plan's Trainer-free check it is not asked). "auto" keeps
    the fused plans for whole rows and runs packed documents in the native
    kernels, saying why once, bitwise as attention="native" does."""
    require_cuda_emulator()
    monkeypatch.setenv("NANOQ_EMU_ATTENTION_NO_BIAS", "1")
    # A shape no other test plans: the device's plans are kept for the
    # process, and a plan another test built would not be refused.
    config = tiny_config(head_dim=40)
    rng = np.random.default_rng(9)
    batches = [random_batch(rng, rows=2, seq_len=32, vocab=256) for _ in range(2)]
    positions = packed_positions(32, [3, 29], [32])
    with pytest.raises(ValueError, match=r'attention="cudnn" cannot run packed documents .*NO_BIAS'):
        nanoq.Trainer(config, nanoq.TrainOptions(backend="cuda_emulated", dtype="bf16", batch_size=2, seq_len=32,
                                                 attention="cudnn", packed_documents=True))
    monkeypatch.setenv("NANOQ_EMU_ATTENTION_PREFERRED", "1")
    auto = nanoq.TrainOptions(backend="cuda_emulated", dtype="bf16", batch_size=2, seq_len=32, attention="auto",
                              packed_documents=True)
    capfd.readouterr()
    fused = train_packed(config, auto, batches, positions)
    err = capfd.readouterr().err
    assert err.count("packed documents run in nanoq's own attention kernels") == 1, err
    assert "with a document mask" in err and "NO_BIAS" in err
    assert fused[3]["implementation"].startswith(STANDIN) and masks(fused[4]) == []
    assert fused[3]["documents"] == "native"
    native = train_packed(config, dataclasses.replace(auto, attention="native"), batches, positions)
    assert fused[0] == native[0] and fused[2] == native[2]


@emulated
def test_the_document_mask_needs_seq_len_a_multiple_of_8(capfd, monkeypatch):
    """The mask's rows are seq_len bf16 values; cuDNN assumes each row
    16-byte aligned without checking it (wrong output otherwise), so a
    seq_len that is not a multiple of 8 runs packed documents natively:
    "cudnn" refuses at Trainer creation, "auto" says why once and keeps
    the fused plans for whole rows."""
    require_cuda_emulator()
    config = tiny_config()
    options = nanoq.TrainOptions(backend="cuda_emulated", dtype="bf16", batch_size=2, seq_len=12,
                                 attention="cudnn", packed_documents=True)
    with pytest.raises(ValueError, match=r'attention="cudnn" cannot run packed documents .*multiple of 8 .*got 12'):
        nanoq.Trainer(config, options)
    monkeypatch.setenv("NANOQ_EMU_ATTENTION_PREFERRED", "1")
    capfd.readouterr()
    with nanoq.Trainer(config, dataclasses.replace(options, attention="auto")) as trainer:
        info = trainer.get_attention_info(0)
        assert info["implementation"].startswith(STANDIN) and info["documents"] == "native", info
        assert masks(trainer.get_allocations(0)) == []
    err = capfd.readouterr().err
    assert err.count("packed documents run in nanoq's own attention kernels: the document mask needs seq_len a "
                     "multiple of 8") == 1, err
    with nanoq.Trainer(config, dataclasses.replace(options, seq_len=16)) as trainer:
        assert trainer.get_attention_info(0)["documents"].startswith(STANDIN)


def test_packed_documents_need_a_causal_model():
    config = dataclasses.replace(tiny_config(), causal=False)
    with pytest.raises(ValueError, match="packed_documents needs a causal model"):
        nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", seq_len=32, packed_documents=True))
    with pytest.raises(TypeError, match="packed_documents must be True or False"):
        nanoq.TrainOptions(packed_documents=1)


def workspace(allocations):
    return [a for a in allocations if a["name"] == "cudnn-attention-workspace"]


@emulated
def test_attention_workspace_comes_from_the_named_allocator_and_the_plan():
    require_cuda_emulator()
    config = tiny_config(head_dim=16, heads=4, kv_heads=2)
    B, T, H, D = 2, 32, 4, 16
    with nanoq.Trainer(config, emulated_options("cudnn", batch_size=B, seq_len=T)) as trainer:
        (reserved,) = workspace(trainer.get_allocations(0))
        assert trainer.attention.startswith(STANDIN)
    # The stand-in's backward keeps a float64 dq accumulator: B*T*H*D doubles.
    assert reserved["context"] == "workspace" and reserved["kind"] == "device"
    assert reserved["bytes"] == 8 * B * T * H * D
    estimate = nanoq.estimate_memory(config, emulated_options("cudnn", batch_size=B, seq_len=T))
    (planned,) = [a for a in estimate.allocations if a.name == "cudnn-attention-workspace"]
    assert planned.bytes == reserved["bytes"] and planned.exact
    with nanoq.Trainer(config, emulated_options("native", batch_size=B, seq_len=T)) as trainer:
        assert workspace(trainer.get_allocations(0)) == []
    estimate = nanoq.estimate_memory(config, emulated_options("native", batch_size=B, seq_len=T))
    assert not [a for a in estimate.allocations if a.name == "cudnn-attention-workspace"]


@emulated
def test_the_unasked_workspace_bound_holds_the_deterministic_backwards_dp_buffer():
    """Where no device can be asked (a plan made without the libraries), the
    cuDNN workspace is planned at its bound, which must hold what the
    deterministic backward (cudnn_attention.cpp asks for it) keeps on
    Hopper: dP in bf16 for every query-key pair, B*H*T*T*2 bytes by the
    cuDNN frontend's own estimate (T padded to 64 for queries and 128 for
    keys), plus the row sums. That grows with T^2 and outgrows the flash
    route's fp32 buffers at training lengths (the old bound held only those)."""
    require_cuda_emulator()
    H, D = 14, 64  # Qwen2.5-0.5B's attention
    config = nanoq.ModelConfig(vocab_size=256, hidden_size=H * D, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=H, num_key_value_heads=2, head_dim=D, rope_theta=1e6,
                               max_position_embeddings=4096)

    def padded(n, m):
        return -(-n // m) * m

    for B, T in ((8, 1024), (1, 4096), (2, 1000)):
        options = emulated_options("cudnn", batch_size=B, seq_len=T)
        unasked = nanoq._core.plan_memory(config.to_core(), _planned_options(options), False)
        (bound,) = [a for a in unasked[0]["allocations"] if a["name"] == "cudnn-attention-workspace"]
        dp = 2 * B * H * padded(T, 64) * padded(T, 128)
        assert not bound["exact"] and bound["bytes"] >= dp + 4 * B * H * T, (B, T, bound["bytes"], dp)


@emulated
def test_a_library_that_throws_its_own_exception_refuses_the_plans(capfd, monkeypatch):
    """The cuDNN frontend throws std::runtime_error (not nanoq's errors) where
    no engine fits the attributes: that is the library refusing the plans,
    as a NanoqError would be. "cudnn" is a ValueError naming it at Trainer
    creation; "auto" runs the native kernels and says why once on stderr
    (only where the library failed: a fallback by the documented limits,
    such as fp32, is the options' choice and says nothing)."""
    require_cuda_emulator()
    monkeypatch.setenv("NANOQ_EMU_ATTENTION_THROW", "1")
    config = tiny_config(head_dim=24)  # a shape no other test plans (the plans are kept for the process)
    with pytest.raises(ValueError, match='attention="cudnn" cannot be used: .*No suitable implementation'):
        nanoq.Trainer(config, emulated_options("cudnn"))
    monkeypatch.setenv("NANOQ_EMU_ATTENTION_PREFERRED", "1")
    capfd.readouterr()
    with nanoq.Trainer(config, emulated_options("auto")) as trainer:
        assert trainer.attention == "native"
        assert workspace(trainer.get_allocations(0)) == []
    err = capfd.readouterr().err
    assert err.count('attention="auto" runs nanoq\'s own attention kernels') == 1, err
    assert "No suitable implementation" in err
    with nanoq.Trainer(config, emulated_options("auto", dtype="fp32")) as trainer:
        assert trainer.attention == "native"
    assert "runs nanoq's own attention kernels" not in capfd.readouterr().err


@emulated
def test_generation_runs_its_prompts_natively_and_keeps_the_runs_plans(checkpoints):
    """Generation's prompt pass is attention of another shape than the run's
    (B=1, the prompt's length): it runs in the native kernels rather than
    build and keep a plan for every prompt length (with cuDNN each compiled
    at run time, and each may need more workspace than was reserved). The
    trainer keeps the run's two plans, and greedy tokens are those of
    attention="native"."""
    require_cuda_emulator()
    path = checkpoints.path("llama")
    config = nanoq.ModelConfig.from_pretrained(path)
    prompts = ([1, 2, 3], [5, 6, 7, 8, 9, 10, 11])
    tokens, infos, built = {}, {}, {}
    for attention in ("native", "cudnn"):
        with nanoq.Trainer(config, emulated_options(attention, seq_len=32)) as trainer:
            trainer.import_weights(path)
            before = plans_built()
            tokens[attention] = [trainer.generate(prompt, 4, temperature=0) for prompt in prompts]
            built[attention] = plans_built() - before
            infos[attention] = trainer.get_attention_info(0)
    assert infos["cudnn"]["implementation"].startswith(STANDIN) and infos["cudnn"]["plans"] == 2, infos
    assert built == {"native": 0, "cudnn": 0}, built  # no plan of a prompt's shape
    assert tokens["cudnn"] == tokens["native"]


@emulated
def test_an_inference_trainer_builds_and_reserves_no_backward_plan(checkpoints):
    """nanoq generate / eval trainers (inference) never run attention's
    backward: only the forward plan is built, and its workspace reserved
    (before: the backward's too, with the deterministic route's B*H*T^2 dP:
    ~16 GiB for an eval at batch 4, 32 heads, T=8192)."""
    require_cuda_emulator()
    path = checkpoints.path("llama")
    config = nanoq.ModelConfig.from_pretrained(path)
    infos, workspace, built = {}, {}, {}
    for inference in (True, False):  # a shape no other test plans (the device keeps its plans)
        options = dataclasses.replace(emulated_options("cudnn", seq_len=56), inference=inference)
        before = plans_built()
        with nanoq.Trainer(config, options) as trainer:
            infos[inference] = trainer.get_attention_info(0)
            workspace[inference] = sum(a["bytes"] for a in trainer.get_allocations(0)
                                       if a["name"] == "cudnn-attention-workspace")
        built[inference] = plans_built() - before
    assert built == {True: 1, False: 1}, built  # the forward, then the training trainer's backward
    assert infos[False]["plans"] == 2 and infos[True]["plans"] == 1, infos
    assert infos[True]["implementation"].startswith(STANDIN), infos
    assert workspace[True] < workspace[False], workspace


def plans_built():
    """The plans the emulator's stand-in for cuDNN has built in this process."""
    import ctypes
    import os

    nanoq.backends()
    lib = ctypes.CDLL(os.path.join(os.path.dirname(nanoq._core.__file__), "libnanoq_cuda_emulated.so"))
    lib.nanoq_emu_attention_plans_built.restype = ctypes.c_longlong
    return lib.nanoq_emu_attention_plans_built()


@emulated
def test_planning_builds_each_shapes_plans_once_per_process():
    """Planning a run asks the library for its plans' workspace where a
    device can be asked. The engine it asks is kept for the process, so
    planning the same shapes again builds nothing more: estimate_memory
    again, or a Trainer's classifier-chunk search, which plans the run once
    per candidate (a vocabulary large enough that chunks are searched, on
    the emulated device's memory). On Hopper each cuDNN plan is compiled at
    run time. A Trainer's backend runs the device's plans: it builds none
    of its own."""
    require_cuda_emulator()
    config = dataclasses.replace(tiny_config(), vocab_size=1 << 16)
    # A shape no other test plans; 1056 rows, more than a least classifier chunk (2^26 logits / V = 1024 rows).
    options = emulated_options("cudnn", batch_size=2, seq_len=528)
    before = plans_built()
    nanoq.estimate_memory(config, options)
    assert plans_built() - before == 2  # a forward and a backward
    nanoq.estimate_memory(config, options)
    nanoq.estimate_memory(config, dataclasses.replace(options, memory_limit=1 << 30))  # chunks searched
    assert plans_built() - before == 2
    with nanoq.Trainer(config, dataclasses.replace(options, memory_limit=1 << 30)) as trainer:
        assert trainer.get_attention_info(0)["plans"] == 2
    with nanoq.Trainer(config, options) as trainer:
        assert trainer.get_attention_info(0)["plans"] == 2
    assert plans_built() - before == 2


@emulated
def test_auto_keeps_the_native_kernel_on_the_emulator():
    """The stand-in is a test double: "auto" never picks it (on a GPU, auto
    picks cuDNN: test_auto_picks_cudnn_on_a_gpu)."""
    require_cuda_emulator()
    with nanoq.Trainer(tiny_config(), emulated_options("auto")) as trainer:
        assert trainer.get_attention_info(0) == dict(implementation="native", plans=0, documents="native",
                                                     document_masks=0, deterministic=True)
        assert workspace(trainer.get_allocations(0)) == []


@emulated
@pytest.mark.parametrize("dtype, head_dim, why", [
    ("fp32", 16, "bf16 only"),
    ("bf16", 12, "multiple of 8"),
])
def test_attention_cudnn_is_refused_at_trainer_creation_where_unsupported(dtype, head_dim, why):
    require_cuda_emulator()
    config = tiny_config(head_dim=head_dim)
    with pytest.raises(ValueError, match=f'attention="cudnn" cannot be used: .*{why}'):
        nanoq.Trainer(config, emulated_options("cudnn", dtype=dtype))
    with pytest.raises(ValueError, match=why):
        nanoq.estimate_memory(config, emulated_options("cudnn", dtype=dtype))
    with nanoq.Trainer(config, emulated_options("auto", dtype=dtype)) as trainer:
        assert trainer.attention == "native"


@emulated
def test_backends_say_which_attention_library_is_built():
    require_cuda_emulator()
    (entry,) = [b for b in nanoq.backends() if b["name"] == "cuda_emulated"]
    assert f"attention: {STANDIN}" in entry["detail"]
    assert attention_library("cuda_emulated").startswith(STANDIN)
    assert attention_library("cpu") == ""


# --------------------------------------------------------------------------
# A GPU: cuDNN itself (bench/gpu_check.sh)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_ops(cuda_device):
    return OpRunner("cuda", cuda_device)


def require_cudnn():
    """cuDNN is an optional part of the cuda backend (its build says whether
    it found the wheels): its GPU tests skip, naming the fix, where it is
    not built in (bench/gpu_check.sh's summary lists it as run without)."""
    if not attention_library("cuda").startswith("cuDNN"):
        pytest.skip("the cuda backend was built without cuDNN: install nvidia-cudnn-cu13 and nvidia-cudnn-frontend "
                    "and rebuild with --no-build-isolation")


def torch_reference(q, k, v, dout):
    """out, lse [B,H,T], dq, dk, dv of causal GQA attention in float64 (PyTorch)."""
    import torch

    B, T, H, D = q.shape
    K = k.shape[2]
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64).permute(0, 2, 1, 3).requires_grad_() for x in (q, k, v))
    ek, ev = (x.repeat_interleave(H // K, dim=1) for x in (tk, tv))
    scores = tq @ ek.transpose(-1, -2) / np.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ ev
    out.backward(torch.tensor(dout, dtype=torch.float64).permute(0, 2, 1, 3))
    back = lambda x: x.permute(0, 2, 1, 3).detach().numpy().astype(np.float32)  # noqa: E731
    return back(out), lse.detach().numpy().astype(np.float32), back(tq.grad), back(tk.grad), back(tv.grad)


@gpu
@pytest.mark.parametrize("shape", [(2, 512, 8, 2, 64), (2, 384, 8, 8, 128), (1, 1024, 12, 2, 128),
                                   (4, 257, 4, 1, 64), (1, 256, 4, 2, 256)])
def test_cudnn_attention_matches_torch_float64(gpu_ops, shape):
    require_cudnn()
    q, k, v, dout = attention_inputs(6, shape)
    expected_out, expected_lse, *expected_grads = torch_reference(q, k, v, dout)
    out, lse = gpu_ops.attention_forward(q, k, v, dtype="bf16", fused=True)
    assert_array_close(out, expected_out, BF16_REL, f"cuDNN out {shape}")
    assert_array_close(lse, expected_lse, 2e-3, f"cuDNN lse {shape}")
    grads = gpu_ops.attention_backward(dout, to_bf16(out), lse, q, k, v, dtype="bf16", fused=True)
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_array_close(g, e, BF16_REL, f"cuDNN {name} {shape}")
    again = gpu_ops.attention_backward(dout, to_bf16(out), lse, q, k, v, dtype="bf16", fused=True)
    for name, g, h in zip(("dq", "dk", "dv"), grads, again):
        assert np.array_equal(g, h), f"cuDNN {name}: two runs differ (the deterministic backward was asked for)"
    # The other algorithm (attention_deterministic False: dq accumulated with atomics), to the same reference.
    grads = gpu_ops.attention_backward(dout, to_bf16(out), lse, q, k, v, dtype="bf16", fused=True,
                                       deterministic=False)
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_array_close(g, e, BF16_REL, f"cuDNN non-deterministic {name} {shape}")


@gpu
@pytest.mark.parametrize("shape", [(3, 512, 8, 2, 64), (2, 1024, 12, 2, 128), (2, 192, 8, 2, 64)])
def test_cudnn_attention_with_packed_documents_matches_the_cpu(cpu, gpu_ops, shape):
    """cuDNN's plans with the documents' mask as their bias (documents of
    one token, inside and across tiles) against the cpu's masked attention,
    in both backward algorithms. T = 192 (T % 128 == 64) is where a
    Hopper backward with a bias was reported to write NaN into dq."""
    require_cudnn()
    B, T = shape[:2]
    q, k, v, dout = attention_inputs(10, shape)
    positions = packed_positions(T, *([100, 7, 1, 300, 64], [T], [33, 200, 1])[:B])
    out, lse = gpu_ops.attention_forward(q, k, v, dtype="bf16", fused=True, positions=positions)
    expected_out, expected_lse = cpu.attention_forward(q, k, v, positions=positions)
    assert_array_close(out, expected_out, BF16_REL, f"cuDNN masked out {shape}")
    assert_array_close(lse, expected_lse, 2e-3, f"cuDNN masked lse {shape}")
    grads = gpu_ops.attention_backward(dout, to_bf16(out), lse, q, k, v, dtype="bf16", fused=True,
                                       positions=positions)
    expected = cpu.attention_backward(dout, to_bf16(out), lse, q, k, v, positions=positions)
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_array_close(g, e, BF16_REL, f"cuDNN masked {name} {shape}")
    grads = gpu_ops.attention_backward(dout, to_bf16(out), lse, q, k, v, dtype="bf16", fused=True,
                                       positions=positions, deterministic=False)
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_array_close(g, e, BF16_REL, f"cuDNN masked non-deterministic {name} {shape}")


@gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
def test_the_unasked_workspace_bound_holds_cudnns_workspace_at_a_long_sequence(cuda_device, deterministic):
    """The bound a plan made without a GPU reserves for cuDNN's workspace
    covers what cuDNN asks for at T = 2048 (where its margin no longer
    hides a term that grows with T or T^2), in both backward algorithms."""
    require_cudnn()
    config = tiny_config(head_dim=64)
    options = gpu_options("cudnn", batch_size=2, seq_len=2048, attention_deterministic=deterministic)
    with nanoq.Trainer(config, options) as trainer:
        (reserved,) = workspace(trainer.get_allocations(0))
    unasked = nanoq._core.plan_memory(config.to_core(), _planned_options(options), False)
    (bound,) = [a for a in unasked[0]["allocations"] if a["name"] == "cudnn-attention-workspace"]
    assert bound["bytes"] >= reserved["bytes"], (bound, reserved)


def gpu_run(seed):
    """The model of the GPU training tests (2 layers of 8 heads of 64, 2 kv
    heads, vocab 1000) and 4 random batches of 4 rows of 256 tokens."""
    config = nanoq.ModelConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=64, rope_theta=1e6)
    rng = np.random.default_rng(seed)
    return config, [random_batch(rng, rows=4, seq_len=256, vocab=1000) for _ in range(4)]


def gpu_options(attention, dtype="bf16", batch_size=4, seq_len=256, **more):
    return nanoq.TrainOptions(backend="cuda", dtype=dtype, batch_size=batch_size, seq_len=seq_len,
                              attention=attention, **more)


@gpu
def test_packed_training_with_cudnn_matches_native_on_a_gpu(cuda_device):
    require_cudnn()
    config, batches = gpu_run(11)
    positions = packed_positions(256, [100, 7, 1, 300], [256], [33, 64], [1, 2, 3])
    native = train_packed(config, gpu_options("native"), batches, positions)
    fused = train_packed(config, gpu_options("cudnn", packed_documents=True), batches, positions)
    for step, (f, n) in enumerate(zip(fused[0], native[0])):
        assert abs(f - n) <= BF16_REL * abs(n), f"step {step}: masked cuDNN loss {f} vs native {n}"
    assert abs(fused[2] - native[2]) <= BF16_REL * abs(native[2]), "validate"
    assert fused[3]["implementation"].startswith("cuDNN") and fused[3]["plans"] == 4, fused[3]
    assert fused[3]["document_masks"] == len(batches) + 1, fused[3]
    assert len(masks(fused[4])) == 1


@gpu
def test_training_with_cudnn_matches_native_on_a_gpu(cuda_device):
    require_cudnn()
    config, batches = gpu_run(7)
    runs = {}
    for attention in ("native", "cudnn"):
        with nanoq.Trainer(config, gpu_options(attention)) as trainer:  # the same seeded init
            losses = []
            for inputs, targets in batches:
                trainer.step(inputs, targets)
                losses.append(trainer.update(lr=3e-3).loss)
            runs[attention] = (losses, trainer.get_attention_info(0))
    (native, native_info), (fused, fused_info) = runs["native"], runs["cudnn"]
    for step, (f, n) in enumerate(zip(fused, native)):
        assert abs(f - n) <= BF16_REL * abs(n), f"step {step}: cuDNN loss {f} vs native {n}"
    assert native_info["implementation"] == "native"
    assert fused_info["implementation"].startswith("cuDNN") and fused_info["plans"] == 2, fused_info


@gpu
def test_auto_picks_cudnn_on_a_gpu_and_native_where_cudnn_cannot_run(cuda_device):
    require_cudnn()
    config = tiny_config(head_dim=64)
    with nanoq.Trainer(config, gpu_options("auto", seq_len=64)) as trainer:
        assert trainer.attention.startswith("cuDNN")
        (reserved,) = workspace(trainer.get_allocations(0))
    (planned,) = [a for a in nanoq.estimate_memory(config, gpu_options("auto", seq_len=64)).allocations
                  if a.name == "cudnn-attention-workspace"]
    assert planned.exact and planned.bytes == reserved["bytes"]
    # Without asking cuDNN (a plan made where no GPU can be asked), its upper bound.
    unasked = nanoq._core.plan_memory(config.to_core(), _planned_options(gpu_options("auto", seq_len=64)), False)
    (bound,) = [a for a in unasked[0]["allocations"] if a["name"] == "cudnn-attention-workspace"]
    assert not bound["exact"] and bound["bytes"] >= reserved["bytes"]
    with nanoq.Trainer(config, gpu_options("auto", dtype="fp32", seq_len=64)) as trainer:
        assert trainer.attention == "native"


@emulated
def test_training_run_says_which_attention_it_uses(tmp_path):
    from nanoq.training import train
    from test_training import tiny_config as tiny_run

    require_cuda_emulator()
    lines = []
    config = tiny_run(tmp_path, backend="cuda_emulated", dtype="bf16", attention="cudnn", steps=2, grad_accum=1,
                      eval_every=2)
    train(config, say=lines.append, progress=False)
    assert any(line.startswith(f"attention: {STANDIN}") and "'cudnn'" in line for line in lines), lines
    assert not any("packed documents" in line for line in lines)


@emulated
def test_a_packed_training_run_runs_its_documents_fused_and_says_so(tmp_path):
    """Files whose tokenization packs (data.packing auto) train with
    packed_documents: the documents run in the fused plans with their mask."""
    import json

    from nanoq.training import train
    from test_training import tiny_config as tiny_run

    require_cuda_emulator()
    lines = []
    config = tiny_run(tmp_path, backend="cuda_emulated", dtype="bf16", attention="cudnn", steps=2, grad_accum=1,
                      eval_every=2)
    (tmp_path / "data" / "tokenize.json").write_text(json.dumps({"packing": "pack", "eos_id": 16}))
    result = train(config, say=lines.append, progress=False)
    assert any(line.startswith(f"attention: {STANDIN}") and f"packed documents: {STANDIN}" in line
               for line in lines), lines
    records = [json.loads(line) for line in open(result.log_path)]
    assert all(math.isfinite(r["loss"]) for r in records if r["type"] == "train")


def test_runs_of_packed_data_reserve_the_documents_mask(tmp_path, monkeypatch):
    """nanoq train and nanoq memory set packed_documents from data.packing
    as the files resolve it (one rule, loop.run_packing): "pack", or "auto"
    on files whose tokenization packs (SFT), training's or eval's, any
    curriculum stage's; streamed windows do not."""
    import json

    from nanoq.data import write_token_shards
    from nanoq.training import load_config, loop, train
    from nanoq.training.settings import train_options
    from test_training import tiny_config as tiny_run

    for name, packing in (("sft", {"packing": "pack"}), ("text", {})):
        (tmp_path / name).mkdir()
        write_token_shards(str(tmp_path / name / "train"), np.arange(200, dtype=np.int32) % 10, 64)
        (tmp_path / name / "tokenize.json").write_text(json.dumps({**packing, "eos_id": 9}))  # documents of 10
    files = {name: str(tmp_path / name / "train_*.bin") for name in ("sft", "text")}
    expected = {("sft", None, "auto"): True, ("text", None, "auto"): False, ("text", None, "pack"): True,
                ("sft", None, "stream"): False, ("text", "sft", "auto"): True, ("text", "text", "auto"): False}
    for (train_files, eval_files, packing), packed in expected.items():
        fields = dict(train_data=files[train_files], packing=packing)
        if eval_files:
            fields["eval_data"] = files[eval_files]
        config = load_config(None, fields)
        assert train_options(config, loop.data_packing(config)).packed_documents is packed, (fields, packed)
    stages = f"{files['text']}@2; {files['sft']}@2"
    assert loop.data_packing(load_config(None, dict(curriculum=stages, steps=4))) == "pack"
    demo = load_config(None, {})
    assert not train_options(demo, loop.data_packing(demo)).packed_documents
    assert loop.data_packing(load_config(None, dict(packing="pack"))) == "pack"

    # train() decides as nanoq memory does: here only its eval files pack.
    seen = []

    def recording(config, packing=None):
        seen.append(packing)
        return train_options(config, packing)

    monkeypatch.setattr(loop, "train_options", recording)
    (tmp_path / "run").mkdir()
    config = tiny_run(tmp_path / "run", steps=1, grad_accum=1, eval_every=1, eval_data=files["sft"])
    assert loop.data_packing(config) == "pack"
    train(config, say=lambda line: None, progress=False)
    assert seen[0] == "pack", seen
