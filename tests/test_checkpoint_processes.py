"""Checkpoints, exports and gradients of a world of several processes.

The processes are ThreadWorld members (each a thread with its own Trainer,
one world through the shared-memory communicator) and, once, real mpiexec
processes. A checkpoint holds one part per process; it loads on any
number of processes and devices, exactly: P x D -> 1 x N -> N x 1 -> P x D
continues bit for bit like a run that never stopped, at every ZeRO stage.
A process that fails mid-save fails the save on every process, and one
that is killed mid-save ends the run; either way the previous checkpoint
stays the newest, as it was. Version-1 checkpoints (one file of
weights, one of optimizer state) still load."""
import errno
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.numpy import load_file

import nanoq
from nanoq import checkpoint
from nanoq.backends import new_comm_id
from nanoq.hf_export import export_checkpoint
from nanoq.testing.threads import ThreadWorld
from nanoq_cli.main import cli
from conftest import cuda_cases, use_cuda_backend
from processes.checkpoints import BATCHES, CONFIG, WORLD, options, train
from test_processes import mpiexec_path
from test_topology import in_threads

V1_FIXTURE = os.path.join(os.path.dirname(__file__), "data", "checkpoint_v1", "step_00000002")


def in_world(processes, devices, body, **overrides):
    """body(trainer) on each of `processes` Trainers of `devices` devices that
    form one world (ThreadWorld members; one process: a trainer alone);
    returns their results, in process order, or raises the first error."""
    world = ThreadWorld(processes)

    def member(rank):
        def go():
            group = world.member(rank) if processes > 1 else None
            with nanoq.Trainer(CONFIG, options(devices, **overrides), processes=group) as trainer:
                assert trainer.topology == (processes * devices, rank * devices)
                return body(trainer)
        return go

    results, errors = in_threads([member(rank) for rank in range(processes)])
    for error in errors:
        if error is not None:
            raise error
    return results


def state_of(trainer):
    """Weights, optimizer state and step count (collective in a world)."""
    return trainer.get_weights(), trainer.get_optimizer_state(), trainer.optimizer_steps


def assert_same_state(got, expected):
    weights, optimizer, steps = got
    assert steps == expected[2]
    for name, value in expected[0].items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
    for kind, tensors in expected[1].items():
        for name, value in tensors.items():
            np.testing.assert_array_equal(optimizer[kind][name], value, err_msg=f"{kind}.{name}")


