"""GPU telemetry through NVML (the ``nvidia-ml-py`` package, module ``pynvml``).

``GpuTelemetry(devices).sample()`` reads, for each GPU the trainer uses, what
``nvidia-smi`` would show: utilisation, memory, power, SM clock, temperature
and the reasons the clocks are held down. Telemetry is an observer: without
NVML (package missing, no driver, no GPU) it is off and says why, and a metric
that NVML cannot read on a GPU is left out of that GPU's sample. Nothing here
raises into the training loop.

Which GPUs: CUDA device ``d`` of the trainer is matched to its NVML device
through ``CUDA_VISIBLE_DEVICES`` (indices or ``GPU-`` UUID prefixes). Without
that variable, CUDA device ``d`` is taken to be NVML device ``d``; that holds
when CUDA enumerates in PCI bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, or a
machine of identical GPUs). MIG instances are not matched: their telemetry is off.
"""
from __future__ import annotations

import os
from typing import List, Optional

# Short names of the clock event ("throttle") reason bits, and the suffix of
# their pynvml constants: nvmlClocksEventReason<suffix> in new pynvml,
# nvmlClocksThrottleReason<suffix> in old (and for the bits only it has).
THROTTLE_REASONS = (
    ("idle", "GpuIdle"),
    ("app_clocks", "ApplicationsClocksSetting"),
    ("sw_power_cap", "SwPowerCap"),
    ("hw_slowdown", "HwSlowdown"),
    ("sync_boost", "SyncBoost"),
    ("sw_thermal", "SwThermalSlowdown"),
    ("hw_thermal", "HwThermalSlowdown"),
    ("power_brake", "HwPowerBrakeSlowdown"),
    ("display_clocks", "DisplayClockSetting"),
    ("board_limit", "BoardLimit"),
    ("reliability", "Reliability"),
)


def decode_throttle_reasons(mask: int, pynvml) -> List[str]:
    """Short names of the bits set in an NVML clock event reason ``mask``
    (see THROTTLE_REASONS); bits this pynvml has no name for come out as one hex string."""
    names = []
    rest = int(mask)
    for name, suffix in THROTTLE_REASONS:
        bit = getattr(pynvml, "nvmlClocksEventReason" + suffix, None)
        if bit is None:
            bit = getattr(pynvml, "nvmlClocksThrottleReason" + suffix, None)
        if bit and rest & bit:
            names.append(name)
            rest &= ~bit
    if rest:
        names.append(f"0x{rest:x}")
    return names


def visible_nvml_indices(pynvml) -> List[int]:
    """NVML indices of the CUDA devices this process sees, in CUDA's order.

    Follows ``CUDA_VISIBLE_DEVICES`` as CUDA does: entries are indices or
    UUID prefixes, and the list ends at the first entry that names no device.
    Unset: every NVML device, in NVML's (PCI bus) order.
    """
    count = pynvml.nvmlDeviceGetCount()
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(count))
    uuids = None
    indices: List[int] = []
    for entry in (part.strip() for part in spec.split(",")):
        if entry.isdigit() and int(entry) < count:
            index = int(entry)
        elif entry.startswith("GPU-"):
            if uuids is None:
                uuids = [_text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)))
                         for i in range(count)]
            matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
            if len(matches) != 1:
                break
            index = matches[0]
        else:
            break  # an invalid entry (or a MIG instance) ends the list, as in CUDA
        if index in indices:
            break
        indices.append(index)
    return indices


class GpuTelemetry:
    """Samples NVML for CUDA devices ``0 .. devices-1`` (None: all visible
    ones; 0: none, and NVML is not touched).

    Never raises: without NVML, ``available`` is False, ``reason`` says why
    and ``sample()`` returns []. ``close()`` (or ``with``) shuts NVML down.
    """

    def __init__(self, devices: Optional[int] = None):
        self.available = False
        self.reason = ""
        self._pynvml = None
        self._handles: list = []
        if devices == 0:
            return
        try:
            import pynvml
        except ImportError:
            self.reason = "nvidia-ml-py is not installed"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            self.reason = f"NVML did not start ({e})"
            return
        self._pynvml = pynvml
        try:
            indices = visible_nvml_indices(pynvml)
            if devices is not None:
                indices = indices[:devices]
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        except pynvml.NVMLError as e:
            self.reason = f"NVML lists no devices ({e})"
            self.close()
            return
        if not self._handles:
            self.reason = "NVML sees none of this process's GPUs"
            self.close()
            return
        self.available = True

    def sample(self) -> List[dict]:
        """One dict per GPU, in CUDA device order: ``device`` (the CUDA index),
        and those of these that NVML reads on it: ``gpu_util``, ``memory_util``
        (%, over NVML's last sample period), ``memory_used``, ``memory_total``
        (bytes), ``power_w``, ``power_limit_w``, ``sm_clock_mhz``,
        ``temperature_c``, ``throttle`` (short names, see THROTTLE_REASONS)."""
        if not self.available:
            return []
        return [self._sample_one(device, handle) for device, handle in enumerate(self._handles)]

    def _sample_one(self, device: int, handle) -> dict:
        nvml = self._pynvml
        out = dict(device=device)

        def read(fields, query):
            # A metric this GPU or driver does not offer (or a transient NVML
            # failure) is left out; telemetry must never stop a run.
            try:
                out.update(zip(fields, query()))
            except nvml.NVMLError:
                pass

        def utilisation():
            rates = nvml.nvmlDeviceGetUtilizationRates(handle)
            return rates.gpu, rates.memory

        def memory():
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            return info.used, info.total

        def throttle():
            query = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
                or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
            return (decode_throttle_reasons(query(handle), nvml),)

        read(("gpu_util", "memory_util"), utilisation)
        read(("memory_used", "memory_total"), memory)
        read(("power_w",), lambda: (nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,))
        read(("power_limit_w",), lambda: (nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0,))
        read(("sm_clock_mhz",), lambda: (nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),))
        read(("temperature_c",), lambda: (nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),))
        read(("throttle",), throttle)
        return out

    def close(self) -> None:
        if self._pynvml is not None:
            try:
                self._pynvml.nvmlShutdown()
            except self._pynvml.NVMLError:
                pass
            self._pynvml = None
        self.available = False
        self._handles = []

    def __enter__(self) -> "GpuTelemetry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value
