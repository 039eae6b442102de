/* main -> outer -> a leaf generated at run time into anonymous executable memory (as oneDNN's JIT kernels are:
 * no file, no CFI, no frame pointer; it saves two registers, zeroes 136 bytes of locals, sets rbp to 0 and spins
 * rdi times) for about as many CPU seconds as argv[1]: the truth a stack scan from a leaf outside every file
 * mapping must find (tests/integration/test_unwind_scan.py). */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static const unsigned char SPIN[] = {
    0x53,                                      /* push rbx */
    0x55,                                      /* push rbp */
    0x48, 0x81, 0xec, 0x88, 0x00, 0x00, 0x00,  /* sub rsp, 136 */
    0x31, 0xc0,                                /* xor eax, eax */
    0xb9, 0x11, 0x00, 0x00, 0x00,              /* mov ecx, 17 */
    0x48, 0x89, 0xfb,                          /* mov rbx, rdi */
    0x48, 0x8d, 0x3c, 0x24,                    /* lea rdi, [rsp] */
    0xf3, 0x48, 0xab,                          /* rep stosq */
    0x31, 0xed,                                /* xor ebp, ebp */
    0x48, 0xff, 0xcb,                          /* 1: dec rbx */
    0x75, 0xfb,                                /* jnz 1b */
    0x48, 0x81, 0xc4, 0x88, 0x00, 0x00, 0x00,  /* add rsp, 136 */
    0x5d,                                      /* pop rbp */
    0x5b,                                      /* pop rbx */
    0xc3,                                      /* ret */
};

typedef void (*spin_fn)(long);

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
    void *code = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (code == MAP_FAILED)
        return 1;
    memcpy(code, SPIN, sizeof(SPIN));
    if (mprotect(code, 4096, PROT_READ | PROT_EXEC) != 0)
        return 1;
    while (cpu_seconds() < secs)
        outer((spin_fn)code, 2000000);
    return 0;
}
