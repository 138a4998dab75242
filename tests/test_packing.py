"""Packed documents (per-token positions) and bidirectional attention, through the Trainer.

A row that packs several documents with their positions must compute what
each document computes alone: the reference runs transformers on every
document separately and sums the per-document losses over the same tokens
(one mean over all counted tokens, as nanoq reports it). Bidirectional
attention (model.causal False) is checked against a Llama forward written
here in PyTorch with scaled_dot_product_attention(is_causal=False); the same
forward with is_causal=True is first checked against transformers, so the
reference itself is pinned. fp32 on the cpu backend; tolerances as
test_reference.py's (fp32 against fp32 torch: ~1e-6 in loss, ~2e-6 of a
tensor's max |grad|).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nanoq
from conftest import (
    IGNORE,
    SEQ,
    VOCAB,
    assert_tensors_close,
    open_trainer,
    param_grads,
    token_terms,
    torch_backward,
    train_options,
)

LOSS_REL = 1e-5
GRAD_REL = 3e-5


def pack_rows(documents, rows, seq_len=SEQ):
    """Packs (inputs, targets) documents in order into `rows` rows of seq_len:
    a document goes whole into the current row, or starts the next; the rest
    of a row is padding (token 0, target ignored, position 0). Returns inputs, targets,
    positions, all int32 [rows, seq_len]."""
    inputs = np.zeros((rows, seq_len), np.int32)
    targets = np.full((rows, seq_len), IGNORE, np.int32)
    positions = np.zeros((rows, seq_len), np.int32)
    row, at = 0, 0
    for x, y in documents:
        n = len(x)
        if at + n > seq_len:
            row, at = row + 1, 0
        inputs[row, at:at + n], targets[row, at:at + n] = x, y
        positions[row, at:at + n] = np.arange(n)
        at += n
    # Padding tokens are one-token documents (position 0) that are never a target.
    return inputs, targets, positions


def random_documents(rng, lengths, mask_frac=0.2):
    documents = []
    for n in lengths:
        tokens = rng.integers(0, VOCAB, size=n + 1)
        y = tokens[1:].astype(np.int32)
        y[rng.random(n) < mask_frac] = IGNORE
        documents.append((tokens[:-1].astype(np.int32), y))
    return documents


# Row 0: documents of 5, 7 and 3 tokens and one padding token; row 1: a
# whole window; row 2: 9 and 6 tokens, then padding.
LENGTHS = [5, 7, 3, SEQ, 9, 6]


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_packed_rows_match_each_document_run_alone(checkpoints, variant):
    documents = random_documents(np.random.default_rng(3), LENGTHS)
    inputs, targets, positions = pack_rows(documents, rows=3)
    assert (positions[:, 0] == 0).all() and (positions == 0).sum() == len(LENGTHS) + 2  # and 2 padding tokens
    ref = torch_backward(checkpoints.model(variant), [(x[None], y[None]) for x, y in documents])
    with open_trainer(checkpoints.path(variant), batch_size=3) as tr:
        tr.step(inputs, targets, positions=positions)
        grads = tr.get_gradients()
        stats = tr.update(lr=1e-3)
        evaluated = tr.validate(inputs, targets, positions=positions)
        unpacked = tr.validate(inputs, targets)  # the same rows attending across documents
    assert stats.tokens == ref.tokens == int((targets != IGNORE).sum())
    assert stats.loss == pytest.approx(ref.loss, rel=LOSS_REL)
    assert_tensors_close(grads, ref.grads, GRAD_REL, f"{variant} packed grad")
    assert stats.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
    assert evaluated.tokens == ref.tokens
    # After the update the weights moved: the packed validate differs from
    # the unpacked one, which lets documents see each other.
    assert abs(evaluated.loss - unpacked.loss) > 1e-4


def test_logits_of_packed_rows_are_those_of_each_document_alone(checkpoints):
    documents = random_documents(np.random.default_rng(7), [5, 7, 3, SEQ])
    inputs, _, positions = pack_rows(documents, rows=2)
    model = checkpoints.model("llama")
    with open_trainer(checkpoints.path("llama")) as tr:
        logits = tr.logits(inputs, positions=positions)
        with pytest.raises(ValueError, match=r"positions\[0, 0\] is 5"):
            tr.logits(inputs, positions=np.full_like(positions, 5))
    at = [(0, 0), (0, 5), (0, 12), (1, 0)]
    for (row, first), (x, _) in zip(at, documents):
        with torch.no_grad():
            expected = model(input_ids=torch.from_numpy(x[None]).long()).logits[0].numpy()
        got = logits[row, first:first + len(x)]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_without_positions_a_step_is_bitwise_unchanged_and_positions_0_to_T_are_the_default(checkpoints):
    """positions 0 .. T-1 in every row are one document per row: the same
    numbers as no positions, and steps without positions stay bitwise what
    they were before a packed step ran on the same trainer."""
    rng = np.random.default_rng(4)
    inputs = rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32)
    targets = rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32)
    whole = np.tile(np.arange(SEQ, dtype=np.int32), (2, 1))
    path = checkpoints.path("llama")
    with open_trainer(path) as plain, open_trainer(path) as mixed:
        plain.step(inputs, targets)
        expected = plain.get_gradients()
        mixed.step(inputs, targets, positions=whole)
        with_positions = mixed.get_gradients()
        mixed.update(lr=0.0)
        plain.update(lr=0.0)
        mixed.step(inputs, targets)
        again = mixed.get_gradients()
    for name in expected:
        np.testing.assert_allclose(with_positions[name], expected[name], rtol=0, atol=1e-6 * np.abs(expected[name]).max())
        np.testing.assert_array_equal(again[name], expected[name])


def test_two_processes_with_packed_rows_match_one_trainer_of_two_devices_bitwise(checkpoints):
    """Each process passes the positions of its own rows (ThreadWorld members)."""
    from nanoq.testing.threads import ThreadWorld
    from test_topology import in_threads

    documents = random_documents(np.random.default_rng(6), [5, 7, 3, 9, 6, 8, 8, 2, 11])
    inputs, targets, positions = pack_rows(documents, rows=4)
    path = checkpoints.path("qwen3")
    config = nanoq.ModelConfig.from_pretrained(path)

    def options(devices):  # one thread per device on both sides: the same sums
        return nanoq.TrainOptions(backend="cpu", devices=devices, batch_size=2, seq_len=SEQ, threads=1)

    with nanoq.Trainer(config, options(2)) as tr:
        tr.import_weights(path)
        tr.step(inputs, targets, positions=positions)
        expected_loss = tr.update(lr=1e-2).loss
        expected = tr.get_weights()
    world = ThreadWorld(2)

    def member(rank):
        def go():
            with nanoq.Trainer(config, options(1), processes=world.member(rank)) as tr:
                tr.import_weights(path)
                rows = slice(2 * rank, 2 * rank + 2)
                tr.step(inputs[rows], targets[rows], positions=np.ascontiguousarray(positions[rows]))
                return tr.update(lr=1e-2).loss, tr.get_weights()
        return go

    results, errors = in_threads([member(0), member(1)])
    assert errors == [None, None], errors
    for loss, got in results:
        assert loss == expected_loss
        for name, value in expected.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_positions_are_checked(checkpoints):
    inputs = np.zeros((2, SEQ), np.int32)
    good = np.tile(np.arange(SEQ, dtype=np.int32), (2, 1))
    with open_trainer(checkpoints.path("llama")) as tr:
        with pytest.raises(TypeError, match="positions must have dtype int32"):
            tr.step(inputs, inputs, positions=good.astype(np.int64))
        with pytest.raises(ValueError, match=r"positions must have shape \(2, 16\)"):
            tr.step(inputs, inputs, positions=good[:1])
        bad = good.copy()
        bad[1, 0] = 3
        with pytest.raises(ValueError, match=r"positions\[1, 0\] is 3"):
            tr.step(inputs, inputs, positions=bad)
        bad = good.copy()
        bad[0, 5] = 7
        with pytest.raises(ValueError, match=r"positions\[0, 5\] is 7"):
            tr.validate(inputs, inputs, positions=bad)
        assert tr._core.micro_steps == 0  # nothing was queued


# --------------------------------------------------------------------------
# Bidirectional attention (model.causal False)
# --------------------------------------------------------------------------


def rotate_half_split(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def llama_logits(model, inputs, is_causal):
    """A Llama forward in plain PyTorch on `model`'s weights, attention by
    F.scaled_dot_product_attention(is_causal=...)."""
    config = model.config
    m = model.model
    H, K = config.num_attention_heads, config.num_key_value_heads
    D = config.hidden_size // H
    B, T = inputs.shape
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = angles.cos().float(), angles.sin().float()

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    x = m.embed_tokens.weight[inputs]
    for layer in m.layers:
        a = layer.self_attn
        h = norm(x, layer.input_layernorm.weight)
        q = (h @ a.q_proj.weight.T).view(B, T, H, D).transpose(1, 2)
        k = (h @ a.k_proj.weight.T).view(B, T, K, D).transpose(1, 2)
        v = (h @ a.v_proj.weight.T).view(B, T, K, D).transpose(1, 2)
        q, k = rotate_half_split(q, cos, sin), rotate_half_split(k, cos, sin)
        k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        x = x + attended.transpose(1, 2).reshape(B, T, H * D) @ a.o_proj.weight.T
        h = norm(x, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        x = x + (F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return norm(x, m.norm.weight) @ model.lm_head.weight.T


def test_bidirectional_attention_matches_torch_sdpa(checkpoints, tmp_path):
    rng = np.random.default_rng(5)
    inputs = rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32)
    targets = rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32)
    targets[rng.random(targets.shape) < 0.2] = IGNORE
    model = checkpoints.model("llama")
    tokens = torch.from_numpy(inputs).long()
    with torch.no_grad():  # the reference forward is transformers' when causal
        hf = model(input_ids=tokens).logits
        torch.testing.assert_close(llama_logits(model, tokens, True), hf, rtol=1e-5, atol=1e-5)
    model.zero_grad(set_to_none=True)
    logits = llama_logits(model, tokens, False)
    target = torch.from_numpy(targets).long()
    counted = target != IGNORE
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=IGNORE, reduction="sum")
    (loss / counted.sum()).backward()
    expected_grads = param_grads(model)

    config = nanoq.ModelConfig.from_pretrained(checkpoints.path("llama"))
    config.causal = False
    with nanoq.Trainer(config, train_options()) as tr:
        tr.import_weights(checkpoints.path("llama"))
        logits = tr.logits(inputs)  # the whole-sequence pass of the KV-cache path
        tr.step(inputs, targets)
        grads = tr.get_gradients()
        stats = tr.update(lr=1e-3)
        with pytest.raises(ValueError, match="causal"):
            tr.step(inputs, targets, positions=np.zeros_like(inputs))
        with pytest.raises(ValueError, match="bidirectional"):
            tr.generate([1, 2, 3], 2)
        with pytest.raises(ValueError, match="bidirectional"):
            tr.export_model(tmp_path / "export")
    with torch.no_grad():
        reference_logits = llama_logits(checkpoints.model("llama"), tokens, False).numpy()
    np.testing.assert_allclose(logits, reference_logits, rtol=0, atol=1e-5 * np.abs(reference_logits).max())
    assert stats.tokens == int(counted.sum())
    assert stats.loss == pytest.approx(float(loss.detach()) / int(counted.sum()), rel=LOSS_REL)
    assert_tensors_close(grads, expected_grads, GRAD_REL, "bidirectional grad")


def test_packed_rows_of_a_learned_position_model_match_each_document_in_its_own_row():
    """With a learned position table (no RoPE) the packed documents index the
    table by their own positions: the same loss and gradients as each
    document alone at the start of a row (the single-document runs being
    checked against PyTorch in test_model_options.py)."""
    config = nanoq.ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, position_embedding="learned",
                               max_position_embeddings=SEQ, qkv_bias=True, o_bias=True, mlp_bias=True)
    documents = random_documents(np.random.default_rng(9), LENGTHS)
    inputs, targets, positions = pack_rows(documents, rows=3)
    alone_inputs = np.zeros((len(documents), SEQ), np.int32)
    alone_targets = np.full((len(documents), SEQ), IGNORE, np.int32)
    for row, (x, y) in enumerate(documents):
        alone_inputs[row, :len(x)], alone_targets[row, :len(y)] = x, y
    results = []
    for rows, batch in ((3, (inputs, targets, positions)), (len(documents), (alone_inputs, alone_targets, None))):
        with nanoq.Trainer(config, train_options(batch_size=rows)) as tr:
            tr.init_weights(5)
            tr.step(*batch)
            results.append((tr.get_gradients(), tr.update(lr=1e-3)))
    (packed, packed_stats), (alone, alone_stats) = results
    assert packed_stats.tokens == alone_stats.tokens
    assert packed_stats.loss == pytest.approx(alone_stats.loss, rel=LOSS_REL)
    # A key bias shifts every score of a query alike: its gradient is zero up to rounding.
    key_biases = [name for name in alone if name.endswith("k_proj.bias")]
    assert max(float(np.abs(packed[n]).max()) for n in key_biases) < 1e-8
    assert_tensors_close({n: g for n, g in packed.items() if n not in key_biases},
                         {n: g for n, g in alone.items() if n not in key_biases}, GRAD_REL,
                         "learned positions packed grad")
    assert np.abs(packed["model.embed_positions.weight"]).max() > 0
