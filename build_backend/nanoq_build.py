"""nanoq's PEP 517 build backend: scikit-build-core, after deciding whether the
build has the cuda backend.

Why a backend of our own (a thin layer; scikit-build-core does the build): a
plain ``pip install .`` must build the cuda backend on a machine where it can
run, one with an NVIDIA GPU and the CUDA toolkit's ``nvcc``, and only there.
That choice changes the build's requirements (cuBLAS, NCCL, cuDNN and the
cuDNN frontend's headers, from the nvidia wheels) and the wheel's run-time
dependencies (the ``cuda`` extra), which ``pyproject.toml`` can only state for
every machine alike. This module

- decides (``cuda_choice``): ``NANOQ_CUDA=ON`` builds the cuda backend,
  ``OFF`` does not, and unset or ``AUTO`` builds it when NVML sees a GPU the
  backend supports (compute capability 8.0 or newer) and an ``nvcc`` is found;
- builds it for the GPUs NVML sees (``cuda_architectures``: their compute
  capabilities, as ``NANOQ_GPU_ARCHITECTURES`` for cmake/cuda_architectures.cmake,
  where ``CMAKE_CUDA_ARCHITECTURES`` or ``$CUDAARCHS`` still win), so that a
  GPU gets code compiled for it and the build compiles no more than it needs;
- adds the nvidia wheels the build compiles against to the build requirements
  (an isolated build installs them into its build environment);
- adds the ``cuda`` extra to the dependencies of a wheel that has the cuda
  backend, so that its libraries are there at run time;
- under ``AUTO``, when the cuda build fails, builds again without it: the
  install still trains, on the cpu. Why a build has no cuda backend goes into
  the package (``NANOQ_CUDA_NOTE``, written by CMake into ``build_note.txt``),
  and ``nanoq train`` says it beside GPUs it leaves idle, since pip shows a
  build's output only when it fails.

Only the standard library and scikit-build-core are imported: this runs in
build environments that have nothing else (the GPU machine's among them).
"""
from __future__ import annotations

import base64
import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional

import scikit_build_core.build as _skb

if sys.version_info >= (3, 11):
    import tomllib
else:  # nanoq needs 3.11 (pyproject.toml): pip says so once it has read the metadata this backend
    import tomli as tomllib  # writes, and scikit-build-core depends on tomli before 3.11

__all__ = ["build_editable", "build_sdist", "build_wheel", "get_requires_for_build_editable",
           "get_requires_for_build_sdist", "get_requires_for_build_wheel"]

_ON = {"on", "1", "true", "yes"}
_OFF = {"off", "0", "false", "no"}

# Beyond the cuda extra's nvidia wheels, the build needs the cuDNN frontend's
# headers. Its own dependencies (cutlass-dsl, tvm-ffi, ~200 MB) come with it
# into the build environment, which build requirements cannot avoid; they are
# not run-time dependencies.
_BUILD_ONLY = ["nvidia-cudnn-frontend"]


# The oldest GPUs the cuda backend runs on: compute capability 8.0 (Ampere),
# for bf16 tensor-core matmuls (cuBLASLt) and cuDNN's fused attention.
MIN_COMPUTE_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class CudaChoice:
    build: bool  # build the cuda backend
    auto: bool  # decided by looking at the machine (NANOQ_CUDA unset or AUTO)
    why: str  # in words, for the build log and the package's note
    nvcc: Optional[str] = None  # the nvcc found, when the choice was auto
    gpus: tuple = ()  # the compute capabilities NVML reported, when the choice was auto (see nvml_gpus)


