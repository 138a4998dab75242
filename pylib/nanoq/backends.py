"""Which compute backends this install has, and which one a Trainer uses.

The cpu backend is always built. The cuda backend is a separate library
(``libnanoq_cuda.so`` beside the core, built with ``NANOQ_CUDA=ON``) that is
loaded only when asked for, after the CUDA libraries of the nvidia wheels
(cudart, cuBLAS, NCCL and, when it was built with it, cuDNN) have been
located and loaded.
"""
from __future__ import annotations

import os
from typing import Optional

from nanoq import _core
from nanoq import options as option_schema

BACKENDS = option_schema.choices("backend")
# Backends that run the cuda backend's code: on a GPU, or on the CPU emulator
# of the CUDA execution model (``cuda_emulated``: for tests, very slow, never
# chosen by "auto").
CUDA_BACKENDS = ("cuda", "cuda_emulated")
# cudnn: only a cuda backend built with cuDNN links it (fused attention);
# nvrtc: cuDNN opens it (by its soname, so a copy loaded here serves) to
# compile its Hopper attention engines at run time.
_CUDA_LIBRARIES = ("cudart", "cublas", "cublasLt", "nccl", "cudnn", "nvrtc")


def _preload_cuda_libraries() -> None:
    """Loads the nvidia wheels' libraries so the cuda backend's links resolve
    wherever pip put them. Missing ones are left to the loader's own search,
    whose error then names what is missing."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        return
    for name in _CUDA_LIBRARIES:
        try:
            load_nvidia_dynamic_lib(name)
        except Exception:  # noqa: BLE001 - the backend's own load reports it
            pass


def _prepare(name: str) -> None:
    """Before the core loads backend ``name``'s library: the CUDA libraries it links."""
    if name == "cuda" and _core.backend_built("cuda"):
        _preload_cuda_libraries()


def device_count(name: str) -> int:
    """Devices backend ``name`` can use now (loads its library if needed).

    Raises ValueError if the backend is not built into this install and
    nanoq.NanoqError if its library cannot be loaded.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; nanoq has {', '.join(BACKENDS)}")
    _prepare(name)
    return _core.device_count(name)


def new_comm_id(name: str) -> bytes:
    """A fresh communicator id of backend ``name`` (bytes): hand the same
    one to every Trainer of a world (``TrainOptions.comm_id``). On cpu it
    names a world of Trainers in this process; on cuda it is an NCCL
    unique id. Loads the backend's library (errors as ``device_count``)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; nanoq has {', '.join(BACKENDS)}")
    _prepare(name)
    return _core.new_comm_id(name)


def gpu_names() -> list[str]:
    """Names of the NVIDIA GPUs NVML sees (empty without NVML or a driver)."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else name)
        return names
    finally:
        pynvml.nvmlShutdown()


def cpu_gemm_detail() -> str:
    """Which sgemm the cpu backend runs, in words (for nanoq.backends() and `nanoq info`)."""
    try:
        gemm = _core.cpu_gemm()
    except ValueError as e:
        return f"GEMM: {e}"
    if gemm["name"] == "openblas":
        return "GEMM: OpenBLAS (scipy-openblas32)"
    why = "NANOQ_CPU_GEMM=portable" if gemm["openblas_built"] else "this build has no OpenBLAS"
    return f"GEMM: portable fallback ({why})"


def attention_library(name: str) -> str:
    """The fused attention library backend ``name`` was built with, in words
    ("cuDNN 9.28.1"; the emulated build's stand-in for cuDNN on
    cuda_emulated), or "" for none (cpu, or a cuda build without cuDNN).
    Loads the backend's library (errors as ``device_count``)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; nanoq has {', '.join(BACKENDS)}")
    _prepare(name)
    return _core.attention_library(name)


def attention_detail(name: str) -> str:
    """Which fused attention backend ``name``'s build has, in words (for
    nanoq.backends() and `nanoq info`); a Trainer's ``attention`` says what
    it runs."""
    try:
        library = attention_library(name)
    except (ValueError, _core.NanoqError) as e:
        return f"attention: {e}"
    if not library:
        return "attention: native kernels (built without cuDNN)"
    if name == "cuda_emulated":  # a test double of cuDNN: "auto" never picks it
        return f'attention: {library} with attention="cudnn"'
    return f'attention: {library} (attention="auto" uses it where it supports the shape)'



# How to build the cuda backend into an install, from nanoq's source folder
# (README, "GPUs: the cuda backend"): it fails with the reason where the
# default (NANOQ_CUDA unset: build it where there is a GPU and nvcc) would
# fall back to the cpu.
CUDA_BUILD_COMMANDS = ("NANOQ_CUDA=ON pip install .",)
# A cuda backend that loads but has no device to run on.
NO_GPU = "no usable GPU (no device or no driver)"


def _build_record(name: str) -> str:
    """A file the build wrote into the package (CMake), stripped; "" where there is none."""
    try:
        with open(os.path.join(os.path.dirname(__file__), name), encoding="utf-8") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def cuda_build_note() -> str:
    """Why this install was built without the cuda backend, as its build
    recorded (build_backend/nanoq_build.py): "" when it has one, or when
    the build did not say."""
    return _build_record("build_note.txt")


def cuda_architectures() -> str:
    """The CUDA architectures this install's cuda backend was compiled for,
    as its build recorded them (cmake/cuda_architectures.cmake), e.g. "90"
    or "80,90"; "" without a cuda backend. A GPU runs it when one of them is
    at or below its compute capability (for plain "XY" entries: code and PTX)."""
    return _build_record("cuda_architectures.txt") if _core.backend_built("cuda") else ""


