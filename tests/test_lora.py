"""LoRA against PyTorch: peft's LoRA on the same transformers model is the reference.

nanoq's adapters live in the core (both backends, through the op interface);
these tests hold them to peft on tiny models: loss and adapter gradients
over several devices and micro-batches, AdamW trajectories, dropout with the
core's documented mask, frozen base weights (no gradients, no optimizer
state, visible in the memory inspector), adapter-only checkpoints that
resume bit for bit, and both exports (merged model, PEFT adapter).
"""
import json
import os
import re

import numpy as np
import peft
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

import nanoq
from conftest import (
    IGNORE,
    SEQ,
    TorchTrainer,
    assert_same_tensors,
    assert_tensors_close,
    random_batch,
    split_rows,
    token_terms,
    torch_backward,
)
from nanoq.testing import OpRunner
from nanoq.checkpoint import CheckpointError, part_file_name
from nanoq.hf_export import export_adapter, export_checkpoint
from nanoq.lora import PEFT_NAMES, LoraConfig, adapter_shapes, projection_shape

LOSS_REL = 1e-5
GRAD_REL = 3e-5
TRAIN_LOSS_REL = 5e-5
WEIGHT_REL = 5e-4

# (variant, targets): every projection is covered, with biases (qwen2) and q/k norms (qwen3).
CASES = [("llama", "all"), ("qwen2", "q,k,v,o"), ("qwen3", "gate,up,down,q")]


def lora_trainer(checkpoint, lora, devices=1, batch_size=2, grad_accum=1, seed=0, backend="cpu", **options):
    config = nanoq.ModelConfig.from_pretrained(checkpoint)
    trainer = nanoq.Trainer(config, nanoq.TrainOptions(backend=backend, devices=devices, batch_size=batch_size,
                                                       seq_len=SEQ, grad_accum=grad_accum, seed=seed, lora=lora,
                                                       **options))
    trainer.import_weights(checkpoint)
    return trainer


def random_adapters(trainer, seed):
    """Adapters with B != 0 too (fresh ones have B = 0, which hides A's gradient)."""
    rng = np.random.default_rng(seed)
    shapes = adapter_shapes(trainer.config, trainer.lora)
    return {name: (rng.standard_normal(shape) / np.sqrt(max(shape))).astype(np.float32)
            for name, shape in shapes.items()}


def set_adapters(trainer, adapters):
    weights = trainer.get_weights()
    weights.update(adapters)
    trainer.set_weights(weights)


def nanoq_name(peft_name):
    return peft_name.replace("base_model.model.", "", 1).replace(".default", "")


def peft_model(hf_model, lora, adapters, dropout=0.0):
    """hf_model wrapped by peft with the same LoRA setting and adapters."""
    model = peft.get_peft_model(hf_model, peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=dropout,
        target_modules=[PEFT_NAMES[t] for t in lora.targets]))
    loaded = 0
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.from_numpy(adapters[nanoq_name(name)]))
                loaded += 1
    assert loaded == len(adapters)
    return model


