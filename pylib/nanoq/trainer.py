"""nanoq.Trainer: the Python face of the core's data-parallel trainer."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading
import warnings
from typing import Dict

import numpy as np

from nanoq import _core
from nanoq import distributed
from nanoq import generation
from nanoq import options as option_schema
from nanoq.backends import (CUDA_BACKENDS, OversubscriptionWarning, cpu_oversubscription, device_count, new_comm_id,
                            resolve_backend)
from nanoq.trainer_config import ModelConfig, TrainOptions, auto_dtype
from nanoq.hf_io import is_parameter, iter_weights, model_fingerprint, read_weights_named, weight_shapes

IGNORE_INDEX = _core.IGNORE_INDEX  # a target the loss skips
# Waits for the devices are cut into slices this long, so that Python runs a
# signal's handler (Ctrl-C's KeyboardInterrupt) between them.
_WAIT_SLICE_MS = 50


@dataclasses.dataclass(frozen=True)
class StepStats:
    """Statistics of one optimizer step (or one validation batch).

    loss: mean cross-entropy over the counted tokens (target != -100) of all
    micro-batches on all devices; loss_1k: the same over positions < 1024;
    z_loss: mean z_loss * lse**2 (in the gradient, not in ``loss``);
    grad_norm: norm of the mean-loss gradient before clipping (nan for
    validation); lse_max / lse_mean: per-token log-sum-exp of the logits;
    tokens: number of counted tokens; with none (every target -100) the
    means (loss, loss_1k, z_loss, lse_*) are 0.0, not NaN. skipped: the
    loss or the gradient was not finite, or no token counted (tokens == 0),
    so update() applied nothing (weights, AdamW state and step count
    unchanged; the gradients are discarded).
    """

    loss: float
    loss_1k: float
    z_loss: float
    grad_norm: float
    lse_max: float
    lse_mean: float
    tokens: int
    skipped: bool = False


def _bad_tokens(values, vocab_size: int, allow_ignore: bool):
    """Mask of the ids outside [0, vocab_size), -100 allowed where allow_ignore (numpy or cupy)."""
    bad = (values < 0) | (values >= vocab_size)
    if allow_ignore:
        bad &= values != IGNORE_INDEX
    return bad


def _first_bad_token(name: str, bad, array_module, values, vocab_size: int, allow_ignore: bool) -> None:
    """Raises naming the first offending index when `bad` has any True."""
    if bool(bad.any()):
        index = tuple(int(i) for i in array_module.argwhere(bad)[0])
        value = int(values[index])
        rule = f"outside [0, {vocab_size})" + (f" and not {IGNORE_INDEX}" if allow_ignore else "")
        raise ValueError(f"token id {value} {rule} in {name}[{', '.join(map(str, index))}]")


def _check_host_batch_array(name: str, array, shape, kinds: str) -> None:
    """A host batch array: numpy, int32, of the batch's shape, C-contiguous
    (TypeError/ValueError naming it; ``kinds`` says what else it may be)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy int32 array{kinds}, got {type(array).__name__}")
    if isinstance(array, np.ma.MaskedArray):  # (its mask would be ignored: the core reads the data)
        raise TypeError(f"{name} is a numpy masked array, whose mask nanoq would not see: give a plain array "
                        f"(targets -100 are not trained on), e.g. {name}.filled(-100) for targets")
    if array.dtype != np.int32:
        raise TypeError(f"{name} must have dtype int32, got {array.dtype}")
    if array.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (devices*batch_size, seq_len), got {array.shape}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray)")


def _check_host_tokens(name: str, array, shape, vocab_size: int, allow_ignore: bool) -> np.ndarray:
    """Checks a numpy token batch; returns it unchanged (no copy)."""
    _check_host_batch_array(name, array, shape, " or a device array")
    _first_bad_token(name, _bad_tokens(array, vocab_size, allow_ignore), np, array, vocab_size, allow_ignore)
    return array


def _check_positions(positions, shape):
    """Checks a batch's per-token positions (None: none): a numpy int32
    C-contiguous array of the batch's shape, each row a run of documents,
    position 0 where one starts (every row starts one) and one more than
    the position before inside it. Returns it unchanged (or None)."""
    if positions is None:
        return None
    _check_host_batch_array("positions", positions, shape, " (host memory)")
    previous = np.concatenate([np.full((shape[0], 1), -1, np.int32), positions[:, :-1]], axis=1)
    bad = np.argwhere((positions != 0) & (positions != previous + 1))
    if bad.size:
        r, t = (int(i) for i in bad[0])
        raise ValueError(f"positions[{r}, {t}] is {positions[r, t]}: a position is 0 (a document starts; "
                         f"every row starts with one) or one more than the position before it "
                         f"({previous[r, t]})")
    return positions


def _interface_stream(name: str, interface) -> int:
    """The stream a device array's producer says its data is (being) written
    on: CUDA Array Interface v3 ``stream``, as the core takes it. 1 is the
    legacy default stream, 2 the per-thread default stream, any other
    positive int a ``cudaStream_t``; None (or no entry, as before version 3)
    means nothing to wait for and becomes 0. The spec disallows 0."""
    stream = interface.get("stream")
    if stream is None:
        return 0
    if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
        raise TypeError(f"{name}.__cuda_array_interface__['stream'] must be None or an int, "
                        f"got {type(stream).__name__}")
    stream = int(stream)
    if stream == 0:
        raise ValueError(f"{name}.__cuda_array_interface__['stream'] is 0, which the CUDA Array Interface "
                         "disallows (ambiguous): the producer must give None, 1, 2 or a stream handle")
    if not 0 < stream < 2**64:
        raise ValueError(f"{name}.__cuda_array_interface__['stream'] = {stream} is not a stream handle")
    return stream


