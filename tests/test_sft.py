"""SFT: prompt-masked token files -> loader -> trainer, against PyTorch, and the CLI.

The tokenizer's SFT mode writes a mask (1 = response token), the loader turns
the prompt's targets into -100, and the trainer's loss is the mean
cross-entropy over the trained tokens of the whole optimizer step: every
micro-batch on every device, divided once by their total count (not a mean
of per-micro-batch or per-device means). Masked positions contribute exactly
nothing: the tests that say "bitwise" compare with np.array_equal.

The step under test has 2 devices x 2 rows x 2 micro-batches of SEQ tokens
cut from a small SFT corpus whose prompts and responses vary in length, so
each micro-batch and each device trains on a different number of tokens.
Tolerances are those of test_reference.py (fp32 against transformers).
"""

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import pytest

from nanoq.testing import OpRunner
from nanoq.data import DataLoader, Dataset, TokenFile
from nanoq.tokenization import load_tokenizer, tokenize_files
from conftest import (
    IGNORE,
    SEQ,
    assert_same_tensors,
    assert_tensors_close,
    build_hf_model,
    open_trainer,
    save_hf_model,
    torch_backward,
)
from test_cli import invoke

LOSS_REL = 1e-5
GRAD_REL = 3e-5
DEVICES, BATCH_SIZE, GRAD_ACCUM = 2, 2, 2
LOADER_SEED = 0  # a step whose (micro-batch, device) groups train on 9, 5, 12 and 15 tokens
VOCAB_SIZE = 300  # of the BPE trained on the corpus

WORDS = "the a fox dog quick lazy brown jumps over river stone light tree bird sings morning wind".split()


def sft_records(count, seed):
    """prompt/response records (prompts up to 13 words, responses up to 7),
    every third one as a user/assistant chat instead."""
    rng = np.random.default_rng(seed)
    records = []
    for index in range(count):
        prompt = " ".join(rng.choice(WORDS, rng.integers(1, 14)))
        response = " ".join(rng.choice(WORDS, rng.integers(1, 8)))
        if index % 3 == 2:
            records.append({"messages": [{"role": "user", "content": prompt},
                                         {"role": "assistant", "content": response}]})
        else:
            records.append({"prompt": f"Q: {prompt}\nA:", "response": f" {response}"})
    return records


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def response_texts(records):
    """The texts the SFT mode trains on: each response, or each assistant turn."""
    for record in records:
        if "response" in record:
            yield record["response"]
        else:
            yield from (m["content"] for m in record["messages"] if m["role"] == "assistant")


def file_windows(token_file):
    """(tokens int32, mask bool), both [complete windows, SEQ + 1]: the token
    file cut as the loader cuts it (window i is tokens [i * SEQ, i * SEQ + SEQ + 1))."""
    count = (len(token_file) - 1) // SEQ
    positions = np.arange(count)[:, None] * SEQ + np.arange(SEQ + 1)
    return np.asarray(token_file.tokens)[positions], token_file.mask[positions]


def device_groups(micro_batches):
    """[(micro-batch index, device, inputs, targets)] of the rows each device gets in each micro-batch."""
    return [(m, d, inputs[d * BATCH_SIZE:(d + 1) * BATCH_SIZE], targets[d * BATCH_SIZE:(d + 1) * BATCH_SIZE])
            for m, (inputs, targets) in enumerate(micro_batches) for d in range(DEVICES)]


def trained(targets):
    return int((targets != IGNORE).sum())


def context_length(row_targets):
    """1 + the position of a row's last trained target (0 if none): inputs
    from there on can reach only masked targets (attention is causal)."""
    counted = np.flatnonzero(row_targets != IGNORE)
    return int(counted[-1]) + 1 if counted.size else 0


@dataclass
class SftStep:
    """One optimizer step's micro-batches from tokenized SFT data, and a model for them."""

    token_file: TokenFile
    micro_batches: list  # GRAD_ACCUM x (inputs, targets) int32 [DEVICES * BATCH_SIZE, SEQ]
    model: object  # transformers LlamaForCausalLM with the checkpoint's weights
    checkpoint: str


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    corpus = write_jsonl(root / "sft.jsonl", sft_records(40, seed=0))
    result = tokenize_files([corpus], root / "data", fmt="sft", train_tokenizer_vocab=VOCAB_SIZE, progress=False)
    assert result.vocab_size == VOCAB_SIZE
    token_file = TokenFile(root / "data" / result.train_files[0])
    loader = DataLoader(Dataset(root / "data" / "train_*.bin", SEQ), batch_rows=DEVICES * BATCH_SIZE,
                        seed=LOADER_SEED, devices=DEVICES)
    micro_batches = [loader.next_batch() for _ in range(GRAD_ACCUM)]
    model = build_hf_model("llama", seed=3, vocab_size=VOCAB_SIZE)
    return SftStep(token_file, micro_batches, model, save_hf_model(model, root / "model"))