def peft_grads(model):
    return {nanoq_name(n): p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant,targets", CASES)
def test_loss_and_adapter_gradients_match_peft(checkpoints, variant, targets):
    """Two devices x two micro-batches with very unequal counted tokens."""
    lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
    rng = np.random.default_rng(1)
    micro = [random_batch(rng, rows=4, mask_frac=f) for f in (0.1, 0.7)]
    with lora_trainer(checkpoints.path(variant), lora, devices=2, grad_accum=2) as tr:
        adapters = random_adapters(tr, 2)
        set_adapters(tr, adapters)
        for batch in micro:
            tr.step(*batch)
        grads = tr.get_gradients()
        stats = tr.update(lr=0.0)
    ref = torch_backward(peft_model(checkpoints.model(variant), lora, adapters), micro)
    assert sorted(grads) == sorted(adapters)  # adapters only: the base has no gradient
    assert stats.tokens == ref.tokens
    assert stats.loss == pytest.approx(ref.loss, rel=LOSS_REL)
    assert_tensors_close(grads, {nanoq_name(n): g for n, g in ref.grads.items()}, GRAD_REL, f"{variant} grad")
    assert min(float(np.abs(g).max()) for g in grads.values()) > 0  # every A and B gets a gradient


def test_adamw_steps_match_peft_and_leave_the_base_untouched(checkpoints):
    lora = LoraConfig(rank=4, alpha=16.0, targets="all")
    rng = np.random.default_rng(3)
    with lora_trainer(checkpoints.path("llama"), lora, batch_size=4) as tr:
        base = {n: w for n, w in tr.get_weights().items() if ".lora_" not in n}
        adapters = random_adapters(tr, 4)
        set_adapters(tr, adapters)
        ref = TorchTrainer(peft_model(checkpoints.model("llama"), lora, adapters))
        for step, clip in enumerate([1.0, 0.0, 0.5, 1.0, 0.0]):
            batch = random_batch(rng, rows=4, mask_frac=0.2)
            ref.step(*batch)
            tr.step(*batch)
            r = ref.update(lr=3e-3, weight_decay=0.1, grad_clip=clip)
            s = tr.update(lr=3e-3, weight_decay=0.1, grad_clip=clip)
            assert s.loss == pytest.approx(r.loss, rel=TRAIN_LOSS_REL), f"step {step}"
            assert s.grad_norm == pytest.approx(r.grad_norm, rel=1e-4), f"step {step}"
        weights = tr.get_weights()
    trained = {nanoq_name(n): w for n, w in ref.weights().items() if ".lora_" in n}
    assert_tensors_close({n: weights[n] for n in trained}, trained, WEIGHT_REL, "adapter")
    assert max(float(np.abs(weights[n] - adapters[n]).max()) for n in adapters) > 1e-3  # they did train
    assert_same_tensors({n: weights[n] for n in base}, base, "frozen weight")


def test_frozen_weights_have_no_gradients_or_optimizer_state(checkpoints):
    lora = LoraConfig(rank=2, targets="q,v")
    path = checkpoints.path("llama")
    config = nanoq.ModelConfig.from_pretrained(path)
    with lora_trainer(path, lora) as tr, nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", batch_size=2,
                                                                                   seq_len=SEQ)) as full:
        adapter_count = sum(int(np.prod(s)) for s in adapter_shapes(config, lora).values())
        model_count = sum(w.size for w in full.get_weights().values())
        assert tr.trainable_names == list(adapter_shapes(config, lora))
        assert sorted(tr.get_optimizer_state()["adam_m"]) == sorted(tr.trainable_names)

        def by_context(trainer):
            out = {}
            for a in trainer.get_allocations(0):
                out[a["context"]] = out.get(a["context"], 0) + a["bytes"]
            return out, {a["name"]: a["bytes"] for a in trainer.get_allocations(0)}

        contexts, names = by_context(tr)
        full_contexts, _ = by_context(full)
        # The inspector shows the frozen weights as weights, and gradients and
        # AdamW state sized by the adapters alone.
        assert names["frozen-weights"] == 4 * model_count
        assert names["adapters"] == contexts["gradients"] == contexts["adam-m"] == contexts["adam-v"] \
            == 4 * adapter_count
        assert full_contexts["gradients"] == 4 * model_count
        assert contexts["gradients"] * 50 < full_contexts["gradients"]
        frozen = tr.parameter_names.index("model.layers.0.self_attn.q_proj.weight")
        tr.step(*random_batch(np.random.default_rng(0), rows=2))
        with pytest.raises(ValueError, match="frozen"):
            tr._core.get_gradient(frozen)
        with pytest.raises(ValueError, match="frozen"):
            tr._core.get_optimizer_state(frozen, 1)


@pytest.mark.parametrize("options", [dict(recompute="block"), dict(recompute="qkv,swiglu"),
                                     dict(offload="optimizer,master")])
def test_recompute_and_offload_leave_lora_training_bitwise_unchanged(checkpoints, options):
    """Recomputation re-runs the adapters (with their dropout masks) inside
    backward; offload streams the adapters' AdamW state: neither may change a bit."""
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.2, targets="all")
    rng = np.random.default_rng(18)
    batches = [random_batch(rng, rows=2, mask_frac=0.2) for _ in range(2)]
    results = []
    for extra in ({}, options):
        with lora_trainer(checkpoints.path("qwen3"), lora, **extra) as tr:
            set_adapters(tr, random_adapters(tr, 19))
            for batch in batches:
                tr.step(*batch)
                tr.update(lr=1e-2)
            results.append(tr.get_weights(trainable_only=True))
    assert_same_tensors(results[1], results[0], f"adapter with {options}")


# -- dropout: the core's mask, reimplemented from cuda_core/dropout.h ------------

