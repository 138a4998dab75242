"""Checkpoints that a damaged file, a non-finite state, a full disk or a
read-only folder can neither poison nor block: checksums verified before
loading, rotation that keeps the newest finite checkpoint, damaged newest
checkpoints set aside on resume, free space checked before a save, and
unwritable run folders refused before any training."""
import collections
import dataclasses
import errno
import json
import os
import re
import shutil
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from nanoq import checkpoint
from nanoq.checkpoint import CheckpointError
from nanoq.training import RunInUse, TrainingHalted, train
from nanoq.training import run_lock
from nanoq_cli.main import cli
from test_checkpoint import make_trainer, train as train_steps
from test_resume import QUIET, config, records

PART = checkpoint.part_file_name(0, 1)
Usage = collections.namedtuple("Usage", "total used free")


def flip_data_byte(step_dir):
    """Flips one bit in the tensor data of the part (the header, hence the size and layout, stay valid)."""
    flip_data_byte_of(os.path.join(step_dir, PART))


def flip_data_byte_of(path):
    raw = bytearray(open(path, "rb").read())
    raw[-5] ^= 0x01
    open(path, "wb").write(bytes(raw))


def first_name(trainer):
    return trainer.trainable_names[0]


def poison_moments(trainer):
    name = first_name(trainer)
    moments = trainer.get_optimizer_state_part(name, "adam_m")
    moments[3] = np.nan
    trainer.set_optimizer_state_part(name, "adam_m", moments)
    return name


# -- checksums -------------------------------------------------------------------

def test_a_flipped_byte_in_tensor_data_is_refused_naming_the_file(tmp_path):
    with make_trainer() as trainer:
        train_steps(trainer, 0, 2)
        saved = trainer.save_checkpoint(tmp_path, 2)
    state = checkpoint.read_state(saved)
    assert state["checksums"][PART] == checkpoint.file_checksum(os.path.join(saved, PART))
    flip_data_byte(saved)
    checkpoint.read_state(saved)  # sizes and headers still look right: only the checksum can tell
    with make_trainer() as trainer:
        before = trainer.get_weights()
        with pytest.raises(CheckpointError, match=f"{PART} is corrupt: its checksum is crc32:"):
            trainer.load_checkpoint(saved)
        assert trainer.optimizer_steps == 0
        for name, value in trainer.get_weights().items():
            assert np.array_equal(value, before[name]), name
    with pytest.raises(CheckpointError, match=f"{PART} is corrupt"):
        checkpoint.read_weights(saved)


@pytest.mark.parametrize("field, value", [("step", 3), ("optimizer_steps", 12), ("extra_state", {"loader": 1})])
def test_a_changed_value_in_the_state_file_is_refused_though_the_json_is_valid(tmp_path, field, value):
    # The state file had no checksum of its own: a digit flipped in the step (or in the data
    # loader's position) left valid JSON that every field check passed, and the run resumed at
    # another step or data position.
    with make_trainer() as trainer:
        train_steps(trainer, 0, 2)
        saved = trainer.save_checkpoint(tmp_path, 2)
    state_file = os.path.join(saved, checkpoint.STATE_FILE)
    text = open(state_file).read()
    state = json.loads(text)
    assert state["state_checksum"] == checkpoint.state_checksum(state)
    state[field] = value
    damaged = json.dumps(state, indent=2)
    open(state_file, "w").write(damaged)
    with pytest.raises(CheckpointError, match=f"{re.escape(state_file)} is corrupt: its values give the "
                                              f"checksum crc32:[0-9a-f]{{8}}, it was saved with 'crc32:"):
        checkpoint.read_state(saved)
    with make_trainer() as trainer:
        with pytest.raises(CheckpointError, match="is corrupt"):
            trainer.load_checkpoint(saved)
        assert trainer.optimizer_steps == 0
    # Only the values count: the same state written otherwise (no indent, other key order) reads.
    open(state_file, "w").write(json.dumps(dict(reversed(list(json.loads(text).items())))))
    assert checkpoint.read_state(saved)["step"] == 2


