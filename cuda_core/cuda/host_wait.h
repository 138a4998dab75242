// Pacing for the host's polling waits (a stream's completion, a nonblocking
// NCCL call's state). A host wait polls instead of blocking in the runtime
// so that it can also watch for a failed peer (see CudaBackend::host_wait):
// it spins for the first ~100 us, which keeps short waits short, then
// sleeps for growing intervals of at most 1 ms, which keeps long waits off
// the CPU.
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace nanoq {
namespace cuda {

class Backoff {
public:
    void pause() {
        using namespace std::chrono;
        if (steady_clock::now() - start_ < microseconds(100)) {
            std::this_thread::yield();
            return;
        }
        std::this_thread::sleep_for(sleep_);
        sleep_ = std::min(sleep_ * 2, microseconds(1000));
    }

private:
    std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
    std::chrono::microseconds sleep_{20};
};

}  // namespace cuda
}  // namespace nanoq
