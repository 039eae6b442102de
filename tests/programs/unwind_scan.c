/* main -> outer -> nocfi_spin (tests/programs/unwind_nocfi.s, no CFI, no frame pointer) for about as many CPU
 * seconds as argv[1]: the truth a stack scan must find (tests/integration/test_unwind_scan.py). */
#include <stdlib.h>
#include <time.h>

void nocfi_spin(long n);

static double cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

__attribute__((noinline)) void outer(long n) {
    nocfi_spin(n);
    __asm__ volatile("" ::: "memory");  /* not a tail call: outer's frame stays */
}

int main(int argc, char **argv) {
    double secs = argc > 1 ? atof(argv[1]) : 1.0;
    while (cpu_seconds() < secs)
        outer(2000000);
    return 0;
}