def _device_array(name: str, array, shape) -> tuple[int, int]:
    """Checks an array with ``__cuda_array_interface__`` (int32, ``shape``,
    C-contiguous); returns (pointer, stream) with stream as _interface_stream."""
    interface = array.__cuda_array_interface__
    if np.dtype(interface["typestr"]) != np.int32:
        raise TypeError(f"{name} must have dtype int32, got {np.dtype(interface['typestr'])}")
    if tuple(interface["shape"]) != shape:
        raise ValueError(f"{name} must have shape {shape} (devices*batch_size, seq_len), "
                         f"got {tuple(interface['shape'])}")
    strides = interface.get("strides")
    if strides is not None and tuple(strides) != (4 * shape[1], 4):
        raise ValueError(f"{name} must be C-contiguous")
    return int(interface["data"][0]), _interface_stream(name, interface)


def _check_device_tokens(name: str, array, stream: int, vocab_size: int, allow_ignore: bool) -> int:
    """Checks the token ids of a device array (see _device_array) on the GPU,
    on its producer's stream so that the check reads what the producer
    wrote; returns the array's device."""
    import cupy  # a device array means the cuda backend, which needs cupy here

    device_array = cupy.asarray(array)
    with device_array.device:
        if stream == 0:
            producer = cupy.cuda.get_current_stream()
        elif stream == 1:
            producer = cupy.cuda.Stream.null
        elif stream == 2:
            producer = cupy.cuda.Stream.ptds
        else:
            producer = cupy.cuda.ExternalStream(stream)
        with producer:
            _first_bad_token(name, _bad_tokens(device_array, vocab_size, allow_ignore), cupy, device_array,
                             vocab_size, allow_ignore)
    return int(device_array.device.id)
def _check_hyper(name: str, value, low: float, high: float = math.inf, low_inclusive=True, high_inclusive=True):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        number = math.inf
    with np.errstate(over="ignore"):
        single = float(np.float32(number))  # what the core computes with

    def ok(x: float) -> bool:
        return math.isfinite(x) and (x >= low if low_inclusive else x > low) and \
            (x <= high if high_inclusive else x < high)
    if not ok(number) or not ok(single):
        lb, hb = "[" if low_inclusive else "(", "]" if high_inclusive else ")"
        rounded = f" ({single!r} as the core's float32)" if ok(number) else ""
        raise ValueError(f"{name} must be finite and in {lb}{low}, {high}{hb}, got {number}{rounded}")
    return number


