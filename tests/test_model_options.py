"""Nano's model options: learned position embeddings, linear biases and model dropout.

The reference is a Nano-like block stack written here in PyTorch float64 (the
embedding plus a learned position table, RMSNorm, q/k/v/o and gate/up/down
projections with biases, SwiGLU, dropout on the embedding, on each attention
output and on each MLP output before it joins the residual stream). Its
dropout masks are drawn here in numpy from the hash of cuda_core/dropout.h
with the seeds the trainer documents, so a wrong mask, a wrong seed or a
mask that backward does not reuse shows as a gradient mismatch.
"""
import dataclasses
import math

import numpy as np
import pytest
import torch

import nanoq
from nanoq.hf_export import export_checkpoint
from conftest import CUDA_BACKENDS, use_cuda_backend

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 61, 32, 48, 2, 4, 2
SEQ, POSITIONS = 12, 16
LOSS_REL, GRAD_REL, WEIGHT_REL = 1e-5, 3e-5, 5e-4
MASK64 = (1 << 64) - 1


def nano_config(learned=True, bias=True, dropout=0.0, tied=True):
    return nanoq.ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                             num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                             rms_norm_eps=1e-5, tie_word_embeddings=tied, qkv_bias=bias, o_bias=bias,
                             mlp_bias=bias, position_embedding="learned" if learned else "rope",
                             max_position_embeddings=POSITIONS if learned else None, dropout=dropout)


def options(devices=1, batch_size=2, seed=7, **more):
    return nanoq.TrainOptions(backend=more.pop("backend", "cpu"), devices=devices, batch_size=batch_size,
                              seq_len=SEQ, seed=seed, **more)


def make_trainer(config, init_seed=3, **opts):
    """A trainer with fresh weights and non-zero biases (so that they matter)."""
    tr = nanoq.Trainer(config, options(**opts))
    tr.init_weights(init_seed)
    rng = np.random.default_rng(init_seed + 100)
    weights = tr.get_weights()
    tr.set_weights({name: rng.standard_normal(w.shape).astype(np.float32) * np.float32(0.1)
                    for name, w in weights.items() if name.endswith(".bias")} | {
        name: w for name, w in weights.items() if not name.endswith(".bias")})
    return tr


def batch(rng, rows):
    inputs = rng.integers(0, VOCAB, size=(rows, SEQ), dtype=np.int32)
    targets = rng.integers(0, VOCAB, size=(rows, SEQ), dtype=np.int32)
    targets[0, :3] = -100
    return inputs, targets


# -- dropout.h's mask, in numpy ---------------------------------------------


