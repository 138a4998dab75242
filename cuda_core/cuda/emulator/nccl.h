// The NCCL subset nanoq uses, for the CPU emulator: communicators of one
// process made from a unique id, blocking or non-blocking initialisation
// (a nonblocking communicator's calls return ncclInProgress, and its state
// must be polled with ncclCommGetAsyncError before the next call), finalize,
// abort (of one rank: as with the real library, peers waiting for that rank
// are not released until they abort their own communicators), and the
// collectives, queued on the caller's stream (or recorded into a graph
// being captured there). A collective waits on its stream until every rank
// of the communicator has reached the same call (the ranks' collectives are
// matched in the order each rank runs them), then the last rank to arrive carries it out for all (sums in
// rank order, so results are deterministic); the ranks' calls are checked to
// agree (operation, count, type, root), which the real library cannot do.
#pragma once

#include <cstddef>

#include "cuda_runtime.h"

#define NCCL_MAJOR 2
#define NCCL_MINOR 99
#define NCCL_UNIQUE_ID_BYTES 128

enum ncclResult_t : int {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};
enum ncclDataType_t : int { ncclInt32 = 2, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9 };
enum ncclRedOp_t : int { ncclSum = 0 };

struct ncclUniqueId {
    char internal[NCCL_UNIQUE_ID_BYTES];
};
typedef struct nanoq_emu_nccl_comm* ncclComm_t;

struct ncclConfig_t {
    std::size_t size;
    int blocking;
};
#define NCCL_CONFIG_INITIALIZER {sizeof(ncclConfig_t), 1}

const char* ncclGetErrorString(ncclResult_t result);
// The library's last warning ("" here: the emulator's errors say it all).
const char* ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();
ncclResult_t ncclAllReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void* send, void* recv, std::size_t recv_count, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllGather(const void* send, void* recv, std::size_t send_count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t op, int root,
                        ncclComm_t comm, cudaStream_t stream);
