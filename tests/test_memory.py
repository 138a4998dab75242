"""The memory estimator (nanoq.memory, `nanoq memory`) against what the core
really allocates.

The estimate is the core's plan of the Trainer's allocations (its op scratch
planned by the backends), so it is held to exact equality: the same
list of (context, name, bytes) as Trainer.get_allocations, hence the same
bytes per context, and its total is exactly the figure
TrainOptions.memory_limit is checked against. On the cpu backend and on
cuda_emulated (the cuda backend's code on the CPU emulator) that is checked
here; on a real GPU by the `gpu`-marked test (skipped without one); and the
cuda estimate of a machine without a GPU against formulas worked by hand.
"""
import dataclasses
import re

import numpy as np
import pytest
from click.testing import CliRunner

import nanoq
from nanoq._core import backend_built
from nanoq.backends import attention_library, device_count
from nanoq.data import write_token_shards
from nanoq.lora import LoraConfig, adapter_shapes
from nanoq.memory import CONTEXTS, estimate_memory, human_bytes, parameter_count_text, parameter_numels
from nanoq_cli.main import cli
from conftest import cuda_cases, use_cuda_backend

# A cuda estimate asks the cuda backend's code for its op scratch: the cuda
# library, or without it the same code built for the emulator (which
# ThreadSanitizer build leaves out, deselecting these tests).
cuda_planned = pytest.mark.cuda_emulated

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
CONFIGS = {
    "llama_untied": nanoq.ModelConfig(**TINY),
    "llama_tied": nanoq.ModelConfig(**TINY, tie_word_embeddings=True),
    "qwen2_bias": nanoq.ModelConfig(**dict(TINY, vocab_size=300, num_hidden_layers=3), qkv_bias=True,
                                    tie_word_embeddings=True),
    # head_dim 16 != hidden/heads, 6 query heads on 2 kv heads, q/k norm.
    "qwen3_gqa": nanoq.ModelConfig(vocab_size=200, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, head_dim=16, qk_norm=True),
    # head_dim 32 > hidden 16: o's input (heads * head_dim) is the widest, and the frozen norms' gradient
    # sink is head_dim long.
    "qwen3_wide_heads": nanoq.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, qk_norm=True),
}
QWEN_0_5B = "configs/qwen2.5-0.5b.json"
QWEN_7B = "configs/qwen2.5-7b.json"


def cpu_options(devices, batch_size=2, seq_len=16, threads=1, **more):
    return nanoq.TrainOptions(backend="cpu", devices=devices, batch_size=batch_size, seq_len=seq_len,
                              threads=threads, **more)


def real_allocations(config, options, device=0):
    with nanoq.Trainer(config, options) as trainer:
        return [(a["context"], a["name"], a["bytes"], a["kind"]) for a in trainer.get_allocations(device)]


def per_context(allocations):
    totals = dict.fromkeys(CONTEXTS, 0)
    for context, _, nbytes, kind in allocations:
        if kind == "device":
            totals[context] += nbytes
    return totals


@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cpu_estimate_equals_real_allocations_per_context(name, devices):
    config = CONFIGS[name]
    # threads 0 (cores shared out) on one device count, so the attention
    # scratch's dependence on hardware_concurrency is mirrored too.
    options = cpu_options(devices, threads=0 if devices == 1 else 1)
    estimate = estimate_memory(config, options)
    real = real_allocations(config, options, device=devices - 1)
    assert [(a.context, a.name, a.bytes, a.kind) for a in estimate.allocations] == real
    assert estimate.contexts == per_context(real)
    assert estimate.device_bytes == sum(per_context(real).values())
    assert estimate.pinned_bytes == 0
    assert estimate.contexts["master"] == 0  # fp32 master weights are a view of the fp32 weights


@pytest.mark.parametrize("recompute,offload,stage", [
    ("swiglu", "", 1), ("ffn", "optimizer", 2), ("norms,qkv", "master", 3), ("block", "optimizer,master", 3),
    ("", "", 2), ("", "", 3), ("ffn", "gradients", 2), ("", "optimizer,master,gradients", 3),
])
@pytest.mark.parametrize("name", ["qwen3_gqa", "llama_untied"])
def test_cpu_estimate_equals_real_allocations_with_recompute_offload_and_stages(recompute, offload, stage, name):
    config = CONFIGS[name]
    options = cpu_options(2, recompute=recompute, offload=offload, zero_stage=stage)
    estimate = estimate_memory(config, options)
    real = real_allocations(config, options, device=1)
    assert [(a.context, a.name, a.bytes, a.kind) for a in estimate.allocations] == real
    # Offloaded state is host memory: counted apart from the device total.
    assert estimate.pinned_bytes == sum(nbytes for _, _, nbytes, kind in real if kind == "pinned")
    assert estimate.device_bytes == sum(per_context(real).values())


@pytest.mark.parametrize("lora", [None, LoraConfig(4, dropout=0.1, targets="all")])
def test_estimate_total_is_exactly_what_memory_limit_allows(lora):
    config, options = CONFIGS["qwen3_gqa"], cpu_options(2, lora=lora)
    need = estimate_memory(config, options).device_bytes
    with nanoq.Trainer(config, dataclasses.replace(options, memory_limit=need)) as trainer:
        assert trainer.memory_summary()[0]["allocated"] == need
    with pytest.raises(nanoq.OutOfMemoryError):
        nanoq.Trainer(config, dataclasses.replace(options, memory_limit=need - 1))


