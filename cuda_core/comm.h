// The communicator interface: collectives between the device workers.
//
// Every worker holds one Communicator (its rank). Collectives are called by
// all ranks in the same order. Sums always add ranks 0..N-1 in the same order
// on every rank, so every rank sees the same bits and a run is deterministic
// for a device count. A failing worker aborts the group and its own
// communicator: every rank blocked in, or later entering, a collective (or a
// host wait on one) then throws WorkerAborted instead of waiting forever.
#pragma once

#include <memory>
#include <string>

#include "tensor.h"

namespace nanoq {

class Backend;

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
    // [r * shard, (r + 1) * shard), held in its tensor `own` (ZeRO-2/3):
    // gather_range fills `out` with elements [begin, end) from their owners,
    // on every rank; reduce_range_add sums `in` (every rank's values of
    // [begin, end)) over ranks and adds the sum of the part a rank owns into
    // its `own`. `scratch` holds at least end - begin float32 elements.
    // With `now` false, gather_range only issues the copy: the device's
    // compute may run alongside it until wait() (used to prefetch a layer).
    virtual void gather_range(const Tensor& out, std::int64_t begin, std::int64_t end, const Tensor& own,
                              std::int64_t shard, bool now = true) = 0;
    virtual void reduce_range_add(const Tensor& in, std::int64_t begin, std::int64_t end, const Tensor& own,
                                  std::int64_t shard, const Tensor& scratch) = 0;
    // Orders the device's compute after every collective issued so far.
    virtual void wait() = 0;
    virtual void barrier() = 0;
    // Abandons this rank's collectives, queued or in flight, for good: called
    // on this rank's worker thread after it failed (a communicator is never
    // touched by another rank's thread). Idempotent.
    virtual void abort() {}
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
    // compared where the backend can (the shared-memory world).
    std::string signature;
};

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
// Trainers of one process with the same topology id form one world.
std::shared_ptr<CommGroup> make_shared_memory_group(const Topology& topology);
// A fresh id for make_shared_memory_group: unique within the process.
std::string new_shared_memory_id();

}  // namespace nanoq
