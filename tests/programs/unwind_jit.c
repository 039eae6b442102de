/* main -> outer -> code in anonymous executable memory (a JIT's kernel, as oneDNN's in libtorch: no CFI, no frame
 * pointer) for about as many CPU seconds as argv[1]: the truth a walk through JIT code must find
 * (tests/integration/test_unwind_scan.py). The code is a leaf: n in rdi, a countdown loop, ret. With argv[2]
 * "big" it first takes a 2 KiB frame and fills it (as oneDNN's kernels spill vector registers), so its return
 * address lies 256 words above the sp of every sample in its loop. */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef void (*spin_fn)(long n);

/* mov rcx, rdi; 1: dec rcx; jnz 1b; ret */
static const unsigned char SPIN[] = {0x48, 0x89, 0xf9, 0x48, 0xff, 0xc9, 0x75, 0xfb, 0xc3};

/* sub rsp, 0x800; mov rcx, 0x100; 1: mov [rsp + rcx*8 - 8], rdi; dec rcx; jnz 1b;
 * mov rcx, rdi; 2: dec rcx; jnz 2b; add rsp, 0x800; ret */
static const unsigned char SPIN_BIG[] = {
    0x48, 0x81, 0xec, 0x00, 0x08, 0x00, 0x00, 0x48, 0xc7, 0xc1, 0x00, 0x01, 0x00, 0x00,
    0x48, 0x89, 0x7c, 0xcc, 0xf8, 0x48, 0xff, 0xc9, 0x75, 0xf6,
    0x48, 0x89, 0xf9, 0x48, 0xff, 0xc9, 0x75, 0xfb, 0x48, 0x81, 0xc4, 0x00, 0x08, 0x00, 0x00, 0xc3};

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
    if (argc > 2 && strcmp(argv[2], "big") == 0)
        memcpy(code, SPIN_BIG, sizeof(SPIN_BIG));
    else
        memcpy(code, SPIN, sizeof(SPIN));
    if (mprotect(code, 4096, PROT_READ | PROT_EXEC) != 0)
        return 1;
    while (cpu_seconds() < secs)
        outer((spin_fn)code, 2000000);
    return 0;
}
