"""The cuda backend against the cpu backend (itself checked against PyTorch in
test_reference.py): whole training steps of the cuda backend's code.

Tests taking the `backend` fixture run twice: on a real GPU ("cuda", marked
``gpu``: skipped without a GPU, failing if the cuda backend is unusable on a
machine with one) and on the CPU emulator of CUDA ("cuda_emulated", marked
``cuda_emulated``, on every machine: the same kernels, dtype dispatch,
scratch, copies, streams and trainer paths, with a reference GEMM for
cuBLASLt and an in-process NCCL). The others need a GPU and are marked gpu.

Tolerances. dtype "fp32" on cuda computes like the cpu backend up to the order
of fp32 sums (cuBLASLt with CUBLAS_COMPUTE_32F, no TF32), so it is held to
the bounds test_reference.py uses against PyTorch: loss within 2e-5, every
gradient within 1e-4 of its tensor's max |grad|, weights after 10 AdamW steps
within 5e-4 of max |w| (Adam turns rounding in near-zero gradients into
O(lr) updates). dtype "bf16" (fp32 master weights) is compared with the fp32
cpu run loosely: on these models PyTorch's bf16 autocast stays within 3e-3 of
fp32 over 10 steps at lr 3e-3, and nanoq keeps activations in bf16 too, so
the bound is 2e-2.

Sizes are small (each test well under 30 s on an H200, most under a second
once the CUDA context exists); the cpu reference runs next to each one.
"""

import numpy as np
import pytest

import nanoq
from nanoq.backends import device_count
from conftest import (
    CUDA_BACKENDS,
    IGNORE,
    SEQ,
    VOCAB,
    assert_same_tensors,
    assert_tensors_close,
    assert_trained_weights_close,
    open_trainer,
    random_batch,
    use_cuda_backend,
)

@pytest.fixture(params=[pytest.param(name, marks=mark, id=name) for name, mark in CUDA_BACKENDS])
def backend(request):
    """The cuda backend a test runs on: "cuda" (a GPU) or "cuda_emulated"."""
    return use_cuda_backend(request.param, request)

LOSS_REL = 2e-5
GRAD_REL = 1e-4
TRAIN_LOSS_REL = 1e-4
WEIGHT_REL = 5e-4
BF16_LOSS_REL = 2e-2

# The variants of conftest.MODEL_VARIANTS that a GPU run must cover.
GPU_VARIANTS = ["llama", "llama_tied", "qwen2", "qwen3"]
# Alternating clip settings: always clips (norms are ~3-7), disabled, never clips.
CLIP_SCHEDULE = [1.0, 0.0, 1.0, 100.0, 1.0, 1.0, 0.0, 100.0, 1.0, 1.0]


def cuda_options(dtype="fp32", master_dtype="fp32", optimizer_dtype="fp32", devices=1, batch_size=4,
                 seq_len=SEQ, grad_accum=1, seed=0, z_loss=0.0, backend="cuda"):
    return nanoq.TrainOptions(backend=backend, dtype=dtype, master_dtype=master_dtype,
                              optimizer_dtype=optimizer_dtype, devices=devices, batch_size=batch_size,
                              seq_len=seq_len, grad_accum=grad_accum, seed=seed, z_loss=z_loss)


def open_cuda_trainer(checkpoint, **options):
    """A cuda trainer with the checkpoint's config and weights imported."""
    trainer = nanoq.Trainer(nanoq.ModelConfig.from_pretrained(checkpoint), cuda_options(**options))
    trainer.import_weights(checkpoint)
    return trainer


def assert_close(actual, expected, rel, what):
    assert abs(actual - expected) <= rel * abs(expected), (
        f"{what}: {actual!r} vs {expected!r} (rel err {abs(actual - expected) / abs(expected):.2e} > {rel:g})")


def assert_same_stats(a, b, what):
    """Every field bitwise equal (nan equals nan: validate() has no grad_norm)."""
    for name, x in vars(a).items():
        y = getattr(b, name)
        assert x == y or (x != x and y != y), f"{what}: {name} {x!r} != {y!r}"


