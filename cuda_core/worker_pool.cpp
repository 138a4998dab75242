#include "worker_pool.h"

#include "nanoq/errors.h"

namespace nanoq {

WorkerPool::WorkerPool(int size) : errors_(size) {
    for (int rank = 0; rank < size; ++rank) threads_.emplace_back([this, rank] { loop(rank); });
}

WorkerPool::~WorkerPool() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    work_ready_.notify_all();
    for (std::thread& t : threads_) t.join();
}

void WorkerPool::run(const std::function<void(int)>& task, const std::function<void(int)>& on_failure) {
    std::lock_guard<std::mutex> one_call(call_mutex_);
    std::unique_lock<std::mutex> lock(mutex_);
    task_ = &task;
    on_failure_ = &on_failure;
    pending_ = size();
    for (auto& e : errors_) e = nullptr;
    ++generation_;
    work_ready_.notify_all();
    work_done_.wait(lock, [&] { return pending_ == 0; });
    task_ = nullptr;
    on_failure_ = nullptr;

    // Prefer the root cause over the ranks that were merely aborted.
    std::exception_ptr first_aborted;
    for (const auto& e : errors_) {
        if (!e) continue;
        try {
            std::rethrow_exception(e);
        } catch (const WorkerAborted&) {
            if (!first_aborted) first_aborted = e;
        } catch (...) {
            std::rethrow_exception(e);
        }
    }
    if (first_aborted) std::rethrow_exception(first_aborted);
}

void WorkerPool::loop(int rank) {
    long seen = 0;
    for (;;) {
        const std::function<void(int)>* task;
        const std::function<void(int)>* on_failure;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen; });
            if (stopping_) return;
            seen = generation_;
            task = task_;
            on_failure = on_failure_;
        }
        std::exception_ptr error;
        try {
            (*task)(rank);
        } catch (...) {
            error = std::current_exception();
            try {
                (*on_failure)(rank);
            } catch (...) {
            }
        }
        std::lock_guard<std::mutex> lock(mutex_);
        errors_[rank] = error;
        if (--pending_ == 0) work_done_.notify_all();
    }
}

}  // namespace nanoq
