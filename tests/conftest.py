"""Shared helpers for the nanoq tests.

Everything that compares nanoq against PyTorch goes through the helpers here so
that the reference semantics (shifted labels, -100 masking, global token mean,
z-loss, AdamW with decay only on matrices, clipping) live in one place.

Models are tiny and fp32 so that the whole suite runs in well under a few
minutes on two CPU cores.
"""

import copy
import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
import pytest

# The CUDA emulator (backend cuda_emulated) shuffles the order in which CUDA
# threads run from this seed; a failing run is replayed with the same
# NANOQ_EMU_SEED. It is read when the emulator library loads, so set it first.
os.environ.setdefault("NANOQ_EMU_SEED", str(int.from_bytes(os.urandom(4), "little") % 1_000_000))

import torch  # noqa: E402
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import nanoq

IGNORE = -100
VOCAB = 128
SEQ = 16

# Shapes shared by all variants: GQA (4 query heads, 2 kv heads), 2 layers.
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

# name -> (config class, model class, config kwargs, nanoq flags expected from the config)
MODEL_VARIANTS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(TINY)),
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(TINY, tie_word_embeddings=True)),
    # head_dim 16 with theta 1e4 and original_max 64 puts rotary frequencies in
    # all three llama3 regimes (kept, smoothed, divided by `factor`).
    "llama3_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            TINY,
            hidden_size=64,
            intermediate_size=96,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # attention_bias=True: q/k/v/o all have biases; also a non-default theta and eps.
    "llama_attn_bias": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            TINY,
            attention_bias=True,
            rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="default", rope_theta=500000.0),
        ),
    ),
    # Qwen2: q/k/v bias, no o bias.
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(TINY, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    ),
    # Qwen3: per-head q/k RMSNorm and head_dim (16) != hidden / heads (8).
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(TINY, head_dim=16)),
}
VARIANTS = list(MODEL_VARIANTS)

# What nanoq.ModelConfig should hold for each variant (constructor kwargs).
_BASE_CFG = dict(
    TINY,
    head_dim=8,
    rope_theta=10000.0,
    rope_scaling=None,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    qkv_bias=False,
    o_bias=False,
    qk_norm=False,
)
NANOQ_CONFIG = {
    "llama": dict(_BASE_CFG),
    "llama_tied": dict(_BASE_CFG, tie_word_embeddings=True),
    "llama3_rope": dict(
        _BASE_CFG,
        hidden_size=64,
        intermediate_size=96,
        head_dim=16,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "llama_attn_bias": dict(_BASE_CFG, qkv_bias=True, o_bias=True, rms_norm_eps=1e-5, rope_theta=500000.0),
    "qwen2": dict(_BASE_CFG, qkv_bias=True, rope_theta=1000000.0),
    "qwen3": dict(_BASE_CFG, head_dim=16, qk_norm=True),
}


# --------------------------------------------------------------------------
# Hugging Face reference models
# --------------------------------------------------------------------------


def hf_config(variant, **overrides):
    cfg_cls, _, kwargs = MODEL_VARIANTS[variant]
    kwargs = dict(kwargs, **overrides)
    cfg = cfg_cls(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def randomize_(model, seed):
    """Replace HF's near-zero init with O(1) random weights.

    Norm weights get noise around 1 and biases are nonzero so that their
    gradients are meaningful (an implementation that ignored them, or
    mis-routed them, would visibly change the loss), and logits have a spread
    of a few units so that the lse / z-loss statistics are non-trivial.
    """
    gen = torch.Generator().manual_seed(seed + 1000)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                p.copy_(noise * (1.5 / math.sqrt(hidden)))
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))


def build_hf_model(variant, seed=0, **overrides):
    """A tiny fp32 HF causal LM with randomized weights (deterministic in seed)."""
    _, model_cls, _ = MODEL_VARIANTS[variant]
    torch.manual_seed(seed)
    model = model_cls(hf_config(variant, **overrides)).float()
    randomize_(model, seed)
    model.train()  # no dropout in these models; train() just to be explicit
    return model


def save_hf_model(model, path, **kwargs):
    model.save_pretrained(str(path), **kwargs)
    return str(path)


class Checkpoints:
    """Lazily built, session-cached checkpoints; one per variant."""

    def __init__(self, root):
        self.root = root
        self._models = {}
        self._paths = {}

    def path(self, variant):
        if variant not in self._paths:
            model = build_hf_model(variant)
            self._models[variant] = model
            self._paths[variant] = save_hf_model(model, self.root / variant)
        return self._paths[variant]

    def model(self, variant):
        """A fresh copy of the HF model stored at path(variant) (safe to train)."""
        self.path(variant)
        return copy.deepcopy(self._models[variant])


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))


