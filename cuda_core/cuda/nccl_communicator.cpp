// NCCL collectives between the per-GPU worker threads of one process.
//
// One communicator per device thread, created concurrently by all ranks from
// the group's unique id. Collectives run on a communication stream of their
// own, ordered against the device's compute stream with events: compute ->
// collective -> compute, without blocking the host. Each collective records
// an event of its own, so that the compute may wait for one of them (an
// asynchronous reduction of a layer, a prefetched gather) while the ones
// issued after it still run.
//
// Failures. A communicator is only ever touched by its own rank's thread:
// NCCL communicators are not thread safe, and aborting one while its thread
// is inside a call is a use after free. So the group's abort() only raises a
// flag, and every rank ends its own communicator: the failing rank on its
// way out (Communicator::abort, called by the trainer), the others when they
// see the flag. Nothing waits where the flag cannot be seen: communicators
// are nonblocking (their initialisation, which waits for every rank, and any
// call may return ncclInProgress), so the rank polls their state with
// ncclCommGetAsyncError, and host waits on the device poll too (see
// CudaBackend::host_wait), checking the flag and NCCL's asynchronous errors.
// Aborting is needed on every rank: with the real library, a rank's abort
// does not release peers waiting for it. A peer that stops without failing
// raises no flag and no error: those polls also give up after the
// collective time limit (collective_timeout_seconds, transport.h), which
// NCCL itself lacks.
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_check.h"
#include "cuda/host_wait.h"
#include "cuda/kernels.h"

