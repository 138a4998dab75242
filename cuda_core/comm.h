// The communicator interface: collectives between the device workers.
//
// Every worker holds one Communicator (its rank). Collectives are called by
// all ranks in the same order. Every rank sees the same bits of a sum. The
// cpu communicator (and the emulated NCCL) add ranks 0..N-1 in order, so a
// run is deterministic for a device count; NCCL adds in the order of its
// algorithm (ring, tree), which may differ between its collectives (a
// reduce-scatter and grouped reduces of the same data) in the last bits
// from three ranks on. A failing worker aborts the group and its own
// communicator: every rank blocked in, or later entering, a collective (or a
// host wait on one) then throws WorkerAborted instead of waiting forever.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "nanoq/transport.h"
#include "tensor.h"

namespace nanoq {

class Backend;

// A collective's place in its rank's issue order (see Communicator).
using CommTicket = std::int64_t;

// How Communicator::reduce_range combines a sum with what its target held.
enum class RangeSum { Store, Add };

// A testing aid, off unless the trainer's testing interface turns it on:
// what one rank's compute issued and waited for, and when its communication
// ran, in the order it happened. Thread safe (the communication thread of
// the cpu communicator records into it too).
class CommTrace {
public:
    struct Event {
        // "backward" (a layer's backward is done), "issue", "wait" (by the
        // trainer); "comm-start", "comm-end" (cpu: the communication thread
        // runs a collective), "compute-waits" (cuda: the compute stream is
        // made to wait for a collective), by the communicator.
        std::string what;
        int layer;         // the layer; -1 for the embedding, num_layers for the head, -2 where not known
        CommTicket ticket; // the collective's ticket; 0 for "backward"
    };
    void record(const char* what, int layer, CommTicket ticket) {
        std::lock_guard<std::mutex> lock(mutex_);
        events_.push_back(Event{what, layer, ticket});
    }
    std::vector<Event> take() {
        std::vector<Event> out;
        std::lock_guard<std::mutex> lock(mutex_);
        out.swap(events_);
        return out;
    }

private:
    std::mutex mutex_;
    std::vector<Event> events_;
};

class Communicator {
public:
    virtual ~Communicator() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;

    // `buffer` holds size() equal chunks; afterwards chunk rank() holds the sum
    // of that chunk over ranks (other chunks are left unspecified).
    virtual void reduce_scatter_sum(const Tensor& buffer) = 0;
    // `buffer` holds size() equal chunks; afterwards every rank holds every
    // rank's own chunk.
    virtual void all_gather(const Tensor& buffer) = 0;

    // Ranges of a flat buffer of which rank r owns the contiguous shard
    // [r * shard, (r + 1) * shard), held in its tensor `own` (ZeRO):
    // gather_range fills `out` with elements [begin, end) from their owners,
    // on every rank; reduce_range sums `in` (every rank's values of
    // [begin, end)) over ranks, and each rank adds (RangeSum::Add) or stores
    // (RangeSum::Store) the sum of the part it owns into its `own`. With
    // Store, `in` may be the part of the very buffer whose shards the `own`s
    // are (an in-place reduce-scatter of a range); with Add, the part of `in`
    // this rank owns is left unspecified.
    //
    // With `now` true a collective is complete, as far as the device's
    // compute is concerned, when it returns. With `now` false it is only
    // issued: it runs alongside the compute (on a communication thread or
    // stream) until wait(ticket) for the ticket it returned, or wait(),
    // orders the compute after it; until then its buffers must not be
    // touched. Tickets grow in issue order and collectives complete in that
    // order, so waiting for one waits for those issued before it too.
    virtual CommTicket gather_range(const Tensor& out, std::int64_t begin, std::int64_t end, const Tensor& own,
                                    std::int64_t shard, bool now = true) = 0;
    virtual CommTicket reduce_range(const Tensor& in, std::int64_t begin, std::int64_t end, const Tensor& own,
                                    std::int64_t shard, RangeSum mode, bool now = true) = 0;
    // Orders the device's compute after collective `ticket`, or after every
    // collective issued so far. Errors of the collective surface here.
    virtual void wait(CommTicket ticket) = 0;
    virtual void wait() = 0;
    virtual void barrier() = 0;
    // Abandons this rank's collectives, queued or in flight, for good: called
    // on this rank's worker thread after it failed (a communicator is never
    // touched by another rank's thread). Idempotent.
    virtual void abort() {}

    // Where this communicator records its testing trace (null: nowhere).
    void set_trace(CommTrace* trace) { trace_ = trace; }

protected:
    void trace(const char* what, CommTicket ticket) {
        if (trace_) trace_->record(what, -2, ticket);
    }
    CommTrace* trace_ = nullptr;
};

// Where one trainer's devices sit among the ranks of its world: global
// ranks first_rank .. first_rank + devices - 1 of world_size. `id` names
// the world (made outside, by the backend's new_comm_id, and given to every
// member); empty: the trainer's devices are the whole world.
struct Topology {
    int world_size = 1;
    int first_rank = 0;
    int devices = 1;
    std::string id;
    // What every member of the world must agree on (model and options),
    // compared where the backend can (the shared-memory world, also across
    // processes).
    std::string signature;
    // The other processes of the world (null: all its trainers are in this
    // process). With one, every process holds `devices` ranks, process p
    // ranks p * devices ..., and the cpu communicator moves what crosses
    // processes through it; the cuda communicator needs only `id`.
    std::shared_ptr<ProcessTransport> transport;
};

// With the other processes of the world: every process's `signature`
// compared with process 0's, so that all of them refuse together
// (InvalidArgument naming the first setting that differs). Every process
// calls it (a collective of the transport).
void require_same_signature(ProcessTransport& transport, const std::string& signature);
// The first "name=value" of signature `a` that `b` lacks, with b's value
// of that name ("" when they agree), for the refusals' messages.
std::string signature_difference(const std::string& a, const std::string& b);

// The communicators of one trainer's devices.
class CommGroup {
public:
    virtual ~CommGroup() = default;
    // Called once on each local device's worker thread (`device` 0..devices-1),
    // all concurrently; `backend` is that device's (its queue orders the
    // collectives). The communicator's rank() is the global rank.
    virtual std::unique_ptr<Communicator> connect(int device, Backend& backend) = 0;
    // Marks the group failed, from any thread: every rank then ends its
    // collectives and host waits, now and later, with WorkerAborted (each
    // aborting its own communicator on its own thread). Thread safe.
    virtual void abort() = 0;
};

// Collectives for worker threads that share host memory (the cpu backend).
// Trainers of one process with the same topology id form one world; with a
// transport, the trainer's devices and those of the other processes do.
std::shared_ptr<CommGroup> make_shared_memory_group(const Topology& topology);
// A fresh id for make_shared_memory_group: unique within the process.
std::string new_shared_memory_id();

}  // namespace nanoq
