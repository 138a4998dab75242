"""Out-of-memory errors that explain themselves (provoked with the cpu
backend's memory limit), and the per-device memory summary."""
import os

import numpy as np
import pytest

import nanoq
from conftest import cuda_cases, use_cuda_backend

CONFIG = nanoq.ModelConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4)


def options(**overrides):
    return nanoq.TrainOptions(**dict(dict(backend="cpu", devices=2, batch_size=2, seq_len=64), **overrides))


def test_memory_summary_matches_allocations():
    with nanoq.Trainer(CONFIG, options()) as trainer:
        summary = trainer.memory_summary()
        assert [entry["device"] for entry in summary] == [0, 1]
        for entry in summary:
            segments = trainer.get_allocations(entry["device"])
            expected = {}
            for s in segments:
                expected[s["context"]] = expected.get(s["context"], 0) + s["bytes"]
            assert entry["contexts"] == expected
            assert entry["allocated"] == sum(expected.values())
            # Host memory has no device figure on the cpu backend.
            assert entry["free"] is None and entry["total"] is None and entry["other"] is None
            assert {"weights", "gradients", "adam-m", "adam-v", "activations", "workspace", "stack"} <= set(expected)


def allocated_bytes():
    with nanoq.Trainer(CONFIG, options()) as trainer:
        return trainer.memory_summary()[0]["allocated"]


def last_allocation():
    with nanoq.Trainer(CONFIG, options()) as trainer:
        return trainer.get_allocations(0)[-1]


def test_activations_that_do_not_fit_suggest_smaller_micro_batches():
    with nanoq.Trainer(CONFIG, options()) as trainer:
        segments = trainer.get_allocations(0)
    first = next(i for i, s in enumerate(segments) if s["context"] == "activations")
    before_activations = sum(s["bytes"] for s in segments[:first])
    with pytest.raises(nanoq.OutOfMemoryError, match=r"(?s)\(activations, float32.*suggestion: lower batch_size"):
        nanoq.Trainer(CONFIG, options(memory_limit=before_activations + 1024))


def test_limit_below_need_raises_out_of_memory_naming_tensor_context_and_device():
    need = allocated_bytes()
    with pytest.raises(nanoq.OutOfMemoryError) as error:
        nanoq.Trainer(CONFIG, options(memory_limit=need - 1))
    message = str(error.value)
    assert "out of memory on device" in message
    # The last allocation is the one that no longer fits.
    last = last_allocation()
    assert f"allocating '{last['name']}' ({last['context']}, float32 [" in message
    assert "memory limit of" in message
    for context in ("weights", "gradients", "adam-m", "adam-v", "activations"):
        assert f"\n  {context}: " in message
    assert "suggestion: " in message
    assert isinstance(error.value, nanoq.NanoqError)


def test_weights_that_do_not_fit_suggest_more_devices():
    with pytest.raises(nanoq.OutOfMemoryError, match=r"(?s)'weights' \(weights, float32 \[\d+\].*already "
                                                     r"allocated on this device: nothing.*suggestion: use more devices"):
        nanoq.Trainer(CONFIG, options(memory_limit=1024))


def test_exact_limit_fits_and_trains():
    need = allocated_bytes()
    with nanoq.Trainer(CONFIG, options(memory_limit=need)) as trainer:
        assert trainer.memory_summary()[0]["limit"] == need
        tokens = np.random.default_rng(0).integers(0, 4096, (4, 64), dtype=np.int32)
        trainer.step(tokens, tokens)
        assert np.isfinite(trainer.update(lr=1e-3).loss)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_out_of_memory_leaks_nothing_and_the_process_goes_on():
    need = allocated_bytes()
    # Each failed attempt allocates everything but the stack (~10 MB) first.
    for _ in range(3):
        with pytest.raises(nanoq.OutOfMemoryError):
            nanoq.Trainer(CONFIG, options(memory_limit=need - 1))
    before = rss_bytes()
    for _ in range(30):
        with pytest.raises(nanoq.OutOfMemoryError):
            nanoq.Trainer(CONFIG, options(memory_limit=need - 1))
    assert rss_bytes() - before < need * 3, "failed constructions must free what they allocated"
    assert allocated_bytes() == need


def test_memory_limit_must_be_a_byte_count():
    with pytest.raises(ValueError, match="memory_limit"):
        options(memory_limit=-1)
    with pytest.raises(ValueError, match="memory_limit"):
        options(memory_limit=1.5)


