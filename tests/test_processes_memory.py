"""The memory plan of several processes: P processes x D devices plan, device
by device, what one process of P*D devices plans, and what the P trainers of
such a world really allocate (ThreadWorld members in threads)."""
import pytest
from click.testing import CliRunner

import nanoq
from nanoq.backends import new_comm_id
from nanoq.memory import estimate_memory
from nanoq.testing.threads import ThreadWorld
from nanoq_cli.main import cli
from test_topology import in_threads

CONFIG = nanoq.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)


def options(devices, **overrides):
    return nanoq.TrainOptions(**dict(dict(backend="cpu", dtype="fp32", devices=devices, batch_size=2, seq_len=8,
                                          threads=1), **overrides))


def rows(allocations):
    return [(a.context, a.name, a.bytes, a.kind) for a in allocations]


@pytest.mark.parametrize("stage,offload", [(1, ""), (2, "optimizer"), (3, "master")])
def test_two_processes_of_two_devices_plan_like_one_process_of_four(stage, offload):
    world = estimate_memory(CONFIG, options(2, zero_stage=stage, offload=offload), processes=2)
    alone = estimate_memory(CONFIG, options(4, zero_stage=stage, offload=offload))
    assert world.processes == 2 and world.world_devices == 4 and len(world.per_device) == 4
    assert [rows(device) for device in world.per_device] == [rows(device) for device in alone.per_device]
    assert world.stack_capacities == alone.stack_capacities
    assert world.device_bytes == alone.device_bytes and world.tokens_per_step == alone.tokens_per_step
    assert "2 processes x 2 devices x batch 2" in world.describe()
    if stage > 1:  # the shards are the world's, not those of one process's two devices
        assert world.device_bytes < estimate_memory(CONFIG, options(2, zero_stage=stage, offload=offload)).device_bytes


@pytest.mark.parametrize("stage", [1, 3])
def test_the_plan_of_two_processes_is_what_their_trainers_allocate(stage):
    world = ThreadWorld(2)

    def member(rank):
        with nanoq.Trainer(CONFIG, options(2, zero_stage=stage), processes=world.member(rank)) as trainer:
            return [([(a["context"], a["name"], a["bytes"], a["kind"]) for a in trainer.get_allocations(device)],
                     trainer.get_stack_info(device)["capacity"]) for device in range(2)]

    (first, second), errors = in_threads([lambda: member(0), lambda: member(1)])
    assert errors == [None, None]
    plan = estimate_memory(CONFIG, options(2, zero_stage=stage), processes=2)
    assert [(rows(device), capacity) for device, capacity in zip(plan.per_device, plan.stack_capacities)] == \
        first + second


def test_under_a_launcher_the_plan_is_of_the_launchers_processes(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "3")
    estimate = estimate_memory(CONFIG, options(2))
    assert estimate.processes == 3 and len(estimate.per_device) == 6
    assert estimate_memory(CONFIG, options(2), processes=1).processes == 1


def test_bad_process_counts_are_clear_errors():
    with pytest.raises(ValueError, match="processes must be a positive integer, got 0"):
        estimate_memory(CONFIG, options(2), processes=0)
    sliced = options(2, world_size=4, first_rank=2, comm_id=new_comm_id("cpu"))
    with pytest.raises(ValueError, match=r"processes \(2\) and options.world_size \(4\) both place"):
        estimate_memory(CONFIG, sliced, processes=2)


def test_nanoq_memory_takes_the_number_of_processes(monkeypatch):
    # The cpu figure is the host's available memory: one figure for both runs (it moves on a busy machine).
    monkeypatch.setenv("NANOQ_CPU_MEMORY_AVAILABLE", str(5 << 30))
    flags = ["--hidden_size", "32", "--intermediate_size", "48", "--num_hidden_layers", "2",
             "--num_attention_heads", "4", "--num_key_value_heads", "2", "--vocab_size", "96", "--backend", "cpu",
             "--seq_len", "8", "--batch_size", "2", "--threads", "1", "--zero_stage", "3",
             "--sample_every", "0"]  # (a run of several processes writes no samples: no KV cache either way)
    world = CliRunner().invoke(cli, ["memory", *flags, "--devices", "2", "--processes", "2"], catch_exceptions=False)
    alone = CliRunner().invoke(cli, ["memory", *flags, "--devices", "4"], catch_exceptions=False)
    assert world.exit_code == 0 and alone.exit_code == 0, world.output + alone.output
    assert "2 processes x 2 devices x batch 2" in world.output and "4 devices x batch 2" in alone.output
    assert world.output.splitlines()[1:] == alone.output.splitlines()[1:]  # the same table per device
    bad = CliRunner().invoke(cli, ["memory", *flags, "--processes", "0"])
    assert bad.exit_code == 2 and "--processes" in bad.output
    # Under mpiexec -n 2 each process estimates the launcher's world; the first one alone prints it
    # (the table came twice). (The launcher's variables as MPICH's mpiexec sets them.)
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("PMI_RANK", rank)
        monkeypatch.setenv("PMI_SIZE", "2")
        launched = CliRunner().invoke(cli, ["memory", *flags, "--devices", "2"], catch_exceptions=False)
        assert launched.exit_code == 0, launched.output
        assert (launched.output.splitlines()[1:] == alone.output.splitlines()[1:]) if printed else \
            launched.output == "", launched.output
