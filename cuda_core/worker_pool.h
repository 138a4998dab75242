// One thread per device, fed from the caller's thread.
//
// run() hands the same task to every worker and blocks (on a condition
// variable, never spinning) until all have finished. A worker that throws
// calls `on_failure(rank)` at once, on its own thread, so that ranks blocked
// in a collective are released, and run() rethrows the root cause to the
// caller. Calls from several threads are served one after the other.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace nanoq {

class WorkerPool {
public:
    explicit WorkerPool(int size);
    ~WorkerPool();
    WorkerPool(const WorkerPool&) = delete;
    WorkerPool& operator=(const WorkerPool&) = delete;

    int size() const { return static_cast<int>(threads_.size()); }
    void run(const std::function<void(int rank)>& task, const std::function<void(int rank)>& on_failure);

private:
    void loop(int rank);

    std::vector<std::thread> threads_;
    std::mutex call_mutex_;  // one run() at a time, whichever thread calls
    std::mutex mutex_;
    std::condition_variable work_ready_;
    std::condition_variable work_done_;
    const std::function<void(int)>* task_ = nullptr;
    const std::function<void(int)>* on_failure_ = nullptr;
    long generation_ = 0;
    int pending_ = 0;
    bool stopping_ = false;
    std::vector<std::exception_ptr> errors_;
};

}  // namespace nanoq
