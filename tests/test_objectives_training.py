"""Nano's training objectives through nanoq train (issue 19 item 2): seq2seq
and denoise batches as Nano defines them, learning a toy task, exact resume,
the mask token, and the settings' rules."""
import json

import numpy as np
import pytest

from nanoq.data import DataLoader, Dataset, EvalLoader, write_tokens
from nanoq.data.objectives import IGNORE_INDEX
from nanoq.training import TrainConfig, read_log, train

T = 8
VOCAB = 32
MASK = 31


def sorting_windows(path, count, seed=0):
    """Nano's sorting toy task: each 2T-token line is T digits, then them sorted."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 11, size=(count, T))
    write_tokens(path, np.concatenate([x, np.sort(x, axis=1)], axis=1).reshape(-1), VOCAB)
    return x


def config(tmp_path, objective, **more):
    values = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, seq_len=T,
                  batch_size=16, backend="cpu", threads=1, steps=60, warmup_steps=0, lr=3e-3, schedule="constant",
                  train_data=str(tmp_path / "train.bin"), eval_data=str(tmp_path / "eval.bin"), eval_every=0,
                  eval_batches=0, sample_every=0, checkpoint_every=0, out_dir=str(tmp_path / "runs"),
                  run_name=objective, causal=False, objective=objective)
    return TrainConfig(**{**values, **more})


def test_seq2seq_batches_are_nanos_halves_of_each_line(tmp_path):
    x = sorting_windows(tmp_path / "train.bin", 20)
    dataset = Dataset(str(tmp_path / "train.bin"), T, objective="seq2seq")
    assert dataset.num_windows == 20 and dataset.window_step == 2 * T
    inputs, targets = dataset.read_windows(np.arange(20))
    np.testing.assert_array_equal(inputs, x)               # Nano: x = ids[0:T]
    np.testing.assert_array_equal(targets, np.sort(x, 1))  # Nano: y = ids[T:2T]


def test_seq2seq_learns_to_sort_with_a_bidirectional_model(tmp_path):
    sorting_windows(tmp_path / "train.bin", 512, seed=1)
    sorting_windows(tmp_path / "eval.bin", 32, seed=2)
    result = train(config(tmp_path, "seq2seq", steps=150), say=lambda line: None, progress=False)
    evals = [loss for _, loss in result.evals]
    # Sorting needs every input position: the loss falls far below the ~ln 10
    # of guessing among the digits (a causal model could not see the later digits).
    assert evals[-1] < 0.6 * np.log(10), evals
    assert result.model_dir.endswith("step_00000150")  # bidirectional: the model is the final checkpoint


def test_denoise_batches_mask_a_ratio_drawn_per_window_and_restore_the_original(tmp_path):
    tokens = np.arange(1, 1 + 64 * T) % (VOCAB - 1)
    write_tokens(tmp_path / "train.bin", tokens, VOCAB)
    dataset = Dataset(str(tmp_path / "train.bin"), T, objective="denoise", mask_token=MASK)
    assert dataset.num_windows == 64 and dataset.window_step == T
    loader = DataLoader(dataset, batch_rows=64, seed=5)
    inputs, targets = loader.next_batch()
    order = np.random.default_rng([5, 0]).permutation(64)  # the loader's documented epoch order
    np.testing.assert_array_equal(targets, tokens.reshape(64, T)[order])  # the target is the original
    masked = inputs == MASK
    np.testing.assert_array_equal(inputs[~masked], targets[~masked])
    assert 0 < masked.mean() < 1 and len({row.sum() for row in masked}) > 3  # ratios differ per window
    # Layout-independent: two parts of the batch are the two halves of it.
    halves = [DataLoader(dataset, batch_rows=64, seed=5, part=(p, 2)).next_batch()[0] for p in (0, 1)]
    np.testing.assert_array_equal(np.concatenate(halves), inputs)
    # The next epoch draws again; an evaluation draws the same each time.
    for _ in range(1):
        again = loader.next_batch()[0]
    assert not np.array_equal(again[np.argsort(np.random.default_rng([5, 1]).permutation(64))],
                              inputs[np.argsort(order)])
    evaluation = EvalLoader(dataset, batch_rows=64, seed=5)
    np.testing.assert_array_equal(next(iter(evaluation))[0], next(iter(evaluation))[0])


def test_denoise_sft_masks_ignore_the_untrained_targets(tmp_path):
    tokens = np.arange(4 * T) % 30 + 1
    mask = np.tile([False, True], 2 * T)
    write_tokens(tmp_path / "train.bin", tokens, VOCAB, mask)
    _, targets = Dataset(str(tmp_path / "train.bin"), T, objective="denoise", mask_token=MASK).read_windows([0])
    np.testing.assert_array_equal(targets[0], np.where(mask[:T], tokens[:T], IGNORE_INDEX))


def test_a_denoise_run_resumes_exactly(tmp_path):
    sorting_windows(tmp_path / "train.bin", 64)
    sorting_windows(tmp_path / "eval.bin", 8, seed=3)
    common = dict(steps=6, mask_token=str(MASK), checkpoint_every=3, eval_every=3, seq_len=2 * T)
    whole = train(config(tmp_path, "denoise", **common), say=lambda line: None, progress=False)
    cut = config(tmp_path, "denoise", run_name="cut", **dict(common, steps=3))
    train(cut, say=lambda line: None, progress=False)
    resumed = train(config(tmp_path, "denoise", run_name="cut", **common), resume=str(tmp_path / "runs" / "cut"),
                    say=lambda line: None, progress=False)

    def losses(path):
        return [(r["step"], r["loss"]) for r in read_log(path) if r["type"] in ("train", "eval")]

    assert losses(resumed.log_path)[-4:] == losses(whole.log_path)[-4:]
    assert resumed.evals == whole.evals


def test_the_mask_token_comes_from_the_tokenizer_or_is_asked_for(tmp_path):
    from tokenizers import Tokenizer, models

    write_tokens(tmp_path / "train.bin", np.arange(1, 1 + 16 * T) % 20, VOCAB)
    run = config(tmp_path, "denoise", eval_data="", steps=1)
    with pytest.raises(ValueError, match="data has no tokenizer .* give the mask token's id"):
        train(run, say=lambda line: None, progress=False)
    vocab = {f"t{i}": i for i in range(30)} | {"<mask>": 30}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    assert train(run, say=lambda line: None, progress=False).steps == 1  # found <mask>
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"mask_token": "t29"}))
    dataset = Dataset(str(tmp_path / "train.bin"), T, objective="denoise", mask_token=29)
    from nanoq.tokenization.tokenizer import find_mask_id
    assert find_mask_id(str(tmp_path)) == 29 and find_mask_id(str(tmp_path), "<mask>") == 30
    assert find_mask_id(None, "7") == 7 and dataset.mask_token == 29
    with pytest.raises(ValueError, match="not in the vocabulary"):
        find_mask_id(str(tmp_path), "<nope>")
    # Files tokenized for packing (SFT's tokenize.json): the objective's windows are the stream's under
    # data.packing auto, as its help says (it was "packing pack is for the causal objective").
    (tmp_path / "tokenize.json").write_text(json.dumps({"packing": "pack"}))
    assert Dataset(str(tmp_path / "train.bin"), T, objective="causal", packing="auto", eos_id=0).packing == "pack"
    assert Dataset(str(tmp_path / "train.bin"), T, objective="denoise", mask_token=29, packing="auto").packing == \
        "stream"
    assert train(config(tmp_path, "denoise", eval_data="", steps=1, run_name="sft-files"), say=lambda line: None,
                 progress=False).steps == 1
    # A token's text is taken as written (" t5" was taken for "t5"); an id may have spaces around it.
    with pytest.raises(ValueError, match="mask token ' t5' is not in the vocabulary"):
        find_mask_id(str(tmp_path), " t5")
    assert find_mask_id(str(tmp_path), " 7 ") == 7 and find_mask_id(str(tmp_path), "  ") == 29
    with pytest.raises(ValueError, match=r"mask token .*id 40.* outside the model's vocabulary \[0, 32\)"):
        train(config(tmp_path, "denoise", eval_data="", steps=1, mask_token="40", run_name="big"),
              say=lambda line: None, progress=False)


@pytest.mark.parametrize("fields,message", [
    (dict(objective="seq2seq", causal=True), "train.objective seq2seq trains a bidirectional model"),
    (dict(objective="causal", causal=False), "would let each position see the token it predicts"),
    (dict(objective="causal", causal=True, mask_token="3"), "data.mask_token is for train.objective denoise"),
    (dict(objective="seq2seq", causal=False, window_step=9), r"data.window_step must be 0 or 16"),
    (dict(objective="denoise", causal=False, packing="pack"), "data.packing pack is for causal models"),
    # (Not an objective's rule, but one of TrainConfig's: run_name="../../escape" made a run outside out_dir.)
    (dict(run_name="../../escape"), r"run\.run_name must be a folder name, .* got '\.\./\.\./escape'"),
    (dict(run_name="a/b"), r"run\.run_name must be a folder name"),
    (dict(run_name=".."), r"run\.run_name must be a folder name"),
])
def test_objective_settings_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(seq_len=8, **fields)


@pytest.mark.parametrize("objective", ["seq2seq", "denoise"])
def test_nanoq_eval_scores_a_bidirectional_model_by_its_runs_objective(tmp_path, objective):
    # nanoq eval of a seq2seq or denoise run must give the loss the run's own evaluation gave
    # (its windows, targets and, for denoise, masks drawn from the run's seed), not next-token
    # targets, which such a model was never trained for.
    import shutil

    from click.testing import CliRunner

    from nanoq_cli.main import cli

    sorting_windows(tmp_path / "train.bin", 64)
    sorting_windows(tmp_path / "eval.bin", 8, seed=3)
    more = dict(mask_token=str(MASK)) if objective == "denoise" else {}
    result = train(config(tmp_path, objective, steps=6, eval_every=6, seq_len=2 * T, seed=5, **more),
                   say=lambda line: None, progress=False)
    (trained,) = [r["loss"] for r in read_log(result.log_path) if r["type"] == "eval" and r["step"] == 6]

    def evaluate(model, *args):
        output = CliRunner().invoke(cli, ["eval", str(model), "--data", str(tmp_path / "eval.bin"), "--backend", "cpu",
                                          "--batch-size", "16", "--json", *map(str, args)])
        return output.exit_code, output.output

    for model in (result.run_dir, result.model_dir, f"{result.run_dir}/checkpoints"):
        code, output = evaluate(model)
        assert code == 0, output
        assert json.loads(output)["loss"] == pytest.approx(trained, rel=1e-5)
    # A copy outside the run is told what it was trained for.
    shutil.copytree(result.model_dir, tmp_path / "elsewhere")
    code, output = evaluate(tmp_path / "elsewhere")
    assert code == 1 and "bidirectional (denoising) model from no nanoq run: give --objective" in output
    code, output = evaluate(tmp_path / "elsewhere", "--objective", "causal")
    assert code == 1 and "--objective causal does not fit" in output
    given = ["--objective", objective] + (["--mask-token", MASK, "--seed", 5] if objective == "denoise" else [])
    code, output = evaluate(tmp_path / "elsewhere", *given)
    assert code == 0, output
    assert json.loads(output)["loss"] == pytest.approx(trained, rel=1e-5)
    if objective == "denoise":  # the masks drawn matter: another seed scores other windows
        code, output = evaluate(tmp_path / "elsewhere", *given[:-1], 6)
        assert code == 0 and json.loads(output)["loss"] != pytest.approx(trained, rel=1e-5)
    else:
        code, output = evaluate(result.run_dir, "--seed", 1)
        assert code == 1 and "--mask-token and --seed are for --objective denoise" in output
