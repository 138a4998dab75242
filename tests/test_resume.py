"""Checkpoints written by the training loop, and resuming from them (train(..., resume=), nanoq train --resume)."""
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from nanoq.checkpoint import NewerFormatError, list_checkpoints, read_state, read_weights
from nanoq.data import write_tokens
from nanoq.memory import human_bytes
from nanoq.training import TrainConfig, read_log, train
from nanoq_cli.main import cli

VOCAB = 64
QUIET = dict(say=lambda line: None, progress=False)


def write_data(directory):
    """Train and eval token files of a learnable pattern; their train glob and eval path."""
    rng = np.random.default_rng(0)
    pattern = np.tile(np.arange(1, 17), 200) + rng.integers(0, 2, 3200) * 16
    directory.mkdir(exist_ok=True)
    write_tokens(directory / "train_000000.bin", pattern, VOCAB)
    write_tokens(directory / "eval_000000.bin", pattern[:700], VOCAB)
    return str(directory / "train_*.bin"), str(directory / "eval_000000.bin")


TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            seq_len=16, batch_size=4, grad_accum=2, warmup_steps=2, lr=1e-2, eval_every=4, eval_batches=0,
            backend="cpu", threads=1, checkpoint_every=4)


def config(tmp_path, **overrides):
    train_data, eval_data = write_data(tmp_path / "data")
    values = dict(TINY, train_data=train_data, eval_data=eval_data, steps=12, out_dir=str(tmp_path / "runs"),
                  run_name="run")
    return TrainConfig(**{**values, **overrides})


def records(run_dir, kind=None):
    log = read_log(os.path.join(run_dir, "log.jsonl"))
    return [r for r in log if kind is None or r["type"] == kind]


def losses_after_resume(run_dir):
    """{step: loss} of the train records written after the last resume record."""
    log = records(run_dir)
    last_resume = max(i for i, r in enumerate(log) if r["type"] == "resume")
    return {r["step"]: r["loss"] for r in log[last_resume:] if r["type"] == "train"}


def straight_run(tmp_path, **overrides):
    result = train(config(tmp_path, run_name="straight", **overrides), **QUIET)
    return result, {r["step"]: r["loss"] for r in records(result.run_dir, "train")}


def snapshot(directory):
    """{relative path: bytes} of every file under ``directory``."""
    files = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, directory)] = open(path, "rb").read()
    return files


class Interrupt(Exception):
    pass


def stop_after_checkpoint(step):
    """A ``say`` that kills the run (as a crash would) once the checkpoint of ``step`` is written."""
    def say(line):
        if line.startswith(f"checkpoint @ step {step}:"):
            raise Interrupt
    return say


def test_a_run_killed_after_a_checkpoint_resumes_bit_for_bit(tmp_path):
    straight, expected = straight_run(tmp_path)
    with pytest.raises(Interrupt):
        train(config(tmp_path), say=stop_after_checkpoint(8), progress=False)
    assert list_checkpoints(tmp_path / "runs" / "run" / "checkpoints") == [4, 8]
    assert not os.path.exists(tmp_path / "runs" / "run" / "model")

    result = train(config(tmp_path), resume=str(tmp_path / "runs" / "run"), **QUIET)
    assert result.resumed_from == os.path.join(result.run_dir, "checkpoints", "step_00000008")
    assert losses_after_resume(result.run_dir) == {step: expected[step] for step in range(9, 13)}  # bitwise
    assert result.evals == straight.evals  # restored [(0, ..), (4, ..)], then 8 and 12 evaluated again
    (resume,) = records(result.run_dir, "resume")
    assert resume["step"] == 8 and resume["changes"] == {}
    assert [r["tokens"] for r in records(result.run_dir, "train")][-1] == 12 * 4 * 16 * 2
    final, reference = read_weights(result.run_dir + "/checkpoints"), read_weights(straight.run_dir + "/checkpoints")
    assert all(np.array_equal(final[name], reference[name]) for name in reference)



