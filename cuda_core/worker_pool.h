// One thread per device, each with its own FIFO queue of tasks.
//
// submit() queues a task on every worker and returns at once; wait() blocks
// (on a condition variable, never spinning) until every queued task has
// finished, and rethrows a failure. run() is submit() then wait().
//
// A task that throws puts the pool in the failed state: the failing worker
// calls `on_failure(rank)` at once, on its own thread, so that ranks blocked
// in a collective are released; every other worker calls it on its own
// thread too, as soon as it is idle or between two tasks (so that a rank
// whose device still holds queued collectives abandons them), and the tasks
// still queued are dropped. The next wait() rethrows the root cause (a
// rank's own failure rather than the peers' WorkerAborted), with the label
// of the task it came from in front of its message, and the pool is usable
// again. Thread safe.
//
// A caller that must not block for long (one that checks for interrupts)
// waits with the timed waits, and drop_unstarted() discards the work that
// has not begun anywhere.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace nanoq {

class WorkerPool {
public:
    using Task = std::function<void(int rank)>;

    WorkerPool(int size, Task on_failure);
    ~WorkerPool();
    WorkerPool(const WorkerPool&) = delete;
    WorkerPool& operator=(const WorkerPool&) = delete;

    int size() const { return static_cast<int>(threads_.size()); }

    // Queues `task` on every worker; returns its ticket (1, 2, ... in
    // submission order). `label` names the work in a failure's message
    // ("<label> failed on device <rank>: <what>"); empty: the message is the
    // failure's own. The task object is kept until every worker has run it.
    long submit(Task task, std::string label);
    // Blocks until every queued task has finished; rethrows a failure.
    void wait();
    void run(Task task) {
        submit(std::move(task), std::string());
        wait();
    }
    // Blocks until the task with `ticket` has finished on every worker, or
    // the pool has failed; returns false when it failed (wait() says why).
    bool wait_for(long ticket);
    // Whether a queued task failed (not yet reported by wait()).
    bool failed();
    // wait() for at most `timeout`, without rethrowing: whether every queued
    // task has finished (or the pool failed and every worker has seen it).
    bool wait_idle_for(std::chrono::milliseconds timeout);
    // wait_for(ticket) for at most `timeout`: whether that task finished on
    // every worker or the pool failed.
    bool wait_for_within(long ticket, std::chrono::milliseconds timeout);
    // Turns every queued task that no worker has started into one that does
    // nothing (its ticket still completes). A ticket runs on every worker or
    // on none, so the collectives of the tasks that do run stay matched.
    // Returns how many tickets were dropped.
    long drop_unstarted();

private:
    struct Queued {
        std::shared_ptr<const Task> task;
        std::shared_ptr<const std::string> label;
        long ticket;
    };
    struct Failure {
        std::exception_ptr error;
        std::shared_ptr<const std::string> label;
    };

    void loop(int rank);
    bool idle() const;

    Task on_failure_;
    std::vector<std::thread> threads_;
    std::mutex mutex_;
    std::condition_variable work_ready_;
    std::condition_variable work_done_;
    std::vector<std::deque<Queued>> queues_;
    std::vector<bool> busy_;
    std::vector<long> finished_;      // per worker: the ticket of its latest finished (or dropped) task
    std::vector<long> started_;       // per worker: the ticket of its latest started task
    std::vector<bool> failure_seen_;  // per worker: on_failure has run in the current failure
    std::vector<Failure> failures_;   // per worker: its failure in the current failure, if any
    long next_ticket_ = 1;
    bool failed_ = false;
    bool stopping_ = false;
};

// Rethrows `error` as the same kind of nanoq exception, its message prefixed
// by `prefix` (std exceptions of other kinds become NanoqError).
[[noreturn]] void rethrow_with_prefix(const std::exception_ptr& error, const std::string& prefix);

}  // namespace nanoq
