/* The USDT probes iaprof's patched Intel compute runtime provides, placed in a plain program for
 * tests/integration/test_runtime_level_zero_usdt.py: level_zero:launch_kernel(iba, start VA, size, name) at
 * sites whose arguments land in different places at -O2 (argument registers, callee-saved registers, stack
 * memory, constants), and level_zero:compile_kernel(debug zebin path) behind a semaphore, so it fires only when
 * the profiler raised it. Each probe that fires is printed, for the test to compare.
 *
 * Build: gcc -O2 -g -fno-omit-frame-pointer ze_usdt.c (sys/sdt.h from systemtap-sdt-dev)
 */
#define _SDT_HAS_SEMAPHORES 1
#include <stdint.h>
#include <stdio.h>
#include <sys/sdt.h>

unsigned short level_zero_launch_kernel_semaphore __attribute__((section(".probes"), used));
unsigned short level_zero_compile_kernel_semaphore __attribute__((section(".probes"), used));

struct kernel {
    uint64_t iba, va, size;
    const char *name;
};

static const struct kernel kernels[] = {
    {0x800000000000ULL, 0x800000001000ULL, 0x400, "gemm_tile"},
    {0x800000000000ULL, 0x800000001400ULL, 0x200, "softmax_rows"},
    {0x900000000000ULL, 0x900000000040ULL, 0x1000, "layer_norm"},
};

static void report(uint64_t iba, uint64_t va, uint64_t size, const char *name) {
    printf("launch %#llx %#llx %#llx %s\n", (unsigned long long)iba, (unsigned long long)va,
           (unsigned long long)size, name);
    fflush(stdout);
}

/* a call the values must survive */
__attribute__((noinline)) void touch(uint64_t iba, uint64_t va, uint64_t size, const char *name) {
    __asm__ volatile("" : : "r"(iba), "r"(va), "r"(size), "r"(name) : "memory");
}

/* arguments in the argument registers */
__attribute__((noinline)) void launch_regs(uint64_t iba, uint64_t va, uint64_t size, const char *name) {
    DTRACE_PROBE4(level_zero, launch_kernel, iba, va, size, name);
    report(iba, va, size, name);
}

/* values kept across calls: callee-saved registers */
__attribute__((noinline)) void launch_loop(int n) {
    for (int i = 0; i < n; i++) {
        const struct kernel *k = &kernels[i % 3];
        uint64_t iba = k->iba, va = k->va + 0x10 * (uint64_t)i, size = k->size;
        const char *name = k->name;
        touch(iba, va, size, name);
        DTRACE_PROBE4(level_zero, launch_kernel, iba, va, size, name);
        report(iba, va, size, name);
    }
}

/* volatile locals: memory relative to the stack pointer */
__attribute__((noinline)) void launch_stack(const struct kernel *k) {
    volatile uint64_t iba = k->iba, va = k->va;
    volatile int32_t size = (int32_t)k->size;
    const char *volatile name = k->name;
    DTRACE_PROBE4(level_zero, launch_kernel, iba, va, size, name);
    report(iba, va, (uint64_t)size, name);
}

/* constants */
__attribute__((noinline)) void launch_const(void) {
    DTRACE_PROBE4(level_zero, launch_kernel, 0xa00000000000ULL, 0xa00000002000ULL, 0x80, "const_kernel");
    report(0xa00000000000ULL, 0xa00000002000ULL, 0x80, "const_kernel");
}

__attribute__((noinline)) void compile(const char *path) {
    if (level_zero_compile_kernel_semaphore) {
        DTRACE_PROBE1(level_zero, compile_kernel, path);
        printf("compile %s\n", path);
        fflush(stdout);
    }
}

int main(void) {
    compile("/tmp/aiflame-test/kernels.debug.zebin");
    launch_regs(kernels[0].iba, kernels[0].va, kernels[0].size, kernels[0].name);
    launch_loop(3);
    launch_stack(&kernels[2]);
    launch_const();
    return 0;
}
