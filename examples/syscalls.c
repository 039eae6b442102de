/* Spends most of its time in the kernel: reads /dev/zero in large chunks.
 * Usage: syscalls [seconds]: of CPU time (user and system), not of wall time (a fixed amount of work). */
#include <fcntl.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static char buf[1 << 20];

__attribute__((noinline)) void read_zeros(int fd) {
    for (int i = 0; i < 16; i++)
        if (read(fd, buf, sizeof buf) < 0)
            exit(1);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 5.0;
    int fd = open("/dev/zero", O_RDONLY);
    if (fd < 0)
        return 1;
    struct timespec t0, t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t0);
    do {
        read_zeros(fd);
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < seconds);
    return 0;
}
