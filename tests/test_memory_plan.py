"""The core's memory plan (nanoq::plan_memory, _core.plan_memory): what a
Trainer would allocate, computed by the Trainer's own allocation sequence on
planning allocators, without a device and without creating a backend.

Held to the real thing: on every device of a real Trainer, the planned list
equals get_allocations entry for entry and the planned stack capacity equals
get_stack_info's, for a spread of options on the cpu backend and on the cuda
backend's code under the emulator. Planning allocates nothing: a model no
machine here could hold plans at once, and the plan needs no device (more
devices than the emulator has plan fine). A memory limit fails the plan
exactly as it fails the Trainer.
"""
import dataclasses
import math
import os
import re
import time

import pytest

import nanoq
from nanoq import _core
from nanoq.lora import LoraConfig
from nanoq.memory import estimate_memory, human_bytes
from conftest import require_cuda_emulator

SMALL = nanoq.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)
QWEN3 = nanoq.ModelConfig(vocab_size=80, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                          num_attention_heads=3, num_key_value_heads=1, head_dim=16, qk_norm=True)
BIAS = nanoq.ModelConfig(vocab_size=70, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, qkv_bias=True, tie_word_embeddings=True)
# Nano's options: a learned position table, biases on every projection, dropout.
NANO = nanoq.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True,
                         position_embedding="learned", max_position_embeddings=12, dropout=0.1)


def planned(config, options):
    """(allocations, stack capacity) per device from the binding: tuples
    context, name, bytes, kind (as get_allocations gives them)."""
    options = dataclasses.asdict(options)
    return [([(a["context"], a["name"], a["bytes"], a["kind"]) for a in plan["allocations"]], plan["stack_capacity"])
            for plan in _core.plan_memory(config.to_core(), options)]


def real(config, options):
    with nanoq.Trainer(config, options) as trainer:
        return [([(a["context"], a["name"], a["bytes"], a["kind"]) for a in trainer.get_allocations(device)],
                 trainer.get_stack_info(device)["capacity"]) for device in range(options.devices)]


# (model, devices, zero_stage, recompute, offload, LoRA)
CPU_SETUPS = [
    (SMALL, 1, 1, "", "", None),
    (SMALL, 2, 1, "swiglu", "optimizer", None),
    (SMALL, 3, 2, "ffn", "gradients", None),
    (QWEN3, 3, 3, "norms,qkv", "master", None),
    (QWEN3, 2, 3, "block", "optimizer,master,gradients", None),
    (BIAS, 3, 1, "", "master", None),
    (BIAS, 2, 2, "qkv", "", None),
    (SMALL, 3, 1, "", "", LoraConfig(4, dropout=0.1, targets="all")),
    (QWEN3, 2, 1, "block", "optimizer", LoraConfig(2, targets="o,down")),
    (BIAS, 1, 1, "ffn", "optimizer,master", LoraConfig(3, dropout=0.2, targets="q,v")),
    (NANO, 2, 3, "block", "optimizer", None),
    (NANO, 1, 1, "", "", LoraConfig(2, dropout=0.1, targets="all")),
]


@pytest.mark.parametrize("config,devices,stage,recompute,offload,lora", CPU_SETUPS)
def test_cpu_plan_equals_a_real_trainer_on_every_device(config, devices, stage, recompute, offload, lora):
    options = nanoq.TrainOptions(backend="cpu", dtype="fp32", devices=devices, batch_size=2, seq_len=8, threads=1,
                                 zero_stage=stage, recompute=recompute, offload=offload, lora=lora)
    plan = planned(config, options)
    assert len(plan) == devices
    assert plan == real(config, options)


def test_cpu_plan_shares_out_the_cores_as_the_trainer_does():
    # threads 0: the cpu backend's attention scratch depends on the cores per device.
    options = nanoq.TrainOptions(backend="cpu", dtype="fp32", devices=2, batch_size=1, seq_len=32, threads=0)
    assert planned(SMALL, options) == real(SMALL, options)


