"""Argument validation: every bad input raises a ValueError/TypeError that
names the problem, and a rejected call leaves no trace (the next valid
step/update gives exactly what a trainer that never saw the bad call gives)."""

import math
import os
import shutil

import numpy as np
import pytest

import nanoq
from conftest import (
    SEQ,
    VOCAB,
    assert_same_tensors,
    open_trainer,
    random_batch,
)

BATCH = 2
GOOD = random_batch(np.random.default_rng(30), rows=BATCH)
GOOD2 = random_batch(np.random.default_rng(31), rows=BATCH)


@pytest.fixture(scope="module")
def clean(checkpoints):
    """Loss and weights of one valid step + update on an untouched trainer."""
    with open_trainer(checkpoints.path("llama"), batch_size=BATCH, grad_accum=2) as tr:
        tr.step(*GOOD)
        stats = tr.update(lr=1e-3)
        return stats.loss, tr.get_weights()


@pytest.fixture
def trainer(checkpoints):
    with open_trainer(checkpoints.path("llama"), batch_size=BATCH, grad_accum=2) as tr:
        yield tr


def assert_unaffected(tr, clean):
    """A valid step + update now must match a trainer that never erred."""
    tr.step(*GOOD)
    stats = tr.update(lr=1e-3)
    assert stats.tokens == BATCH * SEQ
    assert stats.loss == clean[0]
    assert_same_tensors(tr.get_weights(), clean[1], "weight")


# --------------------------------------------------------------------------
# step() / validate() inputs
# --------------------------------------------------------------------------


def _with(which, fn):
    """(inputs, targets) with one of them replaced by fn(array)."""
    inputs, targets = GOOD[0].copy(), GOOD[1].copy()
    if which == "inputs":
        return fn(inputs), targets
    return inputs, fn(targets)


def _set(index, value):
    def fn(a):
        a[index] = value
        return a

    return fn


def _non_contiguous(a):
    wide = np.zeros((a.shape[0], 2 * a.shape[1]), dtype=np.int32)
    wide[:, ::2] = a
    view = wide[:, ::2]
    assert view.shape == a.shape and not view.flags.c_contiguous
    return view


def _fortran(a):
    f = np.asfortranarray(a)
    assert not f.flags.c_contiguous
    return f


BAD_ARRAYS = {
    # name: (which, transform, exception, message fragments)
    "inputs-int64": ("inputs", lambda a: a.astype(np.int64), TypeError, ["int32"]),
    "targets-int64": ("targets", lambda a: a.astype(np.int64), TypeError, ["int32"]),
    "inputs-float32": ("inputs", lambda a: a.astype(np.float32), TypeError, ["int32"]),
    "targets-float32": ("targets", lambda a: a.astype(np.float32), TypeError, ["int32"]),
    "inputs-uint32": ("inputs", lambda a: a.astype(np.uint32), TypeError, ["int32"]),
    "inputs-long-rows": ("inputs", lambda a: np.zeros((BATCH, SEQ + 1), np.int32), ValueError, ["shape"]),
    "inputs-extra-row": ("inputs", lambda a: np.zeros((BATCH + 1, SEQ), np.int32), ValueError, ["shape"]),
    "inputs-1d": ("inputs", lambda a: np.ascontiguousarray(a.reshape(-1)), ValueError, ["shape"]),
    "inputs-3d": ("inputs", lambda a: np.ascontiguousarray(a.reshape(BATCH, SEQ, 1)), ValueError, ["shape"]),
    "targets-short-rows": ("targets", lambda a: np.zeros((BATCH, SEQ - 1), np.int32), ValueError, ["shape"]),
    "inputs-strided": ("inputs", _non_contiguous, ValueError, ["contiguous"]),
    "targets-strided": ("targets", _non_contiguous, ValueError, ["contiguous"]),
    "inputs-fortran": ("inputs", _fortran, ValueError, ["contiguous"]),
    # A masked array's mask was silently ignored (the core reads the data beneath it).
    "targets-masked": ("targets", lambda a: np.ma.masked_array(a, mask=a % 2 == 0), TypeError,
                       ["masked array", "targets.filled(-100)"]),
    "inputs-id-vocab": ("inputs", _set((1, 3), VOCAB), ValueError, ["[1, 3]", str(VOCAB)]),
    "inputs-id-negative": ("inputs", _set((0, 7), -1), ValueError, ["[0, 7]", "-1"]),
    "inputs-id-minus-100": ("inputs", _set((1, 0), -100), ValueError, ["[1, 0]", "-100"]),
    "targets-id-vocab": ("targets", _set((1, 3), VOCAB + 5), ValueError, ["[1, 3]", str(VOCAB + 5)]),
    "targets-id-negative": ("targets", _set((0, 15), -5), ValueError, ["[0, 15]", "-5"]),
}


