// Moving bytes between the processes of a run, for the cpu communicator.
//
// A launcher (mpiexec, srun) starts the processes; MPI connects them. The
// core does not link MPI: the program that embeds it hands the trainer a
// ProcessTransport over its own MPI communicator (the Python package's is
// mpi4py's, see nanoq.distributed), so the core works with whichever MPI
// the program brought up and builds without one. Only the cpu backend's
// collectives go through it; the cuda backend's go through NCCL, whose id
// the program broadcasts itself (TrainOptions::comm_id).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace nanoq {

class ProcessTransport {
public:
    virtual ~ProcessTransport() = default;
    // This process's rank among size() processes.
    virtual int rank() const = 0;
    virtual int size() const = 0;
    // Collective over all processes, called in the same order on every one
    // and by one thread of a process at a time: sends send_bytes[q] bytes,
    // the q-th consecutive block of `send`, to process q, and receives
    // recv_bytes[q] bytes from process q into the q-th consecutive block of
    // `recv` (the block to and from this process itself included). Throws
    // NanoqError when the transfer fails.
    virtual void alltoallv(const void* send, const std::vector<std::int64_t>& send_bytes, void* recv,
                           const std::vector<std::int64_t>& recv_bytes) = 0;
    // Returns when every process has called it.
    virtual void barrier() = 0;
    // Both should give up, throwing NanoqError, when they have waited for
    // the other processes longer than collective_timeout_seconds() (when
    // > 0), as the Python package's (nanoq.distributed.MPITransport) does.
};

// The seconds environment variable `name` gives, `fallback` when it is
// unset or empty; InvalidArgument naming the variable for anything but a
// number >= 0 (where the callers take 0 as "no limit").
double seconds_from_env(const char* name, double fallback);
// How long a rank waits for work that includes collectives with other
// ranks before it gives up with an error (NANOQ_COLLECTIVE_TIMEOUT, 1800
// seconds by default; 0 waits for ever): a rank whose process stopped
// without failing (stuck in I/O or a deadlock, its GPU hung) would
// otherwise leave every other rank waiting in a collective for good. The
// cuda backend's NCCL waits and the transports honour it.
double collective_timeout_seconds();
// The end of that error's message: what may have happened, and the variable.
std::string collective_timeout_advice();

}  // namespace nanoq
