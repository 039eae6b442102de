/* Record layouts shared by every aiflame BPF program and the agent (agent/records.py mirrors them;
 * tests/integration/test_records_layout.py proves the two agree). Raw values only: user space symbolizes. */
#ifndef AIFLAME_H
#define AIFLAME_H

#define AIFLAME_MAX_STACK 127
#define AIFLAME_COMM_LEN 16

enum aiflame_rec_kind {
    REC_SAMPLE = 1,
    REC_FORK = 2,
    REC_EXEC = 3,
    REC_EXIT = 4,
};

/* Counters kept per CPU; the agent sums them and reports each one. */
enum aiflame_counter {
    CNT_SAMPLES = 0,      /* samples of target threads seen by the program */
    CNT_LOST = 1,         /* samples dropped: ring buffer full */
    CNT_USTACK_ERR = 2,   /* user stack lookup failed */
    CNT_KSTACK_ERR = 3,   /* kernel stack lookup failed */
    CNT_PROC_LOST = 4,    /* fork/exec/exit records dropped */
    CNT_TARGETS_FULL = 5, /* a child could not be followed: target map full */
    CNT_MAX = 8,
};

struct sample_rec {
    __u32 kind;        /* REC_SAMPLE */
    __u32 cpu;
    __u64 time_ns;     /* bpf_ktime_get_ns(), CLOCK_MONOTONIC */
    __u32 pid;         /* tgid */
    __u32 tid;
    __s32 user_len;    /* bytes of user[] filled, or a negative errno */
    __s32 kern_len;    /* bytes of kern[] filled, or a negative errno */
    char comm[AIFLAME_COMM_LEN];
    __u64 user[AIFLAME_MAX_STACK]; /* leaf first */
    __u64 kern[AIFLAME_MAX_STACK]; /* leaf first */
};

struct proc_rec {
    __u32 kind;        /* REC_FORK, REC_EXEC or REC_EXIT */
    __u32 cpu;
    __u64 time_ns;
    __u32 pid;         /* the process (fork: the parent's tgid) */
    __u32 child;       /* fork: the new task's id; otherwise 0 */
    char comm[AIFLAME_COMM_LEN];
};

#endif
