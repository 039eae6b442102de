/* Record layouts shared by every aiflame BPF program and the agent (agent/kernel/records.py mirrors them, and
 * core/raw.py PyFlag the PY_* flags; tests/integration/test_records_layout.py proves the layouts agree and
 * tests/unit/test_records.py the constants). Raw values only: user space symbolizes. */
#ifndef AIFLAME_H
#define AIFLAME_H

#define AIFLAME_MAX_STACK 127
#define AIFLAME_COMM_LEN 16
#ifndef AIFLAME_MAX_PY_FRAMES
#define AIFLAME_MAX_PY_FRAMES 96
#endif

enum aiflame_rec_kind {
    REC_SAMPLE = 1,
    REC_FORK = 2,
    REC_EXEC = 3,
    REC_EXIT = 4,
    REC_CALL = 5,   /* a probed runtime call entered (call_rec) */
    REC_RET = 6,    /* a probed runtime call returned (ret_rec) */
    REC_OPEN = 7,   /* a target opened a shared library; it is stopped until the agent has probed it */
    REC_OFFCPU = 8, /* a target thread went to sleep: its stack (sample_rec; time_ns: when; bpf/offcpu.bpf.c) */
    REC_OFFCPU_END = 9, /* ... and how long it slept (offcpu_end_rec) */
};

/* Counters kept per CPU; the agent sums them and reports each one. */
enum aiflame_counter {
    CNT_SAMPLES = 0,      /* samples of target threads seen by the program */
    CNT_LOST = 1,         /* samples dropped: ring buffer full */
    CNT_USTACK_ERR = 2,   /* user stack lookup failed */
    CNT_KSTACK_ERR = 3,   /* kernel stack lookup failed */
    CNT_PROC_LOST = 4,    /* fork/exec/exit records dropped */
    CNT_TARGETS_FULL = 5, /* a child could not be followed: children map full */
    CNT_PY_TRUNCATED = 6, /* Python stack deeper than AIFLAME_MAX_PY_FRAMES */
    CNT_PY_READ_ERR = 7,  /* a Python frame could not be read (page not resident, torn state) */
    CNT_CALL_LOST = 8,    /* runtime call or return records dropped: ring buffer full */
    CNT_OPEN_LOST = 9,    /* library-open records dropped (the target was not stopped) */
    CNT_UW_TAILCALL_FAIL = 10, /* a CFI walk could not tail-call on (its prog array empty): frame pointers used */
    CNT_STOPS_UNRECORDED = 11, /* a target not stopped at a probe: the stops map was full */
    CNT_CALL_SKIPPED = 12, /* PROBE_SAMPLE calls over the per-CPU record budget: counted in call_skipped, no record */
    CNT_OFFCPU = 13,      /* target threads' blocks recorded (--off-cpu) */
    CNT_OFFCPU_LOST = 14, /* off-CPU records dropped: ring buffer full */
    CNT_MAX = 15,
};

/* values of the targets map (records.py TargetFlag) */
#define TARGET_ON 1      /* sample and probe this process */
#define TARGET_PY 2      /* it has a Python walker layout in py_procs */

/* py_flags of a sample or call (core/raw.py PyFlag) */
#define PY_PRESENT 1     /* the process runs CPython with a verified layout */
#define PY_TSTATE 2      /* the sampled thread has a Python thread state */
#define PY_TRUNCATED 4   /* more frames than AIFLAME_MAX_PY_FRAMES */
#define PY_READ_ERR 8    /* the walk stopped on a failed read */

/* A Python frame takes two words of sample_rec.data: the code object address, then
 * instr | owner << 32 | is_entry << 40, where instr is f_lasti (3.10) or the instruction pointer minus the code
 * address in bytes (3.11+), and owner/is_entry mark evaluator entries (3.11+). */
#define AIFLAME_SAMPLE_WORDS (2 * AIFLAME_MAX_STACK + 2 * AIFLAME_MAX_PY_FRAMES)

/* Per-process walker configuration (agent/python/ fills it from the version's layout). Offsets of -1 mark
 * fields the version does not have. */
struct py_proc {
    __u64 runtime;     /* address of _PyRuntime */
    __u32 version;     /* major << 8 | minor */
    __s32 tid_offset;  /* 3.10: kernel tid inside glibc's struct pthread; -1 otherwise */
    __s32 runtime_interp_head;
    __s32 interp_tstate_head;
    __s32 tstate_next;
    __s32 tstate_thread_id;
    __s32 tstate_native_thread_id;
    __s32 tstate_frame;
    __s32 cframe_current_frame;
    __s32 frame_code;
    __s32 frame_back;
    __s32 frame_instr;
    __s32 frame_owner;
    __s32 frame_is_entry;
    __u32 frame_read;  /* bytes of a frame to read at once: covers every frame field above (<= 128) */
    __u32 pad;
};

/* Built in a per-CPU buffer and copied to the ring buffer only as long as it is used: a header, then
 * user_len/8 user addresses, kern_len/8 kernel addresses (both leaf first) and py_count Python frames
 * (newest first), packed one after the other in data[]. */