def _splitmix64_int(z):
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def mix_seed(seed, stream):
    return _splitmix64_int(seed ^ ((stream * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & MASK64))


def keep_mask(seed, count, drop):
    """dropout_keep(seed, i, drop) for i in [0, count)."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + (np.arange(count, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    return u >= np.float32(drop)


def device_masks(options_seed, dropout_step, rank, rows, drop):
    """{(layer, site): keep mask [rows, HIDDEN]} of one device's micro-batch:
    site 0 the attention output, 1 the MLP output; (LAYERS, 0) the embedding.
    The micro-batch's seed mixes the run's seed, the micro-step and the
    global rank; each site is its own stream 2**32 + 2 * layer + site."""
    base = mix_seed(mix_seed(options_seed, dropout_step), rank)
    sites = [(layer, site) for layer in range(LAYERS) for site in (0, 1)] + [(LAYERS, 0)]
    return {(layer, site): keep_mask(mix_seed(base, (1 << 32) + 2 * layer + site), rows * HIDDEN,
                                     drop).reshape(rows, HIDDEN) for layer, site in sites}


def step_masks(options_seed, dropout_step, devices, rows_per_device, drop):
    """The masks of a global micro-batch: each device's rows, stacked."""
    per_device = [device_masks(options_seed, dropout_step, rank, rows_per_device, drop) for rank in range(devices)]
    return {key: np.concatenate([m[key] for m in per_device]) for key in per_device[0]}


# -- the PyTorch reference ---------------------------------------------------


def rope(x, theta=10000.0):
    """Half-split rotary embedding of x [B, T, heads, D] (Llama's convention)."""
    T, D = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv.float().double()[None, :]
    cos, sin = torch.cat([angle.cos()] * 2, -1)[None, :, None, :], torch.cat([angle.sin()] * 2, -1)[None, :, None, :]
    half = D // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class Reference:
    """The Nano-like model on float64 copies of nanoq's weights."""

    def __init__(self, config, weights):
        self.config = config
        self.params = {name: torch.tensor(w, dtype=torch.float64, requires_grad=True) for name, w in weights.items()}

    def p(self, name):
        return self.params.get(name)

    def linear(self, x, name):
        bias = self.p(name + ".bias")
        y = x @ self.p(name + ".weight").T
        return y + bias if bias is not None else y

    def rmsnorm(self, x, name):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.config.rms_norm_eps) * self.p(name)

    def dropped(self, x, masks, key):
        if masks is None:
            return x
        keep = torch.tensor(masks[key].reshape(x.shape), dtype=torch.float64)
        return x * keep / (1.0 - self.config.dropout)

    def hidden(self, inputs, masks=None):
        c = self.config
        B, T = inputs.shape
        D = c.head_dim
        ids = torch.tensor(inputs, dtype=torch.long)
        x = self.p("model.embed_tokens.weight")[ids]
        if c.learned_positions:
            x = x + self.p("model.embed_positions.weight")[:T][None]
        x = self.dropped(x, masks, (c.num_hidden_layers, 0))
        for layer in range(c.num_hidden_layers):
            pre = f"model.layers.{layer}."
            h = self.rmsnorm(x, pre + "input_layernorm.weight")
            q = self.linear(h, pre + "self_attn.q_proj").view(B, T, c.num_attention_heads, D)
            k = self.linear(h, pre + "self_attn.k_proj").view(B, T, c.num_key_value_heads, D)
            v = self.linear(h, pre + "self_attn.v_proj").view(B, T, c.num_key_value_heads, D)
            if not c.learned_positions:
                q, k = rope(q), rope(k)
            group = c.num_attention_heads // c.num_key_value_heads
            k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
            scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
            att = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(B, T, -1)
            x = x + self.dropped(self.linear(att, pre + "self_attn.o_proj"), masks, (layer, 0))
            h = self.rmsnorm(x, pre + "post_attention_layernorm.weight")
            gate, up = self.linear(h, pre + "mlp.gate_proj"), self.linear(h, pre + "mlp.up_proj")
            mlp = self.linear(torch.nn.functional.silu(gate) * up, pre + "mlp.down_proj")
            x = x + self.dropped(mlp, masks, (layer, 1))
        return self.rmsnorm(x, "model.norm.weight")

    def logits(self, inputs, masks=None):
        head = self.p("lm_head.weight")
        return self.hidden(inputs, masks) @ (head if head is not None else self.p("model.embed_tokens.weight")).T

    def loss_sum(self, inputs, targets, masks=None):
        logits = self.logits(inputs, masks).reshape(-1, self.config.vocab_size)
        return torch.nn.functional.cross_entropy(logits, torch.tensor(targets.reshape(-1), dtype=torch.long),
                                                 ignore_index=-100, reduction="sum")

    def gradients(self, micro_batches, mask_list):
        """Loss (mean over counted tokens) and gradients of one optimizer step."""
        for p in self.params.values():
            p.grad = None
        counted = sum(int((t != -100).sum()) for _, t in micro_batches)
        total = sum(self.loss_sum(i, t, m) for (i, t), m in zip(micro_batches, mask_list)) / counted
        total.backward()
        return float(total.detach()), {name: p.grad.numpy().astype(np.float64) for name, p in self.params.items()}

    def adamw_steps(self, steps, lr=3e-3, weight_decay=0.1, grad_clip=1.0):
        """steps: (micro_batches, masks) per optimizer step; AdamW as nanoq's
        (decay on matrices only, clipping by global norm)."""
        params = list(self.params.values())
        optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                                       {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                      lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
        losses = []
        for micro_batches, mask_list in steps:
            loss, _ = self.gradients(micro_batches, mask_list)
            norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in params))
            if norm > grad_clip:
                for p in params:
                    p.grad *= grad_clip / norm
            optimizer.step()
            losses.append(loss)
        return losses

    def weights(self):
        return {name: p.detach().numpy() for name, p in self.params.items()}


def assert_close(actual, expected, rel, what):
    assert sorted(actual) == sorted(expected), f"{what}: names differ"
    for name, e in expected.items():
        scale = float(np.abs(e).max())
        err = float(np.abs(actual[name].astype(np.float64) - e).max())
        # A floor for gradients that are zero in exact arithmetic (k's bias
        # without RoPE: softmax ignores a constant added to a query's scores).
        scale = max(scale, 1e-4)
        assert err <= rel * scale, f"{what} {name}: max abs err {err:.3e} > {rel:g} * {scale:.3e}"


