/* aiflame's in-process NVIDIA stall sampler: a CUDA injection library (CUDA_INJECTION64_PATH) that runs
 * CUPTI's PC Sampling API inside the target and streams what it collects to a file the agent reads.
 *
 * Built by the agent (agent/accel/cupti_build.py) with gcc against the CUPTI headers of NVIDIA's
 * `nvidia-cuda-cupti` wheel; it links only libc (dlopen, pthreads), and loads libcupti at run time from the
 * path the agent passes. The agent also puts it in LD_PRELOAD, so a process that loads CUDA but never reaches
 * a driver (no GPU) still says so in its stream.
 *
 * Environment (set by the agent):
 *   AIFLAME_CUPTI_DIR        directory for the streams, one file per process: cupti-<pid>.stream (required)
 *   AIFLAME_CUPTI_LIB        path of libcupti.so (default: the loader's search for libcupti.so.13)
 *   AIFLAME_CUPTI_PERIOD     sampling period exponent: one sample per SM every 2^N cycles (5..31, default 20)
 *   AIFLAME_CUPTI_HW_BUFFER  CUPTI's device-side buffer in bytes (default 64 MiB; CUPTI's own is 512 MiB)
 *   AIFLAME_CUPTI_SCRATCH    CUPTI's host scratch buffer in bytes (0: CUPTI's default, 1 MiB)
 *   AIFLAME_CUPTI_PCS        PC records fetched per cuptiPCSamplingGetData (default 4096)
 *   AIFLAME_CUPTI_DRAIN_MS   how often the worker drains the samples (default 100)
 *   AIFLAME_CUPTI_FLUSH_MS   how often the summed samples are written (default 1000; 0: every drain, unsummed)
 *   AIFLAME_CUPTI_MAX_BYTES  stream size limit; past it PC batches and cubins are dropped and counted (1 GiB)
 *
 * Safety: every failure writes an ERROR record and returns; the target then runs on, unprofiled. Nothing here
 * exits, aborts or prints to the target's stdout/stderr.
 *
 * Stream format (little-endian; symbolize/cupti_stream.py is the reader, and the two must change together):
 *   header  : "AIFLCUPT" u16 version(1) u16 header_size(24) u32 pid u64 start CLOCK_MONOTONIC ns
 *   record  : u16 type u16 flags(0) u32 payload_size, payload
 *   str     : u16 length, bytes (no NUL)
 *   1 INFO     str key, str value
 *   2 ERROR    i32 code, str stage, str message
 *   3 CONTEXT  u32 ctx, u32 device, u64 time_ns
 *   4 REASONS  u32 ctx, u32 n, n x (u32 index, str name)
 *   5 CUBIN    u32 ctx, u32 module_id, u64 crc, u64 size, size bytes
 *   6 PCS      u32 ctx, u32 n, u64 time_ns, u64 range_id, u64 total_samples, u64 dropped_samples,
 *              u64 non_user_samples, u8 hardware_buffer_full, u8 from_config_buffer, u16 0, u32 remaining_pcs,
 *              n x (u64 crc, u64 pc_offset, u32 function_index, u32 correlation_id, u32 k, str function,
 *                   k x (u32 reason_index, u32 samples))
 *   7 COUNTERS u32 n, n x (str name, u64 value)
 *   8 END      (empty): the process finished cleanly; a stream without it was cut short
 */
#define _GNU_SOURCE
#include <cupti.h>
#include <cupti_pcsampling.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

enum { REC_INFO = 1, REC_ERROR, REC_CONTEXT, REC_REASONS, REC_CUBIN, REC_PCS, REC_COUNTERS, REC_END };

#define STREAM_VERSION 1
#define HEADER_SIZE 24

/* ---------------------------------------------------------------------------------------------------------
 * Serializer: a growable byte buffer per record, written with one write() under the stream lock.
 */

typedef struct {
    uint8_t *p;
    size_t len, cap;
    int failed;
} buf_t;

static void buf_need(buf_t *b, size_t n) {
    if (b->failed || b->len + n <= b->cap)
        return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n)
        cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (!p) {
        b->failed = 1;
        return;
    }
    b->p = p;
    b->cap = cap;
}

static void put(buf_t *b, const void *v, size_t n) {
    buf_need(b, n);
    if (b->failed)
        return;
    memcpy(b->p + b->len, v, n);
    b->len += n;
}

