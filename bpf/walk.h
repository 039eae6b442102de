/* The CFI walk of a user stack, in tail calls (bpf/unwind.h says how the tables are laid out): the tables, the
 * per-CPU walk state and its caches, one frame's step, the scan past code without CFI, and the programs every
 * kind of walk (CPU samples, launch stacks, off-CPU stacks) runs, generated per kind by UW_STEP_PROGRAM and
 * UW_SCAN_PROGRAM.
 */
#ifndef AIFLAME_WALK_H
#define AIFLAME_WALK_H

#include "common.h"
#include "unwind.h"

/* .eh_frame unwinding (bpf/unwind.h says how the tables are laid out). The row pool is mmapped by the agent,
 * which writes a file's rows in one copy. */
BPF_F_TABLE("array", u32, u64, unwind_rows, AIFLAME_UNWIND_ROWS, BPF_F_MMAPABLE);
/* u32 entries two to a u64 value (an array map's values are 8-byte aligned): entry e is the low (e even) or high
 * half of value e / 2, so the agent writes the mmapped map as a plain u32 array. */
BPF_F_TABLE("array", u32, u64, unwind_index, AIFLAME_UNWIND_INDEX / 2, BPF_F_MMAPABLE);

static __always_inline int uw_index_entry(u32 e, u32 *out) {
    u32 slot = e >> 1;
    u64 *v = unwind_index.lookup(&slot);
    if (!v)
        return -1;
    *out = (u32)(*v >> ((e & 1) * 32));
    return 0;
}
BPF_ARRAY(unwind_rules, struct unwind_rule, AIFLAME_UNWIND_RULES);
BPF_F_TABLE("hash", u32, struct unwind_proc, unwind_procs, AIFLAME_UNWIND_PROCS, BPF_F_NO_PREALLOC);
BPF_ARRAY(layout_unwind_proc, struct unwind_proc, 1);
BPF_ARRAY(layout_unwind_rule, struct unwind_rule, 1);

/* While a call with a return probe runs, the kernel keeps its return address and puts the address of its
 * uretprobe trampoline (in the [uprobes] page, mapped from no file) in the stack slot. A walk through such a frame
 * would stop there, losing every caller (the Python path of a sample inside a probed all-reduce). on_call keeps,
 * per thread, the slot and the original return address of its last UW_URET_CALLS probed calls; the walk takes the
 * original back when it reads a page-aligned address that maps nowhere from a slot kept there. */
#define UW_URET_CALLS 8
struct uret_calls {
    u64 slot[UW_URET_CALLS];
    u64 ra[UW_URET_CALLS];
    u32 n;  /* calls recorded; the newest is at (n - 1) % UW_URET_CALLS */
    u32 pad;
};
BPF_TABLE("lru_hash", u32, struct uret_calls, uret_ras, 4096);

/* The return address the kernel's uretprobe took from `slot` of thread `tid`, or 0. */
static __always_inline u64 uw_uret_ra(u32 tid, u64 slot) {
    struct uret_calls *u = uret_ras.lookup(&tid);
    if (!u)
        return 0;
#pragma unroll
    for (int i = 0; i < UW_URET_CALLS; i++) {
        if (u->slot[i] == slot)
            return u->ra[i];
    }
    return 0;
}

#define AIFLAME_MAX_FRAME_BYTES (8u << 20)
#define UW_PAGE 4096

/* Whether `addr` may be the kernel's uretprobe trampoline, which starts the [uprobes] page: page-aligned. */
static __always_inline int uw_uret_trampoline(u64 addr) {
    return !(addr & (UW_PAGE - 1));
}

/* Rows found, per CPU: a deep stack's return addresses are the same call sites sample after sample, and sampled
 * pcs fall in the same hot code, so most frames (98% on the dispatcher loop) find their row here without searching.
 * An entry holds a row's address range; sets of four entries (one cache line) by table and 64-byte block of code,
 * the entry to replace in a set chosen round-robin. */
