/* Known split: each round spends 70% of its work in func_a and 30% in func_b (same inner loop).
 * Usage: cpu_split [seconds] [percent_a]: seconds of CPU time, not of wall time (a fixed amount of work, however
 * busy the host). Built with frame pointers. */
#include <stdlib.h>
#include <time.h>

static volatile unsigned long sink;

__attribute__((noinline)) static void spin(unsigned long n) {
    unsigned long x = sink;
    for (unsigned long i = 0; i < n; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    sink = x;
}

__attribute__((noinline)) void func_a(unsigned long n) { spin(n); }
__attribute__((noinline)) void func_b(unsigned long n) { spin(n); }

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 5.0;
    unsigned long pct_a = argc > 2 ? strtoul(argv[2], NULL, 10) : 70;
    struct timespec t0, t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t0);
    do {
        for (int r = 0; r < 20; r++) {
            func_a(pct_a * 2000);
            func_b((100 - pct_a) * 2000);
        }
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < seconds);
    return 0;
}