def test_nanoq_eval_of_a_run_cuts_the_windows_its_evaluations_did(tmp_path):
    # A run of disjoint windows (data.window_step = seq_len + 1, as a Nano import's one window per
    # line): nanoq eval of its model takes the run's windows and so its final evaluation's figures.
    result = train(config(tmp_path, steps=4, window_step=17), **QUIET)
    final = records(result.run_dir, "eval")[-1]
    eval_data = str(tmp_path / "data" / "eval_000000.bin")
    for model in (result.run_dir, os.path.join(result.run_dir, "model"), final_checkpoint := os.path.join(
            result.run_dir, "checkpoints", "step_00000004")):
        output = CliRunner().invoke(cli, ["eval", model, "--data", eval_data, "--backend", "cpu", "--json"])
        assert output.exit_code == 0, output.output
        got = json.loads(output.output.splitlines()[-1])
        assert got["window_step"] == 17 and got["tokens"] == final["tokens"], (model, got, final)
        np.testing.assert_allclose(got["loss"], final["loss"], rtol=1e-5)
    # --window-step says otherwise; another seq_len than the run's takes the default step.
    output = CliRunner().invoke(cli, ["eval", final_checkpoint, "--data", eval_data, "--backend", "cpu", "--json",
                                      "--window-step", "16"])
    assert json.loads(output.output.splitlines()[-1])["tokens"] == 699 // 16 * 16, output.output
    output = CliRunner().invoke(cli, ["eval", final_checkpoint, "--data", eval_data, "--backend", "cpu", "--json",
                                      "--seq-len", "8"])
    assert json.loads(output.output.splitlines()[-1])["window_step"] == 8, output.output
    output = CliRunner().invoke(cli, ["eval", final_checkpoint, "--data", eval_data, "--backend", "cpu",
                                      "--window-step", "5"])
    assert output.exit_code == 1 and "Error: window_step must be seq_len (16: windows sharing a token) or " \
        "seq_len + 1 (17: disjoint windows); got 5" in output.output, output.output


def test_a_resumed_runs_folder_means_its_newest_model_to_generate_and_eval(tmp_path):
    # After a finished run is resumed for more steps, its final model goes to model-step<N>/
    # and model/ keeps the first finish's: `nanoq eval RUN` (and generate, which resolves
    # MODEL alike) must take the newest, and say which when the folder holds several.
    train(config(tmp_path, steps=8, schedule="constant"), **QUIET)
    result = train(config(tmp_path, steps=12, schedule="constant"), resume="auto", **QUIET)
    run = result.run_dir
    eval_data = str(tmp_path / "data" / "eval_000000.bin")

    def loss(model):
        output = CliRunner().invoke(cli, ["eval", model, "--data", eval_data, "--backend", "cpu", "--json"])
        assert output.exit_code == 0, output.output
        return json.loads(output.output.splitlines()[-1])["loss"], output.output

    newest, first = loss(os.path.join(run, "model-step12"))[0], loss(os.path.join(run, "model"))[0]
    assert newest != first
    got, output = loss(run)
    assert got == newest
    assert f"model: {os.path.join(run, 'model-step12')}, the model of the run's last finish (step 12)" in output
    # A checkpoint newer than the last finish (a resumed run stopped before its end: here its
    # end record is gone) is the newest model.
    lines = open(os.path.join(run, "log.jsonl")).readlines()
    last_end = max(i for i, line in enumerate(lines) if json.loads(line)["type"] == "end")
    with open(os.path.join(run, "log.jsonl"), "w") as f:
        f.writelines(lines[:last_end] + lines[last_end + 1:])
    got, output = loss(run)
    assert got == newest  # step 12's checkpoint holds the weights model-step12 has
    assert "the newest checkpoint (step 12), newer than the run's last exported model" in output
    # A finished run never resumed holds one model (and its checkpoints of the same step): no note.
    single = train(config(tmp_path, steps=4, schedule="constant", run_name="single"), **QUIET)
    got, output = loss(single.run_dir)
    assert got == loss(os.path.join(single.run_dir, "model"))[0] and "model:" not in output
    # A run config.toml that does not parse (another nanoq version's, say) is passed over with a warning: a
    # causal model is scored causally, in windows of the defaults.
    with open(os.path.join(single.run_dir, "config.toml"), "w") as f:
        f.write("[train]\nno_such_setting = 1\n")
    again, output = loss(single.run_dir)
    assert again == got and "warning: the windows are cut by the options and defaults, not by the model's run: " \
        f"{os.path.join(single.run_dir, 'config.toml')}: unknown key 'train.no_such_setting'" in output, output


