#include "worker_pool.h"

#include <algorithm>
#include <new>

#include "nanoq/errors.h"

namespace nanoq {

WorkerPool::WorkerPool(int size, Task on_failure)
    : on_failure_(std::move(on_failure)),
      queues_(size),
      busy_(size, false),
      finished_(size, 0),
      started_(size, 0),
      failure_seen_(size, false),
      failures_(size) {
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

long WorkerPool::submit(Task task, std::string label) {
    auto shared_task = std::make_shared<const Task>(std::move(task));
    auto shared_label = std::make_shared<const std::string>(std::move(label));
    long ticket;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        ticket = next_ticket_++;
        for (auto& queue : queues_) queue.push_back(Queued{shared_task, shared_label, ticket});
    }
    work_ready_.notify_all();
    return ticket;
}

bool WorkerPool::idle() const {
    for (int rank = 0; rank < size(); ++rank) {
        if (busy_[rank] || !queues_[rank].empty()) return false;
        if (failed_ && !failure_seen_[rank]) return false;
    }
    return true;
}

void WorkerPool::wait() {
    Failure reported;
    {
        std::unique_lock<std::mutex> lock(mutex_);
        work_done_.wait(lock, [&] { return idle(); });
        if (!failed_) return;
        // Prefer the root cause over the ranks that were merely aborted.
        int chosen = -1;
        for (int rank = 0; rank < size() && chosen < 0; ++rank) {
            if (!failures_[rank].error) continue;
            try {
                std::rethrow_exception(failures_[rank].error);
            } catch (const WorkerAborted&) {
            } catch (...) {
                chosen = rank;
            }
        }
        for (int rank = 0; rank < size() && chosen < 0; ++rank)
            if (failures_[rank].error) chosen = rank;
        reported = failures_[chosen];
        const int rank = chosen;
        failed_ = false;
        std::fill(failure_seen_.begin(), failure_seen_.end(), false);
        for (Failure& f : failures_) f = Failure{};
        if (reported.label && !reported.label->empty())
            rethrow_with_prefix(reported.error, *reported.label + " failed on device " + std::to_string(rank) + ": ");
    }
    std::rethrow_exception(reported.error);
}

bool WorkerPool::wait_for(long ticket) {
    std::unique_lock<std::mutex> lock(mutex_);
    work_done_.wait(lock, [&] {
        return failed_ || std::all_of(finished_.begin(), finished_.end(), [&](long t) { return t >= ticket; });
    });
    return !failed_;
}

bool WorkerPool::failed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return failed_;
}

bool WorkerPool::wait_idle_for(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    return work_done_.wait_for(lock, timeout, [&] { return idle(); });
}

bool WorkerPool::wait_for_within(long ticket, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    return work_done_.wait_for(lock, timeout, [&] {
        return failed_ || std::all_of(finished_.begin(), finished_.end(), [&](long t) { return t >= ticket; });
    });
}

long WorkerPool::drop_unstarted() {
    static const auto nothing = std::make_shared<const Task>([](int) {});
    std::lock_guard<std::mutex> lock(mutex_);
    // Tickets up to the newest one any worker has begun must run everywhere.
    const long first_dropped = *std::max_element(started_.begin(), started_.end()) + 1;
    long last_dropped = first_dropped - 1;
    for (auto& queue : queues_)
        for (Queued& queued : queue)
            if (queued.ticket >= first_dropped) {
                queued.task = nothing;
                last_dropped = std::max(last_dropped, queued.ticket);
            }
    return last_dropped - first_dropped + 1;
}

void WorkerPool::loop(int rank) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        work_ready_.wait(lock, [&] {
            return stopping_ || !queues_[rank].empty() || (failed_ && !failure_seen_[rank]);
        });
        if (stopping_) return;
        if (failed_) {
            // Work queued behind a failure is dropped; this rank abandons its
            // collectives (its device may hold some that a peer never joins).
            if (!queues_[rank].empty()) finished_[rank] = queues_[rank].back().ticket;
            queues_[rank].clear();
            if (!failure_seen_[rank]) {
                failure_seen_[rank] = true;
                busy_[rank] = true;
                lock.unlock();
                try {
                    on_failure_(rank);
                } catch (...) {
                }
                lock.lock();
                busy_[rank] = false;
            }
            work_done_.notify_all();
            continue;
        }
        Queued next = std::move(queues_[rank].front());
        queues_[rank].pop_front();
        const long ticket = next.ticket;
        started_[rank] = ticket;
        busy_[rank] = true;
        lock.unlock();
        std::exception_ptr error;
        try {
            (*next.task)(rank);
        } catch (...) {
            error = std::current_exception();
        }
        if (error) {
            lock.lock();
            failed_ = true;
            failures_[rank] = Failure{error, next.label};
            failure_seen_[rank] = true;
            lock.unlock();
            work_ready_.notify_all();  // the other workers abandon their work too
            try {
                on_failure_(rank);
            } catch (...) {
            }
        }
        next = Queued{};  // the task's captures are released on this thread, outside the lock
        lock.lock();
        busy_[rank] = false;
        finished_[rank] = std::max(finished_[rank], ticket);
        work_done_.notify_all();
    }
}

void rethrow_with_prefix(const std::exception_ptr& error, const std::string& prefix) {
    try {
        std::rethrow_exception(error);
    } catch (const OutOfMemory& e) {
        throw OutOfMemory(prefix + e.what());
    } catch (const WorkerAborted& e) {
        throw WorkerAborted(prefix + e.what());
    } catch (const InvalidArgument& e) {
        throw InvalidArgument(prefix + e.what());
    } catch (const std::bad_alloc&) {
        throw OutOfMemory(prefix + "out of host memory inside the nanoq core");
    } catch (const std::exception& e) {
        throw NanoqError(prefix + e.what());
    } catch (...) {
        throw NanoqError(prefix + "unknown failure");
    }
}

}  // namespace nanoq
