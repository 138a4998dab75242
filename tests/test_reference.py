"""nanoq against PyTorch / Hugging Face on every supported architecture variant.

Tolerances: a fp32 torch run differs from a fp64 one by ~2e-6 (relative to a
tensor's max |grad|) on these models, by < 1e-6 in loss, and after 10 AdamW
steps by ~1e-4 of max |w| (Adam turns tiny gradient differences of near-zero
elements into O(lr) updates).  The bounds below leave ~10x margin on that.
"""

import json
import math
import os
import shutil

import numpy as np
import pytest

import nanoq
from conftest import (
    IGNORE,
    NANOQ_CONFIG,
    SEQ,
    VARIANTS,
    TorchTrainer,
    assert_config_matches,
    assert_same_tensors,
    assert_tensors_close,
    assert_trained_weights_close,
    build_hf_model,
    model_weights,
    open_trainer,
    random_batch,
    run_steps,
    save_hf_model,
    torch_backward,
    train_options,
    write_config,
)

LOSS_REL = 1e-5
GRAD_REL = 3e-5
TRAIN_LOSS_REL = 5e-5
WEIGHT_REL = 5e-4


def assert_stats_match(stats, ref, loss_rel=LOSS_REL):
    assert stats.tokens == ref.tokens
    assert stats.loss == pytest.approx(ref.loss, rel=loss_rel)
    assert stats.lse_max == pytest.approx(ref.lse_max, rel=loss_rel)
    assert stats.lse_mean == pytest.approx(ref.lse_mean, rel=loss_rel)


# --------------------------------------------------------------------------
# Single step: loss and gradients
# --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_and_every_gradient_match_torch(checkpoints, variant):
    batch = random_batch(np.random.default_rng(1), rows=4)
    ref = torch_backward(checkpoints.model(variant), [batch])
    with open_trainer(checkpoints.path(variant), batch_size=4) as tr:
        tr.step(*batch)
        grads = tr.get_gradients()
        stats = tr.update(lr=1e-3)
    assert_tensors_close(grads, ref.grads, GRAD_REL, f"{variant} grad")
    assert_stats_match(stats, ref)
    assert stats.tokens == 4 * SEQ
    assert stats.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
    assert stats.z_loss == 0.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_imported_weights_round_trip_under_hf_names(checkpoints, variant):
    """get_weights() after import returns exactly the checkpoint, keyed by HF
    parameter names (no lm_head.weight for tied embeddings)."""
    expected = model_weights(checkpoints.model(variant))
    with open_trainer(checkpoints.path(variant)) as tr:
        assert_same_tensors(tr.get_weights(), expected, f"{variant} weight")
    assert ("lm_head.weight" in expected) == (variant != "llama_tied")


@pytest.mark.parametrize("variant", ["llama", "llama_tied", "qwen3"])
def test_ignored_targets_are_excluded_from_loss_and_gradients(checkpoints, variant):
    inputs, targets = random_batch(np.random.default_rng(2), rows=4, mask_frac=0.4)
    targets[2, :] = IGNORE  # a row with nothing counted
    batch = (inputs, targets)
    ref = torch_backward(checkpoints.model(variant), [batch])
    with open_trainer(checkpoints.path(variant), batch_size=4) as tr:
        tr.step(*batch)
        grads = tr.get_gradients()
        stats = tr.update(lr=1e-3)
    assert ref.tokens == int((targets != IGNORE).sum()) < 3 * SEQ
    assert_stats_match(stats, ref)
    assert_tensors_close(grads, ref.grads, GRAD_REL, f"{variant} grad")


def test_inputs_under_ignored_tail_do_not_affect_loss_or_gradients(checkpoints):
    """With causal attention, inputs at positions whose targets (and all later
    targets) are ignored cannot influence anything that is counted."""
    rng = np.random.default_rng(3)
    inputs, targets = random_batch(rng, rows=2)
    targets[:, 10:] = IGNORE
    other = inputs.copy()
    other[:, 10:] = rng.integers(0, 128, size=(2, SEQ - 10))
    assert not np.array_equal(other, inputs)
    results = []
    for inp in (inputs, other):
        with open_trainer(checkpoints.path("llama")) as tr:
            tr.step(inp, targets)
            grads = tr.get_gradients()
            results.append((tr.update(lr=1e-3), grads))
    (s1, g1), (s2, g2) = results
    assert s1.tokens == s2.tokens == 20
    assert s1.loss == pytest.approx(s2.loss, rel=1e-6)
    assert_tensors_close(g2, g1, 1e-6, "grad")


