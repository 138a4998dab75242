"""The classifier's chunk of rows, sized by the memory budget.

The fused classifier computes the logits [rows, vocab] a chunk of rows at a
time in a stack buffer. The chunk is the backend's smallest
(BackendPlugin::classifier_chunk_elements) at least and grows, up to all
rows (one chunk: one pass, one head-gradient matmul), into what the memory
limit leaves once everything else is counted; on the cuda backend the
device's memory stands in for a limit. The Trainer and the memory plan
choose alike, so the plan stays exact. One chunk and several give the same
loss and gradients, both held to a float64 PyTorch reference.
"""
import dataclasses

import numpy as np
import pytest
import torch

import nanoq
from nanoq import _core
from conftest import CUDA_BACKENDS, IGNORE, assert_tensors_close, build_hf_model, save_hf_model, use_cuda_backend

# 65536 logits per row: the cpu backend's 4M-element chunk holds 64 of the 128 rows.
VOCAB, BATCH, SEQ = 65536, 8, 16
ROWS = BATCH * SEQ
CONFIG = nanoq.ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2)
CPU = nanoq.TrainOptions(backend="cpu", dtype="fp32", devices=1, batch_size=BATCH, seq_len=SEQ, threads=1)
ROW_BYTES = 4 * VOCAB  # one more row of float32 logits on the stack


def plan(options, config=CONFIG, **more):
    """(allocations as (context, name, bytes, kind), stack capacity, device bytes) of device 0."""
    device = _core.plan_memory(config.to_core(), dataclasses.asdict(options), **more)[0]
    allocations = [(a["context"], a["name"], a["bytes"], a["kind"]) for a in device["allocations"]]
    return allocations, device["stack_capacity"], sum(a[2] for a in allocations if a[3] == "device")


def test_without_a_limit_the_cpu_backend_keeps_its_chunk_and_a_limit_grows_it_to_the_largest_that_fits():
    _, least_stack, need = plan(CPU)
    _, all_stack, all_need = plan(dataclasses.replace(CPU, memory_limit=1 << 34))
    # One chunk of all 128 rows: 64 rows more of logits on the stack (and 8 bytes a row of per-row scratch).
    assert all_stack - least_stack == (ROWS - 64) * ROW_BYTES
    assert all_need - need == (ROWS - 64) * (ROW_BYTES + 8)
    for extra_rows in (1, 17, 40):
        limit = need + extra_rows * (ROW_BYTES + 8) + 100
        _, stack, allocated = plan(dataclasses.replace(CPU, memory_limit=limit))
        assert stack - least_stack == extra_rows * ROW_BYTES
        assert allocated <= limit < allocated + ROW_BYTES + 8, "the largest chunk that fits, and no larger"
    # A limit the least chunk does not fit still fails (the chunk never shrinks below the backend's).
    with pytest.raises(nanoq.OutOfMemoryError, match="out of memory on device 0"):
        plan(dataclasses.replace(CPU, memory_limit=need - 1))


def test_the_trainer_allocates_the_chunk_the_plan_chose():
    _, _, need = plan(CPU)
    for limit in (0, need + 23 * (ROW_BYTES + 8), 1 << 34):
        options = dataclasses.replace(CPU, memory_limit=limit)
        allocations, stack, _ = plan(options)
        with nanoq.Trainer(CONFIG, options) as trainer:
            real = [(a["context"], a["name"], a["bytes"], a["kind"]) for a in trainer.get_allocations(0)]
            assert real == allocations
            assert trainer.get_stack_info(0)["capacity"] == stack


@pytest.mark.parametrize("backend", [pytest.param(name, marks=mark, id=name) for name, mark in CUDA_BACKENDS])
def test_cuda_chunk_grows_into_the_device_memory_and_the_plan_knows_it(backend, request):
    """The emulator's devices report 16 GiB (a GPU its own memory): without
    a limit the whole logits fit; a limit just short of that keeps the
    64M-element chunk (1024 of 2048 rows here). Plan and Trainer agree."""
    use_cuda_backend(backend, request)
    options = nanoq.TrainOptions(backend=backend, dtype="bf16", devices=1, batch_size=2, seq_len=1024)
    _, stack, _ = plan(options)
    _, _, need = plan(dataclasses.replace(options, memory_limit=1 << 40))
    tight = dataclasses.replace(options, memory_limit=need - 1024 * 2 * VOCAB)
    tight_allocations, tight_stack, _ = plan(tight)
    assert stack - tight_stack == 1024 * 2 * VOCAB  # 1024 more bf16 rows of logits
    with nanoq.Trainer(CONFIG, options) as trainer:
        assert trainer.get_stack_info(0)["capacity"] == stack
    with nanoq.Trainer(CONFIG, tight) as trainer:
        assert trainer.get_stack_info(0)["capacity"] == tight_stack
        assert [(a["context"], a["name"], a["bytes"], a["kind"]) for a in trainer.get_allocations(0)] == \
            tight_allocations


