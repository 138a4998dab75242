"""Checkpoints: exact resume in a new process, any device count, atomic
saves that survive SIGKILL and full disks, rotation, and corrupt inputs
rejected before the trainer is touched."""
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import nanoq
from nanoq import checkpoint
from nanoq.checkpoint import CheckpointError

CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
SEQ = 16
ROWS = 4


def make_trainer(devices=2, seed=0, grad_accum=1):
    options = nanoq.TrainOptions(backend="cpu", devices=devices, batch_size=ROWS // devices, seq_len=SEQ, seed=seed,
                                 grad_accum=grad_accum)
    return nanoq.Trainer(nanoq.ModelConfig(**CONFIG), options)


def batch(step):
    tokens = np.random.default_rng(1000 + step).integers(0, CONFIG["vocab_size"], (ROWS, SEQ + 1), dtype=np.int32)
    return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])


def train(trainer, first, last):
    losses = []
    for step in range(first, last):
        trainer.step(*batch(step))
        losses.append(trainer.update(lr=3e-3, weight_decay=0.1, grad_clip=0.5).loss)
    return losses


# The same training code, run in fresh interpreters for the resume test.
SCRIPT = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from test_checkpoint import make_trainer, train
    mode, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    trainer = make_trainer()
    if mode == "first":
        losses = train(trainer, 0, 10)
        trainer.save_checkpoint(root, 10, {{"next_step": 10}})
    else:
        state = trainer.load_checkpoint(root)
        losses = train(trainer, state["extra_state"]["next_step"], 20)
    np.savez(out, losses=np.array(losses), **trainer.get_weights())
