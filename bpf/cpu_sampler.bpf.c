/* CPU sampler: runs on every perf-event sample (CPU clock or cycles), keeps only target processes, and
 * ships raw user and kernel stacks through a ring buffer submitted without wakeups (the agent drains it on
 * a timer). Targets live in a map so one compiled program serves any pid set.
 *
 * Defines (set by agent/sampler.py):
 *   AIFLAME_RINGBUF_PAGES  ring buffer size in pages (power of two)
 *   AIFLAME_MAX_TARGETS    capacity of the target map
 *   AIFLAME_FOLLOW         follow forks of targets (profile -- CMD)
 *   AIFLAME_ALL            sample every process (no target filter)
 */
#include <uapi/linux/ptrace.h>
#include <uapi/linux/bpf_perf_event.h>
#include "aiflame.h"

BPF_HASH(targets, u32, u32, AIFLAME_MAX_TARGETS);
BPF_PERCPU_ARRAY(counters, u64, CNT_MAX);
BPF_RINGBUF_OUTPUT(events, AIFLAME_RINGBUF_PAGES);
/* Never written: lets user space read the C layouts back through BCC's type info. */
BPF_ARRAY(layout_sample, struct sample_rec, 1);
BPF_ARRAY(layout_proc, struct proc_rec, 1);

static __always_inline void count(u32 idx) {
    u64 *v = counters.lookup(&idx);
    if (v)
        (*v)++;
}

static __always_inline int is_target(u32 tgid) {
#ifdef AIFLAME_ALL
    return tgid != 0;
#else
    return targets.lookup(&tgid) != NULL;
#endif
}

int on_sample(struct bpf_perf_event_data *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_target(tgid))
        return 0;
    count(CNT_SAMPLES);

    struct sample_rec *rec = events.ringbuf_reserve(sizeof(struct sample_rec));
    if (!rec) {
        count(CNT_LOST);
        return 0;
    }
    rec->kind = REC_SAMPLE;
    rec->cpu = bpf_get_smp_processor_id();
    rec->time_ns = bpf_ktime_get_ns();
    rec->pid = tgid;
    rec->tid = (u32)id;
    bpf_get_current_comm(rec->comm, sizeof(rec->comm));
    rec->kern_len = bpf_get_stack(ctx, rec->kern, sizeof(rec->kern), 0);
    if (rec->kern_len < 0)
        count(CNT_KSTACK_ERR);
    rec->user_len = bpf_get_stack(ctx, rec->user, sizeof(rec->user), BPF_F_USER_STACK);
    if (rec->user_len < 0)
        count(CNT_USTACK_ERR);
    events.ringbuf_submit(rec, BPF_RB_NO_WAKEUP);
    return 0;
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
/* The forking task is current; a new thread of a target is harmless in the map and the agent prunes it. */
TRACEPOINT_PROBE(sched, sched_process_fork) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!is_target(tgid))
        return 0;
    u32 child = args->child_pid;
    u32 one = 1;
    if (targets.update(&child, &one) != 0)
        count(CNT_TARGETS_FULL);
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
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!args->group_dead || !is_target(tgid))
        return 0;
    emit_proc(REC_EXIT, tgid, 0);
    return 0;
}
