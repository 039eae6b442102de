/* main -> caller -> ncclAllReduce (uret_lib.c) for `argv[1]` milliseconds; see uret_lib.c. */
#include <stddef.h>
#include <stdlib.h>

int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op, void *comm,
                  void *stream);

__attribute__((noinline)) int caller(long ms) {
    int r = ncclAllReduce(NULL, NULL, (size_t)ms, 7, 0, NULL, (void *)0x5151);  /* the stream: on the stack */
    __asm__ volatile("" ::: "memory");  /* not a tail call: caller stays on the stack */
    return r;
}

int main(int argc, char **argv) {
    return caller(argc > 1 ? atol(argv[1]) : 1000);
}
