# The CUDA architectures the cuda backend is compiled for: the first given of
#   1. the builder's own: CMAKE_CUDA_ARCHITECTURES (-D, also through $CMAKE_ARGS
#      or pip's --config-settings), else $CUDAARCHS;
#   2. NANOQ_GPU_ARCHITECTURES: the compute capabilities of the GPUs the build
#      saw, e.g. "90" or "80;90" (build_backend/nanoq_build.py sets it from
#      NVML), so that `pip install .` compiles for the machine's own GPUs;
#   3. 80;90: A100 and H100/H200, where no GPU was seen (CI, a login node).
# Each "XY" compiles sm_XY code and compute_XY PTX, which the driver compiles
# for any newer GPU when loading; an older GPU has no code to run.
#
# A -D value stays in the build folder's cache, and pip reuses the folder:
# where the build backend says the builder named none this time
# (NANOQ_ARCHITECTURES_NAMED=OFF), a value cached by an earlier build does not
# count. $CUDAARCHS is read here on every configure (CMake itself reads it only
# on a folder's first). Included by cuda_backend.cmake before
# enable_language(CUDA); tests/test_build_backend.py configures it in a
# project of its own.
if(NANOQ_ARCHITECTURES_NAMED STREQUAL "OFF")
  unset(CMAKE_CUDA_ARCHITECTURES CACHE)
  unset(CMAKE_CUDA_ARCHITECTURES)
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  if(NOT "$ENV{CUDAARCHS}" STREQUAL "")
    set(CMAKE_CUDA_ARCHITECTURES $ENV{CUDAARCHS})
  elseif(NANOQ_GPU_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES ${NANOQ_GPU_ARCHITECTURES})
  else()
    set(CMAKE_CUDA_ARCHITECTURES 80 90)
  endif()
endif()
