/* Runtime probes: uprobes on accelerator runtime calls (CUDA, NCCL, gloo, Level Zero...), in the same program
 * text as the CPU sampler when asked for (agent/kernel/sampler.py), so calls share its target map, the walk, the
 * Python walker and the ring buffer (through the headers).
 *
 * Every probe runs the same code with its own spec (probe_specs[id], filled by the agent): raw argument
 * registers, up to four pointer reads, an optional string, the caller's stack. Return probes add the time and
 * return value, and optionally a value the call wrote through an out-pointer argument (a handle). User space
 * names and decodes the arguments; nothing here knows a runtime.
 *
 * With AIFLAME_UPROBE_SESSION (kernel 6.13+) on_call is attached through uprobe session links and runs at a
 * call's return too, only when its entry run returned 0 (KEEP_RET): a launch counted without a record returns
 * SKIP_RET, and the kernel neither hijacks its return address nor traps at its return. Otherwise on_ret is
 * attached on its own and runs at every return of a probe with PROBE_RET.
 *
 * Libraries a target opens after the start are probed before their first call: an openat of a path that looks
 * like a shared object, once it succeeded, stops the process (SIGSTOP), the agent attaches and continues it
 * (SIGCONT).
 */
#include <uapi/linux/ptrace.h>
#include "common.h"
#include "python.h"
#include "walk.h"

BPF_ARRAY(probe_specs, struct probe_spec, AIFLAME_MAX_PROBES);
BPF_PERCPU_ARRAY(call_scratch, struct call_rec, 1);
/* (tid << 32 | probe) -> the out-pointer argument of a call in flight. LRU: a thread that dies inside a call
 * leaves its entry, and a target can make many; the oldest go first. */
BPF_TABLE("lru_hash", u64, u64, call_outs, 16384);
/* FNV-1a hashes of library paths the agent has already handled: their opens do not stop the target. LRU: a
 * target opening endless distinct names cannot fill it; a path evicted stops its next opener once more. */
BPF_TABLE("lru_hash", u64, u8, libs_seen, 65536);
/* Targets that opened a shared object since their last PROBE_IF_OPENED stop (the loader's, once it has mapped
 * what it opened): the agent reads their mappings there, before the libraries' code runs. LRU: the entries of
 * processes gone go first. */
BPF_TABLE("lru_hash", u32, u8, libs_opened, AIFLAME_MAX_TARGETS);
/* Library opens go out through a ring buffer of their own, which the agent reads first: their target waits,
 * stopped, and must not wait while the agent reads the records queued before them (a CUDA library's constructors
 * register ~24k kernels just before the loader opens the next library). */
BPF_RINGBUF_OUTPUT(stop_events, 16);
/* PROBE_SAMPLE calls counted without a record, per CPU, by (process, probe, the argument naming the kernel); the
 * next record kept for the key on that CPU takes its count, the agent reads what is left at the end. Not LRU: a
 * full map refuses the count (CNT_CALL_LOST), it never drops one silently. */
struct sample_key {
    u32 tgid;
    u32 probe;
    u64 arg;
};
BPF_PERCPU_HASH(call_skipped, struct sample_key, u64, 16384); /* x CPUs values: 2 MiB a 16-CPU host */
/* The per-CPU record budget of PROBE_SAMPLE calls: credit in ns, AIFLAME_CALL_INTERVAL_NS a record. */
struct call_budget {
    u64 last_ns;
    u64 credit_ns;
};
BPF_PERCPU_ARRAY(call_budgets, struct call_budget, 1);
/* What on_call returns at a call's entry: with session links, whether on_call is to run at its return. */
#ifdef AIFLAME_UPROBE_SESSION
#define SKIP_RET 1
#else
#define SKIP_RET 0 /* returns are on_ret's, attached on their own */
#endif
#define KEEP_RET 0

/* tid -> the PROBE_SAMPLE call it is inside: a launch inside a launch (cudaLaunchKernel -> cuLaunchKernel) is the
 * same launch, neither recorded nor counted again. An entry older than a second is a thread that died inside a
 * launch (its id reused): launches return in microseconds. A launch whose return is not probed (LAUNCH_NORET)
 * leaves its entry behind when it returns: it is open only while its return address is still in its slot and
 * the later call sits deeper in the stack (launch_open says when). */
