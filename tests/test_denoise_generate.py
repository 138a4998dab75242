"""Generation for bidirectional (denoising) models by iterative unmasking
(Trainer.denoise, nanoq.generation.denoise, `nanoq generate --steps`).

The prompt is followed by mask tokens; each pass runs the model over the
whole sequence and fills the most confident masked positions, so that all
are filled after `steps` passes. Checked against a loop written here over a
PyTorch bidirectional Llama forward on the same weights (test_packing's,
itself pinned to transformers when causal), and against a stand-in core
whose confidences are chosen, so that the fill order is known exactly.
"""
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import nanoq
from conftest import SEQ, VOCAB, train_options
from nanoq.generation import Sampler, denoise
from test_packing import llama_logits

PROMPT = [5, 9, 3, 77, 101]
NEW = 9      # PROMPT + NEW = 14 <= SEQ
MASK = 127   # an ordinary id of the tiny models' vocabulary, used as the mask


def bidirectional_trainer(checkpoints, **options):
    config = nanoq.ModelConfig.from_pretrained(checkpoints.path("llama"))
    config.causal = False
    trainer = nanoq.Trainer(config, train_options(**options))
    trainer.import_weights(checkpoints.path("llama"))
    return trainer


def reference_logits(model, sequence):
    """float64 logits [T, vocab] of one sequence through the PyTorch bidirectional forward."""
    with torch.no_grad():
        return llama_logits(model, torch.tensor([sequence]), is_causal=False)[0].double()


def reference_greedy_denoise(model, prompt, new, steps, mask):
    """Iterative unmasking written plainly: every pass, each masked position's
    most likely token other than the mask, and its softmax probability; the
    ceil(masked / passes left) most probable positions are filled (the
    earlier first among equals). The block is the trainer's seq_len, the
    positions after the new ones staying masks."""
    sequence = list(prompt) + [mask] * (SEQ - len(prompt))
    masked = set(range(len(prompt), len(prompt) + new))
    for step in range(steps):
        logits = reference_logits(model, sequence)
        logits[:, mask] = -math.inf
        probabilities = torch.softmax(logits, dim=-1)
        confidence, tokens = probabilities.max(dim=-1)
        count = math.ceil(len(masked) / (steps - step))
        for position in sorted(masked, key=lambda p: (-float(confidence[p]), p))[:count]:
            sequence[position] = int(tokens[position])
            masked.remove(position)
    assert not masked
    return sequence[len(prompt):len(prompt) + new]


def reference_sampled_denoise(model, prompt, new, steps, mask, sampler):
    """The same loop with the sampler choosing each masked position's token
    (in position order) from the PyTorch logits."""
    sequence = list(prompt) + [mask] * (SEQ - len(prompt))
    masked = list(range(len(prompt), len(prompt) + new))
    for step in range(steps):
        logits = reference_logits(model, sequence).float().numpy()
        logits[:, mask] = -np.inf
        chosen = {p: sampler.choose(logits[p]) for p in masked}
        count = math.ceil(len(masked) / (steps - step))
        fill = sorted(masked, key=lambda p: (-chosen[p][1], p))[:count]
        for position in fill:
            sequence[position] = chosen[position][0]
        masked = [p for p in masked if p not in fill]
    assert not masked
    return sequence[len(prompt):len(prompt) + new]


@pytest.mark.parametrize("steps", [1, 3, NEW])
def test_greedy_denoise_equals_the_pytorch_reference_loop_token_for_token(checkpoints, steps):
    model = checkpoints.model("llama")
    with bidirectional_trainer(checkpoints) as tr:
        ids = tr.denoise(PROMPT, NEW, steps, MASK, temperature=0)
        # top_k 1 is greedy too (at temperature 1 the confidences are the same softmax)
        assert tr.denoise(PROMPT, NEW, steps, MASK, temperature=1.0, top_k=1) == ids
    assert ids == reference_greedy_denoise(model, PROMPT, NEW, steps, MASK)
    assert len(ids) == NEW and MASK not in ids


