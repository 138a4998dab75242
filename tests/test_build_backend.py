"""The build backend (build_backend/nanoq_build.py): whether `pip install .`
builds the cuda backend, what that build requires, and the wheel's added
run-time dependencies. The real builds run in CI (.ci/run: the default on a
machine without a GPU, then NANOQ_CUDA=ON); here each decision and the wheel
patch are checked on their own."""
from __future__ import annotations

import base64
import email.parser
import hashlib
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

backends = importlib.import_module("nanoq.backends")  # the module (nanoq.backends is also a function's name)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def nb():
    spec = importlib.util.spec_from_file_location("nanoq_build_under_test", ROOT / "build_backend" / "nanoq_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def fake_tool(folder: Path, name: str = "nvcc") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# -- the choice ---------------------------------------------------------------------------


def test_nanoq_cuda_on_and_off_decide_without_looking(nb, monkeypatch):
    monkeypatch.setattr(nb, "nvml_gpus", lambda: pytest.fail("ON/OFF must not look at the machine"))
    for value in ("ON", "on", "1", "TRUE"):
        choice = nb.cuda_choice({"NANOQ_CUDA": value})
        assert choice.build and not choice.auto
    for value in ("OFF", "0", "false"):
        choice = nb.cuda_choice({"NANOQ_CUDA": value})
        assert not choice.build and not choice.auto and f"NANOQ_CUDA={value}" in choice.why


def test_a_bad_nanoq_cuda_value_is_refused(nb):
    with pytest.raises(ValueError, match="NANOQ_CUDA='maybe': expected ON, OFF or AUTO"):
        nb.cuda_choice({"NANOQ_CUDA": "maybe"})


def test_auto_builds_it_only_with_a_gpu_and_nvcc(nb, monkeypatch, tmp_path):
    nvcc = fake_tool(tmp_path / "toolkit" / "bin")
    with_nvcc = {"PATH": str(tmp_path / "toolkit" / "bin")}
    without = {"PATH": str(tmp_path / "empty")}
    monkeypatch.setattr(nb, "nvml_gpus", lambda: [])
    for environ in ({}, {"NANOQ_CUDA": "auto"}, with_nvcc):
        choice = nb.cuda_choice(environ)
        assert not choice.build and choice.auto and "no NVIDIA GPU was seen" in choice.why
    monkeypatch.setattr(nb, "nvml_gpus", lambda: [(9, 0), (9, 0)])
    monkeypatch.setattr(nb, "find_nvcc", lambda environ: None)
    choice = nb.cuda_choice(without)
    assert not choice.build and choice.auto and "2 NVIDIA GPUs (compute capability 9.0) but no nvcc" in choice.why
    monkeypatch.undo()
    monkeypatch.setattr(nb, "nvml_gpus", lambda: [(8, 0)])
    choice = nb.cuda_choice({"NANOQ_CUDA": "AUTO", **with_nvcc})
    assert choice.build and choice.auto and choice.nvcc == nvcc and choice.gpus == ((8, 0),)
    assert choice.why == f"1 NVIDIA GPU (compute capability 8.0) and {nvcc}"


def test_auto_leaves_out_gpus_older_than_the_backend_supports(nb, monkeypatch, tmp_path):
    """Compute capability 8.0 (Ampere) and newer: bf16 tensor cores and cuDNN's fused attention.
    A machine with only older GPUs gets a cpu build that says why; one of each builds it."""
    with_nvcc = {"PATH": str(Path(fake_tool(tmp_path / "bin")).parent)}
    monkeypatch.setattr(nb, "nvml_gpus", lambda: [(7, 5), (7, 0)])
    choice = nb.cuda_choice(with_nvcc)
    assert not choice.build and choice.auto
    assert choice.why == ("2 NVIDIA GPUs (compute capability 7.0, 7.5) seen when building, older than the cuda "
                          "backend supports (compute capability 8.0, Ampere, or newer); NANOQ_CUDA=ON builds it "
                          "anyway")
    monkeypatch.setattr(nb, "nvml_gpus", lambda: [(7, 5), (8, 6)])
    assert nb.cuda_choice(with_nvcc).build
    monkeypatch.setattr(nb, "nvml_gpus", lambda: [None])  # a capability NVML did not give: tried
    assert nb.cuda_choice(with_nvcc).build
    assert nb.cuda_choice({"NANOQ_CUDA": "ON"}).build  # ON builds whatever is there


def fake_nvcc(folder: Path, arches=(75, 80, 86, 87, 88, 89, 90, 100, 110, 103, 120, 121)) -> str:
    """An nvcc that answers --list-gpu-arch as CUDA 13.0's does."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "nvcc"
    listing = "\\n".join(f"compute_{a}" for a in arches)
    path.write_text(f'#!/bin/sh\n[ "$1" = --list-gpu-arch ] && printf "{listing}\\n"\nexit 0\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_the_architectures_are_the_gpus_seen(nb, tmp_path):
    nvcc = fake_nvcc(tmp_path / "bin")
    assert nb.nvcc_architectures(nvcc) == [75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121]
    assert nb.cuda_architectures([(9, 0)], nvcc) == "90"
    assert nb.cuda_architectures([(9, 0), (8, 0), (9, 0)], nvcc) == "80;90"
    assert nb.cuda_architectures([(8, 9), (12, 0)], nvcc) == "89;120"
    assert nb.cuda_architectures([(7, 5), (9, 0)], nvcc) == "90"  # an unsupported GPU gets no code
    # Newer than this nvcc knows: its newest, whose PTX the driver compiles for the GPU.
    assert nb.cuda_architectures([(13, 0)], nvcc) == "121"
    # The default (cmake/cuda_architectures.cmake's) where a capability is unknown or nothing was seen.
    assert nb.cuda_architectures([None, (9, 0)], nvcc) == ""
    assert nb.cuda_architectures([], nvcc) == ""
    # Without nvcc's list, the GPUs' own.
    assert nb.nvcc_architectures(str(tmp_path / "missing")) == [] and nb.nvcc_architectures(None) == []
    assert nb.cuda_architectures([(9, 0)], None) == "90"


def test_nvcc_is_looked_for_where_cmake_looks(nb, tmp_path):
    on_path = fake_tool(tmp_path / "path")
    home = fake_tool(tmp_path / "home" / "bin")
    chosen = fake_tool(tmp_path / "chosen", "my-nvcc")
    empty = str(tmp_path / "empty")
    assert nb.find_nvcc({"PATH": str(tmp_path / "path"), "CUDA_HOME": str(tmp_path / "home")}) == on_path
    assert nb.find_nvcc({"PATH": empty, "CUDA_HOME": str(tmp_path / "home")}) == home
    assert nb.find_nvcc({"PATH": empty, "CUDA_PATH": str(tmp_path / "home")}) == home
    assert nb.find_nvcc({"PATH": str(tmp_path / "path"), "CUDACXX": chosen}) == chosen
    assert nb.find_nvcc({"PATH": str(tmp_path / "path"), "CUDACXX": str(tmp_path / "missing")}) is None
    if not os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        assert nb.find_nvcc({"PATH": empty}) is None


def test_the_gpus_are_nvmls(nb):
    """Read through the driver's NVML library with ctypes (a build environment has no
    nvidia-ml-py); checked against nvidia-ml-py's own reading (none where there is no driver)."""
    import pynvml  # nvidia-ml-py, a dependency of nanoq

    try:
        pynvml.nvmlInit()
        expected = [pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(i))
                    for i in range(pynvml.nvmlDeviceGetCount())]
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        expected = []
    assert nb.nvml_gpus() == [tuple(c) for c in expected]