@pytest.mark.parametrize("fields", [dict(zero_stage=1), dict(zero_stage=2), dict(zero_stage=3),
                                    dict(zero_stage=3, offload=("optimizer", "master"))],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_checkpoints_move_between_2x2_1x4_4x1_and_back_bitwise(tmp_path, fields):
    # The run that never stops: 8 updates on 2 processes x 2 devices.
    def straight(trainer):
        trainer.init_weights(seed=3)
        return train(trainer, range(8)), state_of(trainer)

    (expected_losses, expected_state), _ = in_world(2, 2, straight, **fields)

    # The same 8 updates in four legs, each resumed from the last one's checkpoint by another layout.
    legs = [(2, 2, range(0, 2)), (1, 4, range(2, 4)), (4, 1, range(4, 6)), (2, 2, range(6, 8))]
    losses = []
    for number, (processes, devices, steps) in enumerate(legs):
        def leg(trainer):
            if number == 0:
                trainer.init_weights(seed=3)
                saved = None
            else:
                state = trainer.load_checkpoint(tmp_path)
                assert state["step"] == steps.start and state["parts"]["processes"] == legs[number - 1][0]
                saved = state_of(trainer)
            leg_losses = train(trainer, steps)
            trainer.save_checkpoint(tmp_path, steps.stop)
            return leg_losses, saved, state_of(trainer)

        results = in_world(processes, devices, leg, **fields)
        if number > 0:  # every process of this layout holds exactly what the last layout saved
            for _, saved, _ in results:
                assert_same_state(saved, left)
        left = results[0][2]
        losses += results[0][0]
    assert losses == expected_losses
    assert_same_state(left, expected_state)
    assert checkpoint.read_state(tmp_path)["step"] == 8


def rows_of(trainer, batch):
    """This trainer's rows of a global batch (inputs, targets)."""
    rows = trainer.world_size * trainer.options.batch_size
    first = trainer.topology[1] * trainer.options.batch_size
    return tuple(np.ascontiguousarray(part[first:first + rows]) for part in batch)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_every_process_gets_the_worlds_gradients(zero_stage):
    """get_gradients is collective in a world of processes: each gets the
    gradients of the whole world, those of one process with all its devices
    (bitwise where the owners' shards hold the sums, stages 2 and 3)."""
    def gradients(trainer):
        trainer.init_weights(seed=3)
        for step in range(2):  # two updates, then the micro-batches of a third
            trainer.step(*rows_of(trainer, BATCHES[2 * step]))
            trainer.step(*rows_of(trainer, BATCHES[2 * step + 1]))
            trainer.update(lr=1e-2)
        trainer.step(*rows_of(trainer, BATCHES[4]))
        trainer.step(*rows_of(trainer, BATCHES[5]))
        return trainer.get_gradients()

    alone, = in_world(1, WORLD, gradients, zero_stage=zero_stage, grad_accum=2)
    members = in_world(2, WORLD // 2, gradients, zero_stage=zero_stage, grad_accum=2)
    assert all(np.abs(value).max() > 0 for value in alone.values())
    for got in members:
        assert sorted(got) == sorted(alone)
        for name, value in alone.items():
            if zero_stage == 1:  # each process sums its devices first: another order of fp32 adds
                np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-8, err_msg=name)
            else:
                np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_a_checkpoint_loads_on_worlds_of_other_sizes(tmp_path):
    def save(trainer):
        trainer.init_weights(seed=3)
        train(trainer, range(2))
        trainer.save_checkpoint(tmp_path, 2)
        return state_of(trainer)

    saved, _ = in_world(2, 2, save, zero_stage=3)
    # Three ranks pad the flat layout differently; one rank holds everything.
    for processes, devices in ((3, 1), (1, 1)):
        for loaded in in_world(processes, devices, lambda t: (t.load_checkpoint(tmp_path), state_of(t))[1],
                               zero_stage=3):
            assert_same_state(loaded, saved)


def test_each_process_writes_the_slices_its_devices_own(tmp_path):
    def save(trainer):
        trainer.init_weights(seed=3)
        train(trainer, range(1))
        path = trainer.save_checkpoint(tmp_path, 1)
        owned = {name: trainer.owned_range(name) for name in trainer.trainable_names}
        return path, owned, state_of(trainer)

    results = in_world(2, 2, save, zero_stage=3)
    step_dir = results[0][0]
    assert [path for path, _, _ in results] == [step_dir, step_dir]  # every process returns the checkpoint
    parts = [checkpoint.part_file_name(p, 2) for p in range(2)]
    assert sorted(os.listdir(step_dir)) == parts + [checkpoint.STATE_FILE]
    with open(os.path.join(step_dir, checkpoint.STATE_FILE)) as f:
        state = json.load(f)
    assert state["format_version"] == checkpoint.FORMAT_VERSION == 2
    assert state["parts"] == dict(processes=2, world_size=4)
    assert state["files"] == {part: os.path.getsize(os.path.join(step_dir, part)) for part in parts}
    weights, optimizer, _ = results[0][2]
    # The parts, read with safetensors itself, tile every tensor; each slice is its writer's owned range.
    assembled = {kind: {name: np.full(value.size, np.nan, np.float32) for name, value in weights.items()}
                 for kind in checkpoint.TENSOR_KINDS}
    for process, part in enumerate(parts):
        path = os.path.join(step_dir, part)
        with safe_open(path, framework="numpy") as f:
            description = json.loads(f.metadata()[checkpoint.PART_METADATA])
        assert description["process"] == process and description["ranks"] == [2 * process, 2 * process + 2]
        owned = results[process][1]
        assert {name: (s["begin"], s["end"]) for name, s in description["slices"].items()} == \
            {name: r for name, r in owned.items() if r[0] < r[1]}
        for key, value in load_file(path).items():
            kind, _, name = key.partition(".")
            begin, end = owned[name]
            assert np.isnan(assembled[kind][name][begin:end]).all(), f"{key} written twice"
            assembled[kind][name][begin:end] = value
    for name, value in weights.items():
        np.testing.assert_array_equal(assembled["weights"][name].reshape(value.shape), value, err_msg=name)
        for kind in nanoq.Trainer.OPTIMIZER_STATE:
            np.testing.assert_array_equal(assembled[kind][name].reshape(value.shape), optimizer[kind][name])
    # nanoq export's reader assembles the same weights.
    read = checkpoint.read_weights(tmp_path)
    assert sorted(read) == sorted(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(read[name], value, err_msg=name)


@pytest.mark.parametrize("failure", ["disk full", "exception"])
def test_a_process_failing_mid_save_fails_it_everywhere_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                                          failure):
    real_save = checkpoint._save_tensors
    arm = {"on": False}

    def save_failing_on_process_1(path, tensors, metadata):
        real_save(path, tensors, metadata)
        if arm["on"] and path.endswith(checkpoint.part_file_name(1, 2)):
            if failure == "disk full":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise RuntimeError("deliberate failure writing part 1")

    monkeypatch.setattr(checkpoint, "_save_tensors", save_failing_on_process_1)

    def run(trainer):
        trainer.init_weights(seed=3)
        train(trainer, range(1))
        trainer.save_checkpoint(tmp_path, 1)
        train(trainer, range(1, 2))
        trainer.world_group.barrier()
        arm["on"] = True
        trainer.world_group.barrier()
        with pytest.raises(OSError if failure == "disk full" else RuntimeError) as caught:
            trainer.save_checkpoint(tmp_path, 2)
        # The world goes on: the next save, with the disk back, succeeds.
        trainer.world_group.barrier()
        arm["on"] = False
        listing = sorted(os.listdir(tmp_path))
        trainer.world_group.barrier()
        return str(caught.value), listing, trainer.save_checkpoint(tmp_path, 3)

    (message_0, listing, final), (message_1, _, _) = in_world(2, 1, run)
    expected = "No space left on device" if failure == "disk full" else "deliberate failure writing part 1"
    assert "failed on process 1 of 2" in message_0 and expected in message_0
    assert expected in message_1
    # After the failed save: the first checkpoint, latest pointing at it, no partial folder.
    assert listing == [".lock", "latest", "step_00000001"]
    assert os.path.basename(final) == "step_00000003"
    assert checkpoint.list_checkpoints(tmp_path) == [1, 3]


def test_every_process_gets_the_save_refused_when_the_step_exists(tmp_path):
    def run(trainer):
        trainer.save_checkpoint(tmp_path, 1)
        with pytest.raises(FileExistsError, match="already exists"):
            trainer.save_checkpoint(tmp_path, 1)
        return True

    assert in_world(2, 1, run) == [True, True]


def test_a_world_placed_by_hand_cannot_save_but_loads_its_part(tmp_path):
    with nanoq.Trainer(CONFIG, options(2, zero_stage=3)) as alone:
        train(alone, range(1))
        alone.save_checkpoint(tmp_path, 1)
        saved = state_of(alone)
    comm_id = new_comm_id("cpu")

    def member(first_rank):
        def go():
            with nanoq.Trainer(CONFIG, options(1, zero_stage=3, world_size=2, first_rank=first_rank,
                                               comm_id=comm_id)) as trainer:
                assert trainer.world_group is None
                trainer.load_checkpoint(tmp_path)
                with pytest.raises(ValueError, match="placed by hand"):
                    trainer.save_checkpoint(tmp_path, 2)
                return {name: (trainer.owned_range(name), trainer.get_parameter_part(name),
                               {kind: trainer.get_optimizer_state_part(name, kind)
                                for kind in trainer.OPTIMIZER_STATE}) for name in trainer.trainable_names}
        return go

    results, errors = in_threads([member(0), member(1)])
    assert errors == [None, None], errors
    for name, value in saved[0].items():
        ranges = [results[rank][name][0] for rank in range(2)]
        tiles = [r for r in ranges if r[0] < r[1]]  # (0, 0): none of it is that trainer's
        assert tiles[0][0] == 0 and tiles[-1][1] == value.size and all(
            a[1] == b[0] for a, b in zip(tiles, tiles[1:])), (name, ranges)
        for (begin, end), weights, optimizer in (results[0][name], results[1][name]):
            np.testing.assert_array_equal(weights, value.reshape(-1)[begin:end])
            for kind, part in optimizer.items():
                np.testing.assert_array_equal(part, saved[1][kind][name].reshape(-1)[begin:end])


def test_version_1_checkpoints_still_load_and_export(tmp_path):
    # Written by nanoq's version-1 checkpoint writer (2 devices, 2 updates of a tiny model).
    weights = load_file(os.path.join(V1_FIXTURE, checkpoint.V1_WEIGHTS_FILE))
    flat = load_file(os.path.join(V1_FIXTURE, checkpoint.V1_OPTIMIZER_FILE))
    state = checkpoint.read_state(V1_FIXTURE)
    assert state["format_version"] == 1
    config = nanoq.ModelConfig(**state["model_config"])

    def check(trainer):
        assert trainer.load_checkpoint(V1_FIXTURE)["extra_state"] == {"loader": {"position": 8}}
        got_weights, got_optimizer, steps = state_of(trainer)
        assert steps == 2
        for name, value in weights.items():
            np.testing.assert_array_equal(got_weights[name], value, err_msg=name)
            for kind in trainer.OPTIMIZER_STATE:
                np.testing.assert_array_equal(got_optimizer[kind][name], flat[f"{kind}.{name}"])
        return True

    for devices in (1, 3):
        with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", devices=devices, batch_size=1, seq_len=4,
                                                      threads=1)) as trainer:
            check(trainer)
    world = ThreadWorld(2)

    def member(rank):
        def go():
            with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", devices=1, batch_size=1, seq_len=4,
                                                          zero_stage=3, threads=1),
                               processes=world.member(rank)) as trainer:
                return check(trainer)
        return go

    results, errors = in_threads([member(0), member(1)])
    assert errors == [None, None], errors
    read = checkpoint.read_weights(V1_FIXTURE)
    exported = load_file(os.path.join(export_checkpoint(V1_FIXTURE, tmp_path / "model"), "model.safetensors"))
    for name, value in weights.items():
        np.testing.assert_array_equal(read[name], value, err_msg=name)
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_export_from_two_processes_equals_export_from_one(tmp_path):
    def run(trainer):
        trainer.init_weights(seed=3)
        train(trainer, range(2))
        name = "two" if trainer.world_group.size > 1 else "one"
        step_dir = trainer.save_checkpoint(tmp_path / f"checkpoints-{name}", 2)
        return trainer.export_model(tmp_path / name), step_dir, state_of(trainer)

    two = in_world(2, 2, run, zero_stage=3)
    (one_dir, _, one_state), = in_world(1, 4, run, zero_stage=3)
    # One process of 4 devices reads its state without any gathering: the
    # 2 x 2 world's gathered state must equal it.
    assert_same_state(two[0][2], one_state)
    assert two[0][0] == two[1][0] == str(tmp_path / "two")  # every process gets the path
    reference = load_file(os.path.join(one_dir, "model.safetensors"))
    # nanoq export of the 2-process checkpoint, too.
    result = CliRunner().invoke(cli, ["export", two[0][1], "-o", str(tmp_path / "from-checkpoint")])
    assert result.exit_code == 0, result.output
    for exported in (os.path.join(two[0][0], "model.safetensors"),
                     os.path.join(tmp_path / "from-checkpoint", "model.safetensors")):
        got = load_file(exported)
        assert sorted(got) == sorted(reference)
        for name, value in reference.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize("backend, optimizer_dtype", cuda_cases(("fp32", "bf16"), ("bf16",)))