def _one_call(method):
    """``method`` runs as one call of its Trainer: it holds the call lock
    throughout, so that another thread's calls, close() included, come
    before or after it, not between its core calls."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._calls:
            return method(self, *args, **kwargs)
    return call


class _CoreCalls:
    """The core trainer seen through its Trainer's call lock: each method
    call holds the lock, so ``Trainer.close()``, which holds it too, frees
    the core only when no other thread is inside a call (most calls let go
    of the GIL while the devices work)."""

    __slots__ = ("_core", "_lock")

    def __init__(self, core, lock):
        self._core, self._lock = core, lock

    def __getattr__(self, name):
        attribute = getattr(self._core, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            with self._lock:
                return attribute(*args, **kwargs)
        return call


class Trainer:
    """Trains one model on ``options.devices`` devices from this thread.

    ``step(inputs, targets)`` runs forward and backward of one micro-batch on
    every device; ``update(lr, ...)`` applies AdamW to the gradients of all
    micro-batches since the last update. Weights are initialised from
    ``options.seed`` at construction; ``import_weights`` replaces them.
    Use as a context manager or call ``close()``.

    Under a launcher (``mpiexec``, ``srun``; see nanoq.distributed), every
    process makes its Trainer with the same config and options, and
    together they train as one world of processes x ``options.devices``
    devices: process p's devices are global ranks p*devices...; ``step``
    takes this process's rows of each global batch (``devices *
    batch_size`` of them). ``processes`` overrides the launcher's
    ProcessGroup (tests); options that place the trainer in a world
    themselves (``world_size`` > 0) are left as they are.

    Interrupts: Ctrl-C (KeyboardInterrupt) while ``step``, ``validate``,
    ``update`` or ``wait`` waits for the devices arrives at once (within
    about 50 ms). In ``step`` it discards that micro-batch alone: it is
    never queued, the micro-batches before it stay (``micro_steps`` counts
    them; the one running goes on in the background), and the next call is
    valid. In ``update``, ``validate`` and ``wait`` it discards every
    micro-batch since the last ``update``: those queued and not begun never
    run, the one running finishes in the background and its gradients are
    then cleared, so the trainer is as after the last ``update``
    (``micro_steps`` is 0; the next ``step`` or ``validate`` is valid,
    ``update`` needs a new ``step`` first, and a later call first waits for
    that running micro-batch). An ``update``
    whose own optimizer work had begun completes (``optimizer_steps`` says
    whether it counted); an interrupted ``validate`` returns nothing (its
    forward pass may finish in the background). In a world of several trainers
    (processes) an interrupted trainer refuses further work: close it.
    """

    def __init__(self, config: ModelConfig, options: TrainOptions, *,
                 processes: distributed.ProcessGroup | None = None):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a nanoq.ModelConfig, got {type(config).__name__}")
        if not isinstance(options, TrainOptions):
            raise TypeError(f"options must be a nanoq.TrainOptions, got {type(options).__name__}")
        if processes is not None and not isinstance(processes, distributed.ProcessGroup):
            raise TypeError(f"processes must be a nanoq.distributed.ProcessGroup, got {type(processes).__name__}")
        # Copies: the caller's objects may change later, this trainer's model and options do not.
        self.config = dataclasses.replace(config)
        self.options = dataclasses.replace(options)
        self._core = None
        self._validated_batch = None
        # step/validate/update/wait from several threads run one at a time (validate is two core calls)
        self._calls = threading.RLock()
        self.processes = distributed.processes() if processes is None else processes
        self.backend = resolve_backend(options.backend)
        core_options = dataclasses.asdict(self._place_in_world(options))
        core_options["backend"] = self.backend
        if options.dtype == "auto":
            core_options["dtype"] = auto_dtype(self.backend)
        option_schema.check(core_options)  # now that backend and dtype are known
        self.dtype = core_options["dtype"]
        transport = self.processes.transport() if self._joined else None
        if self._joined:
            self._world_group = self.processes
        elif not options.world_size or options.world_size == options.devices:
            self._world_group = distributed.SingleProcess()
        else:
            self._world_group = None  # a world of trainers placed by hand (TrainOptions.world_size)
        self._core = _CoreCalls(_core.CoreTrainer(config.to_core(), core_options, transport), self._calls)
        parameters = self._core.parameters()
        self._parameters = [(name, shape, decay) for name, shape, decay, _ in parameters]
        # Indices of the parameters that train (all, unless LoRA froze the model's weights).
        self._trainable = [i for i, (*_, trainable) in enumerate(parameters) if trainable]
        self._index = {name: i for i, (name, _, _) in enumerate(self._parameters)}
        self.lora = options.lora
        self.base_model: str | None = None  # the directory import_weights read (LoRA checkpoints refer to it)
        # nanoq.hf_io.model_fingerprint of what import_weights read there (checkpoints record it)
        self.base_model_fingerprint: str | None = None
        # Where the weights (with LoRA: the frozen ones) came from: None (init_weights), "import_weights"
        # or "set_weights"; a LoRA checkpoint of a base model is refused on initial weights.
        self.weights_from: str | None = None
        self._alone_in_world = self.topology[0] == self.world_size
        self._batch_shape = (options.devices * options.batch_size, options.seq_len)
        self.init_weights(options.seed)
        if self.backend == "cpu":  # (nanoq train says this in its settings' words instead)
            node_processes = self.processes.node_local()[1] if self._joined else 1
            warning = cpu_oversubscription(options.devices, options.threads, node_processes,
                                           names=("TrainOptions.devices", "TrainOptions.threads"))
            if warning:
                warnings.warn(warning, OversubscriptionWarning, stacklevel=2)

    def _place_in_world(self, options: TrainOptions) -> TrainOptions:
        """``options`` placed in the world of this trainer's processes: every
        process's devices one after the other, and rank 0's communicator id."""
        group = self.processes
        self._joined = group.size > 1 and not options.world_size
        if not self._joined:
            return options
        devices = group.allgather(options.devices)
        if len(set(devices)) != 1:
            raise ValueError(f"every process of a run must drive the same number of devices; run.devices per "
                             f"process: {devices}")
        if self.backend in CUDA_BACKENDS and group.transport() is not None and self.backend != "cuda":
            raise ValueError(f"the {self.backend} backend connects the trainers of one process only (its NCCL is a "
                             f"stand-in); several processes need backend cuda or cpu")
        first_device = options.first_device
        if self.backend == "cuda" and not first_device:
            first_device = distributed.local_devices(group, options.devices, device_count(self.backend))
        comm_id = group.broadcast(new_comm_id(self.backend) if group.is_root else None)
        return dataclasses.replace(options, world_size=group.size * options.devices,
                                   first_rank=group.rank * options.devices, comm_id=comm_id,
                                   first_device=first_device)

    # -- lifecycle -----------------------------------------------------------
    def wait(self) -> None:
        """Waits until the devices have done the work ``step()`` queued.
        A failure of that work is raised here (naming its step), as it is by
        the next ``update()``, ``validate()`` or getter; the trainer then
        refuses further work."""
        with self._interruptible():
            self._wait_for_devices(for_step=False)
            self._core.wait()

    @property
    def micro_steps(self) -> int:
        """Micro-batches ``step()`` took since the last ``update()`` (0 after an interrupt)."""
        return self._core.micro_steps

    @contextlib.contextmanager
    def _interruptible(self, discard: bool = True):
        """The block runs as this thread's call alone; a KeyboardInterrupt
        inside it discards the micro-batches since the last update (see the
        class docstring) unless ``discard`` is false, then goes on up."""
        try:
            with self._calls:
                yield
        except KeyboardInterrupt:
            with self._calls:
                if self._core is not None and discard:
                    self._core.discard_micro_batches()
            raise

    def _wait_for_devices(self, for_step: bool) -> None:
        """Waits, in slices that let signal handlers run, for what the next
        core call would wait for first (the queued steps; for a step, its
        batch slot), so that the call itself then waits no more for them."""
        while not self._core.wait_ready(_WAIT_SLICE_MS, for_step):
            pass
        if not for_step:  # all queued work is done: a validate queued before has read its batch
            self._validated_batch = None

    def close(self) -> None:
        """Waits for queued work, then stops the device workers and frees all
        memory (also when the queued work failed: its error is raised after
        the memory is freed, so a failure is never lost). Safe to call twice,
        and from another thread than one using the trainer: the memory is
        freed once that thread's call has returned (its next call raises
        RuntimeError; ``wait()``, with nothing queued, returns)."""
        if self._core is None:
            return
        with self._calls:
            try:
                self._core.wait()
            finally:
                self._core.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:
            pass  # the exception already leaving the block is the one to see

    @property
    def world_size(self) -> int:
        """Number of devices (worker threads) this trainer runs on (in a larger
        world, this trainer's part: see ``topology``)."""
        return self._core.world_size

    @property
    def topology(self) -> tuple:
        """(world size, global rank of this trainer's first device)."""
        return self._core.world, self._core.first_rank

    @property
    def world_group(self) -> distributed.ProcessGroup | None:
        """The processes whose trainers make up this trainer's world: its
        ProcessGroup when it joined the world of several processes, a
        SingleProcess when it is alone in its world, None for a world
        placed by hand (TrainOptions.world_size), whose other trainers it
        cannot reach. Calls that need the whole world's state (checkpoints,
        exports, the getters below) are collective over this group."""
        return self._world_group

    @property
    def parameter_names(self) -> list[str]:
        """Hugging Face names of the parameters, in the core's order (with
        LoRA: the adapters, then the frozen model weights)."""
        return [name for name, _, _ in self._parameters]

    @property
    def parameter_shapes(self) -> Dict[str, tuple]:
        """{Hugging Face name: shape} of every parameter, in the core's order
        (no weights are read: this needs no collective in a larger world)."""
        return {name: shape for name, shape, _ in self._parameters}

    @property
    def trainable_names(self) -> list[str]:
        """Names of the parameters that have gradients and optimizer state."""
        return [self._parameters[i][0] for i in self._trainable]

    # -- weights -------------------------------------------------------------
    @_one_call
    def init_weights(self, seed: int = 0) -> None:
        """Fresh weights from ``seed``: N(0, 0.02) matrices (output projections
        scaled by 1/sqrt(2*layers)), unit norms, zero biases; LoRA adapters
        as ``nanoq.lora.init_adapters`` (B = 0, so the adapted model starts
        equal to the base). Identical on any device count."""
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        rng = np.random.default_rng(int(seed))
        residual_scale = 1.0 / math.sqrt(2 * self.config.num_hidden_layers)
        self.base_model = self.weights_from = self.base_model_fingerprint = None
        if self.lora is not None:
            self.init_adapters(seed)
        for index, (name, shape, _) in enumerate(self._parameters):
            if ".lora_" in name:
                continue
            if name.endswith("norm.weight"):
                value = np.ones(shape, np.float32)
            elif name.endswith(".bias"):
                value = np.zeros(shape, np.float32)
            else:
                std = 0.02 * (residual_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
                value = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            self._core.set_parameter(index, value.reshape(-1))

    @_one_call
    def init_adapters(self, seed: int = 0) -> None:
        """Fresh LoRA adapters from ``seed`` (see ``nanoq.lora.init_adapters``)."""
        from nanoq.lora import init_adapters

        if self.lora is None:
            raise ValueError("this trainer has no LoRA adapters (TrainOptions.lora is None)")
        for name, value in init_adapters(self.config, self.lora, seed).items():
            self._core.set_parameter(self._index[name], value.reshape(-1))

    @_one_call
    def import_weights(self, path: str | os.PathLike) -> None:
        """Loads Hugging Face weights: a model directory, ``model.safetensors``
        or ``model.safetensors.index.json`` (sharded). Every parameter must be
        present with the config's shape; bf16/fp16 tensors are widened to fp32.
        Every file's header is checked first: on any error nothing is loaded.
        A tied model (tie_word_embeddings) takes a file's lm_head.weight only
        when it equals its embedding (ValueError otherwise: another model).
        With LoRA these are the frozen weights; the adapters are untouched."""
        self._require_open()

        def wanted(name: str) -> bool:
            return is_parameter(name, self.config.tie_word_embeddings)

        in_file = weight_shapes(path)
        shapes = {name: shape for name, shape in in_file.items() if wanted(name)}
        for name, shape in shapes.items():
            index = self._index.get(name)
            if index is None:
                raise ValueError(f"{path}: tensor {name!r} is not a parameter of this model config")
            if shape != self._parameters[index][1]:
                raise ValueError(f"{path}: tensor {name!r} has shape {shape}, the config needs "
                                 f"{self._parameters[index][1]}")
        missing = [name for name in self._index if name not in shapes and ".lora_" not in name]
        if missing:
            raise ValueError(f"{path}: missing {len(missing)} parameter(s), e.g. {', '.join(missing[:3])}")
        if self.config.tie_word_embeddings and "lm_head.weight" in in_file:
            # A tied model's output matrix is its embedding: a file whose lm_head differs is another model.
            pair = read_weights_named(path, ("lm_head.weight", "model.embed_tokens.weight"))
            if not np.array_equal(pair["lm_head.weight"], pair["model.embed_tokens.weight"]):
                raise ValueError(f"{path}: its lm_head.weight differs from its model.embed_tokens.weight, but this "
                                 f"model config ties them (tie_word_embeddings): load it with "
                                 f"tie_word_embeddings=False (its config.json's tie_word_embeddings is what "
                                 f"ModelConfig.from_pretrained reads)")
        for name, array in iter_weights(path):
            if wanted(name):
                self._core.set_parameter(self._index[name], array.reshape(-1))
        self.base_model, self.weights_from = os.path.abspath(os.fspath(path)), "import_weights"
        self.base_model_fingerprint = model_fingerprint(path)  # once, of what was read: each save records it

    @_one_call
    def get_weights(self, trainable_only: bool = False) -> Dict[str, np.ndarray]:
        """All parameters (or only the trainable ones) as float32 arrays
        under Hugging Face names; with LoRA the adapters are
        ``...q_proj.lora_A.weight`` and ``...q_proj.lora_B.weight``.

        In a world of several processes at ZeRO stage 3 this is collective
        (every process calls it; each gets the full tensors, the layers'
        gathered from every process's shards, one tensor at a time)."""
        indices = self._trainable if trainable_only else range(len(self._parameters))
        gather = self._gathers() and self.options.zero_stage == 3
        trainable = set(self._trainable)
        out = {}
        for i in indices:
            if gather and i in trainable:
                out[self._parameters[i][0]] = self._gather_parts(i, self._core.get_parameter_part)
            else:
                out[self._parameters[i][0]] = self._core.get_parameter(i)
        return out

    def _gathers(self) -> bool:
        """Whether whole-world reads gather the parts of other processes."""
        return self._world_group is not None and self._world_group.size > 1

    def _gather_parts(self, index: int, read_part) -> np.ndarray:
        """Trainable parameter ``index``'s full tensor from every process's
        part (``read_part(index)``, of ``owned_range``); collective."""
        name, shape, _ = self._parameters[index]
        begin, _ = self._core.owned_range(index)
        full = np.empty(math.prod(shape), np.float32)
        covered = 0
        for part_begin, part in self._world_group.allgather((begin, read_part(index))):
            full[part_begin:part_begin + part.size] = part
            covered += part.size
        if covered != full.size:  # the processes' trainers are not one world's ranks, in order
            raise RuntimeError(f"the processes' parts of {name} cover {covered} of its {full.size} elements")
        return full.reshape(shape)

    @_one_call
    def get_gradients(self) -> Dict[str, np.ndarray]:
        """Gradients (float32, Hugging Face names) of the mean loss over the
        tokens counted so far in this optimizer step, summed over devices,
        before clipping. Raises ValueError before the first ``step``. In a
        world of several processes this is collective (every process calls
        it; each gets the whole world's gradients, summed over processes in
        rank order, one tensor at a time); a trainer in a world placed by
        hand (``world_group`` None) cannot reach the others: ValueError."""
        self._require_training("get_gradients")
        if self._core.micro_steps == 0:
            raise ValueError("no gradients yet: call step() before get_gradients()")
        if not self._gathers():
            return {self._parameters[i][0]: self._core.get_gradient(i) for i in self._trainable}
        out = {}
        for i in self._trainable:
            addends = self._world_group.allgather(self._core.get_gradient_addend(i))
            total = addends[0].copy()  # the processes of a ThreadWorld share the objects
            for addend in addends[1:]:
                total += addend
            out[self._parameters[i][0]] = total
        return out

    # -- checkpoints and export ---------------------------------------------
    def _require_open(self) -> None:
        """RuntimeError("this Trainer is closed") after close(), as every core
        call then raises, for the calls that look at their arguments (files,
        dicts) first: that a closed trainer can do nothing is the news."""
        self._core.world_size  # noqa: B018 - the core's closed check

    def _require_training(self, what: str, hint: str = "") -> None:
        """ValueError for a call that trains (or keeps training state) on an inference trainer."""
        if self.options.inference:
            raise ValueError(f"{what}() needs a trainer made for training: this one has inference=True (no "
                             f"gradients or optimizer state){hint}")

    @_one_call
    def save_checkpoint(self, directory: str | os.PathLike, step: int, extra_state: dict | None = None, *,
                        keep_last: int = 0, keep_every: int = 0, tokenizer_dir: str | None = None) -> str:
        """Writes ``directory/step_<step:08d>/`` atomically (see nanoq.checkpoint)
        and points ``directory/latest`` at it; returns the step directory.
        extra_state: JSON-serialisable state of the caller (data loader,
        schedule, ...) returned by ``load_checkpoint``. With keep_last > 0,
        older checkpoints are then deleted except the newest keep_last and
        every step divisible by keep_every. tokenizer_dir is recorded for
        ``nanoq export``. In a world of several processes every process calls
        it: each writes its own part, and all return once the checkpoint is
        complete (see nanoq.checkpoint)."""
        from nanoq.checkpoint import save_checkpoint

        self._require_training("save_checkpoint", "; write its weights with export_model instead")
        return save_checkpoint(self, directory, step, extra_state, keep_last=keep_last, keep_every=keep_every,
                               tokenizer_dir=tokenizer_dir)

    @_one_call
    def load_checkpoint(self, directory: str | os.PathLike) -> dict:
        """Restores weights, master weights, AdamW state and step count from a
        step directory, or from the newest valid one of a checkpoint root.
        Works with any number of processes and devices, whatever wrote it.
        Returns the checkpoint's JSON state (``step``, ``extra_state``, ...).
        Everything is checked before the trainer is touched. In a world of
        several processes every process calls it."""
        self._require_open()
        self._require_training("load_checkpoint", "; it takes a checkpoint's weights with "
                               "set_weights(nanoq.checkpoint.read_weights(step_dir), trainable_only=True)")
        from nanoq.checkpoint import load_checkpoint

        return load_checkpoint(self, directory)

    @_one_call
    def export_model(self, directory: str | os.PathLike, **kwargs) -> str:
        """Writes a Hugging Face model directory (see nanoq.hf_export.export_model);
        returns its path. In a world of several processes every process
        calls it, process 0 writes, and every process gets the path."""
        from nanoq.hf_export import export_model

        return export_model(self, directory, **kwargs)

    OPTIMIZER_STATE = ("master", "adam_m", "adam_v")

    @_one_call
    def get_optimizer_state(self) -> Dict[str, Dict[str, np.ndarray]]:
        """{"master" | "adam_m" | "adam_v": {Hugging Face name: float32 array}}
        of the trainable parameters, gathered from every device's shard (in
        a world of several processes: collective, every process gets the
        full tensors). A trainer in a world placed by hand (``world_group``
        None) cannot reach the other shards: ValueError."""
        self._require_training("get_optimizer_state")
        if self._gathers():
            return {kind: {self._parameters[i][0]: self._gather_parts(
                i, lambda index, k=k: self._core.get_optimizer_state_part(index, k)) for i in self._trainable}
                for k, kind in enumerate(self.OPTIMIZER_STATE)}
        return {kind: {self._parameters[i][0]: self._core.get_optimizer_state(i, k) for i in self._trainable}
                for k, kind in enumerate(self.OPTIMIZER_STATE)}

    # -- this trainer's part of the world's state ----------------------------
    def owned_range(self, name: str) -> tuple[int, int]:
        """(begin, end): the elements of trainable parameter ``name``
        (flattened in C order) that lie in the ZeRO shards of this trainer's
        devices, the part of it this trainer writes to a checkpoint.
        (0, size) for a trainer alone in its world; begin == end when none."""
        return self._core.owned_range(self._trainable_index(name))

    def get_parameter_part(self, name: str) -> np.ndarray:
        """The ``owned_range`` part of trainable parameter ``name``'s
        weights: float32 [end - begin]. Never needs other trainers."""
        return self._core.get_parameter_part(self._trainable_index(name))

    def get_optimizer_state_part(self, name: str, kind: str) -> np.ndarray:
        """The ``owned_range`` part of ``kind`` ("master", "adam_m" or
        "adam_v") of trainable parameter ``name``: float32 [end - begin]."""
        self._require_training("get_optimizer_state_part")
        return self._core.get_optimizer_state_part(self._trainable_index(name), self._optimizer_kind(kind))

    def set_optimizer_state_part(self, name: str, kind: str, part: np.ndarray) -> None:
        """Writes what ``get_optimizer_state_part`` reads (float32 [end - begin])."""
        self._require_training("set_optimizer_state_part")
        index, k = self._trainable_index(name), self._optimizer_kind(kind)
        self._core.set_optimizer_state_part(index, k, np.ascontiguousarray(part, np.float32).reshape(-1))

    def _trainable_index(self, name: str) -> int:
        index = self._index.get(name)
        if index is None or index not in self._trainable:
            raise ValueError(f"{name!r} is not a trainable parameter of this model")
        return index

    def _optimizer_kind(self, kind: str) -> int:
        if kind not in self.OPTIMIZER_STATE:
            raise ValueError(f"optimizer state kind must be one of {', '.join(self.OPTIMIZER_STATE)}, got {kind!r}")
        return self.OPTIMIZER_STATE.index(kind)

    @_one_call
    def set_optimizer_state(self, state: Dict[str, Dict[str, np.ndarray]], optimizer_steps: int) -> None:
        """Restores what ``get_optimizer_state`` returned and the AdamW step
        count. Every kind and parameter must be present with its shape; all
        is checked before anything is written."""
        self._require_training("set_optimizer_state")
        if isinstance(optimizer_steps, bool) or not isinstance(optimizer_steps, (int, np.integer)) \
                or not 0 <= optimizer_steps <= 2**31 - 1:
            raise ValueError(f"optimizer_steps must be an integer in [0, 2**31 - 1], got {optimizer_steps!r}")
        if self._core.micro_steps:  # (the core refuses the step count then, after the state was written)
            raise ValueError(f"cannot set the optimizer state with micro-batches pending ({self._core.micro_steps} "
                             f"step() calls since the last update()): call update() first")
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict of {{kind: {{name: array}}}}, got {type(state).__name__}")
        arrays = {}
        for kind in self.OPTIMIZER_STATE:
            for i in self._trainable:
                name, shape, _ = self._parameters[i]
                array = state.get(kind, {}).get(name)
                array = None if array is None else np.asarray(array)
                if array is None or array.shape != shape:
                    found = None if array is None else array.shape
                    raise ValueError(f"optimizer state {kind}.{name}: expected shape {shape}, got {found}")
                arrays[kind, i] = array
        for k, kind in enumerate(self.OPTIMIZER_STATE):
            for i in self._trainable:
                self._core.set_optimizer_state(i, k, np.ascontiguousarray(arrays[kind, i], np.float32).reshape(-1))
        self._core.set_optimizer_steps(int(optimizer_steps))

    @_one_call
    def set_weights(self, weights: Dict[str, np.ndarray], trainable_only: bool = False) -> None:
        """Sets every parameter (or every trainable one) from ``{Hugging Face
        name: array}`` (all must be present with their shapes, and every name
        must be a parameter of the model; checked before any is set; with
        ``trainable_only`` the frozen ones given are left as they are).

        Errors, in this order: TypeError when ``weights`` is not a dict;
        ValueError naming the names that are not parameters; TypeError for a
        given weight that is not numeric and ValueError for one with another
        shape than its parameter's (named, with both shapes); ValueError
        counting the parameters that are missing, naming a few."""
        self._require_open()
        if not isinstance(weights, dict):
            raise TypeError(f"weights must be a dict of {{name: array}}, got {type(weights).__name__}")
        unknown = sorted(name for name in weights if name not in self._index)
        if unknown:
            raise ValueError(f"{len(unknown)} weight(s) are not parameters of this model, e.g. "
                             f"{', '.join(map(repr, unknown[:3]))} (parameter_names lists them)")
        indices = list(self._trainable if trainable_only else range(len(self._parameters)))
        arrays, wrong_shapes = {}, []
        for name, shape, _ in (self._parameters[i] for i in indices):
            if name not in weights:
                continue
            array = np.asarray(weights[name])
            if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
                raise TypeError(f"weight {name}: expected a numeric array, got dtype {array.dtype}")
            if array.shape != shape:
                wrong_shapes.append(f"{name} has shape {array.shape}, expected {shape}")
            arrays[name] = array
        if wrong_shapes:
            raise ValueError(f"{len(wrong_shapes)} weight(s) have the wrong shape: {'; '.join(wrong_shapes[:3])}"
                             f"{'; ...' if len(wrong_shapes) > 3 else ''}")
        missing = [self._parameters[i][0] for i in indices if self._parameters[i][0] not in arrays]
        if missing:
            which = "trainable parameters" if trainable_only else "parameters"
            raise ValueError(f"{len(missing)} of the model's {len(indices)} {which} are missing from weights, "
                             f"e.g. {', '.join(map(repr, missing[:3]))}; set_weights sets them all at once "
                             f"(get_weights() gives every one to start from"
                             f"{'' if trainable_only else '; trainable_only=True sets only the trainable ones'})")
        for i in indices:
            self._core.set_parameter(i, np.ascontiguousarray(arrays[self._parameters[i][0]], np.float32).reshape(-1))
        if not trainable_only or self.lora is None:
            self.weights_from = "set_weights"  # (base_model stays: a caller may set back what it imported)

    # -- training ------------------------------------------------------------
    def _device_batch(self, inputs, targets):
        """(inputs pointer, targets pointer, device, inputs stream, targets
        stream) of a device batch, or None for numpy arrays; every check
        happens here, before the core. The core orders its reads after the
        producers' streams (CUDA Array Interface v3)."""
        on_device = [hasattr(a, "__cuda_array_interface__") for a in (inputs, targets)]
        vocab = self._core.vocab_size  # the model's, whatever self.config says now
        if not any(on_device):
            _check_host_tokens("inputs", inputs, self._batch_shape, vocab, allow_ignore=False)
            _check_host_tokens("targets", targets, self._batch_shape, vocab, allow_ignore=True)
            return None
        if not all(on_device):
            raise TypeError("inputs and targets must both be numpy arrays or both device arrays")
        if self.backend != "cuda":  # the emulator has no device arrays
            raise TypeError(f"device arrays need the cuda backend; this trainer runs on {self.backend}: "
                            "pass numpy arrays")
        inputs_ptr, inputs_stream = _device_array("inputs", inputs, self._batch_shape)
        targets_ptr, targets_stream = _device_array("targets", targets, self._batch_shape)
        inputs_device = _check_device_tokens("inputs", inputs, inputs_stream, vocab, False)
        targets_device = _check_device_tokens("targets", targets, targets_stream, vocab, True)
        if inputs_device != targets_device:
            raise ValueError(f"inputs are on GPU {inputs_device} but targets on GPU {targets_device}")
        if inputs_device >= self.world_size:
            raise ValueError(f"the batch is on GPU {inputs_device}, but this trainer uses GPUs "
                             f"0..{self.world_size - 1}")
        return inputs_ptr, targets_ptr, inputs_device, inputs_stream, targets_stream

    def _positions(self, positions):
        positions = _check_positions(positions, self._batch_shape)
        if positions is not None and not self.config.causal:
            raise ValueError("positions (packed documents) need a causal model; this one has model.causal False")
        return positions

    def step(self, inputs, targets, positions=None) -> None:
        """Forward and backward of one micro-batch on every device.

        inputs, targets: int32 C-contiguous arrays of shape
        [devices * batch_size, seq_len]: numpy arrays, or (cuda backend)
        device arrays such as cupy's (anything with ``__cuda_array_interface__``),
        copied on their GPU (after the work queued on the stream their
        ``__cuda_array_interface__`` names). Device d gets rows
        [d*batch_size, (d+1)*batch_size). targets[b, t] is the token that
        should follow inputs[b, :t+1], or -100 for no loss. The arrays are
        copied before step returns and may be reused at once.

        positions (optional; numpy int32, the same shape, host memory even
        for device batches) packs several documents into a row: each
        token's position in its document, 0 where one starts (every row
        starts with one), else one more than the position before. Attention
        then stays inside each document and RoPE restarts with it, so a row
        computes what each document would alone. None: positions 0 ..
        seq_len-1 in every row (one sequence per row, or a stream that
        attends across documents). Needs ``config.causal``.

        The work is queued on the devices: step returns without waiting for
        it. ``update``, ``validate`` and the getters wait for it, and a
        failure in it is raised there (or by the next step), naming the
        step; the trainer then refuses further work.
        """
        self._require_training("step")
        device_batch = self._device_batch(inputs, targets)
        positions = self._positions(positions)
        if self._core.micro_steps >= self.options.grad_accum:
            raise ValueError(f"step() called {self.options.grad_accum + 1} times without update(); "
                             f"grad_accum is {self.options.grad_accum}")
        # An interrupt discards only this micro-batch: it is not queued (or, should the
        # interrupt come just after, it counts, as micro_steps says), and those before
        # it stay. Alone in its world, that is; the members of a larger world must
        # step together, so there the interrupt ends the trainer's part (see above).
        with self._interruptible(discard=not self._alone_in_world):
            self._wait_for_devices(for_step=True)
            packed = {} if positions is None else {"positions": positions}
            if device_batch is None:
                self._core.step(inputs, targets, **packed)
            else:
                self._core.step_device(*device_batch, **packed)

    def validate(self, inputs, targets, positions=None) -> StepStats:
        """Loss of one batch (same arrays and positions as ``step``) without
        touching gradients."""
        device_batch = self._device_batch(inputs, targets)
        positions = self._positions(positions)
        with self._interruptible():
            self._wait_for_devices(for_step=False)
            # The devices read the arrays after this call if it is interrupted: keep them until they are done.
            self._validated_batch = (inputs, targets)
            packed = {} if positions is None else {"positions": positions}
            if device_batch is None:
                self._core.queue_validate(inputs, targets, **packed)
            else:
                self._core.queue_validate_device(*device_batch, **packed)
            self._wait_for_devices(for_step=False)
            return StepStats(**self._core.validate_result())

    # -- inference -------------------------------------------------------------
    @property
    def holds_whole_world(self) -> bool:
        """Whether this trainer holds every rank of its world (one process, no
        other trainers): what generation and the other whole-model calls need."""
        return self.processes.size == 1 and self.topology[0] == self.world_size

    def _require_alone(self, what: str) -> None:
        if not self.holds_whole_world:
            raise ValueError(f"{what} runs in a trainer that holds its whole world; this one is one of "
                             f"{self.processes.size} processes ({self.topology[0]} devices in all): call it in a "
                             f"single-process run")

    @_one_call
    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop=()) -> list[int]:
        """Continues ``prompt_ids`` (a sequence of token ids) by up to
        ``max_new_tokens`` tokens; returns the new ids (a list of ints).

        The core runs the prompt in one pass that fills a KV cache (its own
        allocation context, "kv-cache", kept after the first call), then one
        token at a time attending to the cache; LoRA adapters apply unmerged.
        Each token is chosen on the host from the last position's logits
        (nanoq.generation.Sampler): temperature 0 (or top_k 1) is greedy;
        else softmax(logits / temperature) restricted to the top_k highest
        (0: all) and the top_p nucleus (1: all), drawn with a generator
        seeded by ``seed`` (the same seed gives the same tokens). Generation
        ends after a token of ``stop`` (an id or ids; it is included) or
        after max_new_tokens. The prompt and the new tokens must fit in
        ``options.seq_len`` positions (and the model's max_position_embeddings). One sequence at a time, in a
        single-process trainer; gradients and optimizer state are untouched.
        """
        self._require_alone("generate()")
        if not self.config.causal:
            raise ValueError("generate() runs causal models; this one is bidirectional (model.causal False): "
                             "use denoise(prompt_ids, max_new_tokens, steps, mask_token), which fills masked "
                             "positions over a few whole-sequence passes")
        sampler = generation.Sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return generation.generate(self._core, prompt_ids, max_new_tokens, sampler, stop,
                                   self.config.max_position_embeddings)

    @_one_call
    def denoise(self, prompt_ids, max_new_tokens: int, steps: int, mask_token: int, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> list[int]:
        """Generation for a bidirectional (denoising) model, ``config.causal``
        False, by iterative unmasking; returns the ``max_new_tokens`` new ids
        (a list of ints).

        The sequence is one block of ``options.seq_len`` positions (at most
        the model's max_position_embeddings), as long as the windows a
        denoiser trains on: ``prompt_ids`` (token ids; may be empty), then
        ``mask_token`` (an id of the vocabulary) everywhere else; the
        max_new_tokens positions after the prompt are filled, the rest stay
        masks (prompt + new tokens must fit in the block). Each of ``steps`` iterations
        (1 <= steps <= max_new_tokens) runs the model over the whole sequence
        (``logits``), chooses a token for every position still masked with
        nanoq.generation.Sampler (as ``generate``: temperature 0 or top_k 1
        is greedy, else seeded sampling restricted by top_k / top_p; the mask
        token itself is never chosen) and fills the ceil(masked / iterations
        left) positions whose chosen token has the highest probability under
        softmax(logits / temperature) (temperature 1 when greedy), the earlier
        position first among equals; the rest stay masked for the next pass.
        The prompt is never changed. Single-process trainers only; gradients
        and optimizer state are untouched.
        """
        self._require_alone("denoise()")
        if self.config.causal:
            raise ValueError("denoise() runs bidirectional models (model.causal False); this one is causal: use "
                             "generate()")
        sampler = generation.Sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return generation.denoise(self._core, prompt_ids, max_new_tokens, steps, mask_token, sampler,
                                  self.config.max_position_embeddings)

    @_one_call
    def logits(self, inputs, positions=None) -> np.ndarray:
        """The model's logits for each row of ``inputs``, an integer array
        [rows, T] of token ids (T <= options.seq_len; any number of rows):
        numpy float32 [rows, T, vocab_size], position t of row r being the
        logits for the token after inputs[r, :t+1] (a bidirectional model,
        ``config.causal`` False: of position t given the whole row). Runs
        through the KV-cache path of ``generate``, one row at a time; LoRA
        adapters apply. positions (optional, numpy int32 of the same shape,
        as in ``step``): each document of a row is run alone, so its logits
        are those of the document by itself."""
        self._require_alone("logits()")
        if positions is not None:
            array = np.asarray(inputs)
            if array.ndim == 2:  # else generation.logits says what is wrong with inputs
                positions = _check_positions(positions, array.shape)
            if not self.config.causal:
                raise ValueError("positions (packed documents) need a causal model; this one has model.causal "
                                 "False")
        return generation.logits(self._core, inputs, positions)

    def update(self, lr: float, beta1: float = 0.9, beta2: float = 0.95, weight_decay: float = 0.1,
               grad_clip: float = 1.0, eps: float = 1e-8) -> StepStats:
        """One AdamW step (bias-corrected, decoupled weight decay on matrices
        only) on the accumulated gradients, clipped to global norm
        ``grad_clip`` (0 disables clipping). Returns the step's statistics."""
        self._require_training("update")
        lr = _check_hyper("lr", lr, 0.0)
        beta1 = _check_hyper("beta1", beta1, 0.0, 1.0, high_inclusive=False)
        beta2 = _check_hyper("beta2", beta2, 0.0, 1.0, high_inclusive=False)
        weight_decay = _check_hyper("weight_decay", weight_decay, 0.0)
        grad_clip = _check_hyper("grad_clip", grad_clip, 0.0)
        # A float32 subnormal eps is 0 where the GPU flushes them: 0 / 0 for a row without gradient.
        eps = _check_hyper("eps", eps, float(np.finfo(np.float32).tiny))
        if self._core.micro_steps == 0:
            raise ValueError("update() called before any step(): there are no gradients to apply")
        with self._interruptible():
            self._wait_for_devices(for_step=False)
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

    def get_attention_info(self, device: int = 0) -> dict:
        """Which attention ``device`` runs: ``implementation`` is "native"
        (the backend's own kernels) or the fused library in use (e.g.
        "cuDNN 9.28.1"), as TrainOptions.attention chose it; ``plans`` is how
        many fused-attention plans it runs (one per pass and whether it
        takes the mask of packed documents; built once per shape for the
        process's trainers of the device); ``documents`` is
        the same for attention over packed documents (positions): the fused
        library where TrainOptions.packed_documents reserved their mask, else
        "native"; ``document_masks`` counts the times that mask was written
        (once per batch of new positions: every layer's attention, forward
        and backward, shares it); ``deterministic`` is whether the attention
        backward is bitwise repeatable (the fused library's as
        TrainOptions.attention_deterministic asks; native: always)."""
        return self._core.attention_info(self._check_device(device))

    @property
    def attention(self) -> str:
        """The attention implementation device 0 runs ("native" or e.g.
        "cuDNN 9.28.1"): see ``get_attention_info``."""
        return self.get_attention_info(0)["implementation"]

    @_one_call
    def memory_summary(self) -> list[dict]:
        """Per device: ``contexts`` (bytes of device memory per context),
        ``allocated`` (their sum), ``host`` (pinned/host bytes), ``limit``
        (the memory_limit option, 0 = none) and, where the backend can tell
        (cuda: cudaMemGetInfo), the device's ``free`` and ``total`` bytes and
        ``other`` = memory in use that is not this trainer's (None on cpu)."""
        summary = []
        for device in range(self.world_size):
            contexts: Dict[str, int] = {}
            host = 0
            for segment in self.get_allocations(device):
                if segment["kind"] == "device":
                    contexts[segment["context"]] = contexts.get(segment["context"], 0) + segment["bytes"]
                else:
                    host += segment["bytes"]
            info = self._core.memory_info(device)
            other = None
            if info["total"] is not None:
                other = max(0, info["total"] - info["free"] - info["allocated"])
            summary.append(dict(device=device, contexts=contexts, allocated=info["allocated"], host=host,
                                limit=info["limit"], free=info["free"], total=info["total"], other=other))
        return summary

    def _check_device(self, device) -> int:
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)) or not 0 <= device < self.world_size:
            raise ValueError(f"device must be an integer in [0, {self.world_size}), got {device!r}")
        return int(device)