# --------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------


def rope_table(time, head_dim, theta=10000.0):
    """RoPE's cos and sin per position and rotated pair, [T, D/2, 2] float32 (half-split convention)."""
    half = head_dim // 2
    angles = np.arange(time)[:, None] * theta ** (-np.arange(half) * 2.0 / head_dim)[None, :]
    return np.stack([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)


def random_batch(rng, rows, seq_len=SEQ, vocab=VOCAB, mask_frac=0.0):
    """Next-token batch: int32 C-contiguous inputs and already-shifted targets.

    A fraction `mask_frac` of the targets is set to -100 (ignored).
    """
    tokens = rng.integers(0, vocab, size=(rows, seq_len + 1), dtype=np.int64)
    inputs = np.ascontiguousarray(tokens[:, :-1], dtype=np.int32)
    targets = np.ascontiguousarray(tokens[:, 1:], dtype=np.int32)
    if mask_frac > 0:
        targets[rng.random(targets.shape) < mask_frac] = IGNORE
    return inputs, targets


def split_rows(inputs, targets, parts):
    """Split a [parts*B, T] batch into `parts` contiguous micro-batches."""
    return [
        (np.ascontiguousarray(i), np.ascontiguousarray(t))
        for i, t in zip(np.split(inputs, parts), np.split(targets, parts))
    ]


# --------------------------------------------------------------------------
# PyTorch reference
# --------------------------------------------------------------------------


def token_terms(model, inputs, targets):
    """Per-token cross-entropy and logsumexp, plus the counted-token mask.

    Labels are already shifted: targets[b, t] is the target of position t,
    so HF's internal label shifting is deliberately not used.
    """
    logits = model(input_ids=torch.from_numpy(inputs).long()).logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    tgt = torch.from_numpy(targets).long()
    mask = tgt != IGNORE
    picked = logits.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return lse - picked, lse, mask


@dataclass
class RefStats:
    loss: float
    z_loss: float
    tokens: int
    lse_max: float
    lse_mean: float
    loss_1k: float
    grad_norm: float = float("nan")
    clipped: bool = False
    grads: dict = field(default_factory=dict, repr=False)


def param_grads(model):
    """Gradients of the parameters that train (frozen LoRA bases have none)."""
    return {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters() if p.requires_grad}


def model_weights(model):
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def torch_backward(model, micro_batches, z_loss=0.0):
    """Backprop CE_mean + z_loss * mean(lse^2) over all counted tokens of all
    micro-batches (one global mean, not a mean of per-micro-batch means).

    Leaves the gradients in model's .grad and returns the statistics nanoq
    reports for the same optimizer step.
    """
    model.zero_grad(set_to_none=True)
    n = int(sum((t != IGNORE).sum() for _, t in micro_batches))
    ce_sum = lse2_sum = lse_sum = 0.0
    lse_max = -math.inf
    ce_1k = 0.0
    n_1k = 0
    for inputs, targets in micro_batches:
        ce, lse, mask = token_terms(model, inputs, targets)
        objective = (ce[mask].sum() + z_loss * (lse[mask] ** 2).sum()) / n
        objective.backward()
        with torch.no_grad():
            m = mask.double()
            ce_sum += float((ce.double() * m).sum())
            lse2_sum += float((lse.double() ** 2 * m).sum())
            lse_sum += float((lse.double() * m).sum())
            if mask.any():
                lse_max = max(lse_max, float(lse[mask].max()))
            m1k = m[:, :1024]
            ce_1k += float((ce.double()[:, :1024] * m1k).sum())
            n_1k += int(m1k.sum())
    grads = param_grads(model)
    norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    return RefStats(
        loss=ce_sum / n,
        z_loss=z_loss * lse2_sum / n,
        tokens=n,
        lse_max=lse_max,
        lse_mean=lse_sum / n,
        loss_1k=ce_1k / max(n_1k, 1),
        grad_norm=norm,
        grads=grads,
    )


def params_with_grads(model):
    return [p for p in model.parameters() if p.grad is not None]


class TorchTrainer:
    """Mirror of nanoq.Trainer's step/update protocol on a HF model.

    AdamW (torch.optim.AdamW) with weight decay only on parameters with
    ndim >= 2; gradient clipping by global norm with scale clip/norm when
    norm > clip (clip 0 disables it).
    """

    def __init__(self, model, z_loss=0.0):
        self.model = model
        self.z_loss = z_loss
        params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay}, {"params": no_decay}], lr=0.0, foreach=False
        )
        self.micro = []

    def step(self, inputs, targets):
        self.micro.append((inputs, targets))

    def update(self, lr, beta1=0.9, beta2=0.95, weight_decay=0.1, grad_clip=1.0, eps=1e-8):
        stats = torch_backward(self.model, self.micro, self.z_loss)
        self.micro = []
        if grad_clip > 0 and stats.grad_norm > grad_clip:
            stats.clipped = True
            scale = grad_clip / stats.grad_norm
            with torch.no_grad():
                for p in params_with_grads(self.model):
                    p.grad.mul_(scale)
        for group, wd in zip(self.opt.param_groups, (weight_decay, 0.0)):
            group.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
        self.opt.step()
        self.model.zero_grad(set_to_none=True)
        return stats

    def weights(self):
        return model_weights(self.model)