# (model, devices, LoRA, recompute, offload): ranks 1-16; targets with the widest inputs (down: intermediate;
# o: heads * head_dim); dropout on and off; offloaded optimizer and master.
LORA_SETUPS = [
    ("llama_untied", 1, LoraConfig(4), "", ""),
    ("llama_tied", 2, LoraConfig(8, dropout=0.1, targets="q,v,down"), "swiglu", ""),
    ("llama_untied", 2, LoraConfig(1, alpha=2, dropout=0.3, targets="all"), "", "optimizer"),
    ("qwen2_bias", 2, LoraConfig(3, dropout=0.2, targets="gate,up"), "norms,qkv", "master"),
    ("qwen3_gqa", 1, LoraConfig(16, targets="all"), "ffn", "optimizer,master"),
    ("qwen3_gqa", 2, LoraConfig(2, dropout=0.05, targets="o,down"), "block", "optimizer,master"),
    ("qwen3_wide_heads", 2, LoraConfig(2, dropout=0.1, targets="o"), "", ""),
    ("qwen3_wide_heads", 1, LoraConfig(5, targets="q,k"), "qkv", ""),
]


@pytest.mark.parametrize("name,devices,lora,recompute,offload", LORA_SETUPS)
def test_cpu_lora_estimate_equals_real_allocations(name, devices, lora, recompute, offload):
    config = CONFIGS[name]
    options = cpu_options(devices, lora=lora, recompute=recompute, offload=offload)
    estimate = estimate_memory(config, options)
    real = real_allocations(config, options, device=devices - 1)
    assert [(a.context, a.name, a.bytes, a.kind) for a in estimate.allocations] == real
    assert estimate.pinned_bytes == sum(nbytes for _, _, nbytes, kind in real if kind == "pinned")
    assert estimate.device_bytes == sum(per_context(real).values())
    sizes = {allocation_name: nbytes for _, allocation_name, nbytes, _ in real}
    adapters = sum(rows * cols for rows, cols in adapter_shapes(config, lora).values())
    assert estimate.trainable_parameters == adapters
    assert estimate.parameters == sum(parameter_numels(config))
    assert sizes["frozen-weights"] == 4 * estimate.parameters  # whole, unpadded
    assert sizes["adapters"] == sizes["gradients"] == 4 * -(-adapters // devices) * devices
    assert sizes["frozen-norm-gradients"] == 4 * max(config.hidden_size, config.head_dim)
    assert "weights" not in sizes


@cuda_planned
def test_lora_gradients_and_optimizer_state_are_a_small_fraction_of_full_fine_tuning():
    config = nanoq.ModelConfig.from_pretrained(QWEN_0_5B)
    options = nanoq.TrainOptions(devices=1, batch_size=8, seq_len=1024)
    lora = LoraConfig(16, targets="q,k,v,o")
    full, tuned = (estimate_memory(config, dataclasses.replace(options, lora=setting), backend="cuda")
                   for setting in (None, lora))
    parameters = 494_032_768
    # Per layer, rank 16: A [16, 896] for q, k, v, o; B [896, 16] for q and o, [128, 16] for k and v.
    adapters = 24 * 16 * (4 * 896 + 2 * 896 + 2 * 128)
    assert (tuned.parameters, tuned.trainable_parameters) == (parameters, adapters)
    assert tuned.contexts["weights"] == 2 * parameters + 2 * adapters  # bf16: the frozen model and the adapters
    assert tuned.contexts["gradients"] == 4 * adapters
    for context in ("master", "adam-m", "adam-v"):  # fp32 master (bf16 weights) and AdamW
        assert tuned.contexts[context] == 4 * adapters
    trained_state = ("gradients", "master", "adam-m", "adam-v")
    assert sum(tuned.contexts[c] for c in trained_state) * 200 < sum(full.contexts[c] for c in trained_state)
    assert tuned.device_bytes < full.device_bytes - 14 * parameters
    assert tuned.contexts["activations"] == full.contexts["activations"]
    # The stack's peak also holds an adapter's [rows, 16] hidden, and with dropout its dropped-out [rows, 896]
    # input (q, k, v and o all read 896 wide), bf16.
    rows = 8 * 1024
    assert tuned.contexts["stack"] - full.contexts["stack"] == 2 * rows * 16
    dropped = estimate_memory(config, dataclasses.replace(options, lora=dataclasses.replace(lora, dropout=0.1)),
                              backend="cuda")
    assert dropped.contexts["stack"] - full.contexts["stack"] == 2 * rows * 16 + 2 * rows * 896


@cuda_planned
def test_sharded_contexts_shrink_with_devices_and_replicated_ones_do_not():
    config = nanoq.ModelConfig.from_pretrained(QWEN_0_5B)
    one, eight = (estimate_memory(config, nanoq.TrainOptions(devices=n, batch_size=8, seq_len=1024), backend="cuda")
                  for n in (1, 8))
    parameters = 494_032_768  # Qwen2.5-0.5B as Hugging Face counts it (tied)
    assert one.parameters == parameters
    assert one.contexts["weights"] == 2 * parameters and one.contexts["gradients"] == 4 * parameters
    for context in ("master", "adam-m", "adam-v"):
        assert one.contexts[context] == 4 * parameters
        assert eight.contexts[context] == 4 * parameters // 8
    for context in ("weights", "gradients", "activations", "stack"):
        assert eight.contexts[context] == one.contexts[context]


@cuda_planned
@pytest.mark.parametrize("device_memory", [16 << 30, 141 * 10**9], ids=["16GiB", "H200"])
def test_cuda_estimate_of_qwen_0_5b_matches_hand_computation(device_memory):
    config = nanoq.ModelConfig.from_pretrained(QWEN_0_5B)
    estimate = estimate_memory(config, nanoq.TrainOptions(devices=1, batch_size=8, seq_len=1024), backend="cuda",
                               device_memory=device_memory)
    sizes = {a.name: a.bytes for a in estimate.allocations}
    rows, C, I, KD, V = 8 * 1024, 896, 4864, 2 * 64, 151936
    # Per layer: input/post norm, residual-mid, q, attention (C wide), k, v, gate, up, swiglu in bf16; the
    # rstds and attention lse (14 heads) in fp32.
    layer = 2 * rows * (5 * C + 2 * KD + 3 * I) + 4 * (2 * rows + rows * 14)
    assert estimate.contexts["activations"] == 24 * layer + 2 * rows * C * 26 + 4 * rows
    # The widest op scratch: an rmsnorm backward's weight-gradient partials (fp32 sums of its channels for
    # each of its blocks: 2^21 // channels, but at least 4 rows per block), then the column sums' own (the
    # channels for each chunk of 64 blocks). Of the hidden norm and the per-head q and k norms (64 channels)
    # the widest, more than attention backward's 4 * rows * heads bytes and even the bound of CUB's sort
    # storage: exact with or without a GPU.
    def rmsnorm_scratch(norm_rows, channels):
        blocks = min(norm_rows // 4, 2**21 // channels)
        return 4 * blocks * channels + 4 * -(-blocks // 64) * channels
    widest = max(rmsnorm_scratch(rows, C), rmsnorm_scratch(rows * 14, 64), rmsnorm_scratch(rows * 2, 64))
    assert widest == 4 * 2048 * C + 4 * 32 * C
    assert sizes["cuda-op-scratch"] == widest
    # Only cuDNN's workspace may be a bound: where the cuda build has cuDNN but no GPU can size it.
    unsized = backend_built("cuda") and attention_library("cuda").startswith("cuDNN") and device_count("cuda") == 0
    assert estimate.approximate == (["cudnn-attention-workspace"] if unsized else [])
    assert sizes["cublaslt-workspace"] == 32 << 20
    # The packed q|k|v projection (14 + 2 x 2 heads of 64) between its one matmul and its unpacking pass, bf16.
    assert sizes["qkv-packed"] == 2 * rows * (14 + 2 * 2) * 64
    assert sizes["parameter-staging"] == 4 << 22
    # The trainer's two batch-staging slots (inputs and targets), the staging of the update's 13 float64 per-step
    # values (AdamW's 12 and the gradient clip) and the backend's own upload staging.
    assert [(a.name, a.bytes, a.kind) for a in estimate.allocations if a.kind == "pinned"] == \
        [("batch-staging", 16 * rows, "pinned"), ("adamw-step-staging", 8 * 13, "pinned"),
         ("host-staging", 8 * rows, "pinned")]
    if device_memory == 16 << 30:
        # The least chunk, 64M logits (441 rows), already overfills 7/8 of 16 GiB: the chunk stays. Stack:
        # d-residual plus the MLP frame (d-gate, d-up, d-post-norm), all bf16, more than 441 rows of logits.
        assert estimate.classifier_rows == (1 << 26) // V == 441
        assert sizes["activation-stack"] == 2 * rows * C + 2 * (2 * rows * I) + 2 * rows * C
        assert "logits in chunks of 441 of the 8,192 rows (as many as fit in 7/8 of a 16.00 GiB device" in \
            estimate.table()
    else:
        # An H200: all rows' bf16 logits in one chunk (one pass, one head-gradient matmul), with d-residual
        # and the classifier's d-norm beside them on the stack.
        assert estimate.classifier_rows == rows
        assert sizes["activation-stack"] == 2 * rows * V + 2 * (2 * rows * C)
        assert "classifier: the logits of all 8,192 rows in one chunk" in estimate.table()


def gpu_visible():
    return backend_built("cuda") and device_count("cuda") > 0


@cuda_planned
def test_a_cuda_estimate_without_a_device_size_keeps_the_least_classifier_chunk_and_says_so():
    config = nanoq.ModelConfig.from_pretrained(QWEN_0_5B)
    options = nanoq.TrainOptions(devices=1, batch_size=8, seq_len=1024)
    plain = estimate_memory(config, options, backend="cuda")
    sized = estimate_memory(config, options, backend="cuda", device_memory=141 * 10**9)
    if not gpu_visible():  # a GPU here would be asked for its memory
        assert plain.classifier_rows == 441
        assert "(the least chunk: on a GPU it grows into the memory left" in plain.table()
    # Only the stack differs (all rows of logits where it held the MLP frame). Generation's fp32 logits stay
    # at the least chunk's 441 rows: they followed the grown chunk (all 1024 rows here, up to gigabytes of
    # fp32 at long sequences), which generation does not need.
    V = 151936
    small = estimate_memory(config, options, backend="cuda", device_memory=16 << 30)
    assert [(a.name, a.bytes) for a in small.allocations if a.name != "activation-stack"] == \
        [(a.name, a.bytes) for a in sized.allocations if a.name != "activation-stack"]
    assert sized.classifier_rows == 8192 and small.classifier_rows == 441
    assert sized.generation == small.generation
    (logits,) = [a for a in sized.generation if a.name == "kv-cache.logits"]
    assert logits.bytes == 4 * 441 * V
    # Suggestions re-plan on the same device size.
    assert sized._with(batch_size=4).device_memory == sized.device_memory
    for bad in (0, -1, 1.5e9, True, "80GB"):
        with pytest.raises(ValueError, match="device_memory must be a positive byte count"):
            estimate_memory(config, options, backend="cuda", device_memory=bad)
    for bad in (-1, 1.5e9, True, "1GB"):  # (-1 was taken: a fit judged on a byte less than planned)
        with pytest.raises(ValueError, match="reserve_bytes must be a byte count"):
            estimate_memory(config, options, backend="cuda", reserve_bytes=bad)
    assert estimate_memory(config, options, backend="cuda", reserve_bytes=0).reserve_bytes == 0


@cuda_planned
def test_cli_device_memory_sizes_the_classifier_chunk_as_on_that_gpu():
    result = invoke("memory", "--model", QWEN_0_5B, "--backend", "cuda", "--batch-size", 8, "--seq-len", 1024,
                    "--device-memory", "141GB")
    assert result.exit_code == 0, result.output
    assert "classifier: the logits of all 8,192 rows in one chunk" in result.output
    assert "fits in 131.32 GiB (141.0 GB)" in result.output



@cuda_planned
def test_cli_without_a_gpu_or_device_memory_says_how_to_get_a_verdict():
    result = invoke("memory", "--model", QWEN_0_5B, "--backend", "cuda", "--batch-size", 8, "--seq-len", 1024)
    assert result.exit_code == 0, result.output
    if gpu_visible():
        assert "(the device memory is that of the smallest GPU nvidia-ml-py sees here)" in result.output
    else:  # before, the table ended without a word on the fit
        assert "(no GPU that nvidia-ml-py sees here to check the fit against: give --device-memory SIZE" in \
            result.output


@cuda_planned
def test_cuda_sort_storage_that_cub_cannot_size_is_bounded_and_said_to_be():
    # 8192 rows on a narrow model: the embedding backward's CUB sort has the largest op scratch. CUB sizes its
    # storage only for a GPU it sees; without one the estimate counts an upper bound and says so. (Native
    # attention: no cuDNN workspace, which a cuda build with cuDNN but without a GPU also bounds.)
    config = CONFIGS["llama_untied"]
    options = nanoq.TrainOptions(devices=1, batch_size=8, seq_len=1024, attention="native")
    cuda = estimate_memory(config, options, backend="cuda")
    if gpu_visible():
        assert cuda.approximate == []
        return
    assert cuda.approximate == ["cuda-op-scratch"]
    rows = 8 * 1024
    sizes = {a.name: a.bytes for a in cuda.allocations}
    # Three int32 index arrays, then twice CUB's alternate int32 keys and values plus 64 KiB.
    assert sizes["cuda-op-scratch"] == 3 * 4 * rows + 2 * 8 * rows + (64 << 10)
    assert "approximate: cuda-op-scratch counted at an upper bound" in cuda.table(1 << 30)
    # The same plan as the cuda backend's code on the emulator, whose stand-in for CUB answers (exactly).
    emulated = estimate_memory(config, options, backend="cuda_emulated")
    assert emulated.approximate == []
    assert [a for a in cuda.allocations if a.exact] == [a for a in emulated.allocations if a.name != "cuda-op-scratch"]


@cuda_planned
def test_seven_billion_parameters_are_estimated_without_allocating_them():
    """The plan of a 7B run on 8 devices (about 150 GB of device state)
    counts its allocations without making them: the process's peak resident
    memory grows by far less than one device's weights. (No timing here:
    timed assertions fail on a loaded machine.)"""
    import resource

    config = nanoq.ModelConfig.from_pretrained(QWEN_7B)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    estimate = estimate_memory(config, nanoq.TrainOptions(devices=8, batch_size=8, seq_len=1024), backend="cuda")
    estimate.suggestions(80 * 10**9)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 * 1024
    assert estimate.device_bytes > 10**10  # the largest device's share of the ~150 GB, counted
    assert sum(parameter_numels(config)) == 7_615_616_512  # Qwen2.5-7B as Hugging Face counts it (untied)
    assert estimate.options.dtype == "bf16"


def test_cpu_refuses_bf16_like_the_trainer():
    with pytest.raises(ValueError, match="fp32 only"):
        estimate_memory(CONFIGS["llama_tied"], cpu_options(1, dtype="bf16"))


def test_micro_batch_suggestion_fits_and_is_the_largest_that_does():
    config, options = CONFIGS["llama_untied"], cpu_options(2, batch_size=8, seq_len=64, grad_accum=3)
    estimate = estimate_memory(config, options)
    limit = estimate_memory(config, dataclasses.replace(options, batch_size=3)).device_bytes + 1
    assert not estimate.fits(limit)
    first = estimate.suggestions(limit)[0]
    batch, accum = map(int, re.search(r"batch_size (\d+) with grad_accum (\d+)", first).groups())
    assert (batch, accum) == (3, 8)  # same 24 sequences per device per step; 4 (a divisor of 24) is too big
    assert f"same {2 * 8 * 3 * 64:,} tokens per step" in first
    assert estimate_memory(config, dataclasses.replace(options, batch_size=batch, grad_accum=accum)).fits(limit)
    assert not estimate_memory(config, dataclasses.replace(options, batch_size=4, grad_accum=6)).fits(limit)


def test_fitting_micro_batch_is_the_largest_that_a_limited_trainer_accepts():
    config, options = CONFIGS["llama_untied"], cpu_options(1, batch_size=8, seq_len=64, grad_accum=2)
    estimate = estimate_memory(config, options)
    assert estimate.fitting_micro_batch(estimate.device_bytes) is estimate
    limit = estimate_memory(config, dataclasses.replace(options, batch_size=4)).device_bytes + 1
    fitting = estimate.fitting_micro_batch(limit)
    # 16 sequences per step kept; 4 is the largest divisor of 16 below 8 that fits (not 7, 6, 5: no divisors).
    assert (fitting.options.batch_size, fitting.options.grad_accum) == (4, 4)
    assert fitting.tokens_per_step == estimate.tokens_per_step
    assert dataclasses.replace(fitting.options, batch_size=8, grad_accum=2) == estimate.options
    # The core agrees: a trainer limited to that many bytes takes the micro-batch of 4, not the setting's 8.
    with nanoq.Trainer(config, dataclasses.replace(fitting.options, memory_limit=limit)) as trainer:
        assert trainer.memory_summary()[0]["allocated"] == fitting.device_bytes
    with pytest.raises(nanoq.OutOfMemoryError):
        nanoq.Trainer(config, dataclasses.replace(options, memory_limit=limit))
    assert estimate.fitting_micro_batch(1000) is None


def test_device_suggestion_uses_zero1_sharding():
    # A wide vocabulary and a tiny batch: weights, gradients and AdamW dominate.
    config = nanoq.ModelConfig(**dict(TINY, vocab_size=20000))
    options = cpu_options(1, batch_size=1, seq_len=8)
    estimate = estimate_memory(config, options)
    three = estimate_memory(config, dataclasses.replace(options, devices=3))
    limit = three.device_bytes
    assert not estimate_memory(config, dataclasses.replace(options, devices=2)).fits(limit)
    suggestions = estimate.suggestions(limit)
    assert len(suggestions) == 1 and "; 3 devices (grad_accum 1: 24 instead of 8 tokens" in suggestions[0]
    assert three.fits(limit)


@cuda_planned
def test_recompute_and_offload_are_suggested_when_they_fit():
    config, options = CONFIGS["llama_untied"], cpu_options(1, batch_size=1, seq_len=64)
    estimate = estimate_memory(config, options)
    recomputed = estimate_memory(config, dataclasses.replace(options, recompute="swiglu"))
    suggestions = estimate.suggestions(recomputed.device_bytes)
    assert suggestions[0].startswith("recompute swiglu (")
    # Offloaded state streams through device buffers of 4M elements: it saves memory on large shards only.
    config = nanoq.ModelConfig.from_pretrained(QWEN_0_5B)
    options = nanoq.TrainOptions(batch_size=1, seq_len=128, recompute="block")
    estimate = estimate_memory(config, options, backend="cuda")
    offloaded = estimate_memory(config, dataclasses.replace(options, offload="optimizer"), backend="cuda")
    assert offloaded.contexts["adam-m"] == 0
    assert offloaded.pinned_bytes - estimate.pinned_bytes == 2 * estimate.contexts["adam-m"]
    limit = offloaded.device_bytes + offloaded.reserve_bytes
    # batch_size is 1 already and recompute block is on: offload first, then ZeRO-1 over more devices.
    assert [line.split(" (")[0] for line in estimate.suggestions(limit)] == ["offload optimizer", "3 devices"]


def test_higher_zero_stages_are_suggested_on_several_devices():
    # Deep enough that a weight shard plus two layer buffers beat whole weights.
    config = nanoq.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                               num_attention_heads=4)
    options = cpu_options(8, batch_size=1, seq_len=8, recompute="block", offload="optimizer,master")
    estimate = estimate_memory(config, options)
    stage2 = estimate_memory(config, dataclasses.replace(options, zero_stage=2))
    stage3 = estimate_memory(config, dataclasses.replace(options, zero_stage=3))
    assert stage3.device_bytes < stage2.device_bytes < estimate.device_bytes
    # On cpu the offloaded state takes the same host memory: needed_bytes counts it.
    assert stage2.needed_bytes == stage2.device_bytes + stage2.reserve_bytes + stage2.pinned_bytes
    lines = estimate.suggestions(stage2.needed_bytes)
    assert lines[0].startswith("zero_stage 2 (gradients sharded across the 8 devices)")
    lines = estimate.suggestions(stage3.needed_bytes)
    assert lines[0].startswith("zero_stage 3 (gradients and weights sharded across the 8 devices)")


def test_lora_suggestions_keep_zero_stage_1():
    # LoRA trains at zero_stage 1 only: no suggestion may raise it, even on several devices.
    config = CONFIGS["llama_untied"]
    options = cpu_options(2, batch_size=1, seq_len=64, lora=LoraConfig(4, targets="all"))
    estimate = estimate_memory(config, options)
    recomputed = estimate_memory(config, dataclasses.replace(options, recompute="swiglu"))
    lines = estimate.suggestions(recomputed.device_bytes)
    assert lines[0].startswith("recompute swiglu (")
    assert not any("zero_stage" in line for line in lines)
    (line,) = estimate.suggestions(1000)
    # On the cpu the offloaded state takes the same host memory, so the lightest offloads nothing here.
    assert line.startswith("nothing fits: even the lightest setting, 64 devices with zero_stage 1, batch_size 1, "
                           "recompute block, needs ")


def suggested_changes(line):
    """The settings a suggestion line of the combined search names, as TrainOptions fields."""
    changes = {}
    text = re.sub(r" \([^()]*host memory per device\)", "", line.split(" (same ")[0])
    for piece in text.split(", "):
        name, value = piece.split(" ", 1)
        if name == "batch_size":
            batch, accum = re.fullmatch(r"(\d+) with grad_accum (\d+)", value).groups()
            changes.update(batch_size=int(batch), grad_accum=int(accum))
        else:
            changes[name] = int(value) if name == "zero_stage" else value
    assert set(changes) <= {"batch_size", "grad_accum", "zero_stage", "recompute", "offload"}, line
    return changes


def test_a_combination_is_found_where_more_recompute_needs_more_memory():
    # One layer: recompute block keeps 512 B more than ffn,norms,qkv, so the heaviest recompute is not the
    # lightest and the search must try each level (it once said "nothing else fits 1 device" here).
    config = nanoq.ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2)
    options = cpu_options(1, batch_size=2, seq_len=16)
    estimate = estimate_memory(config, options)
    lines = estimate.suggestions(510000)
    assert not lines[0].startswith(("nothing", "2 devices")), lines
    suggested = estimate_memory(config, dataclasses.replace(options, **suggested_changes(lines[0])))
    assert suggested.fits(510000) and suggested.tokens_per_step == estimate.tokens_per_step


def test_an_inference_estimate_suggests_what_an_inference_trainer_can_take():
    config = CONFIGS["llama_untied"]
    options = cpu_options(1, batch_size=8, seq_len=64, inference=True)
    estimate = estimate_memory(config, options)
    assert "inference (no gradients, master weights or AdamW)" in estimate.describe()
    lines = estimate.suggestions(estimate.device_bytes // 2)
    # Before, the search asked for offload and higher stages, which the inference rule refuses (ValueError).
    assert lines and not any("offload" in line or "zero_stage" in line for line in lines), lines


def test_changes_that_fit_only_together_are_suggested_together():
    config, options = CONFIGS["llama_untied"], cpu_options(1, batch_size=4, seq_len=64)
    estimate = estimate_memory(config, options)
    together = estimate_memory(config, dataclasses.replace(options, batch_size=1, grad_accum=4, recompute="block"))
    limit = together.device_bytes
    # Neither change alone fits: before, the suggestions tried recompute and offload together only.
    assert not estimate_memory(config, dataclasses.replace(options, batch_size=1, grad_accum=4)).fits(limit)
    assert not estimate_memory(config, dataclasses.replace(options, recompute="block")).fits(limit)
    lines = estimate.suggestions(limit)
    assert lines[0] == (f"batch_size 1 with grad_accum 4, recompute block (same 256 tokens per step): needs "
                        f"{human_bytes(limit)}")


@cuda_planned
@pytest.mark.parametrize("gigabytes", [8, 12])
def test_a_run_that_fits_somehow_is_never_told_that_nothing_fits(gigabytes):
    # Qwen2.5-0.5B at seq 4096 on one small GPU: only a smaller micro-batch, a higher ZeRO stage
    # (for offloading gradients), recompute and offload together fit; the suggestions once said
    # "nothing fits: even 64 devices ... need 5.94 GiB" of 7.45 GiB.
    config = nanoq.ModelConfig.from_pretrained(QWEN_0_5B)
    options = nanoq.TrainOptions(batch_size=8, seq_len=4096)
    limit = gigabytes * 10**9
    estimate = estimate_memory(config, options, backend="cuda", device_memory=limit)
    lines = estimate.suggestions(limit)
    assert lines and not lines[0].startswith(("nothing fits", "nothing else fits")), lines
    changes = suggested_changes(lines[0])
    assert len(changes) >= 2, lines[0]  # no single change fits
    suggested = estimate_memory(config, dataclasses.replace(options, **changes), backend="cuda", device_memory=limit)
    assert suggested.fits(limit) and suggested.tokens_per_step == estimate.tokens_per_step
    assert f"needs {human_bytes(suggested.device_bytes + suggested.reserve_bytes)}" in lines[0]


def test_when_nothing_fits_it_says_so():
    config, options = CONFIGS["llama_untied"], cpu_options(1, batch_size=1, seq_len=8)
    (line,) = estimate_memory(config, options).suggestions(1000)
    # On a model this small the stages' buffers outweigh their shards: stage 1 is the lightest.
    assert line.startswith("nothing fits: even the lightest setting, 64 devices with zero_stage 1, batch_size 1, ")
    assert line.endswith("per device; shorten seq_len (8) or train a smaller model")
    # Where a reserve counts (cuda's 1 GiB by default), the line says how much of the need it is: on a
    # small model it is most of it, and the user's own figure may be smaller.
    (line,) = estimate_memory(config, options, backend="cuda").suggestions(1 << 30)
    assert line.startswith("nothing fits: ") and line.endswith(
        "or train a smaller model (1.00 GiB of that is the reserve for memory outside nanoq's allocator: CUDA "
        "context, libraries; reserve_bytes, nanoq memory --reserve)"), line


def test_table_has_a_row_per_context_and_a_verdict():
    estimate = estimate_memory(CONFIGS["llama_tied"], cpu_options(2))
    table = estimate.table(1 << 30)
    for context in CONTEXTS + ("total",):
        assert re.search(rf"^{context} +\S+ \S*B ", table, re.M), context
    assert re.search(rf"^total +{re.escape(human_bytes(estimate.device_bytes))} ", table, re.M)
    assert "fits in 1.00 GiB" in table
    assert "does NOT fit" in estimate.table(1000)


def test_table_shows_the_frozen_weights_apart_from_the_adapters():
    config, lora = CONFIGS["llama_tied"], LoraConfig(4, dropout=0.1, targets="q,v,down")
    estimate = estimate_memory(config, cpu_options(2, lora=lora))
    sizes = {a.name: a.bytes for a in estimate.allocations}
    adapters = sum(rows * cols for rows, cols in adapter_shapes(config, lora).values())
    table = estimate.table(1 << 30)
    assert (f"{parameter_count_text(estimate.parameters)} parameters (2 layers, hidden 32, vocab 128, tied), "
            f"frozen; LoRA rank 4 on q,v,down, dropout 0.1: {parameter_count_text(adapters)} trainable; cpu") in table
    weights = human_bytes(sizes["frozen-weights"] + sizes["adapters"])
    assert re.search(rf"^weights +{re.escape(weights)}  the frozen model weights "
                     rf"\({re.escape(human_bytes(4 * estimate.parameters))}, whole on every device\) and the LoRA "
                     rf"adapters \({re.escape(human_bytes(sizes['adapters']))}\)$", table, re.M)
    assert re.search(r"^gradients +\S+ \S*B  float32 gradients of the adapters only", table, re.M)
    for context in CONTEXTS + ("total",):
        assert re.search(rf"^{context} +\S+ \S*B ", table, re.M), context


# -- the command line ------------------------------------------------------------------

TINY_FLAGS = ["--vocab_size", "128", "--hidden_size", "32", "--intermediate_size", "64", "--num_hidden_layers", "2",
              "--num_attention_heads", "4", "--seq_len", "32", "--batch_size", "4", "--threads", "1",
              "--backend", "cpu", "--devices", "2"]


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_cli_prints_the_table_and_the_verdict():
    result = invoke("memory", *TINY_FLAGS, "--device-memory", "1GiB")
    assert result.exit_code == 0, result.output
    assert "2 devices x batch 4 x seq 32" in result.output
    for context in CONTEXTS:
        assert re.search(rf"^{context} ", result.output, re.M)
    assert "fits in 1.00 GiB" in result.output and "suggestion" not in result.output


def test_cli_reads_the_model_from_a_toml_file_and_suggests_when_it_does_not_fit(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[model]\nvocab_size = 128\nhidden_size = 32\nintermediate_size = 64\n"
                      "num_hidden_layers = 2\nnum_attention_heads = 4\n[train]\nbatch_size = 8\n"
                      "[run]\nbackend = \"cpu\"\nthreads = 1\n")
    options = cpu_options(1, batch_size=8, seq_len=128)
    model = nanoq.ModelConfig(**dict(TINY, num_key_value_heads=4), rms_norm_eps=1e-5, tie_word_embeddings=True)
    # The run samples during training (train.sample_every's default): its KV cache counts.
    limit = estimate_memory(model, dataclasses.replace(options, batch_size=2), generates=True).device_bytes
    result = invoke("memory", config, "--seq-len", 128, "--device-memory", limit)
    assert result.exit_code == 0, result.output
    assert human_bytes(estimate_memory(model, options, generates=True).device_bytes) in result.output
    assert "does NOT fit" in result.output
    assert "suggestion: batch_size 2 with grad_accum 4 (same 1,024 tokens per step)" in result.output
    # --grad-accum, as `nanoq train` takes it: the suggestions keep the run's tokens per step.
    result = invoke("memory", config, "--seq-len", 128, "--grad-accum", 3, "--device-memory", limit)
    assert result.exit_code == 0, result.output
    assert "suggestion: batch_size 2 with grad_accum 12 (same 3,072 tokens per step)" in result.output


@cuda_planned
def test_cli_estimates_a_hugging_face_model_for_cuda_without_a_gpu():
    result = invoke("memory", "--model", QWEN_7B, "--backend", "cuda", "--devices", 8, "--batch-size", 8,
                    "--seq-len", 1024, "--device-memory", "80GB")
    assert result.exit_code == 0, result.output
    assert "7.62B parameters" in result.output and "pinned host" in result.output
    assert "does NOT fit in 74.51 GiB (80.0 GB)" in result.output
    assert "suggestion: batch_size 4 with grad_accum 2 (same 65,536 tokens per step)" in result.output


def test_cli_estimates_lora_from_the_lora_settings():
    result = invoke("memory", *TINY_FLAGS, "--lora-rank", 8, "--lora-targets", "q,v,down", "--lora-dropout", 0.1)
    assert result.exit_code == 0, result.output
    model = nanoq.ModelConfig(**dict(TINY, num_key_value_heads=4), rms_norm_eps=1e-5, tie_word_embeddings=True)
    options = cpu_options(2, batch_size=4, seq_len=32, lora=LoraConfig(8, dropout=0.1, targets="q,v,down"))
    estimate = estimate_memory(model, options, generates=True)  # samples during training (the default)
    assert "frozen; LoRA rank 8 on q,v,down, dropout 0.1" in result.output
    assert re.search(rf"^total +{re.escape(human_bytes(estimate.device_bytes))} ", result.output, re.M)
    assert "the frozen model weights (" in result.output


def test_cli_reads_the_vocab_size_from_the_configs_token_files(tmp_path):
    folder = tmp_path / "configs"
    (folder / "data").mkdir(parents=True)
    write_token_shards(str(folder / "data" / "train"), np.arange(400) % 250, vocab_size=250)
    write_token_shards(str(folder / "data" / "eval"), np.arange(100) % 7, vocab_size=250)
    config = folder / "run.toml"
    config.write_text('[data]\ntrain_data = "data/train_*.bin"\neval_data = "data/eval_*.bin"\n')
    assert TINY_FLAGS[0] == "--vocab_size"
    flags = TINY_FLAGS[2:]  # the vocab size comes from the token files
    result = invoke("memory", config, *flags)  # from another working directory: paths are the file's
    assert result.exit_code == 0, result.output
    model = nanoq.ModelConfig(**dict(TINY, vocab_size=250, num_key_value_heads=4), rms_norm_eps=1e-5,
                              tie_word_embeddings=True)
    estimate = estimate_memory(model, cpu_options(2, batch_size=4, seq_len=32), generates=True)
    assert "vocab 250, tied" in result.output
    assert re.search(rf"^total +{re.escape(human_bytes(estimate.device_bytes))} ", result.output, re.M)
    config.write_text('[data]\ntrain_data = "missing/train_*.bin"\n')
    result = invoke("memory", config, *flags)
    assert result.exit_code == 1 and str(folder / "missing" / "train_*.bin") in result.output


def test_the_kv_cache_counts_in_the_fit_of_a_run_that_samples_during_training(tmp_path):
    model = nanoq.ModelConfig(**TINY, rms_norm_eps=1e-5, tie_word_embeddings=True)  # TINY_FLAGS' model
    options = cpu_options(2, batch_size=4, seq_len=32)
    alone, sampling = estimate_memory(model, options), estimate_memory(model, options, generates=True)
    assert sampling.kv_cache_bytes == alone.kv_cache_bytes > 0
    assert sampling.device_bytes == alone.device_bytes + alone.kv_cache_bytes
    assert sampling.contexts == dict(alone.contexts, **{"kv-cache": alone.kv_cache_bytes})
    assert alone.fits(alone.device_bytes) and not sampling.fits(alone.device_bytes)
    assert re.search(r"^kv-cache .* not in the total$", alone.table(), re.M)
    assert not re.search(r"not in the total", sampling.table())
    flags = [*TINY_FLAGS, "--num_key_value_heads", "2"]
    for every, expected in (("60", sampling), ("0", alone)):
        result = invoke("memory", *flags, "--sample_every", every)
        assert re.search(rf"^total +{re.escape(human_bytes(expected.device_bytes))} ", result.output, re.M)
    # Where training writes no samples (a bidirectional model, several processes) no KV cache counts.
    bidirectional = estimate_memory(dataclasses.replace(model, causal=False), options)
    (tmp_path / "bidirectional.toml").write_text('[model]\ncausal = false\n[train]\nobjective = "seq2seq"\n')
    for extra, expected in (([tmp_path / "bidirectional.toml"], bidirectional), (["--processes", "2"], estimate_memory(model, options, processes=2))):
        result = invoke("memory", *flags, "--sample_every", "60", *extra)
        assert result.exit_code == 0, result.output
        assert re.search(rf"^total +{re.escape(human_bytes(expected.device_bytes))} ", result.output, re.M)
        assert re.search(r"^kv-cache .* not in the total$", result.output, re.M)


def test_cli_plot_writes_a_png(tmp_path):
    output = tmp_path / "mem.png"
    result = invoke("memory", *TINY_FLAGS, "--device-memory", "1MiB", "--plot", output)
    assert result.exit_code == 0, result.output
    assert f"wrote {output}" in result.output
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_refuses_a_path_it_cannot_write_before_estimating(tmp_path):
    for output, expected in ((tmp_path / "missing" / "mem.png", f"the folder {tmp_path / 'missing'} does not exist"),
                             (tmp_path / "mem", "name an image file ending in one of "),
                             (tmp_path / "mem.txt", "name an image file ending in one of ")):
        result = invoke("memory", *TINY_FLAGS, "--plot", output)
        assert result.exit_code == 1 and not isinstance(result.exception, (OSError, ValueError)), result.output
        assert f"Error: cannot write {output}: " in result.output and expected in result.output, result.output
        assert "total" not in result.output  # refused before the estimate
        assert not output.exists()


# -- the cuda backend's code: on the CPU emulator, and on a GPU ------------------------


@pytest.mark.parametrize("backend,name,batch_size,seq_len,lora,dtype", cuda_cases([
    ("qwen3_gqa", 2, 16, None, "bf16"),
    # 8192 rows on a narrow model: the embedding backward's CUB sort has the largest op scratch.
    ("llama_untied", 8, 1024, None, "bf16"),
    ("qwen2_bias", 1, 1200, None, "fp32"),
    ("qwen3_gqa", 2, 16, LoraConfig(4, dropout=0.1, targets="o,down"), "bf16"),
]))
def test_cuda_estimate_equals_real_allocations(request, backend, name, batch_size, seq_len, lora, dtype):
    use_cuda_backend(backend, request)
    config = CONFIGS[name]
    options = nanoq.TrainOptions(backend=backend, devices=1, batch_size=batch_size, seq_len=seq_len, lora=lora,
                                 dtype=dtype)
    estimate = estimate_memory(config, options)
    assert estimate.approximate == []
    assert [(a.context, a.name, a.bytes, a.kind) for a in estimate.allocations] == real_allocations(config, options)


def test_cli_memory_takes_the_packing_which_changes_the_cuda_plan(monkeypatch):
    # data.packing pack reserves cuda's attention-document-mask: `nanoq memory --packing` plans it.
    import nanoq.memory

    seen = []
    real = nanoq.memory.estimate_memory
    def recording(model, options, **kwargs):
        seen.append(options.packed_documents)
        return real(model, options, **kwargs)

    monkeypatch.setattr(nanoq.memory, "estimate_memory", recording)
    for packing in ("pack", "stream"):
        result = invoke("memory", *TINY_FLAGS, "--packing", packing)
        assert result.exit_code == 0, result.output
    assert seen == [True, False]


def nothing_fits_candidates(options, more_devices):
    """The settings the "nothing fits" line chooses from, spelled out apart from the search's code:
    batch_size 1 with each ZeRO stage, offload (in OFFLOAD's order, gradients from stage 2, none on a
    shared host) and recompute level, on the run's devices and on 64."""
    recomputes = [(), ("swiglu",), ("ffn",), ("ffn", "norms"), ("ffn", "norms", "qkv"), ("block",)]
    for devices in [options.devices] + ([64] if more_devices else []):
        for stage in (1, 2, 3):
            offloadable = ("optimizer", "master") + (("gradients",) if stage >= 2 else ())
            offloads = [offloadable[:count] for count in range(len(offloadable) + 1)] if more_devices else [()]
            for offload in offloads:
                for recompute in recomputes:
                    yield dataclasses.replace(options, devices=devices, zero_stage=stage, batch_size=1,
                                              recompute=",".join(recompute), offload=",".join(offload))


@pytest.mark.parametrize("shared_host", [True, False])
def test_nothing_fits_names_the_lightest_setting_the_estimator_finds(shared_host):
    # Qwen2.5-7B on one cpu device (`nanoq memory --backend cpu --seq-len 256 --batch-size 1`): there a
    # higher ZeRO stage only adds buffers, yet the line once named zero_stage 3 and its 125.43 GiB, more
    # than the run's own 115.79 GiB.
    config = nanoq.ModelConfig.from_pretrained(QWEN_7B)
    options = cpu_options(1, batch_size=1, seq_len=256)
    estimate = estimate_memory(config, options)
    (line,) = estimate.suggestions(1 << 30, shared_host=shared_host)
    lightest = min(estimate_memory(config, candidate).needed_bytes
                   for candidate in nothing_fits_candidates(options, more_devices=not shared_host))
    assert lightest <= estimate.needed_bytes
    assert re.search(r"needs? (\S+ \S+) per device;", line).group(1) == human_bytes(lightest), line
    # The setting it names needs that.
    named = re.fullmatch(r"nothing fits: even the lightest setting, (\d+) devices? with zero_stage (\d), batch_size 1"
                         r"(?:, recompute ([a-z,]+))?(?: and offload ([a-z,]+))?, needs .*", line)
    assert named, line
    devices, stage, recompute, offload = named.groups()
    named_options = dataclasses.replace(options, devices=int(devices), zero_stage=int(stage), batch_size=1,
                                        recompute=recompute or "", offload=offload or "")
    assert estimate_memory(config, named_options).needed_bytes == lightest
    if shared_host:
        assert line.startswith("nothing fits: even the lightest setting, 1 device with zero_stage 1, "), line


def test_the_model_given_twice_and_a_negative_reserve_are_usage_errors(tmp_path):
    # --model with --init-from estimated --model's and dropped --init-from without a word; a negative
    # --reserve was said to need a positive size, though 0 is taken.
    result = invoke("memory", "--model", QWEN_0_5B, "--init-from", tmp_path, "--backend", "cpu")
    assert result.exit_code == 2 and "give the model once: --model or --init-from, not both" in result.output
    result = invoke("memory", *TINY_FLAGS, "--reserve", "-1")
    assert result.exit_code == 2 and "'-1': the size must be zero or more" in result.output
    assert invoke("memory", *TINY_FLAGS, "--reserve", "0").exit_code == 0
    result = invoke("memory", *TINY_FLAGS, "--device-memory", "0")
    assert result.exit_code == 2 and "'0': the size must be positive" in result.output
