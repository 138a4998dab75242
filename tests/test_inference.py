"""Trainers for forward passes only (TrainOptions.inference): the weights
without gradients, master weights or AdamW state; the reads of the model
bitwise as a training trainer's; every call that trains refused."""
import numpy as np
import pytest
from conftest import cuda_cases, use_cuda_backend

import nanoq
from nanoq.lora import LoraConfig
from nanoq.memory import estimate_memory

CONFIG = nanoq.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
TRAINING_STATE = {"master", "gradients", "adam-m", "adam-v"}


def options(backend="cpu", **more):
    dtype = "fp32" if backend == "cpu" else "bf16"
    return nanoq.TrainOptions(**dict(dict(backend=backend, dtype=dtype, batch_size=2, seq_len=16, threads=1), **more))


def tokens(seed=0, rows=2):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (rows, 16), dtype=np.int32)


def pair(backend="cpu", **more):
    """A training trainer, trained a step so its weights are not the initial
    ones, and an inference trainer given its weights."""
    training = nanoq.Trainer(CONFIG, options(backend, **more))
    training.step(tokens(1), tokens(2))
    training.update(lr=1e-2)
    reading = nanoq.Trainer(CONFIG, options(backend, inference=True, **more))
    reading.set_weights(training.get_weights(trainable_only=True), trainable_only=True)
    return training, reading


def reads(trainer):
    x = tokens(3)
    return (trainer.logits(x), trainer.validate(x, tokens(4)).loss,
            trainer.generate([5, 6, 7], 6, temperature=0.0))


@pytest.mark.parametrize("lora", [None, LoraConfig(rank=2, targets="q,v")], ids=["full", "lora"])
def test_an_inference_trainer_reads_the_model_bitwise_as_a_training_one_without_its_state(lora):
    training, reading = pair(lora=lora)
    with training, reading:
        expected, got = reads(training), reads(reading)
        assert np.array_equal(expected[0], got[0]) and expected[1:] == got[1:]
        trained, inferring = training.memory_summary()[0]["contexts"], reading.memory_summary()[0]["contexts"]
        assert TRAINING_STATE & set(trained) and not TRAINING_STATE & set(inferring)
        # The rest is a training trainer's with recompute block: no activation a backward would read is kept.
        assert inferring["activations"] < trained["activations"]
        with nanoq.Trainer(CONFIG, options(lora=lora, recompute="block")) as blocked:
            assert {k: v for k, v in blocked.memory_summary()[0]["contexts"].items()
                    if k not in TRAINING_STATE | {"kv-cache"}} == \
                {k: v for k, v in inferring.items() if k != "kv-cache"}
        # The memory plan is the same allocation sequence.
        planned = estimate_memory(CONFIG, options(lora=lora, inference=True))
        assert {k: v for k, v in planned.contexts.items() if v and k != "kv-cache"} == \
            {k: v for k, v in inferring.items() if k != "kv-cache"}


def test_an_inference_trainer_keeps_activations_as_recompute_block_whatever_recompute_says():
    planned = {recompute: estimate_memory(CONFIG, options(inference=True, recompute=recompute)).contexts
               for recompute in ((), ("swiglu",), ("ffn", "norms"), ("block",))}
    assert all(contexts == planned[("block",)] for contexts in planned.values())
    assert planned[()]["activations"] < estimate_memory(CONFIG, options()).contexts["activations"]


def test_every_call_that_trains_is_refused_naming_the_option(tmp_path):
    with nanoq.Trainer(CONFIG, options(inference=True)) as reading:
        weights = reading.get_weights()
        calls = {"step": lambda: reading.step(tokens(), tokens()),
                 "update": lambda: reading.update(lr=1e-3),
                 "get_gradients": reading.get_gradients,
                 "get_optimizer_state": reading.get_optimizer_state,
                 "set_optimizer_state": lambda: reading.set_optimizer_state({}, 0),
                 "save_checkpoint": lambda: reading.save_checkpoint(tmp_path / "ckpt", 1),
                 "load_checkpoint": lambda: reading.load_checkpoint(tmp_path / "ckpt")}
        for what, call in calls.items():
            with pytest.raises(ValueError, match=rf"^{what}\(\) needs a trainer made for training: this one has "
                                                 r"inference=True"):
                call()
        assert not (tmp_path / "ckpt").exists()
        # The core refuses too, for callers below the Python layer.
        with pytest.raises(ValueError, match=r"step\(\) needs a trainer made for training: this one has inference "
                                             r"= true"):
            reading._core.step(tokens(), tokens())
        # Still whole and usable.
        assert all(np.array_equal(weights[name], value) for name, value in reading.get_weights().items())
        reading.validate(tokens(), tokens())


def test_the_inference_rule_is_checked_before_anything_is_allocated():
    for more in (dict(zero_stage=2, devices=2), dict(offload="optimizer")):
        with pytest.raises(ValueError, match="an inference trainer keeps whole weights only"):
            options(inference=True, **more)


def test_nanoq_generate_and_eval_read_models_with_an_inference_trainer(tmp_path):
    from nanoq_cli.inference import find_model, open_trainer

    with nanoq.Trainer(CONFIG, options()) as trainer:
        model = trainer.export_model(str(tmp_path / "model"))
    with open_trainer(find_model(model), "cpu", 16) as reading:
        # No training state, and none of the activations a backward would read.
        assert reading.options.inference
        assert not TRAINING_STATE & set(reading.memory_summary()[0]["contexts"])


@pytest.mark.parametrize("backend", cuda_cases())
def test_on_cuda_the_bf16_weights_stand_in_for_the_master_copy(backend, request):
    # The inference trainer's "master" is its bf16 weights: writing fp32 values rounds them once, as a
    # training trainer's weights are rounded from its fp32 master copy, so the reads agree bitwise.
    use_cuda_backend(backend, request)
    training, reading = pair(backend, attention="native", cuda_graphs=False)
    with training, reading:
        expected, got = reads(training), reads(reading)
        assert np.array_equal(expected[0], got[0]) and expected[1:] == got[1:]
        assert "master" in training.memory_summary()[0]["contexts"]
        assert not TRAINING_STATE & set(reading.memory_summary()[0]["contexts"])