struct uw_cache_ent {
    u32 table;  /* unwind_map.table_id (0: empty) */
    u32 start;  /* the row covers ELF addresses [start, end) */
    u32 end;
    u32 rule;
};
#define UW_CACHE_SLOTS 1024
#define UW_CACHE_WAYS 4

/* Where a user walk stands between tail calls (per CPU, like the sample it fills). */
struct uw_state {
    u64 pc;
    u64 sp;
    u64 bp;
    u32 n;      /* frames written to the sample so far */
    u32 why;    /* UW_STOP_* once done, | UW_USED_FP, UW_USED_SCAN */
    u32 calls;  /* tail calls of uw_KIND_step so far */
    u8 scan_ok;   /* the walk may scan the stack past code without CFI (samples; not launch stacks) */
    u8 scan_now;  /* the step stopped at such code: scan before the next step */
    u8 scans;     /* scans done in this walk */
    u8 scan_retry;  /* the scan's last find was refused: search on above it (uw_scan_refused) */
    u8 scan_jit;  /* the scan began in JIT code, which no file's code reaches by a direct call */
    u32 scan_n;   /* frames before the frame a scan found (0: none in question) */
    u64 scan_bp;  /* bp when that scan began */
    u64 scan_from;  /* where a search on above the refused find begins */
    u64 scan_end;   /* the end of that scan's window (UW_SCAN_WORDS words above its sp) */
    u32 target;   /* the sampled process's target flags (samples) */
    u32 tid;      /* the walked thread */
    u32 victim;   /* round-robin: the rule cache entry to replace next in a set */
    /* binary-search bounds: kept in the map value, not in registers, so the verifier sees them as unknown
     * scalars and the states of both branches of each step prune into one (linear, not exponential, cost) */
    u32 lo;
    u32 hi;
    u32 fail;   /* the frame's UW_STOP_* should frame pointers fail (in the map value, as lo and hi, for the verifier) */
    u32 jit;    /* the frame is JIT code: its rbp means nothing, so no frame-pointer step (a scan where allowed) */
    u64 recent_maps;  /* 1 + the indexes in unwind_proc.m of the last four mappings searched, 16 bits each */
    /* Part of a page of the walked stack (a deep walk reads a return address, and often rbp, in every frame),
     * copied at the first word read in it (uw_read). Invalid (page_addr 0) at the start of each walk: the stack
     * changes between samples. */
    u64 page_addr;
    u32 page_lo;   /* page[page_lo, page_hi) holds the copy */
    u32 page_hi;
    u8 page[2 * UW_PAGE];  /* twice the page: the verifier bounds the copy's start and length apart */
    struct uw_cache_ent cache[UW_CACHE_SLOTS];  /* kept from walk to walk (uw_find_rule) */
};

/* *out = the user u64 at addr, through the page copy in st. A miss copies from UW_COPY_BELOW bytes below addr (a
 * frame's saved rbp is read after its return address, below it: starting at addr cost a second copy in 45% of
 * pages) to UW_COPY_FIRST bytes further, or to the page's end when the walk comes back above that copy in the
 * same page: in 41% of the pages a dispatcher-loop walk enters it reads a few words before one big frame takes
 * it to the next page, and the bytes copied, cold in cache, are much of a copy's cost. A read straddling two
 * pages, or from a page that cannot be copied, goes to the user memory directly. */
