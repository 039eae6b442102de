/* Workload of tests/integration/test_unwind_vs_perf.py and bench/bench_unwind.py, built -O1/-O2
 * -fomit-frame-pointer so only CFI can unwind it. For ARGV[1] seconds of CPU time it runs:
 *   - caller_a and caller_b, 70/30, both around one static leaf (hidden_leaf);
 *   - a tail call (tail_entry jumps to tail_target at -O2: tail_entry is then in no stack, for perf too);
 *   - a function with alloca (its CFA is rbp-based);
 *   - realigned_outer -> realigned_inner, both realigning the stack (a 64-byte-aligned local and a variable-length
 *     array, as libtorch's AVX-512 kernels): their CFA is *(rbp - N) and rbp's saved value is at [rbp], both
 *     as CFI expressions, so a walk that does not restore rbp from there loops in realigned_outer;
 *   - lib_spin, called through the PLT in libunwind_lib.so (built without frame pointers too);
 *   - in_vdso, calling clock_gettime(CLOCK_MONOTONIC) in a loop: most of its samples are in the vDSO, which has
 *     CFI but no file;
 *   - a SIGPROF handler that burns CPU itself, so samples land inside it and the walk must go through
 *     __restore_rt back to the interrupted code. It is armed after 0.25 s: libc (where __restore_rt is) is
 *     the last library the loader maps, and the agent describes it to the unwinder only at its next poll
 *     after the mapping (up to ~0.1 s); the test is about the signal frame, not that start-up delay.
 * Every sample's stack should reach main. */
#define _GNU_SOURCE
#include <alloca.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

volatile unsigned long sink;
unsigned long lib_spin(unsigned long n); /* libunwind_lib.so */

#define NOIPA __attribute__((noipa))

NOIPA static unsigned long hidden_leaf(unsigned long n) {
    unsigned long x = sink;
    for (unsigned long i = 0; i < n; i++)
        x = x * 6364136223846793005UL + i;
    return x;
}

NOIPA unsigned long caller_a(unsigned long n) {
    unsigned long r = hidden_leaf(n);
    sink += r;
    return r ^ 1;
}

NOIPA unsigned long caller_b(unsigned long n) {
    unsigned long r = hidden_leaf(n);
    sink += r;
    return r ^ 2;
}

NOIPA unsigned long tail_target(unsigned long n) {
    return hidden_leaf(n) + 3;
}

NOIPA unsigned long tail_entry(unsigned long n) {
    sink++;
    return tail_target(n); /* a sibling call at -O2 */
}

NOIPA unsigned long with_alloca(unsigned long n) {
    size_t k = 64 + (n & 1023);
    volatile char *p = alloca(k);
    p[0] = 1;
    p[k - 1] = 2;
    return hidden_leaf(n) + p[0] + p[k - 1];
}

NOIPA unsigned long realigned_inner(unsigned long n, int len) {
    _Alignas(64) volatile char v[64];
    char vla[len];
    memset(vla, 1, len);
    v[0] = vla[len - 1];
    return hidden_leaf(n) + v[0];
}

NOIPA unsigned long realigned_outer(unsigned long n, int len) {
    _Alignas(64) volatile char v[64];
    char vla[len];
    memset(vla, 2, len);
    v[1] = vla[0];
    return realigned_inner(n, len + 1) + v[1] + vla[len - 1];
}

NOIPA unsigned long via_plt(unsigned long n) {
    unsigned long r = lib_spin(n);
    sink += r;
    return r;
}

NOIPA unsigned long in_vdso(unsigned long n) {
    struct timespec t;
    unsigned long x = 0;
    for (unsigned long i = 0; i < n; i++) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        x += (unsigned long)t.tv_nsec;
    }
    sink += x;
    return x;
}

NOIPA static void in_handler(unsigned long n) {
    sink += hidden_leaf(n);
}

static void on_prof(int sig) {
    (void)sig;
    in_handler(1000000);
}

static double cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + t.tv_nsec / 1e9;
}

/* n scaled by a pseudo-random 0.5-1.5: same mean, no fixed period */
static unsigned long drawn(unsigned long n, unsigned *state) {
    *state = *state * 1103515245u + 12345u;
    return n / 2 + n * ((*state >> 16) % 1024) / 1024;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    unsigned long chunk = 200000;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_prof;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGPROF, &sa, NULL);
    struct itimerval it = {{0, 20000}, {0, 20000}}; /* every 20 ms of CPU time */
    double start = cpu_seconds(), end = start + seconds;
    int armed = 0;
    unsigned order = 1;
    while (cpu_seconds() < end) {
        if (!armed && cpu_seconds() > start + 0.25) {
            setitimer(ITIMER_PROF, &it, NULL);
            armed = 1;
        }
        /* 7 of 10 calls to caller_a, in a pseudo-random order: a fixed a,a,...,b,b,b pattern is periodic, and perf's
         * regular clock could lock onto it (once it read 74/26 while aiflame read 67.6/32.4 of the same run).
         * Each call's length is drawn too (0.5-1.5 chunks): with fixed lengths the round itself is periodic, and
         * perf once read tail_target, at a fixed place in it, at 3.7 % where aiflame read 7.6 % */
        for (int i = 0; i < 10; i++) {
            order = order * 1103515245u + 12345u;
            if ((order >> 16) % 10 < 7)
                caller_a(drawn(chunk, &order));
            else
                caller_b(drawn(chunk, &order));
        }
        tail_entry(drawn(chunk, &order));
        with_alloca(drawn(chunk, &order));
        realigned_outer(drawn(chunk, &order), 8 + (order & 7));
        via_plt(drawn(chunk, &order));
        in_vdso(drawn(chunk / 8, &order));
    }
    return 0;
}