static void put_u8(buf_t *b, uint8_t v) { put(b, &v, 1); }
static void put_u16(buf_t *b, uint16_t v) { put(b, &v, 2); }
static void put_u32(buf_t *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(buf_t *b, uint64_t v) { put(b, &v, 8); }

static void put_str(buf_t *b, const char *s) {
    size_t n = s ? strnlen(s, 65535) : 0;
    put_u16(b, (uint16_t)n);
    put(b, s, n);
}

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Drop counters, written in the COUNTERS record at the end. */
typedef struct {
    uint64_t batches_dropped;   /* PC batches not written: stream size limit or out of memory */
    uint64_t pcs_dropped;       /* PC records in those batches */
    uint64_t samples_dropped;   /* samples in those PC records */
    uint64_t cubins_dropped;    /* cubins not written: stream size limit or out of memory */
    uint64_t hw_buffer_full;    /* GetData calls that found CUPTI's hardware buffer full (samples lost) */
    uint64_t getdata_errors;    /* other failed GetData calls */
    uint64_t write_errors;      /* short or failed writes of the stream */
    uint64_t cupti_dropped;     /* CUPTI's own droppedSamples, summed */
} counters_t;

static struct {
    pthread_mutex_t mu;
    int fd;              /* -1: closed or never opened */
    pid_t pid;           /* the process the stream belongs to (a forked child must not write to it) */
    uint64_t bytes, max_bytes;
    counters_t c;
} S = {PTHREAD_MUTEX_INITIALIZER, -1, 0, 0, 1ull << 30, {0}};

static void write_all(const uint8_t *p, size_t n) {
    while (n) {
        ssize_t w = write(S.fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            S.c.write_errors++;
            return;
        }
        p += w;
        n -= (size_t)w;
    }
}

/* Emit one record (caller holds S.mu). `essential` records (errors, end, counters, tables) ignore the size
 * limit, which is there to bound the bulky ones. Returns 0 when the record was written. */
static int emit(uint16_t type, const buf_t *payload, int essential) {
    if (S.fd < 0 || getpid() != S.pid)
        return -1;
    if (payload->failed)
        return -1;
    if (!essential && S.bytes + payload->len + 8 > S.max_bytes)
        return -1;
    uint8_t hdr[8];
    uint16_t flags = 0;
    uint32_t len = (uint32_t)payload->len;
    memcpy(hdr, &type, 2);
    memcpy(hdr + 2, &flags, 2);
    memcpy(hdr + 4, &len, 4);
    write_all(hdr, 8);
    if (payload->len)
        write_all(payload->p, payload->len);
    S.bytes += 8 + payload->len;
    return 0;
}

/* Emit an essential record, taking S.mu, and free its payload. */
static void emit_essential(uint16_t type, buf_t *b) {
    pthread_mutex_lock(&S.mu);
    emit(type, b, 1);
    pthread_mutex_unlock(&S.mu);
    free(b->p);
}

/* Open the stream for this process: `path` is created fresh (never an existing file, never through a symlink:
 * the directory may be writable by others), the header written. Returns 0 on success. */
EXPORT int aiflame_cupti_stream_open(const char *path) {
    pthread_mutex_lock(&S.mu);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC, 0600);
    if (fd < 0) {
        pthread_mutex_unlock(&S.mu);
        return -1;
    }
    S.fd = fd;
    S.pid = getpid();
    S.bytes = 0;
    memset(&S.c, 0, sizeof S.c);
    buf_t b = {0};
    put(&b, "AIFLCUPT", 8);
    put_u16(&b, STREAM_VERSION);
    put_u16(&b, HEADER_SIZE);
    put_u32(&b, (uint32_t)S.pid);
    put_u64(&b, mono_ns());
    if (!b.failed)
        write_all(b.p, b.len);
    S.bytes = b.len;
    free(b.p);
    pthread_mutex_unlock(&S.mu);
    return 0;
}

EXPORT void aiflame_cupti_set_max_bytes(uint64_t max_bytes) { S.max_bytes = max_bytes; }

EXPORT void aiflame_cupti_write_info(const char *key, const char *value) {
    buf_t b = {0};
    put_str(&b, key);
    put_str(&b, value);
    emit_essential(REC_INFO, &b);
}

EXPORT void aiflame_cupti_write_error(const char *stage, int32_t code, const char *message) {
    buf_t b = {0};
    put(&b, &code, 4);
    put_str(&b, stage);
    put_str(&b, message);
    emit_essential(REC_ERROR, &b);
}

EXPORT void aiflame_cupti_write_context(uint32_t ctx, uint32_t device, uint64_t time_ns) {
    buf_t b = {0};
    put_u32(&b, ctx);
    put_u32(&b, device);
    put_u64(&b, time_ns);
    emit_essential(REC_CONTEXT, &b);
}

EXPORT void aiflame_cupti_write_reasons(uint32_t ctx, size_t n, const uint32_t *index, char *const *names) {
    buf_t b = {0};
    put_u32(&b, ctx);
    put_u32(&b, (uint32_t)n);
    for (size_t i = 0; i < n; i++) {
        put_u32(&b, index[i]);
        put_str(&b, names[i]);
    }
    emit_essential(REC_REASONS, &b);
}

EXPORT void aiflame_cupti_write_cubin(uint32_t ctx, uint32_t module_id, uint64_t crc, const void *data,
                                      size_t size) {
    buf_t b = {0};
    put_u32(&b, ctx);
    put_u32(&b, module_id);
    put_u64(&b, crc);
    put_u64(&b, (uint64_t)size);
    put(&b, data, size);
    pthread_mutex_lock(&S.mu);
    if (emit(REC_CUBIN, &b, 0) != 0)
        S.c.cubins_dropped++;
    pthread_mutex_unlock(&S.mu);
    free(b.p);
}

