"""nanoq's CPU backend against PyTorch eager on the same tiny Llama, in one run.

Each trainer runs in its own fresh subprocess (so peak memory is its own),
on the same weights, batch and thread count, for the same number of full
optimizer steps (forward, backward, clipping, AdamW). Prints tokens/s and the
peak resident memory growth of each, and the ratios.

With ``--lora-rank R``, both fine-tune LoRA adapters (alpha 2R, on
``--lora-targets``) on the frozen model instead: nanoq's core adapters
against peft on the same transformers model.

    python bench/bench_cpu_vs_torch.py [--layers 4 --dim 256 --vocab 8192 --batch 8 --seq 256 --steps 5]
    python bench/bench_cpu_vs_torch.py --lora-rank 16 --lora-targets q,k,v,o
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def batch(args, step):
    import numpy as np

    rng = np.random.default_rng(1000 + step)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq + 1), dtype=np.int32)
    return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])


def run_nanoq(args) -> dict:
    import nanoq

    baseline = rss_bytes()
    config = nanoq.ModelConfig.from_pretrained(args.model_dir)
    from nanoq.lora import LoraConfig

    lora = LoraConfig(rank=args.lora_rank, alpha=2 * args.lora_rank, targets=args.lora_targets) \
        if args.lora_rank else None
    options = nanoq.TrainOptions(backend="cpu", devices=1, batch_size=args.batch, seq_len=args.seq,
                                 threads=args.threads, lora=lora)
    with nanoq.Trainer(config, options) as trainer:
        trainer.import_weights(args.model_dir)
        losses, start = [], None
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                start = time.perf_counter()
            trainer.step(*batch(args, step))
            losses.append(trainer.update(lr=1e-3, weight_decay=0.1, grad_clip=1.0).loss)
        elapsed = time.perf_counter() - start
    return dict(seconds=elapsed, losses=losses, peak=peak_rss_bytes() - baseline)


def run_torch(args) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    baseline = rss_bytes()
    model = LlamaForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    if args.lora_rank:
        import peft

        from nanoq.lora import PEFT_NAMES, parse_targets

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
            target_modules=[PEFT_NAMES[t] for t in parse_targets(args.lora_targets)]))
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    losses, start = [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start = time.perf_counter()
        inputs, targets = (torch.from_numpy(a).long() for a in batch(args, step))
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    elapsed = time.perf_counter() - start
    return dict(seconds=elapsed, losses=losses, peak=peak_rss_bytes() - baseline)


def make_model(args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(args.model_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--lora-rank", type=int, default=0, help="fine-tune LoRA adapters of this rank (0: all weights)")
    parser.add_argument("--lora-targets", default="q,k,v,o")
    parser.add_argument("--worker", choices=["nanoq", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = run_nanoq(args) if args.worker == "nanoq" else run_torch(args)
        print(json.dumps(result))
        return

    with tempfile.TemporaryDirectory() as model_dir:
        args.model_dir = model_dir
        make_model(args)
        results = {}
        for worker in ("nanoq", "torch"):
            command = [sys.executable, __file__, "--worker", worker, "--model-dir", model_dir] + sys.argv[1:]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results[worker] = json.loads(out.strip().splitlines()[-1])

    tokens = args.steps * args.batch * args.seq
    what = f"LoRA rank {args.lora_rank} on {args.lora_targets} (nanoq core vs peft)" if args.lora_rank \
        else "full training"
    print(f"tiny Llama: {args.layers} layers, dim {args.dim}, ffn {args.ffn}, vocab {args.vocab}, "
          f"B={args.batch}, T={args.seq}, {args.threads} threads, {args.steps} timed steps; {what}")
    for name, r in results.items():
        print(f"{name:>6}: {tokens / r['seconds']:8.0f} tokens/s   peak memory +{r['peak'] / 2**20:7.1f} MiB   "
              f"losses {', '.join(f'{x:.4f}' for x in r['losses'])}")
    n, t = results["nanoq"], results["torch"]
    print(f"ratio nanoq/torch: speed {t['seconds'] / n['seconds']:.2f}x, peak memory {n['peak'] / t['peak']:.2f}x")


if __name__ == "__main__":
    main()