struct sample_rec {
    __u32 kind;        /* REC_SAMPLE */
    __u32 cpu;
    __u64 time_ns;     /* bpf_ktime_get_ns(), CLOCK_MONOTONIC */
    __u32 pid;         /* tgid */
    __u32 tid;
    __s32 user_len;    /* bytes of user addresses in data[], or a negative errno */
    __s32 kern_len;    /* bytes of kernel addresses in data[], or a negative errno */
    char comm[AIFLAME_COMM_LEN];
    __u32 py_count;    /* Python frames in data[] */
    __u32 py_flags;    /* PY_* */
    __u32 unwind;      /* how the user stack was walked: UW_STOP_* | UW_USED_FP (bpf/unwind.h); 0: frame pointers */
    __u32 pad;
    __u64 data[AIFLAME_SAMPLE_WORDS];
};

/* The end of a block whose REC_OFFCPU sample_rec went out earlier (the agent pairs them by tid and out_ns). */
struct offcpu_end_rec {
    __u32 kind;        /* REC_OFFCPU_END */
    __u32 cpu;
    __u64 time_ns;     /* when the block ended: the thread's wakeup (else when it ran again) */
    __u32 pid;
    __u32 tid;
    __u64 out_ns;      /* when it blocked: the time_ns of its REC_OFFCPU record */
};

struct proc_rec {
    __u32 kind;        /* REC_FORK, REC_EXEC or REC_EXIT */
    __u32 cpu;
    __u64 time_ns;
    __u32 pid;         /* the process (fork: the parent's tgid) */
    __u32 child;       /* fork: the new task's id; otherwise 0 */
    char comm[AIFLAME_COMM_LEN];
};


/* Runtime probes (bpf/runtime_probes.bpf.c). A probe's arguments are the sources 0-5 (rdi, rsi, rdx, rcx, r8,
 * r9), 6 (the stack pointer at entry) and 7 (the return address, read at sp); 8-11 are the results of earlier
 * derefs of the same probe, so pointer chains can be followed. */
#define AIFLAME_MAX_PROBES 256
#define AIFLAME_PROBE_ARGS 8
#define AIFLAME_PROBE_DEREFS 4
#define AIFLAME_CALL_STR 128
#define AIFLAME_PATH_LEN 256

#define PROBE_STACK 1   /* capture the caller's user and Python stack */
#define PROBE_STR 2     /* read a NUL-terminated string at source str_src */
#define PROBE_OUT 4     /* at return, read the u64 the call wrote at its entry argument out_arg */
#define PROBE_STOP 8    /* stop the process (SIGSTOP) and wake the agent, which continues it (e.g. at exit()) */
#define PROBE_REGS 16   /* args[0-5] hold the registers regs[] names instead (USDT probes: any register) */
#define PROBE_RET 32    /* the call has a return probe (with session links: when its entry run asks for it) */
/* Launches: past one record every AIFLAME_CALL_INTERVAL_NS per CPU (a burst of 64) a call is only counted, per (process, probe,
 * args[sample_arg]) in call_skipped, and the next record kept for that key carries the count in `calls`: every
 * call is counted, per kernel, and the stacks kept stand for the calls around them. */
#define PROBE_SAMPLE 64
/* with PROBE_STOP: only when the process opened a shared object since its last such stop (the loader's
 * _dl_debug_state: its mappings are complete, nothing of them has run yet) */
#define PROBE_IF_OPENED 128
#define AIFLAME_PROBE_REGS 6

struct probe_spec {
    __u32 flags;       /* PROBE_* */
    __s16 src[AIFLAME_PROBE_DEREFS];   /* deref i reads 8 bytes at (source src[i]) + off[i]; -1 = unused */
    __s32 off[AIFLAME_PROBE_DEREFS];
    __s16 str_src;
    __s16 out_arg;
    /* PROBE_REGS: args[i] = register regs[i] (0-15: rax rbx rcx rdx rsi rdi rbp rsp r8-r15), -1 = 0 */
    __s16 regs[AIFLAME_PROBE_REGS];
    __s16 sample_arg;  /* PROBE_SAMPLE: the argument (0-7) that names what is launched (the kernel) */
    __s16 pad;
};

/* Header, then user_len/8 user addresses (leaf first) and py_count Python frames (2 words each) in data[]. */
struct call_rec {
    __u32 kind;        /* REC_CALL */
    __u32 cpu;
    __u64 time_ns;
    __u32 pid;
    __u32 tid;
    __u32 probe;       /* index into the agent's probe list */
    __s32 user_len;    /* bytes of user addresses in data[], or a negative errno; 0 without PROBE_STACK */
    __u64 args[AIFLAME_PROBE_ARGS];
    __u64 deref[AIFLAME_PROBE_DEREFS];
    __u32 deref_ok;    /* bit i: deref i succeeded */
    __u32 py_count;
    __u32 py_flags;
    __s32 str_len;     /* bytes read incl. NUL, or a negative errno (the agent reads /proc/PID/mem then) */
    __u32 calls;       /* calls this record stands for: 1, or 1 + those of its key counted without a record */
    __u32 pad;
    char str[AIFLAME_CALL_STR];
    __u64 data[AIFLAME_SAMPLE_WORDS];
};

struct ret_rec {
    __u32 kind;        /* REC_RET */
    __u32 cpu;
    __u64 time_ns;
    __u32 pid;
    __u32 tid;
    __u32 probe;
    __u32 out_ok;      /* the out value could be read */
    __u64 ret;         /* rax */
    __u64 out;
};

struct open_rec {
    __u32 kind;        /* REC_OPEN */
    __u32 cpu;
    __u64 time_ns;
    __u32 pid;
    __u32 tid;
    char path[AIFLAME_PATH_LEN];
};

#endif
