# The cuda backend: libnanoq_cuda.so beside libnanoq_core.so, loaded by the
# core only when the cuda backend is asked for.
#
# nvcc comes from the CUDA toolkit; cuBLASLt and NCCL from the nvidia pip
# wheels (nvidia-cublas, nvidia-nccl-cu13) of the Python that builds, so build
# with --no-build-isolation. Architectures: CMAKE_CUDA_ARCHITECTURES
# (default 80;90, i.e. A100 and H100/H200).
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 80 90)
endif()
set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
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

file(GLOB NANOQ_CUDA_KERNELS "${CMAKE_CURRENT_SOURCE_DIR}/cuda_core/cuda/kernels_*.cu")
add_library(nanoq_cuda SHARED
  cuda_core/cuda/cuda_backend.cpp
  cuda_core/cuda/cublaslt_matmul.cpp
  cuda_core/cuda/nccl_communicator.cpp
  ${NANOQ_CUDA_KERNELS})
target_link_libraries(nanoq_cuda PRIVATE nanoq_core CUDA::cudart nanoq_cublaslt nanoq_nccl)
target_compile_options(nanoq_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -O3>
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 --threads 2>)
# The nvidia wheels' libraries are preloaded by nanoq.backends; the RPATH
# finds them when nanoq and the wheels share a site-packages.
set_target_properties(nanoq_cuda PROPERTIES
  INSTALL_RPATH "$ORIGIN;$ORIGIN/../nvidia/cu13/lib;$ORIGIN/../nvidia/nccl/lib")
install(TARGETS nanoq_cuda LIBRARY DESTINATION nanoq)
