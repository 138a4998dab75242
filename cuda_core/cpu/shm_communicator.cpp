// Shared-memory collectives for worker threads over host memory.
//
// Each collective publishes every rank's buffer pointer, meets at a barrier,
// lets each rank work on the part it owns (reading the others' buffers), and
// meets again before anyone may touch its buffer. In-place reduce-scatter is
// safe because rank r writes only chunk r of its own buffer, which no other
// rank reads (the same holds for a range stored in place); all-gather because
// each rank writes only its own buffer.
//
// Asynchronous collectives (`now` false) run on a communication thread of
// each rank, in issue order, while the rank's worker computes. A synchronous
// one first waits for that thread to finish what was issued before it, then
// runs on the caller's thread: every rank still runs its collectives one at a
// time and in the same order, which is all the barrier protocol needs. An
// error on the communication thread (an abandoned collective) is kept and
// thrown by the worker's next call.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm.h"
#include "nanoq/errors.h"

namespace nanoq {
namespace {

class SharedMemoryGroup;

class SharedMemoryCommunicator final : public Communicator {
public:
    SharedMemoryCommunicator(std::shared_ptr<SharedMemoryGroup> group, int rank);
    ~SharedMemoryCommunicator() override;
    int rank() const override { return rank_; }
    int size() const override;
    void reduce_scatter_sum(const Tensor& buffer) override;
    void all_gather(const Tensor& buffer) override;
    CommTicket gather_range(const Tensor& out, std::int64_t begin, std::int64_t end, const Tensor& own,
                            std::int64_t shard, bool now) override;
    CommTicket reduce_range(const Tensor& in, std::int64_t begin, std::int64_t end, const Tensor& own,
                            std::int64_t shard, RangeSum mode, bool now) override;
    void wait(CommTicket ticket) override;
    void wait() override { wait(issued_); }
    void barrier() override;
    void abort() override;

private:
    // Runs `collective` now (after what was issued before it) or queues it
    // for the communication thread.
    CommTicket issue(std::function<void()> collective, bool now);
    void communication_loop();
    void begin_collective(const Tensor& buffer, bool any_dtype = false);
    std::int64_t chunk_size(const Tensor& buffer) const;

    std::shared_ptr<SharedMemoryGroup> group_;
    int rank_;
    std::thread thread_;  // the communication thread (none for a group of one)
    std::mutex mutex_;
    std::condition_variable changed_;
    std::deque<std::pair<CommTicket, std::function<void()>>> queue_;
    CommTicket issued_ = 0;     // tickets handed out (touched by the worker's thread only)
    CommTicket completed_ = 0;  // collectives finished
    bool running_ = false;      // the communication thread is inside a collective
    bool stopping_ = false;
    std::exception_ptr error_;  // the first failure; every later call throws it
};

class SharedMemoryGroup final : public std::enable_shared_from_this<SharedMemoryGroup> {
public:
    // `several_trainers`: the world's members are trainers made apart (a
    // world with an id), whose first meeting may wait for one that never comes.
    SharedMemoryGroup(int size, std::string signature, bool several_trainers)
        : size_(size),
          several_trainers_(several_trainers),
          signature_(std::move(signature)),
          buffers_(size, nullptr),
          joined_(size, false) {}

    // Claims global ranks [first, first + count) for a joining trainer.
    void join(const Topology& t) {
        std::lock_guard<std::mutex> lock(mutex_);
        for (int r = t.first_rank; r < t.first_rank + t.devices; ++r) {
            if (joined_[r]) throw InvalidArgument("rank " + std::to_string(r) + " of communicator world " +
                                                  "already joined: each rank of a world belongs to one trainer");
            joined_[r] = true;
        }
    }

    void abort(const std::string& why = "collective abandoned: another worker failed") {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!aborted_) reason_ = why;
        aborted_ = true;
        cv_.notify_all();
    }

    int size() const { return size_; }
    const std::string& signature() const { return signature_; }

    // Every rank of the world meets here. In a world of several trainers,
    // the wait in the first meeting (their rendezvous) is bounded: a member
    // that never comes fails the others instead of hanging them.
    void barrier() {
        std::unique_lock<std::mutex> lock(mutex_);
        if (aborted_) throw WorkerAborted(reason_);
        const long generation = generation_;
        if (++arrived_ == size_) {
            arrived_ = 0;
            ++generation_;
            cv_.notify_all();
            return;
        }
        auto done = [&] { return generation_ != generation || aborted_; };
        if (generation_ == 0 && several_trainers_) {
            if (!cv_.wait_for(lock, rendezvous_timeout(), done)) {
                aborted_ = true;
                reason_ = "the communicator world of " + std::to_string(size_) + " ranks did not gather within " +
                          std::to_string(rendezvous_timeout().count()) +
                          " s: not every rank's trainer was created (NANOQ_RENDEZVOUS_TIMEOUT sets the limit)";
                cv_.notify_all();
                throw NanoqError(reason_);
            }
        } else {
            cv_.wait(lock, done);
        }
        if (aborted_) throw WorkerAborted(reason_);
    }

