"""Generation with the core's KV cache (Trainer.generate, Trainer.logits,
nanoq.generation.Sampler) against transformers on the same weights.

The prompt runs as one causal pass that fills the cache, each later token as
one query over it (Backend::attention_decode); greedy decoding must give
transformers' greedy `generate` token for token, and the logits of every
position those of the model's forward.
"""
import json
import os
import shutil

import numpy as np
import peft
import pytest
import torch

import nanoq
from conftest import VOCAB, open_trainer, random_batch, require_cuda_emulator
from nanoq.generation import Sampler
from nanoq.lora import PEFT_NAMES, LoraConfig
from test_lora import nanoq_name, random_adapters, set_adapters

LOGITS_ABS = 2e-5  # fp32 against fp32 torch: |logits| ~ 5, differences ~4e-6
GEN_SEQ = 32       # positions of the generating trainers (prompt + new tokens)
PROMPT = [5, 9, 3, 77, 101]


def hf_greedy(model, prompt, new_tokens):
    """transformers' greedy continuation of `prompt` (no eos: exactly new_tokens)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def kv_cache_bytes(trainer):
    return sum(a["bytes"] for a in trainer.get_allocations(0) if a["context"] == "kv-cache")


@pytest.mark.parametrize("variant", ["llama", "llama_tied", "qwen2", "qwen3"])
def test_logits_match_transformers(checkpoints, variant):
    inputs = np.random.default_rng(0).integers(0, VOCAB, (3, 12)).astype(np.int32)
    with open_trainer(checkpoints.path(variant)) as tr:
        logits = tr.logits(inputs)
    with torch.no_grad():
        expected = checkpoints.model(variant)(torch.tensor(inputs).long()).logits.numpy()
    assert logits.dtype == np.float32 and logits.shape == (3, 12, VOCAB)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=LOGITS_ABS)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_greedy_generate_matches_transformers_token_for_token(checkpoints, variant):
    with open_trainer(checkpoints.path(variant), seq_len=GEN_SEQ) as tr:
        tokens = tr.generate(PROMPT, 24, temperature=0)
    assert tokens == hf_greedy(checkpoints.model(variant), PROMPT, 24)
    assert len(tokens) == 24 and all(isinstance(t, int) for t in tokens)


def test_greedy_generate_with_lora_adapters_matches_peft(checkpoints):
    lora = LoraConfig(rank=4, alpha=8.0, targets="all")
    path = checkpoints.path("qwen2")
    options = nanoq.TrainOptions(backend="cpu", batch_size=1, seq_len=GEN_SEQ, lora=lora)
    with nanoq.Trainer(nanoq.ModelConfig.from_pretrained(path), options) as tr:
        tr.import_weights(path)
        adapters = random_adapters(tr, seed=3)
        set_adapters(tr, adapters)
        tokens = tr.generate(PROMPT, 20, temperature=0)
        with_adapters = tr.logits(np.array([PROMPT], np.int32))
    model = peft.get_peft_model(checkpoints.model("qwen2"), peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, target_modules=[PEFT_NAMES[t] for t in lora.targets])).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.from_numpy(adapters[nanoq_name(name)]))
        expected = model(torch.tensor([PROMPT])).logits.numpy()
        plain = checkpoints.model("qwen2")(torch.tensor([PROMPT])).logits.numpy()
    assert np.abs(expected - plain).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(with_adapters, expected, rtol=0, atol=LOGITS_ABS)
    assert tokens == hf_greedy(model, PROMPT, 20)


def test_generate_on_two_devices_with_sharded_weights_equals_one_device(checkpoints):
    path = checkpoints.path("llama")
    with open_trainer(path, seq_len=GEN_SEQ) as one:
        expected = one.generate(PROMPT, 16, temperature=0.8, seed=4)
        expected_logits = one.logits(np.array([PROMPT], np.int32))
    config = nanoq.ModelConfig.from_pretrained(path)
    options = nanoq.TrainOptions(backend="cpu", devices=2, batch_size=1, seq_len=GEN_SEQ, zero_stage=3)
    with nanoq.Trainer(config, options) as two:
        two.import_weights(path)
        assert two.generate(PROMPT, 16, temperature=0.8, seed=4) == expected
        np.testing.assert_array_equal(two.logits(np.array([PROMPT], np.int32)), expected_logits)


def test_top_k_one_is_greedy_and_seeded_sampling_is_reproducible(checkpoints):
    with open_trainer(checkpoints.path("llama"), seq_len=GEN_SEQ) as tr:
        greedy = tr.generate(PROMPT, 20, temperature=0)
        assert tr.generate(PROMPT, 20, temperature=1.5, top_k=1, seed=9) == greedy
        first = tr.generate(PROMPT, 20, temperature=1.0, seed=1)
        again = tr.generate(PROMPT, 20, temperature=1.0, seed=1)
        other = tr.generate(PROMPT, 20, temperature=1.0, seed=2)
        nucleus = tr.generate(PROMPT, 20, temperature=1.0, top_k=10, top_p=0.9, seed=1)
    assert first == again
    assert first != other
    assert first != greedy
    assert len(nucleus) == 20


def test_stop_tokens_end_generation_after_the_stop_token(checkpoints):
    with open_trainer(checkpoints.path("llama"), seq_len=GEN_SEQ) as tr:
        free = tr.generate(PROMPT, 20, temperature=0)
        stop = free[3]
        first = free.index(stop)
        assert tr.generate(PROMPT, 20, temperature=0, stop=[stop, VOCAB - 1]) == free[:first + 1]
        assert tr.generate(PROMPT, 20, temperature=0, stop=stop) == free[:first + 1]
        assert tr.generate(PROMPT, 0) == []


def test_the_kv_cache_is_an_allocation_context_the_inspector_shows(checkpoints):
    with open_trainer(checkpoints.path("qwen3"), seq_len=GEN_SEQ) as tr:
        assert kv_cache_bytes(tr) == 0  # allocated by the first generation
        tr.generate(PROMPT, 3, temperature=0)
        names = {a["name"]: a["bytes"] for a in tr.get_allocations(0) if a["context"] == "kv-cache"}
        cfg = tr.config
        # Keys and values of every layer, for seq_len positions of the kv heads (float32).
        per_layer = GEN_SEQ * cfg.num_key_value_heads * cfg.head_dim * 4
        for layer in range(cfg.num_hidden_layers):
            assert names[f"kv-cache.layer.{layer}.keys"] == per_layer
            assert names[f"kv-cache.layer.{layer}.values"] == per_layer
        held = kv_cache_bytes(tr)
        tr.generate(PROMPT, 3, temperature=0)
        assert kv_cache_bytes(tr) == held  # kept and reused
        assert tr.memory_summary()[0]["contexts"]["kv-cache"] == held


def test_generation_leaves_training_bitwise_unchanged(checkpoints):
    """A generate() between steps changes neither the gradients nor the update."""
    batch = random_batch(np.random.default_rng(5), rows=2)
    results = []
    for generate in (False, True):
        with open_trainer(checkpoints.path("llama")) as tr:
            tr.step(*batch)
            if generate:
                tr.generate(PROMPT, 6, temperature=0.7, seed=3)
                tr.logits(batch[0])
            stats = tr.update(lr=1e-2)
            tr.step(*batch)
            results.append((stats.loss, tr.get_gradients(), tr.get_weights()))
    (loss_a, grads_a, weights_a), (loss_b, grads_b, weights_b) = results
    assert loss_a == loss_b
    for name in weights_a:
        np.testing.assert_array_equal(weights_a[name], weights_b[name], name)
        np.testing.assert_array_equal(grads_a[name], grads_b[name], name)


def test_bad_generation_arguments_raise_naming_the_argument(checkpoints):
    with open_trainer(checkpoints.path("llama"), seq_len=GEN_SEQ) as tr:
        cases = [
            (dict(prompt_ids=[]), ValueError, "prompt_ids is empty"),
            (dict(prompt_ids=[1, VOCAB]), ValueError, rf"token id {VOCAB} at prompt_ids\[1\] is outside"),
            (dict(prompt_ids=[1, -1]), ValueError, r"token id -1 at prompt_ids\[1\]"),
            (dict(prompt_ids="hello"), TypeError, "not text"),
            (dict(prompt_ids=[[1, 2]]), ValueError, "1-D"),
            (dict(prompt_ids=[1.5]), TypeError, "ints"),
            (dict(max_new_tokens=GEN_SEQ), ValueError, "more than seq_len 32"),
            (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be >= 0"),
            (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an int"),
            (dict(temperature=-0.1), ValueError, "temperature must be >= 0"),
            (dict(temperature="hot"), TypeError, "temperature must be a number"),
            (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
            (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
            (dict(top_k=-1), ValueError, "top_k must be >= 0"),
            (dict(seed=-3), ValueError, "seed must be >= 0"),
            (dict(stop=[VOCAB + 5]), ValueError, r"token id 133 at stop\[0\]"),
        ]
        for change, error, words in cases:
            kwargs = dict(dict(prompt_ids=PROMPT, max_new_tokens=4), **change)
            with pytest.raises(error, match=words):
                tr.generate(**kwargs)
        with pytest.raises(ValueError, match="more than seq_len"):
            tr.logits(np.zeros((1, GEN_SEQ + 1), np.int32))
        with pytest.raises(ValueError, match="2-D"):
            tr.logits(np.zeros(4, np.int32))
        with pytest.raises(ValueError, match=r"token id 200 at inputs\[0\]\[2\]"):
            tr.logits(np.array([[1, 2, 200]]))
        # Nothing above broke the trainer.
        assert tr.generate(PROMPT, 4, temperature=0) == tr.generate(PROMPT, 4, temperature=0)


def test_generate_refuses_a_trainer_of_several_processes(checkpoints):
    class TwoProcesses(nanoq.distributed.SingleProcess):
        size = 2

    with open_trainer(checkpoints.path("llama")) as tr:
        tr.processes = TwoProcesses()
        with pytest.raises(ValueError, match="generate\\(\\) runs in a trainer that holds its whole world"):
            tr.generate(PROMPT, 2)
        with pytest.raises(ValueError, match="logits\\(\\) runs in a trainer"):
            tr.logits(np.array([PROMPT], np.int32))


def test_sampler_draws_from_the_top_k_and_nucleus_with_softmax_frequencies():
    logits = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15], np.float32))
    draws = 4000

    def frequencies(**kwargs):
        sampler = Sampler(seed=11, **kwargs)
        counts = np.bincount([sampler(logits) for _ in range(draws)], minlength=5)
        return counts / draws

    np.testing.assert_allclose(frequencies(), [0.05, 0.4, 0.1, 0.3, 0.15], atol=0.03)
    # top_k 2: tokens 1 and 3 only, renormalised.
    np.testing.assert_allclose(frequencies(top_k=2), [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], atol=0.03)
    # top_p 0.8: 0.4 + 0.3 < 0.8 <= 0.4 + 0.3 + 0.15, so tokens 1, 3 and 4.
    np.testing.assert_allclose(frequencies(top_p=0.8), [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85], atol=0.03)
    # temperature 0.5 squares the probabilities (before normalising).
    squared = np.array([0.05, 0.4, 0.1, 0.3, 0.15]) ** 2
    np.testing.assert_allclose(frequencies(temperature=0.5), squared / squared.sum(), atol=0.03)
    assert Sampler(temperature=0)(logits) == 1
    assert Sampler(temperature=0)(np.array([1.0, 3.0, 3.0], np.float32)) == 1  # ties: the lowest id
    # A temperature so small that logits / temperature overflow: the greedy limit, not NaN probabilities.
    for temperature in (1e-320, 1e-300):
        assert Sampler(temperature=temperature, seed=3).choose(logits * 1000) == (1, 1.0)


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_emulated_cuda_backend_generates_as_the_cpu_backend(checkpoints, dtype):
    """The generation path on the cuda backend's kernels (under the CPU
    emulator): the prefill's attention, attention_decode over the native
    attention kernel, and the rest of the forward; in bf16 the cache and
    activations are bf16 and the logits float32."""
    require_cuda_emulator()
    path = checkpoints.path("qwen3")
    config = nanoq.ModelConfig.from_pretrained(path)
    options = nanoq.TrainOptions(backend="cuda_emulated", dtype=dtype, batch_size=1, seq_len=GEN_SEQ)
    prompt = PROMPT[:3]
    with nanoq.Trainer(config, options) as tr:
        tr.import_weights(path)
        tokens = tr.generate(prompt, 5, temperature=0)
        logits = tr.logits(np.array([prompt + tokens[:-1]], np.int32))
        assert kv_cache_bytes(tr) > 0
    with open_trainer(path, seq_len=GEN_SEQ) as cpu:
        expected = cpu.logits(np.array([prompt + tokens[:-1]], np.int32))
        if dtype == "fp32":
            assert cpu.generate(prompt, 5, temperature=0) == tokens
    assert logits.dtype == np.float32
    # bf16: weights and activations rounded to 8 bits of mantissa (~1% of the logits' scale).
    atol = LOGITS_ABS if dtype == "fp32" else 2e-2 * np.abs(expected).max()
    np.testing.assert_allclose(logits, expected, rtol=0, atol=atol)


# --------------------------------------------------------------------------
# nanoq generate / nanoq eval
# --------------------------------------------------------------------------

CLI_TEXT = ["The quick brown fox jumps over the lazy dog. " * 3, "A stitch in time saves nine, they say. " * 3]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny random Llama with a trained byte-level BPE tokenizer beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY, randomize_
    from nanoq.tokenization.tokenizer import train_bpe_tokenizer, tokenizer_vocab_size

    tokenizer = train_bpe_tokenizer(CLI_TEXT, 300)
    vocab = tokenizer_vocab_size(tokenizer)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(TINY, vocab_size=vocab, max_position_embeddings=64))).eval()
    randomize_(model, 0)
    path = tmp_path_factory.mktemp("hf") / "tiny"
    model.save_pretrained(str(path))
    tokenizer.save(str(path / "tokenizer.json"))
    return path, model, tokenizer


def invoke(*args):
    from click.testing import CliRunner

    from nanoq_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_nanoq_generate_prints_transformers_greedy_continuation(hf_folder, tmp_path):
    path, model, tokenizer = hf_folder
    prompt = "The quick brown"
    ids = tokenizer.encode(prompt).ids
    result = invoke("generate", path, "--prompt", prompt, "--max-new-tokens", 12, "--temperature", 0,
                    "--backend", "cpu", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    expected = hf_greedy(model, ids, 12)
    eos = tokenizer.token_to_id("<|endoftext|>")
    if eos in expected:  # nanoq stops at the tokenizer's end-of-sequence token, included
        expected = expected[:expected.index(eos) + 1]
    assert out["prompt"] == prompt and out["prompt_ids"] == ids
    assert out["completion_ids"] == expected
    assert out["completion"] == tokenizer.decode(expected, skip_special_tokens=True)
    text = invoke("generate", path, "--prompt", prompt, "--max-new-tokens", 12, "--temperature", 0,
                  "--backend", "cpu")
    assert text.exit_code == 0 and text.output == out["completion"] + "\n"

    # The same weights as a nanoq checkpoint (recording the tokenizer) generate the same.
    config = nanoq.ModelConfig.from_pretrained(path)
    with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", batch_size=1, seq_len=16)) as tr:
        tr.import_weights(path)
        tr.save_checkpoint(tmp_path / "checkpoints", 7, tokenizer_dir=str(path))
    again = invoke("generate", tmp_path / "checkpoints", "--prompt", prompt, "--max-new-tokens", 12,
                   "--temperature", 0, "--backend", "cpu", "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.output)["completion_ids"] == expected
    # A run folder: its checkpoints.
    run = invoke("generate", tmp_path, "--prompt", prompt, "--max-new-tokens", 12, "--temperature", 0,
                 "--backend", "cpu", "--json")
    assert run.exit_code == 0 and json.loads(run.output)["completion_ids"] == expected



def test_nanoq_generate_continues_token_ids_of_a_model_without_a_tokenizer(hf_folder, tmp_path):
    # A Nano import's model has no tokenizer.json: --prompt-ids gives the ids and the completion's are printed.
    import shutil

    path, model, tokenizer = hf_folder
    bare = shutil.copytree(path, tmp_path / "bare", ignore=shutil.ignore_patterns("tokenizer*"))
    ids = tokenizer.encode("The quick brown").ids
    expected = hf_greedy(model, ids, 12)[:12]
    args = ("--max-new-tokens", 12, "--temperature", 0, "--backend", "cpu")
    result = invoke("generate", bare, "--prompt-ids", ",".join(map(str, ids)), *args)
    assert result.exit_code == 0 and result.output == " ".join(map(str, expected)) + "\n", result.output
    result = invoke("generate", bare, "--prompt-ids", " ".join(map(str, ids)), *args, "--json")
    assert json.loads(result.output) == dict(prompt_ids=ids, completion_ids=expected), result.output
    # With a tokenizer the ids are decoded in --json too, and generation stops at its end-of-sequence token.
    result = invoke("generate", path, "--prompt-ids", " ".join(map(str, ids)), *args, "--json")
    out = json.loads(result.output)
    assert out["prompt"] == "The quick brown" and out["prompt_ids"] == ids
    plain = json.loads(invoke("generate", path, "--prompt", "The quick brown", *args, "--json").output)
    assert out["completion_ids"] == plain["completion_ids"] and out["completion"] == plain["completion"]
    for extra, message in ((("--prompt", "The"), "model without a tokenizer"),
                           ((), "give the prompt as --prompt TEXT or as --prompt-ids IDS (one of them)"),
                           (("--prompt-ids", "1 2", "--prompt", "x"), "(one of them)"),
                           (("--prompt-ids", " , "), "--prompt-ids holds no token ids"),
                           (("--prompt-ids", "1 -2"), "non-negative integers) separated by spaces or commas; got '-2'"),
                           (("--prompt-ids", f"1 {model.config.vocab_size}"),
                            f"token id {model.config.vocab_size} is not below the model's vocab size")):
        result = invoke("generate", bare, *extra, "--backend", "cpu")
        if message == "model without a tokenizer":
            message = f"{bare} has no tokenizer (tokenizer.json) for --prompt (give --prompt-ids"
        assert result.exit_code == 1 and message in result.output, (extra, result.output)


def test_a_moved_run_still_finds_its_tokenizer_and_generate_takes_one_given(hf_folder, tmp_path):
    # Checkpoints record the tokenizer folder's absolute path; a run moved or copied with its
    # data finds it by its place relative to the checkpoints.
    path, model, tokenizer = hf_folder
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    shutil.copyfile(os.path.join(path, "tokenizer.json"), run / "data" / "tokenizer.json")
    config = nanoq.ModelConfig.from_pretrained(path)
    with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", batch_size=1, seq_len=16)) as tr:
        tr.import_weights(path)
        tr.save_checkpoint(run / "checkpoints", 7, tokenizer_dir=str(run / "data"))
    moved = tmp_path / "moved"
    os.rename(run, moved)
    prompt = "The quick brown"
    expected = hf_greedy(model, tokenizer.encode(prompt).ids, 12)
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = expected[:expected.index(eos) + 1] if eos in expected else expected
    args = ("--prompt", prompt, "--max-new-tokens", 12, "--temperature", 0, "--backend", "cpu", "--json")
    result = invoke("generate", moved, *args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["completion_ids"] == expected
    result = invoke("export", moved / "checkpoints", "-o", tmp_path / "exported")
    assert result.exit_code == 0 and "warning" not in result.output, result.output
    assert (tmp_path / "exported" / "tokenizer.json").read_bytes() == (moved / "data" / "tokenizer.json").read_bytes()
    # Gone from both places: generate says how to give one, and --tokenizer does; export warns in a line.
    os.remove(moved / "data" / "tokenizer.json")
    result = invoke("generate", moved, *args)
    assert result.exit_code == 1 and "pass --tokenizer FOLDER" in result.output
    result = invoke("generate", moved, "--tokenizer", path, *args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["completion_ids"] == expected
    result = invoke("export", moved / "checkpoints", "-o", tmp_path / "untokenized")
    assert result.exit_code == 0, result.output
    assert (f"warning: the checkpoint's tokenizer directory {run / 'data'} holds no tokenizer.json any more; "
            f"exporting without a tokenizer (pass tokenizer_dir, or nanoq export --tokenizer, to include one)\n"
            ) in result.output
    assert "UserWarning" not in result.output


def test_nanoq_generate_stops_at_the_models_eos_ids_as_transformers_does(hf_folder, tmp_path):
    # An instruct model lists end-of-turn ids beside the EOS in generation_config.json (Llama 3's
    # <|eot_id|>): generate() stops at any of them, and so does nanoq generate.
    import shutil

    path, model, tokenizer = hf_folder
    prompt = "The quick brown"
    greedy = hf_greedy(model, tokenizer.encode(prompt).ids, 12)
    folder = shutil.copytree(path, tmp_path / "instruct")
    end_of_turn = greedy[4]
    json.dump({"eos_token_id": [tokenizer.token_to_id("<|endoftext|>"), end_of_turn]},
              open(folder / "generation_config.json", "w"))
    result = invoke("generate", folder, "--prompt", prompt, "--max-new-tokens", 12, "--temperature", 0,
                    "--backend", "cpu", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["completion_ids"] == greedy[:greedy.index(end_of_turn) + 1]


def test_nanoq_generate_refuses_what_it_cannot_run(hf_folder, tmp_path):
    path, _, _ = hf_folder
    result = invoke("generate", path, "--prompt", "The", "--max-new-tokens", 100, "--backend", "cpu")
    assert result.exit_code != 0 and "exceed the model's 64 positions" in result.output
    # The default (64 new tokens) fits what the 64 positions leave after the prompt instead of failing.
    result = invoke("generate", path, "--prompt", "The", "--temperature", 0, "--backend", "cpu", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert len(out["prompt_ids"]) + len(out["completion_ids"]) <= 64
    result = invoke("generate", tmp_path, "--prompt", "The", "--backend", "cpu")
    assert result.exit_code != 0 and "is not a Hugging Face model folder" in result.output
    result = invoke("generate", path, "--prompt", "The", "--top-p", 0)
    assert result.exit_code != 0 and "--top-p" in result.output


def test_nanoq_eval_equals_transformers_mean_loss_on_the_same_windows(hf_folder, tmp_path):
    from nanoq.data import Dataset
    from nanoq.data.token_file import write_tokens

    path, model, tokenizer = hf_folder
    vocab = model.config.vocab_size
    rng = np.random.default_rng(7)
    for i, count in enumerate([70, 45]):  # 6 + 4 windows of 11 tokens, tails dropped
        write_tokens(tmp_path / f"eval_{i}.bin", rng.integers(0, vocab, count), vocab)
    result = invoke("eval", path, "--data", tmp_path / "eval_*.bin", "--seq-len", 10, "--batch-size", 4,
                    "--backend", "cpu", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)

    inputs, targets = Dataset(str(tmp_path / "eval_*.bin"), 10).read_windows(np.arange(10))
    with torch.no_grad():
        logits = model(torch.tensor(inputs).long()).logits
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).double(),
                                                     torch.tensor(targets).long().reshape(-1)).item()
    assert out["tokens"] == 100 and out["windows"] == 10 and out["batches"] == 3  # the last batch padded
    assert out["loss"] == pytest.approx(expected, rel=1e-5)
    assert out["perplexity"] == pytest.approx(np.exp(expected), rel=1e-5)
    text = invoke("eval", path, "--data", tmp_path / "eval_*.bin", "--seq-len", 10, "--batches", 1,
                  "--backend", "cpu")
    assert text.exit_code == 0 and text.output.startswith("loss ") and "1 batches" in text.output


def test_nanoq_generate_runs_a_lora_checkpoint_unmerged_on_its_base(hf_folder, tmp_path):
    path, _, tokenizer = hf_folder
    prompt = "A stitch in"
    ids = tokenizer.encode(prompt).ids
    eos = tokenizer.token_to_id("<|endoftext|>")
    lora = LoraConfig(rank=4, alpha=8.0, targets="q,v,down")
    options = nanoq.TrainOptions(backend="cpu", batch_size=1, seq_len=16, lora=lora)
    with nanoq.Trainer(nanoq.ModelConfig.from_pretrained(path), options) as tr:
        tr.import_weights(path)
        base = tr.logits(np.array([ids], np.int32))
        set_adapters(tr, random_adapters(tr, seed=5))
        assert np.abs(tr.logits(np.array([ids], np.int32)) - base).max() > 1e-2  # the adapters matter
        expected = tr.generate(ids, 10, temperature=0, stop=[eos])
        tr.save_checkpoint(tmp_path / "lora", 1, tokenizer_dir=str(path))
    result = invoke("generate", tmp_path / "lora", "--prompt", prompt, "--max-new-tokens", 10, "--temperature", 0,
                    "--backend", "cpu", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["completion_ids"] == expected


def test_nanoq_eval_of_packed_documents_equals_transformers_on_each_document(hf_folder, tmp_path):
    from nanoq.data.token_file import write_tokens

    path, model, tokenizer = hf_folder
    vocab = model.config.vocab_size
    rng = np.random.default_rng(8)
    eos = 0
    documents = [np.append(rng.integers(1, vocab, n - 1), eos) for n in (4, 9, 6, 11, 3, 7)]
    write_tokens(tmp_path / "eval_0.bin", np.concatenate(documents), vocab)
    result = invoke("eval", path, "--data", tmp_path / "eval_*.bin", "--seq-len", 10, "--batch-size", 2,
                    "--backend", "cpu", "--packing", "pack", "--json")
    assert result.exit_code != 0 and "EOS id" in result.output  # no tokenize.json names it
    (tmp_path / "tokenize.json").write_text(json.dumps({"eos_id": eos, "packing": "pack"}))
    result = invoke("eval", path, "--data", tmp_path / "eval_*.bin", "--seq-len", 10, "--batch-size", 2,
                    "--backend", "cpu", "--packing", "auto", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    total, count = 0.0, 0
    with torch.no_grad():
        for doc in documents:
            logits = model(torch.tensor(doc[None, :-1]).long()).logits[0].double()
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(doc[1:]).long(), reduction="sum").item()
            count += len(doc) - 1
    assert out["tokens"] == count
    assert out["loss"] == pytest.approx(total / count, rel=1e-5)
    # auto is the default, as for training's eval: files tokenized for packing are evaluated packed.
    result = invoke("eval", path, "--data", tmp_path / "eval_*.bin", "--seq-len", 10, "--batch-size", 2,
                    "--backend", "cpu", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == out