def test_a_state_checksum_is_crc32_of_the_canonical_json_of_the_other_fields():
    import zlib

    state = {"b": [1, 2.5, "é"], "a": {"y": None, "x": True}, "state_checksum": "anything"}
    canonical = '{"a":{"x":true,"y":null},"b":[1,2.5,"\\u00e9"]}'
    assert checkpoint.state_checksum(state) == f"crc32:{zlib.crc32(canonical.encode()):08x}"


def test_the_checksum_is_zlibs_crc32_of_the_whole_file(tmp_path):
    import zlib

    path = tmp_path / "file"
    data = np.random.default_rng(0).bytes(3 * 1000 + 7)
    path.write_bytes(data)
    original = checkpoint.CHECKSUM_CHUNK
    try:
        checkpoint.CHECKSUM_CHUNK = 1000  # several chunks
        assert checkpoint.file_checksum(path) == f"crc32:{zlib.crc32(data):08x}"
    finally:
        checkpoint.CHECKSUM_CHUNK = original


def test_a_checkpoint_without_checksums_still_loads(tmp_path):
    with make_trainer() as trainer:
        train_steps(trainer, 0, 2)
        saved = trainer.save_checkpoint(tmp_path, 2)
        expected = trainer.get_weights()
    state_file = os.path.join(saved, checkpoint.STATE_FILE)
    state = json.load(open(state_file))
    for key in ("checksums", "finite", "non_finite", "state_checksum"):  # as written before these existed
        del state[key]
    json.dump(state, open(state_file, "w"))
    with make_trainer(seed=5) as trainer:
        trainer.load_checkpoint(saved)
        for name, value in trainer.get_weights().items():
            assert np.array_equal(value, expected[name]), name


# -- nothing poisoned kept at the expense of something good -------------------------

def test_nan_in_adam_moments_is_recorded_and_rotation_keeps_the_newest_finite(tmp_path):
    with make_trainer() as trainer:
        train_steps(trainer, 0, 1)
        trainer.save_checkpoint(tmp_path, 1, keep_last=2)
        name = poison_moments(trainer)
        for step in (2, 3, 4):
            trainer.save_checkpoint(tmp_path, step, keep_last=2)
    assert checkpoint.read_state(tmp_path / "step_00000001")["finite"] is True
    poisoned = checkpoint.read_state(tmp_path / "step_00000004")
    assert poisoned["finite"] is False and poisoned["non_finite"] == [f"adam_m.{name}"]
    # keep_last = 2 alone would keep only 3 and 4, both poisoned.
    assert checkpoint.list_checkpoints(tmp_path) == [1, 3, 4]
    assert checkpoint.newest_finite(tmp_path) == str(tmp_path / "step_00000001")
    assert checkpoint.rotate(tmp_path, keep_last=1) == [3]


def test_a_run_halted_by_a_poisoned_state_names_the_last_good_checkpoint(tmp_path):
    cfg = config(tmp_path, steps=8, checkpoint_every=2, keep_last=1, max_skipped_steps=2, eval_every=0)
    run_dir = tmp_path / "runs" / "run"
    with pytest.raises(RuntimeError):  # a crash after the checkpoint of step 4
        train(cfg, say=_raise_after("checkpoint @ step 4:"), progress=False)
    root = run_dir / "checkpoints"
    good = str(root / "step_00000004")
    # Poison the moments of the checkpoint the run will resume from (step 5, with step 4's loop state).
    with make_trainer_for(cfg) as trainer:
        state = trainer.load_checkpoint(good)
        poison_moments(trainer)
        trainer.save_checkpoint(root, 5, state["extra_state"])
    with pytest.raises(TrainingHalted) as halted:
        train(cfg, resume=str(run_dir), **QUIET)
    message = str(halted.value)
    assert f"the last good checkpoint is {good}" in message and "is not finite" in message
    assert os.path.isdir(good)  # kept by the rotation after every poisoned save (keep_last = 1)
    assert records(str(run_dir), "halted")[-1]["last_good_checkpoint"] == good


def _raise_after(prefix):
    def say(line):
        if line.startswith(prefix):
            raise RuntimeError("stopped by the test")
    return say


def make_trainer_for(cfg):
    import nanoq
    from nanoq.training.settings import train_options

    with open(os.path.join(cfg.out_dir, cfg.run_name, "checkpoints", "step_00000004", "trainer_state.json")) as f:
        model = json.load(f)["model_config"]
    return nanoq.Trainer(nanoq.ModelConfig(**model), train_options(cfg))