def assert_stats_close(stats, ref, rel, what):
    assert stats.tokens == ref.tokens, f"{what}: tokens {stats.tokens} != {ref.tokens}"
    assert_close(stats.loss, ref.loss, rel, f"{what} loss")
    assert_close(stats.lse_max, ref.lse_max, rel, f"{what} lse_max")
    assert_close(stats.lse_mean, ref.lse_mean, rel, f"{what} lse_mean")


# --------------------------------------------------------------------------
# fp32: the cuda backend computes what the cpu backend computes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_fp32_loss_and_every_gradient_match_cpu(checkpoints, variant, backend):
    batch = random_batch(np.random.default_rng(1), rows=4, mask_frac=0.1)
    results = []
    for trainer in (open_trainer(checkpoints.path(variant), batch_size=4),
                    open_cuda_trainer(checkpoints.path(variant), backend=backend)):
        with trainer:
            trainer.step(*batch)
            gradients = trainer.get_gradients()
            results.append((trainer.update(lr=1e-3), gradients))
    (cpu_stats, cpu_grads), (cuda_stats, cuda_grads) = results
    assert_stats_close(cuda_stats, cpu_stats, LOSS_REL, f"{variant}")
    assert_close(cuda_stats.grad_norm, cpu_stats.grad_norm, GRAD_REL, f"{variant} grad_norm")
    assert_tensors_close(cuda_grads, cpu_grads, GRAD_REL, f"{variant} cuda grad")


@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_fp32_ten_adamw_steps_match_cpu(checkpoints, variant, backend):
    rng = np.random.default_rng(10)
    batches = [random_batch(rng, rows=4, mask_frac=0.1) for _ in CLIP_SCHEDULE]
    runs = []
    for trainer in (open_trainer(checkpoints.path(variant), batch_size=4),
                    open_cuda_trainer(checkpoints.path(variant), backend=backend)):
        with trainer:
            stats = []
            for batch, clip in zip(batches, CLIP_SCHEDULE):
                trainer.step(*batch)
                stats.append(trainer.update(lr=1e-3, weight_decay=0.1, grad_clip=clip))
            runs.append((stats, trainer.get_weights()))
    (cpu_stats, cpu_weights), (cuda_stats, cuda_weights) = runs
    for step, (c, g) in enumerate(zip(cpu_stats, cuda_stats)):
        assert_stats_close(g, c, TRAIN_LOSS_REL, f"{variant} step {step}")
        assert_close(g.grad_norm, c.grad_norm, GRAD_REL, f"{variant} step {step} grad_norm")
    assert_trained_weights_close(cuda_weights, cpu_weights, WEIGHT_REL, f"{variant} cuda weight after 10 steps",
                                 lr=1e-3, steps=len(CLIP_SCHEDULE))


def test_fp32_z_loss_masking_accumulation_and_validate_match_cpu(checkpoints, backend):
    """The classifier's z-loss gradient, ignored targets (a whole row among
    them), a mean over two micro-batches, and validate() on the held-out batch."""
    rng = np.random.default_rng(2)
    micro_batches = [random_batch(rng, rows=4, mask_frac=f) for f in (0.4, 0.0)]
    micro_batches[0][1][2, :] = IGNORE
    held_out = random_batch(rng, rows=4, mask_frac=0.2)
    path = checkpoints.path("llama_tied")
    results = []
    for trainer in (open_trainer(path, batch_size=4, grad_accum=2, z_loss=2e-2),
                    open_cuda_trainer(path, grad_accum=2, z_loss=2e-2, backend=backend)):
        with trainer:
            for batch in micro_batches:
                trainer.step(*batch)
            validation = trainer.validate(*held_out)
            gradients = trainer.get_gradients()
            results.append((trainer.update(lr=1e-3), validation, gradients))
    (cpu_stats, cpu_val, cpu_grads), (cuda_stats, cuda_val, cuda_grads) = results
    assert cpu_stats.z_loss > 0.1, f"z-loss {cpu_stats.z_loss} too small to test anything"
    assert_stats_close(cuda_stats, cpu_stats, LOSS_REL, "train")
    assert_close(cuda_stats.z_loss, cpu_stats.z_loss, LOSS_REL, "z_loss")
    assert_close(cuda_stats.loss_1k, cpu_stats.loss_1k, LOSS_REL, "loss_1k")
    assert_stats_close(cuda_val, cpu_val, LOSS_REL, "validate")
    assert_tensors_close(cuda_grads, cpu_grads, GRAD_REL, "z-loss/masked/accumulated cuda grad")