def test_cuda_parts_of_bf16_weights_and_state_move_between_device_counts_exactly(backend, optimizer_dtype, request,
                                                                              tmp_path):
    # The parts go through the cuda backend's casts (bf16 weights and state
    # to float32 and back): what 2 devices saved, 1 device holds exactly.
    use_cuda_backend(backend, request)
    fields = dict(backend=backend, dtype="bf16", optimizer_dtype=optimizer_dtype, zero_stage=3)
    with nanoq.Trainer(CONFIG, options(2, **fields)) as saving:
        saving.init_weights(seed=3)
        train(saving, range(1))
        saving.save_checkpoint(tmp_path, 1)
        saved = state_of(saving)
    with nanoq.Trainer(CONFIG, options(1, **fields)) as loading:
        loading.load_checkpoint(tmp_path)
        assert_same_state(state_of(loading), saved)


MPI_SCRIPT = """
import json, os, sys
import numpy as np
sys.path.insert(0, {tests!r})
import nanoq
from processes.checkpoints import BATCHES, CONFIG, WORLD, options, train
out = sys.argv[1]
with nanoq.Trainer(CONFIG, options(1)) as trainer:  # one device per process, the world from mpiexec
    trainer.init_weights(seed=3)
    train(trainer, range(2))
    path = trainer.save_checkpoint(os.path.join(out, "ckpt"), 2)
    losses = train(trainer, range(2, 3))
    rank = trainer.processes.rank
    with open(os.path.join(out, f"rank{{rank}}.json"), "w") as f:
        json.dump(dict(topology=trainer.topology, path=path, losses=losses), f)
"""