# -- the tests -----------------------------------------------------------------


def test_layout_has_the_position_table_and_mlp_biases():
    with nanoq.Trainer(nano_config(), options()) as tr:
        names = tr.parameter_names
        shapes = {name: w.shape for name, w in tr.get_weights().items()}
    assert names[:2] == ["model.embed_tokens.weight", "model.embed_positions.weight"]
    assert shapes["model.embed_positions.weight"] == (POSITIONS, HIDDEN)
    for proj, width in (("gate_proj", INTER), ("up_proj", INTER), ("down_proj", HIDDEN)):
        assert shapes[f"model.layers.1.mlp.{proj}.bias"] == (width,)
    with nanoq.Trainer(nano_config(learned=False, bias=False), options()) as tr:
        assert not [n for n in tr.parameter_names if "positions" in n or "mlp" in n and n.endswith(".bias")]


@pytest.mark.parametrize("learned,bias", [(True, True), (True, False), (False, True)])
def test_loss_and_gradients_match_torch(learned, bias):
    config = nano_config(learned=learned, bias=bias)
    micro = batch(np.random.default_rng(1), rows=4)
    with make_trainer(config, batch_size=4) as tr:
        ref = Reference(config, tr.get_weights())
        tr.step(*micro)
        grads = tr.get_gradients()
        stats = tr.update(lr=0.0)
    loss, ref_grads = ref.gradients([micro], [None])
    assert stats.loss == pytest.approx(loss, rel=LOSS_REL)
    assert_close(grads, ref_grads, GRAD_REL, "gradient")


def test_dropout_gradients_match_torch_with_the_documented_masks():
    config = nano_config(dropout=0.25)
    rng = np.random.default_rng(2)
    micro_batches = [batch(rng, rows=2), batch(rng, rows=2)]
    with make_trainer(config, batch_size=2, grad_accum=2, seed=11) as tr:
        ref = Reference(config, tr.get_weights())
        for inputs, targets in micro_batches:
            tr.step(inputs, targets)
        grads = tr.get_gradients()
        stats = tr.update(lr=0.0)
    masks = [step_masks(11, micro, 1, 2 * SEQ, 0.25) for micro in range(2)]
    dropped = 1.0 - np.mean([m.mean() for m in masks[0].values()])
    assert 0.2 < dropped < 0.3  # the masks are real: about a quarter dropped
    loss, ref_grads = ref.gradients(micro_batches, masks)
    assert stats.loss == pytest.approx(loss, rel=LOSS_REL)
    assert_close(grads, ref_grads, GRAD_REL, "gradient")
    # Without the masks the reference is far off: the test can fail.
    _, grads_without = ref.gradients(micro_batches, [None, None])
    with pytest.raises(AssertionError):
        assert_close(grads, grads_without, 100 * GRAD_REL, "gradient")


def test_adamw_steps_with_dropout_match_torch_on_two_devices():
    config = nano_config(dropout=0.1)
    rng = np.random.default_rng(3)
    steps = [[batch(rng, rows=4)] for _ in range(3)]
    with make_trainer(config, devices=2, batch_size=2, seed=5, zero_stage=2) as tr:
        ref = Reference(config, tr.get_weights())
        losses = []
        for micro_batches in steps:
            for inputs, targets in micro_batches:
                tr.step(inputs, targets)
            losses.append(tr.update(lr=3e-3).loss)
        weights = tr.get_weights()
    ref_losses = ref.adamw_steps([(mb, [step_masks(5, s, 2, 2 * SEQ, 0.1)]) for s, mb in enumerate(steps)])
    assert losses == pytest.approx(ref_losses, rel=5e-5)
    assert_close(weights, ref.weights(), WEIGHT_REL, "weight")


def test_validate_logits_and_generate_run_without_dropout():
    config = nano_config(dropout=0.5)
    inputs, targets = batch(np.random.default_rng(4), rows=2)
    with make_trainer(config, batch_size=2) as tr:
        ref = Reference(config, tr.get_weights())
        stats = tr.validate(inputs, targets)
        logits = tr.logits(inputs[:, :7])
        generated = tr.generate([int(t) for t in inputs[0, :5]], max_new_tokens=6, temperature=0.0)
    with torch.no_grad():
        expected = ref.loss_sum(inputs, targets) / int((targets != -100).sum())
        ref_logits = ref.logits(inputs[:, :7]).numpy()
    assert stats.loss == pytest.approx(float(expected), rel=LOSS_REL)
    assert_close({"logits": logits}, {"logits": ref_logits}, 1e-5, "logits")
    assert generated == greedy_reference(ref, inputs[0, :5], 6)


