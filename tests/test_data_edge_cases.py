"""Data edge cases (issue 17, item 7): steps without counted tokens, eval
files from another tokenizer, token ids past the header's vocab (llm.q's
added EOS), windows that step by seq_len (and resumes of runs from before),
and the modes of exported files. CPU only, tiny models and files."""
import dataclasses
import hashlib
import json
import os
import re
import struct

import numpy as np
import pytest

import nanoq
from nanoq.data import DataLoader, Dataset, TokenFile, write_tokens
from nanoq.training import TrainConfig, train
from nanoq.training.log import read_log

QUIET = dict(say=lambda line: None, progress=False)
MODEL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SEQ = 16
ROWS = 4


def make_trainer(devices=2, vocab=96):
    options = nanoq.TrainOptions(backend="cpu", devices=devices, batch_size=ROWS // devices, seq_len=SEQ, seed=0,
                                 threads=1)
    return nanoq.Trainer(nanoq.ModelConfig(vocab_size=vocab, **MODEL), options)


def counted_batch(step, vocab=96):
    tokens = np.random.default_rng(step).integers(0, vocab, (ROWS, SEQ + 1), dtype=np.int32)
    return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])


HYPER = dict(lr=1e-2, weight_decay=0.1, grad_clip=1.0)


def llmq_file(path, tokens, header_vocab):
    """A token file as llm.q's tokenizer writes it (no mask), built without
    nanoq: its ids may pass the header's vocab, as llm.q's added EOS does."""
    tokens = np.asarray(tokens, dtype="<i4")
    header = b"BIN.TOK\n" + struct.pack("<5i", 2, 4, tokens.size, header_vocab, 0)
    with open(path, "wb") as f:
        f.write(header + bytes(1024 - len(header)) + tokens.tobytes())
    return str(path)


def run_config(tmp_path, **overrides):
    values = dict(MODEL, seq_len=SEQ, batch_size=2, grad_accum=1, steps=2, warmup_steps=0, lr=1e-2, eval_every=0,
                  eval_batches=0, checkpoint_every=0, backend="cpu", devices=1, threads=1,
                  out_dir=str(tmp_path / "runs"), run_name="run")
    values.update(overrides)
    return TrainConfig(**values)


def pattern(count, vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, count)


# --------------------------------------------------------------------------
# A step with no counted tokens
# --------------------------------------------------------------------------


def test_a_step_without_counted_tokens_reports_loss_0_and_changes_nothing():
    with make_trainer() as tr, make_trainer() as reference:
        for trainer in (tr, reference):
            trainer.step(*counted_batch(0))
            trainer.update(**HYPER)  # AdamW moments are non-zero now: a zero-gradient step would still move
        weights, state, steps = tr.get_weights(), tr.get_optimizer_state(), tr.optimizer_steps

        inputs, _ = counted_batch(1)
        tr.step(inputs, np.full_like(inputs, -100))
        stats = tr.update(**HYPER)
        assert (stats.loss, stats.tokens, stats.skipped) == (0.0, 0, True)
        assert not any(np.isnan([stats.loss, stats.loss_1k, stats.z_loss, stats.lse_mean, stats.lse_max]))
        assert tr.optimizer_steps == steps
        after = tr.get_weights()
        for name, value in weights.items():
            np.testing.assert_array_equal(after[name], value, err_msg=name)
        after_state = tr.get_optimizer_state()
        for kind, tensors in state.items():
            for name, value in tensors.items():
                np.testing.assert_array_equal(after_state[kind][name], value, err_msg=f"{kind} {name}")

        # The next update is bit for bit that of a trainer that never saw the empty step
        # (the same AdamW step number, so the same bias correction).
        for trainer in (tr, reference):
            trainer.step(*counted_batch(2))
            trainer.update(**HYPER)
        expected = reference.get_weights()
        for name, value in tr.get_weights().items():
            np.testing.assert_array_equal(value, expected[name], err_msg=name)

        validation = tr.validate(inputs, np.full_like(inputs, -100))
        assert (validation.loss, validation.tokens) == (0.0, 0)