/* Serialize the first totalNumPcs records of a CUPTI PC sampling buffer, exactly as CUPTI filled it. */
EXPORT void aiflame_cupti_write_pcs(uint32_t ctx, uint64_t time_ns, const CUpti_PCSamplingData *d,
                                    int from_config_buffer) {
    size_t n = d->totalNumPcs;
    uint64_t samples = 0;
    buf_t b = {0};
    put_u32(&b, ctx);
    put_u32(&b, (uint32_t)n);
    put_u64(&b, time_ns);
    put_u64(&b, d->rangeId);
    put_u64(&b, d->totalSamples);
    put_u64(&b, d->droppedSamples);
    put_u64(&b, d->nonUsrKernelsTotalSamples);
    put_u8(&b, d->hardwareBufferFull);
    put_u8(&b, (uint8_t)(from_config_buffer != 0));
    put_u16(&b, 0);
    put_u32(&b, (uint32_t)d->remainingNumPcs);
    for (size_t i = 0; i < n; i++) {
        const CUpti_PCSamplingPCData *pc = &d->pPcData[i];
        put_u64(&b, pc->cubinCrc);
        put_u64(&b, pc->pcOffset);
        put_u32(&b, pc->functionIndex);
        put_u32(&b, pc->correlationId);
        put_u32(&b, (uint32_t)pc->stallReasonCount);
        put_str(&b, pc->functionName);
        for (size_t k = 0; k < pc->stallReasonCount; k++) {
            put_u32(&b, pc->stallReason[k].pcSamplingStallReasonIndex);
            put_u32(&b, pc->stallReason[k].samples);
            samples += pc->stallReason[k].samples;
        }
    }
    pthread_mutex_lock(&S.mu);
    S.c.cupti_dropped += d->droppedSamples;
    if (emit(REC_PCS, &b, 0) != 0) {
        S.c.batches_dropped++;
        S.c.pcs_dropped += n;
        S.c.samples_dropped += samples;
    }
    pthread_mutex_unlock(&S.mu);
    free(b.p);
}

static void count_locked(uint64_t *field) {
    pthread_mutex_lock(&S.mu);
    (*field)++;
    pthread_mutex_unlock(&S.mu);
}

/* ---------------------------------------------------------------------------------------------------------
 * Accumulator: CUPTI hands the same hot PCs over at every drain (every 100 ms), so each drain's records are summed
 * here per (cubin CRC, pc offset, function index, correlation id) and written as one PCS record every flush
 * interval: a training job's stream grows by the PCs it runs, not by 10 copies a second of them (at 2^20 cycles
 * an H100 GPT loop wrote 8.5 MB/s of per-drain records, reaching the 1 GiB stream cap in two minutes).
 * Function names are CUPTI's strings, which live until sampling ends (remember_name). A table that cannot take a
 * record is written out first; one that cannot be allocated leaves the records written as they come.
 */

#define ACC_REASONS 64
#define ACC_CAP 16384 /* slots; written out when 3/4 full */

typedef struct {
    uint64_t crc, off;
    uint32_t fidx, corr;
    char *name;
    uint32_t n, used;                          /* reasons held; used: the slot is taken */
    CUpti_PCSamplingStallReason r[ACC_REASONS];
} acc_pc;

typedef struct {
    acc_pc *slot;
    size_t len;
    uint64_t first_ns, total, dropped, non_user;
    uint8_t hw_full;
    int failed;
} pc_acc;

static size_t acc_hash(uint64_t crc, uint64_t off, uint32_t fidx, uint32_t corr) {
    uint64_t h = crc * 0x9E3779B97F4A7C15ull ^ (off >> 4) * 0xC2B2AE3D27D4EB4Full ^ ((uint64_t)fidx << 32 | corr);
    h ^= h >> 29;
    return (size_t)(h & (ACC_CAP - 1));
}

/* Write what `a` holds as one PCS record (the batch fields summed) and empty it. */
static void acc_flush(pc_acc *a, uint32_t ctx, uint64_t time_ns) {
    if (!a->slot || (!a->len && !a->dropped))
        return;
    CUpti_PCSamplingPCData *pcs = calloc(a->len ? a->len : 1, sizeof *pcs);
    CUpti_PCSamplingData d;
    memset(&d, 0, sizeof d);
    d.size = sizeof d;
    d.totalSamples = a->total;
    d.droppedSamples = a->dropped;
    d.nonUsrKernelsTotalSamples = a->non_user;
    d.hardwareBufferFull = a->hw_full;
    d.pPcData = pcs;
    size_t k = 0;
    for (size_t i = 0; pcs && i < ACC_CAP; i++) {
        acc_pc *e = &a->slot[i];
        if (!e->used)
            continue;
        pcs[k].size = sizeof pcs[k];
        pcs[k].cubinCrc = e->crc;
        pcs[k].pcOffset = e->off;
        pcs[k].functionIndex = e->fidx;
        pcs[k].correlationId = e->corr;
        pcs[k].functionName = e->name;
        pcs[k].stallReasonCount = e->n;
        pcs[k].stallReason = e->r;
        k++;
    }
    d.totalNumPcs = k;
    if (pcs) {
        aiflame_cupti_write_pcs(ctx, a->first_ns ? a->first_ns : time_ns, &d, 0);
    } else { /* counted as a record the stream could not take (aiflame_cupti_write_pcs) */
        pthread_mutex_lock(&S.mu);
        S.c.batches_dropped++;
        S.c.pcs_dropped += a->len;
        S.c.samples_dropped += a->total;
        pthread_mutex_unlock(&S.mu);
    }
    free(pcs);
    memset(a->slot, 0, ACC_CAP * sizeof *a->slot);
    a->len = 0;
    a->first_ns = a->total = a->dropped = a->non_user = 0;
    a->hw_full = 0;
}

/* Sum one drain's records into `a` (writing `a` out first when it is too full); 0, or -1 when `a` cannot be
 * used (then the caller writes the records as they are). */