""")


def run_script(tmp_path, *args):
    script = tmp_path / "resume.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(__file__)))
    subprocess.run([sys.executable, str(script), *map(str, args)], check=True, timeout=120)


def test_resume_in_a_new_process_is_bitwise_identical(tmp_path):
    with make_trainer() as trainer:
        straight = train(trainer, 0, 20)
        weights = trainer.get_weights()
    run_script(tmp_path, "first", tmp_path / "ckpt", tmp_path / "first.npz")
    run_script(tmp_path, "second", tmp_path / "ckpt", tmp_path / "second.npz")
    first, second = np.load(tmp_path / "first.npz"), np.load(tmp_path / "second.npz")
    assert list(first["losses"]) + list(second["losses"]) == straight
    for name, value in weights.items():
        assert np.array_equal(second[name], value), name


@pytest.mark.parametrize("devices", [1, 4])
def test_checkpoint_from_two_devices_continues_on_other_device_counts(tmp_path, devices):
    with make_trainer(devices=2) as trainer:
        train(trainer, 0, 4)
        trainer.save_checkpoint(tmp_path, 4)
        expected = train(trainer, 4, 8)
        expected_weights = trainer.get_weights()
    with make_trainer(devices=devices, seed=7) as trainer:
        trainer.load_checkpoint(tmp_path)
        assert trainer.optimizer_steps == 4
        losses = train(trainer, 4, 8)
        np.testing.assert_allclose(losses, expected, rtol=1e-5)
        for name, value in trainer.get_weights().items():
            np.testing.assert_allclose(value, expected_weights[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_layout_latest_pointer_and_state(tmp_path):
    with make_trainer() as trainer:
        train(trainer, 0, 1)
        first = trainer.save_checkpoint(tmp_path, 1, {"loader": {"position": 4}})
        train(trainer, 1, 2)
        second = trainer.save_checkpoint(tmp_path, 2)
    assert os.path.basename(first) == "step_00000001"
    assert sorted(os.listdir(second)) == ["part-00000-of-00001.safetensors", "trainer_state.json"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"
    assert checkpoint.resolve(tmp_path) == second
    state = checkpoint.read_state(first)
    assert state["step"] == 1 and state["optimizer_steps"] == 1 and state["devices"] == 2
    assert state["extra_state"] == {"loader": {"position": 4}}
    assert state["model_config"]["hidden_size"] == 32 and state["nanoq_version"] == nanoq.__version__


def test_saving_an_existing_step_or_unserialisable_state_is_refused(tmp_path):
    with make_trainer() as trainer:
        train(trainer, 0, 1)
        trainer.save_checkpoint(tmp_path, 1)
        with pytest.raises(FileExistsError, match="already exists"):
            trainer.save_checkpoint(tmp_path, 1)
        with pytest.raises(ValueError, match="JSON"):
            trainer.save_checkpoint(tmp_path, 2, {"array": np.zeros(2)})
    assert checkpoint.list_checkpoints(tmp_path) == [1]



@pytest.mark.parametrize("argument,value", [("keep_last", -1), ("keep_last", 1.5), ("keep_last", "2"),
                                            ("keep_last", True), ("keep_every", -2), ("keep_every", 2.0)])
def test_a_bad_rotation_count_is_refused_before_anything_is_written_or_deleted(tmp_path, argument, value):
    # keep_last=-1 deleted every earlier checkpoint; 1.5 or "2" wrote the step, then raised a TypeError from
    # inside the rotation (and the retry found the step written); keep_every=-2 was used as a modulus.
    with make_trainer() as trainer:
        for step in (1, 2, 3):
            train(trainer, step - 1, step)
            trainer.save_checkpoint(tmp_path, step)
        with pytest.raises(ValueError, match=f"{argument} must be a non-negative integer .*, got {value!r}"):
            trainer.save_checkpoint(tmp_path, 4, **{argument: value, "keep_last": 1} if argument == "keep_every"
                                    else {argument: value})
        with pytest.raises(ValueError, match=f"{argument} must be a non-negative integer"):
            checkpoint.rotate(tmp_path, **({argument: value, "keep_last": 1} if argument == "keep_every"
                                           else {argument: value}))
    assert checkpoint.list_checkpoints(tmp_path) == [1, 2, 3]


def test_saving_with_micro_batches_pending_is_refused(tmp_path):
    # Before, it saved without their gradients (and load_checkpoint refused the same state).
    with make_trainer(grad_accum=2) as trainer:
        trainer.step(*batch(0))
        with pytest.raises(ValueError, match=r"cannot save a checkpoint with micro-batches pending \(1 step\(\) "
                                             r"calls since the last update\(\)\): call update\(\) first"):
            trainer.save_checkpoint(tmp_path, 1)
        assert not os.path.exists(tmp_path / "step_00000001")
        trainer.step(*batch(1))
        trainer.update(lr=1e-3)
        trainer.save_checkpoint(tmp_path, 1)


def test_a_rotation_that_fails_after_the_save_warns_and_returns_the_saved_checkpoint(tmp_path, monkeypatch):
    with make_trainer() as trainer:
        train(trainer, 0, 1)
        trainer.save_checkpoint(tmp_path, 1)

        def refused(root, step):
            raise PermissionError(13, "Permission denied", os.path.join(root, checkpoint.step_dir_name(step)))

        monkeypatch.setattr(checkpoint, "_delete", refused)
        with pytest.warns(checkpoint.DiskSpaceWarning, match=r"checkpoint step 2 is saved in .*step_00000002, but "
                                                             r"rotation \(keep_last = 1\) could not delete an older "
                                                             r"one: Permission denied \(.*step_00000001\); what it "
                                                             r"could not delete remains") as caught:
            path = trainer.save_checkpoint(tmp_path, 2, keep_last=1)
        assert caught[0].filename == __file__  # the caller's line, through Trainer's method
    assert os.path.basename(path) == "step_00000002" and checkpoint.list_checkpoints(tmp_path) == [1, 2]
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"


def test_saving_an_earlier_step_than_the_roots_newest_is_refused(tmp_path):
    # Before, rotation by step deleted the step just written (keep_last=2 kept 100 and 200), and `latest`
    # named it; load_checkpoint(root) then restored the other run's step 200 without a word.
    with make_trainer() as old:
        train(old, 0, 1)
        for step in (100, 200):
            old.save_checkpoint(tmp_path, step)
    with make_trainer() as trainer:
        train(trainer, 0, 1)
        for keep_last in (0, 2):
            with pytest.raises(ValueError, match=rf"cannot save checkpoint step 10 into {tmp_path}: it holds a "
                                                 r"later checkpoint \(step 200\)"):
                trainer.save_checkpoint(tmp_path, 10, keep_last=keep_last)
        assert checkpoint.list_checkpoints(tmp_path) == [100, 200]
        assert (tmp_path / "latest").read_text().strip() == "step_00000200"
        assert sorted(set(os.listdir(tmp_path)) - {".lock"}) == ["latest", "step_00000100", "step_00000200"]
        assert os.path.basename(trainer.save_checkpoint(tmp_path, 201, keep_last=2)) == "step_00000201"
        assert checkpoint.list_checkpoints(tmp_path) == [200, 201]


KILL_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_checkpoint import make_trainer, train
    trainer = make_trainer()
    train(trainer, 0, 1)
    trainer.save_checkpoint(sys.argv[1], 1)
    train(trainer, 1, 2)
    import os
    from nanoq.testing import PAUSE_IN_SAVE_ENV
    os.environ[PAUSE_IN_SAVE_ENV] = sys.argv[2]
    trainer.save_checkpoint(sys.argv[1], 2)
""")