#define LAUNCH_UNSENT 1 /* counted without a record: its return is not sent either */
#define LAUNCH_NORET 2  /* its return does not run on_call (session links) */
#ifdef AIFLAME_UPROBE_SESSION
#define LAUNCH_SKIPPED (LAUNCH_UNSENT | LAUNCH_NORET)
#else
#define LAUNCH_SKIPPED LAUNCH_UNSENT
#endif
struct launch_in {
    u32 probe;
    u32 flags; /* LAUNCH_* */
    u64 time_ns;
    u64 sp; /* at its entry: where its return address is */
    u64 ra;
    u64 ip; /* the probed address: which function (one probe id may name several) */
};
BPF_TABLE("lru_hash", u32, struct launch_in, in_launch, 16384);
BPF_ARRAY(layout_call, struct call_rec, 1);
BPF_ARRAY(layout_ret, struct ret_rec, 1);
BPF_ARRAY(layout_open, struct open_rec, 1);
BPF_ARRAY(layout_spec, struct probe_spec, 1);
/* The caller's stack by CFI, as the sampler walks it (walk.h), in kprobe-type tail calls of its own: the walk's
 * state per CPU, its prog array (UW_PROG_STEP, UW_PROG_FINISH) and its program uw_call_step. */
BPF_PERCPU_ARRAY(uw_call_scratch, struct uw_state, 1);
BPF_PROG_ARRAY(uw_call_progs, 2);

static __always_inline struct call_rec *call_rec(void) {
    u32 zero = 0;
    return call_scratch.lookup(&zero);
}

static __always_inline struct uw_state *call_walk(void) {
    u32 zero = 0;
    return uw_call_scratch.lookup(&zero);
}

static __always_inline void call_tail(void *ctx, u32 prog) {
    uw_call_progs.call(ctx, prog);
}

static __always_inline void call_walked(struct call_rec *rec, struct uw_state *st) {
    rec->user_len = st->n * 8;
}

/* Stop the current process (SIGSTOP, delivered on its way back to user space) so the agent can act before it
 * goes on, recording the stop first: a stop the watchdog could not know of is never made. Then send `rec` to the
 * agent (through stop_events with `own_ring`, else with the records before it), and only then: the agent
 * continues the target as soon as it has read the record, so a record it could read before the signal was sent
 * (this program preempted, or its vCPU descheduled, in between) left the target stopped for good. A record that
 * cannot be sent takes the stop back (SIGCONT drops the pending SIGSTOP). */
static __always_inline int stop_target_and_emit(u32 tgid, u64 time_ns, void *rec, u64 size, int own_ring) {
    int stopped = 0;
    if (stops.update(&tgid, &time_ns) != 0)
        count(CNT_STOPS_UNRECORDED);
    else if (bpf_send_signal(19) == 0)
        stopped = 1;
    else
        stops.delete(&tgid);
    int sent = own_ring ? stop_events.ringbuf_output(rec, size, BPF_RB_FORCE_WAKEUP)
                        : events.ringbuf_output(rec, size, BPF_RB_FORCE_WAKEUP);
    if (sent == 0)
        return 0;
    if (stopped && bpf_send_signal(18) == 0)
        stops.delete(&tgid);
    return -1;
}

/* The caller's frame-pointer chain: the probed ip, then the return address of each frame from rbp up. At a
 * function's entry its caller's own return address is at sp, not on the chain (the agent inserts it from
 * args[7]). bpf_get_stack walks until a read fails, and on the hosts we measured that final fault cost ~0.9 us,
 * more than the rest of the probe; here a frame must lie above the previous one and at most
 * AIFLAME_MAX_FRAME_GAP past it, so a chain ends (on rbp = 0 from _start, or on a register that is not a frame
 * pointer) without touching unmapped memory. Returns the number of words written. */