#define UW_COPY_BELOW 64
#define UW_COPY_FIRST 512
static __always_inline int uw_read(struct uw_state *st, u64 *out, u64 addr) {
    u64 base = addr & ~(u64)(UW_PAGE - 1);
    u32 off = addr & (UW_PAGE - 1);
    if (off > UW_PAGE - 8)
        goto direct;
    if (st->page_addr != base || off < st->page_lo || off + 8 > st->page_hi) {
        u32 from = (off > UW_COPY_BELOW ? off - UW_COPY_BELOW : 0) & (UW_PAGE - 8);
        u32 to = st->page_addr == base && off >= st->page_hi ? UW_PAGE : from + UW_COPY_FIRST;
        if (to > UW_PAGE)
            to = UW_PAGE;
        u64 len = to - from - 8;  /* 0..UW_PAGE - 8; the mask shows the verifier */
        asm volatile("%0 &= 4095" : "+r"(len));
        len += 8;
        /* the bounds before the copy (valid once page_addr is set): nothing but off is kept across the call */
        st->page_lo = from;
        st->page_hi = to;
        if (bpf_probe_read_user(st->page + from, len, (void *)(base + from)) != 0) {
            st->page_addr = 0;
            goto direct;
        }
        st->page_addr = base;
    }
    *out = load64(st->page + (off & (UW_PAGE - 1)));
    return 0;
direct: {
        /* into a local, then *out from a register: *out is then a spilled value on every path, as on the copy's,
         * which the verifier can match across paths (a helper's write would leave it as bytes of another kind) */
        u64 v;
        int err = bpf_probe_read_user(&v, sizeof(v), (void *)addr);
        u64 r = v;
        asm volatile("" : "+r"(r));
        *out = r;
        return err;
    }
}

static __always_inline struct unwind_map *uw_find_map(struct unwind_proc *p, struct uw_state *st, u64 pc) {
    /* a walk goes back and forth between a few files (libtorch, libpython, libc): try the last four found */
    u64 recent = st->recent_maps;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 last = (recent >> (16 * i)) & 0xffff;
        if (last) {
            struct unwind_map *m = &p->m[(last - 1) & (AIFLAME_UNWIND_MAPS - 1)];
            if (m->start <= pc && pc < m->end)
                return m;
        }
    }
    st->lo = 0;
    st->hi = p->n;
    for (int i = 0; i < AIFLAME_MAP_STEPS; i++) {
        asm volatile("" ::: "memory");  /* read the bounds from st, not from the last step's registers */
        u32 lo = st->lo, hi = st->hi;
        if (lo >= hi)
            break;
        u32 mid = (lo + hi) / 2;
        if (p->m[mid & (AIFLAME_UNWIND_MAPS - 1)].start <= pc)
            st->lo = mid + 1;
        else
            st->hi = mid;
    }
    u32 lo = st->lo;
    if (lo == 0 || lo > AIFLAME_UNWIND_MAPS)
        return NULL;
    struct unwind_map *m = &p->m[(lo - 1) & (AIFLAME_UNWIND_MAPS - 1)];
    if (pc >= m->end)
        return NULL;
    st->recent_maps = recent << 16 | lo;  /* the oldest of the four drops out */
    return m;
}

/* The rule index of m's last row at or below `addr` (0: not covered), and the addresses that row covers,
 * [*start, *end). Only the rows of addr's index page are searched: every row below them is below addr and every
 * row above them is above it. */
static __always_inline u32 uw_search_rule(struct uw_state *st, struct unwind_map *m, u32 addr, u32 *start,
                                          u32 *end) {
    u32 first = m->first_row, n = m->nrows;
    if (!m->npages || addr < m->page_base)
        return 0;
    u32 k = (addr - m->page_base) >> (m->page_shift & 31);
    if (k < m->npages) {
        u32 lo, hi;
        if (uw_index_entry(m->index_first + k, &lo) || uw_index_entry(m->index_first + k + 1, &hi))
            return 0;
        st->lo = lo;
        st->hi = hi;
    } else {
        st->lo = n;  /* past the last page: the last row */
        st->hi = n;
    }
    for (int i = 0; i < AIFLAME_ROW_STEPS; i++) {
        asm volatile("" ::: "memory");  /* read the bounds from st, not from the last step's registers */
        u32 lo = st->lo, hi = st->hi;
        if (lo >= hi)
            break;
        u32 mid = lo + (hi - lo) / 2;
        u32 idx = first + mid;
        u64 *row = unwind_rows.lookup(&idx);
        if (!row)
            return 0;
        if ((u32)*row <= addr)
            st->lo = mid + 1;
        else
            st->hi = mid;
    }
    u32 lo = st->lo;
    if (lo == 0)
        return 0;
    u32 idx = first + lo - 1;
    u64 *row = unwind_rows.lookup(&idx);
    if (!row)
        return 0;
    *start = (u32)*row;
    *end = 0xffffffffu;  /* the last row covers the rest of the file */
    if (lo < n) {
        idx++;
        u64 *next = unwind_rows.lookup(&idx);
        if (next)
            *end = (u32)*next;
    }
    return (u32)(*row >> 32) & 0xffff;
}