    void publish(int rank, void* data) { buffers_[rank] = data; }
    const float* buffer(int rank) const { return static_cast<const float*>(buffers_[rank]); }
    const char* bytes(int rank) const { return static_cast<const char*>(buffers_[rank]); }

private:
    static std::chrono::seconds rendezvous_timeout() {
        const char* value = std::getenv("NANOQ_RENDEZVOUS_TIMEOUT");
        const long seconds = value ? std::atol(value) : 0;
        return std::chrono::seconds(seconds > 0 ? seconds : 120);
    }

    int size_;
    bool several_trainers_;
    std::string signature_;
    std::vector<void*> buffers_;
    std::vector<bool> joined_;
    std::mutex mutex_;
    std::condition_variable cv_;
    int arrived_ = 0;
    long generation_ = 0;
    bool aborted_ = false;
    std::string reason_;
};

// One trainer's part of a world: its devices are global ranks first_rank...
class SharedMemoryMembers final : public CommGroup {
public:
    SharedMemoryMembers(std::shared_ptr<SharedMemoryGroup> world, int first_rank)
        : world_(std::move(world)), first_rank_(first_rank) {}
    std::unique_ptr<Communicator> connect(int device, Backend&) override {
        return std::make_unique<SharedMemoryCommunicator>(world_, first_rank_ + device);
    }
    void abort() override { world_->abort(); }

private:
    std::shared_ptr<SharedMemoryGroup> world_;
    int first_rank_;
};

// The worlds of this process with an id, while a member lives.
std::mutex worlds_mutex;
std::map<std::string, std::weak_ptr<SharedMemoryGroup>>& worlds() {
    static std::map<std::string, std::weak_ptr<SharedMemoryGroup>> by_id;
    return by_id;
}

SharedMemoryCommunicator::SharedMemoryCommunicator(std::shared_ptr<SharedMemoryGroup> group, int rank)
    : group_(std::move(group)), rank_(rank) {
    if (group_->size() > 1) thread_ = std::thread([this] { communication_loop(); });
}

SharedMemoryCommunicator::~SharedMemoryCommunicator() {
    bool abandoned = false;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
        abandoned = running_ || !queue_.empty();
        queue_.clear();
        changed_.notify_all();
    }
    // Collectives left behind would keep the peers waiting for this rank.
    if (abandoned) group_->abort();
    if (thread_.joinable()) thread_.join();
}

int SharedMemoryCommunicator::size() const { return group_->size(); }

void SharedMemoryCommunicator::communication_loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        auto [ticket, collective] = std::move(queue_.front());
        queue_.pop_front();
        running_ = true;
        lock.unlock();
        trace("comm-start", ticket);
        std::exception_ptr failure;
        try {
            collective();
        } catch (...) {
            failure = std::current_exception();
        }
        trace("comm-end", ticket);
        lock.lock();
        running_ = false;
        if (failure && !error_) error_ = failure;
        if (error_) queue_.clear();  // later collectives cannot meet their peers
        completed_ = ticket;
        changed_.notify_all();
    }
}

CommTicket SharedMemoryCommunicator::issue(std::function<void()> collective, bool now) {
    const CommTicket ticket = ++issued_;
    if (!thread_.joinable()) {  // a group of one: nothing to overlap
        collective();
        completed_ = ticket;
        return ticket;
    }
    if (now) {
        wait(ticket - 1);
        try {
            collective();
        } catch (...) {
            std::lock_guard<std::mutex> lock(mutex_);
            if (!error_) error_ = std::current_exception();
            throw;
        }
        std::lock_guard<std::mutex> lock(mutex_);
        completed_ = ticket;
        return ticket;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) std::rethrow_exception(error_);
    queue_.emplace_back(ticket, std::move(collective));
    changed_.notify_all();
    return ticket;
}

void SharedMemoryCommunicator::wait(CommTicket ticket) {
    if (!thread_.joinable()) return;
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return completed_ >= ticket || error_; });
    if (error_) std::rethrow_exception(error_);
}

void SharedMemoryCommunicator::abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.clear();
    if (!error_) error_ = std::make_exception_ptr(WorkerAborted("collective abandoned: this worker failed"));
    changed_.notify_all();
}