def _raises(call, exc, fragments):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment.lower() in message.lower(), f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("case", list(BAD_ARRAYS))
def test_step_rejects_bad_array_and_stays_usable(trainer, clean, case):
    which, transform, exc, fragments = BAD_ARRAYS[case]
    bad = _with(which, transform)
    _raises(lambda: trainer.step(*bad), exc, fragments)
    assert_unaffected(trainer, clean)


@pytest.mark.parametrize("case", ["inputs-int64", "targets-strided", "inputs-id-vocab", "targets-id-negative"])
def test_validate_rejects_bad_array_and_stays_usable(trainer, clean, case):
    which, transform, exc, fragments = BAD_ARRAYS[case]
    bad = _with(which, transform)
    _raises(lambda: trainer.validate(*bad), exc, fragments)
    assert_unaffected(trainer, clean)


@pytest.mark.parametrize("which, value", [("inputs", VOCAB), ("inputs", -100), ("targets", VOCAB),
                                          ("targets", -1)])
def test_the_core_checks_the_ids_it_reads_itself(trainer, clean, which, value):
    # Python checks a batch's ids, but the caller's array may change before the core copies it
    # (another thread): the core checks what it reads, and an id past the vocabulary never
    # reaches the embedding (it read past the table: a segmentation fault).
    bad = _with(which, _set((1, 3), value))
    with pytest.raises(ValueError, match=rf"{which} hold id {value} at flat index {SEQ + 3}, outside \[0, {VOCAB}\)"):
        trainer._core.step(*bad)
    with pytest.raises(ValueError, match=rf"{which} hold id {value} at flat index {SEQ + 3}"):
        trainer._core.validate(*bad)
    assert_unaffected(trainer, clean)


def test_validate_reads_its_own_copy_of_the_batch(trainer):
    # The workers read a validate's batch after the call has checked it: from a copy, which a
    # caller refilling its arrays meanwhile (another thread, or after an interrupted validate)
    # cannot change (before: a wrong loss, or with bad ids a segmentation fault).
    import threading

    from nanoq.testing import hooks

    inputs, targets = GOOD[0].copy(), GOOD[1].copy()
    expected = trainer.validate(inputs, targets).loss
    hooks.delay_next_validate(trainer, 0, 0.5)
    refill = threading.Timer(0.2, lambda: (inputs.fill(1), targets.fill(2)))
    refill.start()
    assert trainer.validate(inputs, targets).loss == expected
    refill.join()
    assert (inputs == 1).all()


def test_a_config_changed_after_the_trainer_was_built_changes_nothing(checkpoints):
    config = nanoq.ModelConfig.from_pretrained(checkpoints.path("llama"))
    with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", batch_size=BATCH, seq_len=SEQ)) as tr:
        config.vocab_size = 2**31 - 1  # the caller's object, reused for something else
        assert tr.config.vocab_size == VOCAB
        with pytest.raises(ValueError, match=rf"token id {2**30} outside \[0, {VOCAB}\) in inputs"):
            tr.step(*_with("inputs", _set((0, 0), 2**30)))


def test_bad_token_after_a_good_micro_batch_keeps_the_good_one(trainer, checkpoints):
    """The rejected micro-batch must not be half-counted: the update sees only
    the accepted micro-batches, exactly like a trainer that never saw it."""
    trainer.step(*GOOD)
    with pytest.raises(ValueError):
        trainer.step(*_with("targets", _set((1, 3), VOCAB)))
    trainer.step(*GOOD2)
    stats = trainer.update(lr=1e-3)
    with open_trainer(checkpoints.path("llama"), batch_size=BATCH, grad_accum=2) as ref:
        ref.step(*GOOD)
        ref.step(*GOOD2)
        expected = ref.update(lr=1e-3)
        assert_same_tensors(trainer.get_weights(), ref.get_weights(), "weight")
    assert stats.tokens == expected.tokens == 2 * BATCH * SEQ
    assert stats.loss == expected.loss