static __always_inline u32 uw_find_rule(struct uw_state *st, struct unwind_map *m, u32 addr) {
    u32 table = m->table_id;
    u64 tag = (u64)table << 32 | addr >> 6;
    u32 set = (u32)((tag * 0x9e3779b97f4a7c15ULL) >> 40) & (UW_CACHE_SLOTS / UW_CACHE_WAYS - 1);
    struct uw_cache_ent *ways = &st->cache[set * UW_CACHE_WAYS];
#pragma unroll
    for (int w = 0; w < UW_CACHE_WAYS; w++) {
        if (ways[w].table == table && ways[w].start <= addr && addr < ways[w].end)
            return ways[w].rule;
    }
    u32 start = 1, end = 0;
    u32 rule = uw_search_rule(st, m, addr, &start, &end);
    if (table && start <= addr && addr < end) {
        struct uw_cache_ent *c = &ways[st->victim++ & (UW_CACHE_WAYS - 1)];
        c->table = table;
        c->start = start;
        c->end = end;
        c->rule = rule;
    }
    return rule;
}

/* A walk as tail calls, e.g. for samples: on_sample -> uw_sample_step (AIFLAME_UW_FRAMES frames each, as often as
 * needed, with uw_sample_scan between steps past code without CFI) -> sample_finish. Each kind of walk has a prog
 * array of these indexes, which the agent fills (agent/kernel/sampler.py UW_PROGS). */
#define UW_PROG_STEP 0
#define UW_PROG_FINISH 1
#define UW_PROG_SCAN 2
#define UW_MAX_SCANS 12      /* scan tail calls per walk */
#define UW_MAX_TAILS 31      /* step and scan tail calls per walk: the kernel allows 33 in all, the finish's included */
#define UW_SCAN_WORDS 128    /* words above sp one scan tail call looks at */
#define UW_SCAN_WINDOWS 4    /* a scan looks up to this many times UW_SCAN_WORDS above sp, one tail call each */
#ifndef AIFLAME_UW_FRAMES
#define AIFLAME_UW_FRAMES 12
#endif
#if !defined(AIFLAME_UW_MAX_DEPTH) || AIFLAME_UW_MAX_DEPTH > AIFLAME_MAX_STACK
#undef AIFLAME_UW_MAX_DEPTH
#define AIFLAME_UW_MAX_DEPTH AIFLAME_MAX_STACK  /* user frames a CFI walk records at most (--max-depth) */
#endif

/* A new walk of thread `tid` from (pc, sp, bp); the rule cache in st is kept. */
static __always_inline void uw_begin(struct uw_state *st, u32 tid, u64 pc, u64 sp, u64 bp, u8 scan_ok) {
    st->tid = tid;
    st->pc = pc;
    st->sp = sp;
    st->bp = bp;
    st->n = 0;
    st->why = 0;
    st->calls = 0;
    st->page_addr = 0;
    st->recent_maps = 0;
    st->scan_ok = scan_ok;
    st->scan_now = 0;
    st->scans = 0;
    st->scan_retry = 0;
    st->scan_n = 0;
}