#define AIFLAME_MAX_FRAME_GAP (8u << 20)
static __always_inline void caller_frames(struct pt_regs *ctx, struct call_rec *rec) {
    rec->data[0] = ctx->ip;
    rec->user_len = 8;
    u64 fp = ctx->bp;
    u64 lo = ctx->sp;
#pragma unroll
    for (int i = 1; i < AIFLAME_MAX_STACK; i++) {
        u64 frame[2];
        if (fp < lo || fp - lo > AIFLAME_MAX_FRAME_GAP || (fp & 7) || bpf_probe_read_user(frame, 16, (void *)fp))
            break;
        if (!frame[1])
            break;
        rec->data[i] = frame[1];
        /* the count goes through the record, not a register, so the verifier sees one state after the loop
         * instead of one per exit */
        rec->user_len = (i + 1) * 8;
        lo = fp + 16;
        fp = frame[0];
    }
}

static __always_inline u64 probe_source(struct call_rec *rec, s16 src) {
    if (src < 8)
        return rec->args[src & 7];
    return rec->deref[(src - 8) & 3];
}

#ifndef AIFLAME_CALL_INTERVAL_NS
#define AIFLAME_CALL_INTERVAL_NS 0 /* no budget: every call is recorded */
#endif
/* u64: at under 30 records a second the int product overflowed, and the budget never ran out */
#define AIFLAME_CALL_BURST_NS ((u64)AIFLAME_CALL_INTERVAL_NS * 64)

/* Whether this CPU may send one more PROBE_SAMPLE record now (a token bucket of 64 records, refilled one record
 * every AIFLAME_CALL_INTERVAL_NS). */
static __always_inline int call_budget_take(u64 now) {
    if (AIFLAME_CALL_INTERVAL_NS == 0)
        return 1;
    u32 zero = 0;
    struct call_budget *b = call_budgets.lookup(&zero);
    if (!b)
        return 1;
    u64 credit = b->credit_ns + (now - b->last_ns);
    if (credit > AIFLAME_CALL_BURST_NS)
        credit = AIFLAME_CALL_BURST_NS;
    b->last_ns = now;
    if (credit < AIFLAME_CALL_INTERVAL_NS) {
        b->credit_ns = credit;
        return 0;
    }
    b->credit_ns = credit - AIFLAME_CALL_INTERVAL_NS;
    return 1;
}

/* Count `n` calls of `key` without a record (a full map refuses them: counted as lost, never silently). */
static __always_inline void count_unsent(struct sample_key *key, u64 n) {
    u64 *have = call_skipped.lookup(key);
    if (have)
        *have += n;
    else if (call_skipped.update(key, &n) != 0)
        count(CNT_CALL_LOST);
}

/* Whether the launch `outer` of this thread is still running, seen from a launch entered at `ip` and `sp`. A
 * launch whose return runs on_call deletes its entry there. One whose return does not is open while its return
 * address is still where it was pushed, or the kernel's uretprobe trampoline is (another tool's return probe on
 * the same function), and the new call is deeper, or as deep and another
 * function (a launch that jumps to the driver's as its last act): once it returned, its caller's next call or
 * push overwrites the slot. Two ways to be wrong, both needing launches of different functions that are not
 * nested: a caller that moves its stack pointer down without writing the slot and calls down to one, and one
 * call site that calls both through a pointer. */
static __always_inline int launch_open(struct launch_in *outer, u64 ip, u64 sp) {
    if (!(outer->flags & LAUNCH_NORET))
        return 1;
    if (sp > outer->sp || (sp == outer->sp && ip == outer->ip))
        return 0;
    u64 slot = 0;
    if (bpf_probe_read_user(&slot, sizeof(slot), (void *)outer->sp) != 0)
        return 0;
    return slot == outer->ra || (slot && uw_uret_trampoline(slot));
}

/* A call whose return the kernel hijacks: its return address, for the CFI walk (walk.h) to see through the
 * kernel's trampoline. */
