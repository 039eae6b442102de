# A function without CFI (no .cfi_* directives, so no .eh_frame FDE covers it) that keeps no frame pointer:
# it saves two registers, takes 136 bytes of locals (zeroed), sets rbp to 0 and spins rdi times. Walks that
# reach it can only go on by scanning the stack for its return address (tests/integration/test_unwind_scan.py).
    .text
    .globl nocfi_spin
    .type nocfi_spin, @function
nocfi_spin:
    push %rbx
    push %rbp
    sub $136, %rsp
    xor %eax, %eax
    mov $17, %ecx
    mov %rdi, %rbx
    lea (%rsp), %rdi
    rep stosq
    xor %ebp, %ebp
1:  dec %rbx
    jnz 1b
    add $136, %rsp
    pop %rbp
    pop %rbx
    ret
    .size nocfi_spin, .-nocfi_spin
    .section .note.GNU-stack,"",@progbits
