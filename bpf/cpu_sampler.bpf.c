/* CPU sampler: runs on every perf-event sample (CPU clock or cycles), keeps only target processes, and
 * ships raw user and kernel stacks through a ring buffer submitted without wakeups (the agent drains it on
 * a timer). Targets live in a map so one compiled program serves any pid set. It also follows the targets'
 * forks, execs and exits.
 *
 * Defines (set by agent/kernel/sampler.py):
 *   AIFLAME_RINGBUF_PAGES  ring buffer size in pages (power of two)
 *   AIFLAME_MAX_TARGETS    capacity of the target map
 *   AIFLAME_FOLLOW         follow forks of targets (profile -- CMD)
 *   AIFLAME_ALL            sample every process (no target filter)
 *   AIFLAME_UW_MAX_DEPTH   user frames a CFI walk records at most (1-127)
 *   AIFLAME_KEEP_ONE_IN    the perf event fires this many times per kept sample; one firing of each block of
 *                          N, at a random position, is kept, so sampling does not run in lockstep with periodic work
 *
 * The runtime probes (runtime_probes.bpf.c) and the off-CPU recorder (offcpu.bpf.c) are programs of the same
 * capture, sharing the target map, the walk and the ring buffer through the headers; agent/kernel/sampler.py
 * puts the files asked for into one program text.
 */
#include <uapi/linux/ptrace.h>
#include <uapi/linux/bpf_perf_event.h>
#include "common.h"
#include "python.h"
#include "walk.h"
#include "sample.h"

/* The sample is assembled here (hot in cache) and only its used part is copied to the ring buffer. */
BPF_PERCPU_ARRAY(sample_scratch, struct sample_rec, 1);
/* Never written: lets user space read the C layouts back through BCC's type info. */
BPF_ARRAY(layout_sample, struct sample_rec, 1);
BPF_ARRAY(layout_proc, struct proc_rec, 1);

/* The sample walk (walk.h): its state per CPU, its prog array, and its programs uw_sample_step, uw_sample_scan. */
BPF_PERCPU_ARRAY(uw_scratch, struct uw_state, 1);
BPF_PROG_ARRAY(uw_progs, 3);

static __always_inline struct sample_rec *sample_rec(void) {
    u32 zero = 0;
    return sample_scratch.lookup(&zero);
}

static __always_inline struct uw_state *sample_walk(void) {
    u32 zero = 0;
    return uw_scratch.lookup(&zero);
}

static __always_inline void sample_tail(void *ctx, u32 prog) {
    uw_progs.call(ctx, prog);
}

static __always_inline void sample_walked(struct sample_rec *rec, struct uw_state *st) {
    rec->user_len = st->n * 8;
    rec->unwind = st->why;
}

static __always_inline int sample_unfinished(struct sample_rec *rec) {
    (void)rec;
    return 0; /* the sample is lost, counted as uw_tailcall_fail */
}

UW_STEP_PROGRAM(sample, struct bpf_perf_event_data, struct sample_rec)
UW_SCAN_PROGRAM(sample, struct bpf_perf_event_data, struct sample_rec)

#if AIFLAME_KEEP_ONE_IN > 1
/* Jittered sampling: of each block of AIFLAME_KEEP_ONE_IN firings on a CPU, keep the one at a random position.
 * The mean rate is exact and each period still gets one sample (as regular sampling does, so shares vary little
 * between runs), but where in the period it lands is random, so it cannot lock onto a periodic workload. */
struct thin_state {
    u32 n;     /* firings so far in this block */
    u32 pick;  /* the one to keep */
};
BPF_PERCPU_ARRAY(thin, struct thin_state, 1);
#endif

