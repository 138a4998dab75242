"""GPU telemetry (nanoq.telemetry) and the memory breakdown of the training loop.

NVML is replaced by a small fake ``pynvml`` module with fixed readings, so
these tests run on CPU-only machines; the real pynvml is only used to check
that telemetry stays off where it cannot start.
"""
import json
import sys
import types

import pytest

import nanoq.training.loop as loop
from nanoq.telemetry import GpuTelemetry, decode_throttle_reasons
from nanoq.trainer import Trainer
from nanoq.training import train
from nanoq.training.log import gpu_summary, memory_lines
from test_training import tiny_config

GIB = 2**30

# Two GPUs as the fake NVML reports them; GPU 1 cannot read its power draw.
GPUS = [
    dict(uuid="GPU-aaaa-0000", util=(97, 41), memory=(61 * GIB, 141 * GIB), power_mw=612_345, limit_mw=700_000,
         sm_clock=1980, temperature=71, reasons=0x4 | 0x40),
    dict(uuid="GPU-bbbb-1111", util=(95, 40), memory=(60 * GIB, 141 * GIB), power_mw=None, limit_mw=700_000,
         sm_clock=1755, temperature=65, reasons=0x1),
]

SAMPLE_0 = dict(device=0, gpu_util=97, memory_util=41, memory_used=61 * GIB, memory_total=141 * GIB,
                power_w=612.345, power_limit_w=700.0, sm_clock_mhz=1980, temperature_c=71,
                throttle=["sw_power_cap", "hw_thermal"])
SAMPLE_1 = dict(device=1, gpu_util=95, memory_util=40, memory_used=60 * GIB, memory_total=141 * GIB,
                power_limit_w=700.0, sm_clock_mhz=1755, temperature_c=65, throttle=["idle"])


def fake_pynvml(gpus=GPUS, init_error=None, event_names=True):
    """A module with the parts of pynvml that nanoq.telemetry calls. Handles
    are NVML indices; ``calls`` counts nvmlInit and nvmlShutdown."""
    nvml = types.ModuleType("pynvml")
    nvml.calls = dict(init=0, shutdown=0)

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    nvml.NVMLError, nvml.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
    nvml.NVML_CLOCK_SM, nvml.NVML_TEMPERATURE_GPU = 1, 0
    bits = dict(GpuIdle=0x1, ApplicationsClocksSetting=0x2, SwPowerCap=0x4, HwSlowdown=0x8, SyncBoost=0x10,
                SwThermalSlowdown=0x20, HwThermalSlowdown=0x40, HwPowerBrakeSlowdown=0x80)
    for suffix, bit in bits.items():
        setattr(nvml, ("nvmlClocksEventReason" if event_names else "nvmlClocksThrottleReason") + suffix, bit)

    def init():
        nvml.calls["init"] += 1
        if init_error is not None:
            raise NVMLError(init_error)

    def shutdown():
        nvml.calls["shutdown"] += 1

    def reading(key):
        def query(handle, *args):
            value = gpus[handle][key]
            if value is None:
                raise NVMLError_NotSupported("Not Supported")
            return value
        return query

    nvml.nvmlInit, nvml.nvmlShutdown = init, shutdown
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetUUID = reading("uuid")
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=gpus[handle]["util"][0],
                                                                              memory=gpus[handle]["util"][1])
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=gpus[handle]["memory"][0],
                                                                        total=gpus[handle]["memory"][1])
    nvml.nvmlDeviceGetPowerUsage = reading("power_mw")
    nvml.nvmlDeviceGetEnforcedPowerLimit = reading("limit_mw")
    nvml.nvmlDeviceGetClockInfo = lambda handle, clock: gpus[handle]["sm_clock"] if clock == 1 else 0
    nvml.nvmlDeviceGetTemperature = lambda handle, sensor: gpus[handle]["temperature"] if sensor == 0 else 0
    reasons = reading("reasons")
    if event_names:
        nvml.nvmlDeviceGetCurrentClocksEventReasons = reasons
    else:
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons = reasons
    return nvml


@pytest.fixture
def nvml(monkeypatch):
    fake = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


# -- without NVML ----------------------------------------------------------------------