# -- a bad newest checkpoint never blocks ---------------------------------------------

def interrupted_run(tmp_path, **overrides):
    """A run of 12 steps (checkpoints every 4) killed after its checkpoint of step 8: its config and directory."""
    cfg = config(tmp_path, keep_last=3, **overrides)
    with pytest.raises(RuntimeError):
        train(cfg, say=_raise_after("checkpoint @ step 8:"), progress=False)
    return cfg, tmp_path / "runs" / "run"


def test_a_truncated_newest_checkpoint_is_set_aside_and_the_run_continues(tmp_path):
    cfg, run_dir = interrupted_run(tmp_path)
    first = {r["step"]: r["loss"] for r in records(str(run_dir), "train")}
    root = run_dir / "checkpoints"
    part = root / "step_00000008" / PART
    with open(part, "r+b") as f:
        f.truncate(os.path.getsize(part) - 100)
    lines = []
    result = train(cfg, resume=str(run_dir), say=lines.append, progress=False)
    assert result.resumed_from == str(root / "step_00000004")
    assert result.steps == 12
    set_aside = [name for name in os.listdir(root) if name.startswith("step_00000008.corrupt-")]
    assert len(set_aside) == 1
    assert any(line.startswith(f"warning: skipping checkpoint {root / 'step_00000008'}") and set_aside[0] in line
               for line in lines)
    assert checkpoint.list_checkpoints(root) == [4, 8, 12]  # step 8 saved again
    again = {r["step"]: r["loss"] for r in records(str(run_dir), "train")[8:]}
    assert again[5] == first[5] and again[8] == first[8]  # the same steps as before, bit for bit


def test_a_checkpoint_with_a_bad_checksum_is_set_aside_on_resume(tmp_path):
    cfg, run_dir = interrupted_run(tmp_path)
    root = run_dir / "checkpoints"
    flip_data_byte(root / "step_00000008")
    result = train(cfg, resume=str(run_dir), **QUIET)
    assert result.resumed_from == str(root / "step_00000004")
    assert any(name.startswith("step_00000008.corrupt-") for name in os.listdir(root))


def test_a_state_file_whose_values_changed_is_set_aside_on_resume(tmp_path):
    cfg, run_dir = interrupted_run(tmp_path)
    root = run_dir / "checkpoints"
    state_file = root / "step_00000008" / checkpoint.STATE_FILE
    state_file.write_text(state_file.read_text().replace('"optimizer_steps": 8', '"optimizer_steps": 9'))
    result = train(cfg, resume=str(run_dir), **QUIET)
    assert result.resumed_from == str(root / "step_00000004")
    assert any(name.startswith("step_00000008.corrupt-") for name in os.listdir(root))


def test_a_resume_reads_each_checksum_once(tmp_path, monkeypatch):
    """Choosing the checkpoint verifies its files; loading it then does not
    read them all again (for a large model's optimizer state, minutes)."""
    cfg, run_dir = interrupted_run(tmp_path)
    root = run_dir / "checkpoints"
    flip_data_byte(root / "step_00000008")  # the newest is damaged: the one before it is chosen
    checked = []
    real = checkpoint.file_checksum
    monkeypatch.setattr(checkpoint, "file_checksum", lambda path: checked.append(os.fspath(path)) or real(path))
    result = train(dataclasses.replace(cfg, checkpoint_every=0), resume=str(run_dir), **QUIET)
    assert result.resumed_from == str(root / "step_00000004") and result.steps == 12
    assert sorted(checked) == sorted([str(root / "step_00000008" / PART), str(root / "step_00000004" / PART)])


def test_a_resume_blocked_by_the_run_lock_moves_nothing_aside(tmp_path):
    cfg, run_dir = interrupted_run(tmp_path)
    flip_data_byte(run_dir / "checkpoints" / "step_00000008")
    before = sorted(os.listdir(run_dir / "checkpoints"))
    with run_lock.RunLock.acquire(str(run_dir)):
        with pytest.raises(RunInUse):
            train(cfg, resume=str(run_dir), **QUIET)
    assert sorted(os.listdir(run_dir / "checkpoints")) == before