def test_lse_statistics_match_torch_over_counted_tokens(checkpoints):
    inputs, targets = random_batch(np.random.default_rng(4), rows=2, mask_frac=0.3)
    ref = torch_backward(checkpoints.model("qwen2"), [(inputs, targets)])
    # Sanity: the statistics over counted tokens differ from the unmasked ones,
    # so a test passing here means the mask is honoured.
    full = torch_backward(checkpoints.model("qwen2"), [(inputs, inputs)])
    assert abs(full.lse_mean - ref.lse_mean) > 1e-4
    with open_trainer(checkpoints.path("qwen2")) as tr:
        tr.step(inputs, targets)
        stats = tr.update(lr=1e-3)
    assert stats.lse_max == pytest.approx(ref.lse_max, rel=1e-5)
    assert stats.lse_mean == pytest.approx(ref.lse_mean, rel=1e-5)


@pytest.mark.parametrize("variant", ["llama", "llama_tied"])
def test_z_loss_gradient_matches_torch_and_is_reported_separately(checkpoints, variant):
    z = 2e-2
    batch = random_batch(np.random.default_rng(5), rows=2, mask_frac=0.2)
    ref = torch_backward(checkpoints.model(variant), [batch], z_loss=z)
    plain = torch_backward(checkpoints.model(variant), [batch], z_loss=0.0)
    # The z term must change the gradients far beyond the tolerance.
    assert max(
        np.abs(ref.grads[n] - plain.grads[n]).max() / np.abs(ref.grads[n]).max() for n in ref.grads
    ) > 100 * GRAD_REL
    with open_trainer(checkpoints.path(variant), z_loss=z) as tr:
        tr.step(*batch)
        grads = tr.get_gradients()
        stats = tr.update(lr=1e-3)
    assert_tensors_close(grads, ref.grads, GRAD_REL, f"{variant} z-loss grad")
    assert stats.loss == pytest.approx(ref.loss, rel=LOSS_REL)  # CE only
    assert stats.z_loss == pytest.approx(ref.z_loss, rel=LOSS_REL)
    assert ref.z_loss > 0.1  # visibly nonzero, and not folded into .loss
    assert stats.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)


def test_loss_1k_equals_loss_for_sequences_up_to_1024(checkpoints):
    batch = random_batch(np.random.default_rng(6), rows=2, mask_frac=0.25)
    with open_trainer(checkpoints.path("llama")) as tr:
        tr.step(*batch)
        stats = tr.update(lr=1e-3)
    assert stats.loss_1k == pytest.approx(stats.loss, rel=1e-6)