# Head dims the attention kernel pads to (64, 128, 256), a sequence that is
# not a multiple of its 32-token tiles, and a vocabulary that is not a
# multiple of any power of two above 8.
REALISTIC_SHAPES = {
    "qwen2_like_hd64": dict(head_dim=64, qkv_bias=True),
    "qwen3_like_hd128": dict(head_dim=128, qk_norm=True),
    "llama_like_hd256": dict(head_dim=256),
}


@pytest.mark.parametrize("shape", list(REALISTIC_SHAPES))
def test_fp32_and_bf16_match_cpu_at_realistic_head_dims(shape, backend):
    config = nanoq.ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
                               **REALISTIC_SHAPES[shape])
    seq_len = 300 if backend == "cuda" else 70  # the emulator: attention costs T^2; 70 is still off the tiles
    batch = random_batch(np.random.default_rng(3), rows=2, seq_len=seq_len, vocab=1000, mask_frac=0.05)
    results = {}
    for name, options in (
            ("cpu", nanoq.TrainOptions(backend="cpu", batch_size=2, seq_len=seq_len)),
            ("cuda fp32", cuda_options(batch_size=2, seq_len=seq_len, backend=backend)),
            ("cuda bf16", cuda_options(dtype="bf16", batch_size=2, seq_len=seq_len, backend=backend))):
        with nanoq.Trainer(config, options) as trainer:  # the same seeded init on every backend
            trainer.step(*batch)
            gradients = trainer.get_gradients()
            results[name] = (trainer.update(lr=1e-3), gradients)
    cpu_stats, cpu_grads = results["cpu"]
    fp32_stats, fp32_grads = results["cuda fp32"]
    bf16_stats, bf16_grads = results["cuda bf16"]
    assert_stats_close(fp32_stats, cpu_stats, LOSS_REL, f"{shape} fp32")
    assert_tensors_close(fp32_grads, cpu_grads, GRAD_REL, f"{shape} fp32 cuda grad")
    assert_close(bf16_stats.loss, cpu_stats.loss, BF16_LOSS_REL, f"{shape} bf16 loss")
    assert_close(bf16_stats.grad_norm, cpu_stats.grad_norm, 0.1, f"{shape} bf16 grad_norm")


def test_wide_mlp_bias_gradients_match_cpu(backend):
    # gate and up biases (mlp_bias, as Nano-style models have) at a width whose column sums need the
    # largest op scratch of the step: the scratch plan must reserve bias_backward at the intermediate
    # width (it did not, and the first backward failed: "cuda op needs more scratch than was reserved").
    config = nanoq.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=4096, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=4, qkv_bias=True, o_bias=True,
                               mlp_bias=True)
    batch = random_batch(np.random.default_rng(5), rows=4, seq_len=256, vocab=256, mask_frac=0.05)
    results = {}
    for name, options in (("cpu", nanoq.TrainOptions(backend="cpu", batch_size=4, seq_len=256)),
                          ("cuda", cuda_options(batch_size=4, seq_len=256, backend=backend))):
        with nanoq.Trainer(config, options) as trainer:  # the same seeded init on every backend
            trainer.step(*batch)
            gradients = trainer.get_gradients()
            results[name] = (trainer.update(lr=1e-3), gradients)
    assert_stats_close(results["cuda"][0], results["cpu"][0], LOSS_REL, "wide mlp_bias")
    assert_tensors_close(results["cuda"][1], results["cpu"][1], GRAD_REL, "wide mlp_bias cuda grad")


