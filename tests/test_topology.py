"""Topology: a trainer's devices may be a contiguous slice of a larger world
(world_size, first_rank, and a communicator id made outside the trainer).
Two Trainer objects in one process, each driven from its own thread, form
one world through the shared-memory communicator: P trainers x D devices
train exactly like 1 trainer x P*D devices. Mismatched worlds fail with a
clear error instead of hanging."""
import dataclasses
import threading
import time

import numpy as np
import pytest

import nanoq
import nanoq.options
from nanoq import _core
from nanoq.backends import new_comm_id
from conftest import cuda_cases, random_batch, use_cuda_backend

CONFIG = nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
SEQ = 8


def options(devices, **overrides):
    return nanoq.TrainOptions(**dict(dict(backend="cpu", devices=devices, batch_size=1, seq_len=SEQ, grad_accum=2,
                                          threads=1), **overrides))


def global_batches(count, rows, seed=0):
    rng = np.random.default_rng(seed)
    return [random_batch(rng, rows, SEQ, CONFIG.vocab_size) for _ in range(count)]


def train(trainer, batches, rows, read_weights):
    """Steps over this trainer's `rows` of every global batch, two micro-batches
    per update, with a validation after each update; returns every update's and
    validation's statistics and (if `read_weights`) the final weights."""
    trainer.init_weights(seed=3)
    results = []
    for index, (inputs, targets) in enumerate(batches):
        trainer.step(np.ascontiguousarray(inputs[rows]), np.ascontiguousarray(targets[rows]))
        if index % 2 == 1:
            results.append(trainer.update(lr=1e-2))
            results.append(trainer.validate(np.ascontiguousarray(inputs[rows]), np.ascontiguousarray(targets[rows])))
    return results, (trainer.get_weights() if read_weights else None)