_MASK64 = (1 << 64) - 1


def _splitmix64(z):
    """The finaliser of dropout.h on uint64 arrays (numpy wraps on overflow)."""
    z = np.asarray(z, np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def mix_seed(seed, stream):
    return int(_splitmix64(np.uint64(seed ^ ((stream * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64))))


def dropout_keep(seed, n, drop):
    index = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _splitmix64(np.uint64(seed) + (index + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15))
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0) >= np.float32(drop)


def test_scale_dropout_op_draws_the_documented_mask():
    x = np.random.default_rng(0).standard_normal(20000).astype(np.float32)
    out = OpRunner("cpu").scale_dropout(x, 2.0, 0.25, 987654321)
    keep = dropout_keep(987654321, x.size, 0.25)
    np.testing.assert_array_equal(out, np.where(keep, x * np.float32(2.0 / 0.75), np.float32(0)))
    assert 0.24 < 1 - keep.mean() < 0.26


class FixedDropout(torch.nn.Module):
    """Dropout with a given keep mask over the flattened input."""

    def __init__(self, keep, drop):
        super().__init__()
        self.scale = torch.from_numpy(keep.astype(np.float32) / np.float32(1 - drop))

    def forward(self, x):
        return x * self.scale.reshape(x.shape)


def test_dropout_matches_peft_with_the_cores_masks(checkpoints):
    """One device, one micro-batch: the core keys each (layer, target) mask by
    mix_seed(mix_seed(mix_seed(seed, step * grad_accum + micro), rank), layer * 7 + target)."""
    drop, seed = 0.3, 11
    lora = LoraConfig(rank=4, alpha=8.0, dropout=drop, targets="q,o,down")
    inputs, targets = random_batch(np.random.default_rng(5), rows=2, mask_frac=0.2)
    with lora_trainer(checkpoints.path("llama"), lora, seed=seed) as tr:
        adapters = random_adapters(tr, 6)
        set_adapters(tr, adapters)
        tr.step(inputs, targets)
        grads = tr.get_gradients()
        stats = tr.update(lr=0.0)
    model = peft_model(checkpoints.model("llama"), lora, adapters, dropout=drop)
    step_seed = mix_seed(mix_seed(seed, 0), 0)
    rows = inputs.size
    target_index = {"q": 0, "o": 3, "down": 6}
    for name, module in model.named_modules():
        if name.endswith(".lora_dropout"):
            layer = int(name.split(".layers.")[1].split(".")[0])
            target = name.split(".")[-2].replace("_proj", "")
            width = projection_shape(tr.config, target)[1]
            keep = dropout_keep(mix_seed(step_seed, layer * 7 + target_index[target]), rows * width, drop)
            module["default"] = FixedDropout(keep, drop)
    ref = torch_backward(model, [(inputs, targets)])
    assert stats.loss == pytest.approx(ref.loss, rel=LOSS_REL)
    assert_tensors_close(grads, {nanoq_name(n): g for n, g in ref.grads.items()}, GRAD_REL, "dropout grad")
    # The masks matter: without them the reference differs by far more.
    plain = torch_backward(peft_model(checkpoints.model("llama"), lora, adapters), [(inputs, targets)])
    assert abs(plain.loss - ref.loss) > 100 * LOSS_REL * ref.loss


def test_dropout_is_off_in_validation_and_deterministic_in_training(checkpoints):
    batch = random_batch(np.random.default_rng(7), rows=2, mask_frac=0.1)
    results = []
    for dropout in (0.0, 0.5, 0.5):
        with lora_trainer(checkpoints.path("llama"), LoraConfig(rank=4, dropout=dropout, targets="all")) as tr:
            set_adapters(tr, random_adapters(tr, 8))
            evaluation = tr.validate(*batch)
            tr.step(*batch)
            results.append((evaluation.loss, tr.get_gradients()))
    assert results[0][0] == results[1][0] == results[2][0]
    assert_same_tensors(results[1][1], results[2][1], "dropout gradient")
    name = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert not np.allclose(results[0][1][name], results[1][1][name], rtol=1e-2)


# -- checkpoints and export --------------------------------------------------------


def test_checkpoint_holds_adapters_only_and_resumes_on_any_device_count(checkpoints, tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0, targets="q,k,v,o,down")
    rng = np.random.default_rng(9)
    steps = [random_batch(rng, rows=4, mask_frac=0.2) for _ in range(4)]  # one global batch per step
    path = checkpoints.path("llama")

    def train(tr, batches):
        for batch in batches:
            for micro in split_rows(*batch, 2):
                tr.step(*micro)
            tr.update(lr=2e-3)

    with lora_trainer(path, lora, grad_accum=2) as tr:
        train(tr, steps[:2])
        step_dir = tr.save_checkpoint(tmp_path / "ckpt", step=2)
        train(tr, steps[2:])
        expected = tr.get_weights(trainable_only=True)
    saved = load_file(os.path.join(step_dir, part_file_name(0, 1)))  # weights.<name>, master.<name>, ...
    assert sorted({key.partition(".")[2] for key in saved}) == sorted(expected)  # no base weight in the checkpoint
    with open(os.path.join(step_dir, "trainer_state.json")) as f:
        state = json.load(f)
    assert state["lora"] == dict(rank=4, alpha=8.0, dropout=0.0, targets=["q", "k", "v", "o", "down"])
    assert state["base_model"] == os.path.abspath(path)
    for devices, batch_size in ((1, 2), (2, 1)):
        with lora_trainer(path, lora, devices=devices, batch_size=batch_size, grad_accum=2) as resumed:
            resumed.load_checkpoint(step_dir)
            assert resumed.optimizer_steps == 2
            train(resumed, steps[2:])
            got = resumed.get_weights(trainable_only=True)
        if devices == 1:
            assert_same_tensors(got, expected, "resumed adapter")
        else:  # sums in another order
            assert_tensors_close(got, expected, 1e-5, "adapter resumed on 2 devices")


def test_same_device_count_resume_with_dropout_is_bitwise(checkpoints, tmp_path):
    lora = LoraConfig(rank=4, dropout=0.2, targets="all")
    rng = np.random.default_rng(12)
    batches = [random_batch(rng, rows=2) for _ in range(4)]
    path = checkpoints.path("llama")
    with lora_trainer(path, lora) as tr:
        for batch in batches[:2]:
            tr.step(*batch)
            tr.update(lr=1e-3)
        step_dir = tr.save_checkpoint(tmp_path / "ckpt", step=2)
        for batch in batches[2:]:
            tr.step(*batch)
            tr.update(lr=1e-3)
        expected = tr.get_weights(trainable_only=True)
    with lora_trainer(path, lora) as resumed:
        resumed.load_checkpoint(step_dir)
        for batch in batches[2:]:
            resumed.step(*batch)
            resumed.update(lr=1e-3)
        assert_same_tensors(resumed.get_weights(trainable_only=True), expected, "resumed adapter")


def test_lora_checkpoint_refuses_a_mismatched_trainer(checkpoints, tmp_path):
    path = checkpoints.path("llama")
    with lora_trainer(path, LoraConfig(rank=4)) as tr:
        step_dir = tr.save_checkpoint(tmp_path / "ckpt", step=0)
    with lora_trainer(path, LoraConfig(rank=2)) as other, pytest.raises(CheckpointError, match="LoRA"):
        other.load_checkpoint(step_dir)
    config = nanoq.ModelConfig.from_pretrained(path)
    with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", batch_size=2, seq_len=SEQ)) as full, \
            pytest.raises(CheckpointError, match="LoRA"):
        full.load_checkpoint(step_dir)


def test_lora_checkpoint_of_a_base_model_is_refused_on_initial_frozen_weights(checkpoints, tmp_path):
    # Before, it loaded onto the trainer's random frozen weights: a wrong model, without a word.
    path = checkpoints.path("llama")
    lora = LoraConfig(rank=4)
    with lora_trainer(path, lora) as tr:
        step_dir = tr.save_checkpoint(tmp_path / "ckpt", step=0)
        base = tr.get_weights()
    config = nanoq.ModelConfig.from_pretrained(path)
    options = nanoq.TrainOptions(backend="cpu", batch_size=2, seq_len=SEQ, lora=lora)
    with nanoq.Trainer(config, options) as fresh:
        with pytest.raises(CheckpointError, match=r"holds LoRA adapters trained on .*, but this trainer's frozen "
                                                  r"weights are its initial random ones: import the base model "
                                                  r"first \(trainer\.import_weights\("):
            fresh.load_checkpoint(step_dir)
        fresh.set_weights(base)  # frozen weights set from Python count as the caller's choice
        assert fresh.load_checkpoint(step_dir)["step"] == 0
        fresh.init_weights(3)  # and fresh ones are initial again
        with pytest.raises(CheckpointError, match="initial random ones"):
            fresh.load_checkpoint(step_dir)


def test_set_weights_refuses_names_that_are_not_parameters_and_non_numeric_values(checkpoints):
    config = nanoq.ModelConfig.from_pretrained(checkpoints.path("llama"))
    with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", batch_size=2, seq_len=SEQ)) as tr:
        weights = tr.get_weights()
        with pytest.raises(ValueError, match=r"1 weight\(s\) are not parameters of this model, e\.g\. "
                                             r"'model\.layers\.0\.typo'"):
            tr.set_weights(dict(weights, **{"model.layers.0.typo": np.zeros(3)}))
        name = next(iter(weights))
        with pytest.raises(TypeError, match=rf"weight {name}: expected a numeric array, got dtype"):
            tr.set_weights(dict(weights, **{name: np.full(weights[name].shape, "x")}))
        with pytest.raises(TypeError, match="weights must be a dict"):
            tr.set_weights(list(weights.values()))
        tr.set_weights({n: w.tolist() for n, w in weights.items()})  # nested lists are arrays too
        assert all(np.array_equal(tr.get_weights()[n], w) for n, w in weights.items())


def test_set_weights_names_a_wrong_shape_it_was_given_and_counts_the_missing_weights(checkpoints):
    config = nanoq.ModelConfig.from_pretrained(checkpoints.path("llama"))
    with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", batch_size=2, seq_len=SEQ)) as tr:
        weights = tr.get_weights()
        names, norm = list(weights), "model.norm.weight"
        with pytest.raises(ValueError, match=rf"^1 weight\(s\) have the wrong shape: model\.norm\.weight has shape "
                                             rf"\(3,\), expected \({config.hidden_size},\)$"):
            tr.set_weights({norm: np.zeros(3, np.float32)})  # the one given is named, not a missing one
        missing = [name for name in names if name != norm]
        with pytest.raises(ValueError, match=rf"^{len(missing)} of the model's {len(names)} parameters are missing "
                                             rf"from weights, e\.g\. {re.escape(repr(missing[:3])[1:-1])}; "
                                             rf"set_weights sets them all at once"):
            tr.set_weights({norm: np.zeros_like(weights[norm])})
        assert all(np.array_equal(tr.get_weights()[n], w) for n, w in weights.items())  # nothing was set


def logits(model, inputs):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(inputs).long()).logits.float().numpy()


