"""Samples during training (train.sample_every, sample_prompts, sample_tokens): greedy continuations
written to the console and log.jsonl, equal to transformers' greedy generate on the same weights, and
leaving the training bitwise unchanged."""
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import load_file

import nanoq
from nanoq.data import write_tokens
from nanoq.testing.threads import ThreadWorld
from nanoq.training import TrainConfig, load_config, read_log, train
from nanoq.training.samples import Samples, document_start, prepare_samples
from nanoq_cli.main import cli
from test_resume import QUIET, TINY, config, records
from test_topology import in_threads

TEXT = ["the cat sat on the mat and the dog sat on the log. " * 3,
        "a bird in the hand is worth two in the bush, said the cat. " * 3,
        "to be or not to be, that is the question of the dog. " * 3] * 8


def hf_greedy(model_dir, prompt, new_tokens, eos=None):
    """transformers' greedy continuation of ``prompt`` by the exported model in ``model_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_default_prompt_is_the_start_of_the_first_eval_document_and_the_sample_is_transformers_greedy(tmp_path):
    result = train(config(tmp_path, steps=8, sample_every=4, sample_tokens=5, checkpoint_every=0), **QUIET)
    samples = records(result.run_dir, "sample")
    assert [(r["step"], r["index"]) for r in samples] == [(4, 0), (8, 0)]
    eval_tokens = np.fromfile(os.path.join(tmp_path, "data", "eval_000000.bin"), dtype="<i4", offset=1024)
    prompt = [int(t) for t in eval_tokens[:8]]  # no tokenizer: half of seq_len 16, shown as ids
    assert all(r["prompt"] == " ".join(map(str, prompt)) for r in samples)
    # The last sample is made with the final weights, which the exported model holds.
    expected = hf_greedy(result.model_dir, prompt, 5)
    assert samples[-1]["completion"] == " ".join(map(str, expected))


@pytest.mark.parametrize("steps, every, expected", [(5, 3, [3, 5]), (3, 8, [3]), (4, 2, [2, 4])])
def test_samples_come_every_n_steps_and_after_the_last_step(tmp_path, steps, every, expected):
    result = train(config(tmp_path, steps=steps, sample_every=every, sample_tokens=2, checkpoint_every=0,
                          eval_every=0), **QUIET)
    assert [r["step"] for r in records(result.run_dir, "sample")] == expected
    samples = Samples(every, [], 2, 16, last=steps)
    assert [step for step in range(steps + 1) if samples.due(step)] == expected


@pytest.mark.parametrize("lora", [{}, dict(lora_rank=2, lora_dropout=0.25)], ids=["full", "lora-dropout"])
def test_a_run_with_samples_trains_bitwise_as_one_without(tmp_path, lora):
    base = dict(steps=6, checkpoint_every=0, eval_every=2, **lora)
    plain = train(config(tmp_path, run_name="plain", sample_every=0, **base), **QUIET)
    sampled = train(config(tmp_path, run_name="sampled", sample_every=1, **base), **QUIET)
    assert len(records(sampled.run_dir, "sample")) == 6 and not records(plain.run_dir, "sample")

    def figures(run_dir):
        return [(r["type"], r["step"], r["loss"], r.get("grad_norm")) for r in records(run_dir)
                if r["type"] in ("train", "eval")]

    assert figures(sampled.run_dir) == figures(plain.run_dir)
    a, b = (load_file(os.path.join(r.model_dir, "model.safetensors")) for r in (plain, sampled))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_kv_cache_that_does_not_fit_turns_samples_off_and_the_run_trains_on(tmp_path, monkeypatch):
    # The first sample allocates generation's KV cache; one that did not fit beside training failed
    # the trainer, and the run died there, losing its steps since the last checkpoint.
    import nanoq.training.loop as loop
    from nanoq.testing import arm_hook

    class Refusing(loop.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            arm_hook(self, "refuse_kv_cache_in_worker", 0)

    monkeypatch.setattr(loop, "Trainer", Refusing)
    base = dict(steps=4, checkpoint_every=0, eval_every=2)
    lines = []
    refused = train(config(tmp_path, run_name="refused", sample_every=1, **base), say=lines.append, progress=False)
    monkeypatch.undo()
    plain = train(config(tmp_path, run_name="plain", sample_every=0, **base), **QUIET)
    assert not records(refused.run_dir, "sample")
    (warning,) = records(refused.run_dir, "warning")
    assert warning["step"] == 1 and warning["message"].startswith(
        "samples off for the rest of the run: generation's KV cache does not fit beside training (out of memory")
    assert [line for line in lines if "samples off" in line] == [f"warning: {warning['message']}"]

    def figures(run_dir):
        return [(r["type"], r["step"], r["loss"]) for r in records(run_dir) if r["type"] in ("train", "eval")]

    assert figures(refused.run_dir) == figures(plain.run_dir) and refused.steps == 4


def tokenized_data(directory):
    """Token files of TEXT with a byte-level BPE tokenizer.json beside them; (train glob, eval path, tokenizer)."""
    from nanoq.tokenization.tokenizer import tokenizer_vocab_size, train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(TEXT, 300)
    eos = tokenizer.token_to_id("<|endoftext|>")
    tokens = np.concatenate([[eos] + tokenizer.encode(text).ids for text in TEXT])
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    vocab = tokenizer_vocab_size(tokenizer)
    write_tokens(directory / "train_000000.bin", tokens, vocab)
    write_tokens(directory / "eval_000000.bin", tokens[: len(tokens) // 4], vocab)
    return str(directory / "train_*.bin"), str(directory / "eval_000000.bin"), tokenizer


def test_sample_prompts_are_encoded_with_the_data_tokenizer_and_completions_decoded(tmp_path):
    train_data, eval_data, tokenizer = tokenized_data(tmp_path / "data")
    prompts = ["the cat", "to be or\nnot"]
    lines = []
    settings = dict(TINY, train_data=train_data, eval_data=eval_data, steps=4, checkpoint_every=0, sample_every=4,
                    sample_tokens=6, seq_len=32, out_dir=str(tmp_path / "runs"), run_name="run")
    result = train(TrainConfig(sample_prompts=prompts, **settings), say=lines.append, progress=False)
    samples = records(result.run_dir, "sample")
    assert [(r["step"], r["index"], r["prompt"]) for r in samples] == [(4, 0, prompts[0]), (4, 1, prompts[1])]
    eos = tokenizer.token_to_id("<|endoftext|>")
    for record, prompt in zip(samples, prompts):
        expected = hf_greedy(result.model_dir, tokenizer.encode(prompt).ids, 6, eos=eos)
        assert record["completion"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert f"sample @ step 4: {prompt!r} -> {record['completion']!r}" in lines
    # Without prompts: the start of the first eval document, after its leading EOS, decoded.
    default = train(TrainConfig(**dict(settings, run_name="default")), **QUIET)
    first = document_start(np.fromfile(eval_data, dtype="<i4", offset=1024), eos, 16)
    assert first[0] != eos and records(default.run_dir, "sample")[0]["prompt"] == tokenizer.decode(first)


def test_document_start_skips_leading_eos_and_stops_at_the_next():
    assert document_start(np.array([0, 0, 5, 6, 0, 7]), 0, 10) == [5, 6]
    assert document_start(np.array([5, 6, 7, 8]), 0, 3) == [5, 6, 7]
    assert document_start(np.array([5, 0, 7]), None, 3) == [5, 0, 7]
    assert document_start(np.array([0, 0]), 0, 3) == []


def test_document_start_with_a_mask_stops_before_the_first_trained_token():
    tokens = np.array([0, 5, 6, 7, 8, 0, 9])
    sft = np.array([1, 0, 0, 1, 1, 1, 0], bool)  # prompt 5 6, reply 7 8
    assert document_start(tokens, 0, 10, sft) == [5, 6]
    assert document_start(tokens, 0, 1, sft) == [5]  # still capped
    assert document_start(tokens[1:], None, 10, sft[1:]) == [5, 6]  # without an EOS id
    assert document_start(tokens, 0, 10, np.ones(7, bool)) == [5, 6, 7, 8]  # trained from its first token
    assert document_start(tokens, 0, 10, np.zeros(7, bool)) == [5, 6, 7, 8]  # nothing trained


def sft_data(directory):
    """SFT token files of sums, each document a question (mask 0) then its answer and EOS (mask 1), with a
    byte-level BPE tokenizer.json beside them; (train glob, eval path, tokenizer, the first eval question)."""
    from nanoq.tokenization.tokenizer import tokenizer_vocab_size, train_bpe_tokenizer

    pairs = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.") for a in range(13, 19) for b in range(21, 27)]
    tokenizer = train_bpe_tokenizer([q + r for q, r in pairs] * 4, 300)
    eos = tokenizer.token_to_id("<|endoftext|>")
    vocab = tokenizer_vocab_size(tokenizer)
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    for name, split in (("train_000000.bin", pairs), ("eval_000000.bin", pairs[-6:])):
        tokens, mask = [], []
        for question, answer in split:
            asked, answered = tokenizer.encode(question).ids, tokenizer.encode(answer).ids + [eos]
            tokens += asked + answered
            mask += [False] * len(asked) + [True] * len(answered)
        write_tokens(directory / name, np.array(tokens), vocab, mask=np.array(mask))
    return str(directory / "train_*.bin"), str(directory / "eval_000000.bin"), tokenizer, pairs[-6][0]


def test_on_sft_data_the_default_prompt_is_the_first_eval_question_without_its_answer(tmp_path):
    train_data, eval_data, tokenizer, question = sft_data(tmp_path / "data")
    asked = tokenizer.encode(question).ids
    assert len(asked) < 16  # the whole question fits the 16-token cap, so the answer's tokens would follow it
    settings = dict(TINY, train_data=train_data, eval_data=eval_data, steps=4, checkpoint_every=0, sample_every=4,
                    sample_tokens=6, seq_len=64, batch_size=2, out_dir=str(tmp_path / "runs"), run_name="run")
    lines = []
    result = train(TrainConfig(**settings), say=lines.append, progress=False)
    (sample,) = records(result.run_dir, "sample")
    assert sample["prompt"] == question
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = hf_greedy(result.model_dir, asked, 6, eos=eos)
    assert sample["completion"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert f"sample @ step 4: {question!r} -> {sample['completion']!r}" in lines


def test_bad_sample_prompts_fail_before_training_naming_the_setting(tmp_path):
    lines = []
    with pytest.raises(ValueError, match=r"train\.sample_prompts needs the data's tokenizer"):
        train(config(tmp_path, sample_every=2, sample_prompts=["hello"]), say=lines.append, progress=False)
    assert not os.path.exists(tmp_path / "runs" / "run")  # nothing ran: no run directory left behind
    assert not [line for line in lines if line.startswith("run directory:")]  # nor one named to the user
    train_data, eval_data, _ = tokenized_data(tmp_path / "tok")
    long = TrainConfig(**dict(TINY, train_data=train_data, eval_data=eval_data, steps=2, sample_every=2,
                              sample_prompts=["the cat sat on the mat " * 4], out_dir=str(tmp_path / "runs")))
    with pytest.raises(ValueError, match=r"train\.sample_prompts\[0\] is \d+ tokens, which leaves no room"):
        train(long, **QUIET)
    for bad in ("hello", [1], ["a", None]):
        with pytest.raises(ValueError, match=r"train\.sample_prompts must be a list of strings"):
            TrainConfig(sample_prompts=bad)


def test_sample_prompts_come_from_repeated_flags_and_toml_arrays(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsample_prompts = ["To be", "a \\"quoted\\"\\nline"]\nsample_every = 5\n')
    config_ = load_config(path)
    assert config_.sample_prompts == ["To be", 'a "quoted"\nline'] and config_.sample_every == 5
    (tmp_path / "round.toml").write_text(config_.to_toml())
    assert load_config(tmp_path / "round.toml") == config_
    result = CliRunner().invoke(cli, ["train", str(path), "--sample-prompts", "one", "--sample_prompts", "two",
                                      "--print-config"])
    assert result.exit_code == 0, result.output
    assert 'sample_prompts = ["one", "two"]' in result.output
    result = CliRunner().invoke(cli, ["train", str(path), "--print-config"])
    assert 'sample_prompts = ["To be", "a \\"quoted\\"\\nline"]' in result.output  # no flag: the file's


def test_several_processes_train_without_samples_and_say_why(tmp_path):
    world = ThreadWorld(2)
    lines = [[], []]
    settings = config(tmp_path, steps=4, sample_every=2, checkpoint_every=0, batch_size=2)
    results, errors = in_threads([
        (lambda r=r: train(settings, processes=world.member(r), say=lines[r].append, progress=False))
        for r in range(2)])
    assert errors == [None, None]
    assert any(line.startswith("samples off: generation needs a single-process run") for line in lines[0])
    assert not lines[1]
    assert not [r for r in read_log(results[0].log_path) if r["type"] == "sample"]


@pytest.mark.parametrize("with_eval", [True, False], ids=["stage-eval", "stage-train"])
def test_a_curriculum_samples_from_its_first_stage(tmp_path, with_eval):
    data = tmp_path / "data"
    data.mkdir()
    files = dict(a_train=np.tile(np.arange(1, 17), 40), a_eval=np.arange(20, 50).repeat(20),
                 b_train=np.arange(30, 60).repeat(20), b_eval=np.arange(40, 64).repeat(20))
    for name, tokens in files.items():
        write_tokens(data / f"{name}.bin", tokens, 64)
    stages = [f"{data}/{stage}_train.bin" + (f"|{data}/{stage}_eval.bin" if with_eval else "") + "@2"
              for stage in ("a", "b")]
    settings = TrainConfig(**dict(TINY, curriculum="; ".join(stages), steps=4, sample_every=2, checkpoint_every=0,
                                  out_dir=str(tmp_path / "runs"), run_name="curriculum"))
    result = train(settings, **QUIET)
    first = " ".join(map(str, files["a_eval" if with_eval else "a_train"][:8]))
    assert [(r["step"], r["prompt"]) for r in records(result.run_dir, "sample")] == [(2, first), (4, first)]


def test_the_demo_shows_samples_of_text_from_an_eval_play(tmp_path):
    from nanoq.tokenization.tokenizer import load_tokenizer

    defaults = TrainConfig()
    assert 0 < defaults.sample_every <= defaults.steps and defaults.steps % defaults.sample_every == 0
    lines = []
    settings = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, steps=2,
                    warmup_steps=0, eval_every=0, eval_batches=1, checkpoint_every=0, batch_size=2, threads=1,
                    backend="cpu", seq_len=32, sample_every=2, sample_tokens=4, out_dir=str(tmp_path))
    result = train(load_config(overrides=settings), say=lines.append, progress=False)
    (sample,) = records(result.run_dir, "sample")
    data = os.path.join(result.run_dir, "data")
    tokenizer = load_tokenizer(data)
    eos = tokenizer.token_to_id("<|endoftext|>")
    (eval_file,) = [name for name in os.listdir(data) if name.startswith("eval_")]
    first = document_start(np.fromfile(os.path.join(data, eval_file), dtype="<i4", offset=1024), eos, 16)
    assert sample["prompt"] == tokenizer.decode(first, skip_special_tokens=True)
    assert sample["prompt"].startswith("THE ") and sample["completion"]  # a play's title page, decoded
    assert any(line.startswith(f"sample @ step 2: {sample['prompt']!r} -> ") for line in lines)


def test_init_from_refuses_data_tokenized_with_another_tokenizer(tmp_path):
    from nanoq.tokenization.tokenizer import train_bpe_tokenizer

    train_data, eval_data, tokenizer = tokenized_data(tmp_path / "data")
    model = nanoq.ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=4)
    same, other = tmp_path / "same", tmp_path / "other"
    for directory, vocab in ((same, None), (other, 280)):
        directory.mkdir()
        other_text = ["zebras quickly jump over lazy foxes, again and again. " * 3]
        (train_bpe_tokenizer(other_text, vocab) if vocab else tokenizer).save(str(directory / "tokenizer.json"))
        with nanoq.Trainer(model, nanoq.TrainOptions(backend="cpu", batch_size=1, seq_len=8)) as trainer:
            trainer.export_model(str(directory / "model"), tokenizer_dir=str(directory))
    settings = dict(TINY, train_data=train_data, eval_data=eval_data, steps=1, sample_every=0,
                    checkpoint_every=0, out_dir=str(tmp_path / "runs"))
    # Before, the run trained and exported the data's tokenizer with the other model.
    with pytest.raises(ValueError, match=r"the training data was tokenized with .*tokenizer\.json \(\d+ tokens\), "
                                         r"not with model\.init_from .*other.model's tokenizer \(\d+ tokens\)"):
        train(TrainConfig(**dict(settings, init_from=str(other / "model"), run_name="other")), **QUIET)
    result = train(TrainConfig(**dict(settings, init_from=str(same / "model"), run_name="same")), **QUIET)
    assert result.steps == 1


def test_the_default_prompt_reads_the_start_of_the_file_only(tmp_path):
    # A token file of many GB: the prompt comes from its first document, so only its start is read
    # (the whole file was scanned for its first token that is not EOS, and its whole mask unpacked).
    from nanoq.data import Dataset
    from nanoq.training.samples import _leading

    eos = 0
    tokens = np.concatenate([[eos] * 5000, [7, 8, 9, eos, 4], np.full(200_000, 5)])
    mask = np.concatenate([np.zeros(5001, bool), np.ones(tokens.size - 5001, bool)])  # 7: prompt; 8 on: trained
    write_tokens(tmp_path / "eval_000000.bin", tokens, 16, mask=mask)
    assert _leading(tokens, eos, chunk=64) == 5000 and _leading(tokens, None) == 0
    assert _leading(np.zeros(10, int), eos, chunk=4) == 10
    from tokenizers import Tokenizer, models

    vocab = {"<|endoftext|>": 0} | {f"t{i}": i for i in range(1, 16)}
    Tokenizer(models.WordLevel(vocab, unk_token="t1")).save(str(tmp_path / "tokenizer.json"))
    dataset = Dataset(str(tmp_path / "eval_000000.bin"), 8)
    reads = []
    mask_range = dataset.files[0].mask_range
    dataset.files[0].mask_range = lambda start, stop: (reads.append((start, stop)), mask_range(start, stop))[1]
    samples = prepare_samples(4, [], 4, 64, dataset, str(tmp_path))
    assert samples.stop == eos and samples.prompts[0].ids == [7]
    assert reads == [(5000, 5016)]
