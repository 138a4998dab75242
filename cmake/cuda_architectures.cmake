# The CUDA architectures the cuda backend is compiled for: the first given of
#   1. CMAKE_CUDA_ARCHITECTURES (-D, also through $CMAKE_ARGS) or $CUDAARCHS,
#      as CMake takes them (left to it here);
#   2. NANOQ_GPU_ARCHITECTURES: the compute capabilities of the GPUs the build
#      saw, e.g. "90" or "80;90" (build_backend/nanoq_build.py sets it from
#      NVML), so that `pip install .` compiles for the machine's own GPUs;
#   3. 80;90: A100 and H100/H200, where no GPU was seen (CI, a login node).
# Each "XY" compiles sm_XY code and compute_XY PTX, which the driver compiles
# for any newer GPU when loading; an older GPU has no code to run.
# Included by cuda_backend.cmake before enable_language(CUDA);
# tests/test_build_backend.py runs it in script mode (cmake -P).
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
  if(NANOQ_GPU_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES ${NANOQ_GPU_ARCHITECTURES})
  else()
    set(CMAKE_CUDA_ARCHITECTURES 80 90)
  endif()
endif()