def test_more_passes_see_the_tokens_filled_before(checkpoints):
    """With several passes a position is chosen given the tokens already
    filled, so the result differs from one pass's argmax of every position."""
    with bidirectional_trainer(checkpoints) as tr:
        one_pass = tr.denoise(PROMPT, NEW, 1, MASK, temperature=0)
        logits = tr.logits(np.array([PROMPT + [MASK] * (SEQ - len(PROMPT))]))[0, len(PROMPT):len(PROMPT) + NEW]
        logits[:, MASK] = -np.inf
        assert one_pass == [int(t) for t in logits.argmax(-1)]
        assert tr.denoise(PROMPT, NEW, NEW, MASK, temperature=0) != one_pass


def test_seeded_sampling_is_reproducible_equals_the_reference_and_seeds_differ(checkpoints):
    model = checkpoints.model("llama")
    kwargs = dict(temperature=1.0, top_k=20, top_p=0.95)
    with bidirectional_trainer(checkpoints) as tr:
        first = tr.denoise(PROMPT, NEW, 3, MASK, seed=4, **kwargs)
        again = tr.denoise(PROMPT, NEW, 3, MASK, seed=4, **kwargs)
        others = [tr.denoise(PROMPT, NEW, 3, MASK, seed=s, **kwargs) for s in (5, 6)]
        unrestricted = tr.denoise([], NEW, 2, MASK, seed=1)  # an empty prompt: all positions masked
    assert first == again
    assert all(other != first for other in others)
    assert first == reference_sampled_denoise(model, PROMPT, NEW, 3, MASK, Sampler(seed=4, **kwargs))
    assert unrestricted == reference_sampled_denoise(model, [], NEW, 2, MASK, Sampler(seed=1))
    assert MASK not in first + unrestricted


class ChosenConfidenceCore:
    """A stand-in CoreTrainer: at position p the logits favour token
    TOKEN[p] by MARGIN[p] over the other ordinary tokens (more margin, more
    confidence), whatever the sequence holds, and favour the mask token
    (id 0) above all, which denoise must never choose. Records each pass's
    input sequence."""

    vocab_size = 6
    seq_len = 12
    # Positions 0, 1: the prompt; 10, 11: the block's rest, which stays masked.
    MARGIN = [0.0, 0.0, 3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 20.0, 20.0]
    TOKEN = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]

    def __init__(self):
        self.passes = []

    def forward_cached(self, tokens, position, all_positions, out):
        assert position == 0 and all_positions
        self.passes.append(np.array(tokens))
        logits = out.reshape(len(tokens), self.vocab_size)
        logits[:] = 0.0
        for p in range(len(tokens)):
            logits[p, self.TOKEN[p]] = self.MARGIN[p]
            logits[p, 0] = 50.0


def test_each_pass_fills_the_most_confident_masked_positions_and_all_by_the_last():
    core = ChosenConfidenceCore()
    mask, prompt = 0, [3, 4]
    new = denoise(core, prompt, 8, 3, mask, Sampler(temperature=0))
    assert new == ChosenConfidenceCore.TOKEN[2:10]
    # 8 masks in 3 passes: ceil(8/3) = 3, then ceil(5/2) = 3, then 2. Confidence order of
    # positions 2..9: 7 (9.0), 9 (6.0), 6 (5.0) | 4 (4.0), 2 (3.0), 8 (2.0) | 3, 5 (1.0, 1.0).
    filled_before = [[], [7, 9, 6], [7, 9, 6, 4, 2, 8]]
    assert len(core.passes) == 3
    for seen, filled in zip(core.passes, filled_before):
        assert list(seen[:2]) == prompt
        assert len(seen) == core.seq_len and list(seen[10:]) == [mask, mask]  # the most confident, never filled
        for p in range(2, 10):
            assert seen[p] == (ChosenConfidenceCore.TOKEN[p] if p in filled else mask), (seen, filled)
    # One pass per position: the same order, one at a time; equal confidences go in position order.
    core = ChosenConfidenceCore()
    denoise(core, prompt, 8, 8, mask, Sampler(temperature=0))
    newly = [int(np.flatnonzero(after != before)[0]) for before, after in zip(core.passes, core.passes[1:])]
    assert newly == [7, 9, 6, 4, 2, 8, 3]  # and position 5 in the last pass