def test_more_steps_after_a_finished_run_continue_it_exactly(tmp_path):
    # A constant schedule does not depend on train.steps, so 8 then 4 more equals 12 at once.
    _, expected = straight_run(tmp_path, schedule="constant")
    train(config(tmp_path, steps=8, schedule="constant"), **QUIET)
    result = train(config(tmp_path, steps=12, schedule="constant"), resume="auto", **QUIET)
    assert losses_after_resume(result.run_dir) == {step: expected[step] for step in range(9, 13)}
    (resume,) = records(result.run_dir, "resume")
    assert resume["changes"] == {"train.steps": [8, 12]}
    assert result.model_dir == os.path.join(result.run_dir, "model-step12")  # the 8-step model is kept
    assert os.path.isdir(os.path.join(result.run_dir, "model"))
    assert read_state(os.path.join(result.run_dir, "checkpoints"))["step"] == 12
    assert "steps = 12" in open(os.path.join(result.run_dir, "config.toml")).read()


def test_resuming_on_two_devices_matches_one_device(tmp_path):
    _, expected = straight_run(tmp_path)
    with pytest.raises(Interrupt):
        train(config(tmp_path), say=stop_after_checkpoint(8), progress=False)
    # The same global batch of 4 rows, now as 2 devices x 2 rows.
    result = train(config(tmp_path, devices=2, batch_size=2), resume="auto", **QUIET)
    resumed = losses_after_resume(result.run_dir)
    assert sorted(resumed) == [9, 10, 11, 12]
    assert [resumed[step] for step in range(9, 13)] == pytest.approx([expected[s] for s in range(9, 13)],
                                                                     rel=1e-5, abs=1e-5)
    (resume,) = records(result.run_dir, "resume")
    assert resume["devices"] == 2
    assert resume["changes"] == {"train.batch_size": [4, 2], "run.devices": [1, 2]}


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=64), "model.hidden_size: checkpoint 32, now 64"),
    (dict(seq_len=8, num_hidden_layers=3), "model.num_hidden_layers: checkpoint 2, now 3\n  data.seq_len: "
                                           "checkpoint 16, now 8"),
    (dict(seed=1), "train.seed: checkpoint 0, now 1"),
])
def test_a_model_or_data_change_is_refused_and_leaves_the_run_untouched(tmp_path, change, message):
    first = train(config(tmp_path, steps=8), **QUIET)
    before = snapshot(first.run_dir)
    with pytest.raises(ValueError) as error:
        train(config(tmp_path, steps=12, **change), resume="auto", **QUIET)
    assert "define the model or the data stream" in str(error.value) and message in str(error.value)
    assert "--resume" in str(error.value)
    assert snapshot(first.run_dir) == before


def test_an_applied_change_is_reported_on_the_console_and_in_the_log(tmp_path):
    train(config(tmp_path, steps=8, schedule="constant"), **QUIET)
    lines = []
    result = train(config(tmp_path, steps=10, schedule="constant", lr=2e-2, keep_last=1), resume="auto",
                   say=lines.append, progress=False)
    (resume,) = records(result.run_dir, "resume")
    assert resume["changes"] == {"train.steps": [8, 10], "train.lr": [0.01, 0.02], "checkpoint.keep_last": [2, 1]}
    assert "  changed since the checkpoint: train.lr 0.01 -> 0.02" in lines
    assert [r["lr"] for r in records(result.run_dir, "train")[8:]] == [0.02, 0.02]
    assert list_checkpoints(os.path.join(result.run_dir, "checkpoints")) == [10]  # keep_last 1 applies


def test_resume_auto_without_a_checkpoint_starts_fresh(tmp_path):
    lines = []
    result = train(config(tmp_path, steps=4, run_name=""), resume="auto", say=lines.append, progress=False)
    assert f"--resume auto: no run in {tmp_path / 'runs'} has a checkpoint, starting a fresh run" in lines
    assert result.resumed_from is None and [r["type"] for r in records(result.run_dir)][0] == "start"
    lines.clear()
    result = train(config(tmp_path, steps=4, run_name="named"), resume="auto", say=lines.append, progress=False)
    assert result.resumed_from is None and result.run_dir == str(tmp_path / "runs" / "named")
    assert any("does not exist yet, starting it" in line for line in lines)