def test_merged_and_peft_exports_give_the_same_logits_as_nanoq(checkpoints, tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0, targets="all")
    path = checkpoints.path("qwen2")
    rng = np.random.default_rng(13)
    inputs, targets = random_batch(rng, rows=2)
    with lora_trainer(path, lora) as tr:
        set_adapters(tr, random_adapters(tr, 14))
        for _ in range(2):
            tr.step(*random_batch(rng, rows=2))
            tr.update(lr=1e-2)
        nanoq_loss = tr.validate(inputs, targets).loss
        merged_dir = tr.export_model(tmp_path / "merged")
        adapter_dir = export_adapter(tr, tmp_path / "adapter")
        step_dir = tr.save_checkpoint(tmp_path / "ckpt", step=2)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == os.path.abspath(path)
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), adapter_dir)
    reference = logits(loaded, inputs)
    np.testing.assert_allclose(logits(merged, inputs), reference, atol=2e-5, rtol=1e-5)
    ce, _, mask = token_terms(loaded, inputs, targets)
    assert nanoq_loss == pytest.approx(float(ce[mask].double().mean()), rel=LOSS_REL)
    assert np.abs(reference - logits(AutoModelForCausalLM.from_pretrained(path), inputs)).max() > 1e-2
    # The same two exports from the checkpoint, with no trainer.
    merged_again = AutoModelForCausalLM.from_pretrained(export_checkpoint(step_dir, tmp_path / "merged2"))
    np.testing.assert_allclose(logits(merged_again, inputs), reference, atol=2e-5, rtol=1e-5)
    adapter_again = export_checkpoint(step_dir, tmp_path / "adapter2", merge_adapters=False)
    loaded_again = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), adapter_again)
    np.testing.assert_allclose(logits(loaded_again, inputs), reference, atol=1e-6)


