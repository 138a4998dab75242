"""nanoq's cuda backend against PyTorch + transformers on one GPU, in one run.

The model is Qwen2.5-0.5B-shaped with random weights: hidden 896, 24 layers,
14 query heads and 2 kv heads of head_dim 64, intermediate 4864, vocab 151936,
tied embeddings, q/k/v biases, rope theta 1e6. The parent process builds it
once (transformers, on the CPU) and saves it in bf16; each trainer then runs
in its own fresh subprocess (so GPU memory is its own) from those weights, on
the same random token batches, for the same full optimizer steps (forward,
backward, clipping to norm 1.0, AdamW with lr 3e-4, betas (0.9, 0.95),
weight decay 0.1 on matrices only):

- nanoq: backend "cuda", dtype "bf16" (weights, activations), master_dtype
  and optimizer_dtype "fp32".
- torch: the model in fp32 (the master weights) under
  ``torch.autocast("cuda", torch.bfloat16)``, ``attn_implementation="sdpa"``,
  cross-entropy on fp32 logits, ``torch.optim.AdamW(fused=True)`` when
  available, eager mode (no torch.compile).

Reported per trainer: tokens/s over the timed steps (after warm-up steps; each
step ends with its loss on the host, so the clock sees finished work), GPU
memory, the losses, and MFU. Memory: nanoq's ``get_allocations`` total (it
takes everything up front), torch's ``max_memory_allocated``, and for both the
rise in the device's used memory (NVML) from before the trainer started to
after the last step, CUDA context and library workspaces included: the
like-for-like figure.

MFU = tokens/s * flops_per_token / 989e12 (the H100/H200 SXM dense bf16 peak),
with the PaLM formula flops_per_token = 6 * N + 12 * L * H * Q * T: N counts
all parameters, the tied embedding once (as the LM-head matmul; the lookup
itself is free), L layers, H query heads, Q head_dim, T seq_len. The
attention term counts the full T x T score matrix although causal attention
needs half of it, as PaLM does.

    python bench/bench_gpu.py [--batch 8 --seq 1024 --steps 10 --warmup 3] [--out DIR]
    python bench/bench_gpu.py --smoke     # a tiny model for 2 steps: checks the plumbing

With ``--out`` (default: $OUT when set) it writes bench_gpu.json and
bench_gpu.txt there. A trainer that fails (exception, crash, hang past
``--worker-timeout``) is recorded as failed and the other still runs; the
exit status is 1 when either failed, 2 when no GPU is visible.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16, datasheet

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, head_dim=64, rope_theta=1e6,
                  tie_word_embeddings=True)
SMOKE = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
             tie_word_embeddings=True)


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
    """PaLM: 6 N + 12 L H Q T (see the module docstring)."""
    attention = 12 * shape["num_hidden_layers"] * shape["num_attention_heads"] * shape["head_dim"] * seq_len
    return 6 * parameter_count(shape) + attention


# --------------------------------------------------------------------------
# Shared by both workers
# --------------------------------------------------------------------------


def batches(args) -> list:
    """The same random (inputs, targets) int32 batches for both trainers."""
    import numpy as np

    out = []
    for step in range(args.warmup + args.steps):
        rng = np.random.default_rng(1000 + step)
        tokens = rng.integers(0, args.shape["vocab_size"], (args.batch, args.seq + 1), dtype=np.int32)
        out.append((np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])))
    return out


def gpu_used_bytes() -> int | None:
    """Used memory of GPU 0 as NVML reports it (all processes), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML means no figure, not a failure
        return None
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    finally:
        pynvml.nvmlShutdown()


def gpu_names() -> list[str]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return []
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else name)
        return names
    finally:
        pynvml.nvmlShutdown()


def timed_loop(args, train_step) -> dict:
    """Runs warm-up + timed steps; train_step(inputs, targets) -> loss (a float on the host)."""
    data = batches(args)
    losses, start = [], None
    for step, (inputs, targets) in enumerate(data):
        if step == args.warmup:
            start = time.perf_counter()
        losses.append(train_step(inputs, targets))
        print(f"step {step}{' (warm-up)' if step < args.warmup else ''}: loss {losses[-1]:.4f}", flush=True)
    return dict(seconds=time.perf_counter() - start, losses=losses)


# --------------------------------------------------------------------------
# Workers (each in its own process)
# --------------------------------------------------------------------------