def test_a_named_damaged_step_directory_is_an_error_not_set_aside(tmp_path):
    cfg, run_dir = interrupted_run(tmp_path)
    step_dir = run_dir / "checkpoints" / "step_00000008"
    flip_data_byte(step_dir)
    with pytest.raises(CheckpointError, match=f"{PART} is corrupt"):
        train(cfg, resume=str(step_dir), **QUIET)
    assert step_dir.is_dir()


# -- disks ------------------------------------------------------------------------------

def fake_free(monkeypatch, free):
    """Makes shutil.disk_usage report ``free(path)`` bytes free."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 40, 0, free(path)))


def test_a_full_disk_fails_the_save_with_sizes_and_folder_and_keeps_the_rest(tmp_path, monkeypatch):
    with make_trainer() as trainer:
        train_steps(trainer, 0, 1)
        trainer.save_checkpoint(tmp_path, 1)
        needed = checkpoint.checkpoint_bytes(trainer)
        assert needed >= sum(os.path.getsize(tmp_path / "step_00000001" / name)
                             for name in os.listdir(tmp_path / "step_00000001"))
        fake_free(monkeypatch, lambda path: 1000)
        with pytest.raises(OSError) as error:
            trainer.save_checkpoint(tmp_path, 2)
    assert error.value.errno == errno.ENOSPC
    message = str(error.value)
    assert "not enough disk space" in message and str(tmp_path) in message and "1000 B is free" in message
    assert f"{needed / 1024:.1f} KiB" in message or f"{needed / 2 ** 20:.1f} MiB" in message
    assert checkpoint.list_checkpoints(tmp_path) == [1]
    assert sorted(os.listdir(tmp_path)) == [".lock", "latest", "step_00000001"]


def test_a_disk_too_small_for_one_more_deletes_the_oldest_kept_first(tmp_path, monkeypatch):
    with make_trainer() as trainer:
        for step in (1, 2):
            train_steps(trainer, step - 1, step)
            trainer.save_checkpoint(tmp_path, step, keep_last=2)
        needed = checkpoint.checkpoint_bytes(trainer)
        # Room for one more only once step 1 is gone.
        fake_free(monkeypatch, lambda path: needed - 1 if (tmp_path / "step_00000001").exists() else needed)
        with pytest.warns(UserWarning, match="deleted step_00000001 before writing the next one"):
            trainer.save_checkpoint(tmp_path, 3, keep_last=2)
    assert checkpoint.list_checkpoints(tmp_path) == [2, 3]


def test_making_room_never_deletes_the_newest_finite_checkpoint(tmp_path, monkeypatch):
    with make_trainer() as trainer:
        train_steps(trainer, 0, 1)
        trainer.save_checkpoint(tmp_path, 1, keep_last=1)
        poison_moments(trainer)
        trainer.save_checkpoint(tmp_path, 2, keep_last=1)
        assert checkpoint.list_checkpoints(tmp_path) == [1, 2]
        needed = checkpoint.checkpoint_bytes(trainer)
        fake_free(monkeypatch, lambda path: needed - 1 if (tmp_path / "step_00000002").exists() else needed)
        with pytest.warns(UserWarning, match="deleted step_00000002"):
            trainer.save_checkpoint(tmp_path, 3, keep_last=1)
        assert checkpoint.list_checkpoints(tmp_path) == [1, 3]
        # Deleting step 3 (all the rotation would delete) cannot make room: nothing is deleted, the save fails.
        fake_free(monkeypatch, lambda path: 1000)
        with pytest.raises(OSError, match="not enough disk space"):
            trainer.save_checkpoint(tmp_path, 4, keep_last=1)
    assert checkpoint.list_checkpoints(tmp_path) == [1, 3]


def test_a_run_shows_and_logs_a_checkpoint_deleted_early_for_room(tmp_path, monkeypatch):
    """In the training loop the early deletion is a console line and a log.jsonl record, not a bare
    Python warning, and the run goes on to finish with the checkpoints keep_last keeps."""
    cfg = config(tmp_path, steps=6, checkpoint_every=2, keep_last=2, eval_every=0)
    real_usage = shutil.disk_usage
    run_dir = tmp_path / "runs" / "run"
    # Short of room while step 2 is still there, once step 4 exists (so at the save of step 6).
    short = lambda: (run_dir / "checkpoints" / "step_00000002").exists() and \
        (run_dir / "checkpoints" / "step_00000004").exists()  # noqa: E731
    needed = []  # what each save asks room for
    real_bytes = checkpoint.checkpoint_bytes
    monkeypatch.setattr(checkpoint, "checkpoint_bytes",
                        lambda trainer: needed.append(real_bytes(trainer)) or needed[-1])
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: Usage(1 << 40, 0, needed[-1] - 1) if short() else real_usage(path))
    lines = []
    train(cfg, say=lines.append, progress=False)
    (line,) = [line for line in lines if line.startswith("warning:")]
    assert "deleted step_00000002 before writing the next one" in line
    (record,) = records(str(run_dir), "warning")
    assert record["step"] == 6 and record["message"] == line[len("warning: "):]
    assert checkpoint.list_checkpoints(run_dir / "checkpoints") == [4, 6]


def refuse_writes_in(monkeypatch, directory):
    """Makes ``directory`` unwritable to nanoq: really (chmod) when not root, else through the write probe
    (root writes through permission bits; the probe is what a read-only mount would fail)."""
    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
        return
    real = run_lock._probe

    def probe(path):
        if os.path.realpath(path) == os.path.realpath(directory):
            raise PermissionError(errno.EROFS, os.strerror(errno.EROFS))
        real(path)

    monkeypatch.setattr(run_lock, "_probe", probe)


def test_the_write_probe_creates_and_removes_a_file(tmp_path):
    run_lock.require_writable(str(tmp_path))
    assert os.listdir(tmp_path) == []
    with pytest.raises(OSError, match="is not writable"):
        run_lock.require_writable(str(tmp_path / "missing"))


def test_a_read_only_run_folder_fails_before_any_training(tmp_path, monkeypatch):
    cfg, run_dir = interrupted_run(tmp_path)
    log_before = records(str(run_dir))
    refuse_writes_in(monkeypatch, run_dir)
    try:
        with pytest.raises(OSError, match=f"the run directory {run_dir} is not writable"):
            train(cfg, resume=str(run_dir), **QUIET)
    finally:
        os.chmod(run_dir, 0o755)
    assert records(str(run_dir)) == log_before  # nothing trained, nothing logged
    assert not (run_dir / "run.lock").exists()


def test_a_read_only_checkpoint_folder_fails_before_any_training(tmp_path, monkeypatch):
    cfg, run_dir = interrupted_run(tmp_path)
    refuse_writes_in(monkeypatch, run_dir / "checkpoints")
    try:
        result = CliRunner().invoke(cli, ["train", str(run_dir / "config.toml"), "--resume", str(run_dir)])
    finally:
        os.chmod(run_dir / "checkpoints", 0o755)
    assert result.exit_code == 1, result.output
    assert f"the run directory {run_dir / 'checkpoints'} is not writable" in result.output
    assert "Traceback" not in result.output


def test_the_run_lock_turns_an_unwritable_folder_into_a_clear_error(tmp_path, monkeypatch):
    real = os.open

    def refusing_open(path, *args, **kwargs):
        if os.path.basename(os.fspath(path)) == run_lock.LOCK_FILE:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(OSError, match=f"the run directory {tmp_path} is not writable") as error:
        run_lock.RunLock.acquire(str(tmp_path))
    assert error.value.errno == errno.EACCES


# -- export ----------------------------------------------------------------------------

def test_export_refuses_non_finite_weights_unless_allowed(tmp_path):
    with make_trainer() as trainer:
        train_steps(trainer, 0, 1)
        weights = trainer.get_weights()
        name = first_name(trainer)
        weights[name][0, 0] = np.inf
        trainer.set_weights(weights)
        saved = trainer.save_checkpoint(tmp_path / "checkpoints", 1)
    assert checkpoint.read_state(saved)["non_finite"][0] == f"weights.{name}"
    refused = CliRunner().invoke(cli, ["export", saved, "-o", str(tmp_path / "model")])
    assert refused.exit_code == 1
    assert f"non-finite weights (NaN or infinity) in {name} (1 of" in refused.output
    assert "--allow-non-finite" in refused.output and not (tmp_path / "model").exists()
    allowed = CliRunner().invoke(cli, ["export", saved, "-o", str(tmp_path / "model"), "--allow-non-finite"])
    assert allowed.exit_code == 0, allowed.output
    assert (tmp_path / "model" / "config.json").is_file()


# -- a world of several processes --------------------------------------------------------

def test_every_process_checksums_its_part_and_reports_non_finite_state(tmp_path):
    from test_checkpoint_processes import in_world

    def save(trainer):
        name = None
        if trainer.processes.rank == 1:  # only process 1's shard of the moments is poisoned
            name = next(n for n in trainer.trainable_names if trainer.owned_range(n)[1] > trainer.owned_range(n)[0])
            moments = trainer.get_optimizer_state_part(name, "adam_v")
            moments[0] = np.inf
            trainer.set_optimizer_state_part(name, "adam_v", moments)
        trainer.save_checkpoint(tmp_path, 1)
        return name

    poisoned = in_world(2, 2, save)[1]
    state = checkpoint.read_state(tmp_path / "step_00000001")
    parts = [checkpoint.part_file_name(process, 2) for process in range(2)]
    assert state["checksums"] == {part: checkpoint.file_checksum(tmp_path / "step_00000001" / part)
                                  for part in parts}
    assert state["finite"] is False and state["non_finite"] == [f"adam_v.{poisoned}"]
    flip_data_byte_of(tmp_path / "step_00000001" / parts[1])

    def load(trainer):
        with pytest.raises(Exception, match=f"{parts[1]} is corrupt"):
            trainer.load_checkpoint(tmp_path / "step_00000001")
        return trainer.optimizer_steps

    assert in_world(2, 2, load) == [0, 0]


def test_processes_resume_past_a_damaged_checkpoint_that_only_the_root_moves_aside(tmp_path):
    from test_processes_loop import tiny_config, train_in_world

    config = tiny_config(tmp_path, devices=2, steps=4, checkpoint_every=2, keep_last=3, eval_every=0)
    first, errors, _ = train_in_world([config, config])
    assert errors == [None, None]
    root = os.path.join(first[0].run_dir, "checkpoints")
    flip_data_byte_of(os.path.join(root, "step_00000004", checkpoint.part_file_name(1, 2)))
    config = dataclasses.replace(config, steps=6)
    (result, other), errors, lines = train_in_world([config, config], resume=first[0].run_dir)
    assert errors == [None, None]
    assert result.resumed_from == other.resumed_from == os.path.join(root, "step_00000002")
    assert [name for name in os.listdir(root) if ".corrupt-" in name] == \
        [next(name for name in os.listdir(root) if name.startswith("step_00000004.corrupt-"))]
    assert any(line.startswith("warning: skipping checkpoint") for line in lines[0]) and lines[1] == []
    assert checkpoint.list_checkpoints(root) == [2, 4, 6]


def test_a_run_in_an_out_dir_that_cannot_be_written_is_a_clear_error(tmp_path, monkeypatch):
    from nanoq.training import loop

    cfg = config(tmp_path)
    os.makedirs(cfg.out_dir)

    def refusing_makedirs(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(loop.os, "makedirs", refusing_makedirs)  # as a read-only out_dir does, even to root
    with pytest.raises(OSError, match=f"cannot create the run directory {os.path.join(cfg.out_dir, 'run')} "
                                      f"\\(Permission denied\\): make run.out_dir writable"):
        train(cfg, **QUIET)


def test_mpiexec_processes_resume_past_a_damaged_checkpoint(tmp_path):
    """Real mpiexec: 2 processes resume a run whose newest checkpoint has a flipped
    byte; the root alone sets it aside, both continue from the one before."""
    import subprocess
    import sys

    from test_processes import mpiexec_path
    from test_processes_loop import tiny_config

    config = tiny_config(tmp_path, devices=1, steps=4, checkpoint_every=2, keep_last=3, eval_every=0,
                         eval_data="")
    settings = dict(train_data=config.train_data, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, seq_len=16, batch_size=2, grad_accum=2,
                    warmup_steps=1, eval_every=0, backend="cpu", threads=1, checkpoint_every=2, keep_last=3,
                    devices=1, out_dir=config.out_dir, run_name="run")

    def nanoq_train(steps, resume):
        flags = [f"--{name}={value}" for name, value in dict(settings, steps=steps).items()]
        command = [mpiexec_path(), "-n", "2", sys.executable, "-m", "nanoq_cli.main", "train", *flags] + \
            (["--resume"] if resume else [])
        done = subprocess.run(command, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    nanoq_train(4, resume=False)
    root = os.path.join(config.out_dir, "run", "checkpoints")
    flip_data_byte_of(os.path.join(root, "step_00000004", checkpoint.part_file_name(0, 2)))
    output = nanoq_train(6, resume=True)
    assert output.count("warning: skipping checkpoint") == 1
    assert f"resuming from {os.path.join(root, 'step_00000002')} at step 2" in output
    assert len([name for name in os.listdir(root) if name.startswith("step_00000004.corrupt-")]) == 1
    assert checkpoint.list_checkpoints(root) == [2, 4, 6]


def _dead_pid():
    """The pid of a process that has ended."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_an_export_killed_midway_leaves_no_folder_behind_after_the_next(tmp_path):
    # A killed new_directory (a second Ctrl-C during a run's final export, say) leaves
    # <dir>.partial-<pid>: a whole model's copy. The next one into that place removes it; a
    # folder of a live process, and a replaced folder while the target is missing (then the
    # only copy), stay.
    from nanoq.durable import new_directory

    target = tmp_path / "model"
    dead = _dead_pid()
    abandoned = [tmp_path / f"model.partial-{dead}", tmp_path / f"model.replaced-{dead}"]
    live = tmp_path / f"model.partial-{os.getppid()}"
    for folder in abandoned + [live]:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * 100)
    with new_directory(target) as partial:
        open(os.path.join(partial, "config.json"), "w").write("{}")
    assert not abandoned[0].exists() and abandoned[1].exists() and live.exists()
    with new_directory(target, overwrite=True) as partial:  # now the target is there: the replaced one goes too
        open(os.path.join(partial, "config.json"), "w").write("{}")
    assert not abandoned[1].exists() and live.exists()
    assert sorted(os.listdir(tmp_path)) == sorted(["model", live.name])



