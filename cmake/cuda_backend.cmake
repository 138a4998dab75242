# The cuda backend: libnanoq_cuda.so beside libnanoq_core.so, loaded by the
# core only when the cuda backend is asked for.
#
# nvcc comes from the CUDA toolkit; cuBLASLt and NCCL from the nvidia pip
# wheels (nvidia-cublas, nvidia-nccl-cu13) of the Python that builds, so build
# with --no-build-isolation; cuDNN too where its wheels are there (below).
# The architectures: cmake/cuda_architectures.cmake.
set(NANOQ_GPU_ARCHITECTURES "" CACHE STRING "CUDA architectures of the GPUs seen when building (set by the build backend)")
set(NANOQ_ARCHITECTURES_NAMED "" CACHE STRING "ON/OFF: whether the builder named CUDA architectures (set by the build backend)")
include(cmake/cuda_architectures.cmake)
set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
# CMake reads $CUDACXX only while no CUDA compiler is in the build folder's
# cache, so a build asked for with another nvcc (build_backend/nanoq_build.py
# sets $CUDACXX to the one it found) would silently use the old one: refuse.
if(DEFINED CACHE{CMAKE_CUDA_COMPILER} AND DEFINED ENV{CUDACXX})
  file(REAL_PATH "$ENV{CUDACXX}" NANOQ_ASKED_NVCC)
  file(REAL_PATH "${CMAKE_CUDA_COMPILER}" NANOQ_CACHED_NVCC)
  if(NOT NANOQ_ASKED_NVCC STREQUAL NANOQ_CACHED_NVCC)
    message(FATAL_ERROR "nanoq: the build folder ${CMAKE_BINARY_DIR} was configured with the CUDA compiler "
                        "${CMAKE_CUDA_COMPILER}, and CMake keeps it over CUDACXX=$ENV{CUDACXX}: delete that "
                        "folder to build with the other")
  endif()
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import nvidia.nccl, nvidia.cu13; print(nvidia.nccl.__path__[0]); print(nvidia.cu13.__path__[0])"
  OUTPUT_VARIABLE NANOQ_NVIDIA_WHEELS OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE NANOQ_NVIDIA_FOUND)
if(NOT NANOQ_NVIDIA_FOUND EQUAL 0)
  message(FATAL_ERROR "NANOQ_CUDA=ON needs the nvidia wheels in the building Python: "
                      "pip install nvidia-nccl-cu13 nvidia-cublas nvidia-cuda-runtime, "
                      "then pip install --no-build-isolation .")
endif()
string(REPLACE "\n" ";" NANOQ_NVIDIA_WHEELS "${NANOQ_NVIDIA_WHEELS}")
list(GET NANOQ_NVIDIA_WHEELS 0 NANOQ_NCCL_ROOT)
list(GET NANOQ_NVIDIA_WHEELS 1 NANOQ_CU13_ROOT)

# The cu13 wheel also carries CUDA runtime headers newer than nvcc's; expose
# only the cuBLAS ones so they cannot shadow the toolkit's.
set(NANOQ_CUBLAS_INCLUDE "${CMAKE_CURRENT_BINARY_DIR}/cublas_include")
file(MAKE_DIRECTORY "${NANOQ_CUBLAS_INCLUDE}")
file(GLOB NANOQ_CUBLAS_HEADERS "${NANOQ_CU13_ROOT}/include/cublas*.h")
foreach(header ${NANOQ_CUBLAS_HEADERS})
  get_filename_component(name "${header}" NAME)
  file(CREATE_LINK "${header}" "${NANOQ_CUBLAS_INCLUDE}/${name}" SYMBOLIC)
endforeach()

add_library(nanoq_cublaslt SHARED IMPORTED)
set_target_properties(nanoq_cublaslt PROPERTIES
  IMPORTED_LOCATION "${NANOQ_CU13_ROOT}/lib/libcublasLt.so.13"
  INTERFACE_INCLUDE_DIRECTORIES "${NANOQ_CUBLAS_INCLUDE}")
add_library(nanoq_nccl SHARED IMPORTED)
set_target_properties(nanoq_nccl PROPERTIES
  IMPORTED_LOCATION "${NANOQ_NCCL_ROOT}/lib/libnccl.so.2"
  INTERFACE_INCLUDE_DIRECTORIES "${NANOQ_NCCL_ROOT}/include")

