/* Native unwinding from .eh_frame CFI tables, in BPF, for binaries without frame pointers.
 *
 * The agent compiles each mapped ELF's CFI into sorted rows (symbolize/objfmt/cfi/) and loads them
 * (agent/kernel/unwind.py) into one pool shared by every process that maps the file:
 *   unwind_rows[i]   u64: ELF virtual address (low 32 bits) | rule index << 32, sorted per file
 *   unwind_rules[r]  how to find the caller's CFA, return address and rbp (rule 0: not covered)
 *   unwind_procs[pid] the process's executable mappings, sorted by start: runtime range, bias (runtime address
 *                    minus ELF address) and the file's row range; a mapping with no rows is walked with
 *                    frame pointers.
 *   unwind_index[i] u32: per file, for each 4 KiB page of its code (larger where rows are sparse), the first of
 *                    its rows at or above the page (npages + 1 entries), so the row search covers one page's
 *                    rows (~40 in libtorch, at most 2^AIFLAME_ROW_STEPS - 1), not all (~10^6)
 * A frame's mapping is most often one of the last four found, and its row one the CPU's rule cache holds; else
 * a binary search finds each (mapping, then row within the page). The walk ends cleanly at a row whose return
 * address is undefined (_start, a thread's clone child) or a zero return address, and says why it ended
 * otherwise (UW_STOP_*), so user space can count the reasons per mapping.
 */
#ifndef AIFLAME_UNWIND_H
#define AIFLAME_UNWIND_H

/* 64 MiB: the executed tables of a CUDA torch process (libtorch_cpu 2.65 M rows, libtorch_cuda 1.03 M, cuBLASLt
 * 0.79 M...: bench/torch_tables.py) with room; a table never executed is evicted first (agent/kernel/unwind.py) */
#ifndef AIFLAME_UNWIND_ROWS
#define AIFLAME_UNWIND_ROWS (1 << 23)
#endif
#define AIFLAME_UNWIND_RULES 65536
#ifndef AIFLAME_UNWIND_INDEX
#define AIFLAME_UNWIND_INDEX (1 << 20)
#endif
#define AIFLAME_UNWIND_MAPS 256     /* executable mappings per process (power of two) */
#define AIFLAME_UNWIND_PROCS 8192
#define AIFLAME_ROW_STEPS 13        /* binary-search steps: 8191 rows per index page at most (unwind.py MAX_PAGE_ROWS) */
#define AIFLAME_MAP_STEPS 9         /* 2^9 > AIFLAME_UNWIND_MAPS */

/* rule kinds (symbolize/objfmt/cfi/table.py mirrors them; a test keeps the two equal) */
#define CFA_NONE 0       /* no CFI row covers the address */
#define CFA_RSP 1        /* CFA = rsp + off */
#define CFA_RBP 2        /* CFA = rbp + off */
#define CFA_PLT 3        /* PLT entry: CFA = rsp + 8 + ((rip & 15) >= 11 ? 8 : 0) */
#define CFA_PLT10 4      /* the same with >= 10 */
#define CFA_DEREF_RBP 5  /* CFA = *(rbp + off) (stack realignment) */
#define CFA_END 6        /* return address undefined: the outermost frame */
#define CFA_INVALID 7    /* a rule we cannot follow */
#define CFA_SIGNAL 8     /* signal trampoline: the interrupted registers are in the ucontext at rsp */
#define RBP_SAME 0
#define RBP_AT_CFA 1     /* rbp saved at CFA + rbp_off */
#define RBP_INVALID 2    /* the caller's rbp is unknown: 0 from there on */
#define RBP_AT_RBP 3     /* rbp saved at the frame's rbp + rbp_off (stack realignment, with CFA_DEREF_RBP) */

/* why a user walk ended (the low byte of sample_rec.unwind) */
#define UW_STOP_END 1          /* the outermost frame: a clean end */
#define UW_STOP_NO_MAPPING 2   /* an address outside every file mapping (JIT, anonymous code, vdso) */
#define UW_STOP_NOT_COVERED 3  /* inside a file whose CFI has no row there, and no frame pointer to follow */
#define UW_STOP_UNSUPPORTED 4  /* a CFA rule we cannot follow, and no frame pointer */
#define UW_STOP_READ_FAULT 5   /* a stack read failed */
#define UW_STOP_DEPTH 6        /* AIFLAME_MAX_STACK frames, or the walk's tail calls spent (UW_MAX_TAILS) */
#define UW_STOP_FP_END 7       /* the frame-pointer chain ended (mappings without tables) */
#define UW_STOP_EVICTED 8      /* the file's table was evicted from the pool */
#define UW_USED_FP 0x100       /* at least one frame was found by frame pointer */
#define UW_USED_SCAN 0x200     /* at least one frame was found by scanning the stack (code without CFI) */

struct unwind_rule {
    __u8 cfa_type;
    __u8 rbp_type;
    __u16 pad;
    __s32 cfa_off;
    __s32 rbp_off;
};

#define UW_ROWS_EVICTED 0xffffffffu  /* first_row of a mapping whose table was evicted (nrows 0) */
/* first_row of anonymous executable memory (JIT code: oneDNN's kernels, nrows 0): no CFI there, so where frame
 * pointers fail the walk scans for the return address (uw_KIND_scan), as in a file's code without CFI */
#define UW_ROWS_JIT 0xfffffffeu
/* first_row of a mapping whose table is being built (nrows 0): frame pointers, else a scan, as code without CFI */
#define UW_ROWS_PENDING 0xfffffffdu
struct unwind_map {
    __u64 start;
    __u64 end;
    __u64 bias;        /* runtime address - ELF virtual address */
    __u32 first_row;
    __u32 nrows;       /* 0: walk this mapping with frame pointers */
    __u32 index_first; /* unwind_index[index_first + k]: the first row (of this file's) at or above page k */
    __u32 page_base;   /* ELF address of page 0 */
    __u32 npages;      /* pages in the index (every table in the pool has one) */
    __u32 page_shift;  /* pages of 1 << page_shift bytes: 12, more for sparse tables */
    __u32 table_id;    /* the agent numbers each table it loads, never reusing a number: the rule cache's tag */
    __u32 pad;
};

struct unwind_proc {
    __u32 n;
    __u32 flags;
    struct unwind_map m[AIFLAME_UNWIND_MAPS];
};

#endif