/* One frame of the user stack from st into data[st->n]: CFI rows where the mapping has a table, frame pointers
 * where it has none or the rule cannot be followed. Returns 1 when the walk is over (st->why says why). */
static __always_inline int unwind_frame(u64 *data, struct unwind_proc *p, struct uw_state *st) {
    u64 pc = st->pc, sp = st->sp, bp = st->bp;
    u32 n = st->n;
    int done = 0;
    do {  /* break: the walk is over; continue: on to the next frame */
        if (n >= AIFLAME_UW_MAX_DEPTH) {
            st->why |= UW_STOP_DEPTH;
            done = 1;
            break;
        }
        u64 idx = n;
        asm volatile("%0 &= 127" : "+r"(idx));  /* n < AIFLAME_MAX_STACK here; the mask shows it to the verifier */
        data[idx] = pc;
        n++;
        /* a caller's pc is a return address, which may be the first byte of the next function: look up pc - 1 */
        u64 look = n > 1 ? pc - 1 : pc;
        struct unwind_map *m = uw_find_map(p, st, look);
        if (!m && n > 1 && uw_uret_trampoline(pc)) {
            u64 ra = uw_uret_ra(st->tid, sp - 8);  /* sp is the CFA the return address was read below */
            if (ra) {
                pc = ra;
                data[idx] = pc;
                look = pc - 1;
                m = uw_find_map(p, st, look);
            }
        }
        st->fail = UW_STOP_NO_MAPPING;
        st->jit = 0;
        u32 cfa_type = CFA_NONE;
        struct unwind_rule *r = NULL;
        if (m) {
            st->fail = m->first_row == UW_ROWS_EVICTED ? UW_STOP_EVICTED :
                       m->first_row == UW_ROWS_PENDING ? UW_STOP_NOT_COVERED : UW_STOP_FP_END;
            if (m->first_row == UW_ROWS_JIT) {
                st->fail = UW_STOP_NOT_COVERED;
                st->jit = 1;
            }
            if (m->nrows) {
                u64 addr = look - m->bias;
                u32 rule = addr >> 32 ? 0 : uw_find_rule(st, m, (u32)addr);
                st->fail = UW_STOP_NOT_COVERED;
                if (rule) {
                    r = unwind_rules.lookup(&rule);
                    if (r) {
                        cfa_type = r->cfa_type;
                        if (cfa_type == CFA_INVALID)
                            st->fail = UW_STOP_UNSUPPORTED;
                    }
                }
            }
        }
        if (cfa_type == CFA_END) {
            st->why |= UW_STOP_END;
            done = 1;
            break;
        }
        u64 cfa = 0;
        if (r && cfa_type == CFA_RSP)
            cfa = sp + r->cfa_off;
        else if (r && cfa_type == CFA_RBP)
            cfa = bp + r->cfa_off;
        else if (cfa_type == CFA_PLT)
            cfa = sp + 8 + ((pc & 15) >= 11 ? 8 : 0);
        else if (cfa_type == CFA_PLT10)
            cfa = sp + 8 + ((pc & 15) >= 10 ? 8 : 0);
        else if (r && cfa_type == CFA_DEREF_RBP) {
            if (uw_read(st, &cfa, bp + r->cfa_off) != 0) {
                st->why |= UW_STOP_READ_FAULT;
                done = 1;
                break;
            }
        } else if (cfa_type == CFA_SIGNAL) {
            /* __restore_rt: sp points at the ucontext; uc_mcontext.gregs at +40 hold rbp [10], rsp [15], rip [16] */
            u64 regs[7];
            if (bpf_probe_read_user(regs, sizeof(regs), (void *)(sp + 40 + 10 * 8)) != 0) {
                st->why |= UW_STOP_READ_FAULT;
                done = 1;
                break;
            }
            bp = regs[0];
            sp = regs[5];
            pc = regs[6];
            if (!pc) {
                st->why |= UW_STOP_END;
                done = 1;
                break;
            }
            continue;
        }
        if (cfa && cfa <= sp) {
            /* A caller's frame lies above its callee's: an rbp-based rule read with a stale rbp (one the JIT code
             * below clobbered, or a rule that did not restore it) would walk in a loop. The frame is kept and its
             * return address searched for as past code without CFI. */
            if (st->scan_ok && st->scans < UW_MAX_SCANS)
                st->scan_now = 1;
            else
                st->why |= UW_STOP_UNSUPPORTED;
            done = 1;
            break;
        }
        if (cfa) {
            u64 ra = 0;
            if (uw_read(st, &ra, cfa - 8) != 0 ||
                (r && r->rbp_type == RBP_AT_CFA && uw_read(st, &bp, cfa + r->rbp_off) != 0) ||
                (r && r->rbp_type == RBP_AT_RBP && uw_read(st, &bp, bp + r->rbp_off) != 0)) {
                st->why |= UW_STOP_READ_FAULT;
                done = 1;
                break;
            }
            if (r && r->rbp_type == RBP_INVALID)
                bp = 0;
            sp = cfa;
            pc = ra;
        } else {
            /* frame pointers: [bp] = the caller's bp, [bp + 8] = the return address */
            u64 frame[2];
            if (st->jit || bp < sp || bp - sp > AIFLAME_MAX_FRAME_BYTES || (bp & 7) ||
                uw_read(st, &frame[0], bp) != 0 || uw_read(st, &frame[1], bp + 8) != 0) {
                if (st->fail == UW_STOP_NOT_COVERED && st->scan_ok && st->scans < UW_MAX_SCANS)
                    st->scan_now = 1;  /* uw_KIND_scan looks for the return address; the reason is set there */
                else
                    st->why |= st->fail;
                done = 1;
                break;
            }
            st->why |= UW_USED_FP;
            sp = bp + 16;
            bp = frame[0];
            pc = frame[1];
        }
        if (!pc) {
            st->why |= UW_STOP_END;
            done = 1;
            break;
        }
    } while (0);
    st->pc = pc;
    st->sp = sp;
    st->bp = bp;
    st->n = n;
    return done;
}