def train_step(checkpoint, micro_batches, **update_kwargs):
    """(gradients before update, update stats, weights after) of one step with one micro-batch per step()."""
    with open_trainer(checkpoint, devices=DEVICES, batch_size=BATCH_SIZE, grad_accum=len(micro_batches)) as tr:
        for inputs, targets in micro_batches:
            tr.step(inputs, targets)
        grads = tr.get_gradients()
        stats = tr.update(lr=1e-3, **update_kwargs)
        return grads, stats, tr.get_weights()


def max_relative_difference(grads, reference):
    return max(float(np.abs(grads[n] - g).max() / np.abs(g).max()) for n, g in reference.items())


# --------------------------------------------------------------------------
# Data pipeline -> trainer -> PyTorch
# --------------------------------------------------------------------------


def test_loader_targets_are_the_response_tokens_of_the_sft_file(sft):
    """Each row is a window of the token file; its counted targets are
    exactly the window's tokens with mask bit 1, the rest are -100."""
    tokens, mask = file_windows(sft.token_file)
    for inputs, targets in sft.micro_batches:
        for row in range(len(inputs)):
            (index,) = np.flatnonzero((tokens[:, :-1] == inputs[row]).all(axis=1))
            expected = np.where(mask[index, 1:], tokens[index, 1:], IGNORE)
            assert np.array_equal(targets[row], expected), f"row {row}"
    assert 0 < sum(trained(t) for _, t in sft.micro_batches) < GRAD_ACCUM * DEVICES * BATCH_SIZE * SEQ / 2


def test_sft_loss_and_gradients_are_the_mean_over_the_whole_steps_response_tokens(sft):
    """2 devices x 2 micro-batches with unequal trained-token counts: the
    loss and gradients match transformers' sum of CE over all response
    targets of the step divided by their total, and not any mean of means."""
    groups = device_groups(sft.micro_batches)
    counts = [trained(t) for _, _, _, t in groups]
    per_micro = [sum(c for (m, _, _, _), c in zip(groups, counts) if m == k) for k in range(GRAD_ACCUM)]
    per_device = [sum(c for (_, d, _, _), c in zip(groups, counts) if d == k) for k in range(DEVICES)]
    assert min(counts) > 0 and len(set(counts)) == len(counts), counts
    assert len(set(per_micro)) == GRAD_ACCUM and len(set(per_device)) == DEVICES, (per_micro, per_device)

    ref = torch_backward(sft.model, sft.micro_batches)
    grads, stats, _ = train_step(sft.checkpoint, sft.micro_batches)
    assert stats.tokens == ref.tokens == sum(counts)
    assert stats.loss == pytest.approx(ref.loss, rel=LOSS_REL)
    assert stats.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
    assert_tensors_close(grads, ref.grads, GRAD_REL, "sft grad")

    # The test tells the global token mean from the means of means a wrong
    # normalisation would give (per micro-batch, per device, per both): their
    # losses differ by over 30x the tolerance (about 100x for the closest,
    # per micro-batch), their gradients by over 1000x.
    means_of = {
        "micro-batch": [torch_backward(sft.model, [m]) for m in sft.micro_batches],
        "device": [torch_backward(sft.model, [(i, t) for _, d, i, t in groups if d == k]) for k in range(DEVICES)],
        "micro-batch and device": [torch_backward(sft.model, [(i, t)]) for _, _, i, t in groups],
    }
    for name, parts in means_of.items():
        mean_of_means = float(np.mean([p.loss for p in parts]))
        assert abs(mean_of_means - ref.loss) > 30 * LOSS_REL * ref.loss, name
        mean_grads = {n: np.mean([p.grads[n] for p in parts], axis=0) for n in ref.grads}
        assert max_relative_difference(mean_grads, ref.grads) > 1000 * GRAD_REL, name