def test_telemetry_is_off_when_nvml_cannot_start(monkeypatch):
    fake = fake_pynvml(init_error="NVML Shared Library Not Found")
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    telemetry = GpuTelemetry()
    assert not telemetry.available and "NVML Shared Library Not Found" in telemetry.reason
    assert telemetry.sample() == []
    telemetry.close()
    telemetry.close()
    assert fake.calls["shutdown"] == 0  # never started


def test_telemetry_is_off_without_the_pynvml_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with GpuTelemetry() as telemetry:
        assert not telemetry.available and "nvidia-ml-py" in telemetry.reason
        assert telemetry.sample() == []


def test_real_pynvml_without_a_driver_is_off_and_silent(capsys):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML")
    with GpuTelemetry() as telemetry:
        assert not telemetry.available and telemetry.reason.startswith("NVML did not start")
        assert telemetry.sample() == []
    assert capsys.readouterr() == ("", "")


def test_zero_devices_never_touch_nvml(nvml):
    with GpuTelemetry(devices=0) as telemetry:
        assert not telemetry.available and telemetry.reason == ""
        assert telemetry.sample() == []
    assert nvml.calls["init"] == 0


# -- sampling ----------------------------------------------------------------------------


def test_sample_reads_every_metric_and_leaves_out_the_unsupported_one(nvml):
    with GpuTelemetry() as telemetry:
        assert telemetry.available and telemetry.reason == ""
        assert telemetry.sample() == [SAMPLE_0, SAMPLE_1]
    assert nvml.calls == dict(init=1, shutdown=1)


def test_devices_limits_the_gpus_sampled(nvml):
    with GpuTelemetry(devices=1) as telemetry:
        assert telemetry.sample() == [SAMPLE_0]


def test_throttle_reasons_decode_with_either_constant_family():
    for event_names in (True, False):
        nvml = fake_pynvml(event_names=event_names)
        assert decode_throttle_reasons(0x4 | 0x40 | 0x80, nvml) == ["sw_power_cap", "hw_thermal", "power_brake"]
        assert decode_throttle_reasons(0x1 | 0x10, nvml) == ["idle", "sync_boost"]
        assert decode_throttle_reasons(0, nvml) == []
        assert decode_throttle_reasons(0x8 | 0x4000, nvml) == ["hw_slowdown", "0x4000"]  # a bit without a name


def test_old_pynvml_throttle_query_is_used(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(event_names=False))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with GpuTelemetry(devices=1) as telemetry:
        assert telemetry.sample()[0]["throttle"] == ["sw_power_cap", "hw_thermal"]