void SharedMemoryCommunicator::reduce_scatter_sum(const Tensor& buffer) {
    if (size() == 1) return;
    const std::int64_t chunk = chunk_size(buffer);
    issue([=] {
        begin_collective(buffer);
        float* own = buffer.f32() + rank_ * chunk;
        for (std::int64_t i = 0; i < chunk; ++i) {
            float acc = 0.0f;
            for (int r = 0; r < size(); ++r) acc += group_->buffer(r)[rank_ * chunk + i];
            own[i] = acc;
        }
        group_->barrier();
    }, true);
}

void SharedMemoryCommunicator::all_gather(const Tensor& buffer) {
    if (size() == 1) return;
    // Any dtype: the trainer gathers float64 statistics.
    const std::size_t chunk = static_cast<std::size_t>(chunk_size(buffer)) * dtype_size(buffer.dtype);
    issue([=] {
        begin_collective(buffer, true);
        char* data = static_cast<char*>(buffer.data);
        for (int r = 0; r < size(); ++r)
            if (r != rank_) std::memcpy(data + r * chunk, group_->bytes(r) + r * chunk, chunk);
        group_->barrier();
    }, true);
}

CommTicket SharedMemoryCommunicator::gather_range(const Tensor& out, std::int64_t begin, std::int64_t end,
                                                  const Tensor& own, std::int64_t shard, bool now) {
    return issue([=] {
        begin_collective(own);
        for (std::int64_t at = begin; at < end;) {
            const int owner = static_cast<int>(at / shard);
            const std::int64_t stop = std::min(end, (owner + 1) * shard);
            std::memcpy(out.f32() + (at - begin), group_->buffer(owner) + (at - owner * shard),
                        sizeof(float) * (stop - at));
            at = stop;
        }
        group_->barrier();
    }, now);
}

CommTicket SharedMemoryCommunicator::reduce_range(const Tensor& in, std::int64_t begin, std::int64_t end,
                                                  const Tensor& own, std::int64_t shard, RangeSum mode, bool now) {
    return issue([=] {
        begin_collective(in);
        // This rank sums, in rank order, every rank's values of the part it owns.
        const std::int64_t lo = std::max(begin, rank_ * shard), hi = std::min(end, (rank_ + 1) * shard);
        float* target = own.f32();
        for (std::int64_t at = lo; at < hi; ++at) {
            float sum = 0.0f;
            for (int r = 0; r < size(); ++r) sum += group_->buffer(r)[at - begin];
            if (mode == RangeSum::Add) target[at - rank_ * shard] += sum;
            else target[at - rank_ * shard] = sum;
        }
        group_->barrier();
    }, now);
}

void SharedMemoryCommunicator::barrier() {
    issue([this] { group_->barrier(); }, true);
}

void SharedMemoryCommunicator::begin_collective(const Tensor& buffer, bool any_dtype) {
    if (!any_dtype) buffer.f32();  // sums and ranges move float32 only; all_gather copies bytes
    group_->publish(rank_, buffer.data);
    group_->barrier();
}

std::int64_t SharedMemoryCommunicator::chunk_size(const Tensor& buffer) const {
    if (buffer.numel() % size() != 0)
        throw InternalError("collective on " + std::to_string(buffer.numel()) + " elements, not divisible by " +
                            std::to_string(size()) + " ranks");
    return buffer.numel() / size();
}

}  // namespace

std::shared_ptr<CommGroup> make_shared_memory_group(const Topology& t) {
    if (t.id.empty()) {
        auto world = std::make_shared<SharedMemoryGroup>(t.world_size, t.signature, false);
        world->join(t);
        return std::make_shared<SharedMemoryMembers>(std::move(world), t.first_rank);
    }
    std::shared_ptr<SharedMemoryGroup> world;
    {
        std::lock_guard<std::mutex> lock(worlds_mutex);
        auto& slot = worlds()[t.id];
        world = slot.lock();
        if (!world) {
            world = std::make_shared<SharedMemoryGroup>(t.world_size, t.signature, true);
            slot = world;
        }
    }
    std::string mismatch;
    if (world->size() != t.world_size)
        mismatch = "a trainer asked for a world of " + std::to_string(t.world_size) + " ranks, but this communicator "
                   "id names a world of " + std::to_string(world->size());
    else if (world->signature() != t.signature)
        mismatch = "the trainers of one communicator world must have the same model config and options (apart from "
                   "devices, first_rank and threads); these differ: " + world->signature() + " vs " + t.signature;
    if (!mismatch.empty()) {
        world->abort(mismatch);  // the members already waiting fail too, instead of waiting for this one
        throw InvalidArgument(mismatch);
    }
    world->join(t);
    return std::make_shared<SharedMemoryMembers>(std::move(world), t.first_rank);
}

std::string new_shared_memory_id() {
    static std::atomic<unsigned long long> next{0};
    std::random_device random;
    return "shm:" + std::to_string(random()) + ":" + std::to_string(++next);
}

}  // namespace nanoq