static __always_inline void note_uret(u32 tid, u64 sp, u64 ra) {
    struct uret_calls fresh = {};
    struct uret_calls *u = uret_ras.lookup_or_try_init(&tid, &fresh);
    if (u) {
        u32 i = u->n++ & (UW_URET_CALLS - 1);
        u->slot[i] = sp;
        u->ra[i] = ra;
    }
}

static __always_inline u32 call_user_words(struct call_rec *rec) {
    u32 nu = (u32)rec->user_len / 8;
    return nu > AIFLAME_MAX_STACK ? AIFLAME_MAX_STACK : nu;
}

/* A call whose record does not go out (no room in the ring, or a tail call of its walk did not happen): a launch
 * is counted on, carried by its key's next record (with the launches this one carried); any other call is lost.
 * Either way its return is not wanted: there is no call to pair it with. Returns SKIP_RET (with separate return
 * probes on_ret runs anyway: it sends nothing for a launch marked here, and a lost call's return pairs with no
 * open call unless one of the same probe is open in the thread). */
static __always_inline int call_unsent(struct call_rec *rec, struct probe_spec *spec) {
    if (!(spec->flags & PROBE_SAMPLE)) {
        count(CNT_CALL_LOST);
        return SKIP_RET;
    }
    struct sample_key key = {rec->pid, rec->probe, rec->args[spec->sample_arg & 7]};
    count_unsent(&key, rec->calls);
    u32 tid = rec->tid;
    struct launch_in *in = spec->flags & PROBE_RET ? in_launch.lookup(&tid) : NULL;
    if (in && in->probe == rec->probe)
        in->flags |= LAUNCH_SKIPPED;
    count(CNT_CALL_SKIPPED);
    return SKIP_RET;
}

/* What the entry answers when a tail call of its walk did not happen (walk.h's KIND_unfinished). */
static __always_inline int call_unfinished(struct call_rec *rec) {
    u32 probe = rec->probe;
    struct probe_spec *spec = probe_specs.lookup(&probe);
    if (!spec)
        return KEEP_RET; /* cannot happen (the entry found it); its return clears any in_launch entry */
    return call_unsent(rec, spec);
}

/* After the caller's user stack (when `stack`: the probe has PROBE_STACK): its Python frames, the out-pointer to
 * remember, and the record out. Returns KEEP_RET when the call's return is wanted. */
static __always_inline int finish_call(struct pt_regs *ctx, struct call_rec *rec, struct probe_spec *spec,
                                       int stack) {
    u32 words = 0;
    if (stack) {
        u32 target = target_flags(rec->pid);
        walk_python(rec->data, &rec->py_count, &rec->py_flags, rec->pid, rec->tid, call_user_words(rec), target);
        /* the length again from the record, not kept across the walk (as in finish_sample) */
        asm volatile("" ::: "memory");
        words = call_user_words(rec) + 2 * rec->py_count;
    }
    if (spec->flags & PROBE_OUT) {
        u64 key = ((u64)rec->tid << 32) | rec->probe;
        u64 ptr = rec->args[spec->out_arg & 7];
        call_outs.update(&key, &ptr);
    }
    if (words > AIFLAME_SAMPLE_WORDS)
        words = AIFLAME_SAMPLE_WORDS;
    u64 size = offsetof(struct call_rec, data) + (u64)words * 8;
    if (size > sizeof(struct call_rec))
        size = sizeof(struct call_rec);
    int ret = spec->flags & PROBE_RET ? KEEP_RET : SKIP_RET;
    if (spec->flags & PROBE_STOP) {
        /* the agent reads what it needs (e.g. the mappings of a process about to exit), then continues it. The
         * loader's stops go out with the library opens, read first; exit's after the records before it. */
        if (stop_target_and_emit(rec->pid, rec->time_ns, rec, size, spec->flags & PROBE_IF_OPENED) != 0)
            count(CNT_CALL_LOST);
        return ret;
    }
    if (events.ringbuf_output(rec, size, BPF_RB_NO_WAKEUP) == 0)
        return ret;
    return call_unsent(rec, spec);
}

/* A call's entry. The probe id is the attach cookie the agent gave this uprobe (agent/uprobes.py attaches with
 * one). Returns KEEP_RET when the call's return is wanted. */
