# The cuda backend built for the CPU emulator: libnanoq_cuda_emulated.so,
# registering the backend "cuda_emulated". The same sources as the real cuda
# backend (kernels_*.cu, cuda_backend.cpp, cublaslt_matmul.cpp,
# nccl_communicator.cpp, fused_attention.cpp) compile with the host C++ compiler against the
# emulator's headers (cuda_core/cuda/emulator: cuda_runtime.h, cuda_bf16.h,
# cublasLt.h, nccl.h, cub; emu_attention.cpp stands in for cuDNN's fused
# attention), so the tests run every kernel and whole training
# steps of the cuda backend's code on any machine. No CUDA toolkit is needed.
#
# Every symbol of the library is hidden: its cuda*/nccl*/cublasLt* functions
# and its copy of the nanoq::cuda code can never bind to (or be bound by) the
# real CUDA libraries or libnanoq_cuda.so loaded into the same process.
set(NANOQ_EMU_DIR "${CMAKE_CURRENT_SOURCE_DIR}/cuda_core/cuda/emulator")
file(GLOB NANOQ_EMU_KERNELS "${CMAKE_CURRENT_SOURCE_DIR}/cuda_core/cuda/kernels_*.cu")
set(NANOQ_EMU_KERNEL_UNITS "")
foreach(kernel ${NANOQ_EMU_KERNELS})
  get_filename_component(stem "${kernel}" NAME_WE)
  set(unit "${CMAKE_CURRENT_BINARY_DIR}/emulated/${stem}.cpp")
  file(CONFIGURE OUTPUT "${unit}" CONTENT "// Generated: ${stem}.cu compiled for the CUDA emulator.\n#include \"${kernel}\"\n")
  list(APPEND NANOQ_EMU_KERNEL_UNITS "${unit}")
endforeach()

add_library(nanoq_cuda_emulated SHARED
  ${NANOQ_EMU_DIR}/emulator.cpp
  ${NANOQ_EMU_DIR}/emu_libraries.cpp
  ${NANOQ_EMU_DIR}/selftest.cpp
  ${NANOQ_EMU_DIR}/emu_attention.cpp
  ${NANOQ_EMU_DIR}/backend_probes.cpp
  ${NANOQ_EMU_DIR}/graph_selftest.cpp
  cuda_core/cuda/cuda_backend.cpp
  cuda_core/cuda/fused_attention.cpp
  cuda_core/cuda/cublaslt_matmul.cpp
  cuda_core/cuda/nccl_communicator.cpp
  ${NANOQ_EMU_KERNEL_UNITS})
target_include_directories(nanoq_cuda_emulated BEFORE PRIVATE "${NANOQ_EMU_DIR}" cuda_core)
# As if built for sm_90 (the emulated devices are Hopper's by default): a test
# that sets another compute capability sees what an unbuilt GPU would.
target_compile_definitions(nanoq_cuda_emulated PRIVATE NANOQ_CUDA_EMULATED=1
                           NANOQ_CUDA_BACKEND_NAME="cuda_emulated" NANOQ_CUDA_ARCHITECTURES="90")
target_link_libraries(nanoq_cuda_emulated PRIVATE nanoq_core Threads::Threads)
# The default (dynamic) TLS model: initial-exec would be ~10% faster but can
# make dlopen fail ("cannot allocate memory in static TLS block") in a process
# that has loaded many libraries already (torch, cupy).
target_compile_options(nanoq_cuda_emulated PRIVATE -O2 -Wall -Wextra -Wno-unknown-pragmas -Wno-unused-parameter -Wno-subobject-linkage)
set_target_properties(nanoq_cuda_emulated PROPERTIES
  CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON INSTALL_RPATH "$ORIGIN")
target_link_options(nanoq_cuda_emulated PRIVATE -Wl,-Bsymbolic -Wl,--exclude-libs,ALL)
install(TARGETS nanoq_cuda_emulated LIBRARY DESTINATION nanoq)