def test_resume_auto_without_a_run_name_takes_the_newest_run_with_a_checkpoint(tmp_path):
    train(config(tmp_path, steps=4, run_name="older"), **QUIET)
    train(config(tmp_path, steps=4, run_name="newer"), **QUIET)
    train(config(tmp_path, steps=4, run_name="no-checkpoints", checkpoint_every=0), **QUIET)
    result = train(config(tmp_path, steps=8, run_name=""), resume="auto", **QUIET)
    assert result.run_dir == str(tmp_path / "runs" / "newer")
    assert result.resumed_from.endswith("step_00000004")
    assert "run_name = \"newer\"" in open(os.path.join(result.run_dir, "config.toml")).read()


def test_resume_errors_say_what_is_wrong(tmp_path):
    train(config(tmp_path, steps=4, run_name="plain", checkpoint_every=0), **QUIET)
    with pytest.raises(ValueError, match="exists but holds no checkpoint"):
        train(config(tmp_path, steps=8, run_name="plain"), resume="auto", **QUIET)
    with pytest.raises(ValueError, match="the run has no checkpoints"):
        train(config(tmp_path, steps=8), resume=str(tmp_path / "runs" / "plain"), **QUIET)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        train(config(tmp_path), resume=str(tmp_path / "nowhere"), **QUIET)
    run = train(config(tmp_path, steps=8), **QUIET).run_dir
    with pytest.raises(ValueError, match=r"at step 8, past train\.steps 6"):
        train(config(tmp_path, steps=6), resume=run, **QUIET)
    with pytest.raises(ValueError, match=r"holds a later checkpoint \(step 8\)"):
        train(config(tmp_path), resume=os.path.join(run, "checkpoints", "step_00000004"), **QUIET)
    # A step directory copied out of its run: the folder above would be taken for the run's.
    import shutil

    copied = shutil.copytree(os.path.join(run, "checkpoints", "step_00000008"), tmp_path / "backup" / "step_00000008")
    with pytest.raises(ValueError, match="a step directory is resumed inside its run"):
        train(config(tmp_path), resume=str(copied), **QUIET)
    assert sorted(os.listdir(tmp_path)) == ["backup", "data", "runs"]  # no lock, log or config put beside it


def test_resume_takes_the_newest_checkpoint_even_if_latest_was_not_updated(tmp_path):
    run = train(config(tmp_path, steps=8), **QUIET).run_dir
    # A save killed between its rename and the update of `latest` leaves it naming the previous step.
    open(os.path.join(run, "checkpoints", "latest"), "w").write("step_00000004\n")
    assert read_state(os.path.join(run, "checkpoints"))["step"] == 8  # load_checkpoint(root), generate, eval
    result = train(config(tmp_path, steps=8), resume="auto", **QUIET)
    assert result.resumed_from == os.path.join(run, "checkpoints", "step_00000008")


def test_resuming_a_finished_run_unchanged_does_nothing_and_names_its_model(tmp_path):
    first = train(config(tmp_path, steps=8), **QUIET)
    before = snapshot(first.run_dir)
    lines = []
    again = train(config(tmp_path, steps=8, lr=5e-3), resume=os.path.join(first.run_dir, "checkpoints"),
                  say=lines.append, progress=False)
    # Nothing trained, evaluated or written: the run directory is byte for byte as the finish left it
    # (a requeued job's `nanoq train --resume auto` must not pile up copies of the model).
    assert snapshot(first.run_dir) == before
    assert f"{first.run_dir} finished at step 8 already: nothing to train (give train.steps above 8, --steps N, " \
           f"to train on)" in lines and f"model: {first.model_dir}" in lines
    assert again.model_dir == first.model_dir and again.steps == 8 and again.parameters == first.parameters
    assert again.final_eval_loss == first.final_eval_loss and again.final_train_loss == first.final_train_loss
    assert again.evals == first.evals and again.resumed_from == os.path.join(first.run_dir, "checkpoints",
                                                                               "step_00000008")
    # Its model gone, the resume writes it again (after evaluating the step once more).
    import shutil

    shutil.rmtree(first.model_dir)
    third = train(config(tmp_path, steps=8), resume="auto", **QUIET)
    assert third.model_dir == first.model_dir and os.path.isfile(os.path.join(third.model_dir, "model.safetensors"))
    assert third.final_eval_loss == first.final_eval_loss
    log = records(first.run_dir)
    assert [r["type"] for r in log[log.index(records(first.run_dir, "resume")[0]):]] == ["resume", "eval", "end"]
    # Moved with its model, the run is still found finished there; with more steps it trains on.
    moved = shutil.move(first.run_dir, tmp_path / "elsewhere")
    assert train(config(tmp_path, steps=8), resume=moved, **QUIET).model_dir == os.path.join(moved, "model")
    longer = train(config(tmp_path, steps=10), resume=moved, **QUIET)
    assert longer.model_dir == os.path.join(moved, "model-step10") and longer.steps == 10


