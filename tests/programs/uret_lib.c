/* A stand-in libnccl.so.2 for tests/integration/test_unwind_uretprobe.py: ncclAllReduce, which the NCCL runtime
 * probes at entry and return, burns `count` milliseconds of its thread's CPU time (not wall time: the samples it
 * gets do not depend on how busy the host is), so CPU samples land inside a call whose
 * return address the kernel has swapped for its uretprobe trampoline. Built -O1 -fomit-frame-pointer: the walk
 * through it is by CFI. */
#include <stddef.h>
#include <time.h>

static double spin_ms(long ms) {
    struct timespec t0, t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    volatile double x = 0;
    do {
        for (int i = 0; i < 100000; i++)
            x += i * 0.5;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    } while ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000 < ms);
    return x;
}

int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op, void *comm,
                  void *stream) {
    (void)sendbuff, (void)recvbuff, (void)datatype, (void)op, (void)comm, (void)stream;
    return spin_ms((long)count) < 0;
}