static int acc_add(pc_acc *a, uint32_t ctx, uint64_t time_ns, const CUpti_PCSamplingData *d) {
    if (a->failed)
        return -1;
    if (!a->slot && !(a->slot = calloc(ACC_CAP, sizeof *a->slot))) {
        a->failed = 1;
        return -1;
    }
    if ((a->len + d->totalNumPcs) * 4 > ACC_CAP * 3)
        acc_flush(a, ctx, time_ns);
    if (d->totalNumPcs * 4 > ACC_CAP * 3)
        return -1; /* more PCs in one drain than the table takes: written as they are */
    if (!a->first_ns)
        a->first_ns = time_ns;
    a->total += d->totalSamples;
    a->dropped += d->droppedSamples;
    a->non_user += d->nonUsrKernelsTotalSamples;
    a->hw_full |= d->hardwareBufferFull;
    for (size_t i = 0; i < d->totalNumPcs; i++) {
        const CUpti_PCSamplingPCData *pc = &d->pPcData[i];
        size_t h = acc_hash(pc->cubinCrc, pc->pcOffset, pc->functionIndex, pc->correlationId);
        acc_pc *e = &a->slot[h];
        while (e->used && !(e->crc == pc->cubinCrc && e->off == pc->pcOffset && e->fidx == pc->functionIndex &&
                            e->corr == pc->correlationId)) {
            h = (h + 1) & (ACC_CAP - 1);
            e = &a->slot[h];
        }
        if (!e->used) {
            e->used = 1;
            e->crc = pc->cubinCrc;
            e->off = pc->pcOffset;
            e->fidx = pc->functionIndex;
            e->corr = pc->correlationId;
            e->name = pc->functionName;
            a->len++;
        }
        for (size_t k = 0; k < pc->stallReasonCount; k++) {
            uint32_t idx = pc->stallReason[k].pcSamplingStallReasonIndex;
            size_t j = 0;
            while (j < e->n && e->r[j].pcSamplingStallReasonIndex != idx)
                j++;
            if (j == e->n) {
                if (e->n == ACC_REASONS) {
                    count_locked(&S.c.samples_dropped); /* never seen: CUPTI has fewer reasons than this */
                    continue;
                }
                e->r[e->n].pcSamplingStallReasonIndex = idx;
                e->r[e->n].samples = 0;
                e->n++;
            }
            e->r[j].samples += pc->stallReason[k].samples;
        }
    }
    return 0;
}

/* The tests' way in (tests/programs/cupti_stream_driver.c): one accumulator, as a context has. */
static pc_acc test_acc;
EXPORT int aiflame_cupti_acc_add(uint32_t ctx, uint64_t time_ns, const CUpti_PCSamplingData *d) {
    return acc_add(&test_acc, ctx, time_ns, d);
}
EXPORT void aiflame_cupti_acc_flush(uint32_t ctx, uint64_t time_ns) { acc_flush(&test_acc, ctx, time_ns); }


/* Write the drop counters and the END record, and close the stream. */
EXPORT void aiflame_cupti_stream_close(void) {
    pthread_mutex_lock(&S.mu);
    if (S.fd >= 0 && getpid() == S.pid) {
        const struct { const char *name; uint64_t v; } cs[] = {
            {"batches_dropped", S.c.batches_dropped}, {"pcs_dropped", S.c.pcs_dropped},
            {"samples_dropped", S.c.samples_dropped}, {"cubins_dropped", S.c.cubins_dropped},
            {"hw_buffer_full", S.c.hw_buffer_full},   {"getdata_errors", S.c.getdata_errors},
            {"cupti_dropped_samples", S.c.cupti_dropped}, {"write_errors", S.c.write_errors},
        };
        buf_t b = {0};
        put_u32(&b, (uint32_t)(sizeof cs / sizeof cs[0]));
        for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
            put_str(&b, cs[i].name);
            put_u64(&b, cs[i].v);
        }
        emit(REC_COUNTERS, &b, 1);
        free(b.p);
        buf_t end = {0};
        emit(REC_END, &end, 1);
        close(S.fd);
    }
    S.fd = -1;
    pthread_mutex_unlock(&S.mu);
}

/* ---------------------------------------------------------------------------------------------------------
 * CUPTI, loaded with dlopen.
 */

typedef CUptiResult (*subscribe_fn)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *);
typedef CUptiResult (*enable_domain_fn)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain);
typedef CUptiResult (*result_string_fn)(CUptiResult, const char **);
typedef CUptiResult (*ctx_id_fn)(CUcontext, uint32_t *);
typedef CUptiResult (*version_fn)(uint32_t *);

static struct {
    subscribe_fn subscribe;
    enable_domain_fn enable_domain;
    result_string_fn result_string;
    ctx_id_fn context_id, device_id;
    version_fn get_version;
    CUptiResult (*get_num_reasons)(CUpti_PCSamplingGetNumStallReasonsParams *);
    CUptiResult (*get_reasons)(CUpti_PCSamplingGetStallReasonsParams *);
    CUptiResult (*set_config)(CUpti_PCSamplingConfigurationInfoParams *);
    CUptiResult (*enable)(CUpti_PCSamplingEnableParams *);
    CUptiResult (*disable)(CUpti_PCSamplingDisableParams *);
    CUptiResult (*get_data)(CUpti_PCSamplingGetDataParams *);
    CUptiResult (*cubin_crc)(CUpti_GetCubinCrcParams *);
} C;

static struct {
    uint32_t period;
    size_t hw_buffer, scratch, pcs;
    unsigned drain_ms, flush_ms;
} cfg = {20, 64u << 20, 0, 4096, 100, 1000};

/* One CUDA context being sampled. */
typedef struct ctx_state {
    CUcontext ctx;
    uint32_t id, device;
    int enabled;
    size_t num_reasons;
    uint32_t *reason_index;
    char **reason_names;
    CUpti_PCSamplingData config_buf; /* CUPTI fills it at module unload/load and at Disable */
    CUpti_PCSamplingData data_buf;   /* what GetData fills */
    pc_acc acc;                      /* drains summed until the next flush */
    struct ctx_state *next;
} ctx_state;

