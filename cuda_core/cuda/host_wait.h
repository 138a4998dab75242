// Pacing for the host's polling waits (a stream's completion, a nonblocking
// NCCL call's state). A host wait polls instead of blocking in the runtime
// so that it can also watch for a failed peer (see CudaBackend::host_wait):
// it spins for the first ~100 us, which keeps short waits short, then
// sleeps for growing intervals of at most 100 us, which keeps long waits
// mostly off the CPU (some 7,000 wake-ups a second, each a query) while
// finding the end of one within ~0.15 ms (Linux adds its timer slack, 50
// us by default, to each sleep): the end of update()'s wait is GPU idle
// time until the next step is queued, which a 1 ms cap made ~0.5 ms per
// optimizer step on average (about 1% of a 50 ms step; not yet measured on
// a GPU).
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
        sleep_ = std::min(sleep_ * 2, microseconds(100));
    }

private:
    std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
    std::chrono::microseconds sleep_{20};
};

}  // namespace cuda
}  // namespace nanoq