/* Walk up to AIFLAME_UW_FRAMES frames of the user stack from st. Returns 1 when the walk is over.
 *
 * Between frames the walk's registers (pc, sp, bp, frames so far) are in st, not in registers, and the
 * compiler must read them again there (the barrier): the kernel's verifier, which walks the loop once per frame,
 * then starts each frame from one state however the last one was found (CFI or frame pointers, a cached rule or
 * a search...), instead of carrying every path's values into the next frame and walking it again for each. */
static __always_inline int unwind_step(u64 *data, struct unwind_proc *p, struct uw_state *st) {
    for (int j = 0; j < AIFLAME_UW_FRAMES; j++) {
        asm volatile("" ::: "memory");
        if (unwind_frame(data, p, st))
            return 1;
    }
    return 0;
}

/* One tail call's share of a walk (samples and probed calls alike): AIFLAME_UW_FRAMES more frames of `pid`'s
 * stack into data. Returns 1 while the walk goes on and may take another tail call, 0 when it is over or out of
 * tail calls (then marked as stopped by depth). */
/* Whether the walk just failed on what the last scan found: the word it took for a return address led, within a
 * frame, to an address in no mapping, a stack it could not read or a CFA not above sp (a stale return address
 * above sp: a JIT kernel's spilled values, oneDNN's among them). Then the walk goes back to before that find and the scan searches on above
 * it, within the same window and the walk's UW_MAX_SCANS. */
/* Whether the walk may take another step or scan tail call and still reach its finish program. */
static __always_inline int uw_tail_room(struct uw_state *st) {
    return st->calls + st->scans < UW_MAX_TAILS;
}