@pytest.mark.parametrize("file", ["model.safetensors", "model.safetensors.index.json"])
def test_a_base_imported_from_its_weights_file_exports_merged_and_as_an_adapter(checkpoints, tmp_path, file):
    # import_weights takes a model's weights file or index too: the base it records is then a file,
    # whose folder holds the config (merge) and is what peft loads (adapter_config.json).
    import shutil

    base = tmp_path / "base"
    if file == "model.safetensors":
        shutil.copytree(checkpoints.path("llama"), base)
    else:
        AutoModelForCausalLM.from_pretrained(checkpoints.path("llama")).save_pretrained(base, max_shard_size="20KB")
    assert os.path.isfile(base / file)
    rng = np.random.default_rng(5)
    inputs, _ = random_batch(rng, rows=2)
    options = nanoq.TrainOptions(backend="cpu", batch_size=2, seq_len=SEQ, lora=LoraConfig(rank=2, targets="q,v"))
    with nanoq.Trainer(nanoq.ModelConfig.from_pretrained(base), options) as tr:
        tr.import_weights(base / file)
        set_adapters(tr, random_adapters(tr, 6))
        adapter_dir = export_adapter(tr, tmp_path / "adapter")
        step_dir = tr.save_checkpoint(tmp_path / "ckpt", step=0)
    assert json.load(open(os.path.join(adapter_dir, "adapter_config.json")))["base_model_name_or_path"] == str(base)
    reference = logits(peft.AutoPeftModelForCausalLM.from_pretrained(adapter_dir), inputs)
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(step_dir, tmp_path / "merged"))
    np.testing.assert_allclose(logits(merged, inputs), reference, atol=2e-5, rtol=1e-5)
    again = export_checkpoint(step_dir, tmp_path / "adapter2", merge_adapters=False)
    assert json.load(open(os.path.join(again, "adapter_config.json")))["base_model_name_or_path"] == str(base)


