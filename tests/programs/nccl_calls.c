/* A fixed set of NCCL calls for tests/integration/test_runtime_nccl.py. Without a GPU every communicator
 * constructor fails (ncclUnhandledCudaError) and collectives on a NULL communicator return ncclInvalidArgument
 * before touching anything, which is all the probes need. Each call prints "name ret" so the test can compare
 * the return values the probes saw.
 *
 * The prototypes and types are those of nccl.h (NCCL 2.32), declared here so the build needs no CUDA headers
 * (nccl.h includes cuda_runtime.h and cuda_fp16.h, which need CCCL headers the wheels lack). Recent additions
 * (ncclAlltoAll, the nccl*Config collectives of 2.32) are weak: made only when the library has them, and
 * printed as "name skipped" otherwise.
 * Build: gcc -O0 -fno-omit-frame-pointer nccl_calls.c /path/to/libnccl.so.2 -Wl,-rpath,/path/to
 */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef int ncclResult_t;
typedef void *cudaStream_t;
enum { ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8,
       ncclInt64 = 4, ncclBfloat16 = 9 };
enum { ncclSum = 0, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };
typedef struct {
    size_t size;
    unsigned int magic, version;
    int blocking, cgaClusterSize, minCTAs, maxCTAs;
    const char *netName;
    int splitShare, trafficClass;
    const char *commName;
    int rest[15]; /* collnetEnable ... nvlsHostMode: sizeof 120 as in NCCL 2.32 */
} ncclConfig_t;

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config);
ncclResult_t ncclCommInitAll(ncclComm_t *comm, int ndev, const int *devlist);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op,
                           ncclComm_t comm, cudaStream_t stream);
__attribute__((weak)) ncclResult_t ncclAllReduceConfig(const void *sendbuff, void *recvbuff, size_t count,
                                                       int datatype, int op, ncclComm_t comm, cudaStream_t stream,
                                                       const void *config);
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, int datatype, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, int datatype, int op,
                               ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, int datatype, int root,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBcast(void *buff, size_t count, int datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op, int root,
                        ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclSend(const void *sendbuff, size_t count, int datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclRecv(void *recvbuff, size_t count, int datatype, int peer, ncclComm_t comm, cudaStream_t stream);
__attribute__((weak)) ncclResult_t ncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count, int datatype,
                                                ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

/* Fake streams: NCCL rejects the NULL communicator before it looks at the stream. */
#define STREAM_A ((cudaStream_t)0x5151)
#define STREAM_B ((cudaStream_t)0x5252)

static float buf[4096];

_Static_assert(sizeof(ncclConfig_t) == 120, "ncclConfig_t as in NCCL 2.32");

static void report(const char *name, ncclResult_t r) {
    printf("%s %d\n", name, r);
    fflush(stdout);
}

static void make_communicators(void) {
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    uint64_t magic = 0x1122334455667788ULL; /* the probes report the id's first 8 bytes */
    memcpy(id.internal, &magic, sizeof magic);
    ncclComm_t comm = NULL;
    report("ncclCommInitRank", ncclCommInitRank(&comm, 2, id, 1));

    ncclConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.size = sizeof cfg;
    cfg.magic = 0xcafebeef;
    cfg.version = 23203;
    cfg.blocking = cfg.cgaClusterSize = cfg.minCTAs = cfg.maxCTAs = INT_MIN;
    cfg.splitShare = cfg.trafficClass = INT_MIN;
    cfg.commName = "tp-group";
    for (int i = 0; i < 15; i++)
        cfg.rest[i] = INT_MIN;
    report("ncclCommInitRankConfig", ncclCommInitRankConfig(&comm, 4, id, 3, &cfg));

    ncclComm_t comms[2] = {NULL, NULL};
    int devs[2] = {0, 1};
    report("ncclCommInitAll", ncclCommInitAll(comms, 2, devs));

    ncclComm_t child = NULL;
    report("ncclCommSplit", ncclCommSplit(NULL, 5, 7, &child, NULL));
}

static void collectives(void) {
    for (int i = 0; i < 3; i++)
        report("ncclAllReduce", ncclAllReduce(buf, buf, 1000, ncclFloat32, ncclSum, NULL, STREAM_A));
    if (ncclAllReduceConfig)
        report("ncclAllReduceConfig", ncclAllReduceConfig(buf, buf, 500, ncclFloat32, ncclAvg, NULL, NULL, NULL));
    else
        printf("ncclAllReduceConfig skipped\n");
    report("ncclAllGather", ncclAllGather(buf, buf, 100, ncclInt64, NULL, STREAM_B));
    report("ncclReduceScatter", ncclReduceScatter(buf, buf, 256, ncclFloat16, ncclMax, NULL, NULL));
    report("ncclBroadcast", ncclBroadcast(buf, buf, 10, ncclInt8, 1, NULL, STREAM_A));
    report("ncclBcast", ncclBcast(buf, 33, ncclUint8, 0, NULL, NULL));
    report("ncclReduce", ncclReduce(buf, buf, 64, ncclFloat64, ncclMin, 1, NULL, STREAM_B));
    if (ncclAlltoAll)
        report("ncclAlltoAll", ncclAlltoAll(buf, buf, 8, ncclBfloat16, NULL, NULL));
    else
        printf("ncclAlltoAll skipped\n");
}

static void point_to_point(void) {
    report("ncclGroupStart", ncclGroupStart());
    report("ncclSend", ncclSend(buf, 10, ncclInt32, 1, NULL, NULL));
    report("ncclRecv", ncclRecv(buf, 20, ncclInt32, 0, NULL, NULL));
    report("ncclGroupEnd", ncclGroupEnd());
}

static void run_calls(void) {
    make_communicators();
    collectives();
    point_to_point();
    report("ncclCommDestroy", ncclCommDestroy(NULL));
}

int main(void) {
    run_calls();
    return 0;
}