def run_nanoq(args) -> dict:
    import nanoq

    used_before = gpu_used_bytes()
    config = nanoq.ModelConfig.from_pretrained(args.model_dir)
    options = nanoq.TrainOptions(backend="cuda", dtype="bf16", master_dtype="fp32", optimizer_dtype="fp32",
                                 batch_size=args.batch, seq_len=args.seq)
    with nanoq.Trainer(config, options) as trainer:
        trainer.import_weights(args.model_dir)

        def train_step(inputs, targets):
            trainer.step(inputs, targets)
            return trainer.update(lr=3e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, grad_clip=1.0).loss

        result = timed_loop(args, train_step)
        used_after = gpu_used_bytes()
        by_context = {}
        for a in trainer.get_allocations(0):
            if a["kind"] == "device":
                by_context[a["context"]] = by_context.get(a["context"], 0) + a["bytes"]
    result.update(allocations_by_context=by_context, peak_bytes=sum(by_context.values()),
                  device_used_rise_bytes=None if used_before is None else used_after - used_before)
    return result


def run_torch(args) -> dict:
    import torch
    from transformers import Qwen2ForCausalLM

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    used_before = gpu_used_bytes()
    device = torch.device("cuda", 0)
    model = Qwen2ForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                             attn_implementation="sdpa").to(device)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        optimizer = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
        fused = True
    except (TypeError, RuntimeError):
        optimizer = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
        fused = False
    torch.cuda.reset_peak_memory_stats(device)

    def train_step(inputs, targets):
        inputs, targets = (torch.from_numpy(a).to(device, dtype=torch.long) for a in (inputs, targets))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    result = timed_loop(args, train_step)
    torch.cuda.synchronize(device)
    used_after = gpu_used_bytes()
    result.update(peak_bytes=int(torch.cuda.max_memory_allocated(device)),
                  peak_reserved_bytes=int(torch.cuda.max_memory_reserved(device)), fused_adamw=fused,
                  torch_version=torch.__version__,
                  device_used_rise_bytes=None if used_before is None else used_after - used_before)
    return result


def worker_main(args) -> int:
    """Runs one trainer; writes its result (or its error) to args.result."""
    try:
        result = run_nanoq(args) if args.worker == "nanoq" else run_torch(args)
        status = 0
    except BaseException as e:  # noqa: BLE001 - recorded, then reported as a failure
        traceback.print_exc()
        result = dict(error=f"{type(e).__name__}: {e}")
        status = 1
    with open(args.result, "w") as f:
        json.dump(result, f)
    return status


# --------------------------------------------------------------------------
# Parent: model, workers, report
# --------------------------------------------------------------------------


def make_model(shape: dict, seq: int, model_dir: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                         intermediate_size=shape["intermediate_size"],
                         num_hidden_layers=shape["num_hidden_layers"],
                         num_attention_heads=shape["num_attention_heads"],
                         num_key_value_heads=shape["num_key_value_heads"], rope_theta=shape["rope_theta"],
                         tie_word_embeddings=shape["tie_word_embeddings"], max_position_embeddings=max(seq, 32768),
                         rms_norm_eps=1e-6, use_sliding_window=False)
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", None)}
    if rope.get("rope_theta") != shape["rope_theta"]:
        raise RuntimeError(f"transformers did not take rope_theta {shape['rope_theta']}: {rope}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim != shape["head_dim"]:
        raise RuntimeError(f"head_dim {head_dim} != {shape['head_dim']}")
    model = Qwen2ForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())  # tied weights appear once
    if count != parameter_count(shape):
        raise RuntimeError(f"the model has {count} parameters, parameter_count() says {parameter_count(shape)}")
    model.to(torch.bfloat16).save_pretrained(model_dir)


