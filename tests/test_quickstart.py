"""The README's first command, `nanoq train` with no settings on the bundled
demo corpus, on the cuda backend: what a user with a GPU runs first. On a
GPU it runs as the Quickstart has it (every default; the backend "auto"
takes the GPU) and must learn; under the CUDA emulator (every machine) the
same path runs with a tiny model for a few steps."""
import json
import math
import os
import re

import pytest
from click.testing import CliRunner

from conftest import use_cuda_backend
from nanoq_cli.main import cli

TINY = ["--hidden_size", "32", "--intermediate_size", "64", "--num_hidden_layers", "1", "--num_attention_heads", "2",
        "--seq_len", "32", "--batch_size", "2", "--steps", "3", "--warmup_steps", "0", "--eval_batches", "1",
        "--backend", "cuda_emulated"]


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=pytest.mark.gpu),
                                     pytest.param("cuda_emulated", marks=pytest.mark.cuda_emulated)])
def test_nanoq_train_on_the_demo_runs_on_the_cuda_backend(tmp_path, backend, request):
    use_cuda_backend(backend, request)
    args = ["--out_dir", tmp_path] + (TINY if backend == "cuda_emulated" else [])
    result = CliRunner().invoke(cli, ["train", *map(str, args)], catch_exceptions=False)
    print(result.output)  # the run's own report (attention engine, tokens/s), kept in the GPU check's log
    assert result.exit_code == 0, result.output
    assert re.search(rf"\) on {backend} x1 \(bf16\); \d+ steps", result.output), result.output
    (run,) = os.listdir(tmp_path)
    records = [json.loads(line) for line in open(tmp_path / run / "log.jsonl")]
    train = [r["loss"] for r in records if r["type"] == "train"]
    evals = [r["loss"] for r in records if r["type"] == "eval"]
    steps = 3 if backend == "cuda_emulated" else 240
    assert len(train) == steps and all(math.isfinite(loss) for loss in train + evals), records
    assert "model.safetensors" in os.listdir(tmp_path / run / "model")
    if backend == "cuda":
        # 240 steps of the demo: from ln(4096) = 8.3 the held-out loss falls by nats, not noise.
        assert evals[-1] < evals[0] - 2.0, evals