def test_export_checkpoint_needs_the_base_model(checkpoints, tmp_path):
    import shutil

    base = shutil.copytree(checkpoints.path("llama"), tmp_path / "base")
    with lora_trainer(base, LoraConfig(rank=2)) as tr:
        step_dir = tr.save_checkpoint(tmp_path / "ckpt", step=0)
    moved = shutil.move(base, tmp_path / "moved")
    with pytest.raises(ValueError, match="does not exist any more"):
        export_checkpoint(step_dir, tmp_path / "out")
    assert os.path.isfile(os.path.join(export_checkpoint(step_dir, tmp_path / "out", base_model=moved),
                                       "config.json"))
    with pytest.raises(ValueError, match="not the model the adapters were trained on"):
        export_checkpoint(step_dir, tmp_path / "other", base_model=checkpoints.path("qwen3"))
    # Unmerged, the adapters need no base weights: the moved base is named as recorded, with a warning.
    with pytest.warns(UserWarning, match=r"its base model .*/base is not there any more; the adapter's "
                                         r"adapter_config.json names it as recorded"):
        adapter = export_checkpoint(step_dir, tmp_path / "adapter", merge_adapters=False)
    assert json.load(open(os.path.join(adapter, "adapter_config.json")))["base_model_name_or_path"] == str(base)
    again = export_checkpoint(step_dir, tmp_path / "adapter-named", merge_adapters=False, base_model=moved)
    assert json.load(open(os.path.join(again, "adapter_config.json")))["base_model_name_or_path"] == str(moved)
    # A base given for the adapter is checked as for merging (the adapter names it as its model): another
    # architecture, the same architecture with other weights, a folder that is no model.
    from safetensors.numpy import load_file, save_file

    tuned = shutil.copytree(moved, tmp_path / "tuned")
    weights = load_file(os.path.join(tuned, "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * np.float32(1.5)
    save_file(weights, os.path.join(tuned, "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "empty").mkdir()
    for merge_adapters in (True, False):
        for other, reason in ((checkpoints.path("qwen3"), "is not the model the adapters were trained on: "),
                              (tuned, "is not the model the adapters were trained on: its weights are not those the "
                                      f"run imported from {base} "),
                              (tmp_path / "empty", "cannot be read as a Hugging Face model")):
            with pytest.raises(ValueError, match=re.escape(f"the base model {other} {reason}")):
                export_checkpoint(step_dir, tmp_path / "refused", base_model=other, merge_adapters=merge_adapters)
            assert not os.path.exists(tmp_path / "refused")


def test_bad_lora_settings_are_refused_before_the_core():
    config = nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4)
    with pytest.raises(ValueError, match="zero_stage 1"):
        nanoq.TrainOptions(backend="cpu", devices=2, zero_stage=2, lora=LoraConfig(rank=4))
    with pytest.raises(ValueError, match="rank"):
        nanoq.TrainOptions(backend="cpu", lora=dict(rank=0))
    with pytest.raises(ValueError, match="unknown LoRA target"):
        nanoq.TrainOptions(backend="cpu", lora=dict(rank=2, targets="q,attn"))
    with pytest.raises(TypeError, match="LoraConfig"):
        nanoq.TrainOptions(backend="cpu", lora=4)
    with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", seq_len=8)) as full, \
            pytest.raises(ValueError, match="no LoRA"):
        export_adapter(full, "unused")


# -- the command line --------------------------------------------------------------


def test_cli_lora_fine_tune_resume_and_both_exports(checkpoints, tmp_path):
    """nanoq train --init-from HF --lora-rank ... on masked (SFT-style) data,
    stopped and resumed, then nanoq export with and without --merge."""
    from click.testing import CliRunner

    from nanoq.data import write_tokens
    from nanoq_cli.main import cli

    base = checkpoints.path("llama")
    rng = np.random.default_rng(17)
    tokens = rng.integers(0, 100, size=6000)
    write_tokens(tmp_path / "train.bin", tokens, vocab_size=100, mask=rng.random(tokens.size) < 0.4)
    write_tokens(tmp_path / "eval.bin", tokens[:800], vocab_size=100)

    def run(*args):
        result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    common = ["train", "--init-from", base, "--lora-rank", 4, "--lora-alpha", 8, "--lora-targets", "q,v,down",
              "--train-data", tmp_path / "train.bin", "--eval-data", tmp_path / "eval.bin", "--seq-len", SEQ,
              "--batch-size", 2, "--eval-every", 0, "--checkpoint-every", 2, "--keep-last", 5, "--lr", 1e-2,
              "--warmup-steps", 1,
              "--backend", "cpu", "--out-dir", tmp_path / "runs", "--run-name", "ft"]
    run(*common, "--steps", 2)  # a first run that "stops" after 2 steps
    output = run(*common, "--steps", 4, "--resume")
    assert "lora: rank 4" in output and "resuming" in output
    run_dir = tmp_path / "runs" / "ft"
    step4 = run_dir / "checkpoints" / "step_00000004"
    assert all(".lora_" in name for name in load_file(str(step4 / part_file_name(0, 1))))
    # The resumed run's own exports (the first run's final model is in model/).
    final = run_dir / "model-step4"
    merged = AutoModelForCausalLM.from_pretrained(final)
    adapter = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), final / "adapter")
    inputs, _ = random_batch(rng, rows=2, vocab=100)
    np.testing.assert_allclose(logits(merged, inputs), logits(adapter, inputs), atol=2e-5, rtol=1e-5)
    # The checkpoint's, with the command: the same model.
    run("export", step4, "-o", tmp_path / "peft")
    run("export", step4, "-o", tmp_path / "full", "--merge")
    assert sorted(os.listdir(tmp_path / "peft")) == ["adapter_config.json", "adapter_model.safetensors"]
    np.testing.assert_allclose(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "full"), inputs),
                               logits(merged, inputs), atol=2e-5, rtol=1e-5)
    from_peft = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "peft")
    np.testing.assert_allclose(logits(from_peft, inputs), logits(merged, inputs), atol=2e-5, rtol=1e-5)
    # nanoq memory reads the architecture from --init-from too.
    estimate = run("memory", "--init-from", base, "--lora-rank", 4, "--lora-targets", "q,v,down", "--seq-len", SEQ,
                   "--train-data", tmp_path / "train.bin", "--backend", "cpu")
    assert "frozen; LoRA rank 4 on q,v,down" in estimate
    with pytest.raises(AssertionError, match="--merge is for LoRA"):
        run("export", checkpoints_full(tmp_path), "-o", tmp_path / "bad", "--merge")


def checkpoints_full(tmp_path):
    """A checkpoint of full (non-LoRA) training."""
    config = nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4)
    with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", seq_len=8)) as trainer:
        return trainer.save_checkpoint(tmp_path / "full-ckpt", step=0)