# --------------------------------------------------------------------------
# Masked tokens contribute exactly nothing
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_classifier_never_reads_masked_rows(request, backend):
    """Rows with target -100 get exactly zero dlogits, even with z-loss, and
    their logits (here NaN, inf or huge) change no other row's gradient and
    no statistic: the two calls below agree bitwise."""
    device = request.getfixturevalue("cuda_device") if backend == "cuda" else 0
    runner = OpRunner(backend, device)
    rng = np.random.default_rng(30)
    rows = 24
    logits = (rng.standard_normal((rows, VOCAB_SIZE)) * 3.0).astype(np.float32)
    targets = rng.integers(0, VOCAB_SIZE, rows).astype(np.int32)
    masked = np.arange(rows) % 3 == 1
    targets[masked] = IGNORE
    poisoned = logits.copy()
    poisoned[masked] = np.resize(np.array([np.nan, np.inf, -np.inf, 1e30], np.float32), poisoned[masked].shape)

    grad, stats = runner.cross_entropy(logits, targets, z_loss=1e-3)
    poisoned_grad, poisoned_stats = runner.cross_entropy(poisoned, targets, z_loss=1e-3)
    assert np.all(grad[masked] == 0.0)
    assert np.all(np.abs(grad[~masked]).max(axis=1) > 0)
    assert np.array_equal(poisoned_grad, grad)
    assert np.array_equal(poisoned_stats, stats)
    assert stats[list(runner.stat_slots).index("tokens")] == (~masked).sum()


def test_an_all_masked_micro_batch_adds_exactly_nothing(sft):
    """A third micro-batch with every target -100 (its input ids used
    nowhere else) leaves the step's gradients, statistics and updated
    weights bitwise unchanged. Every id that is an input only where no
    trained target can see it has an embedding gradient of exactly 0."""
    used = np.unique(np.concatenate([inputs.ravel() for inputs, _ in sft.micro_batches]))
    unused = np.setdiff1d(np.arange(VOCAB_SIZE), used)
    context = np.unique(np.concatenate([inputs[row, :context_length(targets[row])]
                                        for inputs, targets in sft.micro_batches for row in range(len(inputs))]))
    after_context_only = np.setdiff1d(used, context)
    assert after_context_only.size > 0  # ids of trailing prompts in this data
    rng = np.random.default_rng(31)
    masked_inputs = rng.choice(unused, size=sft.micro_batches[0][0].shape).astype(np.int32)
    masked_batch = (masked_inputs, np.full_like(masked_inputs, IGNORE))

    base_grads, base_stats, base_weights = train_step(sft.checkpoint, sft.micro_batches)
    first, second = sft.micro_batches
    grads, stats, weights = train_step(sft.checkpoint, [first, masked_batch, second])
    assert_same_tensors(grads, base_grads, "grad with an all-masked micro-batch")
    assert stats == base_stats
    assert_same_tensors(weights, base_weights, "weight after the step")
    embedding = grads["model.embed_tokens.weight"]
    assert not embedding[np.union1d(after_context_only, masked_inputs)].any()
    assert np.abs(embedding[context]).max(axis=1).min() > 0


def test_inputs_after_the_last_trained_target_change_nothing(sft):
    """Causal attention: an input after a row's last trained target
    position feeds only masked targets. Replacing all those inputs (the
    trailing prompt of the next document, and every input of device 1's
    rows in micro-batch 2, made all-masked here) changes nothing, bitwise."""
    micro_batches = [(inputs.copy(), targets.copy()) for inputs, targets in sft.micro_batches]
    micro_batches[1][1][BATCH_SIZE:] = IGNORE  # device 1 trains on nothing in micro-batch 2
    rng = np.random.default_rng(32)
    replaced = []
    for inputs, targets in micro_batches:
        other = inputs.copy()
        for row, row_targets in enumerate(targets):
            tail = context_length(row_targets)
            other[row, tail:] = (inputs[row, tail:] + rng.integers(1, VOCAB_SIZE, SEQ - tail)) % VOCAB_SIZE
        replaced.append((other, targets))
    changed = sum(int((o != i).sum()) for (o, _), (i, _) in zip(replaced, micro_batches))
    assert changed >= BATCH_SIZE * SEQ + 4  # the all-masked rows and some prompt tails

    base_grads, base_stats, _ = train_step(sft.checkpoint, micro_batches)
    grads, stats, _ = train_step(sft.checkpoint, replaced)
    assert base_stats.tokens == sum(trained(t) for _, t in micro_batches)
    assert_same_tensors(grads, base_grads, "grad with other inputs under masked targets")
    assert stats == base_stats