def _folder_with(path, text):
    path.mkdir()
    (path / "config.json").write_text(text)


def test_replacing_a_folder_swaps_it_in_one_step_where_the_system_can(tmp_path, monkeypatch):
    # An overwriting export (LoRA's overwrite=True) must never leave the name empty: a kill
    # between "move the old one aside" and "rename the new one in" left no folder there.
    # Linux swaps the two in one step (renameat2 RENAME_EXCHANGE; ext4, xfs, btrfs, tmpfs
    # and overlayfs have it), and then the target is never renamed away.
    from nanoq import durable

    target = tmp_path / "adapter"
    _folder_with(target, "old")
    renamed_away = []
    rename = os.rename
    monkeypatch.setattr(durable.os, "rename",
                        lambda a, b: (renamed_away.append(a) if os.fspath(a) == str(target) else None, rename(a, b)))
    with durable.new_directory(target, overwrite=True) as partial:
        open(os.path.join(partial, "config.json"), "w").write("new")
    assert (target / "config.json").read_text() == "new"
    assert os.listdir(tmp_path) == ["adapter"]
    if sys.platform.startswith("linux"):
        assert renamed_away == []
        a, b = tmp_path / "a", tmp_path / "b"
        _folder_with(a, "a")
        _folder_with(b, "b")
        assert durable._exchange(str(a), str(b))
        assert (a / "config.json").read_text() == "b" and (b / "config.json").read_text() == "a"