# --------------------------------------------------------------------------
# bf16
# --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_bf16_losses_track_fp32_cpu_and_fall_on_a_learnable_batch(checkpoints, variant, backend):
    """One batch repeated 10 times at lr 3e-3: the fp32 loss falls from ~6
    to ~1; bf16 (fp32 master weights and AdamW state) must follow it."""
    batch = random_batch(np.random.default_rng(11), rows=4)
    losses = []
    for trainer in (open_trainer(checkpoints.path(variant), batch_size=4),
                    open_cuda_trainer(checkpoints.path(variant), dtype="bf16", backend=backend)):
        with trainer:
            run = []
            for _ in range(10):
                trainer.step(*batch)
                run.append(trainer.update(lr=3e-3, weight_decay=0.1, grad_clip=1.0).loss)
            losses.append(run)
    cpu_losses, bf16_losses = losses
    for step, (c, b) in enumerate(zip(cpu_losses, bf16_losses)):
        assert_close(b, c, BF16_LOSS_REL, f"{variant} bf16 step {step} (cpu fp32 losses {cpu_losses}, "
                                          f"bf16 {bf16_losses})")
    assert bf16_losses[-1] < 0.5 * bf16_losses[0], f"{variant}: bf16 loss did not fall: {bf16_losses}"


def _bytes_by_context(allocations):
    out = {}
    for a in allocations:
        out[a["context"]] = out.get(a["context"], 0) + a["bytes"]
    return out


def test_bf16_master_weights_and_bf16_adam_state_train(checkpoints, backend):
    path = checkpoints.path("qwen3")
    batch = random_batch(np.random.default_rng(12), rows=4)
    with open_cuda_trainer(path, dtype="bf16", master_dtype="bf16", optimizer_dtype="bf16", backend=backend) as trainer:
        losses = []
        for _ in range(10):
            trainer.step(*batch)
            stats = trainer.update(lr=1e-2, weight_decay=0.1, grad_clip=1.0)
            assert np.isfinite(stats.loss) and np.isfinite(stats.grad_norm), stats
            losses.append(stats.loss)
        n_params = sum(w.size for w in trainer.get_weights().values())
        by_context = _bytes_by_context(trainer.get_allocations(0))
    assert losses[-1] < 0.8 * losses[0], f"bf16 master/optimizer: loss did not fall: {losses}"
    # bf16 master weights are the weights themselves; the moments are 2 bytes each.
    assert "master" not in by_context, f"a separate master copy was allocated: {by_context}"
    for context in ("weights", "adam-m", "adam-v"):
        assert 2 * n_params <= by_context[context] < 3 * n_params, (
            f"{context}: {by_context[context]} bytes for {n_params} bf16 parameters")


# --------------------------------------------------------------------------
# Device arrays (cupy) as batches
# --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_device")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cupy_batch_gives_bitwise_the_numpy_result(checkpoints, dtype):
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(13)
    train, held_out = random_batch(rng, rows=4, mask_frac=0.1), random_batch(rng, rows=4, mask_frac=0.1)
    path = checkpoints.path("qwen2")
    runs = {}
    for kind in ("numpy", "cupy"):
        convert = cupy.asarray if kind == "cupy" else (lambda a: a)
        with open_cuda_trainer(path, dtype=dtype) as trainer:
            validation = trainer.validate(*map(convert, held_out))
            trainer.step(*map(convert, train))
            gradients = trainer.get_gradients()
            runs[kind] = (validation, trainer.update(lr=1e-3), gradients, trainer.get_weights())
    (nv, ns, ng, nw), (cv, cs, cg, cw) = runs["numpy"], runs["cupy"]
    assert_same_stats(cv, nv, f"{dtype} validate, cupy vs numpy batch")
    assert_same_stats(cs, ns, f"{dtype} update, cupy vs numpy batch")
    assert_same_tensors(cg, ng, f"{dtype} cupy-batch grad")
    assert_same_tensors(cw, nw, f"{dtype} cupy-batch weight")