def test_loss_1k_is_mean_over_positions_below_1024(tmp_path):
    """seq_len 1100: loss_1k averages only counted targets at positions < 1024."""
    seq = 1100
    model = build_hf_model(
        "llama",
        seed=7,
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    path = save_hf_model(model, tmp_path / "long")
    inputs, targets = random_batch(np.random.default_rng(7), rows=1, seq_len=seq, vocab=64, mask_frac=0.1)
    ref = torch_backward(model, [(inputs, targets)])
    assert abs(ref.loss_1k - ref.loss) > 10 * LOSS_REL * ref.loss  # the test tells the two apart
    with open_trainer(path, batch_size=1, seq_len=seq) as tr:
        tr.step(inputs, targets)
        stats = tr.update(lr=1e-3)
    assert stats.loss == pytest.approx(ref.loss, rel=LOSS_REL)
    assert stats.loss_1k == pytest.approx(ref.loss_1k, rel=LOSS_REL)


def test_validate_matches_torch_and_leaves_gradients_and_weights_alone(checkpoints):
    rng = np.random.default_rng(8)
    train, held_out = random_batch(rng, rows=2), random_batch(rng, rows=2, mask_frac=0.2)
    ref_train = torch_backward(checkpoints.model("qwen3"), [train])
    ref_val = torch_backward(checkpoints.model("qwen3"), [held_out])
    with open_trainer(checkpoints.path("qwen3")) as tr:
        before = tr.get_weights()
        tr.step(*train)
        v = tr.validate(*held_out)
        assert_same_tensors(tr.get_weights(), before, "weight")
        grads = tr.get_gradients()
        stats = tr.update(lr=1e-3)
    assert_stats_match(v, ref_val)
    assert math.isnan(v.grad_norm)
    assert_tensors_close(grads, ref_train.grads, GRAD_REL, "grad after validate")
    assert_stats_match(stats, ref_train)


def test_gradients_mid_accumulation_are_the_mean_over_tokens_so_far(checkpoints):
    rng = np.random.default_rng(9)
    micro = [random_batch(rng, rows=2, mask_frac=f) for f in (0.0, 0.5, 0.2)]
    ref_two = torch_backward(checkpoints.model("llama"), micro[:2])
    ref_all = torch_backward(checkpoints.model("llama"), micro)
    with open_trainer(checkpoints.path("llama"), grad_accum=3) as tr:
        tr.step(*micro[0])
        tr.step(*micro[1])
        grads_two = tr.get_gradients()
        tr.step(*micro[2])
        grads_all = tr.get_gradients()
        stats = tr.update(lr=1e-3)
    assert_tensors_close(grads_two, ref_two.grads, GRAD_REL, "grad after 2 of 3")
    assert_tensors_close(grads_all, ref_all.grads, GRAD_REL, "grad after 3 of 3")
    assert_stats_match(stats, ref_all)


# --------------------------------------------------------------------------
# Training: AdamW, weight decay, clipping
# --------------------------------------------------------------------------

# Alternating clip settings: always clips (norms are ~3-7), disabled, never clips.
CLIP_SCHEDULE = [1.0, 0.0, 1.0, 100.0, 1.0, 1.0, 0.0, 100.0, 1.0, 1.0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_ten_adamw_steps_match_torch(checkpoints, variant):
    ref = TorchTrainer(checkpoints.model(variant))
    rng = np.random.default_rng(10)
    clipped = []
    with open_trainer(checkpoints.path(variant), batch_size=4) as tr:
        for i, clip in enumerate(CLIP_SCHEDULE):
            batch = random_batch(rng, rows=4, mask_frac=0.1)
            ref.step(*batch)
            tr.step(*batch)
            r = ref.update(lr=1e-3, weight_decay=0.1, grad_clip=clip)
            s = tr.update(lr=1e-3, weight_decay=0.1, grad_clip=clip)
            clipped.append(r.clipped)
            assert s.loss == pytest.approx(r.loss, rel=TRAIN_LOSS_REL), f"step {i}"
            assert s.grad_norm == pytest.approx(r.grad_norm, rel=1e-4), f"step {i}"
            assert s.tokens == r.tokens
        weights = tr.get_weights()
    assert any(clipped) and not all(clipped)
    assert_trained_weights_close(weights, ref.weights(), WEIGHT_REL, f"{variant} weight", lr=1e-3,
                                 steps=len(CLIP_SCHEDULE))


def test_clipping_rescales_gradient_before_adam(checkpoints):
    """With a large eps the Adam update depends on the gradient's scale, so a
    wrong clip factor (or clipping after Adam) shows up in the weights."""
    kw = dict(lr=1e-2, eps=0.05, grad_clip=0.5, weight_decay=0.0)
    rng = np.random.default_rng(11)
    batches = [random_batch(rng, rows=2) for _ in range(2)]
    ref = TorchTrainer(checkpoints.model("llama"))
    unclipped = TorchTrainer(checkpoints.model("llama"))
    with open_trainer(checkpoints.path("llama")) as tr:
        for batch in batches:
            ref.step(*batch)
            unclipped.step(*batch)
            tr.step(*batch)
            r = ref.update(**kw)
            unclipped.update(**dict(kw, grad_clip=0.0))
            s = tr.update(**kw)
            assert r.clipped
            assert s.grad_norm == pytest.approx(r.grad_norm, rel=1e-4)
        weights = tr.get_weights()
    expected = ref.weights()
    diff = max(np.abs(expected[n] - w).max() for n, w in unclipped.weights().items())
    assert diff > 1e-3  # clipping visibly matters here
    assert_tensors_close(weights, expected, 1e-5, "clipped weight")


@pytest.mark.parametrize("variant", ["llama_attn_bias", "qwen3"])
def test_weight_decay_is_decoupled_and_only_on_matrices(checkpoints, variant):
    """Two runs from the same weights on the same batch, wd 0 vs 0.5: the
    difference must be exactly -lr*wd*w_before for ndim >= 2 (decay applied
    to the pre-update weights, as torch.optim.AdamW does) and zero for norm
    weights and biases."""
    lr, wd = 1e-2, 0.5
    batch = random_batch(np.random.default_rng(12), rows=2)
    after = {}
    for decay in (0.0, wd):
        with open_trainer(checkpoints.path(variant)) as tr:
            before = tr.get_weights()
            tr.step(*batch)
            tr.update(lr=lr, weight_decay=decay)
            after[decay] = tr.get_weights()
    for name, w0 in before.items():
        delta = after[wd][name].astype(np.float64) - after[0.0][name]
        if w0.ndim >= 2:
            err = np.abs(delta + lr * wd * w0).max()
            assert err <= 2e-6 * np.abs(w0).max(), f"{name}: decay off by {err:.3e}"
        else:
            assert np.array_equal(after[wd][name], after[0.0][name]), f"{name} was decayed"


# --------------------------------------------------------------------------
# Checkpoints and configs
# --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_from_pretrained_reads_each_variant(checkpoints, variant):
    cfg = nanoq.ModelConfig.from_pretrained(checkpoints.path(variant))
    assert_config_matches(cfg, NANOQ_CONFIG[variant])


@pytest.mark.parametrize("variant", ["llama_tied", "llama3_rope", "llama_attn_bias", "qwen2", "qwen3"])
def test_hand_built_model_config_trains_like_from_pretrained(checkpoints, variant):
    batch = random_batch(np.random.default_rng(13), rows=2)
    losses = []
    for cfg in (
        nanoq.ModelConfig(**NANOQ_CONFIG[variant]),
        nanoq.ModelConfig.from_pretrained(checkpoints.path(variant)),
    ):
        with nanoq.Trainer(cfg, train_options()) as tr:
            tr.import_weights(checkpoints.path(variant))
            losses.append(run_steps(tr, [batch], lr=1e-3).loss)
    assert losses[0] == losses[1]


def _llama3_4x_config():
    c = NANOQ_CONFIG["llama3_rope"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": dict(c["rope_scaling"]),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0",
    }


def _qwen2_4x_config():
    c = NANOQ_CONFIG["qwen2"]
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **{k: c[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads")},
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1",
    }


def _qwen3_5x_config():
    c = NANOQ_CONFIG["qwen3"]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **{k: c[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "head_dim")},
        "attention_bias": False,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "transformers_version": "5.0.0",
    }


def _llama3_5x_config():
    c = NANOQ_CONFIG["llama3_rope"]
    cfg = _llama3_4x_config()
    del cfg["rope_theta"], cfg["rope_scaling"], cfg["torch_dtype"]
    cfg.update(
        head_dim=c["head_dim"],
        rope_parameters=dict(c["rope_scaling"], rope_theta=10000.0),
        dtype="float32",
        transformers_version="5.1.0",
    )
    return cfg


@pytest.mark.parametrize(
    "variant, make_config",
    [
        ("llama3_rope", _llama3_4x_config),
        ("qwen2", _qwen2_4x_config),
        ("llama3_rope", _llama3_5x_config),
        ("qwen3", _qwen3_5x_config),
    ],
    ids=["llama3-4.x", "qwen2-4.x", "llama3-5.x", "qwen3-5.x"],
)
def test_hand_written_configs_of_both_transformers_styles_are_read(checkpoints, tmp_path, variant, make_config):
    """config.json as transformers 4.x (rope_theta/rope_scaling/torch_dtype)
    or 5.x (rope_parameters/dtype) writes it: same config, same loss."""
    path = write_config(tmp_path / "ckpt", make_config())
    shutil.copy(os.path.join(checkpoints.path(variant), "model.safetensors"), path)
    cfg = nanoq.ModelConfig.from_pretrained(path)
    assert_config_matches(cfg, NANOQ_CONFIG[variant])
    batch = random_batch(np.random.default_rng(14), rows=2)
    ref = torch_backward(checkpoints.model(variant), [batch])
    with open_trainer(path) as tr:
        stats = run_steps(tr, [batch], lr=1e-3)
    assert stats.loss == pytest.approx(ref.loss, rel=LOSS_REL)


def test_from_pretrained_rejects_unsupported_architecture(tmp_path):
    path = write_config(
        tmp_path,
        {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": 128,
            "n_embd": 32,
            "n_head": 4,
            "n_layer": 2,
            "n_positions": 64,
        },
    )
    with pytest.raises(ValueError, match="(?i)gpt2"):
        nanoq.ModelConfig.from_pretrained(path)


@pytest.mark.parametrize(
    "change",
    [
        dict(hidden_size=30),  # 30 / 4 heads, no head_dim
        dict(num_key_value_heads=3),  # 3 kv heads cannot serve 4 query heads
    ],
    ids=["hidden-not-divisible-by-heads", "kv-heads-not-dividing-heads"],
)
def test_from_pretrained_rejects_inconsistent_shapes(tmp_path, change):
    cfg = _llama3_4x_config()
    cfg.update({"hidden_size": 32, "rope_scaling": None, **change})
    with pytest.raises(ValueError):
        nanoq.ModelConfig.from_pretrained(write_config(tmp_path, cfg))


def test_sharded_checkpoint_imports_identically(checkpoints, tmp_path):
    model = checkpoints.model("llama")
    sharded = save_hf_model(model, tmp_path / "sharded", max_shard_size="20KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) >= 2
    batch = random_batch(np.random.default_rng(15), rows=2)
    single = checkpoints.path("llama")
    results = []
    for source in (single, os.path.join(single, "model.safetensors"), sharded):
        with nanoq.Trainer(nanoq.ModelConfig.from_pretrained(single), train_options()) as tr:
            tr.import_weights(source)
            weights = tr.get_weights()
            results.append((run_steps(tr, [batch], lr=1e-3).loss, weights))
    for loss, weights in results[1:]:
        assert loss == results[0][0]
        assert_same_tensors(weights, results[0][1], "weight")


def test_import_rejects_checkpoint_of_another_shape(checkpoints):
    cfg = nanoq.ModelConfig.from_pretrained(checkpoints.path("llama"))
    with nanoq.Trainer(cfg, train_options()) as tr:
        with pytest.raises((ValueError, RuntimeError)):
            tr.import_weights(checkpoints.path("llama3_rope"))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fields_a_config_json_leaves_out_take_transformers_defaults(family):
    # A Qwen3 config.json without head_dim means transformers' 128 (nanoq took hidden / heads, and then
    # refused the weights naming a tensor's shape); Qwen2's and Qwen3's key/value heads default to 32.
    import transformers

    config_class, architecture = {"llama": (transformers.LlamaConfig, "LlamaForCausalLM"),
                                  "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM"),
                                  "qwen3": (transformers.Qwen3Config, "Qwen3ForCausalLM")}[family]
    sizes = dict(vocab_size=256, hidden_size=1024, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=64)
    reference = config_class(**sizes)
    ours = nanoq.ModelConfig.from_hf_dict(dict(sizes, architectures=[architecture], model_type=family))
    assert ours.num_key_value_heads == reference.num_key_value_heads
    assert ours.head_dim == (getattr(reference, "head_dim", None) or sizes["hidden_size"] // 64)
    assert ours.rms_norm_eps == reference.rms_norm_eps
    assert ours.tie_word_embeddings == reference.tie_word_embeddings