def greedy_reference(ref, prompt, new_tokens):
    tokens = [int(t) for t in prompt]
    with torch.no_grad():
        for _ in range(new_tokens):
            tokens.append(int(ref.logits(np.array([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("learned,bias", [(True, True), (False, True), (True, False)])
def test_generation_matches_torch_with_learned_positions_and_biases(learned, bias):
    config = nano_config(learned=learned, bias=bias)
    prompt = np.random.default_rng(5).integers(0, VOCAB, size=4)
    with make_trainer(config) as tr:
        ref = Reference(config, tr.get_weights())
        generated = tr.generate(prompt.tolist(), max_new_tokens=SEQ - 4, temperature=0.0)
        logits = tr.logits(np.array([prompt]))
    assert generated == greedy_reference(ref, prompt, SEQ - 4)
    with torch.no_grad():
        assert_close({"l": logits}, {"l": ref.logits(np.array([prompt])).numpy()}, 1e-5, "logits")


def _train(tr, steps):
    losses = []
    for micro_batches in steps:
        for inputs, targets in micro_batches:
            tr.step(inputs, targets)
        losses.append(tr.update(lr=3e-3).loss)
    return losses, tr.get_weights()


# Stage 1 reduces the gradients once per step, stages 2 and 3 per micro-batch:
# each variation is held to the stage it shares that order with.
@pytest.mark.parametrize("stage,variation", [
    (2, dict(zero_stage=3)), (1, dict(recompute="block")), (1, dict(recompute="norms,qkv")),
    (1, dict(offload="optimizer,master")), (2, dict(zero_stage=2, offload="gradients", recompute="ffn")),
    (2, dict(zero_stage=3, offload="optimizer", recompute="block")),
])
def test_sharding_recompute_and_offload_leave_results_bitwise_unchanged(stage, variation):
    config = nano_config(dropout=0.2)
    rng = np.random.default_rng(6)
    steps = [[batch(rng, rows=4), batch(rng, rows=4)] for _ in range(2)]
    with make_trainer(config, devices=2, batch_size=2, grad_accum=2, zero_stage=stage) as tr:
        expected = _train(tr, steps)
    with make_trainer(config, devices=2, batch_size=2, grad_accum=2, **dict(dict(zero_stage=stage), **variation)) as tr:
        actual = _train(tr, steps)
    assert actual[0] == expected[0]
    for name, w in expected[1].items():
        assert np.array_equal(actual[1][name], w), name


def test_resume_from_a_checkpoint_is_exact_with_dropout(tmp_path):
    config = nano_config(dropout=0.2)
    rng = np.random.default_rng(7)
    steps = [[batch(rng, rows=2)] for _ in range(4)]
    with make_trainer(config) as tr:
        expected = _train(tr, steps)
    with make_trainer(config) as tr:
        _train(tr, steps[:2])
        tr.save_checkpoint(tmp_path / "ckpt", step=2)
    with nanoq.Trainer(config, options()) as tr:
        tr.load_checkpoint(tmp_path / "ckpt")
        actual = _train(tr, steps[2:])
    assert actual[0] == expected[0][2:]
    for name, w in expected[1].items():
        assert np.array_equal(actual[1][name], w), name


@pytest.mark.parametrize("config,reason", [
    (nano_config(learned=True, bias=False), "learned position embeddings"),
    (nanoq.ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                       num_attention_heads=HEADS, qkv_bias=True, mlp_bias=True), "no MLP biases"),
])
def test_export_refuses_what_transformers_cannot_represent(tmp_path, config, reason):
    with nanoq.Trainer(config, options()) as tr:
        tr.init_weights(0)
        with pytest.raises(ValueError, match=reason):
            tr.export_model(tmp_path / "out")
        tr.save_checkpoint(tmp_path / "ckpt", step=1)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=reason):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bias,dropout", [(True, 0.0), (False, 0.3)])
def test_rope_models_with_biases_or_dropout_export_as_llama(tmp_path, bias, dropout):
    """Nano's bias = true is Llama's attention_bias and mlp_bias; dropout
    changes no weight. transformers computes the same logits."""
    import transformers

    config = nano_config(learned=False, bias=bias, dropout=dropout, tied=False)
    inputs = np.random.default_rng(8).integers(0, VOCAB, size=(1, SEQ), dtype=np.int32)
    with make_trainer(config) as tr:
        tr.export_model(tmp_path / "out")
        ours = tr.logits(inputs)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert model.config.mlp_bias == bias and model.config.attention_bias == bias
    with torch.no_grad():
        theirs = model(torch.tensor(inputs, dtype=torch.long)).logits.numpy()
    assert_close({"l": ours}, {"l": theirs}, 1e-4, "logits")
    assert nanoq.ModelConfig.from_pretrained(tmp_path / "out").mlp_bias == bias


def test_model_options_are_checked():
    with pytest.raises(ValueError, match="position_embedding"):
        nano_config().__class__(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                num_attention_heads=2, position_embedding="alibi")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        nanoq.ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                          num_attention_heads=2, position_embedding="learned")
    with pytest.raises(ValueError, match="dropout"):
        nano_config(dropout=1.0)
    with pytest.raises(ValueError, match="seq_len 20 exceeds"):
        nanoq.Trainer(nano_config(), nanoq.TrainOptions(backend="cpu", seq_len=20))


def test_memory_plan_holds_the_table_biases_and_the_dropout_stack():
    """The plan is the trainer's allocations (test_memory_plan checks it entry
    for entry); here: the table is a planned weight, and the stack the plan
    sizes holds a step with dropout and learned positions."""
    from nanoq import _core
    import dataclasses

    config, opts = nano_config(dropout=0.1), options(batch_size=2, recompute="block", dtype="fp32")
    plan = _core.plan_memory(config.to_core(), dataclasses.asdict(opts))[0]
    without = _core.plan_memory(nano_config(learned=False, bias=False).to_core(), dataclasses.asdict(opts))[0]
    weights = sum(a["bytes"] for a in plan["allocations"] if a["context"] == "weights")
    weights_without = sum(a["bytes"] for a in without["allocations"] if a["context"] == "weights")
    biases = LAYERS * (HEADS * 8 + 2 * KV_HEADS * 8 + HIDDEN + 2 * INTER + HIDDEN)
    assert weights - weights_without >= 4 * (POSITIONS * HIDDEN + biases)
    assert plan["stack_capacity"] > without["stack_capacity"]
    with make_trainer(config, **dict(batch_size=2, recompute="block")) as tr:
        tr.step(*batch(np.random.default_rng(9), rows=2))
        info = tr.get_stack_info(0)
    assert info["capacity"] == plan["stack_capacity"]
    assert 0 < info["high_water"] <= info["capacity"]


# -- the cuda backend's code (the emulator everywhere, a GPU where there is one)


@pytest.fixture(params=[pytest.param(name, marks=mark, id=name) for name, mark in CUDA_BACKENDS])
def cuda_backend(request):
    return use_cuda_backend(request.param, request)


@pytest.mark.parametrize("dtype,rel", [("fp32", 1e-4), ("bf16", 5e-2)])
def test_cuda_backend_steps_match_the_cpu_backend_with_every_option(cuda_backend, dtype, rel):
    """Two devices, ZeRO 3 and recompute: learned positions, biases and
    dropout through the cuda backend's ops against the cpu backend (which
    the tests above hold to PyTorch); the masks come from the same hash."""
    config = nano_config(dropout=0.2)
    rng = np.random.default_rng(10)
    steps = [[batch(rng, rows=4)] for _ in range(3)]
    runs = []
    for backend, run_dtype in ((cuda_backend, dtype), ("cpu", "fp32")):
        with make_trainer(config, backend=backend, dtype=run_dtype, devices=2, batch_size=2, seed=4,
                          zero_stage=3, recompute="block") as tr:
            tr.step(*steps[0][0])
            grads = tr.get_gradients()
            losses = [tr.update(lr=3e-3).loss] + _train(tr, steps[1:])[0]
            runs.append((grads, losses, tr.get_weights()))
    (grads, losses, weights), (cpu_grads, cpu_losses, cpu_weights) = runs
    assert_close(grads, cpu_grads, rel, "gradient")
    assert losses == pytest.approx(cpu_losses, rel=rel / 10)
    if dtype == "fp32":  # bf16 weights: Adam turns rounding in tiny gradients into O(lr) steps
        assert_close(weights, cpu_weights, WEIGHT_REL, "weight")


def test_checkpoints_from_before_the_options_still_load(tmp_path):
    """A trainer_state.json written before these options existed has no
    position_embedding, mlp_bias or dropout: it is a RoPE model without them."""
    import json

    from nanoq.checkpoint import STATE_FILE, CheckpointError, read_state

    config = nano_config(learned=False, bias=False)
    with make_trainer(config) as tr:
        tr.save_checkpoint(tmp_path / "ckpt", step=1)
        expected = tr.get_weights()
    state_file = tmp_path / "ckpt" / read_state(tmp_path / "ckpt")["path"].split("/")[-1] / STATE_FILE
    state = json.loads(state_file.read_text())
    for key in ("position_embedding", "mlp_bias", "dropout"):
        del state["model_config"][key]
    del state["state_checksum"]  # (nor its own checksum, which came later)
    state_file.write_text(json.dumps(state))
    with nanoq.Trainer(config, options()) as tr:
        tr.load_checkpoint(tmp_path / "ckpt")
        assert all(np.array_equal(w, expected[name]) for name, w in tr.get_weights().items())
    with nanoq.Trainer(nano_config(learned=False, bias=False, dropout=0.1), options()) as tr:
        tr.load_checkpoint(tmp_path / "ckpt")  # dropout changes no weight
    with nanoq.Trainer(nano_config(learned=True, bias=False), options()) as tr:
        with pytest.raises(CheckpointError, match="position_embedding"):
            tr.load_checkpoint(tmp_path / "ckpt")


def test_nanoq_generate_runs_a_learned_position_checkpoint(tmp_path):
    """`nanoq generate` on a checkpoint of a model that does not export."""
    import json

    from click.testing import CliRunner

    from nanoq.tokenization.tokenizer import tokenizer_vocab_size, train_bpe_tokenizer
    from nanoq_cli.main import cli

    tokenizer = train_bpe_tokenizer(["the cat sat on the mat; the dog sat on the log. " * 40], 280)
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    vocab = tokenizer_vocab_size(tokenizer)
    config = dataclasses.replace(nano_config(dropout=0.1), vocab_size=vocab)
    prompt = "the cat sat"
    ids = tokenizer.encode(prompt).ids
    with make_trainer(config) as tr:
        expected = tr.generate(ids, max_new_tokens=SEQ - len(ids), temperature=0.0)
        tr.save_checkpoint(tmp_path / "checkpoints", 3, tokenizer_dir=str(tmp_path / "tok"))
    result = CliRunner().invoke(cli, ["generate", str(tmp_path / "checkpoints"), "--prompt", prompt,
                                      "--max-new-tokens", str(SEQ - len(ids)), "--temperature", "0", "--backend",
                                      "cpu", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    completion = json.loads(result.output)["completion_ids"]
    eos = tokenizer.token_to_id("<|endoftext|>")
    if eos in expected:
        expected = expected[:expected.index(eos) + 1]
    assert completion == expected


@pytest.mark.parametrize("checkpoint_every", [0, 3])
def test_nanoq_train_with_the_model_settings_ends_on_a_checkpoint_when_transformers_cannot_hold_it(
        tmp_path, checkpoint_every):
    # The [model] settings reach the core; a learned-position model cannot be
    # exported, so the run's last checkpoint is its model (written once).
    from nanoq.checkpoint import list_checkpoints, read_state
    from nanoq.data import write_tokens
    from nanoq.training import TrainConfig, train

    write_tokens(tmp_path / "train_0.bin", np.arange(3000) % 64, 64)
    config = TrainConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         seq_len=16, batch_size=2, backend="cpu", threads=1, steps=3, warmup_steps=0,
                         train_data=str(tmp_path / "train_0.bin"), eval_data="", eval_every=0, sample_every=0,
                         checkpoint_every=checkpoint_every, out_dir=str(tmp_path / "runs"), run_name="r",
                         position_embedding="learned", linear_bias=True, dropout=0.1)
    lines = []
    result = train(config, say=lines.append, progress=False)
    assert any(line.startswith("no Hugging Face export: a model with learned position embeddings") for line in lines)
    root = tmp_path / "runs" / "r" / "checkpoints"
    assert list_checkpoints(str(root)) == [3]
    assert result.model_dir == str(root / "step_00000003")
    assert sum("checkpoint @ step 3" in line for line in lines) == 1
    model = read_state(result.model_dir)["model_config"]
    assert (model["position_embedding"], model["max_position_embeddings"], model["mlp_bias"], model["qkv_bias"],
            model["o_bias"], model["dropout"]) == ("learned", 16, True, True, True, 0.1)