def in_threads(functions, timeout=120):
    """Runs each function in its own thread; returns their results, or raises
    the first error (a hang fails the test)."""
    results, errors = [None] * len(functions), [None] * len(functions)

    def run(i):
        try:
            results[i] = functions[i]()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(functions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a trainer of the world hung"
    return results, errors


def world(trainers, devices, backend="cpu", **overrides):
    """Options for `trainers` trainers of `devices` devices each, one world."""
    comm_id = new_comm_id(backend)
    return [options(devices, backend=backend, world_size=trainers * devices, first_rank=t * devices,
                    comm_id=comm_id, **overrides) for t in range(trainers)]


def run_world(opts, batches, read_weights=True):
    def member(o):
        def go():
            with nanoq.Trainer(CONFIG, o) as trainer:
                assert trainer.topology == (o.world_size or o.devices, o.first_rank)
                rows = slice(o.first_rank * o.batch_size, (o.first_rank + o.devices) * o.batch_size)
                return train(trainer, batches, rows, read_weights)
        return go

    results, errors = in_threads([member(o) for o in opts])
    for e in errors:
        if e is not None:
            raise e
    return results


def assert_same_stats(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for field in dataclasses.fields(x):
            u, v = getattr(x, field.name), getattr(y, field.name)
            assert u == v or (u != u and v != v), (field.name, x, y)  # bitwise; NaN where both have none


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
@pytest.mark.parametrize("trainers, devices", [(2, 1), (2, 2)])
def test_trainers_of_one_world_train_like_one_trainer_with_all_devices(trainers, devices, zero_stage):
    total = trainers * devices
    batches = global_batches(6, total, seed=zero_stage)
    (alone_stats, alone_weights), = run_world([options(total, zero_stage=zero_stage)], batches,
                                              read_weights=zero_stage < 3)
    members = run_world(world(trainers, devices, zero_stage=zero_stage), batches, read_weights=zero_stage < 3)
    for stats, weights in members:
        assert_same_stats(stats, alone_stats)  # every rank sees the world's loss and gradient norm
        if zero_stage < 3:
            for name, value in alone_weights.items():
                assert np.array_equal(weights[name], value), name


def test_calls_that_need_other_trainers_shards_raise_a_clear_error():
    batches = global_batches(1, 2)

    def member(o):
        def go():
            with nanoq.Trainer(CONFIG, o) as trainer:
                trainer.init_weights(seed=1)
                row = slice(o.first_rank, o.first_rank + 1)
                trainer.step(np.ascontiguousarray(batches[0][0][row]), np.ascontiguousarray(batches[0][1][row]))
                messages = []
                for call in (trainer.get_optimizer_state, trainer.get_gradients):
                    with pytest.raises(ValueError, match="needs the shards of all 2 ranks") as error:
                        call()
                    messages.append(str(error.value))
                names = [name for name, *_ in trainer._core.parameters()]
                layer = next(i for i, name in enumerate(names) if ".layers." in name)
                with pytest.raises(ValueError, match="stage-3 layer weight needs the shards"):
                    trainer._core.get_parameter(layer)
                # What this trainer holds whole still reads: the embedding.
                embed = trainer._core.get_parameter(names.index("model.embed_tokens.weight"))
                trainer.update(lr=1e-2)  # the world goes on after the refused calls
                return messages, embed
        return go

    results, errors = in_threads([member(o) for o in world(2, 1, zero_stage=3)])
    assert errors == [None, None], errors
    (messages_0, embed_0), (messages_1, embed_1) = results
    assert "other trainers" in messages_0[0]
    assert np.array_equal(embed_0, embed_1)


@pytest.mark.parametrize("second", [dict(world_size=3), dict(seq_len=SEQ * 2, world_size=2),
                                    dict(zero_stage=2, world_size=2)],
                         ids=["world_size", "seq_len", "zero_stage"])
def test_mismatched_members_of_a_world_fail_clearly_instead_of_hanging(second):
    comm_id = new_comm_id("cpu")
    first = options(1, world_size=2, first_rank=0, comm_id=comm_id)
    other = options(1, **dict(dict(first_rank=1, comm_id=comm_id), **second))

    def member(o, delay):
        def go():
            time.sleep(delay)  # the first member is waiting in the rendezvous when the second comes
            nanoq.Trainer(CONFIG, o).close()
        return go

    start = time.monotonic()
    _, errors = in_threads([member(first, 0.0), member(other, 0.5)])
    assert time.monotonic() - start < 30
    assert isinstance(errors[1], ValueError), errors
    expected = "names a world of 2" if "world_size" in second and second["world_size"] == 3 else \
        "must have the same model config and options"
    assert expected in str(errors[1])
    # The member that was already waiting learns why, rather than waiting for ever.
    assert isinstance(errors[0], nanoq.NanoqError) and expected in str(errors[0]), errors


def test_a_member_that_never_comes_ends_the_rendezvous_with_an_error(monkeypatch):
    monkeypatch.setenv("NANOQ_RENDEZVOUS_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.raises(nanoq.NanoqError, match="did not gather within 1 s"):
        nanoq.Trainer(CONFIG, options(1, world_size=2, comm_id=new_comm_id("cpu")))
    assert time.monotonic() - start < 20

@pytest.mark.parametrize("comm_id", [b"my-world", b"", b"\x00" * 128], ids=["own-name", "empty", "nccl-sized"])
def test_a_comm_id_not_made_for_the_cpu_backend_is_refused_at_once(monkeypatch, comm_id):
    # A name of the caller's own (or another backend's id) named a world of its own: the trainer waited
    # out the rendezvous time limit for partners that never came.
    monkeypatch.setenv("NANOQ_RENDEZVOUS_TIMEOUT", "60")
    start = time.monotonic()
    expected = "needs comm_id" if not comm_id else r"comm_id is not a cpu communicator id .*new_comm_id\(\"cpu\"\)"
    with pytest.raises(ValueError, match=expected):
        nanoq.Trainer(CONFIG, options(1, world_size=2, comm_id=comm_id))
    assert time.monotonic() - start < 20



def test_a_member_closed_while_the_others_train_fails_them_instead_of_hanging_them():
    # A caller error closes one trainer of the world (its `with` block exits); the other's next
    # step needs it in a collective: it fails at once, naming the closed rank (before: it waited
    # for ever, and so did its close()).
    first, second = world(2, 1)
    inputs, targets = global_batches(1, 2)[0]

    def a():
        with nanoq.Trainer(CONFIG, first) as trainer:
            with pytest.raises(ValueError, match="no device 1"):  # a rank of the world, not a device of this trainer
                trainer._core.communication_trace(1)
            time.sleep(1.0)  # the other member has closed by now
            trainer.step(np.ascontiguousarray(inputs[:1]), np.ascontiguousarray(targets[:1]))
            trainer.step(np.ascontiguousarray(inputs[:1]), np.ascontiguousarray(targets[:1]))
            trainer.update(lr=1e-2)

    def b():
        with nanoq.Trainer(CONFIG, second) as trainer:
            trainer.step(np.ascontiguousarray(inputs[1:, :SEQ // 2]), targets[1:])  # the wrong shape

    start = time.monotonic()
    _, errors = in_threads([a, b], timeout=60)
    assert time.monotonic() - start < 30
    assert isinstance(errors[1], ValueError), errors
    assert isinstance(errors[0], nanoq.NanoqError) and "rank 1's trainer was closed" in str(errors[0]), errors


def test_topology_options_are_checked():
    # The forms in Python; how they fit the devices is the core's rules (nanoq.options), which
    # TrainOptions applies when it is made and the core again when a Trainer is made.
    with pytest.raises(TypeError, match="comm_id must be bytes"):
        options(1, comm_id="text")
    with pytest.raises(ValueError, match="first_rank must be an integer"):
        options(1, first_rank=1.5)
    for fields, rule in ((dict(devices=1, world_size=2), "world_needs_comm_id"),
                         (dict(devices=2, world_size=2, first_rank=1, comm_id=b"x"), "devices_fit_in_the_world"),
                         (dict(devices=2, world_size=1), "world_holds_the_devices")):
        message = nanoq.options.rule_message(rule)
        with pytest.raises(ValueError) as caught:
            options(**fields)
        assert str(caught.value) == message
        core_options = dict(dataclasses.asdict(options(1)), dtype="fp32", **fields)
        with pytest.raises(ValueError) as caught:
            _core.CoreTrainer(CONFIG.to_core(), core_options)
        assert str(caught.value) == message
    # Defaults: the trainer's devices are the world, as before.
    with nanoq.Trainer(CONFIG, options(2)) as trainer:
        assert trainer.topology == (2, 0) and trainer.world_size == 2


def test_ids_are_fresh():
    assert new_comm_id("cpu") != new_comm_id("cpu")


@pytest.mark.parametrize("backend", cuda_cases())
def test_cuda_trainers_of_one_world_train_like_one_trainer(backend, request):
    use_cuda_backend(backend, request)
    batches = global_batches(4, 2, seed=7)
    (alone_stats, alone_weights), = run_world([options(2, backend=backend)], batches)
    for stats, weights in run_world(world(2, 1, backend=backend), batches):
        assert_same_stats(stats, alone_stats)
        for name, value in alone_weights.items():
            assert np.array_equal(weights[name], value), name


def test_the_memory_estimate_of_a_world_member_equals_its_allocations():
    from nanoq.memory import estimate_memory

    opts = world(2, 1, zero_stage=2)

    def member(o):
        def go():
            with nanoq.Trainer(CONFIG, o) as trainer:
                return [(a["context"], a["name"], a["bytes"], a["kind"]) for a in trainer.get_allocations(0)]
        return go

    results, errors = in_threads([member(o) for o in opts])
    assert errors == [None, None], errors
    for o, real in zip(opts, results):
        estimate = estimate_memory(CONFIG, o)
        assert [(a.context, a.name, a.bytes, a.kind) for a in estimate.allocations] == real


def test_the_documented_spelling_makes_a_world_id():
    # The README, the options' rule and TrainOptions' errors name nanoq.new_comm_id; they said
    # nanoq.backends.new_comm_id, which is the backends() function's attribute lookup and failed.
    comm_id = nanoq.new_comm_id("cpu")
    assert isinstance(comm_id, bytes) and comm_id != nanoq.new_comm_id("cpu")
    options = nanoq.TrainOptions(backend="cpu", devices=1, world_size=2, first_rank=1, comm_id=comm_id)
    assert options.comm_id == comm_id
    with pytest.raises(TypeError, match=r"comm_id must be bytes \(from nanoq\.new_comm_id\)"):
        nanoq.TrainOptions(backend="cpu", devices=1, world_size=2, comm_id="text")
    with pytest.raises(ValueError, match=r"made once with nanoq\.new_comm_id"):
        nanoq.TrainOptions(backend="cpu", devices=1, world_size=2)