static __always_inline int uw_scan_refused(struct uw_state *st) {
    u32 stop = st->why & 0xff;
    if (!st->scan_n || st->n > st->scan_n + 2 || st->scans >= UW_MAX_SCANS || !uw_tail_room(st) ||
        (stop != UW_STOP_NO_MAPPING && stop != UW_STOP_READ_FAULT && stop != UW_STOP_UNSUPPORTED))
        return 0;
    st->why &= ~0xffu;
    st->scan_retry = 1;
    st->scan_now = 1;
    return 1;
}

static __always_inline int uw_walk_more(u64 *data, u32 pid, struct uw_state *st) {
    struct unwind_proc *up = unwind_procs.lookup(&pid);
    int done = up ? unwind_step(data, up, st) : 1;
    st->calls++;
    if (done) {
        if (st->scan_now && !uw_tail_room(st)) {
            st->scan_now = 0;
            st->why |= UW_STOP_DEPTH;  /* out of tail calls */
        }
        uw_scan_refused(st);
        return 0;
    }
    if (uw_tail_room(st))
        return 1;
    st->why |= UW_STOP_DEPTH;
    return 0;
}

/* Whether the code before return address `ra` is a call: 2 for e8 rel32 (direct), 1 for ff /2 with a register,
 * [reg], [reg+disp8], [reg+disp32] or [rip+disp32] operand (the forms compilers emit), else 0. Reads the 8 code
 * bytes before ra. */
static __always_inline int uw_after_call(u64 ra) {
    u8 c[8];
    if (bpf_probe_read_user(c, 8, (void *)(ra - 8)) != 0)
        return 0;
    if (c[3] == 0xe8)                                  /* call rel32 */
        return 2;
    if (c[6] == 0xff && (c[7] & 0xf8) == 0xd0)         /* call reg */
        return 1;
    if (c[6] == 0xff && (c[7] & 0xf8) == 0x10 && (c[7] & 7) != 4 && (c[7] & 7) != 5)  /* call [reg] */
        return 1;
    if (c[5] == 0xff && (c[6] & 0xf8) == 0x50 && (c[6] & 7) != 4)  /* call [reg+disp8] */
        return 1;
    if (c[2] == 0xff && ((c[3] & 0xf8) == 0x90 || c[3] == 0x15))  /* call [reg+disp32], call [rip+disp32] */
        return 1;
    return 0;
}

/* Tail-called when a walk reached code its file's CFI does not cover and frame pointers failed (hand-written
 * kernels such as MKL's): the nearest word above sp that points into a mapped file just after a call instruction
 * is taken as the frame's return address (as crash unwinders do as a last resort); the walk goes on from there
 * (through more such code by more scans, up to UW_MAX_SCANS), and the sample says a frame was found so
 * (UW_USED_SCAN). uw_scan_ra returns whether it found one (else the walk is marked stopped). */
static __always_inline int uw_scan_ra(u32 pid, struct uw_state *st) {
    st->scan_now = 0;
    st->scans++;
    struct unwind_proc *p = unwind_procs.lookup(&pid);
    if (st->scan_retry) {  /* back to before the refused find (uw_scan_refused), on above it */
        st->n = st->scan_n;
        st->bp = st->scan_bp;
        st->sp = st->scan_from;
    } else {
        st->scan_n = st->n;
        st->scan_bp = st->bp;
        st->scan_end = st->sp + 8 * UW_SCAN_WORDS * UW_SCAN_WINDOWS;
        st->scan_jit = st->jit;
    }
    st->scan_retry = 0;
    u64 sp = st->sp;
    int found = 0, more = 0;
    for (int i = 0; p && i < UW_SCAN_WORDS; i++) {
        u64 at = sp + 8 * i, v = 0;
        if (at >= st->scan_end || uw_read(st, &v, at) != 0)
            break;
        more = i == UW_SCAN_WORDS - 1;  /* all of this call's words read, none taken: the next call reads on */
        if (v < 4096)
            continue;
        struct unwind_map *m = uw_find_map(p, st, v - 1);
        if (!m)
            continue;
        int call = uw_after_call(v);
        /* past JIT code, a direct call from a file is a stale return address (its callee was in that file) */
        if (!call || (call == 2 && st->scan_jit && m->first_row != UW_ROWS_JIT))
            continue;
        st->pc = v;
        st->sp = at + 8;
        st->scan_from = at + 8;
        st->why |= UW_USED_SCAN;
        found = 1;
        break;
    }
    if (found && !uw_tail_room(st)) {
        found = 0;
        st->why |= UW_STOP_DEPTH;  /* out of tail calls */
    } else if (!found && more && p && st->scans < UW_MAX_SCANS && uw_tail_room(st)) {
        /* oneDNN's JIT kernels keep more than UW_SCAN_WORDS words of spills under their return address */
        st->scan_from = sp + 8 * UW_SCAN_WORDS;
        st->scan_retry = 1;
        st->scan_now = 1;
    } else if (!found && !(st->why & 0xff)) {
        st->why |= UW_STOP_NOT_COVERED;
    }
    return found;
}

