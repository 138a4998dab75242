// Scenarios that exercise the emulator's stream capture and graphs, run by
// tests/test_cuda_graphs.py through the one exported function below: a
// capture that forks onto a second stream and joins back, replayed, and the
// calls CUDA forbids during a capture, each of which must fail the call and
// then the capture. Compiled into the emulated backend only.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/kernel_utils.cuh"

namespace nanoq {
namespace cuda {
namespace {

constexpr int kThreads = 64;
std::string forbidden_message;  // the forbidden call's error text

__global__ void add_kernel(int* data, int value) { data[threadIdx.x] += value; }
__global__ void twice_kernel(int* out, const int* in) { out[threadIdx.x] = 2 * in[threadIdx.x]; }

struct Streams {
    cudaStream_t main = nullptr, side = nullptr;
    cudaEvent_t fork = nullptr, join = nullptr;
    int* data = nullptr;  // [2 * kThreads]: the main stream's half, then the side stream's
    Streams() {
        cudaStreamCreateWithFlags(&main, cudaStreamNonBlocking);
        cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
        cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
        cudaEventCreateWithFlags(&join, cudaEventDisableTiming);
        cudaMalloc(&data, sizeof(int) * 2 * kThreads);
        cudaMemsetAsync(data, 0, sizeof(int) * 2 * kThreads, main);
        cudaStreamSynchronize(main);
    }
    ~Streams() {
        cudaFree(data);
        cudaEventDestroy(fork);
        cudaEventDestroy(join);
        cudaStreamDestroy(side);
        cudaStreamDestroy(main);
    }
    int read(int at) {
        int value = 0;
        cudaMemcpy(&value, data + at, sizeof(int), cudaMemcpyDeviceToHost);
        return value;
    }
};

// main: +1, fork; side: twice into its half; join; main: +100. Replayed
// three times: the main half ends at 303 and the side half at 2 * 203.
cudaError_t replay(int* out) {
    Streams s;
    if (cudaError_t e = cudaStreamBeginCapture(s.main, cudaStreamCaptureModeGlobal)) return e;
    detail::launch(add_kernel, 1, kThreads, 0, s.main, s.data, 1);
    cudaEventRecord(s.fork, s.main);
    cudaStreamWaitEvent(s.side, s.fork, 0);
    cudaStreamCaptureStatus side_status = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(s.side, &side_status);
    detail::launch(twice_kernel, 1, kThreads, 0, s.side, s.data + kThreads, s.data);
    cudaEventRecord(s.join, s.side);
    cudaStreamWaitEvent(s.main, s.join, 0);
    detail::launch(add_kernel, 1, kThreads, 0, s.main, s.data, 100);
    cudaGraph_t graph = nullptr;
    if (cudaError_t e = cudaStreamEndCapture(s.main, &graph)) return e;
    cudaStreamCaptureStatus after = cudaStreamCaptureStatusActive;
    cudaStreamIsCapturing(s.side, &after);
    if (cudaError_t e = cudaStreamSynchronize(s.main)) return e;
    out[0] = s.read(0);  // nothing ran: it was recorded
    cudaGraphExec_t exec = nullptr;
    if (cudaError_t e = cudaGraphInstantiate(&exec, graph, 0)) return e;
    cudaGraphDestroy(graph);  // the executable graph keeps what it needs
    for (int i = 0; i < 3; ++i)
        if (cudaError_t e = cudaGraphLaunch(exec, s.main)) return e;
    if (cudaError_t e = cudaStreamSynchronize(s.main)) return e;
    cudaGraphExecDestroy(exec);
    out[1] = s.read(0);
    out[2] = s.read(kThreads);
    out[3] = side_status;
    out[4] = after;
    return cudaSuccess;
}

// Begins a capture of `mode` on s.main with one kernel and one piece of
// work holding a token in it, runs `illegal` (whose error is returned),
// then ends the capture: out[0] gets the end's error, out[1] whether a
// graph came back and out[2] whether the recorded work is still held once
// the graph is destroyed (a capture that failed must let go of it at once:
// its collectives hold their NCCL communicator, whose abort waits for them).
template <class Illegal>
cudaError_t forbidden(int* out, cudaStreamCaptureMode mode, Illegal&& illegal) {
    Streams s;
    if (cudaError_t e = cudaStreamBeginCapture(s.main, mode)) return e;
    detail::launch(add_kernel, 1, kThreads, 0, s.main, s.data, 1);
    auto token = std::make_shared<int>(0);
    nanoq_emu::enqueue(s.main, [token] {}, "token holder");
    const cudaError_t status = illegal(s);
    forbidden_message = status == cudaSuccess ? "" : cudaGetErrorString(status);
    cudaGraph_t graph = nullptr;
    out[0] = cudaStreamEndCapture(s.main, &graph);
    out[1] = graph != nullptr;
    if (graph) cudaGraphDestroy(graph);
    out[2] = token.use_count() > 1;
    cudaGetLastError();
    return status;
}

cudaError_t run(const std::string& test, int* out) {
    const auto thread_local_mode = cudaStreamCaptureModeThreadLocal;
    if (test == "replay") return replay(out);
    if (test == "stream_synchronize")
        return forbidden(out, thread_local_mode, [](Streams& s) { return cudaStreamSynchronize(s.main); });
    if (test == "stream_query")
        return forbidden(out, thread_local_mode, [](Streams& s) { return cudaStreamQuery(s.main); });
    if (test == "device_synchronize")
        return forbidden(out, cudaStreamCaptureModeRelaxed, [](Streams&) { return cudaDeviceSynchronize(); });
    if (test == "event_query")
        return forbidden(out, thread_local_mode, [](Streams& s) {
            cudaEventRecord(s.fork, s.main);
            return cudaEventQuery(s.fork);
        });
    if (test == "event_synchronize")
        return forbidden(out, thread_local_mode, [](Streams& s) {
            cudaEventRecord(s.fork, s.main);
            return cudaEventSynchronize(s.fork);
        });
    if (test == "memcpy")
        return forbidden(out, thread_local_mode, [](Streams& s) {
            int value = 0;
            return cudaMemcpy(&value, s.data, sizeof(int), cudaMemcpyDeviceToHost);
        });
    if (test == "pageable_copy")
        return forbidden(out, cudaStreamCaptureModeRelaxed, [](Streams& s) {
            std::vector<int> host(kThreads);
            return cudaMemcpyAsync(host.data(), s.data, sizeof(int) * kThreads, cudaMemcpyDeviceToHost, s.main);
        });
    if (test == "malloc_global")
        return forbidden(out, cudaStreamCaptureModeGlobal, [](Streams&) {
            void* p = nullptr;
            return cudaMalloc(&p, 256);
        });
    if (test == "malloc_relaxed")  // allowed: out[0] is then the end's success
        return forbidden(out, cudaStreamCaptureModeRelaxed, [](Streams&) {
            void* p = nullptr;
            return cudaMalloc(&p, 256);  // freed with the emulator's memory at exit: 256 bytes
        });
    if (test == "unjoined")
        return forbidden(out, thread_local_mode, [](Streams& s) {
            cudaEventRecord(s.fork, s.main);
            cudaStreamWaitEvent(s.side, s.fork, 0);
            detail::launch(twice_kernel, 1, kThreads, 0, s.side, s.data + kThreads, s.data);
            return cudaSuccess;  // the side stream's kernel is never joined
        });
    if (test == "outside_event")
        return forbidden(out, thread_local_mode, [](Streams& s) {
            cudaEventRecord(s.join, s.side);  // not captured
            return cudaStreamWaitEvent(s.main, s.join, 0);
        });
    return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace cuda
}  // namespace nanoq

// Runs scenario `name` and returns its CUDA error code (the forbidden call's
// in the error scenarios), `message` its text; out[0..4] as described above.
extern "C" __attribute__((visibility("default"))) int nanoq_emu_graph_selftest(const char* name, int* out,
                                                                                char* message, int message_bytes) {
    nanoq::cuda::forbidden_message.clear();
    const cudaError_t status = nanoq::cuda::run(name, out);
    const std::string text = !nanoq::cuda::forbidden_message.empty() ? nanoq::cuda::forbidden_message
                             : status == cudaSuccess                 ? std::string()
                                                                     : std::string(cudaGetErrorString(status));
    std::strncpy(message, text.c_str(), message_bytes - 1);
    message[message_bytes - 1] = 0;
    return static_cast<int>(status);
}
