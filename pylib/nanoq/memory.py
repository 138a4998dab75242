"""How much memory a training run takes per device, computed without allocating.

``estimate_memory(config, options)`` lists, allocation by allocation, what the
core allocates on each device (every device holds the same list), in the
order the core allocates it. It mirrors, and must be kept in step with:

- ``cuda_core/trainer.cpp`` (Trainer constructor): flat weights and float32
  gradients padded to a multiple of the device count (stage 2: a gradient
  shard, the embedding's and head's gradients and one layer's; stage 3 also:
  a weight shard, the embedding and head and two layer buffers, see
  ``cuda_core/zero.cpp``); the ZeRO-1 shards of
  the master weights (a view of the weights, allocating nothing, when master
  and weight dtypes agree and it is not offloaded) and AdamW moments, in
  pinned host memory when offloaded, with their device chunk buffers; token,
  statistics and staging buffers.
- ``cuda_core/model.cpp`` (LlamaModel constructor, ``Recompute::parse``,
  ``stack_bytes()``, ``scratch_shapes()``, ``parameter_layout()``): the kept
  (not recomputed) activations, the residual stream, the RoPE table and the
  activation stack's capacity.
- With LoRA (``TrainOptions.lora``, zero_stage 1): the model's weights
  whole and unpadded on every device ("frozen-weights"), the flat buffers
  above ("adapters" instead of "weights") sized by the adapter layout
  (``nanoq.lora.adapter_shapes``, model.cpp ``lora_layout()``), staging for
  the largest parameter of either, the model's "frozen-norm-gradients" sink
  and, on the stack, a running adapter's pushes (``adapter_bytes()``).

The backends' op scratch is not mirrored: each backend plans it itself
(``BackendPlugin::scratch_plan``, the function its ``reserve_scratch``
allocates from; ``nanoq.backends.scratch_plan``), so estimating a backend
loads its library. The cuda backend's op scratch includes CUB's radix-sort
storage, which only CUB can size, and only with a device: where it cannot
(no GPU, or the cuda backend not built, when the plan comes from the
cuda_emulated backend's copy of the same code without asking CUB), an upper
bound is counted and the line is marked inexact (``Allocation.exact``,
``MemoryEstimate.approximate``). It decides the op scratch only when it is the
largest op's need: models with few heads and narrow projections.

Bytes are those the allocator records (``Trainer.get_allocations``), which
are also what ``TrainOptions.memory_limit`` counts: the device total here is
exactly the figure the limit is checked against. Not counted by the
allocator, and so not here: the CUDA context, cuBLASLt's handle and NCCL's
buffers (``reserve_bytes`` stands in for them when judging a fit), and the
allocation granularity of cudaMalloc.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterator, List, Optional

from nanoq import _core
from nanoq.backends import CUDA_BACKENDS, device_count, scratch_plan
from nanoq.config import OFFLOAD, RECOMPUTE, ModelConfig, TrainOptions
from nanoq.lora import LoraConfig, adapter_shapes, projection_shape

CONTEXTS = ("weights", "master", "gradients", "adam-m", "adam-v", "activations", "workspace", "stack")
CONTEXT_MEANING = {
    "weights": "the weights: a full copy (stages 1-2) or a shard, embedding, head and two layers (3)",
    "master": "this device's shard of the master weights (none when they are the weights or offloaded)",
    "gradients": "float32 gradients: a full copy (stage 1) or a shard, embedding, head and one layer (2-3)",
    "adam-m": "this device's shard of the AdamW first moment (none when offloaded)",
    "adam-v": "this device's shard of the AdamW second moment (none when offloaded)",
    "activations": "kept for backward: residual stream and each layer's (not recomputed) ones",
    "workspace": "tokens, statistics, staging, RoPE table, op scratch",
    "stack": "backward's temporaries (one arena, sized for its peak)",
}
# With LoRA the trained parameters are the adapters; the weights context
# also holds the frozen model (its share is spelled out in the table).
LORA_CONTEXT_MEANING = {
    "master": "this device's shard of the adapters' master weights (none when they are the adapters or offloaded)",
    "gradients": "float32 gradients of the adapters only (the frozen weights have none)",
    "adam-m": "this device's shard of the adapters' AdamW first moment (none when offloaded)",
    "adam-v": "this device's shard of the adapters' AdamW second moment (none when offloaded)",
}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
_STAT_BYTES = _core.STAT_DTYPE().itemsize  # the loss statistics' element (float64)
# Memory a cuda device loses to what nanoq's allocator does not see: the CUDA
# context, cuBLASLt and NCCL (an assumption, adjustable; 0 on the cpu and on
# the emulator, which has none of them).
CUDA_RESERVE_BYTES = 1 << 30
# The largest device count `suggestions` tries.
MAX_SUGGESTED_DEVICES = 64

# Constants of the core, named as there.
_STAGING_ELEMENTS = 1 << 22          # trainer.cpp kStagingElements
_STACK_ALIGNMENT = 256                # allocator.h StackArena::kAlignment
# Backend::classifier_chunk_elements() (cuda_emulated runs the cuda backend's code)
_CLASSIFIER_CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26, "cuda_emulated": 1 << 26}
_OPTIMIZER_CHUNK = 1 << 22           # trainer.cpp kOptimizerChunk (offload's device buffers)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One allocation of a device: context, tensor name, bytes, and kind
    ("device", or "pinned" for page-locked host memory). ``exact`` is False
    where ``bytes`` is an upper bound (a library's size the backend could
    not ask for without a device)."""

    context: str
    name: str
    bytes: int
    kind: str = "device"
    exact: bool = True


