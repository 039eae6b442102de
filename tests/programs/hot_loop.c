// A hot loop for `aiflame annotate`: nearly all samples fall on the lines marked loop_start to loop_end, in
// hot_loop (noinline, exported with -rdynamic so a stripped copy still names it from .dynsym). Runs for argv[1]
// seconds of CPU time (default 1): a fixed amount of work, however busy the host.
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define N 4096

__attribute__((noinline)) double hot_loop(const double *a, long n, long reps) {
    double s = 0.0;
    for (long r = 0; r < reps; r++) {  // MARK:loop_start
        for (long i = 0; i < n; i++) {
            s += a[i] * 1.0000001 + (double)(i & 7);
        }
    }  // MARK:loop_end
    return s;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    double secs = argc > 1 ? atof(argv[1]) : 1.0;
    static double a[N];
    for (int i = 0; i < N; i++) a[i] = i * 0.5;
    double t0 = now(), s = 0.0;
    while (now() - t0 < secs) s += hot_loop(a, N, 64);
    printf("%f\n", s);
    return 0;
}