def nvml_gpus() -> list[Optional[tuple[int, int]]]:
    """The compute capability, (major, minor), of each NVIDIA GPU that the driver's NVML library
    reports; None for one whose capability NVML does not give. Empty without a driver."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return []
    try:
        init, count_devices, shutdown = nvml.nvmlInit_v2, nvml.nvmlDeviceGetCount_v2, nvml.nvmlShutdown
    except AttributeError:  # a driver too old for the v2 entry points
        return []
    if init() != 0:
        return []
    try:
        count = ctypes.c_uint(0)
        if count_devices(ctypes.byref(count)) != 0:
            return []
        get_handle = getattr(nvml, "nvmlDeviceGetHandleByIndex_v2", None)
        get_capability = getattr(nvml, "nvmlDeviceGetCudaComputeCapability", None)
        gpus = []
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            known = (get_handle is not None and get_capability is not None
                     and get_handle(ctypes.c_uint(index), ctypes.byref(handle)) == 0
                     and get_capability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0)
            gpus.append((major.value, minor.value) if known else None)
        return gpus
    finally:
        shutdown()


def find_nvcc(environ: Mapping[str, str]) -> Optional[str]:
    """nvcc where CMake would look for it: $CUDACXX, PATH, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda."""
    if environ.get("CUDACXX"):
        return environ["CUDACXX"] if os.access(environ["CUDACXX"], os.X_OK) else None
    found = shutil.which("nvcc", path=environ.get("PATH", os.defpath))
    if found:
        return found
    for root in (environ.get("CUDA_HOME"), environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def _capability(gpu: tuple[int, int]) -> str:
    return f"{gpu[0]}.{gpu[1]}"


def _gpus_in_words(gpus) -> str:
    known = sorted({g for g in gpus if g is not None})
    text = f"{len(gpus)} NVIDIA GPU{'s' if len(gpus) > 1 else ''}"
    if known:
        text += f" (compute capability {', '.join(map(_capability, known))})"
    return text


def cuda_choice(environ: Mapping[str, str]) -> CudaChoice:
    """Whether this build has the cuda backend, from NANOQ_CUDA and the machine."""
    value = environ.get("NANOQ_CUDA", "").strip()
    if value.lower() in _ON:
        return CudaChoice(True, False, f"NANOQ_CUDA={value}")
    if value.lower() in _OFF:
        return CudaChoice(False, False, f"NANOQ_CUDA={value} was set when building")
    if value and value.lower() != "auto":
        raise ValueError(f"NANOQ_CUDA={value!r}: expected ON, OFF or AUTO (the default: ON where NVML sees "
                         "an NVIDIA GPU and nvcc is found)")
    gpus = tuple(nvml_gpus())
    if not gpus:
        return CudaChoice(False, True, "no NVIDIA GPU was seen when building; NANOQ_CUDA=ON builds it anyway")
    if all(g is not None and g < MIN_COMPUTE_CAPABILITY for g in gpus):
        return CudaChoice(False, True, f"{_gpus_in_words(gpus)} seen when building, older than the cuda backend "
                                       f"supports (compute capability {_capability(MIN_COMPUTE_CAPABILITY)}, "
                                       "Ampere, or newer); NANOQ_CUDA=ON builds it anyway", gpus=gpus)
    nvcc = find_nvcc(environ)
    if nvcc is None:
        return CudaChoice(False, True, f"{_gpus_in_words(gpus)} but no nvcc (the CUDA 13 toolkit) when building: "
                                       "not on PATH, nor in $CUDA_HOME, $CUDA_PATH or /usr/local/cuda", gpus=gpus)
    return CudaChoice(True, True, f"{_gpus_in_words(gpus)} and {nvcc}", nvcc, gpus)


def nvcc_architectures(nvcc: Optional[str]) -> list[int]:
    """The virtual architectures nvcc compiles for (``nvcc --list-gpu-arch``: 75, 80, ... 120);
    empty where that cannot be asked."""
    if nvcc is None:
        return []
    try:
        listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted({int(word[len("compute_"):]) for word in listed.split()
                   if word.startswith("compute_") and word[len("compute_"):].isdigit()})


def cuda_architectures(gpus, nvcc: Optional[str]) -> str:
    """CUDA architectures for the GPUs seen (NANOQ_GPU_ARCHITECTURES, e.g. "90" or "80;90"):
    each supported GPU's compute capability, or nvcc's newest where the GPU is newer than nvcc
    knows (the driver compiles that one's PTX for it). "" (cmake/cuda_architectures.cmake's default)
    without GPUs, or with one whose capability is unknown."""
    if not gpus or any(g is None for g in gpus):
        return ""
    known = nvcc_architectures(nvcc)
    chosen = set()
    for gpu in gpus:
        if gpu < MIN_COMPUTE_CAPABILITY:
            continue
        arch = 10 * gpu[0] + gpu[1]
        if known and arch not in known:
            older = [a for a in known if a < arch]
            if not older:
                continue
            arch = older[-1]
        chosen.add(arch)
    return ";".join(str(a) for a in sorted(chosen))


def architectures_named(environ: Mapping[str, str], config_settings=None) -> bool:
    """Whether the builder named the CUDA architectures, which then win over the GPUs seen
    (cmake/cuda_architectures.cmake): $CUDAARCHS, or CMAKE_CUDA_ARCHITECTURES in $CMAKE_ARGS,
    scikit-build-core's $SKBUILD_CMAKE_ARGS / $SKBUILD_CMAKE_DEFINE, or pip's --config-settings
    (cmake.define.CMAKE_CUDA_ARCHITECTURES, cmake.args). Then the build does not ask NVML for
    them (an AUTO choice still counts the GPUs); else CMake forgets a value an earlier build
    left in its cache."""
    settings = " ".join(f"{k}={v}" for k, v in (config_settings or {}).items())
    texts = [environ.get(name, "") for name in ("CMAKE_ARGS", "SKBUILD_CMAKE_ARGS", "SKBUILD_CMAKE_DEFINE")]
    return bool(environ.get("CUDAARCHS")) or any("CMAKE_CUDA_ARCHITECTURES" in text for text in texts + [settings])


def cuda_extra(pyproject: str = "pyproject.toml") -> list[str]:
    """The ``cuda`` extra of pyproject.toml: the cuda backend's run-time dependencies."""
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["project"]["optional-dependencies"]["cuda"])


