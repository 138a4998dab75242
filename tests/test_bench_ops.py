"""The op benchmark's plumbing (bench/bench_ops.py) and the op harness's timing call.

No timed assertions: the smoke runs check that every case of the table runs
on nanoq and on PyTorch and lands in the report, not how fast.
"""

import importlib.util
import json
import pathlib

import numpy as np
import pytest

from conftest import require_cuda_emulator
from nanoq.testing import OpRunner, op_table

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_bench_ops():
    spec = importlib.util.spec_from_file_location("bench_ops", ROOT / "bench" / "bench_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_ops():
    return load_bench_ops()


class FakeCudaTorch:
    """Enough of torch's CUDA API for time_torch, on a clock of its own: a
    graph replay costs `replay` seconds of GPU time, an eager call `eager`
    of host time (its GPU work then waits on the host)."""

    def __init__(self, capturable=True, replay=1e-5, eager=5e-5):
        import contextlib
        import types

        self.calls, self.clock, self.capturing = [], 0.0, False
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = fake.clock

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return 1e3 * (other.at - self.at)

        class CUDAGraph:
            def replay(self):
                fake.calls.append("replay")
                fake.clock += replay

        @contextlib.contextmanager
        def graph(g):
            fake.capturing = True
            try:
                yield
            finally:
                fake.capturing = False

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_stream(self, other):
                pass

        self.cuda = types.SimpleNamespace(
            Event=Event, CUDAGraph=CUDAGraph, graph=graph, Stream=Stream, synchronize=lambda device=None: None,
            current_stream=lambda device=None: Stream(), stream=lambda s: contextlib.nullcontext())
        self.capturable, self.eager = capturable, eager

    def fn(self):
        if self.capturing and not self.capturable:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.calls.append("capture" if self.capturing else "eager")
        if not self.capturing:
            self.clock += self.eager


def test_torch_is_timed_from_a_cuda_graph_or_marked_when_it_cannot_be(bench_ops, monkeypatch):
    import sys
    import time
    import types

    device = types.SimpleNamespace(type="cuda")
    fake = FakeCudaTorch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    seconds, how = bench_ops.time_torch(fake.fn, 20, device)
    # Captured once after the warm-ups, then only replays are timed: the graph's time, not the calls'.
    assert how == "graph" and seconds == pytest.approx(1e-5)
    assert fake.calls == ["eager", "eager", "capture"] + ["replay"] * 21
    # Not capturable: timed eagerly; a GPU time that is all the host's issuing is marked host-bound.
    fake = FakeCudaTorch(capturable=False)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(time, "perf_counter", lambda: fake.clock)
    seconds, how = bench_ops.time_torch(fake.fn, 20, device)
    assert how == "eager, host-bound" and seconds == pytest.approx(5e-5)
    assert fake.calls == ["eager", "eager"] + ["eager"] * 20
    row = dict(case="rmsnorm_forward", variant="backend", ok=True, nanoq_seconds=1e-5, nanoq_rate="1 GB/s",
               torch_seconds=seconds, torch_rate="1 GB/s", ratio=5.0, torch_timing=how)
    assert bench_ops.format_row(row).endswith("(torch eager, host-bound)")
    assert "(torch" not in bench_ops.format_row(dict(row, torch_timing="graph"))


def test_every_op_of_the_table_has_a_case(bench_ops):
    assert {op for op, _ in bench_ops.CASES.values()} == set(op_table())


def smoke_report(bench_ops, tmp_path, backend):
    assert bench_ops.main(["--smoke", "--backend", backend, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_ops.json").read_text())
    text = (tmp_path / "bench_ops.txt").read_text()
    cases = {row["case"] for row in report["rows"]}
    assert cases == set(bench_ops.CASES)
    for row in report["rows"]:
        assert row["ok"], row
        assert row["nanoq_seconds"] > 0 and row["torch_seconds"] > 0, row
        assert row["ratio"] == pytest.approx(row["torch_seconds"] / row["nanoq_seconds"])
        assert row["torch_timing"] == "host", row  # no GPU here: torch on the CPU
    # Every composite is also timed as its default composition.
    composites = {row["case"] for row in report["rows"] if row["variant"] == "default composition"}
    assert {"classifier", "qkv_forward", "residual_rmsnorm_forward", "swiglu_gate_up_backward"} <= composites
    assert "matmul" not in composites
    assert len(text.splitlines()) == 3 + len(report["rows"]) + 1
    assert text.splitlines()[-1] == f"{len(report['rows'])} of {len(report['rows'])} timings ran"
    return report


ATTENTION_CASES = {"attention_forward", "attention_backward", "attention_forward-documents",
                   "attention_backward-documents"}


def test_smoke_on_the_cpu_backend_times_every_case(bench_ops, tmp_path):
    report = smoke_report(bench_ops, tmp_path, "cpu")
    assert report["dtype"] == "fp32" and report["torch_device"] == "cpu"
    assert not [row for row in report["rows"] if row["variant"] == "native"]  # the cpu has no fused attention


@pytest.mark.cuda_emulated
def test_smoke_on_the_emulated_cuda_backend_times_every_case(bench_ops, tmp_path):
    require_cuda_emulator()
    report = smoke_report(bench_ops, tmp_path, "cuda_emulated")
    assert report["dtype"] == "bf16"
    # Attention runs in the fused library (the stand-in here, cuDNN on a GPU) and again natively.
    assert {row["case"] for row in report["rows"] if row["variant"] == "native"} == ATTENTION_CASES
    # The backward also in the library's other algorithm (dq accumulated with atomics).
    nondeterministic = [row for row in report["rows"] if row["variant"] == "nondeterministic"]
    assert {row["case"] for row in nondeterministic} == {"attention_backward", "attention_backward-documents"}
    assert all(row["ok"] for row in nondeterministic), nondeterministic


def test_document_cases_count_the_pairs_of_each_document(bench_ops):
    """The -documents cases pack DOCUMENT_LENGTHS into each row (rows start
    at different documents) and count 4*H*D FLOPs per query-key pair that a
    document's causal mask keeps (the forward; the backward 2.5 times that)."""
    import numpy as np

    B, T = 6, 60
    dims = dict(bench_ops.SMOKE, batch=B, time=T)
    positions = bench_ops.document_positions(dims)
    assert positions.shape == (B, T) and len({row.tobytes() for row in positions}) > 2
    starts = np.arange(T)[None, :] - positions
    assert (positions[:, 0] == 0).all() and (starts >= 0).all()
    keys = np.arange(T)
    pairs = sum(int(((keys <= t) & (keys >= starts[b, t])).sum()) for b in range(B) for t in range(T))
    inputs = bench_ops.Inputs(dims, "fp32", "cpu")
    case = bench_ops.CASES["attention_forward-documents"][1](inputs, dims)
    assert case["flops"] == 4.0 * dims["heads"] * dims["head_dim"] * pairs
    mask = bench_ops._document_mask(inputs, positions).numpy()
    assert mask.shape == (B, 1, T, T) and int(mask.sum()) == pairs


def test_cuda_without_a_gpu_exits_2_and_says_why(bench_ops, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_ops.main(["--out", str(tmp_path)]) == 2
    assert "needs an NVIDIA GPU" in json.loads((tmp_path / "bench_ops.json").read_text())["error"]


def test_cases_past_the_time_limit_are_recorded_as_skipped(bench_ops, tmp_path):
    # The limit is checked before each case: one over at once skips them all.
    assert bench_ops.main(["--smoke", "--backend", "cpu", "--ops", "add,fill", "--time-limit", "1e-9",
                           "--out", str(tmp_path)]) == 1  # nothing ran: not even a partial run
    rows = json.loads((tmp_path / "bench_ops.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["fill", "add"]
    for row in rows:
        assert not row["ok"] and row["error"] == "skipped: the time limit (1e-09 s) was reached"


def test_bad_arguments_are_refused(bench_ops, capsys):
    with pytest.raises(SystemExit):
        bench_ops.parse_args(["--ops", "matmul,nope"])
    assert "unknown case or op: nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_ops.parse_args(["--backend", "cpu", "--dtype", "bf16"])
    with pytest.raises(SystemExit):
        bench_ops.parse_args(["--repeats", "0"])
    # An op name selects all of its cases.
    assert bench_ops.parse_args(["--ops", "matmul"]).cases == [c for c in bench_ops.CASES if c.startswith("matmul-")]


def test_op_runner_time_returns_the_mean_seconds_of_one_run():
    cpu = OpRunner("cpu")
    a = np.ones((32, 32), np.float32)
    seconds = cpu.time("matmul", a, a, repeats=3)
    assert isinstance(seconds, float) and seconds > 0
    # The arguments are checked as for run().
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        cpu.time("nope", a)
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        cpu.time("matmul", a, a, repeats=0)
    with pytest.raises(TypeError, match="missing a required argument: 'b'"):
        cpu.time("matmul", a)
    with pytest.raises(ValueError, match=r"add: b has shape"):
        cpu.time("add", a, a.T[:, :3])


def test_run_after_time_is_unchanged():
    """time() shares run()'s staging: a run after timing (and the op's own
    upload, adamw's scale) still gives the float64 AdamW step."""
    cpu = OpRunner("cpu")
    rng = np.random.default_rng(0)
    p, g = rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    m, v = np.zeros(64, np.float32), np.zeros(64, np.float32)
    cpu.time("adamw", p, g, m, v, lr=0.1, scale=0.5, repeats=2)
    p1, m1, v1 = cpu.adamw(p, g, m, v, lr=0.1, scale=0.5)
    g64 = g.astype(np.float64) * 0.5
    m_hat, v_hat = 0.1 * g64 / (1 - 0.9), 0.001 * g64 ** 2 / (1 - 0.999)
    np.testing.assert_allclose(p1, p - 0.1 * m_hat / (np.sqrt(v_hat) + 1e-8), rtol=1e-5, atol=1e-6)