def test_a_checkpoint_saved_by_two_mpi_processes_loads_in_one(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(MPI_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    began = time.monotonic()
    result = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(script), str(tmp_path)],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.load(open(tmp_path / f"rank{rank}.json")) for rank in range(2)]
    assert [r["topology"] for r in ranks] == [[2, 0], [2, 1]]
    assert ranks[0]["path"] == ranks[1]["path"]
    assert checkpoint.read_state(ranks[0]["path"])["parts"] == dict(processes=2, world_size=2)
    with nanoq.Trainer(CONFIG, options(2)) as straight:  # one process of the same world size
        straight.init_weights(seed=3)
        train(straight, range(2))
        expected = state_of(straight)
        expected_losses = train(straight, range(2, 3))
        expected_after = state_of(straight)
    with nanoq.Trainer(CONFIG, options(2)) as resumed:  # fresh weights: the load must replace them
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert_same_state(state_of(resumed), expected)
        assert train(resumed, range(2, 3)) == expected_losses == ranks[0]["losses"] == ranks[1]["losses"]
        assert_same_state(state_of(resumed), expected_after)
    assert time.monotonic() - began < 60


MPI_KILL_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
import nanoq
from nanoq.testing import PAUSE_IN_SAVE_ENV
from processes.checkpoints import BATCHES, CONFIG, WORLD, options, train
out = sys.argv[1]
with nanoq.Trainer(CONFIG, options(1)) as trainer:
    rank = trainer.processes.rank
    trainer.init_weights(seed=3)
    train(trainer, range(1))
    trainer.save_checkpoint(os.path.join(out, "ckpt"), 1)
    train(trainer, range(1, 2))
    with open(os.path.join(out, f"pid{{rank}}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:  # process 1 pauses once its part of step 2 is written, to be killed there
        os.environ[PAUSE_IN_SAVE_ENV] = os.path.join(out, "paused")
    trainer.save_checkpoint(os.path.join(out, "ckpt"), 2)
"""


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_as_the_newest(tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(MPI_KILL_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    root, marker = tmp_path / "ckpt", tmp_path / "paused"
    run = subprocess.Popen([mpiexec_path(), "-n", "2", sys.executable, str(script), str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert run.poll() is None, run.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "process 1 never reached its pause in the save"
            time.sleep(0.05)
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
        run.wait(timeout=30)  # the launcher ends process 0, which waits for process 1's report
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode != 0
    # Step 2's partial folder holds process 1's part, but step 1 is still the newest checkpoint.
    partials = [name for name in os.listdir(root) if ".partial-" in name]
    assert len(partials) == 1 and checkpoint.part_file_name(1, 2) in os.listdir(root / partials[0])
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert checkpoint.list_checkpoints(root) == [1]
    with nanoq.Trainer(CONFIG, options(2)) as straight:
        straight.init_weights(seed=3)
        train(straight, range(1))
        expected = state_of(straight)
    with nanoq.Trainer(CONFIG, options(2)) as resumed:
        assert resumed.load_checkpoint(root)["step"] == 1
        assert_same_state(state_of(resumed), expected)
        resumed.save_checkpoint(root, 2)  # and the next save clears what the killed one left
    assert not [name for name in os.listdir(root) if ".partial-" in name]
    assert checkpoint.list_checkpoints(root) == [1, 2]