def test_where_folders_cannot_be_swapped_a_failed_replacement_puts_the_old_one_back(tmp_path, monkeypatch):
    from nanoq import durable

    monkeypatch.setattr(durable, "_exchange", lambda a, b: False)
    target = tmp_path / "adapter"
    _folder_with(target, "old")
    with durable.new_directory(target, overwrite=True) as partial:  # the two renames, when they work
        open(os.path.join(partial, "config.json"), "w").write("new")
    assert (target / "config.json").read_text() == "new" and os.listdir(tmp_path) == ["adapter"]
    rename = os.rename

    def second_fails(a, b):
        if ".partial-" in os.fspath(a) and os.fspath(b) == str(target):
            raise OSError(5, "Input/output error")
        rename(a, b)

    monkeypatch.setattr(durable.os, "rename", second_fails)
    with pytest.raises(OSError, match="Input/output"):
        with durable.new_directory(target, overwrite=True) as partial:
            open(os.path.join(partial, "config.json"), "w").write("newer")
    assert (target / "config.json").read_text() == "new" and os.listdir(tmp_path) == ["adapter"]


def test_a_replacement_killed_while_deleting_the_old_folder_leaves_the_new_one(tmp_path):
    # The process dies (os._exit, as a SIGKILL would) while the replaced folder is deleted:
    # the new folder is in place, and what is left of the old one goes with the next export.
    import subprocess

    target = tmp_path / "adapter"
    _folder_with(target, "old")
    child = subprocess.run([sys.executable, "-c", f"""
import os, shutil
from nanoq import durable
def dies(path, **options):
    config = os.path.join(path, "config.json")
    if os.path.exists(config) and open(config).read() == "old":
        os._exit(9)
    shutil.rmtree(path, **options)
durable.shutil = type("shutil", (), {{"rmtree": staticmethod(dies)}})
with durable.new_directory({str(target)!r}, overwrite=True) as partial:
    open(os.path.join(partial, "config.json"), "w").write("new")
"""], capture_output=True, text=True, timeout=120)
    assert child.returncode == 9, child.stderr
    assert (target / "config.json").read_text() == "new"
    assert len(os.listdir(tmp_path)) == 2  # the rest of the old one, under a name of the dead process
    from nanoq.durable import new_directory

    with new_directory(target, overwrite=True) as partial:
        open(os.path.join(partial, "config.json"), "w").write("newer")
    assert os.listdir(tmp_path) == ["adapter"]