def test_a_refused_optimizer_state_writes_nothing(trainer):
    trainer.step(*GOOD)
    trainer.update(lr=1e-3)
    state, weights = trainer.get_optimizer_state(), trainer.get_weights()
    zeros = {kind: {name: np.zeros_like(array) for name, array in arrays.items()} for kind, arrays in state.items()}
    trainer.step(*GOOD2)  # a micro-batch pending: refused before the state is touched (the weights were zeroed)
    with pytest.raises(ValueError, match="cannot set the optimizer state with micro-batches pending"):
        trainer.set_optimizer_state(zeros, 1)
    trainer.update(lr=1e-3)
    state, weights = trainer.get_optimizer_state(), trainer.get_weights()
    for steps in (2**31, -1, 1.5, True):
        with pytest.raises(ValueError, match="optimizer_steps must be an integer"):
            trainer.set_optimizer_state(zeros, steps)
    assert_same_tensors(trainer.get_weights(), weights, "weight")
    for kind in state:
        assert_same_tensors(trainer.get_optimizer_state()[kind], state[kind], kind)
    as_lists = {kind: {name: array.tolist() for name, array in arrays.items()} for kind, arrays in state.items()}
    trainer.set_optimizer_state(as_lists, trainer.optimizer_steps)  # array-likes are taken


def test_ignore_index_is_the_only_accepted_negative_target(trainer):
    inputs, targets = GOOD[0], GOOD[1].copy()
    targets[:, ::2] = -100
    trainer.step(inputs, targets)
    assert trainer.update(lr=1e-3).tokens == BATCH * SEQ // 2


# --------------------------------------------------------------------------
# step()/update() protocol
# --------------------------------------------------------------------------


def test_update_before_any_step_raises(trainer, clean):
    with pytest.raises(ValueError, match="(?i)step"):
        trainer.update(lr=1e-3)
    assert_unaffected(trainer, clean)


def test_second_update_without_new_step_raises(trainer, clean):
    trainer.step(*GOOD)
    trainer.update(lr=1e-3)
    with pytest.raises(ValueError):
        trainer.update(lr=1e-3)
    assert_same_tensors(trainer.get_weights(), clean[1], "weight")


def test_more_steps_than_grad_accum_raises_and_keeps_accepted_steps(trainer, checkpoints):
    trainer.step(*GOOD)
    trainer.step(*GOOD2)
    with pytest.raises(ValueError, match="(?i)grad_accum|accum"):
        trainer.step(*GOOD)
    stats = trainer.update(lr=1e-3)
    with open_trainer(checkpoints.path("llama"), batch_size=BATCH, grad_accum=2) as ref:
        ref.step(*GOOD)
        ref.step(*GOOD2)
        assert stats.loss == ref.update(lr=1e-3).loss
    assert stats.tokens == 2 * BATCH * SEQ
    # and the next optimizer step accepts grad_accum micro-batches again
    trainer.step(*GOOD)
    trainer.step(*GOOD2)
    trainer.update(lr=1e-3)


BAD_HYPER = {
    "lr-nan": dict(lr=math.nan),
    "lr-inf": dict(lr=math.inf),
    "beta1-one": dict(beta1=1.0),
    "beta1-negative": dict(beta1=-0.1),
    "beta1-nan": dict(beta1=math.nan),
    "beta2-one": dict(beta2=1.0),
    "beta2-inf": dict(beta2=math.inf),
    "eps-negative": dict(eps=-1e-8),
    "eps-nan": dict(eps=math.nan),
    "weight_decay-nan": dict(weight_decay=math.nan),
    "weight_decay-inf": dict(weight_decay=math.inf),
    "grad_clip-nan": dict(grad_clip=math.nan),
    # Valid as Python floats, not as the core's float32 (before: NaN or infinite weights, unreported).
    "beta2-rounds-to-one": dict(beta2=0.99999999),
    "eps-rounds-to-zero": dict(eps=1e-46),
    "eps-subnormal": dict(eps=1e-40),
    "lr-overflows": dict(lr=1e39),
    "weight_decay-overflows": dict(weight_decay=1e39),
}