def test_sigkill_during_save_leaves_previous_checkpoint_and_is_cleaned_up(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "paused"
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT.format(tests=os.path.dirname(__file__)))
    process = subprocess.Popen([sys.executable, str(script), str(root), str(marker)])
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert process.poll() is None, "the saving process ended before pausing"
        assert time.monotonic() < deadline, "the save never reached its pause"
        time.sleep(0.05)
    # The part of step 2 is on disk, the JSON state is not.
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    partials = [name for name in os.listdir(root) if ".partial-" in name]
    assert partials, "the interrupted save should have left its partial folder"
    assert checkpoint.list_checkpoints(root) == [1]
    assert checkpoint.resolve(root).endswith("step_00000001")
    with make_trainer() as trainer:
        assert trainer.load_checkpoint(root)["step"] == 1
        train(trainer, 1, 2)
        trainer.save_checkpoint(root, 2)
    assert not [name for name in os.listdir(root) if ".partial-" in name]
    assert checkpoint.list_checkpoints(root) == [1, 2]


def test_full_disk_during_save_raises_and_keeps_previous_checkpoint(tmp_path, monkeypatch):
    with make_trainer() as trainer:
        train(trainer, 0, 1)
        trainer.save_checkpoint(tmp_path, 1)
        real_save = checkpoint._save_tensors

        def save_until_full(path, tensors, metadata):
            if path.endswith(checkpoint.part_file_name(0, 1)):
                with open(path, "wb") as f:
                    f.write(b"\0" * 100)
                raise OSError(errno.ENOSPC, "No space left on device")
            real_save(path, tensors, metadata)

        monkeypatch.setattr(checkpoint, "_save_tensors", save_until_full)
        train(trainer, 1, 2)
        with pytest.raises(OSError, match="No space left on device.*earlier checkpoints are intact"):
            trainer.save_checkpoint(tmp_path, 2)
    assert sorted(os.listdir(tmp_path)) == [".lock", "latest", "step_00000001"]
    assert checkpoint.resolve(tmp_path).endswith("step_00000001")


def test_rotation_keeps_last_k_and_every_mth(tmp_path):
    with make_trainer() as trainer:
        for step in range(1, 13):
            train(trainer, step - 1, step)
            trainer.save_checkpoint(tmp_path, step, keep_last=2, keep_every=5)
    assert checkpoint.list_checkpoints(tmp_path) == [5, 10, 11, 12]
    assert checkpoint.rotate(tmp_path, keep_last=1) == [5, 10, 11]
    assert checkpoint.list_checkpoints(tmp_path) == [12]
    with pytest.raises(ValueError, match="keep_last"):
        checkpoint.rotate(tmp_path, keep_last=0)