/* All CUPTI PC sampling calls and the context list are serialized by this lock (callbacks run on the
 * application's threads, the drain on our worker). */
static pthread_mutex_t cupti_mu = PTHREAD_MUTEX_INITIALIZER;
static ctx_state *contexts;
static int injected;         /* InitializeInjection ran in this process */
static pid_t owner_pid;      /* the process that set things up */
static pthread_t worker;
static int worker_started, worker_stop;
static pthread_cond_t worker_cv = PTHREAD_COND_INITIALIZER;

/* Function-name strings CUPTI allocated: they may be shared between records and batches, so they are freed
 * only once sampling has ended (an open-addressing set of pointers). */
static void **names_seen;
static size_t names_cap, names_len;

static void remember_name(void *p) {
    if (!p)
        return;
    if ((names_len + 1) * 2 > names_cap) {
        size_t cap = names_cap ? names_cap * 2 : 1024;
        void **t = calloc(cap, sizeof *t);
        if (!t)
            return; /* leak rather than risk a double free */
        for (size_t i = 0; i < names_cap; i++) {
            if (!names_seen[i])
                continue;
            size_t h = ((uintptr_t)names_seen[i] >> 4) & (cap - 1);
            while (t[h])
                h = (h + 1) & (cap - 1);
            t[h] = names_seen[i];
        }
        free(names_seen);
        names_seen = t;
        names_cap = cap;
    }
    size_t h = ((uintptr_t)p >> 4) & (names_cap - 1);
    while (names_seen[h]) {
        if (names_seen[h] == p)
            return;
        h = (h + 1) & (names_cap - 1);
    }
    names_seen[h] = p;
    names_len++;
}

static void cupti_error(const char *stage, CUptiResult r) {
    const char *s = NULL;
    char msg[64];
    if (!C.result_string || C.result_string(r, &s) != CUPTI_SUCCESS || !s) {
        /* CUPTI cannot name its own errors before it has a driver (e.g. 999 with no GPU). */
        snprintf(msg, sizeof msg, "CUPTI error %d%s", (int)r, r == CUPTI_ERROR_UNKNOWN ? " (unknown)" : "");
        s = msg;
    }
    aiflame_cupti_write_error(stage, (int32_t)r, s);
}

static int alloc_pc_buffer(CUpti_PCSamplingData *d, size_t pcs, size_t reasons) {
    memset(d, 0, sizeof *d);
    d->size = sizeof(CUpti_PCSamplingData);
    d->collectNumPcs = pcs;
    d->pPcData = calloc(pcs, sizeof(CUpti_PCSamplingPCData));
    if (!d->pPcData)
        return -1;
    for (size_t i = 0; i < pcs; i++) {
        d->pPcData[i].size = sizeof(CUpti_PCSamplingPCData);
        d->pPcData[i].stallReason = calloc(reasons ? reasons : 1, sizeof(CUpti_PCSamplingStallReason));
        if (!d->pPcData[i].stallReason)
            return -1;
    }
    return 0;
}

/* Write out what a buffer holds and make it reusable (caller holds cupti_mu). */
static void flush_buffer(ctx_state *s, CUpti_PCSamplingData *d, int from_config) {
    if (d->totalNumPcs == 0 && d->droppedSamples == 0)
        return;
    uint64_t now = mono_ns();
    if (cfg.flush_ms == 0 || acc_add(&s->acc, s->id, now, d) != 0)
        aiflame_cupti_write_pcs(s->id, now, d, from_config);
    for (size_t i = 0; i < d->totalNumPcs; i++)
        remember_name(d->pPcData[i].functionName);
    d->totalNumPcs = 0;
    d->remainingNumPcs = 0;
    d->totalSamples = d->droppedSamples = d->nonUsrKernelsTotalSamples = 0;
    d->hardwareBufferFull = 0;
}

/* Fetch everything CUPTI holds for a context (caller holds cupti_mu). */
static void drain(ctx_state *s) {
    if (!s->enabled)
        return;
    flush_buffer(s, &s->config_buf, 1);
    for (int round = 0; round < 64; round++) {
        CUpti_PCSamplingGetDataParams p = {0};
        p.size = CUpti_PCSamplingGetDataParamsSize;
        p.ctx = s->ctx;
        p.pcSamplingData = &s->data_buf;
        CUptiResult r = C.get_data(&p);
        if (r == CUPTI_ERROR_OUT_OF_MEMORY) {
            count_locked(&S.c.hw_buffer_full);
        } else if (r != CUPTI_SUCCESS) {
            count_locked(&S.c.getdata_errors);
            if (S.c.getdata_errors <= 3)
                cupti_error("cuptiPCSamplingGetData", r);
            break;
        }
        size_t remaining = s->data_buf.remainingNumPcs;
        flush_buffer(s, &s->data_buf, 0);
        if (remaining == 0 || r != CUPTI_SUCCESS)
            break;
    }
}

static void disable(ctx_state *s) {
    if (!s->enabled)
        return;
    drain(s);
    CUpti_PCSamplingDisableParams p = {0};
    p.size = CUpti_PCSamplingDisableParamsSize;
    p.ctx = s->ctx;
    CUptiResult r = C.disable(&p);
    if (r != CUPTI_SUCCESS)
        cupti_error("cuptiPCSamplingDisable", r);
    flush_buffer(s, &s->config_buf, 1); /* Disable copies the last records into the configured buffer */
    acc_flush(&s->acc, s->id, mono_ns());
    s->enabled = 0;
}