HOST_MEMORY_SCRIPT = r'''
import json, sys
import nanoq
sys.path.insert(0, sys.argv[1])
from test_memory_limit import CONFIG, options

def attempt(**overrides):
    try:
        trainer = nanoq.Trainer(CONFIG, options(**overrides))
    except nanoq.OutOfMemoryError as e:
        return None, str(e)
    return trainer, trainer.memory_summary()[0]["allocated"]

one, one_bytes = attempt(devices=1)          # fits the figure alone
two, refused = attempt(devices=1)            # a second one at once does not: the count is per process
one.close()
again, again_bytes = attempt(devices=1)      # closing the first gave its memory back
again.close()
both, both_refused = attempt(devices=2)      # two devices of one trainer add up too
print(json.dumps(dict(one=one_bytes, refused=refused, again=again_bytes, both_refused=both_refused,
                      both=both is None)))
'''


def run_with_host_memory(available):
    import json
    import subprocess
    import sys

    env = dict(os.environ, NANOQ_CPU_MEMORY_AVAILABLE=str(available))
    result = subprocess.run([sys.executable, "-c", HOST_MEMORY_SCRIPT, os.path.dirname(__file__)], env=env,
                            capture_output=True, text=True, timeout=300)
    return result, (json.loads(result.stdout.splitlines()[-1]) if result.returncode == 0 else None)