# -- requirements --------------------------------------------------------------------------


def test_the_cuda_build_requires_the_libraries_it_compiles_against(nb, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(nb, "_skb", types.SimpleNamespace(get_requires_for_build_wheel=lambda cs: ["cmake>=3.26"],
                                                          get_requires_for_build_editable=lambda cs: []))
    extra = nb.cuda_extra()
    assert "cupy-cuda13x" in extra and "nvidia-cudnn-cu13" in extra  # pyproject's [cuda] extra
    needed = nb.cuda_build_requirements()
    for wheel in ("nvidia-nccl-cu13", "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cudnn-cu13",
                  "nvidia-cuda-nvrtc", "nvidia-cudnn-frontend"):
        assert wheel in needed
    assert "cupy-cuda13x" not in needed  # run time only
    monkeypatch.setenv("NANOQ_CUDA", "ON")
    assert nb.get_requires_for_build_wheel() == ["cmake>=3.26"] + needed
    assert nb.get_requires_for_build_editable() == needed
    monkeypatch.setenv("NANOQ_CUDA", "OFF")
    assert nb.get_requires_for_build_wheel() == ["cmake>=3.26"]


def make_wheel(folder: Path, body: bool = True, cuda: bool = False) -> str:
    name = "nanoq-0.1.0-cp311-cp311-linux_x86_64.whl"
    metadata = ("Metadata-Version: 2.2\nName: nanoq\nVersion: 0.1.0\nRequires-Dist: numpy>=1.24\n"
                'Provides-Extra: cuda\nRequires-Dist: cupy-cuda13x; extra == "cuda"\n')
    if body:
        metadata += "Description-Content-Type: text/markdown\n\n# nanoq\n\nRequires-Dist: not a header\n"
    files = {"nanoq/__init__.py": b"x = 1\n", "nanoq-0.1.0.dist-info/METADATA": metadata.encode(),
             "nanoq-0.1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\n"}
    if cuda:
        files["nanoq/libnanoq_cuda.so"] = b"\x7fELF"
    record = "".join(f"{path},sha256={hash_of(data)},{len(data)}\n" for path, data in files.items())
    record += "nanoq-0.1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / name, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
        wheel.writestr("nanoq-0.1.0.dist-info/RECORD", record)
    return name


def hash_of(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def read_wheel(path: Path) -> tuple[email.message.Message, dict, dict]:
    with zipfile.ZipFile(path) as wheel:
        files = {name: wheel.read(name) for name in wheel.namelist()}
    metadata = email.parser.BytesParser().parsebytes(files["nanoq-0.1.0.dist-info/METADATA"])
    record = {row.split(",")[0]: row.split(",")[1:] for row in
              files["nanoq-0.1.0.dist-info/RECORD"].decode().splitlines()}
    return metadata, files, record


@pytest.mark.parametrize("body", [True, False], ids=["with-description", "headers-only"])
def test_requirements_are_added_to_a_built_wheel(nb, tmp_path, body):
    name = make_wheel(tmp_path, body)
    nb.add_requirements(tmp_path / name, ["cupy-cuda13x", "nvidia-cublas"])
    metadata, files, record = read_wheel(tmp_path / name)
    assert metadata.get_all("Requires-Dist") == ["numpy>=1.24", 'cupy-cuda13x; extra == "cuda"', "cupy-cuda13x",
                                                 "nvidia-cublas"]
    assert metadata["Name"] == "nanoq" and metadata["Version"] == "0.1.0"
    if body:
        assert metadata.get_payload() == "# nanoq\n\nRequires-Dist: not a header\n"
    for path, data in files.items():  # every hash in RECORD still holds, METADATA's new one too
        if path.endswith("RECORD"):
            continue
        assert record[path] == [f"sha256={hash_of(data)}", str(len(data))], path
    assert files["nanoq/__init__.py"] == b"x = 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary file left


# -- the build ------------------------------------------------------------------------------


class FakeSkb:
    """scikit-build-core's build_wheel: records the environment each build saw, and fails the
    cuda builds when told to (with an error, or a wheel without the cuda library)."""

    def __init__(self, cuda_fails: bool, how: str = "error"):
        self.cuda_fails, self.how = cuda_fails, how
        self.builds = []

    def build_wheel(self, wheel_directory, config_settings=None, metadata_directory=None):
        self.builds.append({k: os.environ.get(k) for k in ("NANOQ_CUDA", "NANOQ_CUDA_NOTE", "CUDACXX",
                                                           "NANOQ_GPU_ARCHITECTURES", "NANOQ_ARCHITECTURES_NAMED")})
        cuda = os.environ["NANOQ_CUDA"] == "ON"
        if self.cuda_fails and cuda and self.how == "error":
            raise SystemExit("CMake configuration failed")
        return make_wheel(Path(wheel_directory), cuda=cuda and not self.cuda_fails)


def test_a_cuda_build_depends_on_the_cuda_extra(nb, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("NANOQ_CUDA", "ON")
    monkeypatch.delenv("CUDACXX", raising=False)
    monkeypatch.setattr(nb, "nvml_gpus", lambda: [])
    skb = FakeSkb(cuda_fails=False)
    monkeypatch.setattr(nb, "_skb", skb)
    name = nb.build_wheel(str(tmp_path))
    assert skb.builds == [{"NANOQ_CUDA": "ON", "NANOQ_CUDA_NOTE": "", "CUDACXX": None, "NANOQ_GPU_ARCHITECTURES": "",
                           "NANOQ_ARCHITECTURES_NAMED": "OFF"}]  # no GPU: cmake's default architectures
    requires = read_wheel(tmp_path / name)[0].get_all("Requires-Dist")
    assert requires[:2] == ["numpy>=1.24", 'cupy-cuda13x; extra == "cuda"'] and requires[2:] == nb.cuda_extra()
    assert os.environ["NANOQ_CUDA"] == "ON" and "NANOQ_CUDA_NOTE" not in os.environ  # restored


@pytest.mark.parametrize("auto", [True, False], ids=["auto", "on"])
def test_a_cuda_build_is_for_the_gpus_seen(nb, monkeypatch, tmp_path, auto):
    """NANOQ_GPU_ARCHITECTURES (cmake/cuda_architectures.cmake's second choice), from the
    GPUs NVML reports and nvcc's list, under AUTO and under ON alike; none for a cpu build."""
    monkeypatch.chdir(ROOT)
    nvcc = fake_nvcc(tmp_path / "toolkit")
    monkeypatch.setenv("PATH", str(tmp_path / "toolkit") + os.pathsep + os.environ["PATH"])
    for name in ("CUDACXX", "CMAKE_ARGS", "CUDAARCHS"):  # the builder names none
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NANOQ_CUDA", "AUTO" if auto else "ON")
    monkeypatch.setattr(nb, "nvml_gpus", lambda: [(9, 0), (8, 6)])
    skb = FakeSkb(cuda_fails=False)
    monkeypatch.setattr(nb, "_skb", skb)
    (tmp_path / "out").mkdir()
    nb.build_wheel(str(tmp_path / "out"))
    assert skb.builds[0]["NANOQ_GPU_ARCHITECTURES"] == "86;90" and skb.builds[0]["NANOQ_ARCHITECTURES_NAMED"] == "OFF"
    assert skb.builds[0]["CUDACXX"] == (nvcc if auto else None)
    assert "NANOQ_GPU_ARCHITECTURES" not in os.environ  # restored
    monkeypatch.setenv("NANOQ_CUDA", "OFF")
    nb.build_wheel(str(tmp_path / "out"))
    assert skb.builds[1]["NANOQ_CUDA"] == "OFF" and skb.builds[1]["NANOQ_GPU_ARCHITECTURES"] is None


@pytest.mark.parametrize("how", ["CMAKE_ARGS", "CUDAARCHS", "config-settings"])
def test_architectures_the_builder_names_are_not_looked_up(nb, monkeypatch, tmp_path, how):
    """They win in cmake/cuda_architectures.cmake anyway: NVML is not asked (bench/gpu_check.sh
    names 90, so its build never depends on reading the driver)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("NANOQ_CUDA", "ON")
    for name in ("CMAKE_ARGS", "CUDAARCHS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(nb, "nvml_gpus", lambda: pytest.fail("named architectures need no GPU list"))
    settings = None
    if how == "CMAKE_ARGS":
        monkeypatch.setenv("CMAKE_ARGS", "-DCMAKE_CUDA_ARCHITECTURES=90 -DNANOQ_CUDA_EMULATOR=OFF")
    elif how == "CUDAARCHS":
        monkeypatch.setenv("CUDAARCHS", "90")
    else:
        settings = {"cmake.define.CMAKE_CUDA_ARCHITECTURES": "90"}
    skb = FakeSkb(cuda_fails=False)
    monkeypatch.setattr(nb, "_skb", skb)
    nb.build_wheel(str(tmp_path), settings)
    assert skb.builds[0]["NANOQ_CUDA"] == "ON" and skb.builds[0]["NANOQ_GPU_ARCHITECTURES"] == ""
    assert skb.builds[0]["NANOQ_ARCHITECTURES_NAMED"] == "ON"
    assert not nb.architectures_named({"CMAKE_ARGS": "-DNANOQ_CUDA_EMULATOR=OFF", "CUDAARCHS": ""},
                                      {"cmake.verbose": "true"})
    assert nb.architectures_named({"SKBUILD_CMAKE_DEFINE": "CMAKE_CUDA_ARCHITECTURES=90"})


CMAKE_ARCHITECTURES = ROOT / "cmake" / "cuda_architectures.cmake"


def cmake_architectures(folder: Path, defines=(), environ=None) -> str:
    """What cmake/cuda_architectures.cmake leaves in CMAKE_CUDA_ARCHITECTURES when a project
    that includes it is configured in `folder` (again, where it was before: its cache stays)."""
    cmake = shutil.which("cmake")
    assert cmake, "cmake is in the test extra (pip install '.[test]')"
    source = folder / "source"
    source.mkdir(parents=True, exist_ok=True)
    (source / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.24)\nproject(architectures LANGUAGES NONE)\n"
        f'include("{CMAKE_ARCHITECTURES.as_posix()}")\n'
        'message(NOTICE "architectures: ${CMAKE_CUDA_ARCHITECTURES}")\n')
    env = {k: v for k, v in os.environ.items() if k not in ("CUDAARCHS", "CMAKE_ARGS")}
    env.update(environ or {})
    out = subprocess.run([cmake, "-S", str(source), "-B", str(folder / "build"), *[f"-D{d}" for d in defines]],
                         env=env, capture_output=True, text=True, check=True)
    return next(line.split(": ", 1)[1] for line in out.stderr.splitlines() if line.startswith("architectures: "))


def test_cmake_builds_for_the_gpus_seen_unless_told_otherwise(tmp_path):
    assert cmake_architectures(tmp_path / "a") == "80;90"  # no GPU seen: A100, H100/H200
    assert cmake_architectures(tmp_path / "b", ["NANOQ_GPU_ARCHITECTURES=89;120"]) == "89;120"
    # The builder's own choice wins: -DCMAKE_CUDA_ARCHITECTURES (CMAKE_ARGS), else $CUDAARCHS.
    assert cmake_architectures(tmp_path / "c", ["NANOQ_GPU_ARCHITECTURES=90", "NANOQ_ARCHITECTURES_NAMED=ON",
                                                "CMAKE_CUDA_ARCHITECTURES=100"]) == "100"
    assert cmake_architectures(tmp_path / "d", ["NANOQ_GPU_ARCHITECTURES=90", "NANOQ_ARCHITECTURES_NAMED=ON"],
                               {"CUDAARCHS": "86"}) == "86"


def test_a_reused_build_folder_forgets_what_an_earlier_build_named(tmp_path):
    """pip reuses build/<wheel tag>: a value the builder named once stays in its cache, but a
    later `pip install .` that names none builds for the GPUs it sees; $CUDAARCHS is read on
    every configure, not only the folder's first (as CMake alone would); an empty one is none."""
    folder = tmp_path / "reused"
    assert cmake_architectures(folder, ["NANOQ_ARCHITECTURES_NAMED=ON", "CMAKE_CUDA_ARCHITECTURES=80"]) == "80"
    assert cmake_architectures(folder, ["NANOQ_ARCHITECTURES_NAMED=OFF", "NANOQ_GPU_ARCHITECTURES=90"]) == "90"
    assert cmake_architectures(folder, ["NANOQ_ARCHITECTURES_NAMED=ON"], {"CUDAARCHS": "86"}) == "86"
    assert cmake_architectures(folder, ["NANOQ_ARCHITECTURES_NAMED=OFF", "NANOQ_GPU_ARCHITECTURES="],
                               {"CUDAARCHS": ""}) == "80;90"


def test_an_auto_cuda_build_that_fails_builds_without_it_and_says_why(nb, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("NANOQ_CUDA", raising=False)
    monkeypatch.setattr(nb, "cuda_choice", lambda environ: nb.CudaChoice(True, True, "1 NVIDIA GPU", "/opt/nvcc"))
    skb = FakeSkb(cuda_fails=True)
    monkeypatch.setattr(nb, "_skb", skb)
    name = nb.build_wheel(str(tmp_path))
    assert [b["NANOQ_CUDA"] for b in skb.builds] == ["ON", "OFF"]
    assert skb.builds[0]["CUDACXX"] == "/opt/nvcc"  # the nvcc that was found is the one CMake uses
    assert skb.builds[1]["NANOQ_CUDA_NOTE"] == ("the cuda build failed when installing; "
                                               "NANOQ_CUDA=ON pip install -v . shows why")
    assert "cupy-cuda13x" not in read_wheel(tmp_path / name)[0].get_all("Requires-Dist")  # a cpu wheel


def test_a_cuda_build_asked_for_fails_with_its_error(nb, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("NANOQ_CUDA", "ON")
    skb = FakeSkb(cuda_fails=True)
    monkeypatch.setattr(nb, "_skb", skb)
    with pytest.raises(SystemExit, match="CMake configuration failed"):
        nb.build_wheel(str(tmp_path))
    assert len(skb.builds) == 1 and not list(tmp_path.iterdir())


def test_a_cpu_build_records_why_it_has_no_cuda_backend(nb, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(nb, "cuda_choice", lambda environ: nb.CudaChoice(False, True, "no NVIDIA GPU was seen"))
    skb = FakeSkb(cuda_fails=False)
    monkeypatch.setattr(nb, "_skb", skb)
    nb.build_wheel(str(tmp_path))
    assert skb.builds[0]["NANOQ_CUDA"] == "OFF" and skb.builds[0]["NANOQ_CUDA_NOTE"] == "no NVIDIA GPU was seen"


def test_this_install_says_why_it_has_no_cuda_backend():
    """The note of the build that made this install (CMake writes it into the package)."""
    note = backends.cuda_build_note()
    if backends._core.backend_built("cuda"):
        assert note == ""
    else:
        assert note, "a wheel built without the cuda backend records why (build_note.txt)"
        assert note in backends.cuda_unusable_reason()
        cuda = next(b for b in backends.backends() if b["name"] == "cuda")
        assert cuda["detail"] == f"not built: {note}"


FAKE_NVML = """
static int fail_init = FAIL_INIT;
static const int capability[3][2] = {{8, 0}, {9, 0}, {12, 0}};
int nvmlInit_v2(void) { return fail_init ? 9 : 0; }  /* 9: NVML_ERROR_DRIVER_NOT_LOADED */
int nvmlDeviceGetCount_v2(unsigned *count) { *count = 3; return 0; }
int nvmlShutdown(void) { return 0; }
#if CAPABILITIES
int nvmlDeviceGetHandleByIndex_v2(unsigned index, void **device) {
    if (index >= 3) return 2;  /* NVML_ERROR_INVALID_ARGUMENT */
    *device = (void *)capability[index];
    return 0;
}
int nvmlDeviceGetCudaComputeCapability(void *device, int *major, int *minor) {
    *major = ((const int *)device)[0];
    *minor = ((const int *)device)[1];
    return 0;
}
#endif
"""


@pytest.mark.parametrize("fail_init,capabilities,expected",
                         [(0, 1, [(8, 0), (9, 0), (12, 0)]), (0, 0, [None] * 3), (1, 1, [])],
                         ids=["three-gpus", "no-capabilities", "no-driver"])
def test_the_gpus_are_read_from_the_drivers_library(tmp_path, fail_init, capabilities, expected):
    """nvml_gpus on a stand-in libnvidia-ml.so.1 (three GPUs of compute capability 8.0, 9.0
    and 12.0; a driver without the capability's entry points; one that does not load),
    found as the real one is, by the dynamic loader."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
    assert compiler, "this test compiles a stand-in NVML library: it needs a C compiler (cc, gcc or g++)"
    source = tmp_path / "nvml.c"
    source.write_text(FAKE_NVML.replace("FAIL_INIT", str(fail_init)).replace("CAPABILITIES", str(capabilities)))
    subprocess.run([compiler, "-x", "c", "-shared", "-fPIC", "-o", str(tmp_path / "libnvidia-ml.so.1"), str(source)],
                   check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import nanoq_build; "
            "print(nanoq_build.nvml_gpus())")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "build_backend")], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == str(expected)


@pytest.mark.parametrize("auto", [True, False], ids=["auto", "on"])
def test_a_build_without_the_cuda_library_is_no_cuda_build(nb, monkeypatch, tmp_path, auto):
    """A configure that quietly left the cuda backend out (CMake reconfiguring without the
    build's defines, say) is a failed cuda build: AUTO falls back, ON fails."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(nb, "cuda_choice", lambda environ: nb.CudaChoice(True, auto, "asked"))
    skb = FakeSkb(cuda_fails=True, how="no library")
    monkeypatch.setattr(nb, "_skb", skb)
    if not auto:
        with pytest.raises(RuntimeError, match="the build finished without the cuda backend"):
            nb.build_wheel(str(tmp_path))
        return
    name = nb.build_wheel(str(tmp_path))
    assert [b["NANOQ_CUDA"] for b in skb.builds] == ["ON", "OFF"]
    assert "cupy-cuda13x" not in read_wheel(tmp_path / name)[0].get_all("Requires-Dist")


def test_a_patched_wheel_keeps_its_entries_and_mode(nb, tmp_path):
    """Each entry's zip attributes (an .so's permissions among them) and the file's own mode."""
    name = make_wheel(tmp_path)
    with zipfile.ZipFile(tmp_path / name, "a") as wheel:
        info = zipfile.ZipInfo("nanoq/libnanoq_core.so", date_time=(2026, 1, 2, 3, 4, 6))
        info.external_attr = 0o100755 << 16
        info.compress_type = zipfile.ZIP_STORED
        wheel.writestr(info, b"\x7fELF")
    (tmp_path / name).chmod(0o644)
    with zipfile.ZipFile(tmp_path / name) as wheel:
        before = {i.filename: (i.external_attr, i.compress_type, i.date_time) for i in wheel.infolist()}
    nb.add_requirements(tmp_path / name, ["cupy-cuda13x"])
    with zipfile.ZipFile(tmp_path / name) as wheel:
        after = {i.filename: (i.external_attr, i.compress_type, i.date_time) for i in wheel.infolist()}
    assert after == before
    assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644


@pytest.mark.gpu
def test_auto_builds_the_cuda_backend_on_a_gpu_machine(nb):
    """Where a GPU is (bench/gpu_check.sh runs the gpu tests): NVML's GPUs through ctypes are
    nvidia-ml-py's, and a plain `pip install .` would build the cuda backend with this nvcc, for
    these GPUs."""
    from conftest import nvidia_gpu_present

    if not nvidia_gpu_present():
        pytest.skip("no NVIDIA GPU on this machine")
    import pynvml

    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        expected = [tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)) for h in handles]
    finally:
        pynvml.nvmlShutdown()
    # In a process of its own: ctypes calls into the real driver's library for the first time
    # here, and a crash must not take the rest of the GPU tests with it.
    code = "import sys; sys.path.insert(0, sys.argv[1]); import nanoq_build; print(nanoq_build.nvml_gpus())"
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "build_backend")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(expected) and expected, out.stdout
    environ = {k: v for k, v in os.environ.items() if k != "NANOQ_CUDA"}
    choice = nb.cuda_choice(environ)
    assert choice.build == (nb.find_nvcc(environ) is not None), choice
    if choice.build:  # for these GPUs (an H100 or H200: "90")
        assert nb.cuda_architectures(choice.gpus, choice.nvcc) == ";".join(
            sorted({f"{major}{minor}" for major, minor in choice.gpus}, key=int)), choice