/* The tail-called programs of one kind of walk (KIND: sample, call, offcpu), each over the kind's own per-CPU
 * record and walk state and through its own prog array (index UW_PROG_STEP, UW_PROG_FINISH, UW_PROG_SCAN).
 * BCC refuses map calls inside a macro, so each kind defines, before these, four small functions:
 *   KIND_rec()              its record (REC *, from its scratch map)
 *   KIND_walk()             its walk state (struct uw_state *)
 *   KIND_tail(ctx, prog)    a tail call into its prog array (returns only when the call did not happen)
 *   KIND_walked(rec, st)    the record takes the walk's frames (and how it ended) before its finish program
 *   KIND_unfinished(rec)    the program's return value when the finish program's tail call did not happen
 * uw_KIND_step walks AIFLAME_UW_FRAMES more frames, then tail-calls itself, the scan, or the finish program;
 * uw_KIND_scan (walks that may scan: not launch stacks) looks for a return address past code without CFI and
 * steps on from it. */
#define UW_WALK_DONE(KIND, ctx, rec, st)                                                     \
    do {                                                                                     \
        KIND##_walked(rec, st);                                                              \
        KIND##_tail(ctx, UW_PROG_FINISH);                                                    \
        count(CNT_UW_TAILCALL_FAIL); /* reached only when the tail call did not happen */    \
        return KIND##_unfinished(rec);                                                       \
    } while (0)

#define UW_STEP_PROGRAM(KIND, CTX, REC)                                                      \
    int uw_##KIND##_step(CTX *ctx) {                                                         \
        REC *rec = KIND##_rec();                                                             \
        struct uw_state *st = KIND##_walk();                                                 \
        if (!rec || !st)                                                                     \
            return 0;                                                                        \
        if (uw_walk_more(rec->data, rec->pid, st))                                           \
            KIND##_tail(ctx, UW_PROG_STEP);                                                  \
        if (st->scan_now)                                                                    \
            KIND##_tail(ctx, UW_PROG_SCAN);                                                  \
        UW_WALK_DONE(KIND, ctx, rec, st);                                                    \
    }

#define UW_SCAN_PROGRAM(KIND, CTX, REC)                                                      \
    int uw_##KIND##_scan(CTX *ctx) {                                                         \
        REC *rec = KIND##_rec();                                                             \
        struct uw_state *st = KIND##_walk();                                                 \
        if (!rec || !st)                                                                     \
            return 0;                                                                        \
        if (uw_scan_ra(rec->pid, st))                                                        \
            KIND##_tail(ctx, UW_PROG_STEP);                                                  \
        else if (st->scan_now)                                                               \
            KIND##_tail(ctx, UW_PROG_SCAN);                                                  \
        UW_WALK_DONE(KIND, ctx, rec, st);                                                    \
    }

#endif /* AIFLAME_WALK_H */
