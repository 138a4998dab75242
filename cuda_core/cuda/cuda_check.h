// Error checks for CUDA, cuBLASLt and NCCL calls: failures become NanoqError
// with the library's message and the call site.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "nanoq/errors.h"

namespace nanoq {
namespace cuda {

inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
    if (status == cudaSuccess) return;
    // The runtime may also keep it as the thread's last error, for the next
    // launch check to report again as its own: this call's, so cleared (an
    // error that sticks to the context, a fault, stays).
    cudaGetLastError();
    throw NanoqError(std::string("CUDA error: ") + cudaGetErrorString(status) + " in " + call + " (" + file + ":" +
                     std::to_string(line) + ")");
}

}  // namespace cuda
}  // namespace nanoq

#define NANOQ_CUDA_CHECK(call) ::nanoq::cuda::check_cuda((call), #call, __FILE__, __LINE__)
// After a kernel launch: configuration errors surface here, execution errors
// at the next synchronize().
#define NANOQ_CUDA_CHECK_LAUNCH() ::nanoq::cuda::check_cuda(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