def test_resuming_a_finished_run_whose_checkpoint_is_the_model_takes_that_checkpoint(tmp_path):
    # Learned positions: transformers cannot compute the model, so the final checkpoint is the model.
    first = train(config(tmp_path, steps=8, position_embedding="learned"), **QUIET)
    assert first.model_dir == os.path.join(first.run_dir, "checkpoints", "step_00000008")
    again = train(config(tmp_path, steps=8, position_embedding="learned"), resume=first.run_dir, **QUIET)
    assert again.model_dir == first.model_dir and again.final_eval_loss == first.final_eval_loss


def test_resuming_from_an_older_step_sets_a_damaged_later_one_aside(tmp_path):
    run = train(config(tmp_path, steps=8), **QUIET).run_dir
    checkpoints = os.path.join(run, "checkpoints")
    os.truncate(os.path.join(checkpoints, "step_00000008", "part-00000-of-00001.safetensors"), 100)
    lines = []
    result = train(config(tmp_path, steps=12), resume=os.path.join(checkpoints, "step_00000004"),
                   say=lines.append, progress=False)
    # Found before training (not at step 8's save, with steps 5-8 trained and lost).
    warning = next(line for line in lines if "setting aside the damaged later checkpoint" in line)
    assert lines.index(warning) < lines.index(next(line for line in lines if line.startswith("resuming from")))
    assert result.steps == 12 and list_checkpoints(checkpoints)[-1] == 12
    assert [name for name in os.listdir(checkpoints) if name.startswith("step_00000008.corrupt-")]


def test_a_checkpoint_of_a_newer_format_is_refused_and_never_set_aside(tmp_path):
    run = train(config(tmp_path, steps=8), **QUIET).run_dir
    checkpoints = os.path.join(run, "checkpoints")
    state_file = os.path.join(checkpoints, "step_00000008", "trainer_state.json")
    state = json.load(open(state_file))
    json.dump(dict(state, format_version=99), open(state_file, "w"))
    for resume in ("auto", run, os.path.join(checkpoints, "step_00000004")):
        with pytest.raises(NewerFormatError, match="format version 99, written by a newer nanoq"):
            train(config(tmp_path, steps=12), resume=resume, **QUIET)
    with pytest.raises(NewerFormatError, match="upgrade nanoq"):
        read_state(checkpoints)  # not the older step 4 in its place
    assert sorted(name for name in os.listdir(checkpoints) if name.startswith("step_")) == \
        ["step_00000004", "step_00000008"]


def test_config_toml_is_replaced_whole_on_resume(tmp_path, monkeypatch):
    run = train(config(tmp_path, steps=8), **QUIET).run_dir
    before = open(os.path.join(run, "config.toml")).read()

    fsync = os.fsync

    def disk_full(fd):  # the disk fills while the new config.toml is written
        if "config.toml" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(28, "No space left on device")
        fsync(fd)
    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        train(config(tmp_path, steps=12), resume=run, **QUIET)
    monkeypatch.undo()
    assert open(os.path.join(run, "config.toml")).read() == before
    assert not [name for name in os.listdir(run) if ".partial-" in name]


