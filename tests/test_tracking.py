"""run.tracker: TensorBoard and Weights & Biases (offline) hold the figures of log.jsonl, read back
with the libraries' own readers, and a resumed run continues the same tracker run."""
import glob
import json
import os
import shutil
import struct
import sys
import time
import zlib

import numpy as np
import pytest

from nanoq.training import JsonlLog, TrainConfig, train
from nanoq.training.tracking import TensorBoardTracker, check_tracker
from test_resume import QUIET, config, records

TRAIN_FIGURES = ("loss", "lr", "grad_norm", "tokens_per_s", "tokens", "trained_tokens", "time")


# -- TensorBoard -----------------------------------------------------------------------


def tensorboard_events(run_dir):
    """EventAccumulator over <run>/tensorboard, everything kept (no sampling)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def tb_scalars(events, tag):
    return [(e.step, e.value) for e in events.Scalars(tag)]


def tb_texts(events, tag):
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)]


def f32(value):
    return float(np.float32(value))  # TensorBoard scalars are float32


def test_tensorboard_holds_every_figure_of_log_jsonl(tmp_path):
    result = train(config(tmp_path, steps=8, sample_every=4, tracker="tensorboard", checkpoint_every=0), **QUIET)
    events = tensorboard_events(result.run_dir)
    train_records = records(result.run_dir, "train")
    assert len(train_records) == 8
    for figure in TRAIN_FIGURES:
        assert tb_scalars(events, f"train/{figure}") == [(r["step"], f32(r[figure])) for r in train_records], figure
    evals = records(result.run_dir, "eval")
    assert tb_scalars(events, "eval/loss") == [(r["step"], f32(r["loss"])) for r in evals]
    assert tb_scalars(events, "eval/tokens") == [(r["step"], f32(r["tokens"])) for r in evals]
    (start,) = records(result.run_dir, "start")
    for name, size in start["memory"][0]["contexts"].items():
        assert tb_scalars(events, f"memory/device0/{name}") == [(0, f32(size))], name
    assert tb_scalars(events, "memory/device0/allocated") == [(0, f32(start["memory"][0]["allocated"]))]
    samples = records(result.run_dir, "sample")
    assert len(samples) == 2
    assert tb_texts(events, "sample/0/completion") == [(r["step"], r["completion"]) for r in samples]
    assert tb_texts(events, "sample/0/prompt") == [(r["step"], r["prompt"]) for r in samples]
    (config_text,) = tb_texts(events, "config")
    assert "| train.lr | `0.01` |" in config_text[1]


def test_gpu_telemetry_records_become_per_gpu_scalars(tmp_path):
    """Telemetry needs NVML on a cuda run; its records go through the same hook."""
    record = dict(type="telemetry", step=10, time=1.5,
                  gpus=[dict(device=0, gpu_util=97, memory_used=2**33, power_w=612.5, temperature_c=71,
                             throttle=["sw_power_cap"]),
                        dict(device=1, gpu_util=95, memory_used=2**32, power_w=600.0, temperature_c=70)])
    with JsonlLog(tmp_path / "log.jsonl", tracker=TensorBoardTracker(str(tmp_path))) as log:
        log.write(**record)
    events = tensorboard_events(tmp_path)
    for gpu in record["gpus"]:
        for name in ("gpu_util", "memory_used", "power_w", "temperature_c"):
            assert tb_scalars(events, f"gpu{gpu['device']}/{name}") == [(10, f32(gpu[name]))]
    assert tb_scalars(events, "telemetry/time") == [(10, 1.5)]
    assert json.loads(open(tmp_path / "log.jsonl").read()) == record


def test_a_resumed_run_continues_the_tensorboard_run_without_duplicated_steps(tmp_path):
    first = train(config(tmp_path, steps=10, tracker="tensorboard", checkpoint_every=4, eval_every=4), **QUIET)
    # As if the run had died after step 10 but before its last checkpoint: steps 9 and 10 are
    # in the tracker, and the run resumes from step 8.
    shutil.rmtree(os.path.join(first.run_dir, "checkpoints", "step_00000010"))
    resumed = train(config(tmp_path, steps=12, tracker="tensorboard", checkpoint_every=4, eval_every=4),
                    resume="auto", **QUIET)
    assert resumed.run_dir == first.run_dir
    events = tensorboard_events(first.run_dir)
    log = records(first.run_dir)
    last_resume = max(i for i, r in enumerate(log) if r["type"] == "resume")
    before = {r["step"]: r for r in log[:last_resume] if r["type"] == "train" and r["step"] <= 8}
    after = {r["step"]: r for r in log[last_resume:] if r["type"] == "train"}
    assert sorted(after) == [9, 10, 11, 12]
    for figure in TRAIN_FIGURES:
        expected = [(step, f32(r[figure])) for step, r in sorted({**before, **after}.items())]
        assert tb_scalars(events, f"train/{figure}") == expected, figure
    # The eval the resumed run repeats at step 8 is there once; the end's eval at 12 is the resumed run's.
    evals = tb_scalars(events, "eval/loss")
    assert [step for step, _ in evals] == [0, 4, 8, 12]
    assert evals[-1] == (12, f32([r for r in log if r["type"] == "eval"][-1]["loss"]))
    assert len(glob.glob(os.path.join(first.run_dir, "tensorboard", "events.out.tfevents.*"))) == 2


# -- Weights & Biases (offline) ---------------------------------------------------------


def wandb_records(path):
    """The protobuf records (wandb.proto.wandb_internal_pb2.Record) of a .wandb run file.

    wandb 0.31 ships no Python reader for its run files; their layout is a
    7-byte header (":W&B", magic 0xBEE1, version) and then LevelDB log
    blocks of 32 KiB, each record framed by crc32 (zlib, seeded with its
    type byte), length and type (1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, path
    position, pending, out = 7, b"", []
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if (crc, length, kind) == (0, 0, 0):
            position += left
            continue
        payload = data[position + 7:position + 7 + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad record at {position}"
        position += 7 + length
        pending += payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def wandb_runs(run_dir):
    """[(run record, [history row {key: value}], {config key: value})] of every offline W&B run of a
    nanoq run, oldest first."""
    import wandb

    # As at the process's exit: W&B's service writes the run files, and only
    # its teardown waits for everything to be written (finish() waits for
    # the run's exit record; one full run once read a file without its run
    # record here). A later wandb.init starts a new service.
    wandb.teardown()
    runs = []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        run, rows, settings = None, [], {}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                settings.update({item.key: json.loads(item.value_json) for item in run.config.update})
            elif kind == "config":
                settings.update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                rows.append({item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json)
                             for item in record.history.item})
        runs.append((run, rows, settings))
    return runs


@pytest.fixture
def wandb_offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def rows_of(rows, key):
    return [(row["step"], row[key]) for row in rows if key in row]


def test_wandb_offline_run_holds_every_figure_of_log_jsonl(tmp_path, wandb_offline):
    result = train(config(tmp_path, steps=8, sample_every=4, tracker="wandb", checkpoint_every=0), **QUIET)
    ((run, rows, settings),) = wandb_runs(result.run_dir)
    assert run.run_id == open(os.path.join(result.run_dir, "wandb_run_id")).read().strip()
    assert run.display_name == "run" and run.project == "nanoq"
    train_records = records(result.run_dir, "train")
    for figure in TRAIN_FIGURES:  # JSON numbers both sides: exactly log.jsonl's
        assert rows_of(rows, f"train/{figure}") == [(r["step"], r[figure]) for r in train_records], figure
    assert rows_of(rows, "eval/loss") == [(r["step"], r["loss"]) for r in records(result.run_dir, "eval")]
    (start,) = records(result.run_dir, "start")
    for name, size in start["memory"][0]["contexts"].items():
        assert rows_of(rows, f"memory/device0/{name}") == [(0, size)], name
    samples = records(result.run_dir, "sample")
    assert rows_of(rows, "sample/0/completion") == [(r["step"], r["completion"]) for r in samples]
    assert settings["train.lr"] == 0.01 and settings["train.sample_every"] == 4 and settings["run.tracker"] == "wandb"


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, wandb_offline):
    first = train(config(tmp_path, steps=8, tracker="wandb", checkpoint_every=4), **QUIET)
    time.sleep(1.0 - time.time() % 1.0)  # W&B names offline runs by the second
    train(config(tmp_path, steps=12, tracker="wandb", checkpoint_every=4), resume="auto", **QUIET)
    (run_a, rows_a, _), (run_b, rows_b, _) = wandb_runs(first.run_dir)
    assert run_a.run_id == run_b.run_id and run_b.resume  # the same run, asked to resume
    log = records(first.run_dir)
    last_resume = max(i for i, r in enumerate(log) if r["type"] == "resume")
    assert rows_of(rows_a, "train/loss") == [(r["step"], r["loss"]) for r in log[:last_resume] if r["type"] == "train"]
    assert rows_of(rows_b, "train/loss") == [(r["step"], r["loss"]) for r in log[last_resume:] if r["type"] == "train"]
    assert [step for step, _ in rows_of(rows_b, "eval/loss")] == [12]  # the repeated eval at 8 is not sent again


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_a_missing_tracker_library_fails_before_training_naming_the_extra(tmp_path, monkeypatch, kind):
    monkeypatch.setitem(sys.modules, kind, None)  # import fails as if it were not installed
    with pytest.raises(ImportError, match=rf'run\.tracker = "{kind}" needs the {kind} package: pip install '
                                          rf'"nanoq\[{kind}\]"'):
        train(config(tmp_path, tracker=kind), **QUIET)
    assert not os.path.exists(tmp_path / "runs")
    # The command line says it in one line, as any bad setting (it printed a traceback).
    from click.testing import CliRunner

    from nanoq_cli.main import cli

    result = CliRunner().invoke(cli, ["train", "--steps", "1", "--tracker", kind, "--out_dir", str(tmp_path / "cli")])
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f'Error: run.tracker = "{kind}" needs the {kind} package') and \
        "Traceback" not in result.output, result.output