def test_denoise_arguments_are_checked_naming_the_argument(checkpoints):
    with bidirectional_trainer(checkpoints) as tr:
        for kwargs, error, message in [
            (dict(mask_token=VOCAB), ValueError, f"mask_token {VOCAB} is outside the vocabulary"),
            (dict(mask_token=-1), ValueError, "mask_token -1 is outside"),
            (dict(mask_token=1.0), TypeError, "mask_token must be an int"),
            (dict(steps=0), ValueError, r"steps must be in \[1, max_new_tokens 9\]"),
            (dict(steps=NEW + 1), ValueError, "steps must be in"),
            (dict(steps=2.5), TypeError, "steps must be an int"),
            (dict(max_new_tokens=0, steps=1), ValueError, "max_new_tokens must be >= 1"),
            (dict(max_new_tokens=SEQ, steps=1), ValueError, "more than seq_len 16"),
            (dict(prompt_ids=[1, VOCAB]), ValueError, r"token id 128 at prompt_ids\[1\]"),
            (dict(prompt_ids="hello"), TypeError, "tokenize it first"),
            (dict(temperature=-1.0), ValueError, "temperature must be >= 0"),
        ]:
            args = dict(dict(prompt_ids=PROMPT, max_new_tokens=NEW, steps=2, mask_token=MASK), **kwargs)
            with pytest.raises(error, match=message):
                tr.denoise(**args)
        with pytest.raises(ValueError, match=r"bidirectional.*use denoise\(prompt_ids"):
            tr.generate(PROMPT, 4)
    with nanoq.Trainer(nanoq.ModelConfig.from_pretrained(checkpoints.path("llama")), train_options()) as tr:
        with pytest.raises(ValueError, match="this one is causal: use generate"):
            tr.denoise(PROMPT, NEW, 2, MASK)


# --------------------------------------------------------------------------
# nanoq generate on a bidirectional checkpoint
# --------------------------------------------------------------------------


def invoke(*args):
    from click.testing import CliRunner

    from nanoq_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def denoise_run(tmp_path_factory):
    """A checkpoint of a tiny bidirectional model with learned positions (random weights; as Nano's
    denoising configs, which turn RoPE off) whose run
    recorded a trained BPE tokenizer holding <mask> and [MASK], and the
    trainer of that checkpoint."""
    from test_generate import CLI_TEXT
    from nanoq.tokenization.tokenizer import tokenizer_vocab_size, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("denoise")
    tokenizer = train_bpe_tokenizer(CLI_TEXT, 300)
    tokenizer.add_special_tokens(["<mask>", "[MASK]"])
    (root / "tok").mkdir()
    tokenizer.save(str(root / "tok" / "tokenizer.json"))
    config = nanoq.ModelConfig(vocab_size=tokenizer_vocab_size(tokenizer), hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=32, position_embedding="learned",
                               causal=False)
    trainer = nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", batch_size=1, seq_len=32))
    trainer.init_weights(seed=3)
    trainer.save_checkpoint(root / "run" / "checkpoints", 5, tokenizer_dir=str(root / "tok"))
    yield root, tokenizer, trainer
    trainer.close()


def test_nanoq_generate_denoises_with_a_bidirectional_checkpoint(denoise_run):
    root, tokenizer, trainer = denoise_run
    prompt = "The quick brown"
    ids = tokenizer.encode(prompt).ids
    eos = tokenizer.token_to_id("<|endoftext|>")

    def expected(steps, mask, **kwargs):
        out = trainer.denoise(ids, 10, steps, mask, **kwargs)
        return out[:out.index(eos) + 1] if eos in out else out

    def run(*args):
        result = invoke("generate", root / "run", "--prompt", prompt, "--max-new-tokens", 10, "--backend", "cpu",
                        "--json", *args)
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    angle, square = tokenizer.token_to_id("<mask>"), tokenizer.token_to_id("[MASK]")
    out = run("--steps", 4, "--temperature", 0)  # the tokenizer's mask token: <mask>, the first known name
    assert out["prompt_ids"] == ids and out["completion_ids"] == expected(4, angle, temperature=0)
    assert out["completion"] == tokenizer.decode(out["completion_ids"], skip_special_tokens=True)
    assert expected(4, square, temperature=0) != out["completion_ids"]  # so the mask used shows
    assert run("--steps", 4, "--temperature", 0, "--mask-token", "[MASK]")["completion_ids"] == \
        expected(4, square, temperature=0)
    assert run("--steps", 4, "--temperature", 0, "--mask-token", square)["completion_ids"] == \
        expected(4, square, temperature=0)
    sampled = run("--steps", 3, "--seed", 2, "--top-k", 40)
    assert sampled["completion_ids"] == expected(3, angle, seed=2, top_k=40)
    assert run()["completion_ids"] == expected(10, angle)  # --steps: --max-new-tokens by default
    text = invoke("generate", root / "run", "--prompt", prompt, "--max-new-tokens", 10, "--steps", 3, "--seed", 2,
                  "--top-k", 40, "--backend", "cpu")
    assert text.exit_code == 0 and text.output == sampled["completion"] + "\n"

    # A tokenizer_config.json naming the mask token wins over the known names.
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"mask_token": {"content": "[MASK]"}}))
    try:
        assert run("--steps", 4, "--temperature", 0)["completion_ids"] == expected(4, square, temperature=0)
    finally:
        (root / "tok" / "tokenizer_config.json").unlink()


