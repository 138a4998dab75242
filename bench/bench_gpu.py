"""nanoq's cuda backend against PyTorch + transformers on one GPU, in one run.

Models (random weights, the shapes of the published checkpoints' config.json):
- Qwen2.5-0.5B: hidden 896, 24 layers, 14 query heads and 2 kv heads of
  head_dim 64, intermediate 4864, vocab 151936, tied embeddings;
- Qwen2.5-1.5B: hidden 1536, 28 layers, 12 query heads and 2 kv heads of
  head_dim 128, intermediate 8960, vocab 151936, tied embeddings;
both with q/k/v biases and rope theta 1e6. The parent process builds each
model once (transformers; on the GPU when there is one) and saves it in
bf16; each trainer then runs in its own fresh subprocess (so GPU memory is
its own) from those weights, on the same random token batches, for the same
full optimizer steps (forward, backward, clipping to norm 1.0, AdamW with lr
3e-4, betas (0.9, 0.95), weight decay 0.1 on matrices only).

Configurations: each model at each batch setting, seq 1024:
- "b8": B=8 (--batch), no gradient accumulation (--grad-accum);
- "llmq": llm.q's published settings for these models on one GPU, B=32 with
  16 micro-batches per optimizer step (IST-DASLab/llmq, benchmarks/H100x1.md
  at commit 7f895bd: `--batch-size=32 --grad-accumulation=16
  --seq-length=1024` for both Qwen2.5-0.5B and -1.5B);
and at each matmul dtype: "bf16" (nanoq's matmul_dtype "auto") and "fp8"
(matmul_dtype "fp8": e4m3 projection matmuls). PyTorch runs once per model
and setting, in bf16 (it has no fp8 path without extra libraries):

- nanoq: backend "cuda", dtype "bf16" (weights, activations), master_dtype
  and optimizer_dtype "fp32", attention "auto", grad_accum as the setting.
- torch: the model in fp32 (the master weights) under
  ``torch.autocast("cuda", torch.bfloat16)``, ``attn_implementation="sdpa"``,
  cross-entropy on fp32 logits, ``torch.optim.AdamW(fused=True)`` when
  available, eager mode (no torch.compile); the loss of each micro-batch
  divided by the number of micro-batches.

Memory: a setting that does not fit the GPU runs in smaller micro-batches
with more of them per step, the same rows in the same order (so the same
tokens, and the same loss, per step), and the report says so. nanoq decides
before it starts, from the core's memory plan of the run (what `nanoq
memory` prints) against the GPU's free memory: the largest micro-batch that
fits. torch, which has no such plan, halves down on its out-of-memory error
(the next smaller divisor of the step's rows), the step started again. So
an 80 GB H100 runs llm.q's B=32 x 16 at 1.5B as B=16 x 32 (nanoq needs about
91.5 GiB at B=32 with fp32 master weights and AdamW state). --device-memory
fits both trainers into less than the GPU has (nanoq's Trainer held to it
with memory_limit, torch with set_per_process_memory_fraction).

Reported per trainer: tokens/s over the timed steps (after the warm-up
steps; each step ends with its loss on the host, so the clock sees finished
work), GPU memory, the losses, and MFU. Memory: nanoq's ``get_allocations``
total (it takes everything up front), torch's ``max_memory_allocated``, and
for both the rise in the device's used memory (NVML) from before the trainer
started to after the last step, CUDA context and library workspaces
included: the like-for-like figure.

MFU = tokens/s * flops_per_token / the GPU's dense bf16 peak (by its NVML
name, peak_flops: 989e12 for H100/H200 SXM, 756e12 for H100 PCIe, 835e12
for the NVL cards; an unknown name is assumed 989e12 and said so); fp8
runs are held to the same bf16 peak, so that MFU compares with bf16 runs.
flops_per_token = 6 * N + 6 * L * H * Q * T: N counts all parameters, the
tied embedding once (as the LM-head matmul; the lookup itself is free), L
layers, H query heads, Q head_dim, T seq_len. The attention term counts the
causal half of the T x T score matrix, the work causal attention needs, as
llm.q's published MFU does (150k tokens/s at 0.5B is its 46.9% by this
formula); PaLM's 12 * L * H * Q * T counts the whole matrix and reads 3-4%
higher at these shapes.

Beside the measurements the report prints llm.q's published H100 figures for
the same models and settings (PUBLISHED below), labelled as published: they
were not measured in this run, on this GPU.

    python bench/bench_gpu.py [--model 0.5b 1.5b] [--matmul-dtype bf16 fp8] [--settings b8 llmq]
                              [--budget 90] [--time-limit 300] [--out DIR]
    python bench/bench_gpu.py --smoke     # a tiny model for 2 steps: checks the plumbing
    python bench/bench_gpu.py --profile-steps 2   # and where each trainer's GPU time goes

With --profile-steps N each trainer runs N more optimizer steps after its
timed ones under torch.profiler (CUDA activity: every kernel, copy and
memset on the device, nanoq's and its libraries' included, also inside CUDA
graphs) and reports, per step: the GPU's busy time (the union of those
intervals) against the wall time, the time per kind of work (matmul,
attention, norm, ...: a grouping by kernel name, PROFILE_GROUPS) and the
kernels that took longest. These steps are not timed (the profiler adds its
own cost per launch); the timed figures are saved before they start, so a
profiler that crashes or overruns the budget loses only the profile. With
--out the traces are kept there (trace_<configuration>_<trainer>.json.gz,
for Perfetto or chrome://tracing).

--budget bounds each trainer's process (model loading included): its timed
steps stop early, after at least one, when the budget is nearly spent, and a
process still running at the budget is killed (recorded as failed).
--time-limit bounds the whole run: a trainer's budget never reaches past it,
and configurations that would start with less than 20 s left are recorded
as skipped. With ``--out`` (default: $OUT when set) it writes
bench_gpu.json and bench_gpu.txt there, again after every configuration,
so that a run stopped from outside keeps what it finished. A trainer that
fails (exception, crash, hang) is recorded as failed and the others still
run; the exit status is 1 when any failed (or none ran), 3 (EXIT_PARTIAL)
when some ran, none failed and the time limit skipped the rest, 2 when no
GPU is visible.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

# Dense bf16 peaks (datasheets) by NVML name, first match wins; fp8 runs are held to these too.
PEAK_BF16_FLOPS = [
    (r"NVL", 835e12),                # H100 NVL, H200 NVL
    (r"H100.*PCIe", 756e12),
    (r"\bG?H(100|200)\b", 989e12),  # H100 / H200 SXM, GH200
]
ASSUMED_PEAK_FLOPS = 989e12  # for a GPU not named above (and without a GPU): said in the report

MODELS = {
    "0.5b": ("Qwen2.5-0.5B", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                  num_attention_heads=14, num_key_value_heads=2, head_dim=64, rope_theta=1e6,
                                  tie_word_embeddings=True)),
    "1.5b": ("Qwen2.5-1.5B", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                  num_attention_heads=12, num_key_value_heads=2, head_dim=128, rope_theta=1e6,
                                  tie_word_embeddings=True)),
}
SMOKE = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
             tie_word_embeddings=True)
LLMQ_SETTING = dict(batch=32, grad_accum=16)  # llm.q's commands for both models (see the module docstring)
MATMUL_DTYPES = {"bf16": "auto", "fp8": "fp8"}  # our name -> nanoq's TrainOptions.matmul_dtype

# llm.q's published figures, one H100, B=32 x 16 micro-batches, seq 1024, bf16
# weights and AdamW moments, CUDA graphs: IST-DASLab/llmq benchmarks/H100x1.md
# (commit 7f895bd), steady-state steps. Printed beside ours, never as measured.
PUBLISHED = {
    ("0.5b", "bf16"): dict(tokens_per_second=150e3, mfu=0.469),
    ("0.5b", "fp8"): dict(tokens_per_second=164e3, mfu=None),
    ("1.5b", "bf16"): dict(tokens_per_second=59e3, mfu=0.570),
    ("1.5b", "fp8"): dict(tokens_per_second=73e3, mfu=None),
}
PUBLISHED_SOURCE = "llm.q, published, one H100 (IST-DASLab/llmq benchmarks/H100x1.md), B=32 x 16, not measured here"

# Issue 15's targets (tokens/s on one H200, and ratios), checked where measured.
TARGETS = {("0.5b", "bf16"): 180e3, ("1.5b", "bf16"): 65e3}
TARGET_FP8_OVER_BF16 = 1.3  # at 1.5B
TARGET_OVER_TORCH = 2.0
MIN_BUDGET = 20.0  # seconds: a trainer is not started with less than this before the time limit
# The exit status of a run in which some configurations (or, in bench_ops.py, cases) ran, none
# failed and --time-limit left the rest unrun; bench/gpu_check.sh reports it as a partial step.
EXIT_PARTIAL = 3
PROFILE_MIN_SECONDS = 15.0  # of a trainer's budget left for its profiled steps (torch's import, the trace)

# Kinds of GPU work, by kernel name (lower case, first match wins): a reading
# aid for the profile, not a measurement of its own. Copies and memsets are
# "copy" by their trace category.
PROFILE_GROUPS = [
    ("communication", r"nccl"),
    ("attention", r"attention|sdpa|fmha|flash|cudnn"),
    ("fp8 quantize", r"fp8|quantiz|amax|absmax"),
    ("matmul", r"gemm|xmma|cutlass|cublas|nvjet|matmul"),
    ("optimizer", r"adam|optimizer|multi_tensor|sum_squares|clip"),
    ("classifier", r"classifier|cross_entropy|softmax|nll|logsumexp"),
    ("rope / qkv", r"rope|rotary|qkv"),  # before "norm": qk_norm_rope_* is q|k|v's pass with or without norms
    ("norm", r"norm"),
    ("swiglu", r"swiglu|silu|glu"),
    ("embedding", r"embedding|radix|sort|index|scatter|gather"),
]
PROFILE_UNFINISHED = "the process ended while profiling"  # the saved result's profile until it is done
DEVICE_TRACE_CATEGORIES = {"kernel": None, "gpu_memcpy": "copy", "gpu_memset": "copy"}


# --------------------------------------------------------------------------
# Model size and FLOPs
# --------------------------------------------------------------------------


def parameter_count(shape: dict) -> int:
    """Parameters of a Qwen2 model (q/k/v biases; a tied embedding counted once)."""
    d, q = shape["hidden_size"], shape["head_dim"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    attention = d * heads * q + 2 * d * kv * q + heads * q * d + heads * q + 2 * kv * q
    mlp = 3 * d * shape["intermediate_size"]
    per_layer = attention + mlp + 2 * d
    embeddings = shape["vocab_size"] * d * (1 if shape["tie_word_embeddings"] else 2)
    return shape["num_hidden_layers"] * per_layer + embeddings + d


def flops_per_token(shape: dict, seq_len: int) -> float:
    """6 N + 6 L H Q T: causal attention's half of PaLM's 12 L H Q T (see the module docstring)."""
    attention = 6 * shape["num_hidden_layers"] * shape["num_attention_heads"] * shape["head_dim"] * seq_len
    return 6 * parameter_count(shape) + attention


def measured_nanoq(measured: dict, model: str, dtype: str) -> tuple:
    """(setting, tokens/s) of nanoq's run of `model` in `dtype`: at llm.q's
    setting where it ran, else at B=8; (None, None) where neither did."""
    for setting in ("llmq", "b8"):
        if measured.get((model, setting, "nanoq", dtype)):
            return setting, measured[(model, setting, "nanoq", dtype)]
    return None, None


def peak_flops(gpu: str) -> tuple[float, bool]:
    """The dense bf16 peak of the GPU NVML names `gpu`, and whether it is
    known (else ASSUMED_PEAK_FLOPS)."""
    for pattern, peak in PEAK_BF16_FLOPS:
        if re.search(pattern, gpu):
            return peak, True
    return ASSUMED_PEAK_FLOPS, False


# --------------------------------------------------------------------------
# Shared by the workers
# --------------------------------------------------------------------------


def batches(run: dict, micro_batches: int, first: int) -> list:
    """The same random (inputs, targets) int32 micro-batches for every trainer of a model and setting."""
    import numpy as np

    out = []
    for index in range(first, first + micro_batches):
        rng = np.random.default_rng(1000 + index)
        tokens = rng.integers(0, run["shape"]["vocab_size"], (run["batch"], run["seq"] + 1), dtype=np.int32)
        out.append((np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])))
    return out


def regroup(micro_batches: list, rows: int) -> list:
    """A step's micro-batches as micro-batches of ``rows`` rows: the same
    rows in the same order, so the same tokens and (the loss being the mean
    over the step's tokens for both trainers) the same step, in more,
    smaller micro-batches. ``rows`` divides the step's rows."""
    import numpy as np

    if rows == len(micro_batches[0][0]):
        return micro_batches
    inputs = np.concatenate([i for i, _ in micro_batches])
    targets = np.concatenate([t for _, t in micro_batches])
    if rows < 1 or len(inputs) % rows:
        raise ValueError(f"{rows} rows per micro-batch do not divide the step's {len(inputs)} rows")
    return [(np.ascontiguousarray(inputs[i:i + rows]), np.ascontiguousarray(targets[i:i + rows]))
            for i in range(0, len(inputs), rows)]


def smaller_micro_batch(rows: int, step_rows: int) -> int | None:
    """The largest micro-batch below ``rows`` rows that divides the step's
    ``step_rows`` (as the memory plan's suggestion picks it), or None."""
    return next((r for r in range(rows - 1, 0, -1) if step_rows % r == 0), None)


@contextlib.contextmanager
def nvml():
    """pynvml, initialised for the block and shut down after it; None
    without NVML or a driver (no figure then, not a failure)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML, no driver
        yield None
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def gpu_memory_bytes(which: str = "used") -> int | None:
    """GPU 0's "used" (all processes) or "free" memory as NVML reports it, or None."""
    with nvml() as lib:
        return None if lib is None else int(getattr(lib.nvmlDeviceGetMemoryInfo(lib.nvmlDeviceGetHandleByIndex(0)),
                                                    which))


def gpu_names() -> list[str]:
    """The NVIDIA GPUs NVML sees (nanoq.backends.gpu_names; importing nanoq
    here starts no CUDA context). Where nanoq does not import (its build
    failed: gpu_check.sh still runs the benchmark, for torch's figures),
    NVML's names read here."""
    try:
        from nanoq.backends import gpu_names as names
    except ImportError:
        with nvml() as lib:
            if lib is None:
                return []
            found = [lib.nvmlDeviceGetName(lib.nvmlDeviceGetHandleByIndex(i)) for i in range(lib.nvmlDeviceGetCount())]
            return [n.decode() if isinstance(n, bytes) else n for n in found]
    return names()


def timed_loop(run: dict, train_step, started: float) -> dict:
    """Runs the warm-up steps, then timed optimizer steps until run["steps"]
    or, after at least one, until the next would likely end past the
    process's budget. train_step(micro_batches) -> loss (a float on the host)."""
    accum, losses, timed, start = run["grad_accum"], [], 0, None
    budget_end = started + run["budget"] - 10.0 if run["budget"] else None  # 10 s for teardown
    for step in range(run["warmup"] + run["steps"]):
        if step == run["warmup"]:
            start = time.perf_counter()
        elif step > run["warmup"] and budget_end is not None:
            per_step = (time.perf_counter() - start) / timed
            if time.perf_counter() + per_step > budget_end:
                print(f"stopping after {timed} timed steps: the budget of {run['budget']:.0f} s is nearly spent",
                      flush=True)
                break
        losses.append(train_step(batches(run, accum, step * accum)))
        timed += step >= run["warmup"]
        print(f"step {step}{' (warm-up)' if step < run['warmup'] else ''}: loss {losses[-1]:.4f}", flush=True)
    return dict(seconds=time.perf_counter() - start, timed_steps=timed, losses=losses)


# --------------------------------------------------------------------------
# Profile: where the GPU time of a step goes
# --------------------------------------------------------------------------


def kernel_short_name(name: str, limit: int | None = 90) -> str:
    """A kernel's name without "void", namespaces and parameter list, at most ``limit`` characters."""
    name = name.replace("(anonymous namespace)::", "")
    name = re.sub(r"^void ", "", name.split("(")[0]).strip()
    name = re.sub(r"\b[A-Za-z_][A-Za-z0-9_]*::", "", name)
    return name[:limit]


def kernel_group(name: str, trace_category: str = "kernel") -> str:
    """The kind of work a device event is (PROFILE_GROUPS), "copy" for copies and memsets."""
    if DEVICE_TRACE_CATEGORIES.get(trace_category):
        return DEVICE_TRACE_CATEGORIES[trace_category]
    # The name and template arguments only: parameter types would group by
    # what a kernel takes (an Fp8Format argument, a Side<> of q|k|v).
    lowered = kernel_short_name(name, limit=None).lower()
    for group, pattern in PROFILE_GROUPS:
        if re.search(pattern, lowered):
            return group
    return "other"


def profile_summary(trace_events: list, wall_seconds: float, steps: int, top: int = 25) -> dict:
    """Per optimizer step, from a chrome trace's events (torch.profiler's
    export): the device events (kernels, copies, memsets), the GPU's busy
    seconds (the union of their intervals: overlapping streams count once),
    the wall seconds, the seconds per group (sums of durations) and the
    `top` kernels by time (short name, seconds and calls per step)."""
    spans, groups, kernels = [], {}, {}
    for event in trace_events:
        category = event.get("cat")
        if event.get("ph") != "X" or category not in DEVICE_TRACE_CATEGORIES:
            continue
        start, duration = float(event["ts"]) * 1e-6, float(event.get("dur", 0.0)) * 1e-6
        spans.append((start, start + duration))
        group = kernel_group(event.get("name", ""), category)
        groups[group] = groups.get(group, 0.0) + duration
        name = kernel_short_name(event.get("name", "")) if category == "kernel" else category
        seconds, calls = kernels.get(name, (0.0, 0))
        kernels[name] = (seconds + duration, calls + 1)
    busy, end = 0.0, None
    for start, stop in sorted(spans):
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    per = 1.0 / max(steps, 1)
    ranked = sorted(kernels.items(), key=lambda item: -item[1][0])[:top]
    return dict(steps=steps, device_events=len(spans), wall_seconds_per_step=wall_seconds * per,
                gpu_busy_seconds_per_step=busy * per,
                groups_seconds_per_step={g: t * per for g, t in sorted(groups.items(), key=lambda item: -item[1])},
                top_kernels=[dict(name=n, seconds_per_step=t * per, calls_per_step=c * per) for n, (t, c) in ranked])


def profile_lines(profile: dict) -> list[str]:
    """The report's lines for one trainer's profile."""
    if "error" in profile:
        return [f"  profile: {profile['error']}"]
    if not profile["device_events"]:
        return [f"  profile ({profile['steps']} steps): no device events recorded (no GPU, or the profiler saw "
                f"none of them)"]
    wall, busy = profile["wall_seconds_per_step"], profile["gpu_busy_seconds_per_step"]
    total = sum(profile["groups_seconds_per_step"].values()) or 1.0
    groups = ", ".join(f"{g} {1e3 * t:.1f} ms ({100 * t / total:.0f}%)"
                       for g, t in profile["groups_seconds_per_step"].items())
    lines = [f"  profile ({profile['steps']} steps under torch.profiler): per step {1e3 * wall:.1f} ms wall, GPU busy "
             f"{1e3 * busy:.1f} ms ({100 * busy / wall if wall else 0:.0f}%); {groups}"]
    for kernel in profile["top_kernels"][:8]:
        lines.append(f"    {1e3 * kernel['seconds_per_step']:8.2f} ms  x{kernel['calls_per_step']:<6g} "
                     f"{kernel['name']}")
    return lines


def profiled_steps(run: dict, train_step, started: float) -> dict | None:
    """run["profile_steps"] more optimizer steps under torch.profiler (see the
    module's docstring): profile_summary's dict, or dict(error=...) when
    they could not run; None when not asked for."""
    steps = run.get("profile_steps", 0)
    if not steps:
        return None
    if run["budget"]:
        left = run["budget"] - (time.perf_counter() - started)
        if left < PROFILE_MIN_SECONDS:
            return dict(error=f"skipped: {left:.0f} s of the budget left (it needs {PROFILE_MIN_SECONDS:.0f})")
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError as e:
        return dict(error=f"skipped: torch.profiler does not import ({e})")
    # Without CUDA (the plumbing tests) torch can only trace the host: no device events then.
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    first = run["warmup"] + run["steps"]  # batches after the timed ones
    try:
        with profile(activities=[activity]) as profiler:
            begin = time.perf_counter()
            for step in range(steps):
                train_step(batches(run, run["grad_accum"], (first + step) * run["grad_accum"]))
            wall = time.perf_counter() - begin
        with tempfile.TemporaryDirectory(prefix="bench_gpu_trace_") as work:
            path = os.path.join(work, "trace.json")
            profiler.export_chrome_trace(path)
            with open(path, "rb") as f:
                raw = f.read()
    except Exception as e:  # noqa: BLE001 - the timed figures stand; the profile is what failed
        traceback.print_exc()
        return dict(error=f"failed: {type(e).__name__}: {e}")
    summary = profile_summary(json.loads(raw).get("traceEvents", []), wall, steps)
    if run.get("trace_path"):
        try:
            os.makedirs(os.path.dirname(run["trace_path"]) or ".", exist_ok=True)
            with gzip.open(run["trace_path"], "wb") as f:
                f.write(raw)
            summary["trace"] = os.path.basename(run["trace_path"])
        except OSError as e:
            summary["trace_error"] = f"{type(e).__name__}: {e}"
    return summary


def saved_partial(path: str | None) -> dict | None:
    """The timed figures save_partial wrote to ``path`` (a result whose
    profile is still PROFILE_UNFINISHED), or None."""
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    return result if result.get("profile", {}).get("error") == PROFILE_UNFINISHED else None


def save_partial(run: dict, result: dict) -> None:
    """The timed figures, written before the profile so that a profiler that
    crashes or is killed at the budget loses only the profile."""
    if run.get("result_path") and run.get("profile_steps"):
        with open(run["result_path"], "w") as f:
            json.dump(dict(result, profile=dict(error=PROFILE_UNFINISHED)), f)


# --------------------------------------------------------------------------
# Workers (each in its own process)
# --------------------------------------------------------------------------


def run_nanoq(run: dict, model_dir: str, started: float) -> dict:
    """nanoq's run, with CUDA graphs (the default) unless the run says
    ``cuda_graphs`` False (``run_worker``'s second try: graphs have never run
    on a GPU before this benchmark's first GPU run)."""
    return _run_nanoq(run, model_dir, started, cuda_graphs=run.get("cuda_graphs", True))


def _run_nanoq(run: dict, model_dir: str, started: float, cuda_graphs: bool) -> dict:
    import nanoq

    used_before = gpu_memory_bytes()
    config = nanoq.ModelConfig.from_pretrained(model_dir)
    options = dict(backend=run["backend"], dtype="fp32" if run["backend"] == "cpu" else "bf16",
                   master_dtype="fp32", optimizer_dtype="fp32", batch_size=run["batch"], seq_len=run["seq"],
                   grad_accum=run["grad_accum"])
    if run["matmul_dtype"] != "bf16":  # bf16 is the default ("auto"): builds without the option still run it
        options["matmul_dtype"] = MATMUL_DTYPES[run["matmul_dtype"]]
    if not cuda_graphs:
        options["cuda_graphs"] = False
    options, fit = fit_nanoq(config, options, run)
    with nanoq.Trainer(config, nanoq.TrainOptions(**options)) as trainer:
        trainer.import_weights(model_dir)

        def train_step(micro_batches):
            for inputs, targets in regroup(micro_batches, options["batch_size"]):
                trainer.step(inputs, targets)
            return trainer.update(lr=3e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, grad_clip=1.0).loss

        result = timed_loop(run, train_step, started)
        attention = trainer.attention
        used_after = gpu_memory_bytes()
        by_context = {}
        for a in trainer.get_allocations(0):
            if a["kind"] == "device":
                by_context[a["context"]] = by_context.get(a["context"], 0) + a["bytes"]
        result.update(micro_batch=options["batch_size"], grad_accum=options["grad_accum"], fit=fit)
        result.update(cuda_graphs=cuda_graphs, attention=attention,
                      allocations_by_context=by_context, peak_bytes=sum(by_context.values()),
                      device_used_rise_bytes=None if used_before is None else used_after - used_before)
        # After the memory figures: torch's own CUDA context must not count in them.
        save_partial(run, result)
        profile = profiled_steps(run, train_step, started)
    if profile is not None:
        result["profile"] = profile
    return result


def fit_nanoq(config, options: dict, run: dict) -> tuple[dict, dict | None]:
    """nanoq's options with the largest micro-batch that the core's memory
    plan (nanoq.estimate_memory, as `nanoq memory` prints it) fits into the
    GPU's free memory, or into run["device_memory"] when given (the Trainer
    is then held to it with memory_limit), the tokens per step kept
    (MemoryEstimate.fitting_micro_batch); the setting's own when it fits.
    Also the fit's record (None when no memory figure applies: off cuda
    without run["device_memory"]). Raises RuntimeError, with the plan's
    suggestions, when not even one row per micro-batch fits."""
    import nanoq
    from nanoq.memory import estimate_memory, human_bytes

    limit = run.get("device_memory") or (gpu_memory_bytes("free") if run["backend"] == "cuda" else None)
    if not limit:
        return options, None
    try:
        estimate = estimate_memory(config, nanoq.TrainOptions(**options), device_memory=limit)
    except (nanoq.NanoqError, ValueError) as e:
        # The plan has not run on a GPU before this benchmark's first GPU run: should it fail
        # there, the setting runs as it is (and fails on its own if it does not fit).
        traceback.print_exc()
        print("--- nanoq's memory plan failed: running the setting's micro-batch unfitted", flush=True)
        return options, dict(error=f"{type(e).__name__}: {e}")
    fitting = estimate.fitting_micro_batch(limit)
    needed = estimate.needed_bytes
    if fitting is None:
        raise RuntimeError(f"B={options['batch_size']}x{options['grad_accum']} needs {human_bytes(needed)}, and not "
                           f"even one row per micro-batch fits the {human_bytes(limit)} of GPU memory: "
                           + "; ".join(estimate.suggestions(limit)))
    options = dict(options, batch_size=fitting.options.batch_size, grad_accum=fitting.options.grad_accum)
    if run.get("device_memory"):
        options["memory_limit"] = limit - fitting.reserve_bytes
    fit = dict(device_memory_bytes=limit, device_memory_given=bool(run.get("device_memory")),
               setting_needs_bytes=needed, needs_bytes=fitting.needed_bytes)
    if fitting is not estimate:
        print(f"B={run['batch']}x{run['grad_accum']} needs {human_bytes(needed)} of the {human_bytes(limit)} "
              f"available: running B={options['batch_size']}x{options['grad_accum']} (the same tokens per step)",
              flush=True)
    return options, fit


def run_torch(run: dict, model_dir: str, started: float) -> dict:
    import torch
    from transformers import Qwen2ForCausalLM

    on_gpu = run["backend"] == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    used_before = gpu_memory_bytes()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        optimizer = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=on_gpu)
        fused = on_gpu
    except (TypeError, RuntimeError):
        optimizer = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
        fused = False
    if on_gpu:
        if run.get("device_memory"):  # held to the memory given, as nanoq's Trainer is
            total_memory = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, run["device_memory"] / total_memory), device)
        torch.cuda.reset_peak_memory_stats(device)
    out_of_memory = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    step_rows = run["batch"] * run["grad_accum"]
    rows, oom = run["batch"], []  # the micro-batch in use; the ones that ran out of memory
    # A test hook (plumbing tests on the CPU, where nothing runs out of memory):
    # micro-batches of more rows than this raise torch's out-of-memory error.
    oom_above = int(os.environ.get("NANOQ_BENCH_TORCH_OOM_ABOVE_ROWS", "0"))

    def attempt(micro_batches):
        micro_batches = regroup(micro_batches, rows)
        total = 0.0
        for inputs, targets in micro_batches:
            if oom_above and len(inputs) > oom_above:
                raise out_of_memory(f"NANOQ_BENCH_TORCH_OOM_ABOVE_ROWS={oom_above}: {len(inputs)} rows")
            inputs, targets = (torch.from_numpy(a).to(device, dtype=torch.long) for a in (inputs, targets))
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
            (loss / len(micro_batches)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(total) / len(micro_batches)

    def train_step(micro_batches):
        """One optimizer step; out of memory, the same step again in smaller
        micro-batches (the same tokens per step), as a user of torch would."""
        nonlocal rows
        while True:
            try:
                return attempt(micro_batches)
            except out_of_memory as e:
                error = str(e).splitlines()[0][:300]
            # Outside the handler: the traceback, and the activations its frames held, are gone.
            smaller = smaller_micro_batch(rows, step_rows)
            if smaller is None:
                raise RuntimeError(f"out of memory even at one row per micro-batch: {error}")
            print(f"torch ran out of memory at B={rows}: the step again at B={smaller}x{step_rows // smaller} "
                  f"(the same tokens per step)", flush=True)
            oom.append(dict(micro_batch=rows, error=error))
            rows = smaller
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()

    result = timed_loop(run, train_step, started)
    result.update(micro_batch=rows, grad_accum=step_rows // rows, out_of_memory=oom)
    peak = {}
    if on_gpu:
        torch.cuda.synchronize(device)
        peak = dict(peak_bytes=int(torch.cuda.max_memory_allocated(device)),
                    peak_reserved_bytes=int(torch.cuda.max_memory_reserved(device)))
    used_after = gpu_memory_bytes()
    result.update(peak, fused_adamw=fused, torch_version=torch.__version__,
                  device_used_rise_bytes=None if used_before is None else used_after - used_before)
    save_partial(run, result)
    profile = profiled_steps(run, train_step, started)
    if profile is not None:
        result["profile"] = profile
    return result


def worker_main(args) -> int:
    """Runs one trainer (its run file says which); writes its result (or its error) to args.result."""
    started = time.perf_counter()
    try:
        with open(args.run) as f:
            run = json.load(f)
        run["result_path"] = args.result
        runner = run_nanoq if run["trainer"] == "nanoq" else run_torch
        result = runner(run, args.model_dir, started)
        status = 0
    except BaseException as e:  # noqa: BLE001 - recorded, then reported as a failure
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"
        result, status = saved_partial(args.result), 0
        if result is None:
            result, status = dict(error=error), 1
        else:  # the timed figures stand; what came after them failed
            result["profile"] = dict(error=f"failed after the timed steps: {error}")
    with open(args.result, "w") as f:
        json.dump(result, f)
    return status


# --------------------------------------------------------------------------
# Parent: models, workers, report
# --------------------------------------------------------------------------


def make_model(shape: dict, seq: int, model_dir: str) -> None:
    """Builds the model with random weights (on the GPU when torch sees one: faster) and saves it in bf16."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                         intermediate_size=shape["intermediate_size"],
                         num_hidden_layers=shape["num_hidden_layers"],
                         num_attention_heads=shape["num_attention_heads"],
                         num_key_value_heads=shape["num_key_value_heads"], rope_theta=shape["rope_theta"],
                         tie_word_embeddings=shape["tie_word_embeddings"], max_position_embeddings=max(seq, 32768),
                         rms_norm_eps=1e-6, use_sliding_window=False, head_dim=shape["head_dim"])
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", None)}
    if rope.get("rope_theta") != shape["rope_theta"]:
        raise RuntimeError(f"transformers did not take rope_theta {shape['rope_theta']}: {rope}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim != shape["head_dim"]:
        raise RuntimeError(f"head_dim {head_dim} != {shape['head_dim']}")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with device:
        model = Qwen2ForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())  # tied weights appear once
    if count != parameter_count(shape):
        raise RuntimeError(f"the model has {count} parameters, parameter_count() says {parameter_count(shape)}")
    model.to(torch.bfloat16).save_pretrained(model_dir)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_worker(run: dict, work_dir: str, model_dir: str) -> dict:
    """The run's record from a worker process. A nanoq run on cuda that fails
    with CUDA graphs (a NanoqError other than out of memory, or a crash; not
    its budget) runs once more without them, in a fresh process (a failed
    capture can leave its CUDA context unusable) and in what is left of its
    budget, the failure recorded beside the figures as ``cuda_graphs_error``."""
    start = time.perf_counter()
    outcome = _worker_process(run, work_dir, model_dir)
    error = "" if outcome["ok"] else outcome["error"]
    # nanoq's own errors and crashes, not out of memory, its budget or a setting's (Python's) errors.
    graphs_may_have = error.startswith("NanoqError") or "no result written" in error or "killed by signal" in error
    retry = run["trainer"] == "nanoq" and run["backend"] == "cuda" and run.get("cuda_graphs", True) and \
        graphs_may_have
    left = run["budget"] - (time.perf_counter() - start) if run["budget"] else 0.0
    if retry and (not run["budget"] or left >= MIN_BUDGET):
        print(f"--- nanoq failed with CUDA graphs: running again without them ({outcome['error'][:200]})",
              flush=True)
        again = _worker_process(dict(run, cuda_graphs=False, budget=left), work_dir, model_dir, "_no_graphs")
        return dict(again, cuda_graphs_error=outcome["error"])
    return outcome


def _worker_process(run: dict, work_dir: str, model_dir: str, suffix: str = "") -> dict:
    tag = f"{run['key'].replace(' ', '_')}_{run['trainer']}{suffix}"
    run_path, result_path = os.path.join(work_dir, f"{tag}.run.json"), os.path.join(work_dir, f"{tag}.json")
    with open(run_path, "w") as f:
        json.dump(run, f)
    command = [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--worker",
               "--model-dir", model_dir, "--run", run_path, "--result", result_path]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    print(f"--- {run['key']}: {run['trainer']} (budget {run['budget']:.0f} s)", flush=True)
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env)
    timed_out = False
    try:
        returncode = process.wait(timeout=run["budget"] or None)
    except subprocess.TimeoutExpired:
        process.kill()
        returncode = process.wait()
        timed_out = True
    result = {}
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
    return worker_outcome(result, returncode, timed_out, run["budget"], time.perf_counter() - start)


def worker_outcome(result: dict, returncode: int, timed_out: bool, budget: float, wall: float) -> dict:
    """A trainer's record from what its process left: its result file's
    dict (empty if none), exit status, whether it was killed at the budget."""
    partial = result.get("profile", {}).get("error") == PROFILE_UNFINISHED
    if partial and (timed_out or returncode != 0):
        # The timed figures were saved before the profile: keep them, the profile is what was lost.
        how = f"killed at the budget of {budget:.0f} s" if timed_out else f"exit status {returncode}"
        result["profile"] = dict(error=f"the process ended while profiling ({how}); the timed figures stand")
        return dict(result, ok=True, wall_seconds=wall)
    if timed_out:
        return dict(ok=False, error=f"timed out after {budget:.0f} s (killed)")
    if returncode != 0 or "error" in result:
        how = f"exit status {returncode}" if returncode >= 0 else f"killed by signal {-returncode}"
        error = result.get("error", "no result written (crashed?); see the log above")
        return dict(ok=False, error=f"{error} [{how}]", wall_seconds=wall)
    return dict(result, ok=True, wall_seconds=wall)


def configurations(args) -> list[dict]:
    """The configurations in the order they run: per model, per setting: nanoq
    in each matmul dtype and torch (bf16), the first dtype's nanoq first."""
    out = []
    for model in args.model:
        name, shape = ("smoke model", SMOKE) if args.smoke else MODELS[model]
        for setting in args.settings:
            batch, accum = ((args.batch, args.grad_accum) if setting == "b8"
                            else (LLMQ_SETTING["batch"], LLMQ_SETTING["grad_accum"]))
            if args.smoke and setting == "llmq":
                batch, accum = 2, 2  # the shape of the setting (accumulation), smoke-sized
            steps, warmup = args.steps, args.warmup
            if setting == "llmq" and not args.smoke:  # a step is 16 micro-batches of 32 rows: fewer of them
                steps, warmup = (args.llmq_steps, args.llmq_warmup)
            base = dict(model=model, model_name=name, shape=shape, setting=setting, batch=batch, grad_accum=accum,
                        seq=args.seq, steps=steps, warmup=warmup, budget=args.budget, backend=args.backend,
                        profile_steps=args.profile_steps, device_memory=args.device_memory)
            trainers = [("nanoq", dtype) for dtype in args.matmul_dtype]
            if not args.only or args.only == "torch":
                trainers.insert(1, ("torch", "bf16"))
            if args.only == "torch":
                trainers = [("torch", "bf16")]
            for trainer, dtype in trainers:
                key = f"{model} {setting} {dtype}"
                trace = (os.path.join(args.out, f"trace_{key.replace(' ', '_')}_{trainer}.json.gz")
                         if args.out and args.profile_steps else None)
                out.append(dict(base, trainer=trainer, matmul_dtype=dtype, key=key, trace_path=trace))
    return out


def micro_batch_lines(run: dict) -> list[str]:
    """The report's line when a trainer ran the step in smaller micro-batches than its setting's, and why."""
    r = run["result"]
    if r.get("fit") and "error" in r["fit"]:
        return [f"  memory plan FAILED, the setting ran unfitted: {r['fit']['error'][:300]}"]
    if r.get("micro_batch", run["batch"]) == run["batch"]:
        return []
    gib = 2.0 ** 30
    ran = f"  ran as B={r['micro_batch']}x{r['grad_accum']} (the same tokens per step): "
    fit = r.get("fit")
    if fit:
        where = "the memory given" if fit["device_memory_given"] else "the GPU's free memory"
        return [ran + f"B={run['batch']}x{run['grad_accum']} needs {fit['setting_needs_bytes'] / gib:.2f} GiB by "
                f"nanoq's memory plan, {where} is {fit['device_memory_bytes'] / gib:.2f} GiB"]
    tried = ", ".join(f"B={o['micro_batch']}" for o in r.get("out_of_memory", []))
    return [ran + f"out of GPU memory at {tried}"]


def summarise(args, runs: list[dict], gpu: str) -> tuple[dict, str]:
    peak, known = peak_flops(gpu)
    lines = [f"nanoq vs PyTorch eager on {gpu}, seq {args.seq}; MFU = tokens/s * FLOP/token (6N + 6*L*H*Q*T, "
             f"causal attention, as llm.q counts) / {peak / 1e12:.0f} TFLOP/s (dense bf16 peak, also for fp8"
             + ("" if known else f"; ASSUMED: {gpu!r} is not a GPU this script knows the peak of") + ")"]
    gib = 2.0 ** 30
    measured = {}  # (model, setting, trainer, dtype) -> tokens/s
    shapes = {}  # (model, setting) -> "B=8x1"
    for run in runs:
        shapes[(run["model"], run["setting"])] = f"B={run['batch']}x{run['grad_accum']}"
        r = run["result"]
        tokens_per_step = run["batch"] * run["seq"] * run["grad_accum"]
        flops = flops_per_token(run["shape"], run["seq"])
        label = (f"{run['model_name']} B={run['batch']}x{run['grad_accum']} {run['trainer']:>5} "
                 f"{run['matmul_dtype']}")
        if not r["ok"]:
            lines.append(f"{label}: FAILED: {r['error']}")
            if r.get("cuda_graphs_error"):  # the second try, without graphs, failed too: the first's error
                lines.append(f"  with CUDA graphs it had failed first: {r['cuda_graphs_error'][:300]}")
            continue
        r["tokens_per_second"] = r["timed_steps"] * tokens_per_step / r["seconds"]
        r["mfu"] = r["tokens_per_second"] * flops / peak
        measured[(run["model"], run["setting"], run["trainer"], run["matmul_dtype"])] = r["tokens_per_second"]
        memory = ""
        if r.get("peak_bytes") is not None:
            memory = f"peak {'allocations' if run['trainer'] == 'nanoq' else 'allocated'} {r['peak_bytes'] / gib:.2f} GiB"
        if r.get("device_used_rise_bytes") is not None:
            memory += f", device used +{r['device_used_rise_bytes'] / gib:.2f} GiB"
        lines.append(f"{label}: {r['tokens_per_second']:9.0f} tokens/s  MFU {100 * r['mfu']:5.1f}%  {memory}  "
                     f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}  ({r['timed_steps']} timed steps)")
        lines += micro_batch_lines(run)
        if run["trainer"] == "nanoq" and "cuda_graphs" in r:
            lines.append(f"  (attention {r.get('attention')}, CUDA graphs {'on' if r['cuda_graphs'] else 'off'})")
        if r.get("cuda_graphs_error"):
            lines.append(f"  CUDA GRAPHS FAILED, these figures are without them: {r['cuda_graphs_error'][:300]}")
        if r.get("profile"):
            lines += profile_lines(r["profile"])
    ratios = {}
    for (model, setting, trainer, dtype), tps in measured.items():
        if trainer != "nanoq":
            continue
        torch_tps = measured.get((model, setting, "torch", "bf16"))
        if torch_tps:
            ratios[f"{model} {setting} {dtype} nanoq/torch"] = tps / torch_tps
        bf16 = measured.get((model, setting, "nanoq", "bf16"))
        if dtype == "fp8" and bf16:
            ratios[f"{model} {setting} nanoq fp8/bf16"] = tps / bf16
    for name, value in ratios.items():
        lines.append(f"ratio {name}: {value:.2f}x")
    if not args.smoke:
        lines.append(f"published figures ({PUBLISHED_SOURCE}):")
    for (model, dtype), figure in PUBLISHED.items():
        if model not in args.model or args.smoke:
            continue
        setting, ours = measured_nanoq(measured, model, dtype)
        mfu = f" ({100 * figure['mfu']:.1f}% of peak, published)" if figure["mfu"] else ""
        beside = ""
        if setting == "llmq":
            beside = (f"; nanoq measured here at the same setting {ours:.0f} tokens/s = "
                      f"{ours / figure['tokens_per_second']:.2f}x it")
        elif setting:
            beside = (f"; nanoq measured here at {shapes[(model, setting)]} only (not llm.q's setting): "
                      f"{ours:.0f} tokens/s")
        lines.append(f"  llm.q {MODELS[model][0]} {dtype}: {figure['tokens_per_second']:.0f} tokens/s{mfu}{beside}")
    if not args.smoke:
        lines.append("issue 15 targets (on one H200" + ("" if "H200" in gpu else f"; measured on {gpu}") + "):")
        for (model, dtype), target in TARGETS.items():
            ours = measured_nanoq(measured, model, dtype)[1]
            lines.append(f"  {MODELS[model][0]} {dtype} >= {target:.0f} tokens/s: "
                         + (f"{ours:.0f} ({'met' if ours >= target else 'not met'})" if ours else "not measured"))
        fp8 = ratios.get("1.5b llmq nanoq fp8/bf16") or ratios.get("1.5b b8 nanoq fp8/bf16")
        lines.append(f"  fp8 >= {TARGET_FP8_OVER_BF16}x bf16 at 1.5B: "
                     + (f"{fp8:.2f}x ({'met' if fp8 >= TARGET_FP8_OVER_BF16 else 'not met'})" if fp8 else "not measured"))
        # Like for like: nanoq's bf16 against torch's bf16 (fp8 has its own target).
        over = {k: v for k, v in ratios.items() if k.endswith("bf16 nanoq/torch")}
        lines.append(f"  >= {TARGET_OVER_TORCH}x PyTorch eager (bf16): "
                     + (", ".join(f"{k.replace(' nanoq/torch', '')} {v:.2f}x "
                                  f"({'met' if v >= TARGET_OVER_TORCH else 'not met'})" for k, v in over.items())
                        if over else "not measured"))
    report = dict(gpu=gpu, seq_len=args.seq, peak_flops=peak, peak_flops_known=known, runs=runs, ratios=ratios,
                  published=[dict(model=m, matmul_dtype=d, **f) for (m, d), f in PUBLISHED.items()],
                  published_source=PUBLISHED_SOURCE, date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    for run in runs:
        run["parameters"] = parameter_count(run["shape"])
        run["flops_per_token"] = flops_per_token(run["shape"], run["seq"])
    return report, "\n".join(lines)


def write_outputs(out_dir: str | None, report: dict, text: str) -> None:
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_gpu.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out_dir, "bench_gpu.txt"), "w") as f:
        f.write(text + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", choices=list(MODELS), default=["0.5b"],
                        help="models, in the order they run (default 0.5b)")
    parser.add_argument("--matmul-dtype", nargs="+", choices=list(MATMUL_DTYPES), default=["bf16"],
                        help="nanoq's matmul dtypes (default bf16); torch runs bf16 once per model and setting")
    parser.add_argument("--settings", nargs="+", choices=["b8", "llmq"], default=["b8"],
                        help="b8: --batch x --grad-accum; llmq: llm.q's B=32 x 16 (default b8)")
    parser.add_argument("--batch", type=int, help="rows per micro-batch of the b8 setting (default 8; smoke 2)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step of the b8 setting (default 1)")
    parser.add_argument("--seq", type=int, help="tokens per row (default 1024; smoke 128)")
    parser.add_argument("--steps", type=int, help="timed optimizer steps at most (default 10; smoke 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 3; smoke 1)")
    parser.add_argument("--llmq-steps", type=int, default=1, help="timed steps at most of the llmq setting (default 1)")
    parser.add_argument("--llmq-warmup", type=int, default=2,
                        help="untimed steps of the llmq setting (default 2: nanoq's second step captures the CUDA "
                             "graphs that run once per step, the update's among them)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and few steps: checks the plumbing")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="optimizer steps per trainer under torch.profiler after the timed ones: where the "
                             "GPU time goes (default 0: none)")
    parser.add_argument("--only", choices=["nanoq", "torch"], help="run one trainer only")
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="directory for bench_gpu.json and bench_gpu.txt (default: $OUT if set)")
    parser.add_argument("--budget", "--worker-timeout", dest="budget", type=float, default=300.0,
                        help="seconds each trainer's process may take, model loading included (default 300)")
    parser.add_argument("--time-limit", type=float, default=0.0,
                        help="seconds for the whole run: configurations not started by then are skipped "
                             "(default: no limit)")
    parser.add_argument("--device-memory", metavar="SIZE",
                        help="GPU memory to fit each trainer into (80GB = 80*10^9 bytes, 80GiB = 80*2^30), instead "
                             "of the GPU's free memory: nanoq's Trainer is held to it (memory_limit), torch too on "
                             "a GPU (set_per_process_memory_fraction). A setting that does not fit runs in smaller "
                             "micro-batches with the same tokens per step, for either trainer")
    parser.add_argument("--no-gpu-check", action="store_true",
                        help="run the trainers even when no GPU is visible (to test the plumbing)")
    parser.add_argument("--backend", choices=["cuda", "cuda_emulated", "cpu"], default="cuda",
                        help="nanoq's backend (default cuda; the others, with torch on the CPU, for plumbing tests)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = dict(batch=2, seq=128, steps=2, warmup=1) if args.smoke else dict(batch=8, seq=1024, steps=10, warmup=3)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("batch", "grad_accum", "seq", "steps", "warmup", "llmq_steps", "llmq_warmup", "profile_steps"):
        floor = 0 if name in ("warmup", "llmq_warmup", "profile_steps") else 1
        if getattr(args, name) < floor:
            parser.error(f"--{name.replace('_', '-')} must be {'>= 0' if floor == 0 else 'positive'}")
    if args.budget < 0 or args.time_limit < 0:
        parser.error("--budget and --time-limit must be >= 0")
    if args.device_memory is not None:
        from nanoq_cli.main import _parse_size  # the CLI's sizes (nanoq memory --device-memory)

        try:
            args.device_memory = _parse_size(args.device_memory)
        except ValueError as e:
            parser.error(f"--device-memory: {e}")
    if args.only == "torch" and args.matmul_dtype != ["bf16"]:
        parser.error("--only torch runs bf16 only")
    if args.smoke:
        args.model = args.model[:1]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)

    gpus = gpu_names()
    gpu = gpus[0] if gpus else "no GPU"
    if not gpus and not args.no_gpu_check:
        message = ("bench_gpu.py needs an NVIDIA GPU, and NVML reports none here (no driver or no device); "
                   "nothing was run. Use --no-gpu-check to run the trainers anyway.")
        print(message, file=sys.stderr)
        write_outputs(args.out, dict(error=message), message)
        return 2

    runs, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as work_dir:
        built = {}
        for run in configurations(args):
            left = args.time_limit - (time.perf_counter() - start) if args.time_limit else None
            if left is not None and run["budget"]:
                run["budget"] = min(run["budget"], left)  # a trainer never runs past the time limit
            if left is not None and left < MIN_BUDGET:
                run["result"] = dict(ok=False, error=f"skipped: the time limit of {args.time_limit:.0f} s was reached")
            else:
                model_dir = os.path.join(work_dir, run["model"])
                if run["model"] not in built:
                    began = time.perf_counter()
                    try:
                        make_model(run["shape"], run["seq"], model_dir)
                        built[run["model"]] = None
                        print(f"--- built and saved the {run['model_name']} in {time.perf_counter() - began:.1f} s",
                              flush=True)
                    except Exception as e:  # noqa: BLE001 - every run of this model fails with it
                        traceback.print_exc()
                        built[run["model"]] = f"building the model failed: {type(e).__name__}: {e}"
                if built[run["model"]]:
                    run["result"] = dict(ok=False, error=built[run["model"]])
                else:
                    run["result"] = run_worker(run, work_dir, model_dir)
            runs.append(run)
            report, text = summarise(args, runs, gpu)
            write_outputs(args.out, report, text)  # after every configuration: a stopped run keeps what it did
    print(text)
    if args.out:
        print(f"wrote {args.out}/bench_gpu.json and bench_gpu.txt")
    return exit_status([run["result"] for run in runs])


def skipped_for_time(result: dict) -> bool:
    return not result["ok"] and result.get("error", "").startswith("skipped: the time limit")


def exit_status(results: list) -> int:
    """0 when everything ran; EXIT_PARTIAL when some ran and the rest was only left out by the
    time limit; 1 when something failed, or nothing ran."""
    if any(not r["ok"] and not skipped_for_time(r) for r in results) or not any(r["ok"] for r in results):
        return 1
    return EXIT_PARTIAL if any(skipped_for_time(r) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