static void *worker_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&cupti_mu);
    while (!worker_stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)cfg.drain_ms * 1000000ull;
        ts.tv_sec += (time_t)(ns / 1000000000ull);
        ts.tv_nsec = (long)(ns % 1000000000ull);
        pthread_cond_timedwait(&worker_cv, &cupti_mu, &ts);
        if (worker_stop)
            break;
        for (ctx_state *s = contexts; s; s = s->next) {
            drain(s);
            uint64_t now = mono_ns();
            if (s->acc.first_ns && now - s->acc.first_ns >= (uint64_t)cfg.flush_ms * 1000000ull)
                acc_flush(&s->acc, s->id, now);
        }
    }
    pthread_mutex_unlock(&cupti_mu);
    return NULL;
}

static ctx_state *find_ctx(CUcontext ctx) {
    for (ctx_state *s = contexts; s; s = s->next)
        if (s->ctx == ctx)
            return s;
    return NULL;
}

static void on_context_created(CUcontext ctx) {
    ctx_state *s = calloc(1, sizeof *s);
    if (!s)
        return;
    s->ctx = ctx;
    if (C.context_id(ctx, &s->id) != CUPTI_SUCCESS)
        s->id = 0;
    if (C.device_id(ctx, &s->device) != CUPTI_SUCCESS)
        s->device = UINT32_MAX;
    aiflame_cupti_write_context(s->id, s->device, mono_ns());

    CUpti_PCSamplingEnableParams ep = {0};
    ep.size = CUpti_PCSamplingEnableParamsSize;
    ep.ctx = ctx;
    CUptiResult r = C.enable(&ep);
    if (r != CUPTI_SUCCESS) {
        cupti_error("cuptiPCSamplingEnable", r); /* e.g. compute capability < 7.0: this context runs unsampled */
        free(s);
        return;
    }
    /* Stall reason names are read at run time: they differ between GPU generations. */
    CUpti_PCSamplingGetNumStallReasonsParams np = {0};
    np.size = CUpti_PCSamplingGetNumStallReasonsParamsSize;
    np.ctx = ctx;
    np.numStallReasons = &s->num_reasons;
    r = C.get_num_reasons(&np);
    if (r == CUPTI_SUCCESS) {
        s->reason_index = calloc(s->num_reasons ? s->num_reasons : 1, sizeof *s->reason_index);
        s->reason_names = calloc(s->num_reasons ? s->num_reasons : 1, sizeof *s->reason_names);
        for (size_t i = 0; s->reason_names && i < s->num_reasons; i++)
            s->reason_names[i] = calloc(1, CUPTI_STALL_REASON_STRING_SIZE);
        CUpti_PCSamplingGetStallReasonsParams rp = {0};
        rp.size = CUpti_PCSamplingGetStallReasonsParamsSize;
        rp.ctx = ctx;
        rp.numStallReasons = s->num_reasons;
        rp.stallReasonIndex = s->reason_index;
        rp.stallReasons = s->reason_names;
        r = (s->reason_index && s->reason_names) ? C.get_reasons(&rp) : CUPTI_ERROR_OUT_OF_MEMORY;
    }
    if (r != CUPTI_SUCCESS) {
        cupti_error("cuptiPCSamplingGetStallReasons", r);
        goto fail;
    }
    aiflame_cupti_write_reasons(s->id, s->num_reasons, s->reason_index, s->reason_names);
    if (alloc_pc_buffer(&s->config_buf, cfg.pcs, s->num_reasons) || alloc_pc_buffer(&s->data_buf, cfg.pcs, s->num_reasons)) {
        aiflame_cupti_write_error("allocate", ENOMEM, "cannot allocate the PC sampling buffers");
        goto fail;
    }

    CUpti_PCSamplingConfigurationInfo a[8];
    size_t n = 0;
    memset(a, 0, sizeof a);
    a[n].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_SAMPLING_PERIOD;
    a[n++].attributeData.samplingPeriodData.samplingPeriod = cfg.period;
    a[n].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_STALL_REASON;
    a[n].attributeData.stallReasonData.stallReasonCount = s->num_reasons;
    a[n++].attributeData.stallReasonData.pStallReasonIndex = s->reason_index;
    a[n].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_HARDWARE_BUFFER_SIZE;
    a[n++].attributeData.hardwareBufferSizeData.hardwareBufferSize = cfg.hw_buffer;
    if (cfg.scratch) {
        a[n].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_SCRATCH_BUFFER_SIZE;
        a[n++].attributeData.scratchBufferSizeData.scratchBufferSize = cfg.scratch;
    }
    /* Continuous mode: kernels are not serialized, so the target's timing is left alone; no correlation ids. */
    a[n].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_COLLECTION_MODE;
    a[n++].attributeData.collectionModeData.collectionMode = CUPTI_PC_SAMPLING_COLLECTION_MODE_CONTINUOUS;
    /* No start/stop control: sampling runs from Enable to Disable (cuptiPCSamplingStart is then not used). */
    a[n].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_ENABLE_START_STOP_CONTROL;
    a[n++].attributeData.enableStartStopControlData.enableStartStopControl = 0;
    a[n].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_OUTPUT_DATA_FORMAT;
    a[n++].attributeData.outputDataFormatData.outputDataFormat = CUPTI_PC_SAMPLING_OUTPUT_DATA_FORMAT_PARSED;
    a[n].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_SAMPLING_DATA_BUFFER;
    a[n++].attributeData.samplingDataBufferData.samplingDataBuffer = &s->config_buf;
    CUpti_PCSamplingConfigurationInfoParams cp = {0};
    cp.size = CUpti_PCSamplingConfigurationInfoParamsSize;
    cp.ctx = ctx;
    cp.numAttributes = n;
    cp.pPCSamplingConfigurationInfo = a;
    r = C.set_config(&cp);
    if (r != CUPTI_SUCCESS) {
        for (size_t i = 0; i < n; i++)
            if (a[i].attributeStatus != CUPTI_SUCCESS) {
                char stage[96];
                snprintf(stage, sizeof stage, "cuptiPCSamplingSetConfigurationAttribute(attribute %d)",
                         (int)a[i].attributeType);
                cupti_error(stage, a[i].attributeStatus);
            }
        cupti_error("cuptiPCSamplingSetConfigurationAttribute", r);
        goto fail;
    }
    s->enabled = 1;
    s->next = contexts;
    contexts = s;
    if (!worker_started && pthread_create(&worker, NULL, worker_main, NULL) == 0)
        worker_started = 1;
    return;
fail: {
    CUpti_PCSamplingDisableParams dp = {0};
    dp.size = CUpti_PCSamplingDisableParamsSize;
    dp.ctx = ctx;
    C.disable(&dp);
    /* The buffers stay allocated: CUPTI may still hold the configured pointer. */
}
}