static __always_inline int call_entry(struct pt_regs *ctx) {
    u32 probe = (u32)bpf_get_attach_cookie(ctx);
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 target = target_flags(tgid);
    if (!target)
        return SKIP_RET;
    struct probe_spec *spec = probe_specs.lookup(&probe);
    u32 zero = 0;
    struct call_rec *rec = call_scratch.lookup(&zero);
    if (!spec || !rec)
        return SKIP_RET;
    if (spec->flags & PROBE_IF_OPENED) {
        if (!libs_opened.lookup(&tgid))
            return SKIP_RET;
        libs_opened.delete(&tgid);
    }
    FILL_HEAD(rec, REC_CALL, id);
    rec->probe = probe;
    rec->args[0] = ctx->di;
    rec->args[1] = ctx->si;
    rec->args[2] = ctx->dx;
    rec->args[3] = ctx->cx;
    rec->args[4] = ctx->r8;
    rec->args[5] = ctx->r9;
    rec->args[6] = ctx->sp;
    /* One read of the stack's top serves the return address and stack-passed arguments (SP+8..SP+24): user
     * reads are the probe's largest cost after the stack walk. */
    u64 top[4] = {};
    if (bpf_probe_read_user(top, sizeof(top), (void *)ctx->sp) != 0)
        top[0] = read_ptr(ctx->sp);
    rec->args[7] = top[0];
#ifndef AIFLAME_UPROBE_SESSION
    if (spec->flags & PROBE_RET) /* on_ret is attached: every call's return is hijacked */
        note_uret((u32)id, ctx->sp, top[0]);
#endif
    if (spec->flags & PROBE_REGS) {
        /* USDT sites: arguments may sit in any general register */
        u64 regs[16] = {ctx->ax, ctx->bx, ctx->cx, ctx->dx, ctx->si, ctx->di, ctx->bp, ctx->sp,
                        ctx->r8, ctx->r9, ctx->r10, ctx->r11, ctx->r12, ctx->r13, ctx->r14, ctx->r15};
#pragma unroll
        for (int i = 0; i < AIFLAME_PROBE_REGS; i++) {
            s16 r = spec->regs[i];
            rec->args[i] = r < 0 ? 0 : regs[r & 15];
        }
    }
    rec->calls = 1;
    if (spec->flags & PROBE_SAMPLE) {
        u32 tid = (u32)id;
        struct launch_in *outer = NULL;
        if (spec->flags & PROBE_RET) {
            outer = in_launch.lookup(&tid);
            /* the age limit is for entries a return deletes (a thread that died inside a launch); one left behind
             * is told by its slot */
            if (outer && ((outer->flags & LAUNCH_NORET) || rec->time_ns - outer->time_ns < 1000000000ull) &&
                launch_open(outer, ctx->ip, ctx->sp))
                return SKIP_RET;
        }
        struct sample_key key = {tgid, probe, rec->args[spec->sample_arg & 7]};
        /* one write to in_launch a launch, that also says whether its return is to be sent: at 10k launches a
         * second every map write is a cost the launching thread pays. The thread's entry left by its last launch
         * (session links) is written over in place, without a second hash walk. */
        struct launch_in mine = {probe, 0, rec->time_ns, ctx->sp, top[0], ctx->ip};
        int sent = call_budget_take(rec->time_ns);
        if (!sent)
            mine.flags = LAUNCH_SKIPPED;
        if (outer)
            *outer = mine;
        else if (spec->flags & PROBE_RET)
            in_launch.update(&tid, &mine);
        if (!sent) {
            count_unsent(&key, 1);
            count(CNT_CALL_SKIPPED);
            return SKIP_RET;
        }
        u64 *skipped = call_skipped.lookup(&key);
        if (skipped && *skipped) {
            rec->calls += (u32)*skipped;
            *skipped = 0;
        }
    }
#ifdef AIFLAME_UPROBE_SESSION
    if (spec->flags & PROBE_RET) /* kept: the kernel hijacks this call's return */
        note_uret((u32)id, ctx->sp, top[0]);
#endif
    rec->deref_ok = 0;
#pragma unroll
    for (int i = 0; i < AIFLAME_PROBE_DEREFS; i++) {
        rec->deref[i] = 0;
        s16 src = spec->src[i];
        if (src < 0)
            continue;
        s32 off = spec->off[i];
        if (src == 6 /* SP */ && off >= 0 && off < (s32)sizeof(top) && !(off & 7)) {
            rec->deref[i] = top[(off >> 3) & 3];
            rec->deref_ok |= 1u << i;
            continue;
        }
        u64 addr = probe_source(rec, src) + (s64)off;
        if (bpf_probe_read_user(&rec->deref[i], 8, (void *)addr) == 0)
            rec->deref_ok |= 1u << i;
        else
            rec->deref[i] = 0;
    }
    rec->str_len = 0;
    if (spec->flags & PROBE_STR) {
        u64 addr = probe_source(rec, spec->str_src);
        rec->str_len = bpf_probe_read_user_str(rec->str, sizeof(rec->str), (void *)addr);
    }
    rec->user_len = 0;
    rec->py_count = 0;
    rec->py_flags = 0;
    if (spec->flags & PROBE_STACK) {
        struct uw_state *st = uw_call_scratch.lookup(&zero);
        if (st && unwind_procs.lookup(&tgid)) {
            uw_begin(st, (u32)id, ctx->ip, ctx->sp, ctx->bp, 0);  /* launch stacks: CFI and frame pointers only */
            uw_call_progs.call(ctx, UW_PROG_STEP);
            count(CNT_UW_TAILCALL_FAIL);
        }
        caller_frames(ctx, rec);
        /* call_finish adds the Python frames: a tail call rather than finish_call here, so the verifier walks the
         * Python walker once (in call_finish), not also in this program (a start-up cost) */
        uw_call_progs.call(ctx, UW_PROG_FINISH);
        count(CNT_UW_TAILCALL_FAIL);
        return call_unsent(rec, spec);
    }
    return finish_call(ctx, rec, spec, 0);
}