def test_folders_a_save_creates_are_made_durable_in_their_parents(tmp_path, monkeypatch):
    from nanoq import durable

    synced = []
    fsync_path = durable.fsync_path
    monkeypatch.setattr(durable, "fsync_path", lambda path: (synced.append(os.fspath(path)), fsync_path(path)))
    durable.make_dirs(tmp_path / "run" / "checkpoints")
    assert synced == [str(tmp_path), str(tmp_path / "run")]
    synced.clear()
    durable.make_dirs(tmp_path / "run" / "checkpoints", exist_ok=True)
    assert synced == []
    with pytest.raises(FileExistsError):
        durable.make_dirs(tmp_path / "run")


# -- a failed call leaves no cycle that keeps the trainer ----------------------------------------------


@pytest.mark.parametrize("call", ["load_missing", "load_corrupt", "save_again"])
def test_a_failed_checkpoint_call_does_not_keep_the_trainer_alive_after_del(tmp_path, call):
    # The error was kept in a local of the frame that raised it (error = e ... raise error): the
    # traceback held the frame and the frame the error, a cycle through the trainer, so `del trainer`
    # after a failed load_checkpoint/save_checkpoint kept its memory, threads and share of the memory
    # budget until the garbage collector ran (a notebook's next Trainer was refused for memory).
    import gc
    import weakref

    saved = None
    if call == "load_corrupt":
        with make_trainer() as trainer:
            saved = trainer.save_checkpoint(tmp_path / "saved", 1)
        flip_data_byte(saved)

    def fail():
        trainer = make_trainer(devices=2)
        with pytest.raises((CheckpointError, FileExistsError)):
            if call == "load_missing":
                trainer.load_checkpoint(tmp_path / "missing")
            elif call == "load_corrupt":
                trainer.load_checkpoint(saved)
            else:
                trainer.save_checkpoint(tmp_path / "again", 1)
                trainer.save_checkpoint(tmp_path / "again", 1)
        return weakref.ref(trainer)

    gc.collect()
    gc.disable()
    try:
        alive = fail()
        assert alive() is None, "the trainer outlived its last reference"
    finally:
        gc.enable()
