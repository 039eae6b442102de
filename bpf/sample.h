/* A sample record's completion, for CPU samples (cpu_sampler.bpf.c) and off-CPU stacks (offcpu.bpf.c) alike:
 * after the user stack, the kernel stack, the Python frames, and the record out to the ring buffer.
 */
#ifndef AIFLAME_SAMPLE_H
#define AIFLAME_SAMPLE_H

#include "common.h"
#include "python.h"

/* The words a stack of `len` bytes (a bpf_get_stack result: negative on error) takes in a sample's data. */
static __always_inline u32 stack_words(s32 len) {
    u32 n = len > 0 ? (u32)len / 8 : 0;
    return n > AIFLAME_MAX_STACK ? AIFLAME_MAX_STACK : n;
}

/* After the user stack: the kernel stack, the Python frames, and the record out to the ring buffer. `ctx` is the
program's context (a perf event's, or a tracepoint's for off-CPU records): the kernel stack is current's. */
static __always_inline int finish_sample(void *ctx, struct sample_rec *rec, u32 target) {
    if (rec->user_len < 0)
        count(CNT_USTACK_ERR);
    u32 nu = stack_words(rec->user_len);
    rec->kern_len = bpf_get_stack(ctx, &rec->data[nu], AIFLAME_MAX_STACK * 8, 0);
    if (rec->kern_len < 0)
        count(CNT_KSTACK_ERR);
    walk_python(rec->data, &rec->py_count, &rec->py_flags, rec->pid, rec->tid,
                nu + stack_words(rec->kern_len), target);
    /* the lengths again from the record, not kept across the walk: the verifier would walk it once per range */
    asm volatile("" ::: "memory");
    u32 words = stack_words(rec->user_len) + stack_words(rec->kern_len) + 2 * rec->py_count;
    if (words > AIFLAME_SAMPLE_WORDS)
        words = AIFLAME_SAMPLE_WORDS;
    u64 size = offsetof(struct sample_rec, data) + (u64)words * 8;
    if (size > sizeof(struct sample_rec))
        size = sizeof(struct sample_rec);
    if (events.ringbuf_output(rec, size, BPF_RB_NO_WAKEUP) != 0)
        count(rec->kind == REC_SAMPLE ? CNT_LOST : CNT_OFFCPU_LOST);
    return 0;
}

#endif /* AIFLAME_SAMPLE_H */