@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_device")
def test_bad_device_batches_raise_before_the_core_and_leave_the_trainer_usable(checkpoints):
    cupy = pytest.importorskip("cupy")
    inputs, targets = random_batch(np.random.default_rng(14), rows=4)
    good_inputs, good_targets = cupy.asarray(inputs), cupy.asarray(targets)
    with open_cuda_trainer(checkpoints.path("llama")) as trainer:
        with pytest.raises(TypeError, match="int32"):
            trainer.step(good_inputs.astype(cupy.int64), good_targets)
        with pytest.raises(TypeError, match="int32"):
            trainer.validate(good_inputs, good_targets.astype(cupy.int64))
        with pytest.raises(ValueError, match="shape"):
            trainer.step(good_inputs[:, :-1].copy(), good_targets[:, :-1].copy())
        with pytest.raises(ValueError, match="contiguous"):
            wide = cupy.zeros((4, 2 * SEQ), dtype=cupy.int32)
            trainer.step(wide[:, ::2], good_targets)
        with pytest.raises(TypeError, match="both"):
            trainer.step(good_inputs, targets)

        bad_inputs = good_inputs.copy()
        bad_inputs[1, 5] = VOCAB + 5
        with pytest.raises(ValueError, match=rf"token id {VOCAB + 5} .*inputs\[1, 5\]"):
            trainer.step(bad_inputs, good_targets)
        bad_targets = good_targets.copy()
        bad_targets[2, 3] = -7  # negative and not -100
        with pytest.raises(ValueError, match=r"token id -7 .*targets\[2, 3\]"):
            trainer.validate(good_inputs, bad_targets)

        masked_targets = good_targets.copy()
        masked_targets[0, :] = IGNORE  # -100 is allowed in targets
        trainer.step(good_inputs, masked_targets)
        stats = trainer.update(lr=1e-3)
    assert stats.tokens == 3 * SEQ, f"counted {stats.tokens} tokens, expected {3 * SEQ}"
    assert np.isfinite(stats.loss), stats


# A kernel that keeps its stream busy for `cycles` GPU clocks (1e9: about half a second).
SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_device")
def test_device_batch_written_on_another_stream_is_read_after_it(checkpoints):
    """The tokens are written on a producer stream of the caller's, behind a
    long kernel; the batch's __cuda_array_interface__ names that stream
    (cupy reports its current stream), and nanoq's reads must wait for it.
    Read too early, the buffers still hold zeros and the loss differs."""
    cupy = pytest.importorskip("cupy")
    spin = cupy.RawKernel(SPIN_SOURCE, "spin")
    rng = np.random.default_rng(15)
    batch, held_out = random_batch(rng, rows=4), random_batch(rng, rows=4)
    path = checkpoints.path("llama")
    with open_cuda_trainer(path) as trainer:
        expected_validation = trainer.validate(*held_out)
        trainer.step(*batch)
        expected_update = trainer.update(lr=1e-3)

    def produced(host_arrays, producer):
        """Device copies of host_arrays, zero until `producer` writes them after a long kernel."""
        sources = [cupy.asarray(a) for a in host_arrays]
        outputs = [cupy.zeros_like(a) for a in sources]
        cupy.cuda.Device().synchronize()
        with producer:
            spin((1,), (1,), (np.int64(1_000_000_000),))
            for out, source in zip(outputs, sources):
                out[...] = source
        return outputs

    # Through Trainer (which also checks the tokens, on the producer's stream)
    # and through the core alone, whose own wait is then all that orders the reads.
    for route in ("trainer", "core"):
        producer = cupy.cuda.Stream(non_blocking=True)
        with open_cuda_trainer(path) as trainer:
            held_out_on_device = produced(held_out, producer)
            with producer:
                if route == "trainer":
                    validation = trainer.validate(*held_out_on_device)
                else:
                    validation = nanoq.StepStats(**trainer._core.validate_device(
                        held_out_on_device[0].data.ptr, held_out_on_device[1].data.ptr, 0, producer.ptr,
                        producer.ptr))
            batch_on_device = produced(batch, producer)
            with producer:
                if route == "trainer":
                    trainer.step(*batch_on_device)
                else:
                    trainer._core.step_device(batch_on_device[0].data.ptr, batch_on_device[1].data.ptr, 0,
                                              producer.ptr, producer.ptr)
            update = trainer.update(lr=1e-3)
        producer.synchronize()
        assert_same_stats(validation, expected_validation, f"validate, batch from a producer stream ({route})")
        assert_same_stats(update, expected_update, f"update, batch from a producer stream ({route})")