static void on_module_loaded(CUcontext ctx, const CUpti_ModuleResourceData *m) {
    ctx_state *s = find_ctx(ctx);
    if (m && m->pCubin && m->cubinSize) {
        CUpti_GetCubinCrcParams p = {0};
        p.size = CUpti_GetCubinCrcParamsSize;
        p.cubinSize = m->cubinSize;
        p.cubin = m->pCubin;
        CUptiResult r = C.cubin_crc(&p);
        if (r == CUPTI_SUCCESS)
            /* The bytes are valid only inside this callback: copy them out now. */
            aiflame_cupti_write_cubin(s ? s->id : 0, m->moduleId, p.cubinCrc, m->pCubin, m->cubinSize);
        else
            cupti_error("cuptiGetCubinCrc", r);
    }
    if (s)
        flush_buffer(s, &s->config_buf, 1); /* after an unload/load, CUPTI flushed into the configured buffer */
}

static void CUPTIAPI on_callback(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                                 const void *cbdata) {
    (void)userdata;
    if (domain != CUPTI_CB_DOMAIN_RESOURCE || getpid() != owner_pid)
        return;
    const CUpti_ResourceData *rd = cbdata;
    pthread_mutex_lock(&cupti_mu);
    ctx_state *s;
    switch (cbid) {
    case CUPTI_CBID_RESOURCE_CONTEXT_CREATED:
        on_context_created(rd->context);
        break;
    case CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING:
        if ((s = find_ctx(rd->context)))
            disable(s);
        break;
    case CUPTI_CBID_RESOURCE_MODULE_LOADED:
        on_module_loaded(rd->context, rd->resourceDescriptor);
        break;
    case CUPTI_CBID_RESOURCE_MODULE_UNLOAD_STARTING:
        /* Required before a module's PCs can be reused by another (CUPTI's rule for continuous mode). */
        if ((s = find_ctx(rd->context)))
            drain(s);
        break;
    default:
        break;
    }
    pthread_mutex_unlock(&cupti_mu);
}

static void at_exit(void) {
    if (getpid() != owner_pid)
        return;
    pthread_mutex_lock(&cupti_mu);
    worker_stop = 1;
    pthread_cond_signal(&worker_cv);
    pthread_mutex_unlock(&cupti_mu);
    if (worker_started)
        pthread_join(worker, NULL);
    pthread_mutex_lock(&cupti_mu);
    for (ctx_state *s = contexts; s; s = s->next)
        disable(s);
    for (size_t i = 0; i < names_cap; i++)
        free(names_seen[i]);
    names_len = 0;
    pthread_mutex_unlock(&cupti_mu);
    aiflame_cupti_stream_close();
}

static uint64_t env_u64(const char *name, uint64_t dflt, uint64_t lo, uint64_t hi) {
    const char *v = getenv(name);
    if (!v || !*v)
        return dflt;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 0);
    if (errno || *end || x < lo || x > hi) {
        char msg[160];
        snprintf(msg, sizeof msg, "%s=%.40s is not in [%llu, %llu]: using %llu", name, v,
                 (unsigned long long)lo, (unsigned long long)hi, (unsigned long long)dflt);
        aiflame_cupti_write_error("config", EINVAL, msg);
        return dflt;
    }
    return x;
}

/* Open this process's stream once (from the preload constructor or the driver's call, whichever is first). */
static int ensure_stream(void) {
    if (S.fd >= 0 && S.pid == getpid())
        return 0;
    const char *dir = getenv("AIFLAME_CUPTI_DIR");
    if (!dir || !*dir)
        return -1;
    char path[4096];
    snprintf(path, sizeof path, "%s/cupti-%d.stream", dir, (int)getpid());
    if (aiflame_cupti_stream_open(path) == 0)
        return 0;
    /* The name is taken (a stream of an earlier process with this pid, or something planted): a fresh one. */
    for (int i = 1; i < 8 && errno == EEXIST; i++) {
        snprintf(path, sizeof path, "%s/cupti-%d.%d.stream", dir, (int)getpid(), i);
        if (aiflame_cupti_stream_open(path) == 0)
            return 0;
    }
    return -1;
}

