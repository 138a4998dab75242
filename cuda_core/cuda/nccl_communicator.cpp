// NCCL collectives between the per-GPU worker threads of one process.
//
// One communicator per device thread, created concurrently by all ranks from
// the group's unique id. Collectives run on a communication stream of their
// own, ordered against the device's compute stream with events: compute ->
// collective -> compute, without blocking the host. abort() (from a failing
// worker's thread) aborts every communicator, which ends any collective a
// peer is blocked in; such communicators are then never used again.
#include <nccl.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_check.h"

namespace nanoq {
namespace cuda {
namespace {

void check_nccl(ncclResult_t status, const char* what) {
    if (status != ncclSuccess)
        throw NanoqError(std::string("NCCL error in ") + what + ": " + ncclGetErrorString(status));
}

ncclDataType_t nccl_type(DType dtype) {
    switch (dtype) {
        case DType::F32: return ncclFloat32;
        case DType::BF16: return ncclBfloat16;
        case DType::I32: return ncclInt32;
        case DType::F64: return ncclFloat64;
    }
    throw InternalError("collective on an unknown dtype");
}

class NcclGroup;

class NcclCommunicator final : public Communicator {
public:
    NcclCommunicator(std::shared_ptr<NcclGroup> group, ncclComm_t comm, int rank, int size, CudaBackend& backend);
    ~NcclCommunicator() override;
    int rank() const override { return rank_; }
    int size() const override { return size_; }
    void reduce_scatter_sum(const Tensor& buffer) override;
    void all_gather(const Tensor& buffer) override;
    void gather_range(const Tensor& out, std::int64_t begin, std::int64_t end, const Tensor& own,
                      std::int64_t shard, bool now) override;
    void wait() override;
    void reduce_range_add(const Tensor& in, std::int64_t begin, std::int64_t end, const Tensor& own,
                          std::int64_t shard, const Tensor& scratch) override;
    void barrier() override;

private:
    std::size_t chunk(const Tensor& buffer) const;
    void start_collective();
    // Records the collective's completion; with `now`, compute waits for it.
    void finish_collective(bool now = true);

    std::shared_ptr<NcclGroup> group_;
    ncclComm_t comm_;
    int rank_, size_;
    CudaBackend& backend_;
    cudaStream_t compute_;
    cudaStream_t stream_ = nullptr;
    cudaEvent_t compute_done_ = nullptr, comm_done_ = nullptr;
    float* barrier_token_ = nullptr;  // 4 bytes of device memory, outside the named allocator
};

class NcclGroup final : public CommGroup, public std::enable_shared_from_this<NcclGroup> {
public:
    explicit NcclGroup(int size) : size_(size), comms_(size, nullptr) {
        if (size > 1) check_nccl(ncclGetUniqueId(&id_), "ncclGetUniqueId");
    }

    std::unique_ptr<Communicator> connect(int rank, Backend& backend) override {
        auto* cuda_backend = dynamic_cast<CudaBackend*>(&backend);
        if (!cuda_backend) throw InternalError("the NCCL communicator needs the cuda backend");
        NANOQ_CUDA_CHECK(cudaSetDevice(cuda_backend->device()));
        ncclComm_t comm = nullptr;
        if (size_ > 1) check_nccl(ncclCommInitRank(&comm, size_, id_, rank), "ncclCommInitRank");
        {
            std::lock_guard<std::mutex> lock(mutex_);
            comms_[rank] = comm;
        }
        return std::make_unique<NcclCommunicator>(shared_from_this(), comm, rank, size_, *cuda_backend);
    }

    void abort() override {
        std::lock_guard<std::mutex> lock(mutex_);
        if (aborted_) return;
        aborted_ = true;
        for (ncclComm_t comm : comms_)
            if (comm) ncclCommAbort(comm);
    }

    // Called by a communicator's destructor: destroys its NCCL communicator
    // unless abort() already did.
    void release(int rank) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (comms_[rank] && !aborted_) ncclCommDestroy(comms_[rank]);
        comms_[rank] = nullptr;
    }