/* Launch stacks are walked by uw_call_step (walk.h; no scan: CFI and frame pointers only), then call_finish. */
UW_STEP_PROGRAM(call, struct pt_regs, struct call_rec)

int call_finish(struct pt_regs *ctx) {
    u32 zero = 0;
    struct call_rec *rec = call_scratch.lookup(&zero);
    if (!rec)
        return 0;
    u32 probe = rec->probe;
    struct probe_spec *spec = probe_specs.lookup(&probe);
    if (!spec)
        return 0;
    return finish_call(ctx, rec, spec, spec->flags & PROBE_STACK);
}

/* A call's return. */
static __always_inline int call_return(struct pt_regs *ctx) {
    u32 probe = (u32)bpf_get_attach_cookie(ctx);
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_target(tgid))
        return 0;
    struct probe_spec *spec = probe_specs.lookup(&probe);
    u64 key = (id << 32) | probe;
    if (spec && (spec->flags & PROBE_SAMPLE)) {
        u32 tid = (u32)id;
        struct launch_in *outer = in_launch.lookup(&tid);
        if (outer && outer->probe != probe)
            return 0; /* the launch inside a launch returns */
        u32 unsent = outer ? outer->flags & LAUNCH_UNSENT : 0;
        in_launch.delete(&tid);
        if (unsent)
            return 0; /* its call was counted without a record */
    }
    struct ret_rec *rec = events.ringbuf_reserve(sizeof(struct ret_rec));
    if (!rec) {
        count(CNT_CALL_LOST);
        return 0;
    }
    FILL_HEAD(rec, REC_RET, id);
    rec->probe = probe;
    rec->ret = ctx->ax;
    rec->out = 0;
    rec->out_ok = 0;
    /* the out-pointer hash is consulted only by probes that have one (an array lookup is far cheaper) */
    u64 *ptr = spec && (spec->flags & PROBE_OUT) ? call_outs.lookup(&key) : NULL;
    if (ptr) {
        if (bpf_probe_read_user(&rec->out, 8, (void *)*ptr) == 0)
            rec->out_ok = 1;
        call_outs.delete(&key);
    }
    events.ringbuf_submit(rec, BPF_RB_NO_WAKEUP);
    return 0;
}