#define LOAD(field, sym)                                                                                   \
    do {                                                                                                   \
        *(void **)&C.field = dlsym(lib, sym);                                                              \
        if (!C.field) {                                                                                    \
            aiflame_cupti_write_error("dlsym", 0, sym);                                                    \
            return -1;                                                                                     \
        }                                                                                                  \
    } while (0)

/* Load CUPTI and subscribe; 0 when sampling is set up (the rest happens in the callbacks). */
static int setup(void) {
    aiflame_cupti_set_max_bytes(env_u64("AIFLAME_CUPTI_MAX_BYTES", 1ull << 30, 1u << 20, 1ull << 40));
    cfg.period = (uint32_t)env_u64("AIFLAME_CUPTI_PERIOD", cfg.period, 5, 31);
    cfg.hw_buffer = (size_t)env_u64("AIFLAME_CUPTI_HW_BUFFER", cfg.hw_buffer, 1u << 20, 1ull << 34);
    cfg.scratch = (size_t)env_u64("AIFLAME_CUPTI_SCRATCH", cfg.scratch, 0, 1ull << 32);
    cfg.pcs = (size_t)env_u64("AIFLAME_CUPTI_PCS", cfg.pcs, 16, 1u << 20);
    cfg.drain_ms = (unsigned)env_u64("AIFLAME_CUPTI_DRAIN_MS", cfg.drain_ms, 1, 60000);
    cfg.flush_ms = (unsigned)env_u64("AIFLAME_CUPTI_FLUSH_MS", cfg.flush_ms, 0, 600000);
    const char *path = getenv("AIFLAME_CUPTI_LIB");
    void *lib = dlopen(path && *path ? path : "libcupti.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        aiflame_cupti_write_error("dlopen", 0, e ? e : "cannot load libcupti");
        return -1;
    }
    LOAD(subscribe, "cuptiSubscribe");
    LOAD(enable_domain, "cuptiEnableDomain");
    LOAD(result_string, "cuptiGetResultString");
    LOAD(context_id, "cuptiGetContextId");
    LOAD(device_id, "cuptiGetDeviceId");
    LOAD(get_version, "cuptiGetVersion");
    LOAD(get_num_reasons, "cuptiPCSamplingGetNumStallReasons");
    LOAD(get_reasons, "cuptiPCSamplingGetStallReasons");
    LOAD(set_config, "cuptiPCSamplingSetConfigurationAttribute");
    LOAD(enable, "cuptiPCSamplingEnable");
    LOAD(disable, "cuptiPCSamplingDisable");
    LOAD(get_data, "cuptiPCSamplingGetData");
    LOAD(cubin_crc, "cuptiGetCubinCrc");
    uint32_t version = 0;
    char v[32];
    if (C.get_version(&version) == CUPTI_SUCCESS) {
        snprintf(v, sizeof v, "%u", version);
        aiflame_cupti_write_info("cupti_api_version", v);
    }
    snprintf(v, sizeof v, "%u", cfg.period);
    aiflame_cupti_write_info("sampling_period_log2", v);
    CUpti_SubscriberHandle sub;
    CUptiResult r = C.subscribe(&sub, on_callback, NULL);
    if (r != CUPTI_SUCCESS) {
        cupti_error("cuptiSubscribe", r); /* e.g. another tool (Nsight) already subscribed */
        return -1;
    }
    r = C.enable_domain(1, sub, CUPTI_CB_DOMAIN_RESOURCE);
    if (r != CUPTI_SUCCESS) {
        cupti_error("cuptiEnableDomain", r);
        return -1;
    }
    atexit(at_exit);
    aiflame_cupti_write_info("state", "subscribed");
    return 0;
}

static int initialize(void) {
    owner_pid = getpid();
    if (ensure_stream() != 0)
        return 1; /* nowhere to report to: stay out of the way */
    injected = 1;
    if (setup() != 0)
        aiflame_cupti_stream_close(); /* the stream is complete: the error record says why nothing follows */
    return 1;
}

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static int init_result = 1;
static void init_once_fn(void) { init_result = initialize(); }

/* Called by the CUDA driver during cuInit when this library is named by CUDA_INJECTION64_PATH. Always
 * reports success: a failure here must not fail the application's CUDA initialization. */
EXPORT int InitializeInjection(void) {
    pthread_once(&init_once, init_once_fn);
    return init_result;
}

/* ---------------------------------------------------------------------------------------------------------
 * Preload side: when loaded through LD_PRELOAD, say at exit if this process loaded CUDA but the driver never
 * called InitializeInjection (no NVIDIA driver or no GPU), so the agent can tell the user.
 */

static pid_t preload_pid;

static int find_cuda(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    const char *slash = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    const char *base = slash ? slash + 1 : info->dlpi_name;
    if (base && (!strncmp(base, "libcudart.so", 12) || !strncmp(base, "libcuda.so", 10))) {
        *(const char **)data = base;
        return 1;
    }
    return 0;
}

__attribute__((constructor)) static void preload_init(void) { preload_pid = getpid(); }

__attribute__((destructor)) static void preload_fini(void) {
    if (injected || getpid() != preload_pid || !getenv("AIFLAME_CUPTI_DIR"))
        return;
    const char *lib = NULL;
    dl_iterate_phdr(find_cuda, &lib);
    if (!lib)
        return; /* not a CUDA process: no stream at all */
    if (ensure_stream() != 0)
        return;
    char msg[256];
    snprintf(msg, sizeof msg, "%s was loaded but no CUDA driver initialized the sampler (no NVIDIA driver or no "
             "GPU in this process)", lib);
    aiflame_cupti_write_error("no_driver", 0, msg);
    aiflame_cupti_stream_close();
}