# --------------------------------------------------------------------------
# Reproducibility and devices
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_two_identical_runs_are_bitwise_identical(checkpoints, dtype, backend):
    rng = np.random.default_rng(15)
    batches = [random_batch(rng, rows=4, mask_frac=0.1) for _ in range(6)]
    runs = []
    for _ in range(2):
        with open_cuda_trainer(checkpoints.path("qwen3"), dtype=dtype, grad_accum=2, backend=backend) as trainer:
            stats = []
            for first, second in zip(batches[::2], batches[1::2]):
                trainer.step(*first)
                trainer.step(*second)
                stats.append(trainer.update(lr=1e-3))
            runs.append((stats, trainer.get_weights()))
    (stats_a, weights_a), (stats_b, weights_b) = runs
    for step, (a, b) in enumerate(zip(stats_a, stats_b)):
        assert_same_stats(a, b, f"{dtype} update {step} of the second run")
    assert_same_tensors(weights_a, weights_b, f"{dtype} weight of the second run")


def test_two_devices_match_one_device(checkpoints, backend):
    if device_count(backend) < 2:
        pytest.skip("needs 2 GPUs")  # the emulator has 4 devices: never skipped there
    rng = np.random.default_rng(16)
    batches = [random_batch(rng, rows=4, mask_frac=0.2) for _ in range(3)]
    runs = []
    for devices in (1, 2):
        with open_cuda_trainer(checkpoints.path("llama"), devices=devices, batch_size=4 // devices,
                               backend=backend) as trainer:
            stats = []
            for batch in batches:
                trainer.step(*batch)
                stats.append(trainer.update(lr=1e-3))
            runs.append((stats, trainer.get_weights()))
    (one_stats, one_weights), (two_stats, two_weights) = runs
    for step, (one, two) in enumerate(zip(one_stats, two_stats)):
        assert_stats_close(two, one, LOSS_REL, f"2 GPUs update {step}")
        assert_close(two.grad_norm, one.grad_norm, GRAD_REL, f"2 GPUs update {step} grad_norm")
    assert_tensors_close(two_weights, one_weights, WEIGHT_REL, "2-GPU weight")


# --------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------


def _free_gpu_bytes() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free)
    finally:
        pynvml.nvmlShutdown()
@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_device")
def test_allocations_list_device_segments_that_the_gpu_really_holds():
    """~45M parameters in bf16 with fp32 master weights: every context is a
    device segment of the expected size, the GPU's free memory drops by at
    least their sum, and close() gives it back."""
    config = nanoq.ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=4)
    options = cuda_options(dtype="bf16", batch_size=4, seq_len=512)
    with nanoq.Trainer(config, cuda_options(seq_len=8)):
        pass  # creates the CUDA context and library handles outside the measurement
    free_before = _free_gpu_bytes()
    trainer = nanoq.Trainer(config, options)
    try:
        inputs, targets = random_batch(np.random.default_rng(17), rows=4, seq_len=512, vocab=32000)
        trainer.step(inputs, targets)
        trainer.update(lr=1e-3)
        free_during = _free_gpu_bytes()
        allocations = trainer.get_allocations(0)
        n_params = sum(w.size for w in trainer.get_weights().values())
    finally:
        trainer.close()
    free_after = _free_gpu_bytes()

    device = [a for a in allocations if a["kind"] == "device"]
    by_context = _bytes_by_context(device)
    for context in ("weights", "master", "gradients", "adam-m", "adam-v", "activations"):
        assert by_context.get(context, 0) > 0, f"no device segment for {context}: {by_context}"
    for a in allocations:
        assert a["name"] and a["bytes"] > 0 and a["kind"] in ("device", "pinned", "host"), a
    assert 2 * n_params <= by_context["weights"] < 3 * n_params, f"bf16 weights: {by_context}, {n_params} params"
    for context in ("master", "adam-m", "adam-v"):
        assert 4 * n_params <= by_context[context] < 5 * n_params, f"fp32 {context}: {by_context}, {n_params} params"
    device_total = sum(by_context.values())
    taken = free_before - free_during
    assert taken >= 0.95 * device_total, (
        f"the GPU lost {taken / 2**20:.1f} MiB but the allocations list {device_total / 2**20:.1f} MiB")
    leaked = free_before - free_after
    assert leaked < 256 * 2**20, f"{leaked / 2**20:.1f} MiB not returned by close() " \
                                 f"(the trainer held {device_total / 2**20:.1f} MiB)"