# cuDNN's fused attention, optional: libcudnn and its headers from the
# nvidia-cudnn-cu13 wheel, the frontend's header-only graph API from the
# nvidia-cudnn-frontend wheel (its headers install into site-packages'
# include/, found through the distribution's file list), and nvrtc.h, which
# the frontend includes, from the toolkit or the nvidia-cuda-nvrtc wheel.
# Without any of them the backend builds without cuDNN (attention runs in
# the native kernels; attention="cudnn" is refused).
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c [=[
import importlib.metadata as metadata, os, sys
try:
    import nvidia.cudnn
    header = metadata.distribution("nvidia-cudnn-frontend").locate_file("include/cudnn_frontend.h")
except metadata.PackageNotFoundError:  # before ImportError, its base class
    sys.exit("no nvidia-cudnn-frontend distribution in this Python")
except ImportError:
    sys.exit("no nvidia.cudnn (the nvidia-cudnn-cu13 wheel) in this Python")
if not os.path.isfile(header):
    sys.exit("the nvidia-cudnn-frontend distribution has no include/cudnn_frontend.h")
print(nvidia.cudnn.__path__[0])
print(os.path.dirname(os.path.abspath(header)))
]=]
  OUTPUT_VARIABLE NANOQ_CUDNN_WHEELS ERROR_VARIABLE NANOQ_CUDNN_ERROR
  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE NANOQ_CUDNN_FOUND)
set(NANOQ_CUDNN OFF)
if(NANOQ_CUDNN_FOUND EQUAL 0)
  string(REPLACE "\n" ";" NANOQ_CUDNN_WHEELS "${NANOQ_CUDNN_WHEELS}")
  list(GET NANOQ_CUDNN_WHEELS 0 NANOQ_CUDNN_ROOT)
  list(GET NANOQ_CUDNN_WHEELS 1 NANOQ_CUDNN_FRONTEND_INCLUDE)
  find_file(NANOQ_NVRTC_HEADER nvrtc.h PATHS ${CUDAToolkit_INCLUDE_DIRS} "${NANOQ_CU13_ROOT}/include" NO_DEFAULT_PATH)
  # The frontend calls nvrtc itself (its Hopper engines are compiled at run
  # time): linked, so that the library names it as needed rather than
  # leaving its symbols for whatever was loaded before.
  # The wheel's first (the run path below finds it beside nanoq), then the toolkit's.
  find_library(NANOQ_NVRTC_LIBRARY NAMES libnvrtc.so.13 nvrtc NAMES_PER_DIR
               PATHS "${NANOQ_CU13_ROOT}/lib" ${CUDAToolkit_LIBRARY_DIR} NO_DEFAULT_PATH)
  if(NOT EXISTS "${NANOQ_CUDNN_ROOT}/lib/libcudnn.so.9")
    message(NOTICE "nanoq: building the cuda backend without cuDNN: no libcudnn.so.9 in ${NANOQ_CUDNN_ROOT}/lib")
  elseif(NOT NANOQ_NVRTC_HEADER OR NOT NANOQ_NVRTC_LIBRARY)
    set(NANOQ_NVRTC_MISSING "")
    if(NOT NANOQ_NVRTC_HEADER)
      list(APPEND NANOQ_NVRTC_MISSING "nvrtc.h")
    endif()
    if(NOT NANOQ_NVRTC_LIBRARY)
      list(APPEND NANOQ_NVRTC_MISSING "libnvrtc")
    endif()
    string(REPLACE ";" " and " NANOQ_NVRTC_MISSING "${NANOQ_NVRTC_MISSING}")
    message(NOTICE "nanoq: building the cuda backend without cuDNN: the cuDNN frontend needs nvrtc, and "
                   "${NANOQ_NVRTC_MISSING} was found neither in the CUDA toolkit nor in the nvidia-cuda-nvrtc "
                   "wheel (pip install nvidia-cuda-nvrtc)")
  else()
    set(NANOQ_CUDNN ON)
  endif()
else()
  message(NOTICE "nanoq: building the cuda backend without cuDNN (attention runs in the native kernels): "
                 "pip install nvidia-cudnn-cu13, pip install --no-deps nvidia-cudnn-frontend, then rebuild with "
                 "--no-build-isolation (${NANOQ_CUDNN_ERROR})")