@pytest.fixture
def saved(tmp_path):
    with make_trainer() as trainer:
        train(trainer, 0, 2)
        return trainer.save_checkpoint(tmp_path, 2)


PART = checkpoint.part_file_name(0, 1)


def corrupt_truncate(step_dir):
    path = os.path.join(step_dir, PART)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    return PART, "bytes"


def corrupt_offsets(step_dir):
    # Same size as recorded, but the header claims data beyond the file.
    path = os.path.join(step_dir, PART)
    raw = open(path, "rb").read()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    name = max(entries, key=lambda k: entries[k]["data_offsets"][1])
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [end + 1, 2 * end + 1 - begin]  # starts past the end of the data
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size, "the edited header must fit in place"
    text = text + b" " * (size - len(text))
    open(path, "wb").write(raw[:8] + text + raw[8 + size:])
    return PART, "data_offsets"


def corrupt_json(step_dir):
    path = os.path.join(step_dir, "trainer_state.json")
    state = json.load(open(path))
    del state["optimizer_steps"]
    state["state_checksum"] = checkpoint.state_checksum(state)  # (else the checksum tells first)
    json.dump(state, open(path, "w"))
    return "trainer_state.json", "optimizer_steps"


@pytest.mark.parametrize("corrupt", [corrupt_truncate, corrupt_offsets, corrupt_json],
                         ids=["truncated-safetensors", "offsets-outside-file", "json-missing-field"])
def test_corrupt_checkpoint_is_rejected_naming_file_and_nothing_is_loaded(saved, corrupt):
    file, problem = corrupt(saved)
    with make_trainer() as trainer:
        before = trainer.get_weights()
        with pytest.raises(CheckpointError) as error:
            trainer.load_checkpoint(saved)
        assert file in str(error.value) and problem in str(error.value)
        assert trainer.optimizer_steps == 0
        for name, value in trainer.get_weights().items():
            assert np.array_equal(value, before[name]), name


def test_checkpoint_of_another_model_shape_is_rejected(saved):
    other = nanoq.ModelConfig(**dict(CONFIG, hidden_size=64))
    with nanoq.Trainer(other, nanoq.TrainOptions(backend="cpu", batch_size=ROWS, seq_len=SEQ)) as trainer:
        with pytest.raises(CheckpointError, match="hidden_size: checkpoint 32, trainer 64"):
            trainer.load_checkpoint(saved)


def test_root_without_checkpoints_is_a_clear_error(tmp_path):
    with make_trainer() as trainer, pytest.raises(CheckpointError, match="no complete checkpoint"):
        trainer.load_checkpoint(tmp_path)


def test_a_file_named_like_a_step_directory_is_passed_over(tmp_path):
    # A stray file in a checkpoint root (`step_00000002`, say) made loading raise NotADirectoryError; an
    # incomplete step directory was passed over for the newest valid one, and so is a file now.
    with make_trainer() as trainer:
        train(trainer, 0, 1)
        trainer.save_checkpoint(tmp_path, 1)
        weights = trainer.get_weights()
    (tmp_path / "step_00000002").write_text("not a checkpoint")
    assert checkpoint.list_checkpoints(tmp_path) == [1]
    assert checkpoint.resolve(tmp_path) == str(tmp_path / "step_00000001")
    with make_trainer() as other:
        other.load_checkpoint(tmp_path)
        assert all(np.array_equal(other.get_weights()[name], weights[name]) for name in weights)
    with pytest.raises(checkpoint.CheckpointError, match="is not a checkpoint: a file, not a step directory"):
        checkpoint.read_state(tmp_path / "step_00000002")