# --------------------------------------------------------------------------
# The command line: nanoq tokenize --format sft, then nanoq train
# --------------------------------------------------------------------------

TINY_RUN = ["--hidden_size", "32", "--intermediate_size", "64", "--num_hidden_layers", "2",
            "--num_attention_heads", "4", "--num_key_value_heads", "2", "--seq_len", str(SEQ),
            "--batch_size", str(BATCH_SIZE), "--devices", str(DEVICES), "--grad_accum", str(GRAD_ACCUM),
            "--threads", "1", "--backend", "cpu"]


def test_cli_tokenizes_sft_data_and_trains_on_the_responses(tmp_path, monkeypatch):
    """tokenize --format sft (a trained BPE; the eval set with that
    tokenizer), then train 2 devices x 2 micro-batches: finite losses, a
    first loss of ~ln(vocab) per trained token, and the final eval scores
    exactly the response tokens of its documents (packed, by default, so
    the run's TrainOptions say packed_documents)."""
    from nanoq.training import loop

    made = []
    real_train_options = loop.train_options
    monkeypatch.setattr(loop, "train_options",
                        lambda config, packing=None: made.append(real_train_options(config, packing)) or made[-1])
    eval_records = sft_records(12, seed=5)
    result = invoke("tokenize", write_jsonl(tmp_path / "train.jsonl", sft_records(40, seed=0)), "-o",
                    tmp_path / "data", "--format", "sft", "--train-tokenizer", "--vocab-size", VOCAB_SIZE)
    assert result.exit_code == 0, result.output
    result = invoke("tokenize", write_jsonl(tmp_path / "eval.jsonl", eval_records), "-o", tmp_path / "eval",
                    "--format", "sft", "--tokenizer", tmp_path / "data" / "tokenizer.json")
    assert result.exit_code == 0, result.output

    steps = 4
    result = invoke("train", "--train_data", tmp_path / "data" / "train_*.bin", "--eval_data",
                    tmp_path / "eval" / "train_000000.bin", *TINY_RUN, "--steps", steps, "--warmup_steps", "0",
                    "--eval_every", "0", "--eval_batches", "0", "--checkpoint_every", "0",
                    "--out_dir", tmp_path / "runs", "--run_name", "sft")
    assert result.exit_code == 0, result.output
    assert [options.packed_documents for options in made] == [True]
    records = [json.loads(line) for line in open(tmp_path / "runs" / "sft" / "log.jsonl")]
    losses = [r["loss"] for r in records if r["type"] == "train"]
    assert len(losses) == steps and all(loss is not None and math.isfinite(loss) for loss in losses), losses
    # Initial weights (std 0.02) give near-uniform predictions: ln(vocab) per
    # trained token; dividing by all positions would give a fraction of it.
    assert losses[0] == pytest.approx(math.log(VOCAB_SIZE), abs=0.1)
    # Each train line counts the targets its loss averaged: responses only.
    positions = DEVICES * BATCH_SIZE * GRAD_ACCUM * SEQ
    trained = [r["trained_tokens"] for r in records if r["type"] == "train"]
    assert all(0 < count < positions / 2 for count in trained), (trained, positions)

    (evaluation,) = [r for r in records if r["type"] == "eval"]
    eval_file = TokenFile(tmp_path / "eval" / "train_000000.bin")
    tokenizer = load_tokenizer(tmp_path / "data" / "tokenizer.json")
    # Each response's tokens and the EOS after it.
    assert int(eval_file.mask.sum()) == sum(len(tokenizer.encode(text, add_special_tokens=False).ids) + 1
                                            for text in response_texts(eval_records))
    # SFT files are packed by default (data.packing auto): every document is
    # whole, so the evaluation scores every response token of the file.
    assert evaluation["tokens"] == int(eval_file.mask.sum()) < len(eval_file) / 2
    assert math.isfinite(evaluation["loss"])
    assert os.path.isfile(tmp_path / "runs" / "sft" / "model" / "model.safetensors")
