/* main -> outer -> code in anonymous executable memory (a JIT's kernel, as oneDNN's in libtorch: no CFI, no frame
 * pointer) for about as many CPU seconds as argv[1]: the truth a walk through JIT code must find
 * (tests/integration/test_unwind_scan.py). The code is a leaf: n in rdi, a countdown loop, ret. */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef void (*spin_fn)(long n);

/* mov rcx, rdi; 1: dec rcx; jnz 1b; ret */
static const unsigned char SPIN[] = {0x48, 0x89, 0xf9, 0x48, 0xff, 0xc9, 0x75, 0xfb, 0xc3};

static double cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

__attribute__((noinline)) void outer(spin_fn spin, long n) {
    spin(n);
    __asm__ volatile("" ::: "memory");  /* not a tail call: outer's frame stays */
}

int main(int argc, char **argv) {
    double secs = argc > 1 ? atof(argv[1]) : 1.0;
    unsigned char *code = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (code == MAP_FAILED)
        return 1;
    memcpy(code, SPIN, sizeof(SPIN));
    if (mprotect(code, 4096, PROT_READ | PROT_EXEC) != 0)
        return 1;
    while (cpu_seconds() < secs)
        outer((spin_fn)code, 2000000);
    return 0;
}