def run_worker(name: str, args, model_dir: str, result_path: str) -> dict:
    command = [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--worker", name,
               "--model-dir", model_dir, "--result", result_path] + args.passthrough
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    print(f"--- {name}: {' '.join(command[3:])}", flush=True)
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env)
    try:
        returncode = process.wait(timeout=args.worker_timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return dict(ok=False, error=f"timed out after {args.worker_timeout} s (killed)")
    result = {}
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
    wall = time.perf_counter() - start
    if returncode != 0 or "error" in result:
        how = f"exit status {returncode}" if returncode >= 0 else f"killed by signal {-returncode}"
        error = result.get("error", "no result written (crashed?); see the log above")
        return dict(ok=False, error=f"{error} [{how}]", wall_seconds=wall)
    return dict(result, ok=True, wall_seconds=wall)


def summarise(args, results: dict, gpu: str) -> tuple[dict, str]:
    shape, tokens_per_step = args.shape, args.batch * args.seq
    flops = flops_per_token(shape, args.seq)
    lines = [f"{args.model_name}: {parameter_count(shape) / 1e6:.1f}M parameters (tied embedding counted once), "
             f"B={args.batch}, T={args.seq}, bf16, {args.steps} timed steps after {args.warmup} warm-up, on {gpu}",
             f"MFU = tokens/s * {flops / 1e9:.3f} GFLOP/token (6N + 12*L*H*Q*T) / {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s"]
    gib = 2.0 ** 30
    for name, r in results.items():
        if not r["ok"]:
            lines.append(f"{name:>6}: FAILED: {r['error']}")
            continue
        r["tokens_per_second"] = args.steps * tokens_per_step / r["seconds"]
        r["mfu"] = r["tokens_per_second"] * flops / PEAK_BF16_FLOPS
        memory = f"peak {'allocations' if name == 'nanoq' else 'allocated'} {r['peak_bytes'] / gib:.2f} GiB"
        if r.get("device_used_rise_bytes") is not None:
            memory += f", device used +{r['device_used_rise_bytes'] / gib:.2f} GiB"
        lines.append(f"{name:>6}: {r['tokens_per_second']:9.0f} tokens/s  MFU {100 * r['mfu']:5.1f}%  {memory}  "
                     f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    ratios = {}
    nanoq, torch = results.get("nanoq", {}), results.get("torch", {})
    if nanoq.get("ok") and torch.get("ok"):
        ratios["speed"] = nanoq["tokens_per_second"] / torch["tokens_per_second"]
        ratios["peak_memory"] = nanoq["peak_bytes"] / torch["peak_bytes"]
        if nanoq.get("device_used_rise_bytes") and torch.get("device_used_rise_bytes"):
            ratios["device_used"] = nanoq["device_used_rise_bytes"] / torch["device_used_rise_bytes"]
        ratios["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(nanoq["losses"], torch["losses"]))
        lines.append("nanoq/torch: speed {speed:.2f}x, peak memory {peak_memory:.2f}x".format(**ratios)
                     + (f", device used {ratios['device_used']:.2f}x" if "device_used" in ratios else "")
                     + f"; losses agree to {ratios['max_loss_rel_diff']:.1e} (relative)")
    report = dict(model=args.model_name, shape=shape, parameters=parameter_count(shape), batch=args.batch,
                  seq_len=args.seq, steps=args.steps, warmup=args.warmup, gpu=gpu, flops_per_token=flops,
                  peak_flops=PEAK_BF16_FLOPS, results=results, ratios=ratios,
                  date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    return report, "\n".join(lines)


def write_outputs(out_dir: str | None, report: dict, text: str) -> None:
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_gpu.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out_dir, "bench_gpu.txt"), "w") as f:
        f.write(text + "\n")
    print(f"wrote {out_dir}/bench_gpu.json and bench_gpu.txt")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, help="rows per step (default 8; smoke 2)")
    parser.add_argument("--seq", type=int, help="tokens per row (default 1024; smoke 128)")
    parser.add_argument("--steps", type=int, help="timed optimizer steps (default 10; smoke 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 3; smoke 1)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and few steps: checks the plumbing")
    parser.add_argument("--only", choices=["nanoq", "torch"], help="run one trainer only")
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="directory for bench_gpu.json and bench_gpu.txt (default: $OUT if set)")
    parser.add_argument("--worker-timeout", type=float, default=300.0,
                        help="seconds each trainer's process may take, model loading included (default 300)")
    parser.add_argument("--no-gpu-check", action="store_true",
                        help="run the trainers even when no GPU is visible (to test the failure reporting)")
    parser.add_argument("--worker", choices=["nanoq", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = dict(batch=2, seq=128, steps=2, warmup=1) if args.smoke else dict(batch=8, seq=1024, steps=10, warmup=3)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name} must be {'>= 0' if name == 'warmup' else 'positive'}")
    args.shape = SMOKE if args.smoke else QWEN25_05B
    args.model_name = "smoke model" if args.smoke else "Qwen2.5-0.5B-shaped"
    # What the workers need to rebuild the same run.
    args.passthrough = [f"--batch={args.batch}", f"--seq={args.seq}", f"--steps={args.steps}",
                        f"--warmup={args.warmup}"] + (["--smoke"] if args.smoke else [])
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

    names = [args.only] if args.only else ["nanoq", "torch"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as work_dir:
        model_dir = os.path.join(work_dir, "model")
        start = time.perf_counter()
        make_model(args.shape, args.seq, model_dir)
        print(f"--- built and saved the {args.model_name} in {time.perf_counter() - start:.1f} s", flush=True)
        for name in names:
            results[name] = run_worker(name, args, model_dir, os.path.join(work_dir, f"{name}.json"))
    report, text = summarise(args, results, gpu)
    print(text)
    write_outputs(args.out, report, text)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