def test_cpu_trainers_are_refused_host_memory_the_machine_does_not_have():
    # Linux overcommits: without the cpu backend's own count, allocations that
    # add up past the machine's memory succeed and the kernel's OOM killer ends
    # the process once they are touched. Here the machine "has" room for one
    # one-device trainer and a half.
    with nanoq.Trainer(CONFIG, options(devices=1)) as trainer:
        single = trainer.memory_summary()[0]["allocated"]
    result, seen = run_with_host_memory(single * 3 // 2)
    assert result.returncode == 0, result.stderr
    assert seen["one"] == single and seen["again"] == single
    for message in (seen["refused"], seen["both_refused"]):
        assert "the cpu backend refused: the process's cpu trainers would hold" in message, message
        assert "available (as NANOQ_CPU_MEMORY_AVAILABLE says)" in message, message
        # The devices share the host's memory: more of them is no advice here (a memory_limit's is above).
        assert "use more devices" not in message, message
        if "(activations" not in message and "(stack" not in message:
            assert "suggestion: a smaller model, or fewer cpu devices: they share the machine's memory" in message
    assert seen["both"]


def test_a_bad_host_memory_figure_is_a_clear_error():
    result, _ = run_with_host_memory("lots")
    assert result.returncode == 1
    assert "ValueError: NANOQ_CPU_MEMORY_AVAILABLE must be a number of bytes above 0, not 'lots'" in result.stderr


def test_nanoq_memory_on_cpu_checks_the_fit_against_the_host_memory():
    import subprocess
    import sys

    from nanoq.memory import human_bytes

    def memory(available, *flags):
        env = dict(os.environ, NANOQ_CPU_MEMORY_AVAILABLE=str(available))
        result = subprocess.run([sys.executable, "-c", "from nanoq_cli.main import main; main()", "memory",
                                 "--backend", "cpu", "--threads", "1", *flags], env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stdout

    output = memory(2 << 30, "--devices", "2")
    assert f"fits in {human_bytes(1 << 30)} " in output  # each of the two devices' share
    assert ("(the device memory is this machine's available host memory, 2.00 GiB, shared by the 2 cpu devices: "
            "as NANOQ_CPU_MEMORY_AVAILABLE says)") in output
    output = memory(1 << 20)
    assert "does NOT fit in 1.0 MiB" in output and "suggestion:" in output
    # The devices share the host memory: neither offloading into it nor more devices (smaller shares) helps.
    suggestions = [line for line in output.splitlines() if "suggestion:" in line]
    assert not any("offload" in line.split("nothing fits")[0] or " devices (" in line for line in suggestions), output
    # ... but fewer devices, each with a larger share, may: the suggestion is one that the host check admits.
    output = memory(100 << 20, "--devices", "2", "--sample_every", "0")
    (line,) = [line for line in output.splitlines() if "suggestion:" in line]
    assert "nothing else fits 2 devices; 1 device (" in line and "(each device's share: 100.0 MiB)" in line, output


def test_the_memory_cgroups_of_the_process_bound_the_host_memory(tmp_path):
    from nanoq._core import cgroup_memory_available

    def write(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    # cgroup v2: the process's own group and the one above it, each limit less its usage without the
    # reclaimable page cache (inactive files); the least of them.
    root = tmp_path / "v2"
    write(tmp_path / "self2", "0::/a/b\n")
    write(root / "a" / "b" / "memory.max", "1000\n")
    write(root / "a" / "b" / "memory.current", "600\n")
    write(root / "a" / "b" / "memory.stat", "anon 500\ninactive_file 100\n")
    assert cgroup_memory_available(str(tmp_path / "self2"), str(root)) == 500
    write(root / "a" / "memory.max", "800\n")
    write(root / "a" / "memory.current", "700\n")
    assert cgroup_memory_available(str(tmp_path / "self2"), str(root)) == 100
    write(root / "a" / "memory.max", "max\n")
    write(root / "a" / "b" / "memory.max", "max\n")
    assert cgroup_memory_available(str(tmp_path / "self2"), str(root)) is None
    # cgroup v1 (and a hybrid's empty v2 line): the memory controller's hierarchy, "no limit" as a huge number.
    root = tmp_path / "v1"
    write(tmp_path / "self1", "5:devices:/\n4:memory:/jobs/42\n0::/\n")
    write(root / "memory" / "jobs" / "42" / "memory.limit_in_bytes", "9223372036854771712\n")
    write(root / "memory" / "jobs" / "memory.limit_in_bytes", "2000\n")
    write(root / "memory" / "jobs" / "memory.usage_in_bytes", "500\n")
    write(root / "memory" / "jobs" / "memory.stat", "cache 300\ntotal_inactive_file 200\n")
    assert cgroup_memory_available(str(tmp_path / "self1"), str(root)) == 1700
    assert cgroup_memory_available(str(tmp_path / "missing"), str(root)) is None


def test_a_kv_cache_that_does_not_fit_fails_generate_but_not_the_training():
    # Generation's first call allocates its KV cache; one that did not fit failed a worker, and a
    # trainer in the middle of training refused all further work (its steps since the last
    # checkpoint lost). Now only generate() fails: nothing else was touched, and training goes on.
    from nanoq.testing import arm_hook

    need = allocated_bytes()
    tokens = np.random.default_rng(0).integers(0, 4096, (4, 64), dtype=np.int32)

    def losses(trainer, provoke):
        out = []
        for step in range(3):
            trainer.step(tokens, tokens)
            if step == 1 and provoke:
                before = [trainer.get_allocations(device) for device in (0, 1)]
                with pytest.raises(nanoq.OutOfMemoryError, match=provoke):
                    trainer.generate([1, 2, 3], 4)
                # All or none: what a device allocated before the refusal is freed again.
                assert [trainer.get_allocations(device) for device in (0, 1)] == before
            out.append(trainer.update(lr=1e-3).loss)
        return out

    with nanoq.Trainer(CONFIG, options()) as trainer:
        expected = losses(trainer, None)
    with nanoq.Trainer(CONFIG, options(memory_limit=need)) as trainer:  # no room for the cache on either
        assert losses(trainer, r"allocating 'kv-cache\.") == expected
    with nanoq.Trainer(CONFIG, options()) as trainer:  # device 1 refused after device 0's cache was made
        arm_hook(trainer, "refuse_kv_cache_in_worker", 1)
        assert losses(trainer, "KV cache") == expected
        assert len(trainer.generate([1, 2, 3], 4)) == 4  # and a later call that fits allocates it
        assert {s["context"] for s in trainer.get_allocations(1)} >= {"kv-cache"}


@pytest.mark.parametrize("backend", cuda_cases())
def test_a_refused_kv_cache_leaves_a_cuda_trainer_training_and_generating_later(backend, request):
    # The cuda backend frees a device's part-made cache (device memory) as the cpu backend does.
    from nanoq.testing import arm_hook

    use_cuda_backend(backend, request)
    config = nanoq.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=2)
    tokens = np.random.default_rng(1).integers(0, 256, (4, 32), dtype=np.int32)
    runs = []
    for provoke in (False, True):
        with nanoq.Trainer(config, options(backend=backend, dtype="fp32", seq_len=32, cuda_graphs=False)) as trainer:
            trainer.step(tokens, tokens)
            before = [trainer.get_allocations(device) for device in (0, 1)]  # (after any first-use workspace)
            if provoke:
                arm_hook(trainer, "refuse_kv_cache_in_worker", 1)
                with pytest.raises(nanoq.OutOfMemoryError, match="KV cache"):
                    trainer.generate([1, 2, 3], 4, temperature=0.0)
                assert [trainer.get_allocations(device) for device in (0, 1)] == before
            loss = trainer.update(lr=1e-3).loss
            runs.append((loss, trainer.generate([1, 2, 3], 4, temperature=0.0)))
    assert runs[1] == runs[0]