# (model, devices, zero_stage, dtype, master_dtype, recompute, offload, LoRA)
EMULATED_SETUPS = [
    (SMALL, 1, 1, "bf16", "fp32", "", "", None),
    (QWEN3, 2, 2, "bf16", "bf16", "ffn", "optimizer,gradients", None),
    (BIAS, 3, 3, "bf16", "fp32", "block", "master", None),
    (SMALL, 2, 1, "fp32", "fp32", "swiglu", "", LoraConfig(2, dropout=0.1, targets="q,down")),
    (NANO, 2, 2, "bf16", "fp32", "qkv", "", None),
]


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("config,devices,stage,dtype,master_dtype,recompute,offload,lora", EMULATED_SETUPS)
def test_emulated_cuda_plan_equals_a_real_trainer_on_every_device(config, devices, stage, dtype, master_dtype,
                                                                   recompute, offload, lora):
    require_cuda_emulator()
    options = nanoq.TrainOptions(backend="cuda_emulated", dtype=dtype, master_dtype=master_dtype, devices=devices,
                                 batch_size=1, seq_len=8, zero_stage=stage, recompute=recompute, offload=offload,
                                 lora=lora)
    plan = planned(config, options)
    assert plan == real(config, options)
    assert all(a["exact"] for device in _core.plan_memory(config.to_core(), dataclasses.asdict(options))
               for a in device["allocations"])


def test_planning_allocates_nothing():
    # Llama-3-70B-shaped in fp32 on 3 cpu devices: several times this machine's memory per device.
    config = nanoq.ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                               num_attention_heads=64, num_key_value_heads=8)
    options = nanoq.TrainOptions(backend="cpu", dtype="fp32", devices=3, batch_size=4, seq_len=4096, threads=1)
    start = time.perf_counter()
    estimate = estimate_memory(config, options)
    assert time.perf_counter() - start < 2.0
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert estimate.device_bytes > 2 * machine
    assert len(estimate.per_device) == 3 and len(estimate.stack_capacities) == 3
    weights = next(a for a in estimate.allocations if a.name == "weights")
    assert weights.bytes >= 4 * estimate.parameters