@dataclasses.dataclass
class MemoryEstimate:
    """Per-device memory of a run. ``allocations`` is one device's list (all
    devices hold the same). ``options`` has ``backend`` and ``dtype``
    resolved; ``parameters`` counts the model's, ``trainable_parameters``
    those with gradients and AdamW state (the LoRA adapters' with LoRA, else
    the same); ``reserve_bytes`` is what ``fits`` adds for memory outside
    nanoq's allocator."""

    config: ModelConfig
    options: TrainOptions
    allocations: List[Allocation]
    parameters: int
    trainable_parameters: int
    reserve_bytes: int

    @property
    def contexts(self) -> Dict[str, int]:
        """Device bytes per context, every context present (0 when unused)."""
        totals = dict.fromkeys(CONTEXTS, 0)
        for a in self.allocations:
            if a.kind == "device":
                totals[a.context] += a.bytes
        return totals

    @property
    def approximate(self) -> List[str]:
        """Names of the allocations whose bytes are an upper bound, not exact."""
        return [a.name for a in self.allocations if not a.exact]

    @property
    def device_bytes(self) -> int:
        """Device memory the allocator takes on each device (what
        ``TrainOptions.memory_limit`` is checked against)."""
        return sum(a.bytes for a in self.allocations if a.kind == "device")

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory per device (cuda's host staging)."""
        return sum(a.bytes for a in self.allocations if a.kind == "pinned")

    @property
    def tokens_per_step(self) -> int:
        o = self.options
        return o.devices * o.batch_size * o.seq_len * o.grad_accum

    def fits(self, device_memory_bytes: int) -> bool:
        """Whether allocations plus ``reserve_bytes`` fit a device of that size."""
        return self.device_bytes + self.reserve_bytes <= device_memory_bytes

    def suggestions(self, device_memory_bytes: int) -> List[str]:
        """Changes that make the run fit, one line each, cheapest first
        (empty if it fits): a smaller micro-batch with more gradient
        accumulation (same tokens per step); recomputing activations; offloading
        AdamW moments and master weights to host memory; a higher ZeRO stage
        (sharded gradients, then weights); more devices, with a higher stage
        and a smaller micro-batch when nothing else fits. When nothing fits at
        all, one line says so.
        """
        if self.fits(device_memory_bytes):
            return []
        out = [line for line in (self._smaller_micro_batch(device_memory_bytes),
                                 self._recompute(device_memory_bytes),
                                 self._offload(device_memory_bytes),
                                 self._zero_stage(device_memory_bytes)) if line]
        if not out:
            both = self._recompute_and_offload(device_memory_bytes)
            out += [both] if both else []
        devices = self._more_devices(device_memory_bytes, shrink_batch=not out)
        if devices:
            out.append(devices)
        return out or [self._nothing_fits()]

    def table(self, device_memory_bytes: Optional[int] = None) -> str:
        """The contexts as rows with their bytes per device (GiB/MiB), the
        total, the reserve and pinned host memory; with a device size, the
        verdict."""
        o = self.options
        meanings = dict(CONTEXT_MEANING)
        if o.lora is not None:
            sizes = {a.name: a.bytes for a in self.allocations}
            meanings.update(LORA_CONTEXT_MEANING,
                            weights=f"the frozen model weights ({human_bytes(sizes['frozen-weights'])}, whole on "
                                    f"every device) and the LoRA adapters ({human_bytes(sizes['adapters'])})")
        rows = [(name, human_bytes(value), meanings[name]) for name, value in self.contexts.items()]
        rows.append(("total", human_bytes(self.device_bytes), "what nanoq allocates per device"))
        if self.reserve_bytes:
            rows.append(("reserve", human_bytes(self.reserve_bytes),
                         "assumed for the CUDA context, cuBLASLt and NCCL (not nanoq's allocator)"))
        if o.backend in CUDA_BACKENDS or self.pinned_bytes:
            rows.append(("pinned host", human_bytes(self.pinned_bytes),
                         "host memory, not on the device: token staging, offloaded state"))
        name_width = max(len(r[0]) for r in rows)
        size_width = max(len(r[1]) for r in rows)
        lines = [self.describe(), ""]
        for name, size, meaning in rows:
            if name == "total":
                lines.append("-" * (name_width + size_width + 2))
            lines.append(f"{name:<{name_width}}  {size:>{size_width}}  {meaning}")
        if device_memory_bytes is not None:
            need = self.device_bytes + self.reserve_bytes
            verdict = "fits" if self.fits(device_memory_bytes) else "does NOT fit"
            lines += ["", f"{verdict} in {human_bytes(device_memory_bytes)} ({device_memory_bytes / 1e9:.1f} GB) "
                          f"per device (needs {human_bytes(need)}, {100 * need / device_memory_bytes:.0f}%)"]
        if self.approximate:
            lines += ["", f"approximate: {', '.join(self.approximate)} counted at an upper bound (CUB sizes its "
                          f"sort storage only for a GPU it sees)"]
        return "\n".join(lines)

    def describe(self) -> str:
        """One line: model size (with LoRA: frozen, and the adapters that
        train), backend, dtypes and batch shape."""
        o = self.options
        c = self.config
        tied = ", tied" if c.tie_word_embeddings else ""
        lora = ""
        if o.lora is not None:
            dropout = f", dropout {o.lora.dropout:g}" if o.lora.dropout else ""
            lora = (f", frozen; LoRA rank {o.lora.rank} on {','.join(o.lora.targets)}{dropout}: "
                    f"{parameter_count_text(self.trainable_parameters)} trainable")
        return (f"{parameter_count_text(self.parameters)} parameters ({c.num_hidden_layers} layers, "
                f"hidden {c.hidden_size}, vocab {c.vocab_size}{tied}){lora}; {o.backend}, {o.dtype} weights, "
                f"{o.master_dtype} master, {o.optimizer_dtype} AdamW"
                + (f", recompute {','.join(o.recompute)}" if o.recompute else "")
                + (f", offload {','.join(o.offload)}" if o.offload else "")
                + (f", zero_stage {o.zero_stage}" if o.zero_stage != 1 else "")
                + f"; {_devices(o.devices)} x batch {o.batch_size} x seq {o.seq_len}, grad_accum {o.grad_accum} = "
                  f"{self.tokens_per_step:,} tokens per step")

    # -- suggestions ------------------------------------------------------------------
    def _with(self, **changes) -> "MemoryEstimate":
        return estimate_memory(self.config, dataclasses.replace(self.options, **changes),
                               reserve_bytes=self.reserve_bytes)

    def _highest_stage(self) -> int:
        """The highest ZeRO stage this run may use (LoRA trains at stage 1 only)."""
        return 1 if self.options.lora is not None else 3

    @staticmethod
    def _offloadable(stage: int) -> tuple:
        """What may be offloaded at a ZeRO stage (gradients from stage 2)."""
        return tuple(name for name in OFFLOAD if name != "gradients" or stage >= 2)

    def _smaller_micro_batch(self, limit: int) -> Optional[str]:
        o = self.options
        sequences = o.batch_size * o.grad_accum  # per device per step, kept
        for batch in range(o.batch_size - 1, 0, -1):
            if sequences % batch:
                continue
            smaller = self._with(batch_size=batch, grad_accum=sequences // batch)
            if smaller.fits(limit):
                return (f"batch_size {batch} with grad_accum {sequences // batch} (same {self.tokens_per_step:,} "
                        f"tokens per step): needs {human_bytes(smaller.device_bytes + self.reserve_bytes)}")
        return None

    def _recompute_levels(self) -> Iterator[tuple]:
        """Recompute settings that add to this one, cheapest first."""
        o = self.options
        for extra in (("swiglu",), ("ffn",), ("ffn", "norms"), ("ffn", "norms", "qkv"), ("block",)):
            names = tuple(sorted(set(o.recompute) | set(extra), key=RECOMPUTE.index))
            if _recompute_set(names) != _recompute_set(o.recompute):
                yield names

    def _offload_levels(self) -> Iterator[tuple]:
        """Offload settings that add to this one, cheapest first."""
        o = self.options
        offloadable = self._offloadable(o.zero_stage)  # each level adds the next, in OFFLOAD's order
        for extra in (offloadable[:count] for count in range(1, len(offloadable) + 1)):
            names = tuple(sorted(set(o.offload) | set(extra), key=OFFLOAD.index))
            if set(names) != set(o.offload):
                yield names

    def _recompute_and_offload(self, limit: int) -> Optional[str]:
        for offload in self._offload_levels():
            for recompute in self._recompute_levels():
                lighter = self._with(recompute=recompute, offload=offload)
                if lighter.fits(limit):
                    return (f"recompute {','.join(recompute)} and offload {','.join(offload)} "
                            f"({human_bytes(lighter.pinned_bytes)} of host memory per device): needs "
                            f"{human_bytes(lighter.device_bytes + self.reserve_bytes)}")
        return None

    def _recompute(self, limit: int) -> Optional[str]:
        for names in self._recompute_levels():
            lighter = self._with(recompute=names)
            if lighter.fits(limit):
                return (f"recompute {','.join(names)} (activations recomputed in backward; more compute, same "
                        f"results): needs {human_bytes(lighter.device_bytes + self.reserve_bytes)}")
        return None

    def _offload(self, limit: int) -> Optional[str]:
        for names in self._offload_levels():
            lighter = self._with(offload=names)
            if lighter.fits(limit):
                return (f"offload {','.join(names)} (kept in host memory, streamed through the device in "
                        f"update(); {human_bytes(lighter.pinned_bytes)} of host memory per device): needs "
                        f"{human_bytes(lighter.device_bytes + self.reserve_bytes)}")
        return None

    def _zero_stage(self, limit: int) -> Optional[str]:
        o = self.options
        if o.devices == 1:
            return None  # one device holds every shard: higher stages only add buffers
        for stage in range(o.zero_stage + 1, self._highest_stage() + 1):
            lighter = self._with(zero_stage=stage)
            if lighter.fits(limit):
                what = "gradients" if stage == 2 else "gradients and weights"
                return (f"zero_stage {stage} ({what} sharded across the {o.devices} devices): needs "
                        f"{human_bytes(lighter.device_bytes + self.reserve_bytes)}")
        return None

    def _more_devices(self, limit: int, shrink_batch: bool) -> Optional[str]:
        o = self.options
        highest = self._highest_stage()
        stages = (o.zero_stage,) + ((highest,) if shrink_batch and o.zero_stage < highest else ())
        for devices in range(o.devices + 1, MAX_SUGGESTED_DEVICES + 1):
            for stage in stages:
                smallest = o.batch_size if not shrink_batch else 1
                if not self._with(devices=devices, zero_stage=stage, batch_size=smallest, grad_accum=1).fits(limit):
                    continue
                for batch in range(o.batch_size, smallest - 1, -1):
                    more = self._with(devices=devices, zero_stage=stage, batch_size=batch, grad_accum=1)
                    if more.fits(limit):
                        break
                sequences = o.devices * o.batch_size * o.grad_accum
                accum = max(1, math.ceil(sequences / (devices * batch)))
                tokens = devices * batch * accum * o.seq_len
                keep = "same" if tokens == self.tokens_per_step else f"{tokens:,} instead of {self.tokens_per_step:,}"
                shape = f"batch_size {batch}, " if batch != o.batch_size else ""
                stage_text = f"zero_stage {stage}, " if stage != o.zero_stage else ""
                alone = f"nothing else fits {_devices(o.devices)}; " if shrink_batch else ""
                return (f"{alone}{devices} devices ({stage_text}{shape}grad_accum {accum}: {keep} tokens per step): "
                        f"needs {human_bytes(more.device_bytes + self.reserve_bytes)}")
        return None

    def _nothing_fits(self) -> str:
        stage = self._highest_stage()
        offload = self._offloadable(stage)
        best = self._with(devices=MAX_SUGGESTED_DEVICES, zero_stage=stage, batch_size=1, grad_accum=1,
                          recompute=("block",), offload=offload)
        return (f"nothing fits: even {_devices(MAX_SUGGESTED_DEVICES)} with zero_stage {stage}, batch_size 1, "
                f"recompute block and offload {','.join(offload)} need "
                f"{human_bytes(best.device_bytes + self.reserve_bytes)} per device; shorten seq_len "
                f"({self.options.seq_len}) or train a smaller model")


def _devices(count: int) -> str:
    return f"{count} device" + ("s" if count != 1 else "")


def human_bytes(count: int) -> str:
    """``1.50 GiB``, ``12.0 MiB``, ``3.0 KiB`` or ``17 B`` (binary units)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit}" if unit == "GiB" else f"{count / size:.1f} {unit}"
    return f"{count} B"


def parameter_count_text(count: int) -> str:
    """``7.62B``, ``494.0M`` or ``52,096``."""
    if count >= 10**9:
        return f"{count / 1e9:.2f}B"
    return f"{count / 1e6:.1f}M" if count >= 10**6 else f"{count:,}"


# -- the mirror of the core ---------------------------------------------------------

def parameter_numels(config: ModelConfig) -> Iterator[int]:
    """Element counts of the parameters in ``parameter_layout()`` order (model.cpp)."""
    c = config
    C, I, V, D = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    q_out, kv_out = c.num_attention_heads * D, c.num_key_value_heads * D
    yield V * C
    for _ in range(c.num_hidden_layers):
        yield C
        yield q_out * C
        if c.qkv_bias:
            yield q_out
        yield kv_out * C
        if c.qkv_bias:
            yield kv_out
        yield kv_out * C
        if c.qkv_bias:
            yield kv_out
        yield C * q_out
        if c.o_bias:
            yield C
        if c.qk_norm:
            yield D
            yield D
        yield C
        yield I * C
        yield I * C
        yield C * I
    yield C
    if not c.tie_word_embeddings:
        yield V * C


def _resolve(options: TrainOptions, backend: Optional[str]) -> TrainOptions:
    """Options with the backend and dtype the Trainer would use. An explicit
    "cuda" needs no GPU here."""
    name = backend or options.backend
    if name == "auto":
        from nanoq.backends import resolve_backend

        name = resolve_backend("auto")
    if name not in ("cpu",) + CUDA_BACKENDS:
        raise ValueError(f"backend must be cpu, {', '.join(CUDA_BACKENDS)} or auto, got {name!r}")
    dtype = options.dtype if options.dtype != "auto" else ("bf16" if name in CUDA_BACKENDS else "fp32")
    if name == "cpu" and "bf16" in (dtype, options.master_dtype, options.optimizer_dtype):
        raise ValueError("the cpu backend computes in fp32 only: use dtype, master_dtype and optimizer_dtype "
                         "\"fp32\" (or \"auto\")")
    return dataclasses.replace(options, backend=name, dtype=dtype)


def _cpu_threads(options: TrainOptions) -> int:
    """Threads per device as trainer.cpp picks them (hardware_concurrency / devices)."""
    if options.threads > 0:
        return options.threads
    from nanoq.backends import device_count  # the core's std::thread::hardware_concurrency()

    return max(1, device_count("cpu") // options.devices)


def estimate_memory(config: ModelConfig, options: TrainOptions, *, backend: Optional[str] = None,
                    reserve_bytes: Optional[int] = None) -> MemoryEstimate:
    """Per-device memory of ``Trainer(config, options)``, without allocating.

    backend: overrides ``options.backend`` ("cpu", "cuda", "cuda_emulated";
    "auto" as the Trainer resolves it). A cuda estimate needs no GPU (see
    the module's note on CUB). ``dtype`` "auto" is bf16 on cuda and
    cuda_emulated, fp32 on cpu. reserve_bytes: memory outside nanoq's
    allocator that ``fits`` adds (default CUDA_RESERVE_BYTES on cuda, 0
    otherwise). The cpu backend's attention scratch depends on the threads
    per device: ``options.threads``, or 0 for this machine's cores shared out.
    Raises ValueError for dtypes the backend lacks (cpu: fp32 only) and, on
    cuda, head_dim > 256; nanoq.NanoqError when the scratch cannot be planned
    (a cuda estimate on an install with neither cuda nor cuda_emulated built).
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a nanoq.ModelConfig, got {type(config).__name__}")
    if not isinstance(options, TrainOptions):
        raise TypeError(f"options must be a nanoq.TrainOptions, got {type(options).__name__}")
    options = _resolve(options, backend)
    numels = list(parameter_numels(config))
    trainable = _trainable_numels(config, options.lora) if options.lora is not None else numels
    allocations = _trainer_allocations(config, options, numels, trainable)
    if reserve_bytes is None:
        reserve_bytes = CUDA_RESERVE_BYTES if options.backend == "cuda" else 0
    return MemoryEstimate(config=config, options=options, allocations=allocations, parameters=sum(numels),
                          trainable_parameters=sum(trainable), reserve_bytes=reserve_bytes)


def _trainable_numels(config: ModelConfig, lora: LoraConfig) -> List[int]:
    """Element counts of the adapters in ``lora_layout()`` order (model.cpp)."""
    return [rows * cols for rows, cols in adapter_shapes(config, lora).values()]


def _trainer_allocations(c: ModelConfig, o: TrainOptions, numels: List[int], trainable: List[int]) -> List[Allocation]:
    """trainer.cpp, Trainer::Trainer, in allocation order. numels: the
    model's parameters; trainable: those in the flat buffers (the same list
    without LoRA, the adapters' with it)."""
    n = o.devices
    shard = -(-sum(trainable) // n)
    padded = shard * n
    weight_size = DTYPE_BYTES[o.dtype]
    # zero.cpp BlockLayout: the embedding, equal layers, the head.
    embed = numels[0]
    head = c.hidden_size + (0 if c.tie_word_embeddings else numels[-1])
    layer = (sum(numels) - embed - head) // c.num_hidden_layers
    out = []
    if o.lora is not None:  # whole on every device, unpadded
        out.append(Allocation("weights", "frozen-weights", sum(numels) * weight_size))
    if o.zero_stage < 3:
        out.append(Allocation("weights", "weights" if o.lora is None else "adapters", padded * weight_size))
    else:
        out += [Allocation("weights", "weight-shard", shard * weight_size),
                Allocation("weights", "embed-weights", embed * weight_size),
                Allocation("weights", "head-weights", head * weight_size),
                Allocation("weights", "layer-weights.0", layer * weight_size),
                Allocation("weights", "layer-weights.1", layer * weight_size)]
    if o.zero_stage == 1:
        out.append(Allocation("gradients", "gradients", padded * 4))
    else:
        grad_kind = "pinned" if "gradients" in o.offload else "device"
        out += [Allocation("gradients", "gradient-shard", shard * 4, grad_kind),
                Allocation("gradients", "embed-gradients", embed * 4),
                Allocation("gradients", "head-gradients", head * 4),
                Allocation("gradients", "layer-gradients", layer * 4),
                Allocation("workspace", "reduce-scratch", max(layer, embed, head) * 4)]
    master_kind = "pinned" if "master" in o.offload else "device"
    optimizer_kind = "pinned" if "optimizer" in o.offload else "device"
    if o.master_dtype != o.dtype or "master" in o.offload:  # else the master shard is a view of the weights
        out.append(Allocation("master", "master", shard * DTYPE_BYTES[o.master_dtype], master_kind))
    optimizer_size = DTYPE_BYTES[o.optimizer_dtype]
    out += [Allocation("adam-m", "adam-m", shard * optimizer_size, optimizer_kind),
            Allocation("adam-v", "adam-v", shard * optimizer_size, optimizer_kind)]
    chunk = min(shard, _OPTIMIZER_CHUNK)  # offloaded state streams through these device buffers
    if "master" in o.offload:
        out.append(Allocation("workspace", "offload-master", chunk * DTYPE_BYTES[o.master_dtype]))
    if "optimizer" in o.offload:
        out += [Allocation("workspace", "offload-adam-m", chunk * optimizer_size),
                Allocation("workspace", "offload-adam-v", chunk * optimizer_size)]
    if "gradients" in o.offload:
        out.append(Allocation("workspace", "offload-gradients", chunk * 4))
    rows = o.batch_size * o.seq_len
    stats = len(_core.stat_slots()) * _STAT_BYTES
    out += [Allocation("workspace", "tokens", rows * 4),
            Allocation("workspace", "targets", rows * 4),
            Allocation("workspace", "loss-stats", stats),
            Allocation("workspace", "eval-stats", stats),
            Allocation("workspace", "gathered-stats", n * _core.gather_stride() * _STAT_BYTES),
            Allocation("workspace", "optimizer-scale", 3 * 4),
            Allocation("workspace", "parameter-staging", min(max(numels + trainable), _STAGING_ELEMENTS) * 4)]
    recompute = _recompute_set(o.recompute)
    specs = _activation_specs(c, o.batch_size, o.seq_len, weight_size, recompute)
    out += _model_allocations(c, o.batch_size, o.seq_len, weight_size, specs, o.lora)
    stack = _stack_bytes(c, rows, weight_size, specs, _classifier_chunk_rows(c, rows, o.backend),
                         _adapter_stack_bytes(c, rows, weight_size, o.lora))
    out.append(Allocation("stack", "activation-stack", stack // 4 * 4))
    out += _backend_scratch(c, o, shard)
    return out


def _recompute_set(names) -> set:
    """model.cpp, Recompute::parse: the names with their implications."""
    r = set(names)
    if "block" in r:
        r |= {"ffn", "norms", "qkv"}
    if "ffn" in r:
        r.add("swiglu")
    return r


def _activation_specs(c: ModelConfig, batch: int, time: int, size: int, recompute: set) -> List[tuple]:
    """model.cpp, the LlamaModel constructor's specs: (name, bytes, recomputed)
    of one layer's activations, in order."""
    rows, C, I = batch * time, c.hidden_size, c.intermediate_size
    H, K, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    HD, KD = H * D, K * D
    block, qkv, norms = "block" in recompute, "qkv" in recompute, "norms" in recompute
    specs = [("input-norm", rows * C * size, norms), ("input-rstd", rows * 4, block)]
    if c.qk_norm:
        specs += [("q-raw", rows * HD * size, qkv), ("k-raw", rows * KD * size, qkv),
                  ("q-rstd", rows * H * 4, qkv), ("k-rstd", rows * K * 4, qkv)]
    specs += [("q", rows * HD * size, qkv), ("k", rows * KD * size, qkv), ("v", rows * KD * size, qkv),
              ("attention", rows * HD * size, block), ("attention-lse", batch * H * time * 4, block),
              ("residual-mid", rows * C * size, block), ("post-norm", rows * C * size, norms),
              ("post-rstd", rows * 4, block), ("gate", rows * I * size, "ffn" in recompute),
              ("up", rows * I * size, "ffn" in recompute), ("swiglu", rows * I * size, "swiglu" in recompute)]
    return specs


def _model_allocations(c: ModelConfig, batch: int, time: int, size: int, specs: List[tuple],
                       lora: Optional[LoraConfig]) -> List[Allocation]:
    """model.cpp, LlamaModel::LlamaModel: RoPE table, residual stream, the
    layers' kept (not recomputed) activations, the final norm; with LoRA the
    sink for the frozen norms' weight gradients."""
    rows, C = batch * time, c.hidden_size
    out = [Allocation("workspace", "rope-cos-sin", time * (c.head_dim // 2) * 2 * 4)]
    out += [Allocation("activations", f"residual.{l}", rows * C * size) for l in range(c.num_hidden_layers + 1)]
    for l in range(c.num_hidden_layers):
        out += [Allocation("activations", f"layer.{l}.{name}", nbytes)
                for name, nbytes, recomputed in specs if not recomputed]
    out += [Allocation("activations", "final-norm", rows * C * size),
            Allocation("activations", "final-rstd", rows * 4)]
    if lora is not None:
        out.append(Allocation("workspace", "frozen-norm-gradients", max(C, c.head_dim) * 4))
    return out


def _classifier_chunk_rows(c: ModelConfig, rows: int, backend: str) -> int:
    """model.cpp, LlamaModel::classifier_chunk_rows."""
    return min(max(1, _CLASSIFIER_CHUNK_ELEMENTS[backend] // c.vocab_size), rows)


def _stack_aligned(nbytes: int) -> int:
    return -(-nbytes // _STACK_ALIGNMENT) * _STACK_ALIGNMENT


def _stack_bytes(c: ModelConfig, rows: int, size: int, specs: List[tuple], chunk_rows: int, adapter: int) -> int:
    """model.cpp, LlamaModel::stack_bytes: the peak of the pushes of forward
    (a layer's recomputed activations) and backward (those plus the
    gradients of the MLP or attention, or the classifier's), each with a
    running adapter's ``adapter`` bytes on top."""
    C, I = c.hidden_size, c.intermediate_size
    HD, KD = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim

    def pushed(elements: int) -> int:
        return _stack_aligned(size * elements)

    transient = sum(_stack_aligned(nbytes) for _, nbytes, recomputed in specs if recomputed)
    classifier = pushed(rows * C) + pushed(chunk_rows * c.vocab_size)
    mlp = 2 * pushed(rows * I) + pushed(rows * C)
    attention = 2 * pushed(rows * HD) + 2 * pushed(rows * KD) + pushed(rows * C)
    backward = pushed(rows * C) + max(classifier, transient + max(mlp, attention) + adapter)
    return max(transient + adapter, backward)


def _adapter_stack_bytes(c: ModelConfig, rows: int, size: int, lora: Optional[LoraConfig]) -> int:
    """model.cpp, LlamaModel::adapter_bytes: what an adapter pushes while it
    runs, its [rows, rank] hidden and, with dropout, its dropped-out input
    (sized for the widest targeted input); 0 without LoRA."""
    if lora is None:
        return 0
    widest_input = max(projection_shape(c, target)[1] for target in lora.targets)
    dropped = _stack_aligned(size * rows * widest_input) if lora.dropout > 0 else 0
    return dropped + _stack_aligned(size * rows * lora.rank)


def _backend_scratch(c: ModelConfig, o: TrainOptions, shard: int) -> List[Allocation]:
    """The backend's reserve_scratch, as the backend plans it for the
    model's ScratchShapes (model.cpp scratch_shapes(), max_reduce the
    gradient shard). A cuda estimate without the cuda backend's library
    takes the plan of the same code built as cuda_emulated, without asking
    CUB (which could not answer for a real GPU there)."""
    rows = o.batch_size * o.seq_len
    shapes = dict(batch=o.batch_size, time=o.seq_len, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                  head_dim=c.head_dim, hidden=c.hidden_size, intermediate=c.intermediate_size, vocab=c.vocab_size,
                  classifier_rows=_classifier_chunk_rows(c, rows, o.backend), max_reduce=shard)
    threads = _cpu_threads(o) if o.backend == "cpu" else 1
    name, ask_libraries = o.backend, True
    if name == "cuda" and not _loadable("cuda"):
        if not _core.backend_built("cuda_emulated"):
            raise _core.NanoqError("cannot estimate the cuda backend's scratch: this install has neither the cuda "
                                   "nor the cuda_emulated backend, whose code plans it")
        name, ask_libraries = "cuda_emulated", False
    return [Allocation("workspace", b["name"], b["bytes"], b["kind"], b["exact"])
            for b in scratch_plan(name, threads=threads, ask_libraries=ask_libraries, **shapes)]


def _loadable(backend: str) -> bool:
    """Whether the backend is built and its library loads here."""
    if not _core.backend_built(backend):
        return False
    try:
        device_count(backend)
    except _core.NanoqError:
        return False
    return True


def visible_gpu_memory() -> Optional[int]:
    """Bytes of the smallest GPU that NVML (nvidia-ml-py) sees, or None
    without nvidia-ml-py, a driver or a GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        sizes = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
                 for i in range(pynvml.nvmlDeviceGetCount())]
        return min(sizes) if sizes else None
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()