# --------------------------------------------------------------------------
# nanoq side
# --------------------------------------------------------------------------


def train_options(devices=1, batch_size=2, seq_len=SEQ, grad_accum=1, seed=0, z_loss=0.0):
    return nanoq.TrainOptions(
        backend="cpu",
        devices=devices,
        batch_size=batch_size,
        seq_len=seq_len,
        grad_accum=grad_accum,
        seed=seed,
        z_loss=z_loss,
    )


def open_trainer(checkpoint, **opts):
    """A CPU trainer with the checkpoint's config and weights imported."""
    cfg = nanoq.ModelConfig.from_pretrained(checkpoint)
    tr = nanoq.Trainer(cfg, train_options(**opts))
    tr.import_weights(checkpoint)
    return tr


def run_steps(tr, micro_batches, **update_kwargs):
    for inputs, targets in micro_batches:
        tr.step(inputs, targets)
    return tr.update(**update_kwargs)


# --------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------


def assert_tensors_close(actual, expected, rel, what="tensor"):
    """Every tensor present on both sides, same shape, and max abs error
    within rel * max|expected| of that tensor (a per-tensor scale, so tensors
    with small gradients such as biases are held to their own magnitude)."""
    assert sorted(actual) == sorted(expected), f"{what}: names differ"
    for name, e in expected.items():
        a = actual[name]
        assert isinstance(a, np.ndarray) and a.dtype == np.float32, f"{what} {name}: {type(a)} {getattr(a, 'dtype', None)}"
        assert a.shape == e.shape, f"{what} {name}: shape {a.shape} != {e.shape}"
        assert np.all(np.isfinite(a)), f"{what} {name}: non-finite values"
        scale = float(np.abs(e).max())
        err = float(np.abs(a.astype(np.float64) - e).max())
        assert err <= rel * scale + 1e-30, (
            f"{what} {name}: max abs err {err:.3e} > {rel:g} * max|ref| {scale:.3e}"
        )


def assert_trained_weights_close(actual, expected, rel, what, lr, steps):
    """assert_tensors_close for weights after `steps` AdamW steps at `lr`,
    except the key biases: their gradient is exactly zero (softmax ignores a
    shift shared by all keys), so AdamW turns rounding noise into updates of
    up to ~lr each and two correct trainers may differ by up to steps * lr."""
    actual, expected = dict(actual), dict(expected)
    for name in [n for n in actual if n.endswith("k_proj.bias")]:
        drift = float(np.abs(actual.pop(name) - expected.pop(name)).max())
        assert drift <= steps * lr, f"{what} {name}: drifted {drift:.2e} > {steps} steps x lr {lr}"
    assert_tensors_close(actual, expected, rel, what)


def assert_same_tensors(a, b, what="tensor"):
    """Bitwise equality of two name->array dicts."""
    assert sorted(a) == sorted(b), f"{what}: names differ"
    for name in a:
        assert np.array_equal(a[name], b[name]), (
            f"{what} {name}: max diff {np.abs(a[name].astype(np.float64) - b[name]).max():.3e}"
        )


def config_summary(cfg):
    """nanoq.ModelConfig as a plain dict comparable with NANOQ_CONFIG entries.

    head_dim=None means hidden_size // num_attention_heads; rope_scaling is
    reduced to the llama3 keys (floats/ints) so representation details don't matter.
    """
    out = {k: getattr(cfg, k) for k in _BASE_CFG}
    if out["head_dim"] is None:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if out["rope_scaling"] is not None:
        rs = out["rope_scaling"]
        out["rope_scaling"] = {k: rs[k] for k in NANOQ_CONFIG["llama3_rope"]["rope_scaling"]}
    return out