    bool aborted() {
        std::lock_guard<std::mutex> lock(mutex_);
        return aborted_;
    }

private:
    int size_;
    ncclUniqueId id_{};
    std::mutex mutex_;
    std::vector<ncclComm_t> comms_;
    bool aborted_ = false;
};

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclGroup> group, ncclComm_t comm, int rank, int size,
                                   CudaBackend& backend)
    : group_(std::move(group)), comm_(comm), rank_(rank), size_(size), backend_(backend), compute_(backend.stream()) {
    NANOQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    NANOQ_CUDA_CHECK(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
    NANOQ_CUDA_CHECK(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming));
    NANOQ_CUDA_CHECK(cudaMalloc(&barrier_token_, sizeof(float)));
}

NcclCommunicator::~NcclCommunicator() {
    group_->release(rank_);
    cudaFree(barrier_token_);
    cudaEventDestroy(compute_done_);
    cudaEventDestroy(comm_done_);
    cudaStreamDestroy(stream_);
}

std::size_t NcclCommunicator::chunk(const Tensor& buffer) const {
    if (buffer.numel() % size_ != 0)
        throw InternalError("collective on " + std::to_string(buffer.numel()) + " elements, not divisible by " +
                            std::to_string(size_) + " ranks");
    return static_cast<std::size_t>(buffer.numel() / size_);
}

void NcclCommunicator::start_collective() {
    if (group_->aborted()) throw WorkerAborted("collective abandoned: another worker failed");
    NANOQ_CUDA_CHECK(cudaEventRecord(compute_done_, compute_));
    NANOQ_CUDA_CHECK(cudaStreamWaitEvent(stream_, compute_done_, 0));
}

void NcclCommunicator::finish_collective(bool now) {
    NANOQ_CUDA_CHECK(cudaEventRecord(comm_done_, stream_));
    if (now) NANOQ_CUDA_CHECK(cudaStreamWaitEvent(compute_, comm_done_, 0));
}

void NcclCommunicator::wait() {
    // The communication stream runs in order: its last event covers everything issued.
    NANOQ_CUDA_CHECK(cudaStreamWaitEvent(compute_, comm_done_, 0));
}

void NcclCommunicator::reduce_scatter_sum(const Tensor& buffer) {
    if (size_ == 1) return;
    const std::size_t n = chunk(buffer);
    char* base = static_cast<char*>(buffer.data);
    start_collective();
    check_nccl(ncclReduceScatter(base, base + rank_ * n * dtype_size(buffer.dtype), n, nccl_type(buffer.dtype),
                                 ncclSum, comm_, stream_),
               "ncclReduceScatter");
    finish_collective();
}

void NcclCommunicator::all_gather(const Tensor& buffer) {
    if (size_ == 1) return;
    const std::size_t n = chunk(buffer);
    char* base = static_cast<char*>(buffer.data);
    start_collective();
    check_nccl(ncclAllGather(base + rank_ * n * dtype_size(buffer.dtype), base, n, nccl_type(buffer.dtype), comm_,
                             stream_),
               "ncclAllGather");
    finish_collective();
}

void NcclCommunicator::gather_range(const Tensor& out, std::int64_t begin, std::int64_t end, const Tensor& own,
                                    std::int64_t shard, bool now) {
    const std::size_t element = dtype_size(own.dtype);
    if (size_ == 1) {  // a copy on the compute stream: ordered already
        NANOQ_CUDA_CHECK(cudaMemcpyAsync(out.data, static_cast<const char*>(own.data) + begin * element,
                                         (end - begin) * element, cudaMemcpyDefault, compute_));
        return;
    }
    // One broadcast per owner of a piece of the range, from its shard.
    start_collective();
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (std::int64_t at = begin; at < end;) {
        const int owner = static_cast<int>(at / shard);
        const std::int64_t stop = std::min(end, (owner + 1) * shard);
        check_nccl(ncclBroadcast(static_cast<const char*>(own.data) + (at - owner * shard) * element,
                                 static_cast<char*>(out.data) + (at - begin) * element, stop - at,
                                 nccl_type(own.dtype), owner, comm_, stream_),
                   "ncclBroadcast");
        at = stop;
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    finish_collective(now);
}

void NcclCommunicator::reduce_range_add(const Tensor& in, std::int64_t begin, std::int64_t end, const Tensor& own,
                                        std::int64_t shard, const Tensor& scratch) {
    const std::int64_t lo = std::max(begin, rank_ * shard), hi = std::min(end, (rank_ + 1) * shard);
    if (size_ == 1) {
        if (lo < hi) backend_.accumulate(own.slice(lo - rank_ * shard, hi - lo), in.slice(lo - begin, hi - lo));
        return;
    }
    // One reduce per owner into its scratch, then the owner adds its part.
    start_collective();
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (std::int64_t at = begin; at < end;) {
        const int owner = static_cast<int>(at / shard);
        const std::int64_t stop = std::min(end, (owner + 1) * shard);
        check_nccl(ncclReduce(static_cast<const float*>(in.data) + (at - begin), scratch.data, stop - at,
                              ncclFloat32, ncclSum, owner, comm_, stream_),
                   "ncclReduce");
        at = stop;
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    finish_collective();
    if (lo < hi) backend_.accumulate(own.slice(lo - rank_ * shard, hi - lo), scratch.slice(0, hi - lo));
}

void NcclCommunicator::barrier() {
    if (size_ == 1) return;
    // A one-element all-reduce that every rank waits for on the host.
    start_collective();
    check_nccl(ncclAllReduce(barrier_token_, barrier_token_, 1, ncclFloat32, ncclSum, comm_, stream_),
               "ncclAllReduce (barrier)");
    finish_collective();
    NANOQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

}  // namespace

std::shared_ptr<CommGroup> make_nccl_group(int size) { return std::make_shared<NcclGroup>(size); }

}  // namespace cuda
}  // namespace nanoq