@pytest.mark.parametrize("case", list(BAD_HYPER))
def test_update_rejects_bad_hyper_parameter_without_side_effects(trainer, clean, case):
    """Rejected before anything is applied: weights unchanged, gradients kept,
    and the following valid update is exactly the clean one."""
    kwargs = dict(dict(lr=1e-3), **BAD_HYPER[case])
    trainer.step(*GOOD)
    before = trainer.get_weights()
    with pytest.raises(ValueError, match=list(BAD_HYPER[case])[0]):
        trainer.update(**kwargs)
    assert_same_tensors(trainer.get_weights(), before, "weight")
    stats = trainer.update(lr=1e-3)
    assert stats.loss == clean[0]
    assert_same_tensors(trainer.get_weights(), clean[1], "weight")


# --------------------------------------------------------------------------
# Trainer construction and lifetime
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(devices=0),
        dict(batch_size=0),
        dict(seq_len=0),
        dict(seq_len=-1),
        dict(grad_accum=0),
        dict(backend="tpu"),
        dict(first_rank=2**31 - 1, world_size=2, comm_id=b"x"),  # first_rank + devices overflowed an int
        dict(threads=100_000),  # OpenMP ended the process when it could not start them
    ],
    ids=["devices=0", "batch_size=0", "seq_len=0", "seq_len=-1", "grad_accum=0", "backend=tpu", "first_rank=max",
         "threads=100000"],
)
def test_trainer_rejects_bad_options(checkpoints, options):
    cfg = nanoq.ModelConfig.from_pretrained(checkpoints.path("llama"))
    kwargs = dict(backend="cpu", devices=1, batch_size=2, seq_len=SEQ, grad_accum=1, seed=0, z_loss=0.0)
    kwargs.update(options)
    name = next(iter(options))
    with pytest.raises(ValueError, match=name):
        nanoq.Trainer(cfg, nanoq.TrainOptions(**kwargs))


def _has_gpu():
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


@pytest.mark.skipif(_has_gpu(), reason="checks the error on machines without a GPU")
def test_cuda_backend_without_gpu_raises_clear_error(checkpoints):
    cfg = nanoq.ModelConfig.from_pretrained(checkpoints.path("llama"))
    with pytest.raises((ValueError, nanoq.NanoqError), match="(?i)cuda|gpu|device"):
        nanoq.Trainer(cfg, nanoq.TrainOptions(backend="cuda", devices=1, batch_size=2, seq_len=SEQ))


def test_operations_after_close_raise_and_close_is_idempotent(checkpoints):
    tr = open_trainer(checkpoints.path("llama"))
    tr.step(*GOOD)
    tr.close()
    for call in (
        lambda: tr.step(*GOOD),
        lambda: tr.update(lr=1e-3),
        lambda: tr.validate(*GOOD),
        lambda: tr.get_weights(),
        lambda: tr.get_gradients(),
        lambda: tr.import_weights(checkpoints.path("llama")),
        lambda: tr.init_weights(seed=0),
    ):
        with pytest.raises((RuntimeError, ValueError), match="(?i)clos"):
            call()
    tr.close()  # second close is a no-op


def test_context_manager_closes_trainer(checkpoints):
    with open_trainer(checkpoints.path("llama")) as tr:
        tr.step(*GOOD)
        tr.update(lr=1e-3)
    with pytest.raises((RuntimeError, ValueError)):
        tr.step(*GOOD)


def test_get_gradients_before_any_step_raises(trainer):
    with pytest.raises(ValueError, match="(?i)step"):
        trainer.get_gradients()


@pytest.mark.parametrize("device", [-1, 1])
def test_device_index_out_of_range_raises(trainer, device):
    for call in (trainer.get_allocations, trainer.get_stack_info):
        with pytest.raises(ValueError, match="device"):
            call(device)


def test_a_closed_trainer_says_so_before_looking_at_the_arguments(trainer, tmp_path):
    # set_weights, load_checkpoint and import_weights checked their dict or files first: a closed
    # trainer reported missing parameters or a checkpoint of another model instead of being closed.
    trainer.close()
    calls = {"set_weights": lambda: trainer.set_weights({}),
             "load_checkpoint": lambda: trainer.load_checkpoint(tmp_path / "missing"),
             "import_weights": lambda: trainer.import_weights(tmp_path / "missing"),
             "step": lambda: trainer.step(*GOOD), "get_weights": trainer.get_weights,
             "save_checkpoint": lambda: trainer.save_checkpoint(tmp_path / "ckpt", 1),
             "export_model": lambda: trainer.export_model(tmp_path / "model")}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="^this Trainer is closed$"):
            call()
    assert not os.listdir(tmp_path)
