/* The Python frame walker: a thread's frames read from its interpreter's thread state, newest first, with the
 * layout the agent found for the process (struct py_proc, agent/python/). Samples, off-CPU stacks and launch
 * stacks all carry them.
 */
#ifndef AIFLAME_PYTHON_H
#define AIFLAME_PYTHON_H

#include "common.h"

BPF_HASH(py_procs, u32, struct py_proc, 4096);
/* tid -> its Python thread state, re-checked on every hit (threads come and go). */
BPF_TABLE("lru_hash", u32, u64, py_tstates, 65536);
/* One frame is read into this per-CPU buffer with a single user read, then picked apart. */
struct py_buf { u8 b[128 + 8]; };
BPF_PERCPU_ARRAY(py_scratch, struct py_buf, 1);
BPF_ARRAY(layout_py_proc, struct py_proc, 1);

/* 8 bytes at `off` of a frame read into `buf` (bounded so the verifier can see it stays inside). */
static __always_inline u64 field64(struct py_buf *buf, s32 off) {
    u32 o = (u32)off & 127;
    return load64(&buf->b[o]);
}

/* Is `ts` the thread state of kernel thread `tid`? */
static __always_inline int tstate_is(struct py_proc *pp, u64 ts, u32 tid) {
    if (!ts)
        return 0;
    if (pp->tstate_native_thread_id >= 0) {
        u64 native = read_ptr(ts + pp->tstate_native_thread_id);
        return native == tid;
    }
    /* 3.10: thread_id is pthread_self(); glibc keeps the kernel tid inside struct pthread. */
    u64 pthread = read_ptr(ts + pp->tstate_thread_id);
    u32 ktid = 0;
    if (!pthread || pp->tid_offset < 0 ||
        bpf_probe_read_user(&ktid, sizeof(ktid), (void *)(pthread + pp->tid_offset)) != 0)
        return 0;
    return ktid == tid;
}

static __always_inline u64 find_tstate(struct py_proc *pp, u32 tid) {
    u64 *cached = py_tstates.lookup(&tid);
    if (cached && tstate_is(pp, *cached, tid))
        return *cached;
    u64 interp = read_ptr(pp->runtime + pp->runtime_interp_head);
    if (!interp)
        return 0;
    u64 ts = read_ptr(interp + pp->interp_tstate_head);
    for (int i = 0; i < 64; i++) {
        if (!ts)
            return 0;
        if (tstate_is(pp, ts, tid)) {
            py_tstates.update(&tid, &ts);
            return ts;
        }
        ts = read_ptr(ts + pp->tstate_next);
    }
    return 0;
}

/* Walk the thread's Python frames, newest first, into data[base...]. Every frame is kept; user space drops
 * shims. Shared by the sampler and the runtime probes (whose launch stacks get Python frames too). `base` is at
 * most 2 * AIFLAME_MAX_STACK (the user and kernel stacks before it), so every frame fits in data.
 *
 * The frame loop is walked by the kernel's verifier once per frame it may take (AIFLAME_MAX_PY_FRAMES), each
 * branch in it doubling what follows until the paths meet again: what differs by interpreter version is chosen
 * before the loop, as masks, and the loop body has no branch but its exits. */
static __always_inline void walk_python(u64 *data, u32 *py_count, u32 *py_flags, u32 tgid, u32 tid, u32 base,
                                        u32 target) {
    /* base goes through the record, as the count will: the verifier then carries one unknown value through the
     * walk, not one state per range of the callers' stack lengths (nine for finish_sample) */
    *py_count = base;
    asm volatile("" ::: "memory");
    base = *py_count;
    *py_count = 0;
    *py_flags = 0;
    if (!(target & TARGET_PY) || base > 2 * AIFLAME_MAX_STACK)
        return;
    struct py_proc *pp = py_procs.lookup(&tgid);
    if (!pp)
        return;
    u32 flags = PY_PRESENT;
    u64 ts = find_tstate(pp, tid);
    if (!ts) {
        *py_flags = flags;
        return;
    }
    flags |= PY_TSTATE;
    u64 frame = read_ptr(ts + pp->tstate_frame);
    if (pp->cframe_current_frame >= 0 && frame)
        frame = read_ptr(frame + pp->cframe_current_frame);
    u32 zero = 0;
    struct py_buf *buf = py_scratch.lookup(&zero);
    if (!buf) {
        *py_flags = flags;
        return;
    }
    u32 size = pp->frame_read & 127;
    s32 code_off = pp->frame_code, back_off = pp->frame_back, instr_off = pp->frame_instr;
    s32 owner_off = pp->frame_owner, entry_off = pp->frame_is_entry;
    /* 3.11+: the instruction is a pointer into the code object (less the code's address: an offset); before,
     * f_lasti (the low 4 bytes) */
    u64 code_mask = pp->version < 0x30b ? 0 : ~0ull;
    u64 owner_mask = owner_off >= 0 ? 0xff : 0;  /* 3.11+: the frame's owner byte */
    u64 entry_mask = entry_off >= 0 ? 0xff : 0;  /* 3.11, 3.12: is_entry */
    /* opaque to the compiler, which would otherwise make a copy of the loop for each value (unswitching) */
    asm volatile("" : "+r"(code_mask), "+r"(owner_mask), "+r"(entry_mask));
    /* the count and the flags go through the record, not registers, so the verifier sees one state after the
     * loop instead of one per exit */
    for (int i = 0; i < AIFLAME_MAX_PY_FRAMES; i++) {
        if (!frame)
            break;
        if (bpf_probe_read_user(buf->b, size, (void *)frame) != 0) {
            flags |= PY_READ_ERR;
            break;
        }
        u64 code = field64(buf, code_off);
        u64 instr = (u32)(field64(buf, instr_off) - (code & code_mask));
        instr |= (field64(buf, owner_off) & owner_mask) << 32;
        instr |= (field64(buf, entry_off) & entry_mask) << 40;
        data[base + 2 * i] = code;
        data[base + 2 * i + 1] = instr;
        *py_count = i + 1;
        if (!code) {
            flags |= PY_READ_ERR;
            break;
        }
        frame = field64(buf, back_off);
    }
    *py_flags = flags;
    if (frame && *py_count == AIFLAME_MAX_PY_FRAMES) {
        *py_flags |= PY_TRUNCATED;
        count(CNT_PY_TRUNCATED);
    }
    if (*py_flags & PY_READ_ERR)
        count(CNT_PY_READ_ERR);
}

#endif /* AIFLAME_PYTHON_H */