def test_checkpoints_are_logged_and_rotated_as_configured(tmp_path):
    lines = []
    result = train(config(tmp_path, steps=11, checkpoint_every=2, keep_last=2, keep_every=4), say=lines.append,
                   progress=False)
    root = os.path.join(result.run_dir, "checkpoints")
    assert [r["step"] for r in records(result.run_dir, "checkpoint")] == [2, 4, 6, 8, 10, 11]
    assert list_checkpoints(root) == [4, 8, 10, 11]  # the newest 2, and every 4th
    assert f"checkpoint @ step 11: {os.path.join(root, 'step_00000011')}" in "\n".join(lines)
    extra = read_state(root)["extra_state"]
    assert extra["step"] == 11 and extra["tokens"] == 11 * 4 * 16 * 2
    assert [step for step, _ in extra["evals"]] == [0, 4, 8]  # the final eval (11) comes after the save
    assert extra["config"]["model"]["hidden_size"] == 32 and extra["data_loader"]["kind"] == "DataLoader"
    off = train(config(tmp_path, steps=2, run_name="off", checkpoint_every=0), **QUIET)
    assert not os.path.exists(os.path.join(off.run_dir, "checkpoints"))


# -- the command line ------------------------------------------------------------------

def cli_args(tmp_path, *extra):
    train_data, eval_data = write_data(tmp_path / "data")
    flags = dict(TINY, train_data=train_data, eval_data=eval_data, out_dir=tmp_path / "runs", run_name="cli")
    args = ["train"]
    for name, value in flags.items():
        args += [f"--{name}", str(value)]
    return args + [str(a) for a in extra]


def invoke(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_cli_resume_continues_with_more_steps_and_refuses_a_model_change(tmp_path):
    _, expected = straight_run(tmp_path, schedule="constant")
    result = invoke(cli_args(tmp_path, "--schedule", "constant", "--steps", "8"))
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / "cli"

    result = invoke(cli_args(tmp_path, "--schedule", "constant", "--steps", "12", "--hidden_size", "64", "--resume"))
    assert result.exit_code == 1
    assert "model.hidden_size: checkpoint 32, now 64" in result.output

    result = invoke(cli_args(tmp_path, "--schedule", "constant", "--steps", "12", "--resume", run))
    assert result.exit_code == 0, result.output
    assert f"resuming from {run / 'checkpoints' / 'step_00000008'} at step 8" in result.output
    step8 = run / "checkpoints" / "step_00000008"
    size = sum(os.path.getsize(step8 / name) for name in os.listdir(step8) if name != "trainer_state.json")
    assert f"verifying {step8} ({human_bytes(size)})" in result.output  # before a long read, what it reads
    assert "changed since the checkpoint: train.steps 8 -> 12" in result.output
    assert losses_after_resume(run) == {step: expected[step] for step in range(9, 13)}
    assert json.loads(open(run / "log.jsonl").readlines()[-1])["model_dir"] == str(run / "model-step12")


def test_cli_resume_of_a_run_directory_alone_takes_the_runs_own_settings(tmp_path):
    _, expected = straight_run(tmp_path, schedule="constant")
    assert invoke(cli_args(tmp_path, "--schedule", "constant", "--steps", "8")).exit_code == 0
    run = tmp_path / "runs" / "cli"
    # Before, the defaults stood in for the run's settings: "cannot resume ... data.train_data: checkpoint ...".
    for where in (run, run / "checkpoints"):
        result = invoke(["train", "--resume", str(where), "--steps", "10" if where == run else "12"])
        assert result.exit_code == 0, result.output
        assert f"settings: {run / 'config.toml'} (the run's own; flags change them)" in result.output
    assert losses_after_resume(run) == {step: expected[step] for step in range(11, 13)}


def test_cli_resume_followed_by_a_config_file_is_a_usage_error(tmp_path):
    toml = tmp_path / "my.toml"
    toml.write_text("[train]\nsteps = 3\n")
    result = invoke(["train", "--resume", str(toml)])
    assert result.exit_code == 2 and "put CONFIG.toml first" in result.output


def test_cli_resume_auto_without_a_config_file_takes_the_runs_own_settings(tmp_path):
    _, expected = straight_run(tmp_path, schedule="constant")
    assert invoke(cli_args(tmp_path, "--schedule", "constant", "--steps", "8")).exit_code == 0
    run = tmp_path / "runs" / "cli"
    # Before, the defaults stood in for the run's settings and the resume was refused.
    result = invoke(["train", "--resume", "--out_dir", str(tmp_path / "runs"), "--steps", "12"])
    assert result.exit_code == 0, result.output
    assert f"settings: {run / 'config.toml'} (the run's own; flags change them)" in result.output
    assert f"resuming from {run / 'checkpoints' / 'step_00000008'} at step 8" in result.output
    assert losses_after_resume(run) == {step: expected[step] for step in range(9, 13)}
    # The flags apply to the run's settings, not to the defaults: offloading gradients needs the run's stage 2.
    args = cli_args(tmp_path, "--zero_stage", "2", "--steps", "2", "--warmup_steps", "1")
    args[args.index("--run_name") + 1] = "stage2"
    assert invoke(args).exit_code == 0
    result = invoke(["train", "--resume", "--out_dir", str(tmp_path / "runs"), "--run_name", "stage2", "--steps", "3",
                     "--offload", "gradients"])
    assert result.exit_code == 0, result.output
    assert "changed since the checkpoint: run.offload '' -> 'gradients'" in result.output
    # A named run with no checkpoint is refused before anything starts, as before.
    (tmp_path / "runs" / "empty").mkdir()
    result = invoke(["train", "--resume", "auto", "--out_dir", str(tmp_path / "runs"), "--run_name", "empty"])
    assert result.exit_code == 1 and "exists but holds no checkpoint" in result.output


def test_the_readme_lists_the_settings_a_resume_must_keep():
    import re

    from nanoq.training.resume import FIXED_ON_RESUME

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    sentence = re.search(r"settings that define the model or the data stream\s*\((.*?)\) must match", readme, re.S)
    assert sentence, "README: the resume section's list of settings that must match"
    listed = set(re.findall(r"`([^`]+)`", sentence.group(1)))
    expected = {f"[{key[:-2]}]" if key.endswith(".*") else key for key in FIXED_ON_RESUME}
    assert listed == expected


def base_model(directory, seed):
    """A Hugging Face folder of TINY's architecture (vocab 64), weights drawn from ``seed``."""
    import nanoq

    model = nanoq.ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2)
    with nanoq.Trainer(model, nanoq.TrainOptions(backend="cpu", batch_size=1, seq_len=16, seed=seed)) as trainer:
        return trainer.export_model(directory)