int on_sample(struct bpf_perf_event_data *ctx) {
#if AIFLAME_KEEP_ONE_IN > 1
    u32 key = 0;
    struct thin_state *th = thin.lookup(&key);
    if (th) {
        if (th->n == 0)
            th->pick = bpf_get_prandom_u32() % AIFLAME_KEEP_ONE_IN;
        u32 keep = th->n == th->pick;
        th->n = th->n + 1 >= AIFLAME_KEEP_ONE_IN ? 0 : th->n + 1;
        if (!keep)
            return 0;
    }
#endif
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 target = target_flags(tgid);
    if (!target)
        return 0;
    count(CNT_SAMPLES);

    u32 zero = 0;
    struct sample_rec *rec = sample_scratch.lookup(&zero);
    if (!rec)
        return 0;
    FILL_HEAD(rec, REC_SAMPLE, id);
    bpf_get_current_comm(rec->comm, sizeof(rec->comm));
    rec->unwind = 0;
    struct uw_state *st = uw_scratch.lookup(&zero);
    if (!st)
        return 0;
    st->target = target;
    if (unwind_procs.lookup(&tgid)) {
        /* the task's user registers: the interrupted ones when the sample hit user code (cs RPL 3), else those
         * saved at its entry to the kernel */
        if ((ctx->regs.cs & 3) == 3) {
            uw_begin(st, (u32)id, ctx->regs.ip, ctx->regs.sp, ctx->regs.bp, 1);
        } else {
            struct pt_regs *regs =
                (struct pt_regs *)bpf_task_pt_regs((struct task_struct *)bpf_get_current_task_btf());
            u64 r[3] = {};
            bpf_probe_read_kernel(&r[0], 8, &regs->ip);
            bpf_probe_read_kernel(&r[1], 8, &regs->sp);
            bpf_probe_read_kernel(&r[2], 8, &regs->bp);
            uw_begin(st, (u32)id, r[0], r[1], r[2], 1);
        }
        if (st->pc)
            uw_progs.call(ctx, UW_PROG_STEP);
        count(CNT_UW_TAILCALL_FAIL);  /* reached only when the tail call did not happen */
    }
    rec->user_len = bpf_get_stack(ctx, rec->data, AIFLAME_MAX_STACK * 8, BPF_F_USER_STACK);
    /* sample_finish adds the kernel stack and the Python frames: a tail call rather than finish_sample here, so
     * the verifier walks the Python walker once (in sample_finish), not also in this program (a start-up cost) */
    uw_progs.call(ctx, UW_PROG_FINISH);
    count(CNT_UW_TAILCALL_FAIL);  /* reached only when the tail call did not happen */
    return 0;
}

int sample_finish(struct bpf_perf_event_data *ctx) {
    u32 zero = 0;
    struct sample_rec *rec = sample_scratch.lookup(&zero);
    struct uw_state *st = uw_scratch.lookup(&zero);
    if (!rec || !st)
        return 0;
    return finish_sample(ctx, rec, st->target);
}

static __always_inline void emit_proc(u32 kind, u32 pid, u32 child) {
    struct proc_rec *rec = events.ringbuf_reserve(sizeof(struct proc_rec));
    if (!rec) {
        count(CNT_PROC_LOST);
        return;
    }
    rec->kind = kind;
    rec->cpu = bpf_get_smp_processor_id();
    rec->time_ns = bpf_ktime_get_ns();
    rec->pid = pid;
    rec->child = child;
    bpf_get_current_comm(rec->comm, sizeof(rec->comm));
    events.ringbuf_submit(rec, BPF_RB_NO_WAKEUP);
}

#ifdef AIFLAME_FOLLOW
/* A new task of a target: a new process is followed, a new thread needs nothing (samples are matched by
 * process), so a flood of short threads never touches the map. The parent is current (copy_process). */
#define AIFLAME_CLONE_THREAD 0x00010000
TRACEPOINT_PROBE(task, task_newtask) {
    if (args->clone_flags & AIFLAME_CLONE_THREAD)
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 target = target_flags(tgid);
    if (!target)
        return 0;
    u32 child = args->pid;
    if (children.update(&child, &target) != 0) {
        count(CNT_TARGETS_FULL);  /* not followed: the agent is not told of it either */
        return 0;
    }
    emit_proc(REC_FORK, tgid, child);
    return 0;
}
#endif

/* A new program image means new mappings: the agent re-reads /proc/PID/maps. */
TRACEPOINT_PROBE(sched, sched_process_exec) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!is_target(tgid))
        return 0;
    emit_proc(REC_EXEC, tgid, 0);
    unwind_procs.delete(&tgid);  /* the old image's mappings: frame pointers until the agent reads the new ones */
    return 0;
}

/* A target's last thread exits: its entries go at once, so the maps hold live processes only even when the
 * exit record is lost (the agent removes them again on the record). */
TRACEPOINT_PROBE(sched, sched_process_exit) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!args->group_dead || !is_target(tgid))
        return 0;
    emit_proc(REC_EXIT, tgid, 0);
#ifndef AIFLAME_ALL
    targets.delete(&tgid);
    children.delete(&tgid);
#endif
    py_procs.delete(&tgid);
    unwind_procs.delete(&tgid);
    stops.delete(&tgid);
    return 0;
}
