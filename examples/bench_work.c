/* Fixed CPU-bound work on N threads, for overhead benchmarks: waits DELAY seconds (so a profiler can attach),
 * (a negative DELAY waits for one byte on stdin instead), then runs ITERS thousand rounds per thread and prints the work's wall time and CPU time (user+sys) in seconds.
 * Usage: bench_work [threads] [iters_thousands] [delay_s] */
#include <pthread.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static unsigned long iters;
static volatile unsigned long sink;

__attribute__((noinline)) static unsigned long kernel_b(unsigned long x) {
    for (int i = 0; i < 1000; i++)
        x = x * 2862933555777941757UL + 3037000493UL;
    return x;
}

__attribute__((noinline)) static unsigned long kernel_a(unsigned long x) {
    for (int i = 0; i < 1000; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    return kernel_b(x);
}

static void *worker(void *arg) {
    unsigned long x = (unsigned long)arg;
    for (unsigned long i = 0; i < iters; i++)
        x = kernel_a(x);
    sink = x;
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    iters = (argc > 2 ? strtoul(argv[2], NULL, 10) : 1) * 1000UL;
    double delay = argc > 3 ? atof(argv[3]) : 0;
    if (threads < 1 || threads > 64)
        return 2;
    if (delay < 0) {
        char c;
        if (read(0, &c, 1) != 1)
            return 3;
    } else {
        usleep((useconds_t)(delay * 1e6));
    }
    pthread_t t[64];
    double t0 = now();
    for (long i = 0; i < threads; i++)
        pthread_create(&t[i], NULL, worker, (void *)(i + 1));
    for (int i = 0; i < threads; i++)
        pthread_join(t[i], NULL);
    double wall = now() - t0;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("%.6f %.6f\n", wall, ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
                                     ru.ru_stime.tv_usec / 1e6);
    return 0;
}