def test_cuda_lora_step_matches_cpu(checkpoints, backend):
    """LoRA (all targets, dropout) on cuda fp32 == cpu: the masks are the same hash on both."""
    from nanoq.lora import LoraConfig, adapter_shapes

    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.2, targets="all")
    batch = random_batch(np.random.default_rng(15), rows=4, mask_frac=0.2)
    results = []
    for name, extra in (("cpu", {}), (backend, {"dtype": "fp32"})):
        options = nanoq.TrainOptions(backend=name, batch_size=4, seq_len=SEQ, lora=lora, **extra)
        with nanoq.Trainer(nanoq.ModelConfig.from_pretrained(checkpoints.path("llama")), options) as tr:
            tr.import_weights(checkpoints.path("llama"))
            rng = np.random.default_rng(16)
            weights = tr.get_weights()
            weights.update({name: (rng.standard_normal(shape) / np.sqrt(max(shape))).astype(np.float32)
                            for name, shape in adapter_shapes(tr.config, lora).items()})
            tr.set_weights(weights)
            tr.step(*batch)
            grads = tr.get_gradients()
            stats = tr.update(lr=1e-3)
            results.append((stats, grads, tr.get_weights(trainable_only=True)))
    (cpu_stats, cpu_grads, cpu_weights), (gpu_stats, gpu_grads, gpu_weights) = results
    assert gpu_stats.loss == pytest.approx(cpu_stats.loss, rel=2e-5)
    assert_tensors_close(gpu_grads, cpu_grads, 1e-4, "cuda adapter grad")
    assert_tensors_close(gpu_weights, cpu_weights, 5e-4, "cuda adapter")


# --------------------------------------------------------------------------
# Packed documents and bidirectional attention
# --------------------------------------------------------------------------


def packed_positions(lengths, rows, seq_len=SEQ):
    """positions [rows, seq_len] of documents of `lengths` packed in turn (cut at seq_len)."""
    out = np.zeros((rows, seq_len), np.int32)
    for r in range(rows):
        row = [p for n in lengths[r % len(lengths):] + lengths for p in range(n)][:seq_len]
        out[r] = row
    return out


def test_fp32_packed_and_bidirectional_steps_match_cpu(checkpoints, backend):
    """Steps alternating packed positions (two layouts: the captured step reads
    the new ones), no positions, and a bidirectional model, as on the cpu."""
    rng = np.random.default_rng(8)
    batches = [random_batch(rng, rows=4, mask_frac=0.1) for _ in range(3)]
    layouts = [packed_positions([5, 3, 8], 4), packed_positions([1, 12, 7, 2], 4), None]
    for variant, causal in (("qwen3", True), ("llama", False)):
        config = nanoq.ModelConfig.from_pretrained(checkpoints.path(variant))
        config.causal = causal
        results = []
        for options in (cuda_options(backend="cpu"), cuda_options(backend=backend)):
            with nanoq.Trainer(config, options) as trainer:
                trainer.import_weights(checkpoints.path(variant))
                steps = []
                for (inputs, targets), positions in zip(batches * 2, layouts * 2):
                    trainer.step(inputs, targets, positions=positions if causal else None)
                    gradients = trainer.get_gradients()
                    steps.append((trainer.update(lr=1e-3), gradients))
                results.append(steps)
        for step, ((cpu_stats, cpu_grads), (cuda_stats, cuda_grads)) in enumerate(zip(*results)):
            what = f"{variant} causal={causal} step {step}"
            assert_stats_close(cuda_stats, cpu_stats, TRAIN_LOSS_REL, what)
            assert_tensors_close(cuda_grads, cpu_grads, GRAD_REL, f"{what} grad")
