// Shared-memory collectives for worker threads over host memory.
//
// Each collective publishes every rank's buffer pointer, meets at a barrier,
// lets each rank work on the part it owns (reading the others' buffers), and
// meets again before anyone may touch its buffer. In-place reduce-scatter is
// safe because rank r writes only chunk r of its own buffer, which no other
// rank reads; all-gather because each rank writes only its own buffer.
#include <condition_variable>
#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "comm.h"
#include "nanoq/errors.h"

namespace nanoq {
namespace {

class SharedMemoryGroup;

class SharedMemoryCommunicator final : public Communicator {
public:
    SharedMemoryCommunicator(std::shared_ptr<SharedMemoryGroup> group, int rank);
    int rank() const override { return rank_; }
    int size() const override;
    void reduce_scatter_sum(const Tensor& buffer) override;
    void all_gather(const Tensor& buffer) override;
    void gather_range(const Tensor& out, std::int64_t begin, std::int64_t end, const Tensor& own,
                      std::int64_t shard, bool now) override;
    void wait() override {}  // every collective here is complete when it returns
    void reduce_range_add(const Tensor& in, std::int64_t begin, std::int64_t end, const Tensor& own,
                          std::int64_t shard, const Tensor& scratch) override;
    void barrier() override;

private:
    void begin_collective(const Tensor& buffer, bool any_dtype = false);
    std::int64_t chunk_size(const Tensor& buffer) const;

    std::shared_ptr<SharedMemoryGroup> group_;
    int rank_;
};

class SharedMemoryGroup final : public CommGroup, public std::enable_shared_from_this<SharedMemoryGroup> {
public:
    explicit SharedMemoryGroup(int size) : size_(size), buffers_(size, nullptr) {}

    std::unique_ptr<Communicator> connect(int rank, Backend&) override {
        return std::make_unique<SharedMemoryCommunicator>(shared_from_this(), rank);
    }

    void abort() override {
        std::lock_guard<std::mutex> lock(mutex_);
        aborted_ = true;
        cv_.notify_all();
    }

    int size() const { return size_; }

    void barrier() {
        std::unique_lock<std::mutex> lock(mutex_);
        if (aborted_) throw WorkerAborted("collective abandoned: another worker failed");
        const long generation = generation_;
        if (++arrived_ == size_) {
            arrived_ = 0;
            ++generation_;
            cv_.notify_all();
            return;
        }
        cv_.wait(lock, [&] { return generation_ != generation || aborted_; });
        if (aborted_) throw WorkerAborted("collective abandoned: another worker failed");
    }

    void publish(int rank, void* data) { buffers_[rank] = data; }
    const float* buffer(int rank) const { return static_cast<const float*>(buffers_[rank]); }
    const char* bytes(int rank) const { return static_cast<const char*>(buffers_[rank]); }

private:
    int size_;
    std::vector<void*> buffers_;
    std::mutex mutex_;
    std::condition_variable cv_;
    int arrived_ = 0;
    long generation_ = 0;
    bool aborted_ = false;
};

SharedMemoryCommunicator::SharedMemoryCommunicator(std::shared_ptr<SharedMemoryGroup> group, int rank)
    : group_(std::move(group)), rank_(rank) {}

int SharedMemoryCommunicator::size() const { return group_->size(); }

void SharedMemoryCommunicator::reduce_scatter_sum(const Tensor& buffer) {
    if (size() == 1) return;
    const std::int64_t chunk = chunk_size(buffer);
    begin_collective(buffer);
    float* own = buffer.f32() + rank_ * chunk;
    for (std::int64_t i = 0; i < chunk; ++i) {
        float acc = 0.0f;
        for (int r = 0; r < size(); ++r) acc += group_->buffer(r)[rank_ * chunk + i];
        own[i] = acc;
    }
    group_->barrier();
}

void SharedMemoryCommunicator::all_gather(const Tensor& buffer) {
    if (size() == 1) return;
    // Any dtype: the trainer gathers float64 statistics.
    const std::size_t chunk = static_cast<std::size_t>(chunk_size(buffer)) * dtype_size(buffer.dtype);
    begin_collective(buffer, true);
    char* data = static_cast<char*>(buffer.data);
    for (int r = 0; r < size(); ++r)
        if (r != rank_) std::memcpy(data + r * chunk, group_->bytes(r) + r * chunk, chunk);
    group_->barrier();
}

void SharedMemoryCommunicator::gather_range(const Tensor& out, std::int64_t begin, std::int64_t end,
                                            const Tensor& own, std::int64_t shard, bool) {
    begin_collective(own);
    for (std::int64_t at = begin; at < end;) {
        const int owner = static_cast<int>(at / shard);
        const std::int64_t stop = std::min(end, (owner + 1) * shard);
        std::memcpy(out.f32() + (at - begin), group_->buffer(owner) + (at - owner * shard), sizeof(float) * (stop - at));
        at = stop;
    }
    group_->barrier();
}

void SharedMemoryCommunicator::reduce_range_add(const Tensor& in, std::int64_t begin, std::int64_t end,
                                                const Tensor& own, std::int64_t shard, const Tensor&) {
    begin_collective(in);
    // This rank adds, in rank order, every rank's values of the part it owns.
    const std::int64_t lo = std::max(begin, rank_ * shard), hi = std::min(end, (rank_ + 1) * shard);
    float* target = own.f32();
    for (std::int64_t at = lo; at < hi; ++at) {
        float sum = 0.0f;
        for (int r = 0; r < size(); ++r) sum += group_->buffer(r)[at - begin];
        target[at - rank_ * shard] += sum;
    }
    group_->barrier();
}

void SharedMemoryCommunicator::barrier() { group_->barrier(); }

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

std::shared_ptr<CommGroup> make_shared_memory_group(int size) { return std::make_shared<SharedMemoryGroup>(size); }

}  // namespace nanoq