@pytest.mark.cuda_emulated
def test_planning_needs_no_device():
    # The emulator offers 4 devices: a Trainer on 8 is refused, the plan of one is not.
    require_cuda_emulator()
    options = nanoq.TrainOptions(backend="cuda_emulated", dtype="bf16", devices=8, batch_size=1, seq_len=8,
                                 zero_stage=3)
    assert _core.device_count("cuda_emulated") < 8
    with pytest.raises(ValueError, match="are available"):
        nanoq.Trainer(SMALL, options)
    plan = planned(SMALL, options)
    assert len(plan) == 8 and all(device == plan[0] for device in plan)
    # Each device's bf16 weight shard: the flat layout split eight ways.
    total = sum(math.prod(shape) for _, shape in _core.parameter_layout(SMALL.to_core()))
    assert {name: nbytes for _, name, nbytes, _ in plan[0][0]}["weight-shard"] == 2 * -(-total // 8)


@pytest.mark.parametrize("lora", [None, LoraConfig(4, targets="all")])
def test_memory_limit_fails_the_plan_exactly_as_it_fails_the_trainer(lora):
    options = nanoq.TrainOptions(backend="cpu", dtype="fp32", devices=1, batch_size=2, seq_len=8, threads=1,
                                 lora=lora)
    need = sum(nbytes for _, _, nbytes, kind in planned(QWEN3, options)[0][0] if kind == "device")
    assert planned(QWEN3, dataclasses.replace(options, memory_limit=need))[0][0] == real(QWEN3, options)[0][0]
    short = dataclasses.replace(options, memory_limit=need - 1)
    with pytest.raises(nanoq.OutOfMemoryError) as plan_error:
        planned(QWEN3, short)
    with pytest.raises(nanoq.OutOfMemoryError) as trainer_error:
        nanoq.Trainer(QWEN3, short)
    assert str(plan_error.value) == str(trainer_error.value)
    assert "allocating '" in str(plan_error.value)


@pytest.mark.parametrize("changes,message", [
    (dict(zero_stage=4), "zero_stage must be 1, 2 or 3"),
    (dict(offload=("gradients",)), "offloading gradients needs zero_stage 2 or 3"),
    (dict(zero_stage=2, lora=dict(rank=4, alpha=8.0, dropout=0.0, targets=("q",))), "LoRA trains at zero_stage 1"),
    (dict(recompute=("attention",)), "unknown recompute option 'attention'"),
    (dict(dtype="fp16"), 'dtype must be "fp32" or "bf16"'),
])
def test_plan_refuses_what_the_core_trainer_refuses(changes, message):
    # Past the Python checks: the core's own, which the plan shares with the Trainer.
    options = dataclasses.asdict(nanoq.TrainOptions(backend="cpu", dtype="fp32", devices=2, batch_size=1,
                                                    seq_len=8, threads=1))
    options.update(changes)
    with pytest.raises(ValueError, match=message):
        _core.plan_memory(SMALL.to_core(), options)
    with pytest.raises(ValueError, match=message):
        _core.CoreTrainer(SMALL.to_core(), options)


def test_parameter_layout_is_the_trainers():
    with nanoq.Trainer(QWEN3, nanoq.TrainOptions(backend="cpu", dtype="fp32", batch_size=1, seq_len=8,
                                                 threads=1)) as trainer:
        names = trainer.parameter_names
        weights = trainer.get_weights()
    layout = _core.parameter_layout(QWEN3.to_core())
    assert [name for name, _ in layout] == names
    assert all(weights[name].shape == shape for name, shape in layout)


def kv_cache_entries(allocations):
    return [(a["context"], a["name"], a["bytes"], a["kind"]) for a in allocations if a["context"] == "kv-cache"]


@pytest.mark.parametrize("config,devices,stage,lora", [
    (SMALL, 1, 1, None),
    (QWEN3, 2, 3, None),  # q/k norms add their own rows; the weights gathered per layer
    (BIAS, 2, 1, LoraConfig(2, targets="q,v")),
])
def test_the_plan_holds_the_kv_cache_that_generation_allocates(config, devices, stage, lora):
    options = nanoq.TrainOptions(backend="cpu", dtype="fp32", devices=devices, batch_size=3, seq_len=12, threads=1,
                                 zero_stage=stage, lora=lora)
    plans = _core.plan_memory(config.to_core(), dataclasses.asdict(options))
    estimate = estimate_memory(config, options)
    with nanoq.Trainer(config, options) as trainer:
        trainer.init_weights()
        trainer.generate([1, 2, 3], 4, temperature=0)
        allocated = [kv_cache_entries(trainer.get_allocations(device)) for device in range(devices)]
        summary = trainer.memory_summary()
    for device in range(devices):
        assert allocated[device] and kv_cache_entries(plans[device]["generation"]) == allocated[device]
        # The training plan itself is unchanged: a run that never generates holds no KV cache.
        assert not kv_cache_entries(plans[device]["allocations"])
        assert estimate.kv_cache_bytes == sum(entry[2] for entry in allocated[device]) \
            == summary[device]["contexts"]["kv-cache"]
    size = re.escape(human_bytes(estimate.kv_cache_bytes))
    assert re.search(rf"^kv-cache +{size}  generation", estimate.table(), re.MULTILINE)


@pytest.mark.cuda_emulated
def test_the_emulated_cuda_plan_holds_the_kv_cache_that_generation_allocates():
    require_cuda_emulator()
    options = nanoq.TrainOptions(backend="cuda_emulated", dtype="bf16", devices=2, batch_size=1, seq_len=8)
    plans = _core.plan_memory(QWEN3.to_core(), dataclasses.asdict(options))
    with nanoq.Trainer(QWEN3, options) as trainer:
        trainer.init_weights()
        trainer.generate([1, 2], 2, temperature=0)
        allocated = [kv_cache_entries(trainer.get_allocations(device)) for device in range(2)]
    assert all(allocated) and [kv_cache_entries(plan["generation"]) for plan in plans] == allocated
