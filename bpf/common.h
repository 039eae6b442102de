/* What every aiflame BPF program shares: the target set, the counters, the ring buffer every record goes out
 * through, and the record head. Each .bpf.c includes the headers it uses; agent/kernel/sampler.py inlines them
 * (once each) into one program text, because BCC rewrites map calls only in its main source, so the programs of
 * one capture share these maps.
 */
#ifndef AIFLAME_COMMON_H
#define AIFLAME_COMMON_H

#include <uapi/linux/ptrace.h>
#include "aiflame.h"

BPF_HASH(targets, u32, u32, AIFLAME_MAX_TARGETS);
/* Processes forked by targets and followed here (AIFLAME_FOLLOW), apart from the targets the agent chose: a
 * target that forks without end fills this map only, and the agent can still add the processes it finds. */
BPF_HASH(children, u32, u32, AIFLAME_MAX_TARGETS);
/* pid -> when a probe stopped it (SIGSTOP at a library open or exit; runtime_probes.bpf.c). The agent deletes the
 * entry when it continues the target; the stop watchdog (agent/kernel/stop_watchdog.py) holds this map too and
 * continues any target whose entry is older than its deadline, or every one when the agent dies. */
BPF_HASH(stops, u32, u64, AIFLAME_MAX_TARGETS);
BPF_PERCPU_ARRAY(counters, u64, CNT_MAX);
BPF_RINGBUF_OUTPUT(events, AIFLAME_RINGBUF_PAGES);

/* The common head of sample, call, return and open records: kind, cpu, time, pid (tgid) and tid from `id`
 * (bpf_get_current_pid_tgid()). */
#define FILL_HEAD(rec, rec_kind, id)                      \
    do {                                                  \
        (rec)->kind = (rec_kind);                         \
        (rec)->cpu = bpf_get_smp_processor_id();          \
        (rec)->time_ns = bpf_ktime_get_ns();              \
        (rec)->pid = (id) >> 32;                          \
        (rec)->tid = (u32)(id);                           \
    } while (0)

static __always_inline void count(u32 idx) {
    u64 *v = counters.lookup(&idx);
    if (v)
        (*v)++;
}

/* targets[pid] holds TARGET_* flags (aiflame.h); TARGET_PY is set by the agent with the process's Python layout,
 * so the walker skips its py_procs lookup in every other process. */
static __always_inline u32 target_flags(u32 tgid) {
#ifdef AIFLAME_ALL
    return tgid != 0 ? (TARGET_ON | TARGET_PY) : 0;
#else
    u32 *v = targets.lookup(&tgid);
    if (v)
        return *v;
#ifdef AIFLAME_FOLLOW
    v = children.lookup(&tgid);
    if (v)
        return *v;
#endif
    return 0;
#endif
}

static __always_inline int is_target(u32 tgid) {
    return target_flags(tgid) != 0;
}

/* The user u64 at addr, 0 when it cannot be read. The helper zeroes its buffer when a read fails (every kernel
 * with it does), so there is no branch on its result: each branch doubles what the verifier walks after it. */
static __always_inline u64 read_ptr(u64 addr) {
    u64 v;
    bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

/* The u64 at `p` (in a map value), aligned or not, in one load. x86 loads it either way, and the verifier allows
 * unaligned map value loads where unaligned access is efficient (x86, without BPF_F_STRICT_ALIGNMENT); a memcpy
 * compiles to eight byte loads with shifts instead, which the verifier walks again on every path through them. */
static __always_inline u64 load64(const void *p) {
    return *(const u64 *)p;
}

#endif /* AIFLAME_COMMON_H */