def float64_reference(model, inputs, targets):
    """Mean cross-entropy over counted tokens and its parameter gradients, in float64."""
    model = model.double()
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=torch.from_numpy(inputs).long()).logits
    tgt = torch.from_numpy(targets).long()
    mask = tgt != IGNORE
    ce = torch.logsumexp(logits, -1) - logits.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    loss = ce[mask].sum() / mask.sum()
    loss.backward()
    return loss.item(), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def test_one_chunk_and_two_give_the_float64_reference_loss_and_gradients(tmp_path):
    model = build_hf_model("llama", vocab_size=VOCAB)
    path = save_hf_model(model, tmp_path / "model")
    rng = np.random.default_rng(5)
    inputs = rng.integers(0, VOCAB, (BATCH, SEQ), dtype=np.int32)
    targets = rng.integers(0, VOCAB, (BATCH, SEQ), dtype=np.int32)
    targets[rng.random((BATCH, SEQ)) < 0.2] = IGNORE
    ref_loss, ref_grads = float64_reference(model, inputs, targets)
    config = nanoq.ModelConfig.from_pretrained(path)
    results = {}
    for name, limit in (("two chunks", 0), ("one chunk", 1 << 34)):
        with nanoq.Trainer(config, dataclasses.replace(CPU, memory_limit=limit)) as trainer:
            trainer.import_weights(path)
            trainer.step(inputs, targets)
            grads = trainer.get_gradients()
            stats = trainer.update(lr=0.0)
            results[name] = (trainer.get_stack_info(0)["capacity"], stats.loss, grads)
    assert results["one chunk"][0] - results["two chunks"][0] == (ROWS - 64) * ROW_BYTES
    for name, (_, loss, grads) in results.items():
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        assert_tensors_close(grads, ref_grads, 3e-5, name)
    assert_tensors_close(results["one chunk"][2], results["two chunks"][2], 1e-5, "one chunk vs two")


@pytest.mark.parametrize("backend", [pytest.param(name, marks=mark, id=name) for name, mark in CUDA_BACKENDS])
def test_a_plan_given_the_device_memory_chooses_as_the_trainer_on_such_a_device(backend, request):
    """plan_memory(device_memory=D) plans the chunk the Trainer chooses on a
    device of D bytes (its budget: D less an eighth), without asking one:
    the emulator's 16 GiB devices, asked, and told; a smaller device equals a
    memory_limit of its budget; no device and no size keeps the least chunk."""
    use_cuda_backend(backend, request)
    options = nanoq.TrainOptions(backend=backend, dtype="bf16", devices=1, batch_size=2, seq_len=1024)
    one_chunk = plan(options)
    if backend == "cuda_emulated":  # (not asked, CUB's storage is a bound: compare the stacks)
        assert plan(options, ask_libraries=False, device_memory=16 << 30)[1] == one_chunk[1]
    least = plan(options, ask_libraries=False)
    assert one_chunk[1] - least[1] == 1024 * 2 * VOCAB  # the other 1024 bf16 rows of logits
    assert _core.plan_memory(CONFIG.to_core(), dataclasses.asdict(options), ask_libraries=False)[0][
        "classifier_rows"] == 1024
    # A device whose budget takes 300 rows more than the least chunk.
    budget = least[2] + 300 * 2 * VOCAB + 100
    device = budget * 8 // 7 + 7
    assert device - device // 8 >= budget > device - device // 8 - 2 * VOCAB
    sized = plan(options, ask_libraries=False, device_memory=device)
    assert sized == plan(dataclasses.replace(options, memory_limit=device - device // 8), ask_libraries=False)
    assert sized[1] - least[1] == 300 * 2 * VOCAB
    # memory_limit is the budget when given, as in the Trainer.
    assert plan(dataclasses.replace(options, memory_limit=budget), device_memory=1 << 40)[1] == sized[1]
    with pytest.raises(ValueError, match="device_memory must be a byte count"):
        plan(options, device_memory=-1)