def assert_config_matches(cfg, expected):
    """Field-by-field comparison (floats approximately: nanoq may store fp32)."""
    got = config_summary(cfg)
    for key, want in expected.items():
        have = got[key]
        if isinstance(want, dict):
            assert isinstance(have, dict) and sorted(have) == sorted(want), f"{key}: {have!r} != {want!r}"
            for k, v in want.items():
                assert have[k] == (v if isinstance(v, str) else pytest.approx(v, rel=1e-6)), f"{key}[{k}]: {have[k]!r} != {v!r}"
        elif isinstance(want, float):
            assert have == pytest.approx(want, rel=1e-6), f"{key}: {have!r} != {want!r}"
        else:
            assert have == want, f"{key}: {have!r} != {want!r}"


def write_config(directory, config):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return str(directory)


# --------------------------------------------------------------------------
# Op-level tests (test_ops.py, test_gpu_ops.py) and the GPU guard
# --------------------------------------------------------------------------


def nvidia_gpu_present():
    """Whether this machine has an NVIDIA GPU, whatever nanoq's build says:
    a /dev/nvidia0 device node, or an nvidia-smi that runs successfully."""
    import shutil
    import subprocess

    if os.path.exists("/dev/nvidia0"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def require_cuda_backend():
    """Skips the calling test when the machine has no NVIDIA GPU; when it has
    one, fails (never skips) unless nanoq's cuda backend is built and sees a
    device, so that a broken GPU build cannot pass as "skipped"."""
    if not nvidia_gpu_present():
        pytest.skip("no NVIDIA GPU on this machine")
    cuda = next(entry for entry in nanoq.backends() if entry["name"] == "cuda")
    if not cuda["built"] or cuda["devices"] == 0:
        pytest.fail(
            f"an NVIDIA GPU is present but nanoq's cuda backend is unusable ({cuda['detail']}); "
            "build it with: NANOQ_CUDA=ON pip install --no-build-isolation .",
            pytrace=False,
        )


def pytest_configure(config):
    # Tests run several cpu devices on few cores on purpose; the warning is tested where it is made.
    config.addinivalue_line("filterwarnings", "ignore::nanoq.backends.OversubscriptionWarning")


def pytest_report_header(config):
    return f"CUDA emulator seed: NANOQ_EMU_SEED={os.environ['NANOQ_EMU_SEED']} (set it to replay a schedule)"


# The test running in this process (pytest_runtest_setup), for the marker
# check in require_cuda_emulator.
_running_test = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _running_test
    _running_test = item


def require_cuda_emulator():
    """Fails (never skips) unless the emulated cuda backend is built: its
    tests are CPU tests and run on every machine. A test that runs on the
    emulator must be marked cuda_emulated: `-m cuda_emulated` selects them
    (the sanitizer runs give them settings of their own, and CI's second
    test run leaves them out)."""
    if _running_test is not None and _running_test.get_closest_marker("cuda_emulated") is None:
        pytest.fail(f"{_running_test.nodeid} runs on the CUDA emulator but is not marked cuda_emulated "
                    "(add @pytest.mark.cuda_emulated)", pytrace=False)
    if not nanoq._core.backend_built("cuda_emulated"):
        pytest.fail("nanoq was built without the CUDA emulator (NANOQ_CUDA_EMULATOR=OFF); "
                    "the cuda_emulated tests need it", pytrace=False)


# The backends that run the cuda backend's code: a real GPU (tests marked
# gpu, skipped without one) and the CPU emulator (marked cuda_emulated, run
# everywhere). Tests parametrized with cuda_cases() run on both.
CUDA_BACKENDS = (("cuda", pytest.mark.gpu), ("cuda_emulated", pytest.mark.cuda_emulated))


def cuda_cases(gpu_cases=(None,), emulated_cases=None):
    """pytest params pairing each cuda backend with its cases: the GPU runs
    `gpu_cases`, the emulator (slow) `emulated_cases` (default: the same).
    A case that is a tuple is spread into the test's other arguments."""
    emulated_cases = gpu_cases if emulated_cases is None else emulated_cases
    params = []
    for (backend, mark), cases in zip(CUDA_BACKENDS, (gpu_cases, emulated_cases)):
        for case in cases:
            values = (backend,) if case is None else (backend, *(case if isinstance(case, tuple) else (case,)))
            ident = backend if case is None else f"{backend}-" + "x".join(map(str, values[1:]))
            params.append(pytest.param(*values, marks=mark, id=ident))
    return params


@pytest.fixture(scope="session")
def cuda_device():
    """Index of the GPU the cuda tests use (0), after require_cuda_backend()."""
    require_cuda_backend()
    return 0


def use_cuda_backend(backend, request):
    """Checks that `backend` ("cuda" or "cuda_emulated") can run its tests
    here (skipping GPU tests without a GPU, never the emulated ones)."""
    if backend == "cuda":
        request.getfixturevalue("cuda_device")
    else:
        require_cuda_emulator()
    return backend


def assert_array_close(actual, expected, rel, what="array", atol=0.0):
    """Same shape, all finite, and max |actual - expected| <= rel * max|expected|
    + atol (one scale per array, so near-zero elements are held to the array's
    size; atol only for arrays that may be exactly zero)."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), f"{what}: {int((~np.isfinite(actual)).sum())} non-finite values"
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    err = float(np.abs(actual.astype(np.float64) - expected).max()) if expected.size else 0.0
    assert err <= rel * scale + atol + 1e-30, (
        f"{what}: max abs err {err:.3e} > {rel:g} * max|expected| {scale:.3e} (rel err {err / max(scale, 1e-30):.2e})"
    )


# --------------------------------------------------------------------------
# GPU tests that ask for more GPUs than the machine has
# --------------------------------------------------------------------------

# The core's refusal of more cuda devices than are visible (Trainer's
# constructor), which on a GPU machine with fewer GPUs than a test asks for
# means "not here", as no GPU at all does: such a test is reported skipped.
_TOO_FEW_GPUS = re.compile(r"asked for (\d+) cuda device\(s\)(?: from device (\d+))?, but (\d+) are available")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or report.passed or item.get_closest_marker("gpu") is None:
        return
    found = _TOO_FEW_GPUS.search(str(call.excinfo.value))
    if found and int(found[1]) + int(found[2] or 0) > int(found[3]):
        needed = int(found[1]) + int(found[2] or 0)
        report.outcome = "skipped"
        report.longrepr = (str(item.path), (item.location[1] or 0) + 1,
                           f"Skipped: needs {needed} GPUs, this machine has {found[3]}")


# --------------------------------------------------------------------------
# CI guard: a CPU test must never be skipped
# --------------------------------------------------------------------------

# With NANOQ_NO_CPU_SKIPS=1 (set by .ci/run), a skipped test that is not
# marked gpu fails the session: a missing test dependency must not hide tests.
_cpu_skips = []


def pytest_runtest_logreport(report):
    if report.skipped and "gpu" not in report.keywords:
        _cpu_skips.append(f"{report.nodeid}: {report.longrepr[-1] if isinstance(report.longrepr, tuple) else ''}")


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("NANOQ_NO_CPU_SKIPS") == "1" and _cpu_skips and exitstatus == 0:
        session.config.get_terminal_writer().line(
            "\nCPU tests were skipped (NANOQ_NO_CPU_SKIPS=1):\n  " + "\n  ".join(_cpu_skips), red=True)
        session.exitstatus = 1


# --------------------------------------------------------------------------
# pytest -n auto (pytest-xdist): how many test processes
# --------------------------------------------------------------------------

# What one test process may hold at its peak: PyTorch and transformers, a few
# tiny models, the CUDA emulator's host copies, or the instrumented runtime
# under tests/sanitize/run.sh (the largest process of a whole ASan run measured
# 2.0 GiB; 3 GiB leaves room).
_TEST_PROCESS_BYTES = 3 << 30


# optionalhook: without pytest-xdist (the GPU machine may lack it) pytest
# would refuse a hook it does not know, and with it the whole conftest.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """One test process per core this process may run on, and no more than the
    available memory holds. Each test already runs its devices on worker
    threads, so more processes than cores would only make them wait."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) << 10 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return cores
    return max(1, min(cores, available // _TEST_PROCESS_BYTES))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest -n's default distribution (load) with work stealing: a process
    that runs out of tests takes some of another's pending ones, so the run
    does not end on one process working through a queue of slow tests
    while the others wait."""
    if config.getvalue("dist") != "load":
        return None
    try:
        from xdist.scheduler import WorkStealingScheduling
    except ImportError:  # pytest-xdist before 3.2: its own load scheduling
        return None
    return WorkStealingScheduling(config, log)
