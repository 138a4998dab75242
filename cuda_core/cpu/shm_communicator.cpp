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
#include <cstdint>
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
#include "nanoq/transport.h"
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
          members_(size),
          several_trainers_(several_trainers),
          signature_(std::move(signature)),
          buffers_(size, nullptr),
          joined_(size, false) {}

    // A world of processes of `local` ranks each, of which this process's
    // are ranks first .. first + local - 1; what crosses processes goes
    // through `transport` (see the file's header).
    SharedMemoryGroup(int size, std::string signature, int first, int local,
                      std::shared_ptr<ProcessTransport> transport)
        : SharedMemoryGroup(size, std::move(signature), false) {
        members_ = local;
        local_first_ = first;
        transport_ = std::move(transport);
        received_offsets_.assign(static_cast<std::size_t>(processes()) + 1, 0);
    }

    // -- across processes ---------------------------------------------------
    bool bridged() const { return transport_ != nullptr; }
    int local() const { return members_; }
    int local_first() const { return local_first_; }
    int processes() const { return size_ / members_; }
    int process() const { return local_first_ / members_; }
    // The leader's swap: `pack(q, out)` appends to `out` what process q
    // needs from this process (nothing for this process itself), `expected(q)`
    // is how many bytes process q sends here. A failure aborts the group, so
    // that the other local ranks stop at their next meeting.
    template <typename Pack, typename Expected>
    void swap(Pack pack, Expected expected) {
        try {
            const int p = processes();
            std::vector<std::int64_t> send_bytes(p, 0), recv_bytes(p, 0);
            sent_.clear();
            for (int q = 0; q < p; ++q) {
                const std::size_t before = sent_.size();
                if (q != process()) pack(q, sent_);
                send_bytes[q] = static_cast<std::int64_t>(sent_.size() - before);
                recv_bytes[q] = q == process() ? 0 : expected(q);
                received_offsets_[q + 1] = received_offsets_[q] + recv_bytes[q];
            }
            received_.resize(static_cast<std::size_t>(received_offsets_[p]));
            transport_->alltoallv(sent_.data(), send_bytes, received_.data(), recv_bytes);
        } catch (const std::exception& e) {
            abort(std::string("a collective between processes failed: ") + e.what());
            throw;
        }
    }
    void transport_barrier() {
        try {
            transport_->barrier();
        } catch (const std::exception& e) {
            abort(std::string("a barrier between processes failed: ") + e.what());
            throw;
        }
    }
    // What process q sent in the last swap.
    const char* received(int q) const { return received_.data() + received_offsets_[q]; }
    const float* received_f32(int q) const { return reinterpret_cast<const float*>(received(q)); }
    bool is_local(int rank) const { return rank >= local_first_ && rank < local_first_ + members_; }

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

    // Rank `rank`'s communicator is going away. In a world of several
    // trainers the others may still run collectives that need it: they fail
    // at once instead of waiting for it for ever.
    void leave(int rank) {
        if (several_trainers_)
            abort("rank " + std::to_string(rank) + "'s trainer was closed: the other trainers of its world cannot "
                  "meet it in a collective any more (close every trainer of a world together)");
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
        if (++arrived_ == members_) {
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
        if (generation_ != generation) return;  // met, whatever came after (a member leaving once done)
        throw WorkerAborted(reason_);
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
    int members_;  // the ranks that meet at barrier(): this process's
    int local_first_ = 0;
    std::shared_ptr<ProcessTransport> transport_;
    std::vector<char> sent_, received_;
    std::vector<std::int64_t> received_offsets_;
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

// The worlds of this process with an id, while a member lives; new_comm_id's
// ids (new_shared_memory_id) start with this.
constexpr const char* kSharedMemoryIdPrefix = "shm:";
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
    if (abandoned)
        group_->abort();
    else
        group_->leave(rank_);
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

namespace {

void append(std::vector<char>& out, const void* data, std::int64_t bytes) {
    const char* begin = static_cast<const char*>(data);
    out.insert(out.end(), begin, begin + bytes);
}

// The part [lo, hi) of [begin, end) that ranks first .. first + count - 1
// own, each `shard` elements from first * shard on (empty: lo == hi).
std::pair<std::int64_t, std::int64_t> owned_part(std::int64_t begin, std::int64_t end, int first, int count,
                                                 std::int64_t shard) {
    const std::int64_t lo = std::max(begin, first * shard), hi = std::min(end, (first + count) * shard);
    return {lo, std::max(lo, hi)};
}

}  // namespace

void SharedMemoryCommunicator::reduce_scatter_sum(const Tensor& buffer) {
    if (size() == 1) return;
    const std::int64_t chunk = chunk_size(buffer);
    issue([=] {
        begin_collective(buffer);
        SharedMemoryGroup& g = *group_;
        const int local = g.local(), first = g.local_first();
        if (g.bridged()) {
            // Process q gets, from each rank here, the chunks of q's ranks.
            if (rank_ == first)
                g.swap([&](int q, std::vector<char>& out) {
                           for (int l = 0; l < local; ++l)
                               append(out, g.buffer(first + l) + q * local * chunk, sizeof(float) * local * chunk);
                       },
                       [&](int) { return std::int64_t(sizeof(float)) * local * local * chunk; });
            g.barrier();
        }
        // sources[r][i]: rank r's value of element i of this rank's chunk.
        std::vector<const float*> sources(size());
        for (int r = 0; r < size(); ++r)
            sources[r] = g.is_local(r) ? g.buffer(r) + rank_ * chunk
                                       : g.received_f32(r / local) + ((r % local) * local + rank_ - first) * chunk;
        float* own = buffer.f32() + rank_ * chunk;
        for (std::int64_t i = 0; i < chunk; ++i) {
            float acc = 0.0f;
            for (int r = 0; r < size(); ++r) acc += sources[r][i];
            own[i] = acc;
        }
        g.barrier();
    }, true);
}

void SharedMemoryCommunicator::all_gather(const Tensor& buffer) {
    if (size() == 1) return;
    // Any dtype: the trainer gathers float64 statistics.
    const std::size_t chunk = static_cast<std::size_t>(chunk_size(buffer)) * dtype_size(buffer.dtype);
    issue([=] {
        begin_collective(buffer, true);
        SharedMemoryGroup& g = *group_;
        const int local = g.local(), first = g.local_first();
        if (g.bridged()) {
            if (rank_ == first)
                g.swap([&](int, std::vector<char>& out) {
                           for (int r = first; r < first + local; ++r) append(out, g.bytes(r) + r * chunk, chunk);
                       },
                       [&](int) { return static_cast<std::int64_t>(chunk) * local; });
            g.barrier();
        }
        char* data = static_cast<char*>(buffer.data);
        for (int r = 0; r < size(); ++r) {
            if (r == rank_) continue;
            const char* source = g.is_local(r) ? g.bytes(r) + r * chunk : g.received(r / local) + (r % local) * chunk;
            std::memcpy(data + r * chunk, source, chunk);
        }
        g.barrier();
    }, true);
}

CommTicket SharedMemoryCommunicator::gather_range(const Tensor& out, std::int64_t begin, std::int64_t end,
                                                  const Tensor& own, std::int64_t shard, bool now) {
    return issue([=] {
        begin_collective(own);
        SharedMemoryGroup& g = *group_;
        const int local = g.local(), first = g.local_first();
        if (g.bridged()) {
            // Every process gets this process's part of the range, in rank order.
            if (rank_ == first)
                g.swap([&](int, std::vector<char>& bytes) {
                           for (int r = first; r < first + local; ++r) {
                               const auto [lo, hi] = owned_part(begin, end, r, 1, shard);
                               append(bytes, g.buffer(r) + (lo - r * shard), sizeof(float) * (hi - lo));
                           }
                       },
                       [&](int q) {
                           const auto [lo, hi] = owned_part(begin, end, q * local, local, shard);
                           return std::int64_t(sizeof(float)) * (hi - lo);
                       });
            g.barrier();
        }
        for (std::int64_t at = begin; at < end;) {
            const int owner = static_cast<int>(at / shard);
            const std::int64_t stop = std::min(end, (owner + 1) * shard);
            const float* source;
            if (g.is_local(owner)) {
                source = g.buffer(owner) + (at - owner * shard);
            } else {
                const int q = owner / local;
                source = g.received_f32(q) + (at - owned_part(begin, end, q * local, local, shard).first);
            }
            std::memcpy(out.f32() + (at - begin), source, sizeof(float) * (stop - at));
            at = stop;
        }
        g.barrier();
    }, now);
}

CommTicket SharedMemoryCommunicator::reduce_range(const Tensor& in, std::int64_t begin, std::int64_t end,
                                                  const Tensor& own, std::int64_t shard, RangeSum mode, bool now) {
    return issue([=] {
        begin_collective(in);
        SharedMemoryGroup& g = *group_;
        const int local = g.local(), first = g.local_first();
        // This process's part of the range, which the swap brings every process's values of.
        const auto [here_lo, here_hi] = owned_part(begin, end, first, local, shard);
        if (g.bridged()) {
            if (rank_ == first)
                g.swap([&](int q, std::vector<char>& bytes) {
                           const auto [lo, hi] = owned_part(begin, end, q * local, local, shard);
                           for (int r = first; r < first + local; ++r)
                               append(bytes, g.buffer(r) + (lo - begin), sizeof(float) * (hi - lo));
                       },
                       [&](int) { return std::int64_t(sizeof(float)) * local * (here_hi - here_lo); });
            g.barrier();
        }
        // sources[r][at - here_lo]: rank r's value of element `at` (of this rank's part).
        std::vector<const float*> sources(size());
        for (int r = 0; r < size(); ++r)
            sources[r] = g.is_local(r) ? g.buffer(r) + (here_lo - begin)
                                       : g.received_f32(r / local) + (r % local) * (here_hi - here_lo);
        // This rank sums, in rank order, every rank's values of the part it owns.
        const auto [lo, hi] = owned_part(begin, end, rank_, 1, shard);
        float* target = own.f32();
        for (std::int64_t at = lo; at < hi; ++at) {
            float sum = 0.0f;
            for (int r = 0; r < size(); ++r) sum += sources[r][at - here_lo];
            if (mode == RangeSum::Add) target[at - rank_ * shard] += sum;
            else target[at - rank_ * shard] = sum;
        }
        g.barrier();
    }, now);
}

void SharedMemoryCommunicator::barrier() {
    issue([this] {
        group_->barrier();
        if (!group_->bridged()) return;
        if (rank_ == group_->local_first()) group_->transport_barrier();
        group_->barrier();
    }, true);
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

namespace {

// Every process's `signature`, through the transport (all of them call this).
std::vector<std::string> exchange_signatures(ProcessTransport& transport, const std::string& signature) {
    const int p = transport.size();
    const std::int64_t mine = static_cast<std::int64_t>(signature.size());
    std::vector<std::int64_t> lengths(p), eight(p, sizeof(std::int64_t));
    std::vector<std::int64_t> sent(p, mine);
    transport.alltoallv(sent.data(), eight, lengths.data(), eight);
    std::string all_sent;
    for (int q = 0; q < p; ++q) all_sent += signature;
    std::int64_t total = 0;
    for (std::int64_t n : lengths) total += n;
    std::string received(static_cast<std::size_t>(total), '\0');
    transport.alltoallv(all_sent.data(), std::vector<std::int64_t>(p, mine), received.data(), lengths);
    std::vector<std::string> out;
    std::size_t at = 0;
    for (std::int64_t n : lengths) {
        out.push_back(received.substr(at, static_cast<std::size_t>(n)));
        at += static_cast<std::size_t>(n);
    }
    return out;
}

std::shared_ptr<CommGroup> make_process_group(const Topology& t) {
    ProcessTransport& transport = *t.transport;
    const int p = transport.size(), q = transport.rank();
    if (p < 1 || q < 0 || q >= p)
        throw InvalidArgument("the process transport says rank " + std::to_string(q) + " of " + std::to_string(p));
    if (t.world_size != p * t.devices || t.first_rank != q * t.devices)
        throw InvalidArgument("a world across " + std::to_string(p) + " processes of " + std::to_string(t.devices) +
                              " devices each has " + std::to_string(p * t.devices) + " ranks, process " +
                              std::to_string(q) + "'s from " + std::to_string(q * t.devices) + "; got world_size " +
                              std::to_string(t.world_size) + " and first_rank " + std::to_string(t.first_rank));
    require_same_signature(transport, t.signature);
    auto world = std::make_shared<SharedMemoryGroup>(t.world_size, t.signature, t.first_rank, t.devices, t.transport);
    world->join(t);
    return std::make_shared<SharedMemoryMembers>(std::move(world), t.first_rank);
}

}  // namespace

double seconds_from_env(const char* name, double fallback) {
    const char* text = std::getenv(name);
    if (!text || !*text) return fallback;
    char* end = nullptr;
    const double seconds = std::strtod(text, &end);
    if (*end || !(seconds >= 0) || seconds > 1e9)
        throw InvalidArgument(std::string(name) + " must be a number of seconds >= 0 (0: no limit), got \"" + text +
                              "\"");
    return seconds;
}

double collective_timeout_seconds() { return seconds_from_env("NANOQ_COLLECTIVE_TIMEOUT", 1800.0); }

std::string collective_timeout_advice() {
    return "another rank may have stopped without failing (its process stuck in I/O or a deadlock, or its GPU "
           "hung); NANOQ_COLLECTIVE_TIMEOUT sets this limit in seconds (0 waits for ever)";
}

std::string signature_difference(const std::string& a, const std::string& b) {
    // Space-separated name=value settings (trainer.cpp's world_signature).
    auto settings = [](const std::string& text) {
        std::vector<std::string> out;
        std::size_t start = 0;
        while (start < text.size()) {
            const std::size_t end = std::min(text.find(' ', start), text.size());
            if (end > start) out.push_back(text.substr(start, end - start));
            start = end + 1;
        }
        return out;
    };
    const std::vector<std::string> theirs = settings(b);
    for (const std::string& mine : settings(a)) {
        if (std::find(theirs.begin(), theirs.end(), mine) != theirs.end()) continue;
        const std::string name = mine.substr(0, mine.find('='));
        std::string other = "none";
        for (const std::string& setting : theirs)
            if (setting.compare(0, name.size() + 1, name + "=") == 0) other = setting;
        return mine + " (against " + other + ")";
    }
    return "";
}

void require_same_signature(ProcessTransport& transport, const std::string& signature) {
    const std::vector<std::string> signatures = exchange_signatures(transport, signature);
    for (std::size_t other = 1; other < signatures.size(); ++other)
        if (signatures[other] != signatures[0])
            throw InvalidArgument("the processes of one world must have the same model config and options (apart "
                                  "from threads); process " + std::to_string(other) + " differs from process 0 in " +
                                  signature_difference(signatures[other], signatures[0]) + "; in all: " +
                                  signatures[other] + " vs " + signatures[0]);
}

std::shared_ptr<CommGroup> make_shared_memory_group(const Topology& t) {
    if (t.transport) return make_process_group(t);
    if (t.id.empty()) {
        auto world = std::make_shared<SharedMemoryGroup>(t.world_size, t.signature, false);
        world->join(t);
        return std::make_shared<SharedMemoryMembers>(std::move(world), t.first_rank);
    }
    // Any other string would name a world of its own, whose members would wait
    // out the rendezvous time limit for partners that never come.
    if (t.id.compare(0, std::strlen(kSharedMemoryIdPrefix), kSharedMemoryIdPrefix) != 0)
        throw InvalidArgument("comm_id is not a cpu communicator id (one starts with \"" +
                              std::string(kSharedMemoryIdPrefix) + "\"): make it with nanoq.new_comm_id(\"cpu\") "
                              "and give the same one to every trainer of the world");
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
                   "devices, first_rank and threads); this one differs in " +
                   signature_difference(t.signature, world->signature()) + "; in all: " + world->signature() +
                   " vs " + t.signature;
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
    return kSharedMemoryIdPrefix + std::to_string(random()) + ":" + std::to_string(++next);
}

}  // namespace nanoq