def _cuda_not_built_why() -> str:
    return cuda_build_note() or "NANOQ_CUDA=ON builds it"


def cuda_unusable_reason() -> str:
    """Why the cuda backend cannot train here, in words ("" when it can)."""
    if not _core.backend_built("cuda"):
        return f"this install was built without the cuda backend ({_cuda_not_built_why()})"
    try:
        if device_count("cuda") > 0:
            return ""
    except _core.NanoqError as e:
        return f"the cuda backend does not load: {e}"
    return f"the cuda backend sees {NO_GPU}"


def idle_gpus_warning(requested: str, resolved: str) -> Optional[str]:
    """A warning, in words, when a run that asked for ``requested`` ("auto")
    runs on ``resolved`` "cpu" although NVML sees NVIDIA GPUs here: which
    ones, why the cuda backend is not used, and how to build it. None
    otherwise (a run that asked for cpu, or no GPU)."""
    if requested != "auto" or resolved != "cpu":
        return None
    names = gpu_names()
    reason = cuda_unusable_reason() if names else ""
    if not reason:
        return None
    how = " && ".join(CUDA_BUILD_COMMANDS) if not _core.backend_built("cuda") else "nanoq info says more"
    return (f"this machine has {len(names)} NVIDIA GPU{'s' if len(names) > 1 else ''} ({', '.join(names)}), but "
            f"{reason}: training on the cpu backend, much slower. For the GPU, in nanoq's source folder"
            f"{' (with the CUDA 13 toolkit installed)' if 'nvcc' in reason else ''}: {how}")


def backends() -> list[dict]:
    """One dict per backend: name, built (compiled into this install),
    devices (usable now), and detail (why it is unusable, GPU names, ...)."""
    report = []
    for name in BACKENDS:
        entry = dict(name=name, built=_core.backend_built(name), devices=0, detail="")
        if not entry["built"]:
            entry["detail"] = f"not built: {_cuda_not_built_why()}" if name == "cuda" else "not built"
        else:
            try:
                entry["devices"] = device_count(name)
            except (ValueError, _core.NanoqError) as e:
                entry["detail"] = str(e)
            if name == "cpu":
                entry["detail"] = f"{entry['devices']} cores; devices are worker threads; {cpu_gemm_detail()}"
            elif name == "cuda_emulated":
                entry["detail"] = "the cuda backend's code on a CPU emulator of CUDA (for tests; very slow)"
            elif entry["devices"] == 0 and not entry["detail"]:
                entry["detail"] = NO_GPU
            elif entry["devices"]:
                entry["detail"] = ", ".join(gpu_names())
            built_for = cuda_architectures() if name == "cuda" else ""
            if built_for:
                entry["detail"] += f"; built for CUDA architectures {built_for}"
            if name in CUDA_BACKENDS:
                entry["detail"] += "; " + attention_detail(name)
        report.append(entry)
    return report


def usable_cores() -> tuple[int, str]:
    """(CPU cores this process may run on, where that count comes from):
    its affinity mask where the OS has one (``os.sched_getaffinity``), else
    ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)), "os.sched_getaffinity"
    return os.cpu_count() or 1, "os.cpu_count"


class OversubscriptionWarning(UserWarning):
    """A cpu trainer asks for more threads than its cores (cpu_oversubscription)."""


def cpu_oversubscription(devices: int, threads: int, processes: int = 1,
                         names: tuple = ("run.devices", "run.threads")) -> Optional[str]:
    """A warning, in words, when a cpu run of ``devices`` worker threads with
    ``threads`` compute threads each (0: the cores shared out, at least one
    each) asks for more threads than this process has cores; None when it
    fits. ``processes``: the run's processes on this node, which share its
    cores where this process may use all of them (where a launcher bound
    each to cores of its own, each is counted alone). ``names``: those of
    the devices and threads settings in the words of the caller. Such a run
    is correct, only much slower."""
    cores, source = usable_cores()
    sharing = processes > 1 and cores >= (os.cpu_count() or 1)
    wanted = devices * max(threads, 1) * (processes if sharing else 1)
    if wanted <= cores:
        return None
    devices_name, threads_name = names
    asked = f"{devices_name} {devices}" if threads == 0 else f"{devices_name} {devices} x {threads_name} {threads}"
    if sharing:
        asked += f" in each of the {processes} processes on this node"
    in_all = " in all" if sharing else ""
    return (f"{asked} asks for {wanted} cpu threads but this process may use {cores} core{'s' * (cores != 1)} "
            f"({source}): the run is oversubscribed and much slower; use at most {cores}{in_all} "
            f"({threads_name} 0 shares the cores out)")


def resolve_backend(name: str) -> str:
    """The backend a Trainer with ``backend=name`` runs on.

    "auto" is cuda when it is built and sees a GPU, else cpu. An explicit
    "cuda" that is not built, cannot load, or sees no GPU is an error.
    """
    if name == "auto":
        if _core.backend_built("cuda"):
            try:
                if device_count("cuda") > 0:
                    return "cuda"
            except _core.NanoqError:
                pass
        return "cpu"
    if name == "cuda":
        if device_count("cuda") == 0:
            raise _core.NanoqError(f"the cuda backend sees {NO_GPU}")
        return name
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; nanoq has {', '.join(BACKENDS)}")
    return name
