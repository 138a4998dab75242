// The communicator interface: collectives between the device workers.
//
// Every worker holds one Communicator (its rank). Collectives are called by
// all ranks in the same order. Sums always add ranks 0..N-1 in that order, so
// every rank sees the same bits and a run is deterministic for a device count.
// A failing worker calls abort(): every rank blocked in, or later entering, a
// collective then throws WorkerAborted instead of waiting forever.
#pragma once

#include <memory>

#include "tensor.h"

namespace nanoq {

class Communicator {
public:
    virtual ~Communicator() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;

    // Sum over ranks, result on every rank.
    virtual void all_reduce_sum(const Tensor& buffer) = 0;
    // `buffer` holds size() equal chunks; afterwards chunk rank() holds the sum
    // of that chunk over ranks (other chunks are left as they were).
    virtual void reduce_scatter_sum(const Tensor& buffer) = 0;
    // `buffer` holds size() equal chunks; afterwards every rank holds every
    // rank's own chunk.
    virtual void all_gather(const Tensor& buffer) = 0;
    virtual void barrier() = 0;
    virtual void abort() = 0;
};

// A group of communicators for worker threads that share host memory.
class SharedMemoryGroup;
std::shared_ptr<SharedMemoryGroup> make_shared_memory_group(int size);
std::unique_ptr<Communicator> make_shared_memory_communicator(std::shared_ptr<SharedMemoryGroup> group, int rank);
// Releases every rank of the group from its collectives, now and later.
void abort_shared_memory_group(SharedMemoryGroup& group);

}  // namespace nanoq
