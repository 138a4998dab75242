"""How much memory a training run takes per device, computed without allocating.

``estimate_memory(config, options)`` lists, allocation by allocation, what
``Trainer(config, options)`` allocates on each device, in the order it
allocates. The list is the core's own plan (``nanoq::plan_memory``, bound as
``nanoq._core.plan_memory``): the Trainer's allocation sequence run against
the named allocator in its planning mode, which records every allocation and
the activation stack's capacity without a device and without creating a
backend. Nothing here computes a size; this module presents the plan (the
contexts' meanings, the table), judges the fit (``reserve_bytes``) and
searches for settings that fit.

The backends' op scratch is part of that plan: each backend plans it itself
(``BackendPlugin::scratch_plan``, the function its ``reserve_scratch``
allocates from), so estimating a backend loads its library. The cuda
backend's op scratch includes CUB's radix-sort storage, which only CUB can
size, and only with a device: where it cannot (no GPU, or the cuda backend
not built, when the plan comes from the cuda_emulated backend's copy of the
same code without asking CUB), an upper bound is counted and the line is
marked inexact (``Allocation.exact``, ``MemoryEstimate.approximate``). It
decides the op scratch only when it is the largest op's need: models with
few heads and narrow projections. The same holds for cuDNN's fused-attention
workspace (``cudnn-attention-workspace``, when ``attention`` takes cuDNN):
cuDNN sizes it from the plans it builds, which needs a GPU; without one the
line is an upper bound, marked inexact. A cuda plan made by the
cuda_emulated copy of the code cannot know whether "auto" would take cuDNN
on the GPU (the emulator's stand-in never takes "auto"), so it plans native
attention there; ``attention="cudnn"`` plans the workspace's bound.

Generation (``Trainer.generate``, ``Trainer.logits``, samples during training)
adds the KV cache, context "kv-cache": the core plans it too, as its first
call allocates it (``MemoryEstimate.generation``, for one sequence of up to
``seq_len`` positions). It counts in the total and the fit of a run that
generates (``generates``: train.sample_every > 0 for ``nanoq memory``);
otherwise it is listed below the total, apart.

Bytes are those the allocator records (``Trainer.get_allocations``), which
are also what ``TrainOptions.memory_limit`` counts: the device total here is
exactly the figure the limit is checked against. Not counted by the
allocator, and so not here: the CUDA context, cuBLASLt's handle and NCCL's
buffers (``reserve_bytes`` stands in for them when judging a fit), and the
allocation granularity of cudaMalloc.

Under a launcher the devices are a world of processes x devices
(``processes``, see nanoq.distributed): the plan is that of every device of
the world, each process's devices planned as its Trainer places them
(global ranks p * devices ...), so the shards are those of the whole world.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterator, List, Optional

from nanoq import _core
from nanoq import distributed
from nanoq import options as option_schema
from nanoq.backends import CUDA_BACKENDS, device_count
from nanoq.trainer_config import OFFLOAD, RECOMPUTE, ModelConfig, TrainOptions, auto_dtype
from nanoq.lora import adapter_shapes

CONTEXTS = ("weights", "master", "gradients", "adam-m", "adam-v", "activations", "workspace", "stack", "kv-cache")
CONTEXT_MEANING = {
    "weights": "the weights: a full copy (stages 1-2) or a shard, embedding, head and two layers (3)",
    "master": "this device's shard of the master weights (none when they are the weights or offloaded)",
    "gradients": "float32 gradients: a full copy (stage 1) or a shard, embedding, head and two layers (2-3)",
    "adam-m": "this device's shard of the AdamW first moment (none when offloaded)",
    "adam-v": "this device's shard of the AdamW second moment (none when offloaded)",
    "activations": "kept for backward: residual stream and each layer's (not recomputed) ones",
    "workspace": "tokens, statistics, staging, RoPE table, op scratch",
    "stack": "backward's temporaries (one arena, sized for its peak)",
    "kv-cache": "generation's (samples during training): one sequence of up to seq_len positions",
}
# With LoRA the trained parameters are the adapters; the weights context
# also holds the frozen model (its share is spelled out in the table).
LORA_CONTEXT_MEANING = {
    "master": "this device's shard of the adapters' master weights (none when they are the adapters or offloaded)",
    "gradients": "float32 gradients of the adapters only (the frozen weights have none)",
    "adam-m": "this device's shard of the adapters' AdamW first moment (none when offloaded)",
    "adam-v": "this device's shard of the adapters' AdamW second moment (none when offloaded)",
}
# Memory a cuda device loses to what nanoq's allocator does not see: the CUDA
# context, cuBLASLt and NCCL (an assumption, adjustable; 0 on the cpu and on
# the emulator, which has none of them).
CUDA_RESERVE_BYTES = 1 << 30
# The largest device count `suggestions` tries (of the whole world, under a launcher).
MAX_SUGGESTED_DEVICES = 64
# Names the world of a plan of several processes: the rules ask one of a
# world larger than a trainer's devices, but a plan opens no communicator.
_PLANNED_COMM_ID = b"memory-plan"


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
    """Per-device memory of a run, as the core plans it. ``per_device``
    holds every device's allocations in allocation order (today all devices
    hold the same list), for all ``processes`` x ``options.devices``
    devices of the world in global rank order, and ``stack_capacities``
    their activation stacks' bytes; ``allocations`` is the list of the
    device that needs the most device memory (the first such), which the
    totals, the table and the fit judge. ``options`` has ``backend`` and ``dtype`` resolved;
    ``parameters`` counts the model's, ``trainable_parameters`` those with
    gradients and AdamW state (the LoRA adapters' with LoRA, else the same);
    ``reserve_bytes`` is what ``fits`` adds for memory outside nanoq's
    allocator. ``generation`` is what that device's first generation
    (Trainer.generate or logits) adds: the KV cache of one sequence of up
    to ``seq_len`` positions, context "kv-cache"; counted in ``contexts``,
    ``device_bytes`` and ``fits`` when ``generates`` (the run generates:
    samples during training), else in none of them. ``classifier_rows``:
    the rows of that device's classifier logits chunk (``batch_size`` x
    ``seq_len`` is one chunk); on cuda it grows into the device's memory,
    ``device_memory`` when the estimate was given one."""

    config: ModelConfig
    options: TrainOptions
    allocations: List[Allocation]
    parameters: int
    trainable_parameters: int
    reserve_bytes: int
    per_device: List[List[Allocation]] = dataclasses.field(default_factory=list)
    stack_capacities: List[int] = dataclasses.field(default_factory=list)
    processes: int = 1
    generation: List[Allocation] = dataclasses.field(default_factory=list)
    generates: bool = False
    classifier_rows: int = 0
    device_memory: Optional[int] = None

    @property
    def world_devices(self) -> int:
        """Devices of the whole run: processes x devices per process."""
        return self.processes * self.options.devices

    @property
    def contexts(self) -> Dict[str, int]:
        """Device bytes per context, every context present (0 when unused)."""
        totals = dict.fromkeys(CONTEXTS, 0)
        for a in self.allocations + (self.generation if self.generates else []):
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
        ``TrainOptions.memory_limit`` is checked against), with the KV
        cache when the run ``generates``."""
        return sum(a.bytes for a in self.allocations if a.kind == "device") + \
            (self.kv_cache_bytes if self.generates else 0)

    @property
    def kv_cache_bytes(self) -> int:
        """Device bytes of generation's KV cache on that device (what
        get_allocations reports for the "kv-cache" context after a
        generate or logits call)."""
        return sum(a.bytes for a in self.generation if a.kind == "device")

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory per device (cuda's host staging)."""
        return sum(a.bytes for a in self.allocations if a.kind == "pinned")

    @property
    def tokens_per_step(self) -> int:
        o = self.options
        return self.world_devices * o.batch_size * o.seq_len * o.grad_accum

    @property
    def needed_bytes(self) -> int:
        """What must fit each device's memory: ``device_bytes`` and
        ``reserve_bytes``, and on the cpu backend the pinned bytes too (its
        devices' memory is the host's, which offloaded state also takes)."""
        return self.device_bytes + self.reserve_bytes + (self.pinned_bytes if self.options.backend == "cpu" else 0)

    def fits(self, device_memory_bytes: int) -> bool:
        """Whether ``needed_bytes`` fit a device of that size."""
        return self.needed_bytes <= device_memory_bytes

    def suggestions(self, device_memory_bytes: int, shared_host: bool = False) -> List[str]:
        """Changes that make the run fit, one line each, cheapest first
        (empty if it fits): a smaller micro-batch with more gradient
        accumulation (same tokens per step); recomputing activations; offloading
        AdamW moments and master weights to host memory; a higher ZeRO stage
        (sharded gradients, then weights); more devices. Where no one change
        fits: the changes that fit together on this run's devices, else on
        the fewest more devices (a smaller micro-batch, a higher stage,
        recompute, offload). When nothing fits at all, one line says so.
        ``shared_host``: the devices share the memory whose share each has
        (the cpu backend's threads in host memory), so neither offloading
        (to that same memory) nor more devices (smaller shares) is suggested.
        """
        if self.fits(device_memory_bytes):
            return []
        offload = not shared_host
        out = [line for line in (self._smaller_micro_batch(device_memory_bytes),
                                 self._recompute(device_memory_bytes),
                                 self._offload(device_memory_bytes) if offload else None,
                                 self._zero_stage(device_memory_bytes)) if line]
        if not out:
            combined = self._combined(device_memory_bytes, offload)
            out += [combined] if combined else []
        devices = (self._fewer_devices(device_memory_bytes) if not out else None) if shared_host else \
            self._more_devices(device_memory_bytes, shrink_batch=not out)
        if devices:
            out.append(devices)
        return out or [self._nothing_fits(offload, more_devices=not shared_host)]

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
        rows = [(name, human_bytes(value), meanings[name]) for name, value in self.contexts.items()
                if name != "kv-cache" or self.generates]
        rows.append(("total", human_bytes(self.device_bytes), "what nanoq allocates per device"))
        if not self.generates:
            rows.append(("kv-cache", human_bytes(self.kv_cache_bytes),
                         f"generation (Trainer.generate and logits): one sequence of up to {o.seq_len} "
                         f"positions, allocated by the first call; not in the total"))
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
            need = self.needed_bytes
            verdict = "fits" if self.fits(device_memory_bytes) else "does NOT fit"
            lines += ["", f"{verdict} in {human_bytes(device_memory_bytes)} ({device_memory_bytes / 1e9:.1f} GB) "
                          f"per device (needs {human_bytes(need)}, {100 * need / device_memory_bytes:.0f}%)"]
        lines += ["", self._classifier_line()]
        if self.approximate:
            lines += ["", f"approximate: {', '.join(self.approximate)} counted at an upper bound (CUB and "
                          f"cuDNN size their storage only for a GPU they see)"]
        return "\n".join(lines)

    def _classifier_line(self) -> str:
        """How the classifier's logits are chunked, and why."""
        rows = self.options.batch_size * self.options.seq_len
        if self.classifier_rows >= rows:
            return f"classifier: the logits of all {rows:,} rows in one chunk"
        line = f"classifier: logits in chunks of {self.classifier_rows:,} of the {rows:,} rows"
        if self.options.backend in CUDA_BACKENDS and not self.options.memory_limit:
            if self.device_memory is None:
                line += (" (the least chunk: on a GPU it grows into the memory left, up to one chunk; give "
                         "device_memory, nanoq memory --device-memory, to plan a device of that size)")
            else:
                line += (f" (as many as fit in 7/8 of a {human_bytes(self.device_memory)} device, the rest left to "
                         f"what the allocator does not see)")
        return line

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
                + ("inference (no gradients, master weights or AdamW)" if o.inference
                   else f"{o.master_dtype} master, {o.optimizer_dtype} AdamW")
                + (f", recompute {','.join(o.recompute)}" if o.recompute else "")
                + (f", offload {','.join(o.offload)}" if o.offload else "")
                + (f", zero_stage {o.zero_stage}" if o.zero_stage != 1 else "")
                + f"; {self._placement()} x batch {o.batch_size} x seq {o.seq_len}, grad_accum {o.grad_accum} = "
                  f"{self.tokens_per_step:,} tokens per step")

    def _placement(self, devices: Optional[int] = None) -> str:
        """``4 devices``, or under a launcher ``2 processes x 2 devices``."""
        devices = self.options.devices if devices is None else devices
        return _devices(devices) if self.processes == 1 else f"{self.processes} processes x {_devices(devices)}"

    # -- suggestions ------------------------------------------------------------------
    def _with(self, **changes) -> "MemoryEstimate":
        return estimate_memory(self.config, dataclasses.replace(self.options, **changes),
                               reserve_bytes=self.reserve_bytes, processes=self.processes, generates=self.generates,
                               device_memory=self.device_memory)

    def _highest_stage(self) -> int:
        """The highest ZeRO stage this run may use (LoRA trains at stage 1
        only, and an inference trainer holds whole weights only)."""
        return 1 if self.options.lora is not None or self.options.inference else 3

    @staticmethod
    def _offloadable(stage: int) -> tuple:
        """What may be offloaded at a ZeRO stage (gradients from stage 2)."""
        return tuple(name for name in OFFLOAD if name != "gradients" or stage >= 2)

    def fitting_micro_batch(self, device_memory_bytes: int) -> Optional["MemoryEstimate"]:
        """This run with the largest micro-batch that fits a device of that
        size, the same sequences per step kept (``batch_size`` a divisor of
        ``batch_size`` x ``grad_accum``, ``grad_accum`` the quotient; nothing
        else changed): this estimate itself when it fits, None when not
        even one sequence per micro-batch does."""
        if self.fits(device_memory_bytes):
            return self
        o = self.options
        sequences = o.batch_size * o.grad_accum  # per device per step, kept
        for batch in range(o.batch_size - 1, 0, -1):
            if sequences % batch:
                continue
            smaller = self._with(batch_size=batch, grad_accum=sequences // batch)
            if smaller.fits(device_memory_bytes):
                return smaller
        return None

    def _smaller_micro_batch(self, limit: int) -> Optional[str]:
        smaller = self.fitting_micro_batch(limit)
        if smaller is None or smaller is self:
            return None
        o = smaller.options
        return (f"batch_size {o.batch_size} with grad_accum {o.grad_accum} (same {self.tokens_per_step:,} "
                f"tokens per step): needs {human_bytes(smaller.needed_bytes)}")

    def _recompute_levels(self) -> Iterator[tuple]:
        """Recompute settings that add names to this one, cheapest first. One
        that the core's implications make equivalent to this one (swiglu
        when ffn is on) plans the same memory, so it never fits where this
        one does not and is never suggested."""
        o = self.options
        for extra in (("swiglu",), ("ffn",), ("ffn", "norms"), ("ffn", "norms", "qkv"), ("block",)):
            names = tuple(sorted(set(o.recompute) | set(extra), key=RECOMPUTE.index))
            if set(names) != set(o.recompute):
                yield names

    def _offload_levels(self, stage: Optional[int] = None) -> Iterator[tuple]:
        """Offload settings that add to this one, cheapest first (at ZeRO
        ``stage``; default this run's)."""
        o = self.options
        if o.inference:
            return  # nothing to offload: an inference trainer has no optimizer state
        # Each level adds the next, in OFFLOAD's order.
        offloadable = self._offloadable(o.zero_stage if stage is None else stage)
        for extra in (offloadable[:count] for count in range(1, len(offloadable) + 1)):
            names = tuple(sorted(set(o.offload) | set(extra), key=OFFLOAD.index))
            if set(names) != set(o.offload):
                yield names

    def _combinations(self, offload: bool) -> List[tuple]:
        """(stage, offload, recompute) of this run and those that add to it,
        in the order the searches prefer them: the lowest stage, then the
        least offload, then the least recompute. On one device too: stage 2
        lets the gradients be offloaded."""
        o = self.options
        recomputes = [o.recompute] + list(self._recompute_levels())
        return [(stage, names, recompute) for stage in range(o.zero_stage, self._highest_stage() + 1)
                for names in [o.offload] + (list(self._offload_levels(stage)) if offload else [])
                for recompute in recomputes]

    def _first_fitting(self, limit: int, devices: int, batch: int, accum: int,
                       combinations: List[tuple]) -> Optional["MemoryEstimate"]:
        for stage, names, recompute in combinations:
            candidate = self._with(devices=devices, zero_stage=stage, batch_size=batch, grad_accum=accum,
                                   recompute=recompute, offload=names)
            if candidate.fits(limit):
                return candidate
        return None

    def _lightest(self, limit: int, devices: int, batches: List[tuple], offload: bool = True,
                  combinations: Optional[List[tuple]] = None) -> Optional["MemoryEstimate"]:
        """This run on ``devices`` devices per process that fits ``limit``
        in the first of ``batches`` ((batch_size, grad_accum), largest
        first) with its ZeRO stage, offload and recompute changed together
        (the first of ``_combinations`` that fits), or None. Memory never
        grows as the micro-batch shrinks, so the micro-batch is bisected;
        the combinations are all tried (neither a higher stage, more offload
        nor more recompute always needs less: their buffers, on small
        models), first at the smallest micro-batch, keeping those that fit
        there."""
        combinations = self._combinations(offload) if combinations is None else combinations
        smallest, least_accum = batches[-1]
        found = None
        kept = []
        for combination in combinations:
            candidate = self._first_fitting(limit, devices, smallest, least_accum, [combination])
            if candidate is not None:
                kept.append(combination)
                found = found or candidate
        if found is None:
            return None
        low, high = 0, len(batches) - 1  # batches[high] fits (found); find the first index that does
        while low < high:
            middle = (low + high) // 2
            candidate = self._first_fitting(limit, devices, *batches[middle], kept)
            if candidate is not None:
                high, found = middle, candidate
            else:
                low = middle + 1
        return found  # the combination at batches[high], the largest micro-batch that fits

    def _changes(self, other: "MemoryEstimate") -> List[str]:
        """What ``other`` changes of this run's ZeRO stage, recompute and
        offload, as the suggestions say it."""
        o, n = self.options, other.options
        parts = [f"zero_stage {n.zero_stage}"] if n.zero_stage != o.zero_stage else []
        if set(n.recompute) != set(o.recompute):
            parts.append(f"recompute {','.join(n.recompute)}")
        if set(n.offload) != set(o.offload):
            parts.append(f"offload {','.join(n.offload)} ({human_bytes(other.pinned_bytes)} of host memory per "
                         f"device)")
        return parts

    def _combined(self, limit: int, offload: bool = True) -> Optional[str]:
        """On this run's devices and with its tokens per step: a smaller
        micro-batch, a higher ZeRO stage, recompute and offload together."""
        o = self.options
        sequences = o.batch_size * o.grad_accum
        batches = [(batch, sequences // batch) for batch in range(o.batch_size, 0, -1) if sequences % batch == 0]
        lighter = self._lightest(limit, o.devices, batches, offload)
        if lighter is None:
            return None
        n = lighter.options
        shape = [f"batch_size {n.batch_size} with grad_accum {n.grad_accum}"] if n.batch_size != o.batch_size else []
        return (f"{', '.join(shape + self._changes(lighter))} (same {self.tokens_per_step:,} tokens per step): needs "
                f"{human_bytes(lighter.needed_bytes)}")

    def _recompute(self, limit: int) -> Optional[str]:
        for names in self._recompute_levels():
            lighter = self._with(recompute=names)
            if lighter.fits(limit):
                return (f"recompute {','.join(names)} (activations recomputed in backward; more compute, same "
                        f"results): needs {human_bytes(lighter.needed_bytes)}")
        return None

    def _offload(self, limit: int) -> Optional[str]:
        for names in self._offload_levels():
            lighter = self._with(offload=names)
            if lighter.fits(limit):
                return (f"offload {','.join(names)} (kept in host memory, streamed through the device in "
                        f"update(); {human_bytes(lighter.pinned_bytes)} of host memory per device): needs "
                        f"{human_bytes(lighter.needed_bytes)}")
        return None

    def _zero_stage(self, limit: int) -> Optional[str]:
        o = self.options
        if self.world_devices == 1:
            return None  # one device holds every shard: higher stages only add buffers
        for stage in range(o.zero_stage + 1, self._highest_stage() + 1):
            lighter = self._with(zero_stage=stage)
            if lighter.fits(limit):
                what = "gradients" if stage == 2 else "gradients and weights"
                return (f"zero_stage {stage} ({what} sharded across the {self.world_devices} devices): needs "
                        f"{human_bytes(lighter.needed_bytes)}")
        return None

    def _more_devices(self, limit: int, shrink_batch: bool) -> Optional[str]:
        """The fewest devices per process that fit, the tokens per step kept
        as near as whole micro-batches allow: with this run's settings, or
        (``shrink_batch``: nothing fits on its devices) with a smaller
        micro-batch, a higher ZeRO stage, recompute and offload as needed."""
        o = self.options
        sequences = self.world_devices * o.batch_size * o.grad_accum

        def accumulation(devices: int, batch: int) -> int:
            return max(1, math.ceil(sequences / (self.processes * devices * batch)))

        most = MAX_SUGGESTED_DEVICES // self.processes  # per process

        def lightest(devices: int) -> Optional["MemoryEstimate"]:
            batches = [(batch, accumulation(devices, batch)) for batch in range(o.batch_size, 0, -1)]
            return self._lightest(limit, devices, batches)

        more = None
        if shrink_batch:
            # Each device count costs a search: bisect, as more devices never need more per device.
            low, high = o.devices + 1, most
            more = lightest(high) if high >= low else None
            while more is not None and low < high:
                middle = (low + high) // 2
                fewer = lightest(middle)
                if fewer is not None:
                    high, more = middle, fewer
                else:
                    low = middle + 1
        else:
            for devices in range(o.devices + 1, most + 1):
                candidate = self._with(devices=devices, grad_accum=accumulation(devices, o.batch_size))
                if candidate.fits(limit):
                    more = candidate
                    break
        if more is None:
            return None
        return self._devices_line(more, alone=shrink_batch)

    def _devices_line(self, other: "MemoryEstimate", alone: bool, share: Optional[int] = None) -> str:
        """The suggestion of ``other``, this run on another number of
        devices: what it changes, its tokens per step and what it needs (of
        each device's ``share`` of one memory, when given)."""
        o, n = self.options, other.options
        tokens = other.tokens_per_step
        keep = "same" if tokens == self.tokens_per_step else f"{tokens:,} instead of {self.tokens_per_step:,}"
        shape = [f"batch_size {n.batch_size}"] if n.batch_size != o.batch_size else []
        inner = ", ".join(self._changes(other) + shape + [f"grad_accum {n.grad_accum}: {keep} tokens per step"])
        needs = human_bytes(other.needed_bytes)
        return ((f"nothing else fits {self._placement()}; " if alone else "")
                + f"{self._placement(n.devices)} ({inner}): needs {needs}"
                + (f" per device (each device's share: {human_bytes(share)})" if share is not None else ""))

    def _fewer_devices(self, share: int) -> Optional[str]:
        """Devices that share one memory (each has ``share`` of it): the
        most devices below this run's whose larger shares fit it, with a
        smaller micro-batch, a higher stage or recompute as needed (no
        offload: it would go to that same memory), the tokens per step kept
        as near as whole micro-batches allow."""
        o = self.options
        total = share * o.devices
        sequences = o.devices * o.batch_size * o.grad_accum  # per process
        for devices in range(o.devices - 1, 0, -1):
            batches = [(batch, max(1, math.ceil(sequences / (devices * batch))))
                       for batch in range(o.batch_size, 0, -1)]
            fewer = self._lightest(total // devices, devices, batches, offload=False)
            if fewer is not None:
                return self._devices_line(fewer, alone=True, share=total // devices)
        return None

    def _nothing_fits(self, offload: bool = True, more_devices: bool = True) -> str:
        """The line when nothing fits: the lightest setting the searches
        consider, as the estimator finds it (which neither a higher stage,
        more offload, more recompute nor more devices always is: on one
        device a higher stage only adds buffers), and what it needs: the
        least ``needed_bytes`` of batch_size 1 with each of
        ``_combinations`` (stage, offload, recompute), on this run's devices
        and, with ``more_devices``, on the most devices the searches try
        (the counts between never need less than the most: the devices
        search bisects on that)."""
        o = self.options
        devices = [o.devices]
        if more_devices:
            most = max(1, MAX_SUGGESTED_DEVICES // self.processes)  # per process
            devices += [most] if most > o.devices else []
        candidates = (self._with(devices=count, zero_stage=stage, batch_size=1, recompute=recompute, offload=names)
                      for count in devices for stage, names, recompute in self._combinations(offload))
        best = min(candidates, key=lambda estimate: estimate.needed_bytes)  # the first of the lightest
        n = best.options
        return (f"nothing fits: even the lightest setting, {self._placement(n.devices)} with zero_stage "
                f"{n.zero_stage}, batch_size 1"
                + (f", recompute {','.join(n.recompute)}" if n.recompute else "")
                + (f" and offload {','.join(n.offload)}" if n.offload else "")
                + f", needs {human_bytes(best.needed_bytes)} per device; shorten seq_len "
                f"({o.seq_len}) or train a smaller model"
                + (f" ({human_bytes(self.reserve_bytes)} of that is the reserve for memory outside nanoq's "
                   f"allocator: CUDA context, libraries; reserve_bytes, nanoq memory --reserve)"
                   if self.reserve_bytes else ""))


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


def parameter_numels(config: ModelConfig) -> Iterator[int]:
    """Element counts of the model's parameters in the core's flat-buffer
    order (``nanoq::parameter_layout``)."""
    for _, shape in _core.parameter_layout(config.to_core()):
        yield math.prod(shape)


def _resolve(options: TrainOptions, backend: Optional[str]) -> TrainOptions:
    """Options with the backend and dtype the Trainer would use. An explicit
    "cuda" needs no GPU here."""
    name = backend or options.backend
    if name == "auto":
        from nanoq.backends import resolve_backend

        name = resolve_backend("auto")
    if name not in ("cpu",) + CUDA_BACKENDS:
        raise ValueError(f"backend must be cpu, {', '.join(CUDA_BACKENDS)} or auto, got {name!r}")
    dtype = options.dtype if options.dtype != "auto" else auto_dtype(name)
    resolved = dataclasses.replace(options, backend=name, dtype=dtype)
    option_schema.check(resolved.core_fields())  # the rules that needed the backend (cpu: fp32 only)
    return resolved


def estimate_memory(config: ModelConfig, options: TrainOptions, *, backend: Optional[str] = None,
                    reserve_bytes: Optional[int] = None, processes: Optional[int] = None,
                    generates: bool = False, device_memory: Optional[int] = None) -> MemoryEstimate:
    """Per-device memory of ``Trainer(config, options)``, without allocating:
    the core's plan of that Trainer (see the module's note).

    backend: overrides ``options.backend`` ("cpu", "cuda", "cuda_emulated";
    "auto" as the Trainer resolves it). A cuda estimate needs no GPU (see
    the module's note on CUB). ``dtype`` "auto" is bf16 on cuda and
    cuda_emulated, fp32 on cpu. reserve_bytes: memory outside nanoq's
    allocator that ``fits`` adds (default CUDA_RESERVE_BYTES on cuda, 0
    otherwise). The cpu backend's attention scratch depends on the threads
    per device: ``options.threads``, or 0 for this machine's cores shared out.
    ``options.memory_limit`` is not applied: the estimate reports what the
    run needs, ``fits`` judges it. processes: the processes of the run, each
    driving ``options.devices`` devices of one world (default: the
    launcher's under a launcher, else 1; see nanoq.distributed); every
    device of the world is planned. With ``options.world_size`` set (a
    trainer that is a slice of a world) only its own devices are planned.
    generates: the run generates (samples during training), so its KV cache
    counts in the totals and the fit (it is planned either way).
    device_memory: bytes of each device to plan for (default: the device
    itself, where the plan can ask it): on cuda the classifier's logits
    chunk grows into the memory a device has left, up to one chunk of all
    rows, so a plan for a GPU that is not here needs its size to match the
    Trainer's allocations there.
    Raises ValueError for options the Trainer refuses (cpu: fp32 only; on
    cuda, head_dim > 256) and a bad ``processes``; nanoq.NanoqError
    when the scratch cannot be planned (a cuda estimate on an install with
    neither cuda nor cuda_emulated built).
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a nanoq.ModelConfig, got {type(config).__name__}")
    if not isinstance(options, TrainOptions):
        raise TypeError(f"options must be a nanoq.TrainOptions, got {type(options).__name__}")
    if not isinstance(generates, bool):
        raise TypeError(f"generates must be True or False, got {generates!r}")
    if device_memory is not None and (isinstance(device_memory, bool) or not isinstance(device_memory, int)
                                      or device_memory <= 0):
        raise ValueError(f"device_memory must be a positive byte count, got {device_memory!r}")
    if reserve_bytes is not None and (isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int)
                                      or reserve_bytes < 0):
        raise ValueError(f"reserve_bytes must be a byte count (0 or more), got {reserve_bytes!r}")
    processes = planned_processes(processes, options)
    options = _resolve(options, backend)
    plans = []
    for process in range(processes):
        plans += _core.plan_memory(config.to_core(), _planned_options(options, processes, process),
                                   _asks_libraries(options.backend), device_memory or 0)
    per_device, converted = [], {}
    for plan in plans:  # devices with equal plans share one list: convert it once
        key = id(plan["allocations"])
        if key not in converted:
            converted[key] = [Allocation(**a) for a in plan["allocations"]]
        per_device.append(converted[key])
    device_totals = [sum(a.bytes for a in allocations if a.kind == "device") for allocations in per_device]
    largest = device_totals.index(max(device_totals))
    allocations = per_device[largest]
    generation = [Allocation(**a) for a in plans[largest]["generation"]]
    parameters = sum(parameter_numels(config))
    trainable = parameters if options.lora is None else \
        sum(rows * cols for rows, cols in adapter_shapes(config, options.lora).values())
    if reserve_bytes is None:
        reserve_bytes = CUDA_RESERVE_BYTES if options.backend == "cuda" else 0
    return MemoryEstimate(config=config, options=options, allocations=allocations, parameters=parameters,
                          trainable_parameters=trainable, reserve_bytes=reserve_bytes, per_device=per_device,
                          stack_capacities=[plan["stack_capacity"] for plan in plans], processes=processes,
                          generation=generation, generates=generates,
                          classifier_rows=plans[largest]["classifier_rows"], device_memory=device_memory)


def planned_processes(processes: Optional[int], options: TrainOptions) -> int:
    """The number of processes to plan for: ``processes``, or the launcher's."""
    if processes is None:
        world = distributed.launcher_world()
        processes = 1 if world is None or options.world_size else world[1]
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive integer, got {processes!r}")
    if processes > 1 and options.world_size:
        raise ValueError(f"processes ({processes}) and options.world_size ({options.world_size}) both place the "
                         f"devices in a world: give processes for a whole run, world_size for a trainer's slice")
    return processes


def _planned_options(options: TrainOptions, processes: int = 1, process: int = 0) -> dict:
    """The options the core plans, as the binding takes them: those of the
    Trainer of process ``process`` of ``processes`` (placed in the world as
    Trainer places it), with no memory limit (the estimate reports what the
    run needs). A cuda estimate without the cuda backend's library is
    planned by the same code built as cuda_emulated."""
    changes = dict(memory_limit=0)
    if processes > 1:
        changes.update(world_size=processes * options.devices, first_rank=process * options.devices,
                       comm_id=_PLANNED_COMM_ID)
    planned = dataclasses.asdict(dataclasses.replace(options, **changes))
    if options.backend == "cuda" and not _loadable("cuda"):
        if not _core.backend_built("cuda_emulated"):
            raise _core.NanoqError("cannot estimate the cuda backend's scratch: this install has neither the cuda "
                                   "nor the cuda_emulated backend, whose code plans it")
        planned["backend"] = "cuda_emulated"
    return planned


def _asks_libraries(backend: str) -> bool:
    """Whether the plan asks libraries (CUB) for their sizes: not when a
    cuda plan comes from cuda_emulated's copy of the code, whose stand-in
    for CUB could not answer for a real GPU."""
    return backend != "cuda" or _loadable("cuda")


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