namespace nanoq {
namespace cuda {
namespace {

// With NCCL's own last warning (kept even without NCCL_DEBUG; process-wide,
// so it may be another rank's; its `comm` argument is unused): the generic
// error strings ("unhandled system error") rarely say what to fix.
std::string nccl_message(ncclResult_t status, const char* what) {
    std::string message = std::string("NCCL error in ") + what + ": " + ncclGetErrorString(status);
    const char* last = ncclGetLastError(nullptr);
    if (last && *last) message += std::string(" (NCCL's last message: ") + last + ")";
    return message;
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

class NcclGroup final : public CommGroup, public std::enable_shared_from_this<NcclGroup> {
public:
    // The world's unique id: the given one (Topology::id, made by
    // new_nccl_id), else a fresh one for a world of this trainer alone.
    explicit NcclGroup(const Topology& t) : size_(t.world_size), first_rank_(t.first_rank) {
        if (!t.id.empty()) {
            if (t.id.size() != sizeof(id_))
                throw InvalidArgument("an NCCL communicator id has " + std::to_string(sizeof(id_)) + " bytes, got " +
                                      std::to_string(t.id.size()) + " (make it with new_comm_id)");
            std::memcpy(&id_, t.id.data(), sizeof(id_));
        } else if (size_ > 1) {
            const ncclResult_t status = ncclGetUniqueId(&id_);
            if (status != ncclSuccess) throw NanoqError(nccl_message(status, "ncclGetUniqueId"));
        }
    }

    std::unique_ptr<Communicator> connect(int device, Backend& backend) override;
    void abort() override { aborted_ = true; }
    bool aborted() const { return aborted_; }
    int size() const { return size_; }
    const ncclUniqueId& id() const { return id_; }

private:
    int size_;
    int first_rank_;
    ncclUniqueId id_{};
    std::atomic<bool> aborted_{false};
};

class NcclCommunicator final : public Communicator {
public:
    NcclCommunicator(std::shared_ptr<NcclGroup> group, int rank, CudaBackend& backend);
    ~NcclCommunicator() override;
    // Joins the group's NCCL communicator (no-op for a group of one).
    void init();
    int rank() const override { return rank_; }
    int size() const override { return size_; }
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
    std::size_t chunk(const Tensor& buffer) const;
    void start_collective();
    // Records the collective's completion under its ticket; with `now`,
    // compute waits for it.
    CommTicket finish_collective(bool now = true);
    // The ticket of a collective run on the compute stream (a group of one):
    // ordered already.
    CommTicket on_compute_stream();
    // Throws when the group failed (WorkerAborted), NCCL reports an
    // asynchronous error, or a wait has lasted `waited` seconds beyond the
    // collective time limit; called while this rank polls (with 0 as a host
    // wait begins: the limit is read again then).
    void check(double waited = 0.0);
    // The error of a wait beyond its time limit; `why_limit` null: a call
    // on the communicator, beyond the collective time limit.
    [[noreturn]] void timed_out(const char* what, double limit_seconds, const char* why_limit) const;
    // The end of a call on the (nonblocking) communicator: ncclInProgress
    // is polled until NCCL reports the call's outcome; errors throw, and so
    // does a wait longer than `limit_seconds` (> 0; by default the
    // collective time limit) with `why_limit`.
    void complete(ncclResult_t status, const char* what, double limit_seconds = -1,
                  const char* why_limit = nullptr);
    // One grouped call per owner of a piece of [begin, end) (the range of a
    // flat buffer whose rank r owns [r * shard, (r + 1) * shard)):
    // issue(owner, at, stop) for each piece [at, stop), then completed.
    template <class Issue>
    void per_owner(const char* what, std::int64_t begin, std::int64_t end, std::int64_t shard, Issue&& issue);

    std::shared_ptr<NcclGroup> group_;
    ncclComm_t comm_ = nullptr;
    int rank_, size_;
    CudaBackend& backend_;
    cudaStream_t compute_;
    cudaStream_t stream_ = nullptr;
    cudaEvent_t compute_done_ = nullptr;
    // The completion events of the latest collectives, by ticket modulo their
    // count. Waiting on a slot recorded again since waits for a later
    // collective: longer than needed, never too short.
    static constexpr int kTicketEvents = 8;
    cudaEvent_t done_[kTicketEvents] = {};
    CommTicket issued_ = 0;  // the last ticket handed out
    CommTicket waited_ = 0;  // the compute is ordered after every collective up to this one
    float* barrier_token_ = nullptr;  // 4 bytes of device memory, outside the named allocator
    // The collective time limit in seconds (collective_timeout_seconds, read
    // when the communicator is made, so that a bad value refuses at once,
    // and as each host wait begins; 0: none, as in a group of one, where no
    // wait depends on another rank).
    double collective_limit_ = 0.0;
};

std::unique_ptr<Communicator> NcclGroup::connect(int device, Backend& backend) {
    const int rank = first_rank_ + device;
    auto* cuda_backend = dynamic_cast<CudaBackend*>(&backend);
    if (!cuda_backend) throw InternalError("the NCCL communicator needs the cuda backend");
    NANOQ_CUDA_CHECK(cudaSetDevice(cuda_backend->device()));
    auto comm = std::make_unique<NcclCommunicator>(shared_from_this(), rank, *cuda_backend);
    try {
        comm->init();
    } catch (...) {
        comm->abort();  // an initialisation in progress is ended too
        throw;
    }
    return comm;
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclGroup> group, int rank, CudaBackend& backend)
    : group_(std::move(group)), rank_(rank), size_(group_->size()), backend_(backend), compute_(backend.stream()) {
    if (size_ > 1) collective_limit_ = collective_timeout_seconds();  // a bad value refuses before any allocation
    NANOQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    NANOQ_CUDA_CHECK(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
    for (cudaEvent_t& event : done_) NANOQ_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    NANOQ_CUDA_CHECK(cudaMalloc(&barrier_token_, sizeof(float)));
    backend_.set_host_wait_check([this](double waited) { check(waited); });
}

// Seconds the initialisation waits for every rank of the world to join
// (NANOQ_NCCL_INIT_TIMEOUT; 0 = for ever). NCCL itself waits for ever: a
// process of the run that failed before connecting (under a launcher that
// does not end the others, such as srun without --kill-on-bad-exit) would
// leave the rest hanging without a word.
double nccl_init_timeout() { return seconds_from_env("NANOQ_NCCL_INIT_TIMEOUT", 600.0); }

void NcclCommunicator::init() {
    if (size_ == 1) return;
    const double limit = nccl_init_timeout();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // returns at once; the wait for every rank is polled (complete)
    const ncclResult_t status = ncclCommInitRankConfig(&comm_, size_, group_->id(), rank_, &config);
    if (status != ncclSuccess && status != ncclInProgress) comm_ = nullptr;  // no communicator to end
    complete(status, "ncclCommInitRankConfig", limit,
             "it waited for every rank of the world to join: a process of the run may have failed or not started, "
             "or the processes disagree on the world (NANOQ_NCCL_INIT_TIMEOUT sets this limit)");
}

NcclCommunicator::~NcclCommunicator() {
    backend_.set_host_wait_check(nullptr);
    if (comm_ && !group_->aborted()) {
        // A healthy group: flush and destroy (every rank does it at once).
        try {
            complete(ncclCommFinalize(comm_), "ncclCommFinalize");
            ncclCommDestroy(comm_);
            comm_ = nullptr;
        } catch (...) {
            // Failed or abandoned on the way: aborted below.
        }
    }
    abort();
    cudaFree(barrier_token_);
    cudaEventDestroy(compute_done_);
    for (cudaEvent_t event : done_) cudaEventDestroy(event);
    cudaStreamDestroy(stream_);
}

void NcclCommunicator::abort() {
    if (!comm_) return;
    ncclCommAbort(comm_);
    comm_ = nullptr;
}

void NcclCommunicator::check(double waited) {
    if (group_->aborted()) throw WorkerAborted("collective abandoned: another worker failed");
    if (!comm_) return;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t status = ncclCommGetAsyncError(comm_, &state);
    if (status != ncclSuccess) state = status;
    if (state != ncclSuccess && state != ncclInProgress)
        throw NanoqError(nccl_message(state, "an earlier call (ncclCommGetAsyncError)"));
    // A host wait: the device's work includes collectives, which wait for
    // every rank. The limit is read as each wait begins, as the Python
    // layer reads it for each exchange.
    if (waited == 0.0 && size_ > 1) collective_limit_ = collective_timeout_seconds();
    if (collective_limit_ > 0 && waited > collective_limit_)
        timed_out("its GPU's work", collective_limit_,
                  ("that work includes collectives, which wait for every rank of the world: " +
                   collective_timeout_advice()).c_str());
}

void NcclCommunicator::timed_out(const char* what, double limit_seconds, const char* why_limit) const {
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%g", limit_seconds);
    throw NanoqError("rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ": " + what +
                     " did not finish within " + seconds + " s: " +
                     (why_limit ? std::string(why_limit)
                                : "a call on the communicator waits for every rank of the world: " +
                                      collective_timeout_advice()));
}

void NcclCommunicator::complete(ncclResult_t status, const char* what, double limit_seconds, const char* why_limit) {
    if (limit_seconds < 0) limit_seconds = collective_limit_;  // (why_limit null: timed_out says why)
    const auto start = std::chrono::steady_clock::now();
    for (Backoff backoff; status == ncclInProgress; backoff.pause()) {
        if (group_->aborted()) throw WorkerAborted("collective abandoned: another worker failed");
        const ncclResult_t query = ncclCommGetAsyncError(comm_, &status);
        if (query != ncclSuccess) status = query;
        if (status == ncclInProgress && limit_seconds > 0 &&
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit_seconds)
            timed_out(what, limit_seconds, why_limit);
    }
    if (status != ncclSuccess) throw NanoqError(nccl_message(status, what));
}

template <class Issue>
void NcclCommunicator::per_owner(const char* what, std::int64_t begin, std::int64_t end, std::int64_t shard,
                                 Issue&& issue) {
    ncclResult_t status = ncclGroupStart();
    if (status != ncclSuccess) throw NanoqError(nccl_message(status, "ncclGroupStart"));
    for (std::int64_t at = begin; at < end && status == ncclSuccess;) {
        const int owner = static_cast<int>(at / shard);
        const std::int64_t stop = std::min(end, (owner + 1) * shard);
        status = issue(owner, at, stop);
        at = stop;
    }
    // The group is ended whatever happened, so that this thread's later NCCL calls are not grouped.
    const ncclResult_t group_end = ncclGroupEnd();
    complete(status != ncclSuccess ? status : group_end, what);
}

std::size_t NcclCommunicator::chunk(const Tensor& buffer) const {
    if (buffer.numel() % size_ != 0)
        throw InternalError("collective on " + std::to_string(buffer.numel()) + " elements, not divisible by " +
                            std::to_string(size_) + " ranks");
    return static_cast<std::size_t>(buffer.numel() / size_);
}

void NcclCommunicator::start_collective() {
    check();
    NANOQ_CUDA_CHECK(cudaEventRecord(compute_done_, compute_));
    NANOQ_CUDA_CHECK(cudaStreamWaitEvent(stream_, compute_done_, 0));
}

CommTicket NcclCommunicator::finish_collective(bool now) {
    const CommTicket ticket = ++issued_;
    NANOQ_CUDA_CHECK(cudaEventRecord(done_[ticket % kTicketEvents], stream_));
    if (now) wait(ticket);
    return ticket;
}

CommTicket NcclCommunicator::on_compute_stream() {
    waited_ = ++issued_;
    return issued_;
}

void NcclCommunicator::wait(CommTicket ticket) {
    if (ticket <= waited_) return;
    NANOQ_CUDA_CHECK(cudaStreamWaitEvent(compute_, done_[ticket % kTicketEvents], 0));
    waited_ = ticket;
    trace("compute-waits", ticket);
}

void NcclCommunicator::reduce_scatter_sum(const Tensor& buffer) {
    if (size_ == 1) return;
    const std::size_t n = chunk(buffer);
    char* base = static_cast<char*>(buffer.data);
    start_collective();
    complete(ncclReduceScatter(base, base + rank_ * n * dtype_size(buffer.dtype), n, nccl_type(buffer.dtype), ncclSum,
                               comm_, stream_),
             "ncclReduceScatter");
    finish_collective();
}

void NcclCommunicator::all_gather(const Tensor& buffer) {
    if (size_ == 1) return;
    const std::size_t n = chunk(buffer);
    char* base = static_cast<char*>(buffer.data);
    start_collective();
    complete(ncclAllGather(base + rank_ * n * dtype_size(buffer.dtype), base, n, nccl_type(buffer.dtype), comm_,
                           stream_),
             "ncclAllGather");
    finish_collective();
}

CommTicket NcclCommunicator::gather_range(const Tensor& out, std::int64_t begin, std::int64_t end, const Tensor& own,
                                          std::int64_t shard, bool now) {
    const std::size_t element = dtype_size(own.dtype);
    if (size_ == 1) {
        NANOQ_CUDA_CHECK(cudaMemcpyAsync(out.data, static_cast<const char*>(own.data) + begin * element,
                                         (end - begin) * element, cudaMemcpyDefault, compute_));
        return on_compute_stream();
    }
    // One broadcast per owner of a piece of the range, from its shard.
    start_collective();
    per_owner("ncclBroadcast", begin, end, shard, [&](int owner, std::int64_t at, std::int64_t stop) {
        return ncclBroadcast(static_cast<const char*>(own.data) + (at - owner * shard) * element,
                             static_cast<char*>(out.data) + (at - begin) * element, stop - at, nccl_type(own.dtype),
                             owner, comm_, stream_);
    });
    return finish_collective(now);
}

CommTicket NcclCommunicator::reduce_range(const Tensor& in, std::int64_t begin, std::int64_t end, const Tensor& own,
                                          std::int64_t shard, RangeSum mode, bool now) {
    const std::int64_t lo = std::max(begin, rank_ * shard), hi = std::min(end, (rank_ + 1) * shard);
    if (size_ == 1) {
        float* target = own.f32() + (lo - rank_ * shard);
        const float* mine = in.f32() + (lo - begin);
        if (lo < hi && mode == RangeSum::Add) {
            accumulate<float>(target, mine, hi - lo, compute_);
            NANOQ_CUDA_CHECK_LAUNCH();
        } else if (lo < hi && target != mine) {
            NANOQ_CUDA_CHECK(cudaMemcpyAsync(target, mine, (hi - lo) * sizeof(float), cudaMemcpyDefault, compute_));
        }
        return on_compute_stream();
    }
    // One reduce per owner of a piece. The owner receives its sum in place
    // (to add it) or straight into its shard (to store it); the other ranks'
    // receive buffers are unused, and name their input.
    start_collective();
    per_owner("ncclReduce", begin, end, shard, [&](int owner, std::int64_t at, std::int64_t stop) {
        float* send = in.f32() + (at - begin);
        float* receive = owner == rank_ && mode == RangeSum::Store ? own.f32() + (at - owner * shard) : send;
        return ncclReduce(send, receive, stop - at, ncclFloat32, ncclSum, owner, comm_, stream_);
    });
    // The owner's addition runs on the communication stream too: the
    // compute does not wait for the sum.
    if (lo < hi && mode == RangeSum::Add) {
        accumulate<float>(own.f32() + (lo - rank_ * shard), in.f32() + (lo - begin), hi - lo, stream_);
        NANOQ_CUDA_CHECK_LAUNCH();
    }
    return finish_collective(now);
}

void NcclCommunicator::barrier() {
    if (size_ == 1) return;
    // A one-element all-reduce that every rank waits for on the host.
    start_collective();
    complete(ncclAllReduce(barrier_token_, barrier_token_, 1, ncclFloat32, ncclSum, comm_, stream_),
             "ncclAllReduce (barrier)");
    finish_collective();
    backend_.host_wait(stream_);
}

}  // namespace

std::shared_ptr<CommGroup> make_nccl_group(const Topology& topology) {
    // Processes that disagree refuse before NCCL connects them (which would
    // wait for ever, or run collectives captured on some ranks only).
    if (topology.transport) require_same_signature(*topology.transport, topology.signature);
    return std::make_shared<NcclGroup>(topology);
}

std::string new_nccl_id() {
    ncclUniqueId id;
    const ncclResult_t status = ncclGetUniqueId(&id);
    if (status != ncclSuccess) throw NanoqError(nccl_message(status, "ncclGetUniqueId"));
    return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

}  // namespace cuda
}  // namespace nanoq