def test_nanoq_generate_refuses_what_denoising_cannot_run(denoise_run, tmp_path):
    from test_generate import CLI_TEXT
    from nanoq.tokenization.tokenizer import train_bpe_tokenizer

    root, _, trainer = denoise_run

    def fails(model, *args):
        result = invoke("generate", model, "--prompt", "The", "--backend", "cpu", "--max-new-tokens", 8, *args)
        assert result.exit_code != 0
        return result.output

    assert "--steps 5 is more than --max-new-tokens 4" in fails(root / "run", "--steps", 5,
                                                                "--max-new-tokens", 4)
    assert "outside the model's vocabulary" in fails(root / "run", "--mask-token", 100000)
    assert "'<blank>' is not in the vocabulary" in fails(root / "run", "--mask-token", "<blank>")
    assert "exceed the model's 32 positions" in fails(root / "run", "--max-new-tokens", 40, "--steps", 2)
    # A tokenizer without a mask token: ask for --mask-token.
    plain = tmp_path / "plain"
    plain.mkdir()
    train_bpe_tokenizer(CLI_TEXT, 300).save(str(plain / "tokenizer.json"))
    trainer.save_checkpoint(tmp_path / "plain-run" / "checkpoints", 1, tokenizer_dir=str(plain))
    output = fails(tmp_path / "plain-run", "--steps", 2)
    assert "has no mask token" in output and "for nanoq generate: pass --mask-token" in output
    assert "(data.mask_token)" not in output  # (a training setting: not what this command takes)
    # nanoq eval names itself (it named generate's option).
    data = tmp_path / "eval.bin"
    from nanoq.data import write_tokens

    write_tokens(data, np.arange(200) % 50, 300)
    result = invoke("eval", tmp_path / "plain-run", "--data", data, "--objective", "denoise", "--backend", "cpu")
    assert result.exit_code != 0 and "for nanoq eval: pass --mask-token" in result.output, result.output
    # ... unless the run names one (data.mask_token in its config.toml), which it trained with.
    (tmp_path / "plain-run" / "config.toml").write_text('[model]\ncausal = false\n[data]\nmask_token = "7"\n'
                                                        '[train]\nobjective = "denoise"\n')
    ids = train_bpe_tokenizer(CLI_TEXT, 300).encode("The").ids
    result = invoke("generate", tmp_path / "plain-run", "--prompt", "The", "--backend", "cpu", "--max-new-tokens", 8,
                    "--steps", 2, "--temperature", 0, "--json")
    assert result.exit_code == 0, result.output
    expected = trainer.denoise(ids, 8, 2, 7, temperature=0)
    assert json.loads(result.output)["completion_ids"] == expected[:len(json.loads(result.output)["completion_ids"])]
    # A run trained for seq2seq never saw masks to fill: refused (it filled them with tokens of noise).
    (tmp_path / "plain-run" / "config.toml").write_text('[model]\ncausal = false\n[train]\nobjective = "seq2seq"\n')
    output = fails(tmp_path / "plain-run", "--steps", 2, "--mask-token", 3)
    assert "was trained for train.objective seq2seq; nanoq generate fills masked positions" in output
    # A causal model takes neither option.
    config = dataclasses.replace(trainer.config, causal=True)
    with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", batch_size=1, seq_len=32)) as causal:
        causal.init_weights(seed=3)
        causal.save_checkpoint(tmp_path / "causal-run" / "checkpoints", 1, tokenizer_dir=str(root / "tok"))
    assert "are for bidirectional (denoising) models" in fails(tmp_path / "causal-run", "--steps", 2)