def test_tracker_setting_refuses_unknown_trackers():
    with pytest.raises(ValueError, match=r"run\.tracker must be one of \"\", tensorboard, wandb, got .mlflow."):
        TrainConfig(tracker="mlflow")
    check_tracker("")


def test_only_the_root_process_tracks(tmp_path):
    from nanoq.testing.threads import ThreadWorld
    from test_topology import in_threads

    world = ThreadWorld(2)
    settings = config(tmp_path, steps=4, batch_size=2, checkpoint_every=0, tracker="tensorboard")
    results, errors = in_threads([(lambda r=r: train(settings, processes=world.member(r), **QUIET))
                                  for r in range(2)])
    assert errors == [None, None]
    run_dir = results[0].run_dir
    assert len(glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))) == 1
    events = tensorboard_events(run_dir)
    assert tb_scalars(events, "train/loss") == [(r["step"], f32(r["loss"])) for r in records(run_dir, "train")]


def test_a_wandb_run_that_cannot_start_is_one_error_naming_the_setting_and_the_way_without_an_account(
        tmp_path, monkeypatch):
    import wandb  # (the test extra's)

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ValueError, match=r"run\.tracker wandb could not start its run: No API key configured\. "
                                         r"Use `wandb login` to log in\. \(WANDB_MODE=offline logs into the run "
                                         r"directory without an account"):
        train(config(tmp_path, steps=2, tracker="wandb"), **QUIET)
    assert not os.path.exists(tmp_path / "runs" / "run")  # nothing ran: no half-made run


def test_the_logged_z_loss_and_the_config_tomls_out_dir(tmp_path, monkeypatch):
    # The z-loss acts on the gradient only: train records now hold its mean (it was logged nowhere).
    monkeypatch.chdir(tmp_path)
    run = train(config(tmp_path, steps=2, z_loss=0.5, out_dir="relative"), **QUIET)
    logged = [r["z_loss"] for r in records(run.run_dir, "train")]
    assert len(logged) == 2 and all(value > 0 for value in logged)
    assert "z_loss" not in records(train(config(tmp_path, steps=1, run_name="plain"), **QUIET).run_dir, "train")[0]
    # The run's config.toml names its out_dir absolute, so that `nanoq train RUN/config.toml --run_name NEW`
    # puts NEW beside this run from any working directory (a relative one was taken from the working directory).
    import tomllib

    saved = tomllib.load(open(os.path.join(run.run_dir, "config.toml"), "rb"))
    assert saved["run"]["out_dir"] == str(tmp_path / "relative")