def cuda_build_requirements(pyproject: str = "pyproject.toml") -> list[str]:
    """What compiling the cuda backend needs beyond the cpu build: the extra's nvidia wheels (their
    headers and libraries; not cupy, cuda-pathfinder) and the cuDNN frontend's headers."""
    return [r for r in cuda_extra(pyproject) if r.startswith("nvidia-")] + _BUILD_ONLY


def add_requirements(wheel: Path, requirements: list[str]) -> None:
    """Add unconditional Requires-Dist lines to a built wheel's METADATA (and its RECORD's hash)."""
    with zipfile.ZipFile(wheel) as source:
        entries = [(info, source.read(info)) for info in source.infolist()]
    metadata = next(info.filename for info, _ in entries
                    if info.filename.count("/") == 1 and info.filename.endswith(".dist-info/METADATA"))
    record = metadata[:-len("METADATA")] + "RECORD"
    lines = "".join(f"Requires-Dist: {r}\n" for r in requirements)
    patched = {info.filename: data for info, data in entries}
    # The headers end at the first blank line; the description may follow.
    head, blank, body = patched[metadata].decode("utf-8").partition("\n\n")
    data = (head.rstrip("\n") + "\n" + lines + ("\n" + body if blank else "")).encode("utf-8")
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    patched[metadata] = data
    row = f"{metadata},sha256={digest},{len(data)}"
    patched[record] = "".join((row if r.startswith(metadata + ",") else r) + "\n"
                              for r in patched[record].decode("utf-8").splitlines()).encode("utf-8")
    fd, tmp = tempfile.mkstemp(dir=wheel.parent, suffix=".whl")
    os.close(fd)
    try:
        shutil.copymode(wheel, tmp)  # mkstemp's is 0600
        with zipfile.ZipFile(tmp, "w") as target:
            for info, _ in entries:
                target.writestr(info, patched[info.filename])
        os.replace(tmp, wheel)
    except BaseException:
        os.unlink(tmp)
        raise


