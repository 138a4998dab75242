"""nanoq.Trainer: the Python face of the core's data-parallel trainer."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Dict

import numpy as np

from nanoq import _core
from nanoq.config import ModelConfig, TrainOptions
from nanoq.hf_io import iter_weights

IGNORE_INDEX = -100
# Tensors some Hugging Face checkpoints carry that are not parameters.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class StepStats:
    """Statistics of one optimizer step (or one validation batch).

    loss: mean cross-entropy over the counted tokens (target != -100) of all
    micro-batches on all devices; loss_1k: the same over positions < 1024;
    z_loss: mean z_loss * lse**2 (in the gradient, not in ``loss``);
    grad_norm: norm of the mean-loss gradient before clipping (nan for
    validation); lse_max / lse_mean: per-token log-sum-exp of the logits;
    tokens: number of counted tokens.
    """

    loss: float
    loss_1k: float
    z_loss: float
    grad_norm: float
    lse_max: float
    lse_mean: float
    tokens: int


def _resolve_backend(name: str) -> str:
    if name == "auto":
        return "cuda" if _core.backend_available("cuda") else "cpu"
    if not _core.backend_available(name):
        raise ValueError(f"backend {name!r} is not available in this build of nanoq "
                         f"(built with: cpu{', cuda' if _core.backend_available('cuda') else ''})")
    return name


def _check_tokens(name: str, array, shape, vocab_size: int, allow_ignore: bool) -> np.ndarray:
    """Checks a token batch; returns it unchanged (no copy)."""
    if hasattr(array, "__cuda_array_interface__") and not isinstance(array, np.ndarray):
        raise TypeError(f"{name} is a device array; this build takes host (numpy) arrays")
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy int32 array, got {type(array).__name__}")
    if array.dtype != np.int32:
        raise TypeError(f"{name} must have dtype int32, got {array.dtype}")
    if array.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (devices*batch_size, seq_len), got {array.shape}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    bad = (array < 0) | (array >= vocab_size)
    if allow_ignore:
        bad &= array != IGNORE_INDEX
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        value = int(array[index])
        rule = f"outside [0, {vocab_size})" + (f" and not {IGNORE_INDEX}" if allow_ignore else "")
        raise ValueError(f"token id {value} {rule} in {name}[{', '.join(map(str, index))}]")
    return array


def _check_hyper(name: str, value, low: float, high: float = math.inf, low_inclusive=True, high_inclusive=True):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    ok = math.isfinite(value) and (value >= low if low_inclusive else value > low) and \
        (value <= high if high_inclusive else value < high)
    if not ok:
        lb, hb = "[" if low_inclusive else "(", "]" if high_inclusive else ")"
        raise ValueError(f"{name} must be finite and in {lb}{low}, {high}{hb}, got {value}")
    return value


class Trainer:
    """Trains one model on ``options.devices`` devices from this thread.

    ``step(inputs, targets)`` runs forward and backward of one micro-batch on
    every device; ``update(lr, ...)`` applies AdamW to the gradients of all
    micro-batches since the last update. Weights are initialised from
    ``options.seed`` at construction; ``import_weights`` replaces them.
    Use as a context manager or call ``close()``.
    """

    def __init__(self, config: ModelConfig, options: TrainOptions):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a nanoq.ModelConfig, got {type(config).__name__}")
        if not isinstance(options, TrainOptions):
            raise TypeError(f"options must be a nanoq.TrainOptions, got {type(options).__name__}")
        self.config = config
        self.options = options
        self.backend = _resolve_backend(options.backend)
        self._core = None
        core_options = dataclasses.asdict(options)
        core_options["backend"] = self.backend
        self._core = _core.CoreTrainer(config.to_core(), core_options)
        self._parameters = self._core.parameters()
        self._index = {name: i for i, (name, _, _) in enumerate(self._parameters)}
        self._batch_shape = (options.devices * options.batch_size, options.seq_len)
        self.init_weights(options.seed)

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        """Stops the device workers and frees all memory. Safe to call twice."""
        if self._core is not None:
            self._core.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def world_size(self) -> int:
        """Number of devices (worker threads) this trainer runs on."""
        return self._core.world_size

    @property
    def parameter_names(self) -> list[str]:
        """Hugging Face names of the parameters, in the core's order."""
        return [name for name, _, _ in self._parameters]

    # -- weights -------------------------------------------------------------
    def init_weights(self, seed: int = 0) -> None:
        """Fresh weights from ``seed``: N(0, 0.02) matrices (output projections
        scaled by 1/sqrt(2*layers)), unit norms, zero biases. Identical on any
        device count."""
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        rng = np.random.default_rng(int(seed))
        residual_scale = 1.0 / math.sqrt(2 * self.config.num_hidden_layers)
        for index, (name, shape, _) in enumerate(self._parameters):
            if name.endswith("norm.weight"):
                value = np.ones(shape, np.float32)
            elif name.endswith(".bias"):
                value = np.zeros(shape, np.float32)
            else:
                std = 0.02 * (residual_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
                value = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            self._core.set_parameter(index, value.reshape(-1))

    def import_weights(self, path: str | os.PathLike) -> None:
        """Loads Hugging Face weights: a model directory, ``model.safetensors``
        or ``model.safetensors.index.json`` (sharded). Every parameter must be
        present with the config's shape; bf16/fp16 tensors are widened to fp32."""
        loaded = set()
        for name, array in iter_weights(path):
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            index = self._index.get(name)
            if index is None:
                raise ValueError(f"{path}: tensor {name!r} is not a parameter of this model config")
            expected = self._parameters[index][1]
            if array.shape != expected:
                raise ValueError(f"{path}: tensor {name!r} has shape {array.shape}, the config needs {expected}")
            self._core.set_parameter(index, array.reshape(-1))
            loaded.add(name)
        missing = [name for name in self._index if name not in loaded]
        if missing:
            raise ValueError(f"{path}: missing {len(missing)} parameter(s), e.g. {', '.join(missing[:3])}")

    def get_weights(self) -> Dict[str, np.ndarray]:
        """All parameters as float32 arrays under Hugging Face names."""
        return {name: self._core.get_parameter(i) for i, (name, _, _) in enumerate(self._parameters)}

    def get_gradients(self) -> Dict[str, np.ndarray]:
        """Gradients (float32, Hugging Face names) of the mean loss over the
        tokens counted so far in this optimizer step, summed over devices,
        before clipping. Raises ValueError before the first ``step``."""
        if self._core.micro_steps == 0:
            raise ValueError("no gradients yet: call step() before get_gradients()")
        return {name: self._core.get_gradient(i) for i, (name, _, _) in enumerate(self._parameters)}

    # -- training ------------------------------------------------------------
    def _check_batch(self, inputs, targets) -> None:
        vocab = self.config.vocab_size
        _check_tokens("inputs", inputs, self._batch_shape, vocab, allow_ignore=False)
        _check_tokens("targets", targets, self._batch_shape, vocab, allow_ignore=True)

    def step(self, inputs: np.ndarray, targets: np.ndarray) -> None:
        """Forward and backward of one micro-batch on every device.

        inputs, targets: int32 C-contiguous arrays of shape
        [devices * batch_size, seq_len]; device d gets rows
        [d*batch_size, (d+1)*batch_size). targets[b, t] is the token that
        should follow inputs[b, :t+1], or -100 for no loss. The arrays are
        read before step returns and may be reused.
        """
        self._check_batch(inputs, targets)
        if self._core.micro_steps >= self.options.grad_accum:
            raise ValueError(f"step() called {self.options.grad_accum + 1} times without update(); "
                             f"grad_accum is {self.options.grad_accum}")
        self._core.step(inputs, targets)

    def validate(self, inputs: np.ndarray, targets: np.ndarray) -> StepStats:
        """Loss of one batch (same shapes as ``step``) without touching gradients."""
        self._check_batch(inputs, targets)
        return StepStats(**self._core.validate(inputs, targets))

    def update(self, lr: float, beta1: float = 0.9, beta2: float = 0.95, weight_decay: float = 0.1,
               grad_clip: float = 1.0, eps: float = 1e-8) -> StepStats:
        """One AdamW step (bias-corrected, decoupled weight decay on matrices
        only) on the accumulated gradients, clipped to global norm
        ``grad_clip`` (0 disables clipping). Returns the step's statistics."""
        lr = _check_hyper("lr", lr, 0.0)
        beta1 = _check_hyper("beta1", beta1, 0.0, 1.0, high_inclusive=False)
        beta2 = _check_hyper("beta2", beta2, 0.0, 1.0, high_inclusive=False)
        weight_decay = _check_hyper("weight_decay", weight_decay, 0.0)
        grad_clip = _check_hyper("grad_clip", grad_clip, 0.0)
        eps = _check_hyper("eps", eps, 0.0, low_inclusive=False)
        if self._core.micro_steps == 0:
            raise ValueError("update() called before any step(): there are no gradients to apply")
        return StepStats(**self._core.update(lr, beta1, beta2, weight_decay, grad_clip, eps))

    @property
    def optimizer_steps(self) -> int:
        """Number of update() calls so far."""
        return self._core.optimizer_steps

    # -- inspection ----------------------------------------------------------
    def get_allocations(self, device: int) -> list[dict]:
        """Every allocation of ``device``: dicts with context, name, bytes, kind."""
        return self._core.allocations(self._check_device(device))

    def get_stack_info(self, device: int) -> dict:
        """Activation stack of ``device``: capacity, high_water (bytes) and the
        (name, bytes) entries live at the high-water mark."""
        return self._core.stack_info(self._check_device(device))

    def _check_device(self, device) -> int:
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)) or not 0 <= device < self.world_size:
            raise ValueError(f"device must be an integer in [0, {self.world_size}), got {device!r}")
        return int(device)

    def _inject_fault(self, rank: int) -> None:
        """Test hook: the next step() fails inside worker ``rank``."""
        self._core.inject_fault(self._check_device(rank))