/* At a call's entry, and with session links at its return too: there the instruction pointer is the return
 * address, at the entry the probed address (bpf_get_func_ip's answer in both). */
int on_call(struct pt_regs *ctx) {
#ifdef AIFLAME_UPROBE_SESSION
    if (ctx->ip != bpf_get_func_ip(ctx))
        return call_return(ctx);
#endif
    return call_entry(ctx);
}

int on_ret(struct pt_regs *ctx) {
    return call_return(ctx);
}

/* One pass over a path: its FNV-1a hash, and whether it names a shared object ("x.so" or "x.so.N..."; ld.so.cache
 * and .py files do not match). */
static __always_inline u64 library_hash(const char *p, int *is_so) {
    u64 h = 0xcbf29ce484222325ULL;
    *is_so = 0;
    for (int i = 0; i < AIFLAME_PATH_LEN - 4; i++) {
        char c = p[i];
        if (c == 0)
            break;
        if (c == '.' && p[i + 1] == 's' && p[i + 2] == 'o' &&
            (p[i + 3] == 0 || (p[i + 3] == '.' && p[i + 4] >= '0' && p[i + 4] <= '9')))
            *is_so = 1;
        h = (h ^ (u8)c) * 0x100000001b3ULL;
    }
    return h;
}

BPF_PERCPU_ARRAY(open_scratch, struct open_rec, 1);
/* pid_tgid -> the record of an openat in flight that names a shared object not handled yet, its path copied at
 * the syscall's entry (what was checked is what the agent handles, whatever the caller's memory says later).
 * Its target stops at the syscall's exit, and only if the file opened: a loader tries many paths that do not
 * exist (310 of the 402 library paths of a CUDA torch import), and each stop costs the target a round trip
 * through the agent. LRU: a thread that dies inside openat leaves its entry (keyed with its process, so a tid
 * reused elsewhere never finds it). */
BPF_TABLE("lru_hash", u64, struct open_rec, opens_in_flight, 4096);

TRACEPOINT_PROBE(syscalls, sys_enter_openat) {
    const char *filename = args->filename;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_target(tgid))
        return 0;
    u32 zero = 0;
    struct open_rec *rec = open_scratch.lookup(&zero);
    if (!rec)
        return 0;
    int is_so = 0;
    u64 h = 0;
    if (bpf_probe_read_user_str(rec->path, sizeof(rec->path), filename) > 0)
        h = library_hash(rec->path, &is_so);
    if (!is_so) {
        opens_in_flight.delete(&id); /* a stale entry of this thread (one that died in openat had its tid) */
        return 0;
    }
    rec->kind = libs_seen.lookup(&h) ? 0 : REC_OPEN; /* 0: handled already, the exit only notes the open */
    if (opens_in_flight.update(&id, rec) != 0)
        count(CNT_OPEN_LOST);
    return 0;
}

/* The open succeeded: the target's next loader stop reads its mappings, and an unseen library stops it now,
 * before the library is mapped. */
TRACEPOINT_PROBE(syscalls, sys_exit_openat) {
    u64 id = bpf_get_current_pid_tgid();
    struct open_rec *rec = opens_in_flight.lookup(&id);
    if (!rec)
        return 0;
    long ret = args->ret;
    u32 tgid = id >> 32;
    if (ret < 0 || !is_target(tgid)) {
        opens_in_flight.delete(&id);
        return 0;
    }
    u8 one = 1;
    libs_opened.update(&tgid, &one);
    if (rec->kind != REC_OPEN) {
        opens_in_flight.delete(&id);
        return 0;
    }
    FILL_HEAD(rec, REC_OPEN, id);
    /* stopped before the library is mapped */
    if (stop_target_and_emit(tgid, rec->time_ns, rec, sizeof(*rec), 1) != 0)
        count(CNT_OPEN_LOST);
    opens_in_flight.delete(&id);
    return 0;
}