endif()
if(NANOQ_CUDNN)
  # The frontend's headers include each other as "../include/...", so they
  # are linked into a folder named include; only they and nvrtc.h are, so
  # that nothing else of site-packages' include/ or of the cu13 wheel's
  # (its newer CUDA runtime headers) can shadow the toolkit's.
  set(NANOQ_CUDNN_INCLUDE "${CMAKE_CURRENT_BINARY_DIR}/cudnn_frontend/include")
  file(MAKE_DIRECTORY "${NANOQ_CUDNN_INCLUDE}")
  file(GLOB NANOQ_CUDNN_FRONTEND_ENTRIES "${NANOQ_CUDNN_FRONTEND_INCLUDE}/cudnn_frontend*"
       "${NANOQ_CUDNN_FRONTEND_INCLUDE}/cudnn_backend_base.h")
  foreach(entry ${NANOQ_CUDNN_FRONTEND_ENTRIES} "${NANOQ_NVRTC_HEADER}")
    get_filename_component(name "${entry}" NAME)
    file(CREATE_LINK "${entry}" "${NANOQ_CUDNN_INCLUDE}/${name}" SYMBOLIC)
  endforeach()
  add_library(nanoq_cudnn SHARED IMPORTED)
  set_target_properties(nanoq_cudnn PROPERTIES
    IMPORTED_LOCATION "${NANOQ_CUDNN_ROOT}/lib/libcudnn.so.9"
    INTERFACE_INCLUDE_DIRECTORIES "${NANOQ_CUDNN_INCLUDE};${NANOQ_CUDNN_ROOT}/include")
  set(NANOQ_ATTENTION_ENGINE cuda_core/cuda/cudnn_attention.cpp)
  message(STATUS "nanoq: the cuda backend's attention uses cuDNN from ${NANOQ_CUDNN_ROOT}")
else()
  set(NANOQ_ATTENTION_ENGINE cuda_core/cuda/no_attention_engine.cpp)
endif()

file(GLOB NANOQ_CUDA_KERNELS "${CMAKE_CURRENT_SOURCE_DIR}/cuda_core/cuda/kernels_*.cu")
add_library(nanoq_cuda SHARED
  cuda_core/cuda/cuda_backend.cpp
  cuda_core/cuda/cublaslt_matmul.cpp
  cuda_core/cuda/fused_attention.cpp
  ${NANOQ_ATTENTION_ENGINE}
  cuda_core/cuda/nccl_communicator.cpp
  ${NANOQ_CUDA_KERNELS})
target_link_libraries(nanoq_cuda PRIVATE nanoq_core CUDA::cudart nanoq_cublaslt nanoq_nccl)
# The architectures built: in the backend's error on a GPU it has no code
# for, and in the package for nanoq.backends to say (nanoq info).
# (For this target's C++ only: nvcc is said to read the commas of a -D value
# as a list; and not as a property of cuda_backend.cpp, which the emulated
# backend compiles too, with its own value.)
string(REPLACE ";" "," NANOQ_BUILT_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
target_compile_definitions(nanoq_cuda PRIVATE
  "$<$<COMPILE_LANGUAGE:CXX>:NANOQ_CUDA_ARCHITECTURES=\"${NANOQ_BUILT_ARCHITECTURES}\">")
file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/cuda_architectures.txt" "${NANOQ_BUILT_ARCHITECTURES}")
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/cuda_architectures.txt" DESTINATION nanoq)
message(STATUS "nanoq: the cuda backend is built for CUDA architectures ${NANOQ_BUILT_ARCHITECTURES}")
if(NANOQ_CUDNN)
  target_link_libraries(nanoq_cuda PRIVATE nanoq_cudnn "${NANOQ_NVRTC_LIBRARY}")
  # The frontend is header-only and large: warnings of ours only, and -O1
  # (after the target's -O3): this file only builds graphs, once per shape,
  # and is the longest compile of the build (measured 110 s at -O3, 73 s at
  # -O1, on one core), which the GPU machine's build time limit must hold.
  set_source_files_properties(cuda_core/cuda/cudnn_attention.cpp PROPERTIES COMPILE_OPTIONS "-Wno-unused-parameter;-O1")
endif()
target_compile_options(nanoq_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -O3>
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 --threads 2>)
# The nvidia wheels' libraries are preloaded by nanoq.backends; the RPATH
# finds them when nanoq and the wheels share a site-packages.
set(NANOQ_CUDA_RPATH "$ORIGIN;$ORIGIN/../nvidia/cu13/lib;$ORIGIN/../nvidia/nccl/lib;$ORIGIN/../nvidia/cudnn/lib")
if(NANOQ_CUDNN)
  # nvrtc from the toolkit rather than the wheel: its folder too, where nothing else would look.
  get_filename_component(NANOQ_NVRTC_DIR "${NANOQ_NVRTC_LIBRARY}" DIRECTORY)
  if(NOT NANOQ_NVRTC_DIR STREQUAL "${NANOQ_CU13_ROOT}/lib")
    list(APPEND NANOQ_CUDA_RPATH "${NANOQ_NVRTC_DIR}")
  endif()
endif()
set_target_properties(nanoq_cuda PROPERTIES INSTALL_RPATH "${NANOQ_CUDA_RPATH}")
install(TARGETS nanoq_cuda LIBRARY DESTINATION nanoq)