@pytest.mark.parametrize("visible, expected", [
    ("1", [dict(SAMPLE_1, device=0)]),                      # CUDA device 0 is NVML device 1
    ("1,0", [dict(SAMPLE_1, device=0), dict(SAMPLE_0, device=1)]),
    ("GPU-bbbb", [dict(SAMPLE_1, device=0)]),               # a UUID prefix
    ("0,7,1", [SAMPLE_0]),                                  # the list ends at the first invalid entry
    ("GPU-", []),                                           # ambiguous prefix: no GPU
    ("MIG-abc", []),
])
def test_cuda_visible_devices_picks_and_orders_the_gpus(nvml, monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with GpuTelemetry() as telemetry:
        assert telemetry.sample() == expected
        assert telemetry.available == bool(expected)
        assert telemetry.reason == ("" if expected else "NVML sees none of this process's GPUs")


# -- console lines -------------------------------------------------------------------------


def test_gpu_summary_of_one_and_of_several_gpus():
    assert gpu_summary([]) == ""
    assert gpu_summary([SAMPLE_0]) == "gpu 97% 61.0GiB 612W 71C throttled: hw_thermal, sw_power_cap"
    both_powered = [SAMPLE_0, dict(SAMPLE_1, power_w=580.0)]
    assert gpu_summary(both_powered) == "2 gpus 95-97% 60.0-61.0GiB 1192W 65-71C throttled: hw_thermal, " \
                                        "sw_power_cap"
    # GPU 1 reports no power: the sum is left out; idle is not a throttle.
    assert gpu_summary([SAMPLE_1, dict(SAMPLE_1, device=1)]) == "2 gpus 95% 60.0GiB 65C"


def test_memory_lines_collapse_identical_devices():
    device = dict(device=0, contexts={"weights": 16 * 2**20, "adam-m": 512}, allocated=16 * 2**20 + 512, host=0)
    assert memory_lines([device]) == ["memory device 0: weights 16.0 MiB, adam-m 512 B, total 16.0 MiB"]
    assert memory_lines([device, dict(device, device=1)]) == \
        ["memory per device (x2): weights 16.0 MiB, adam-m 512 B, total 16.0 MiB"]
    other = dict(device, device=1, host=3 * GIB)
    assert memory_lines([device, other]) == [
        "memory device 0: weights 16.0 MiB, adam-m 512 B, total 16.0 MiB",
        "memory device 1: weights 16.0 MiB, adam-m 512 B, total 16.0 MiB, host 3.00 GiB"]


# -- the training loop ------------------------------------------------------------------------


class RecordingTrainer(Trainer):
    """A Trainer that keeps what get_allocations returned per device."""

    seen: dict = {}

    def get_allocations(self, device):
        allocations = super().get_allocations(device)
        RecordingTrainer.seen[device] = allocations
        return allocations


def test_cpu_run_logs_the_memory_breakdown_and_no_telemetry(tmp_path, nvml, monkeypatch):
    monkeypatch.setattr(loop, "Trainer", RecordingTrainer)
    RecordingTrainer.seen = {}
    lines = []
    result = train(tiny_config(tmp_path, devices=2, telemetry_every=1, steps=3, eval_every=0),
                   say=lines.append, progress=False)
    records = [json.loads(line) for line in open(result.log_path)]
    assert "telemetry" not in {record["type"] for record in records}
    assert nvml.calls["init"] == 0  # a cpu run never starts NVML, even where it works
    assert not any("| gpu" in line or "telemetry" in line for line in lines)

    memory = records[0]["memory"]
    assert [entry["device"] for entry in memory] == [0, 1] and set(RecordingTrainer.seen) == {0, 1}
    for entry in memory:
        sums = {}
        for allocation in RecordingTrainer.seen[entry["device"]]:
            sums[allocation["context"]] = sums.get(allocation["context"], 0) + allocation["bytes"]
        assert entry["contexts"] == sums
        assert {"weights", "gradients", "adam-m", "adam-v"} <= set(sums)
        assert entry["allocated"] == sum(sums.values())
    assert memory_lines(memory)[0] in lines
    assert memory_lines(memory)[0].startswith("memory per device (x2): weights ")


def test_telemetry_records_and_console_summary_every_n_steps(tmp_path, nvml, monkeypatch):
    # The loop's wiring, with the sampler built over the fake NVML (a cpu run
    # would otherwise get none): steps 2 and 4 of 5 sample.
    monkeypatch.setattr(loop, "_telemetry", lambda config, trainer: GpuTelemetry(devices=2))
    lines = []
    result = train(tiny_config(tmp_path, telemetry_every=2, steps=5, eval_every=0), say=lines.append,
                   progress=False)
    records = [json.loads(line) for line in open(result.log_path)]
    telemetry = [record for record in records if record["type"] == "telemetry"]
    assert [record["step"] for record in telemetry] == [2, 4]
    assert all(record["gpus"] == [SAMPLE_0, SAMPLE_1] for record in telemetry)
    train_times = {record["step"]: record["time"] for record in records if record["type"] == "train"}
    assert [record["time"] for record in telemetry] == [train_times[2], train_times[4]]
    step_lines = [line for line in lines if line.startswith("step ")]
    assert len(step_lines) == 5
    summary = " | " + gpu_summary([SAMPLE_0, SAMPLE_1])
    assert [line.endswith(summary) for line in step_lines] == [False, True, False, True, False]


def test_cuda_run_telemetry_says_why_it_is_off(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error="Driver Not Loaded"))
    cuda = types.SimpleNamespace(backend="cuda", world_size=2)
    config = types.SimpleNamespace(telemetry_every=10)
    telemetry = loop._telemetry(config, cuda)
    assert not telemetry.available and telemetry.reason == "NVML did not start (Driver Not Loaded)"
    assert loop._telemetry(types.SimpleNamespace(telemetry_every=0), cuda).reason == ""
