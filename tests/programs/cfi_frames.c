/* Fixture for tests/unit/test_cfi.py: compiled at several optimisation levels, its CFI is compared with
 * readelf's. It covers alloca (CFA moves to rbp), stack realignment (CFA = *(rbp-8)), calls through the
 * PLT, a signal handler, a sigreturn trampoline without augmentation S, a .cfi_signal_frame function, and
 * one function that walks through every CFA instruction the parser interprets (most via .cfi_escape). */
#define _GNU_SOURCE
#include <alloca.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

volatile int sink;

__attribute__((noinline)) int use_alloca(int n) {
    char *p = alloca(n);
    memset(p, n, n);
    return p[n / 2] + sink;
}

__attribute__((noinline, force_align_arg_pointer)) int realigned(int n) {
    _Alignas(64) volatile char buf[256];
    for (int i = 0; i < n && i < 256; i++) buf[i] = (char)i;
    return buf[n & 255] + use_alloca(n + 1);
}

__attribute__((noinline)) long many_args(long a, long b, long c, long d, long e, long f, long g, long h, long i) {
    return a + b + c + d + e + f + g + h + i + sink;
}

__attribute__((noinline)) int early_exit(int n) {
    if (n < 0) return -1;
    long acc = 0;
    for (int i = 0; i < n; i++) acc += many_args(i, i, i, i, i, i, i, i, i) + realigned(i);
    printf("%ld\n", acc);
    return (int)acc;
}

static void on_signal(int sig) { sink += sig; }

/* A sigreturn trampoline without augmentation S (the FDE starts one nop early, as glibc's does), a frame
   marked with .cfi_signal_frame, and one function walking through every CFA instruction we interpret. */
__asm__(
    ".text\n"
    ".globl my_restore_rt\n"
    ".type my_restore_rt, @function\n"
    "trampoline_fde:\n"
    "  .cfi_startproc\n"
    "  nop\n"
    "my_restore_rt:\n"
    "  movq $15, %rax\n"
    "  syscall\n"
    "  .cfi_endproc\n"
    ".globl sigframe_fn\n"
    ".type sigframe_fn, @function\n"
    "sigframe_fn:\n"
    "  .cfi_startproc\n"
    "  .cfi_signal_frame\n"
    "  nop\n"
    "  ret\n"
    "  .cfi_endproc\n"
    ".globl weird_cfi\n"
    ".type weird_cfi, @function\n"
    "weird_cfi:\n"
    "  .cfi_startproc\n"
    "  push %rbp\n"
    "  .cfi_adjust_cfa_offset 8\n"
    "  .cfi_rel_offset %rbp, 0\n"
    "  mov %rsp, %rbp\n"
    "  .cfi_def_cfa_register %rbp\n"
    "  nop\n"
    "  .cfi_remember_state\n"
    "  .cfi_def_cfa %rsp, 8\n"
    "  .cfi_same_value %rbp\n"
    "  nop\n"
    "  .cfi_restore_state\n"
    "  nop\n"
    "  .cfi_register %rip, %rdx\n"
    "  nop\n"
    "  .cfi_offset %rip, -8\n"
    "  nop\n"
    "  .cfi_def_cfa %r10, 0\n"
    "  nop\n"
    "  .cfi_escape 0x0f, 11, 0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3a, 0x2a, 0x33, 0x24, 0x22\n"
    "  nop\n"
    "  .cfi_escape 0x0f, 3, 0x76, 0x78, 0x06\n"
    "  nop\n"
    "  .cfi_escape 0x10, 6, 2, 0x76, 0x00\n"
    "  nop\n"
    "  .cfi_def_cfa %rsp, 16\n"
    "  .cfi_restore %rbp\n"
    "  nop\n"
    "  .cfi_escape 0x16, 6, 2, 0x77, 0x00\n"
    "  nop\n"
    "  .cfi_val_offset %rbp, -16\n"
    "  nop\n"
    "  .cfi_escape 0x2e, 0x10\n"
    "  .cfi_offset %rbp, -24\n"
    "  .cfi_escape 0x13, 0x7e\n"
    "  nop\n"
    "  .cfi_escape 0x12, 0x07, 0x7d\n"
    "  nop\n"
    "  .cfi_escape 0x11, 0x06, 0x7d\n"
    "  nop\n"
    "  .cfi_escape 0x2f, 0x06, 0x02\n"
    "  nop\n"
    "  .cfi_escape 0x06, 0x06\n"
    "  .skip 300, 0x90\n"
    "  .cfi_def_cfa_offset 32\n"
    "  .skip 70000, 0x90\n"
    "  .cfi_def_cfa_offset 40\n"
    "  nop\n"
    "  .cfi_escape 0x0a, 0x0b, 0x00\n"
    "  .cfi_undefined %rip\n"
    "  nop\n"
    "  .cfi_escape 0x08, 0x10\n"
    "  ret\n"
    "  .cfi_endproc\n");

void my_restore_rt(void);
void sigframe_fn(void);
void weird_cfi(void);

int main(int argc, char **argv) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGUSR1, &sa, NULL);
    raise(SIGUSR1);
    if (argc > 5) { my_restore_rt(); sigframe_fn(); weird_cfi(); }
    return early_exit(argc > 1 ? atoi(argv[1]) : 3) & 1 ? EXIT_SUCCESS : (int)strlen(argv[0]) % 2;
}