def test_a_run_whose_steps_count_no_tokens_finishes_and_logs_them_as_such(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_tokens(data / "train_000000.bin", pattern(400, 64), 64, mask=np.zeros(400, dtype=bool))
    result = train(run_config(tmp_path, train_data=str(data / "train_*.bin"), steps=3, max_skipped_steps=2),
                   **QUIET)
    records = read_log(result.log_path)
    assert [r["loss"] for r in records if r["type"] == "train"] == [0.0, 0.0, 0.0]
    assert [r["trained_tokens"] for r in records if r["type"] == "train"] == [0, 0, 0]
    skipped = [r for r in records if r["type"] == "skipped"]
    assert [r["reason"] for r in skipped] == ["no counted tokens"] * 3
    assert not [r for r in records if r["type"] == "halted"]  # not taken for a diverged run
    assert os.path.isfile(os.path.join(result.model_dir, "model.safetensors"))


# --------------------------------------------------------------------------
# Eval files must share the train files' vocab
# --------------------------------------------------------------------------


def test_eval_files_of_another_vocab_are_refused_naming_both(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_tokens(data / "train_000000.bin", pattern(400, 64), 64)
    write_tokens(data / "eval_000000.bin", pattern(200, 80), 80)
    write_tokens(data / "same_000000.bin", pattern(200, 64, seed=1), 64)
    with pytest.raises(ValueError, match=r"data\.eval_data has vocab size 80 but data\.train_data has 64"):
        train(run_config(tmp_path, train_data=str(data / "train_*.bin"), eval_data=str(data / "eval_*.bin")),
              **QUIET)
    assert not os.path.exists(tmp_path / "runs" / "run")  # refused before any step
    stages = f"{data / 'train_*.bin'}|{data / 'same_*.bin'}@1; {data / 'train_*.bin'}|{data / 'eval_*.bin'}@1"
    with pytest.raises(ValueError, match=r"data\.curriculum stage 2 eval_data has vocab size 80 but "
                                         r"data\.curriculum stage 2 train_data has 64"):
        train(run_config(tmp_path, curriculum=stages, run_name="stages"), **QUIET)
    result = train(run_config(tmp_path, train_data=str(data / "train_*.bin"), eval_data=str(data / "same_*.bin"),
                              run_name="same"), **QUIET)
    assert result.final_eval_loss is not None
    # Nor may a stage's train files, or the files of one set, differ (they trained, the model taking the larger).
    stages = f"{data / 'train_*.bin'}@1; {data / 'eval_*.bin'}@1"
    with pytest.raises(ValueError, match=r"data\.curriculum stage 2 train_data has vocab size 80 but "
                                         r"data\.curriculum stage 1 train_data has 64: the stages' files come from"):
        train(run_config(tmp_path, curriculum=stages, run_name="mixed-stages"), **QUIET)
    (tmp_path / "mixed").mkdir()
    write_tokens(tmp_path / "mixed" / "a.bin", pattern(400, 64), 64)
    write_tokens(tmp_path / "mixed" / "b.bin", pattern(400, 80), 80)
    with pytest.raises(ValueError, match=r"the files of data\.train_data give different vocab sizes in their "
                                         r"headers: 64 \(.*a\.bin\), 80 \(.*b\.bin\); they come from"):
        train(run_config(tmp_path, train_data=str(tmp_path / "mixed" / "*.bin"), run_name="mixed"), **QUIET)
    assert sorted(os.listdir(tmp_path / "runs")) == ["same"]



def test_file_sets_of_two_tokenizers_of_one_vocab_size_are_refused(tmp_path):
    # Two byte-level BPEs of 300 tokens, trained on other text: the vocab-size check passes them,
    # but the same id is other text in each. Train vs eval, and curriculum stages, are compared.
    from nanoq.tokenization import tokenize_files

    rng = np.random.default_rng(0)
    corpora = []
    for name, letters in (("a", "abcdefghijklm"), ("b", "nopqrstuvwxyz")):  # words of other letters: other merges
        words = ["".join(rng.choice(list(letters), rng.integers(2, 7))) for _ in range(3000)]
        corpus = tmp_path / f"{name}.txt"
        corpus.write_text("\n".join(" ".join(words[i:i + 10]) for i in range(0, 3000, 10)) + "\n")
        corpora.append((name, corpus))
    for name, corpus in corpora:
        tokenize_files([corpus], tmp_path / name, split="line", train_tokenizer_vocab=300, eval_fraction=0.1,
                       progress=False)
    assert json.load(open(tmp_path / "a" / "tokenize.json"))["vocab_size"] == \
        json.load(open(tmp_path / "b" / "tokenize.json"))["vocab_size"]
    a, b = (str(tmp_path / name / "train_*.bin") for name in "ab")
    settings = dict(MODEL, vocab_size=300, seq_len=8)
    with pytest.raises(ValueError, match=r"data\.eval_data was tokenized with .*/b/tokenizer\.json, "
                                         r"data\.train_data with .*/a/tokenizer\.json, and their vocabularies "
                                         r"differ"):
        train(run_config(tmp_path, train_data=a, eval_data=str(tmp_path / "b" / "eval_*.bin"), **settings),
              **QUIET)
    assert not os.path.exists(tmp_path / "runs" / "run")
    with pytest.raises(ValueError, match=r"data\.curriculum stage 2 train_data was tokenized with .*/b/"):
        train(run_config(tmp_path, curriculum=f"{a}@1; {b}@1", run_name="stages", **settings), **QUIET)
    # The same tokenizer in another folder is one tokenizer.
    import shutil

    shutil.copytree(tmp_path / "a", tmp_path / "a-copy")
    result = train(run_config(tmp_path, train_data=a, eval_data=str(tmp_path / "a-copy" / "eval_*.bin"),
                              run_name="same", **settings), **QUIET)
    assert result.final_eval_loss is not None


@pytest.fixture(scope="module")
def model_of_vocab_64(tmp_path_factory):
    """A Hugging Face model directory (vocab 64) to start runs from."""
    with make_trainer(devices=1, vocab=64) as trainer:
        return trainer.export_model(str(tmp_path_factory.mktemp("init") / "model"))


def test_init_from_takes_model_dropout_and_refuses_settings_of_another_architecture(tmp_path, model_of_vocab_64):
    from nanoq.training.loop import model_config

    base = nanoq.ModelConfig.from_pretrained(model_of_vocab_64)
    assert model_config(run_config(tmp_path, init_from=model_of_vocab_64), 64) == base
    # Before, every [model] setting was dropped with init_from: the run trained without its dropout.
    assert model_config(run_config(tmp_path, init_from=model_of_vocab_64, dropout=0.25), 64) == \
        dataclasses.replace(base, dropout=0.25)
    for settings, named in ((dict(causal=False, objective="seq2seq"), "model.causal = false"),
                            (dict(linear_bias=True), "model.linear_bias = true"),
                            (dict(position_embedding="learned"), "model.position_embedding = 'learned'")):
        with pytest.raises(ValueError, match=rf"{re.escape(named)} cannot apply to model\.init_from .*: its "
                                             r"config\.json sets the architecture \(causal true"):
            model_config(run_config(tmp_path, init_from=model_of_vocab_64, **settings), 64)


def test_init_from_warns_of_model_sizes_it_sets_otherwise(tmp_path, model_of_vocab_64):
    # The model.init_from folder's config.json sets the sizes: [model] sizes that differ (a converted
    # Nano config's, say) are named rather than dropped in silence; those that agree are not.
    data = tmp_path / "data"
    data.mkdir()
    write_tokens(data / "train_000000.bin", pattern(400, 64), 64)
    lines = []
    result = train(run_config(tmp_path, init_from=model_of_vocab_64, train_data=str(data / "train_*.bin"), steps=1,
                              vocab_size=48, hidden_size=48), say=lines.append, progress=False)
    assert result.final_train_loss is not None
    assert f"warning: model.vocab_size = 48 (its 64), model.hidden_size = 48 (its 32) are not what trains: " \
           f"model.init_from {model_of_vocab_64}'s config.json sets the architecture; leave them out of [model]" \
           in lines, lines
    lines.clear()
    train(run_config(tmp_path, init_from=model_of_vocab_64, train_data=str(data / "train_*.bin"), steps=1,
                     run_name="agreeing"), say=lines.append, progress=False)
    assert not any("not what trains" in line for line in lines), lines


def test_with_init_from_eval_files_may_have_the_models_vocab(tmp_path, model_of_vocab_64):
    data = tmp_path / "data"
    data.mkdir()
    # The train files' header says 63 (a tokenizer's base vocab), the model has 64 rows.
    write_tokens(data / "train_000000.bin", pattern(400, 63), 63)
    write_tokens(data / "eval_000000.bin", pattern(200, 64), 64)
    write_tokens(data / "other_000000.bin", pattern(200, 60), 60)
    result = train(run_config(tmp_path, init_from=model_of_vocab_64, train_data=str(data / "train_*.bin"),
                              eval_data=str(data / "eval_*.bin"), steps=1), **QUIET)
    assert result.final_eval_loss is not None
    with pytest.raises(ValueError, match=r"data\.eval_data has vocab size 60 but data\.train_data has 63 nor "
                                         r"model\.init_from's \(64\)"):
        train(run_config(tmp_path, init_from=model_of_vocab_64, train_data=str(data / "train_*.bin"),
                         eval_data=str(data / "other_*.bin"), run_name="other"), **QUIET)


# --------------------------------------------------------------------------
# Token ids past the header's vocab (llm.q's added EOS)
# --------------------------------------------------------------------------


def eos_terminated(documents, vocab, eos, seed=0):
    rng = np.random.default_rng(seed)
    return np.concatenate([np.append(rng.integers(0, vocab, 30), eos) for _ in range(documents)])


def test_an_eos_past_the_header_vocab_is_accepted_when_the_model_covers_it(tmp_path, model_of_vocab_64):
    data = tmp_path / "data"
    data.mkdir()
    tokens = eos_terminated(12, 63, eos=63)  # header vocab 63, EOS id 63: llm.q's Qwen2.5 layout
    path = llmq_file(data / "train_000000.bin", tokens, header_vocab=63)
    token_file = TokenFile(path)
    assert (token_file.vocab_size, token_file.max_token) == (63, 63)
    result = train(run_config(tmp_path, init_from=model_of_vocab_64, train_data=path, steps=1), **QUIET)
    assert result.steps == 1
    # Without [model] vocab_size the model takes the data's ids: 64 rows, so EOS has one.
    result = train(run_config(tmp_path, train_data=path, steps=1, run_name="auto"), **QUIET)
    assert json.load(open(os.path.join(result.model_dir, "config.json")))["vocab_size"] == 64


def test_a_token_past_the_models_vocab_is_refused_naming_the_model_vocab(tmp_path, model_of_vocab_64):
    data = tmp_path / "data"
    data.mkdir()
    tokens = eos_terminated(12, 64, eos=64)
    path = llmq_file(data / "train_000000.bin", tokens, header_vocab=64)
    first = int(np.flatnonzero(tokens == 64)[0])
    with pytest.raises(ValueError, match=rf"train_000000\.bin.*token id 64 at index {first} is outside the "
                                         r"vocabulary of model\.init_from .* \(64 ids"):
        train(run_config(tmp_path, init_from=model_of_vocab_64, train_data=path), **QUIET)
    with pytest.raises(ValueError, match=rf"token id 64 at index {first} is outside the vocabulary of the model "
                                         r"\(64 ids"):
        train(run_config(tmp_path, train_data=path, vocab_size=64, run_name="sized"), **QUIET)


def test_one_stray_id_far_past_the_header_vocab_is_named_not_made_a_vocabulary(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    tokens = eos_terminated(12, 63, eos=63)
    tokens[100] = 10**9  # before: model.vocab_size 0 made this a 10**9-row embedding, then out of memory
    path = llmq_file(data / "train_000000.bin", tokens, header_vocab=63)
    with pytest.raises(ValueError, match=r"train_000000\.bin.*token id 1000000000 at index 100 is far past the "
                                         r"token files' vocab size 63 .*only below 126 \(2x\)\. A corrupt file\?"):
        train(run_config(tmp_path, train_data=path, steps=1), **QUIET)
    tokens[100] = 125  # still below twice the header's: taken as the vocabulary, as llm.q's added ids are
    path = llmq_file(data / "train_000000.bin", tokens, header_vocab=63)
    result = train(run_config(tmp_path, train_data=path, steps=1, run_name="wide"), **QUIET)
    assert json.load(open(os.path.join(result.model_dir, "config.json")))["vocab_size"] == 126


def test_nanoq_eval_checks_the_ids_against_the_models_vocab(tmp_path, model_of_vocab_64):
    from click.testing import CliRunner
    from nanoq_cli.main import cli

    def evaluate(path):
        return CliRunner().invoke(cli, ["eval", model_of_vocab_64, "--data", path, "--seq-len", str(SEQ),
                                        "--backend", "cpu", "--json"])

    covered = evaluate(llmq_file(tmp_path / "eos.bin", eos_terminated(12, 63, eos=63), header_vocab=63))
    assert covered.exit_code == 0, covered.output
    assert json.loads(covered.output)["tokens"] > 0
    tokens = eos_terminated(12, 64, eos=64)
    refused = evaluate(llmq_file(tmp_path / "past.bin", tokens, header_vocab=64))
    assert refused.exit_code == 1
    assert f"token id 64 at index {int(np.flatnonzero(tokens == 64)[0])} is outside the vocabulary of the model " \
           f"{model_of_vocab_64} (64 ids" in refused.output
    # A trained model's vocabulary is what it is: only training may take a larger one.
    assert "Tokenize with the model's tokenizer\n" in refused.output and "at least" not in refused.output


# --------------------------------------------------------------------------
# Windows step by seq_len
# --------------------------------------------------------------------------


def ascending(path, count, first=0):
    write_tokens(path, np.arange(first, first + count), 10_000)
    return str(path)


def test_windows_step_by_seq_len_and_every_token_is_a_target_once_per_epoch(tmp_path):
    seq, windows = 4, 30
    tokens = np.arange(windows * seq + 1 + 2)  # 2 tokens of tail, too short for another window
    dataset = Dataset(ascending(tmp_path / "a.bin", tokens.size), seq)
    assert len(dataset) == windows
    inputs, targets = dataset.read_windows(np.arange(windows))
    for i in range(windows):  # window i covers tokens [i * seq, i * seq + seq + 1)
        assert inputs[i].tolist() == tokens[i * seq:i * seq + seq].tolist()
        assert targets[i].tolist() == tokens[i * seq + 1:i * seq + seq + 1].tolist()
    loader = DataLoader(dataset, batch_rows=6, seed=3)
    epoch = np.concatenate([loader.next_batch()[1] for _ in range(windows // 6)])
    assert (loader.epoch, loader.position) == (1, 0)
    assert sorted(epoch.ravel().tolist()) == tokens[1:windows * seq + 1].tolist()  # each token a target once


def old_fingerprint(paths, seq_len, windows):
    """A DataLoader state's dataset entry as nanoq wrote it before windows
    stepped by seq_len (names, sizes and seq_len hashed; the window count)."""
    digest = hashlib.sha256(str(seq_len).encode())
    for path in paths:
        digest.update(f"\0{os.path.basename(path)}\0{os.path.getsize(path)}".encode())
    return {"files": len(paths), "windows": windows, "sha256": digest.hexdigest()[:32]}


def test_a_loader_state_from_before_resumes_with_the_old_windows(tmp_path):
    seq, count = 4, 103
    path = ascending(tmp_path / "a.bin", count)
    old_windows = count // (seq + 1)  # 20 windows of 5 tokens, side by side
    state = {"kind": "DataLoader", "seed": 7, "epoch": 1, "position": 6,
             "dataset": old_fingerprint([path], seq, old_windows)}
    loader = DataLoader(Dataset(path, seq), batch_rows=4, seed=7)
    assert loader.state_dict()["window_step"] == seq
    loader.load_state_dict(json.loads(json.dumps(state)))
    inputs, targets = loader.next_batch()
    order = np.random.default_rng([7, 1]).permutation(old_windows)[6:10]
    assert inputs.tolist() == [list(range(k * (seq + 1), k * (seq + 1) + seq)) for k in order]
    assert targets.tolist() == [list(range(k * (seq + 1) + 1, k * (seq + 1) + seq + 1)) for k in order]
    saved = loader.state_dict()
    assert saved["window_step"] == seq + 1 and saved["dataset"] == state["dataset"]
    again = DataLoader(Dataset(path, seq), batch_rows=4, seed=7)
    again.load_state_dict(saved)  # and a state saved after that resume keeps them too
    assert again.dataset.window_step == seq + 1


def test_loader_states_and_configs_with_another_window_step_are_refused(tmp_path):
    path = ascending(tmp_path / "a.bin", 103)
    loader = DataLoader(Dataset(path, 4), batch_rows=4, seed=7)
    with pytest.raises(ValueError, match="window_step 3"):
        loader.load_state_dict(dict(loader.state_dict(), window_step=3))
    with pytest.raises(ValueError, match=r"data\.window_step must be 0 or data\.seq_len \(16"):
        run_config(tmp_path, window_step=5)
    assert len(Dataset(path, 4, window_step=5)) == 20  # disjoint windows, as Nano's lines
    with pytest.raises(ValueError, match="window_step must be seq_len"):
        Dataset(path, 4, window_step=3)


# --------------------------------------------------------------------------
# Exported models and checkpoints: the umask decides
# --------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=["022", "077", "002"])
def test_exported_and_checkpoint_files_get_the_mode_the_umask_gives_a_new_file(tmp_path, umask):
    with make_trainer(devices=1) as trainer:
        previous = os.umask(umask)
        try:
            directory = trainer.export_model(str(tmp_path / "model"))
            step_dir = trainer.save_checkpoint(str(tmp_path / "checkpoints"), 1)
        finally:
            os.umask(previous)
    names = sorted(os.listdir(directory))
    assert "model.safetensors" in names and "config.json" in names
    for name in names:
        assert os.stat(os.path.join(directory, name)).st_mode & 0o777 == 0o666 & ~umask, name
    parts = [name for name in os.listdir(step_dir) if name.endswith(".safetensors")]
    assert parts and "trainer_state.json" in os.listdir(step_dir)
    for name in parts + ["trainer_state.json"]:  # the tensors as readable as the JSON beside them
        assert os.stat(os.path.join(step_dir, name)).st_mode & 0o777 == 0o666 & ~umask, name


def test_a_token_file_write_that_fails_names_the_file_and_leaves_nothing(tmp_path):
    # A file-size limit (or a full disk) fails a write() whose OSError names no file: the message was
    # "[Errno 27] File too large" alone.
    import subprocess
    import sys

    script = f"""
import errno, os, resource, signal
import numpy as np
from nanoq.data import write_tokens
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
try:
    write_tokens({str(tmp_path / "big.bin")!r}, np.arange(10000) % 50, 64)
except OSError as e:
    print(e.errno == errno.EFBIG, e, flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # (for what the process writes at exit)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == f"True [Errno {__import__('errno').EFBIG}] File too large (writing " \
                                  f"{tmp_path / 'big.bin'})", done.stdout + done.stderr
    assert os.listdir(tmp_path) == []  # the temporary file is gone, and no token file was made


def test_tokens_that_no_window_holds_are_counted_and_said_when_they_are_many(tmp_path):
    # Windows do not span files: each file's tokens after its last whole window train nothing, which
    # tiny shards (nanoq tokenize --shard-tokens) made a quarter of the data, silently.
    from nanoq.data import Dataset

    window = SEQ + 1
    (tmp_path / "short").mkdir()
    for i in range(6):  # one whole window and half of another in each
        write_tokens(tmp_path / "short" / f"train_{i:06d}.bin", pattern(window + SEQ // 2, 64, seed=i), 64)
    write_tokens(tmp_path / "long.bin", pattern(100 * SEQ + 1 + 3, 64), 64)
    short = Dataset(str(tmp_path / "short" / "*.bin"), SEQ)
    assert short.num_windows == 6 and short.tail_tokens == 6 * (SEQ // 2)
    disjoint = Dataset(str(tmp_path / "short" / "*.bin"), SEQ, window_step=window)
    assert disjoint.tail_tokens == 6 * (SEQ // 2)
    assert Dataset(str(tmp_path / "long.bin"), SEQ).tail_tokens == 3
    lines = []
    train(run_config(tmp_path, train_data=str(tmp_path / "short" / "*.bin")), say=lines.append, progress=False)
    tokens = 6 * (window + SEQ // 2)
    assert f"warning: {6 * (SEQ // 2):,} of data.train_data's {tokens:,} tokens " \
           f"({100 * 6 * (SEQ // 2) / tokens:.0f}%) are never trained: windows do not span its 6 files" in \
           "\n".join(lines)
    lines.clear()
    train(run_config(tmp_path, train_data=str(tmp_path / "long.bin"), run_name="long"), say=lines.append,
          progress=False)
    assert not [line for line in lines if "never trained" in line]  # 3 of 6,404 tokens: not worth a word