def _has_cuda_backend(wheel: Path) -> bool:
    with zipfile.ZipFile(wheel) as archive:
        return any(n.endswith("nanoq/libnanoq_cuda.so") for n in archive.namelist())


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _say(text: str) -> None:
    print(f"nanoq build: {text}", file=sys.stderr, flush=True)


def _build(hook, wheel_directory: str, config_settings) -> str:
    choice = cuda_choice(os.environ)
    _say(("building the cuda backend: " if choice.build else "building without the cuda backend: ") + choice.why)
    values = {"NANOQ_CUDA": "ON" if choice.build else "OFF", "NANOQ_CUDA_NOTE": "" if choice.build else choice.why}
    if choice.nvcc:
        # The nvcc that was found. Not a CMAKE_CUDA_COMPILER define: where the build folder's
        # cache holds another compiler, CMake then deletes its cache and configures again
        # without skbuild's defines (NANOQ_CUDA among them): a cpu build that looks like a
        # success. A different $CUDACXX is refused by cmake/cuda_backend.cmake instead.
        values["CUDACXX"] = choice.nvcc
    if choice.build and architectures_named(os.environ, config_settings):
        values.update(NANOQ_GPU_ARCHITECTURES="", NANOQ_ARCHITECTURES_NAMED="ON")
        _say("CUDA architectures: as CMAKE_CUDA_ARCHITECTURES or $CUDAARCHS name them")
    elif choice.build:
        # For the GPUs seen (ON looks too: it decides whether to build, not for what).
        architectures = cuda_architectures(choice.gpus if choice.auto else nvml_gpus(),
                                           choice.nvcc or find_nvcc(os.environ))
        values.update(NANOQ_GPU_ARCHITECTURES=architectures, NANOQ_ARCHITECTURES_NAMED="OFF")
        _say("CUDA architectures: " + (f"{architectures}, the GPUs seen" if architectures else
                                       "cmake/cuda_architectures.cmake's default (no supported GPU of known compute "
                                       "capability was seen)"))
    try:
        with _environ(values):
            name = hook(wheel_directory, config_settings, None)
            if choice.build and not _has_cuda_backend(Path(wheel_directory) / name):
                raise RuntimeError("the build finished without the cuda backend (no nanoq/libnanoq_cuda.so in "
                                   f"{name}): the CMake log above says why")
    except (Exception, SystemExit) as e:
        if not (choice.build and choice.auto):
            raise
        # NANOQ_CUDA=ON never gets here: it fails with the build's error.
        why = "the cuda build failed when installing; NANOQ_CUDA=ON pip install -v . shows why"
        _say(f"the cuda build failed ({type(e).__name__}: {e}; the log above says why). Building without "
             "the cuda backend: this install trains on the cpu.")
        with _environ({"NANOQ_CUDA": "OFF", "NANOQ_CUDA_NOTE": why}):
            return hook(wheel_directory, config_settings, None)
    if choice.build:
        add_requirements(Path(wheel_directory) / name, cuda_extra())
    return name


# The hooks. There is no prepare_metadata_for_build_*: whether the wheel has
# the cuda extra's dependencies is known only once it is built, so pip takes
# the metadata from the built wheel (and builds it once).

def _with_cuda_requirements(requirements) -> list[str]:
    return list(requirements) + (cuda_build_requirements() if cuda_choice(os.environ).build else [])


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    return _with_cuda_requirements(_skb.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None) -> list[str]:
    return _with_cuda_requirements(_skb.get_requires_for_build_editable(config_settings))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    return _build(_skb.build_wheel, wheel_directory, config_settings)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    return _build(_skb.build_editable, wheel_directory, config_settings)


def get_requires_for_build_sdist(config_settings=None) -> list[str]:
    return list(_skb.get_requires_for_build_sdist(config_settings))


def build_sdist(sdist_directory, config_settings=None) -> str:
    return _skb.build_sdist(sdist_directory, config_settings)