@pytest.mark.parametrize("lora", [False, True])
def test_a_moved_init_from_model_is_taken_on_resume_when_it_holds_the_same_weights(tmp_path, lora):
    # The model a run started from moved: resuming named only the missing folder, and the
    # new place was refused as a change of model.init_from, a dead end. Now the new place
    # is taken when it holds the same model (architecture, and weights by the fingerprint
    # the checkpoint recorded); another model is refused.
    base = base_model(tmp_path / "base", seed=1)
    more = dict(lora_rank=4, lora_alpha=8.0, schedule="constant") if lora else dict(schedule="constant")
    train(config(tmp_path, steps=4, init_from=base, **more), **QUIET)
    moved = str(tmp_path / "base.moved")
    os.rename(base, moved)
    with pytest.raises(ValueError, match=r"model\.init_from .*/base holds no config\.json \(moved or deleted\?\); "
                                         r"if the model moved, resume with its new place"):
        train(config(tmp_path, steps=6, init_from=base, **more), resume="auto", **QUIET)
    with pytest.raises(ValueError, match=r"model\.init_from: checkpoint '.*/base', now ''"):  # dropped: refused
        train(config(tmp_path, steps=6, **more), resume="auto", **QUIET)
    other = base_model(tmp_path / "other", seed=2)  # the same architecture, other weights
    with pytest.raises(ValueError, match="its weights are not the ones .*/base held when the checkpoint was saved"):
        train(config(tmp_path, steps=6, init_from=other, **more), resume="auto", **QUIET)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "adapters trained on another base" warning for a moved base
        result = train(config(tmp_path, steps=6, init_from=moved, **more), resume="auto", **QUIET)
    resumes = records(result.run_dir, "resume")
    assert resumes[-1]["changes"] == {"model.init_from": [base, moved], "train.steps": [4, 6]}
    # Straight through from the moved base: the same losses (LoRA's frozen weights are the base's).
    straight = train(config(tmp_path, steps=6, init_from=moved, run_name="straight", **more), **QUIET)
    assert [r["loss"] for r in records(result.run_dir, "train")] == \
        [r["loss"] for r in records(straight.run_dir, "train")]
    # A checkpoint of an older nanoq records no fingerprint: full weights still resume from the
    # moved base (the checkpoint holds them all), LoRA adapters do not (their base is unproven).
    os.rename(moved, str(tmp_path / "base.again"))
    state_file = os.path.join(result.run_dir, "checkpoints", "step_00000006", "trainer_state.json")
    state = json.load(open(state_file))
    del state["base_model_fingerprint"], state["state_checksum"]  # as written before these existed
    json.dump(state, open(state_file, "w"))
    resume = lambda: train(config(tmp_path, steps=8, init_from=str(tmp_path / "base.again"), **more),  # noqa: E731
                           resume="auto", **QUIET)
    if lora:
        with pytest.raises(ValueError, match="records no fingerprint of the base model"):
            resume()
    else:
        assert resume().steps == 8
    # A run from random weights given a model.init_from on resume: not a move, refused as before.
    train(config(tmp_path, steps=2, run_name="scratch", **more), **QUIET)
    with pytest.raises(ValueError, match=r"model\.init_from: checkpoint '', now '.*base\.again'"):
        train(config(tmp_path, steps=4, run_name="scratch", init_from=str(tmp_path / "base.again"), **more),
              resume="auto", **QUIET)


