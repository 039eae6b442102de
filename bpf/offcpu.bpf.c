/* Off-CPU time (`profile --off-cpu`): agent/kernel/sampler.py puts this file into the sampler's program text only
 * when asked, so the sampler's own start-up and cost are unchanged without it.
 *
 * At sched_switch the task switching out is current (prev). A target thread that goes to sleep (prev_state S, D
 * or I: it waits for something) has its stack taken as a CPU sample's is: the CFI walk from its user registers
 * (bpf_task_pt_regs: those saved at its entry to the kernel), in tail calls of this tracepoint's own program type,
 * its Python frames and its kernel stack. The record (REC_OFFCPU, time_ns: when it blocked) goes out at once. The
 * thread's wakeup (sched_wakeup) is noted, and when it is switched in again a small REC_OFFCPU_END record says when
 * the block ended: at the wakeup (time then spent runnable, waiting for a CPU, is not blocked time) or, without
 * one seen, when it ran. The agent pairs the two records by (tid, out_ns) and weighs the stack by the difference.
 *
 * Only tracepoint arguments (as the running kernel's format files describe them) and helpers are read: no kernel
 * struct, so the program runs on kernels whose headers BCC does not have.
 */
#include <uapi/linux/ptrace.h>
#include "common.h"
#include "python.h"
#include "walk.h"
#include "sample.h"

/* prev_state values meaning the thread blocked: S (interruptible sleep), D (uninterruptible), I (idle wait). Not
 * R (0, or 0x100 "R+" when preempted: it still wants the CPU), T/t (stopped or traced: the probes' own stops of
 * targets among them), P, X or Z (parked or exiting). */
#define OFFCPU_BLOCKED (0x1 | 0x2 | 0x80)

/* A blocked thread, by tid: when it blocked and when it was woken (0: not yet). LRU: a thread that never runs
 * again (killed while asleep) leaves its entry, and the oldest go first. */
struct offcpu_since {
    u64 out_ns;
    u64 wake_ns;
    u32 pid;
    u32 pad;
};
BPF_TABLE("lru_hash", u32, struct offcpu_since, offcpu_blocked, 16384);
BPF_PERCPU_ARRAY(offcpu_scratch, struct sample_rec, 1);
BPF_PERCPU_ARRAY(uw_off_scratch, struct uw_state, 1);
/* The off-CPU walk (walk.h) as tail calls of tracepoint programs (a prog array holds programs of one type only):
 * uw_offcpu_step, uw_offcpu_scan, then offcpu_finish. */
BPF_PROG_ARRAY(uw_off_progs, 3);
BPF_ARRAY(layout_offcpu_end, struct offcpu_end_rec, 1);

static __always_inline struct sample_rec *offcpu_rec(void) {
    u32 zero = 0;
    return offcpu_scratch.lookup(&zero);
}

static __always_inline struct uw_state *offcpu_walk(void) {
    u32 zero = 0;
    return uw_off_scratch.lookup(&zero);
}

static __always_inline void offcpu_tail(void *ctx, u32 prog) {
    uw_off_progs.call(ctx, prog);
}

static __always_inline void offcpu_walked(struct sample_rec *rec, struct uw_state *st) {
    rec->user_len = st->n * 8;
    rec->unwind = st->why;
}

static __always_inline int offcpu_unfinished(struct sample_rec *rec) {
    (void)rec;
    return 0; /* the sample is lost, counted as uw_tailcall_fail */
}

TRACEPOINT_PROBE(sched, sched_wakeup) {
    u32 tid = args->pid;
    struct offcpu_since *b = offcpu_blocked.lookup(&tid);
    if (b && !b->wake_ns)
        b->wake_ns = bpf_ktime_get_ns();
    return 0;
}

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 now = bpf_ktime_get_ns();
    /* the thread switched in: the end of its block, if it was one of ours */
    u32 next = args->next_pid;
    struct offcpu_since *b = offcpu_blocked.lookup(&next);
    if (b) {
        struct offcpu_end_rec *end = events.ringbuf_reserve(sizeof(struct offcpu_end_rec));
        if (end) {
            end->kind = REC_OFFCPU_END;
            end->cpu = bpf_get_smp_processor_id();
            end->time_ns = b->wake_ns ? b->wake_ns : now;
            end->pid = b->pid;
            end->tid = next;
            end->out_ns = b->out_ns;
            events.ringbuf_submit(end, BPF_RB_NO_WAKEUP);
        } else {
            count(CNT_OFFCPU_LOST);
        }
        offcpu_blocked.delete(&next);
    }
    /* the thread switched out: its stack, if it blocks */
    if (!(args->prev_state & OFFCPU_BLOCKED))
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    u32 target = target_flags(tgid);
    if (!target || tid != (u32)args->prev_pid)
        return 0;
    struct offcpu_since since = {now, 0, tgid, 0};
    offcpu_blocked.update(&tid, &since);
    count(CNT_OFFCPU);
    u32 zero = 0;
    struct sample_rec *rec = offcpu_scratch.lookup(&zero);
    if (!rec)
        return 0;
    FILL_HEAD(rec, REC_OFFCPU, id);
    rec->time_ns = now;
    bpf_get_current_comm(rec->comm, sizeof(rec->comm));
    rec->unwind = 0;
    struct uw_state *st = uw_off_scratch.lookup(&zero);
    if (!st)
        return 0;
    st->target = target;
    if (unwind_procs.lookup(&tgid)) {
        /* its user registers, saved at its entry to the kernel (the system call it blocks in) */
        struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs((struct task_struct *)bpf_get_current_task_btf());
        u64 r[3] = {};
        bpf_probe_read_kernel(&r[0], 8, &regs->ip);
        bpf_probe_read_kernel(&r[1], 8, &regs->sp);
        bpf_probe_read_kernel(&r[2], 8, &regs->bp);
        uw_begin(st, tid, r[0], r[1], r[2], 1);
        if (st->pc)
            uw_off_progs.call(args, UW_PROG_STEP);
        count(CNT_UW_TAILCALL_FAIL);  /* reached only when the tail call did not happen */
    }
    rec->user_len = bpf_get_stack(args, rec->data, AIFLAME_MAX_STACK * 8, BPF_F_USER_STACK);
    /* offcpu_finish completes the record (kernel stack, Python frames), as sample_finish does for on_sample */
    uw_off_progs.call(args, UW_PROG_FINISH);
    count(CNT_UW_TAILCALL_FAIL);  /* reached only when the tail call did not happen */
    return 0;
}

UW_STEP_PROGRAM(offcpu, void, struct sample_rec)
UW_SCAN_PROGRAM(offcpu, void, struct sample_rec)

int offcpu_finish(void *ctx) {
    u32 zero = 0;
    struct sample_rec *rec = offcpu_scratch.lookup(&zero);
    struct uw_state *st = uw_off_scratch.lookup(&zero);
    if (!rec || !st)
        return 0;
    return finish_sample(ctx, rec, st->target);
}