def test_a_warmup_cut_short_and_done_is_not_started_again_by_more_steps(tmp_path):
    # 5 steps with the default 20-step warmup warm up over all 5 (with a warning). Resumed to 15
    # steps, the warmup would become 15: the rate fell from the peak reached back to 8e-4 and
    # warmed up again. The warmup done is kept; the schedule then decays over the new steps.
    from nanoq.training.lr_schedule import learning_rate

    settings = dict(steps=5, warmup_steps=20, lr=2e-3, schedule="cosine", checkpoint_every=5)
    lines = []
    train(config(tmp_path, **settings), say=lines.append, progress=False)
    assert any("train.warmup_steps (20) is longer than the run's train.steps (5)" in line for line in lines)
    lines.clear()
    result = train(config(tmp_path, **dict(settings, steps=15)), resume="auto", say=lines.append, progress=False)
    rates = [r["lr"] for r in records(result.run_dir, "train")]
    expected = [learning_rate(s, kind="cosine", peak=2e-3, total_steps=5, warmup_steps=5) for s in range(5)] + \
        [learning_rate(s, kind="cosine", peak=2e-3, total_steps=15, warmup_steps=5) for s in range(5, 15)]
    assert rates == pytest.approx(expected, rel=1e-12)
    assert rates[5] == pytest.approx(2e-3) and all(a >= b for a, b in zip(rates[5:], rates[6:]))
    assert any("train.warmup_steps (20) was cut to the run's first 5 steps, and that warmup is done" in line
               for line in lines)
    assert not any("is longer than the run's" in line for line in lines)
    # A warmup_steps given anew on resume is taken as asked.
    again = train(config(tmp_path, **dict(settings, steps=20, warmup_steps=18)), resume="auto", **QUIET)
    rates = [r["lr"] for r in records(again.run_dir, "train")][-5:]
    assert rates == pytest.approx([learning_rate(s, kind="cosine", peak=2e-3, total_steps=20, warmup_steps=18)
                                   for s in range(15, 20)], rel=1e-12)


def test_a_signal_during_an_evaluation_stops_before_the_next_step_and_the_resume_does_not_repeat_it(
        tmp_path, monkeypatch):
    # A Ctrl-C during the evaluation before step 1 let the evaluation finish and then trained a
    # step before stopping. Now it stops there, with a checkpoint of step 0 holding that
    # evaluation, which the resumed run does not run again.
    import signal

    from nanoq.training import loop

    straight, _ = straight_run(tmp_path, steps=8)
    evaluate = loop.evaluate
    calls = []

    def interrupted_evaluate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # handled in this thread before evaluate returns
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", interrupted_evaluate)
    stopped = train(config(tmp_path, steps=8), **QUIET)
    assert stopped.stopped_by == "SIGINT" and stopped.steps == 0
    assert records(stopped.run_dir, "train") == []
    (record,) = records(stopped.run_dir, "stopped")
    assert record["step"] == 0 and read_state(record["checkpoint"])["step"] == 0
    monkeypatch.setattr(loop, "evaluate", evaluate)
    result = train(config(tmp_path, steps=8), resume="auto", **QUIET)
    assert result.evals == straight.evals  # step 0's once, then 4 and 8
    assert [r["loss"] for r in records(result.run_dir, "train")] == \
        [r["loss"] for r in records(straight.run_dir, "train")]
