/* The C engine of symbolize/objfmt/cfi/: the same parse, selection, interpretation and packing as its Python
 * reference (program.py, and _build_py of parse.py), step for step, so that both give identical rows, rules,
 * stats and error messages.
 * Built by fast.py on first use (cc -O2 -shared) and called through ctypes; see __init__.py for the layout.
 *
 * Errors longjmp out of the parse with one message; everything allocated is owned by `struct ctx` and
 * freed on both paths. Arithmetic that the Python side does on unbounded integers is done here in 128
 * bits, or saturated to OFF_BIG where only "does it fit in s32" matters afterwards.
 */
#define _POSIX_C_SOURCE 200809L /* pread */
#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#define MAX_RULES (1u << 16)
#define MAX_STATE_DEPTH 64
#define MAX_PC 0xFFFFFFFFull
#define OFF_BIG INT64_MIN /* an offset too large for any rule */
#define NKIND_CFA 9
#define NKIND_RBP 4
enum { CFA_NONE, CFA_RSP, CFA_RBP, CFA_PLT, CFA_PLT10, CFA_DEREF_RBP, CFA_END, CFA_INVALID, CFA_SIGNAL };
enum { RBP_UNCHANGED, RBP_OFFSET, RBP_INVALID, RBP_AT_RBP };
enum { R_UNDEF, R_SAME, R_OFFSET, R_OTHER, R_AT_RBP };
enum { SEC_EH, SEC_DEBUG };
static const char *const SECNAME[2] = {".eh_frame", ".debug_frame"};

/* The interface; fast.py declares the same structs with ctypes. */
struct cfi_input {
    const uint8_t *eh;
    uint64_t eh_len, eh_addr;
    const uint8_t *hdr;
    uint64_t hdr_len, hdr_addr;
    const uint8_t *dbg;
    uint64_t dbg_len;
    int64_t fd;
    uint64_t ncode;
    const uint64_t *code; /* ncode triples: vaddr, file offset, filesz */
    uint64_t max_rows;
};

struct cfi_result {
    uint8_t *rows; /* nrows * 8 bytes <IHH> */
    uint64_t nrows;
    uint8_t *rules; /* nrules * 12 bytes <BBxxii> */
    uint64_t nrules;
    /* fdes, fdes_used, fdes_overlapping, rows_raw, rows, rules, covered_bytes, cfa kinds[9], rbp kinds[4] */
    uint64_t stats[20];
    char source[32];
    char error[512];
};

struct rule {
    uint8_t cfa_type, rbp_type;
    int32_t cfa_off, rbp_off;
};

struct state {
    uint64_t cfa_reg; /* UINT64_MAX: no CFA rule yet */
    int64_t cfa_off;
    const uint8_t *expr; /* NULL: CFA is register + offset */
    uint64_t expr_len;
    int64_t rbp_off, ra_off;
    uint8_t rbp_k, ra_k;
};

struct record {
    uint64_t off, ident, id_pos, body, end;
    int is_cie;
};

struct cie {
    uint64_t caf;
    int64_t daf;
    uint8_t fde_enc, has_z, signal, parsed;
    struct state state;
};

struct fde {
    uint64_t start, end, offset, prog, prog_end;
    int sec;
    struct cie *cie;
};

struct section {
    const uint8_t *d;
    uint64_t len;
    struct record *recs;
    uint64_t nrecs, caprecs;
    struct cie *cies; /* parallel to recs */
};

/* Per-FDE output of run(): rows appended while the rule changes. */
struct fde_rows {
    uint64_t *locs;
    struct rule *rules;
    uint64_t n, cap, cap2;
};

struct ctx {
    const struct cfi_input *in;
    struct section sec[2];
    struct fde *fdes;
    uint64_t nfdes, capfdes;
    struct fde **taken, **cand;
    uint64_t ntaken;
    uint64_t *ent; /* .eh_frame_hdr pairs */
    uint8_t *seen; /* per .eh_frame record: listed already */
    struct fde_rows frows;
    uint8_t *rows;
    uint64_t nrows, caprows;
    struct rule rules[MAX_RULES];
    uint32_t nrules;
    int32_t *hash; /* open addressing over rules, -1 empty */
    uint64_t cfa_kinds[NKIND_CFA], rbp_kinds[NKIND_RBP];
    char prefix[160];
    char *error;
    jmp_buf fail;
};

__attribute__((format(printf, 2, 3), noreturn)) static void fail(struct ctx *c, const char *fmt, ...) {
    size_t n = strlen(c->prefix);
    memcpy(c->error, c->prefix, n);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->error + n, 512 - n, fmt, ap);
    va_end(ap);
    longjmp(c->fail, 1);
}

static void *grow(struct ctx *c, void *p, uint64_t *cap, uint64_t need, size_t elem) {
    if (need <= *cap)
        return p;
    uint64_t n = *cap ? *cap : 1024;
    while (n < need)
        n *= 2;
    void *q = realloc(p, n * elem);
    if (!q)
        fail(c, "out of memory");
    *cap = n;
    return q;
}

/* --- reading primitives (mirroring _uleb, _sleb, _fixed, _encoded) ----------------------------------- */

/* A LEB128 value (at most 10 bytes); `sign` extends the last byte's sign bit. */
static uint64_t leb(struct ctx *c, const uint8_t *d, uint64_t *pos, uint64_t end, int sign) {
    uint64_t r = 0;
    unsigned shift = 0;
    for (;;) {
        if (*pos >= end)
            fail(c, "truncated LEB128 at 0x%llx", (unsigned long long)*pos);
        if (shift >= 70)
            fail(c, "LEB128 longer than 10 bytes at 0x%llx", (unsigned long long)*pos);
        uint8_t b = d[(*pos)++];
        if (shift < 64)
            r |= (uint64_t)(b & 0x7f) << shift;
        shift += 7;
        if (b < 0x80) {
            if (sign && shift < 64 && (b & 0x40))
                r |= ~0ull << shift;
            return r;
        }
    }
}

static uint64_t uleb(struct ctx *c, const uint8_t *d, uint64_t *pos, uint64_t end) {
    return leb(c, d, pos, end, 0);
}

static int64_t sleb(struct ctx *c, const uint8_t *d, uint64_t *pos, uint64_t end) {
    return (int64_t)leb(c, d, pos, end, 1);
}

static uint64_t fixed(struct ctx *c, const uint8_t *d, uint64_t *pos, uint64_t end, unsigned n, int sign) {
    if (*pos + n > end)
        fail(c, "truncated value at 0x%llx", (unsigned long long)*pos);
    uint64_t v = 0;
    for (unsigned i = 0; i < n; i++)
        v |= (uint64_t)d[*pos + i] << (8 * i);
    *pos += n;
    if (sign && n < 8 && (v >> (8 * n - 1)) & 1)
        v |= ~0ull << (8 * n);
    return v;
}

/* size of a DW_EH_PE value format, 0 for LEB128, -1 for unknown */
static int pe_size(unsigned fmt, int *sign) {
    *sign = fmt >= 0x09;
    switch (fmt) {
    case 0x00: case 0x04: case 0x0c: return 8;
    case 0x01: case 0x09: return 0;
    case 0x02: case 0x0a: return 2;
    case 0x03: case 0x0b: return 4;
    default: return -1;
    }
}

static uint64_t encoded(struct ctx *c, const uint8_t *d, uint64_t *pos, uint64_t end, unsigned enc, uint64_t pc_base,
                        int has_data_base, uint64_t data_base, int allow_indirect) {
    int sign;
    int size = pe_size(enc & 0x0f, &sign);
    unsigned app = enc & 0x70;
    if (size < 0)
        fail(c, "unsupported pointer encoding 0x%02x", enc);
    if ((enc & 0x80) && !allow_indirect)
        fail(c, "indirect pointer encoding 0x%02x where an address is needed", enc);
    uint64_t start = *pos, v;
    if (size)
        v = fixed(c, d, pos, end, (unsigned)size, sign);
    else
        v = sign ? (uint64_t)sleb(c, d, pos, end) : uleb(c, d, pos, end);
    if (app == 0x10)
        v += pc_base + start;
    else if (app == 0x30 && has_data_base)
        v += data_base;
    else if (app)
        fail(c, "unsupported pointer encoding 0x%02x", enc);
    return v;
}

static uint64_t rd32(const uint8_t *p) { return p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24; }

static uint64_t rdn(const uint8_t *p, unsigned n) {
    uint64_t v = 0;
    for (unsigned i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* --- records (mirroring _walk) ------------------------------------------------------------------------ */

static void walk(struct ctx *c, int which) {
    struct section *s = &c->sec[which];
    const char *name = SECNAME[which];
    uint64_t pos = 0, n = s->len;
    while (pos < n) {
        if (pos + 4 > n) {
            uint64_t i = pos;
            while (i < n && !s->d[i])
                i++;
            if (i == n)
                break; /* zero padding after the last record */
            fail(c, "%s: truncated record at 0x%llx", name, (unsigned long long)pos);
        }
        uint64_t length = rd32(s->d + pos);
        if (length == 0) {
            pos += 4;
            continue;
        }
        unsigned idsize = 4, head = 4;
        if (length == 0xffffffffull) {
            if (pos + 12 > n)
                fail(c, "%s: truncated record at 0x%llx", name, (unsigned long long)pos);
            length = rdn(s->d + pos + 4, 8);
            idsize = 8;
            head = 12;
        } else if (length >= 0xfffffff0ull) {
            fail(c, "%s: reserved length 0x%llx at 0x%llx", name, (unsigned long long)length, (unsigned long long)pos);
        }
        if (length > n - pos - head || length < idsize)
            fail(c, "%s: record at 0x%llx runs past the end of the section", name, (unsigned long long)pos);
        uint64_t end = pos + head + length, id_pos = pos + head;
        uint64_t ident = rdn(s->d + id_pos, idsize);
        s->recs = grow(c, s->recs, &s->caprecs, s->nrecs + 1, sizeof *s->recs);
        struct record *r = &s->recs[s->nrecs++];
        r->off = pos;
        r->ident = ident;
        r->id_pos = id_pos;
        r->body = id_pos + idsize;
        r->end = end;
        r->is_cie = which == SEC_EH ? ident == 0 : ident == (idsize == 4 ? 0xffffffffull : ~0ull);
        pos = end;
    }
}

static struct record *find_record(struct section *s, uint64_t off) {
    uint64_t lo = 0, hi = s->nrecs;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (s->recs[mid].off < off)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < s->nrecs && s->recs[lo].off == off ? &s->recs[lo] : NULL;
}

/* --- the CFA program (mirroring _classify_expr, _rule, _run) ------------------------------------------ */

static const uint8_t PLT11[] = {0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22};
static const uint8_t PLT10[] = {0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3a, 0x2a, 0x33, 0x24, 0x22};

static int64_t sat(__int128 v) { return v < INT64_MIN + 1 || v > INT64_MAX ? OFF_BIG : (int64_t)v; }
static int fits32(int64_t v) { return v >= INT32_MIN && v <= INT32_MAX; }

/* LEB128 inside an expression: no error, just "not this form" (the Python side catches its Unreadable). */
static int expr_sleb(const uint8_t *d, uint64_t pos, uint64_t end, int64_t *out, uint64_t *next) {
    uint64_t r = 0;
    unsigned shift = 0;
    for (;;) {
        if (pos >= end || shift >= 70)
            return 0;
        uint8_t b = d[pos++];
        if (shift < 64)
            r |= (uint64_t)(b & 0x7f) << shift;
        shift += 7;
        if (b < 0x80) {
            if (shift < 64 && (b & 0x40))
                r |= ~0ull << shift;
            *out = (int64_t)r;
            *next = pos;
            return 1;
        }
    }
}

static int classify_expr(const uint8_t *e, uint64_t n, int64_t *off) {
    if (n == sizeof PLT11 && !memcmp(e, PLT11, n)) {
        *off = 8;
        return CFA_PLT;
    }
    if (n == sizeof PLT10 && !memcmp(e, PLT10, n)) {
        *off = 8;
        return CFA_PLT10;
    }
    if (n >= 3 && e[0] == 0x76 && e[n - 1] == 0x06) {
        uint64_t next;
        if (expr_sleb(e, 1, n - 1, off, &next) && next == n - 1)
            return CFA_DEREF_RBP;
    }
    *off = 0;
    return CFA_INVALID;
}

static struct rule make_rule(const struct state *s, int signal) {
    struct rule r = {0, RBP_UNCHANGED, 0, 0};
    if (signal) {
        r.cfa_type = CFA_SIGNAL;
        return r;
    }
    if (s->ra_k == R_UNDEF) {
        r.cfa_type = CFA_END;
        return r;
    }
    r.cfa_type = CFA_INVALID;
    if (s->ra_k != R_OFFSET || s->ra_off != -8)
        return r;
    int t;
    int64_t off;
    if (s->expr)
        t = classify_expr(s->expr, s->expr_len, &off);
    else if (s->cfa_reg == 7)
        t = CFA_RSP, off = s->cfa_off;
    else if (s->cfa_reg == 6)
        t = CFA_RBP, off = s->cfa_off;
    else
        return r;
    if (t == CFA_INVALID || !fits32(off))
        return r;
    r.cfa_type = (uint8_t)t;
    r.cfa_off = (int32_t)off;
    if (s->rbp_k == R_UNDEF || s->rbp_k == R_SAME)
        r.rbp_type = RBP_UNCHANGED;
    else if (s->rbp_k == R_OFFSET && fits32(s->rbp_off))
        r.rbp_type = RBP_OFFSET, r.rbp_off = (int32_t)s->rbp_off;
    else if (s->rbp_k == R_AT_RBP && fits32(s->rbp_off))
        r.rbp_type = RBP_AT_RBP, r.rbp_off = (int32_t)s->rbp_off;
    else
        r.rbp_type = RBP_INVALID;
    return r;
}

static int rule_eq(const struct rule *a, const struct rule *b) {
    return a->cfa_type == b->cfa_type && a->rbp_type == b->rbp_type && a->cfa_off == b->cfa_off &&
           a->rbp_off == b->rbp_off;
}

static const struct state NO_STATE = {UINT64_MAX, 0, NULL, 0, 0, 0, R_UNDEF, R_UNDEF};



static void emit_fde_row(struct ctx *c, struct fde_rows *o, uint64_t loc, const struct rule *r) {
    o->locs = grow(c, o->locs, &o->cap, o->n + 1, sizeof *o->locs);
    o->rules = grow(c, o->rules, &o->cap2, o->n + 1, sizeof *o->rules);
    o->locs[o->n] = loc;
    o->rules[o->n++] = *r;
}

static void set_reg(struct state *s, uint64_t reg, uint8_t kind, int64_t off) {
    if (reg == 6)
        s->rbp_k = kind, s->rbp_off = off;
    else if (reg == 16)
        s->ra_k = kind, s->ra_off = off;
}

static void restore_reg(struct state *s, const struct state *init, uint64_t reg) {
    if (reg == 6)
        s->rbp_k = init->rbp_k, s->rbp_off = init->rbp_off;
    else if (reg == 16)
        s->ra_k = init->ra_k, s->ra_off = init->ra_off;
}

/* Interpret d[pos:end]: a CIE's when out is NULL, else an FDE's. Returns the final state; *visited counts
 * the locations below stop. */
static struct state run(struct ctx *c, const uint8_t *d, uint64_t pos, uint64_t end, const struct cie *cie,
                        struct fde_rows *out, uint64_t start, uint64_t stop, int signal, uint64_t *visited) {
    struct state s = out ? cie->state : NO_STATE;
    const struct state *init = &cie->state;
    struct state stack[MAX_STATE_DEPTH];
    unsigned depth = 0;
    uint64_t loc = start, caf = cie->caf;
    int64_t daf = cie->daf;
    int have_last = 0;
    struct rule last = {0, 0, 0, 0};
    *visited = 0;
    unsigned __int128 nw;
#define ADVANCE(expr)                                                                                            \
    do {                                                                                                         \
        nw = (expr);                                                                                             \
        if (!out)                                                                                                \
            fail(c, "advance in CIE initial instructions");                                                    \
        if (nw > stop || nw < loc)                                                                               \
            fail(c, "advance leaves the FDE range 0x%llx..0x%llx", (unsigned long long)start,                  \
                 (unsigned long long)stop);                                                                      \
        if (nw != loc) {                                                                                         \
            struct rule r = make_rule(&s, signal);                                                               \
            if (!have_last || !rule_eq(&r, &last)) {                                                             \
                emit_fde_row(c, out, loc, &r);                                                                   \
                last = r;                                                                                        \
                have_last = 1;                                                                                   \
            }                                                                                                    \
            ++*visited;                                                                                          \
            loc = (uint64_t)nw;                                                                                  \
        }                                                                                                        \
    } while (0)
    while (pos < end) {
        uint8_t op = d[pos++];
        uint8_t hi = op & 0xc0;
        uint64_t reg, v, n;
        int64_t sv;
        if (hi == 0x40) {
            ADVANCE((unsigned __int128)loc + (unsigned __int128)(op & 0x3f) * caf);
        } else if (hi == 0x80) {
            v = uleb(c, d, &pos, end);
            set_reg(&s, op & 0x3f, R_OFFSET, sat((__int128)v * daf));
        } else if (hi == 0xc0) {
            restore_reg(&s, init, op & 0x3f);
        } else {
            switch (op) {
            case 0x0e: /* def_cfa_offset */
                s.cfa_off = sat(uleb(c, d, &pos, end));
                break;
            case 0x00: /* nop */
                break;
            case 0x0a: /* remember_state */
                if (depth >= MAX_STATE_DEPTH)
                    fail(c, "remember_state nested deeper than %d", MAX_STATE_DEPTH);
                stack[depth++] = s;
                break;
            case 0x0b: /* restore_state */
                if (!depth)
                    fail(c, "restore_state without remember_state");
                s = stack[--depth];
                break;
            case 0x02: /* advance_loc1 */
                v = fixed(c, d, &pos, end, 1, 0);
                ADVANCE((unsigned __int128)loc + (unsigned __int128)v * caf);
                break;
            case 0x03: /* advance_loc2 */
                v = fixed(c, d, &pos, end, 2, 0);
                ADVANCE((unsigned __int128)loc + (unsigned __int128)v * caf);
                break;
            case 0x04: /* advance_loc4 */
                v = fixed(c, d, &pos, end, 4, 0);
                ADVANCE((unsigned __int128)loc + (unsigned __int128)v * caf);
                break;
            case 0x0c: /* def_cfa */
                s.cfa_reg = uleb(c, d, &pos, end);
                s.cfa_off = sat(uleb(c, d, &pos, end));
                s.expr = NULL;
                break;
            case 0x0d: /* def_cfa_register */
                s.cfa_reg = uleb(c, d, &pos, end);
                s.expr = NULL;
                break;
            case 0x12: /* def_cfa_sf */
                s.cfa_reg = uleb(c, d, &pos, end);
                sv = sleb(c, d, &pos, end);
                s.cfa_off = sat((__int128)sv * daf);
                s.expr = NULL;
                break;
            case 0x13: /* def_cfa_offset_sf */
                sv = sleb(c, d, &pos, end);
                s.cfa_off = sat((__int128)sv * daf);
                break;
            case 0x0f: /* def_cfa_expression */
                n = uleb(c, d, &pos, end);
                if (n > end - pos)
                    fail(c, "expression runs past the end at 0x%llx", (unsigned long long)pos);
                s.expr = d + pos;
                s.expr_len = n;
                pos += n;
                break;
            case 0x10: /* expression */
            case 0x16: /* val_expression */
                reg = uleb(c, d, &pos, end);
                n = uleb(c, d, &pos, end);
                if (n > end - pos)
                    fail(c, "expression runs past the end at 0x%llx", (unsigned long long)pos);
                {
                    /* DW_OP_breg6 N alone: a stack-realigning prologue saved the caller's rbp at [rbp + N] */
                    int64_t at;
                    uint64_t next;
                    if (op == 0x10 && reg == 6 && n >= 2 && d[pos] == 0x76 &&
                        expr_sleb(d, pos + 1, pos + n, &at, &next) && next == pos + n)
                        set_reg(&s, reg, R_AT_RBP, at);
                    else
                        set_reg(&s, reg, R_OTHER, 0);
                }
                pos += n;
                break;
            case 0x05: /* offset_extended */
            case 0x11: /* offset_extended_sf */
            case 0x2f: /* GNU_negative_offset_extended */
                reg = uleb(c, d, &pos, end);
                if (op == 0x11) {
                    sv = sleb(c, d, &pos, end);
                    set_reg(&s, reg, R_OFFSET, sat((__int128)sv * daf));
                } else {
                    v = uleb(c, d, &pos, end);
                    __int128 f = op == 0x2f ? -(__int128)v : (__int128)v;
                    set_reg(&s, reg, R_OFFSET, sat(f * daf));
                }
                break;
            case 0x14: /* val_offset */
            case 0x15: /* val_offset_sf */
                reg = uleb(c, d, &pos, end);
                if (op == 0x14)
                    (void)uleb(c, d, &pos, end);
                else
                    (void)sleb(c, d, &pos, end);
                set_reg(&s, reg, R_OTHER, 0);
                break;
            case 0x06: /* restore_extended */
                reg = uleb(c, d, &pos, end);
                restore_reg(&s, init, reg);
                break;
            case 0x07: /* undefined */
                reg = uleb(c, d, &pos, end);
                set_reg(&s, reg, R_UNDEF, 0);
                break;
            case 0x08: /* same_value */
                reg = uleb(c, d, &pos, end);
                set_reg(&s, reg, R_SAME, 0);
                break;
            case 0x09: /* register */
                reg = uleb(c, d, &pos, end);
                (void)uleb(c, d, &pos, end);
                set_reg(&s, reg, R_OTHER, 0);
                break;
            case 0x2e: /* GNU_args_size */
                (void)uleb(c, d, &pos, end);
                break;
            case 0x01: /* set_loc */
                v = encoded(c, d, &pos, end, cie->fde_enc, 0, 0, 0, 0);
                if ((cie->fde_enc & 0x70) == 0x10)
                    fail(c, "pc-relative DW_CFA_set_loc");
                ADVANCE((unsigned __int128)v);
                break;
            case 0x1d: /* MIPS_advance_loc8 */
                v = fixed(c, d, &pos, end, 8, 0);
                ADVANCE((unsigned __int128)loc + (unsigned __int128)v * caf);
                break;
            case 0x2d: /* GNU_window_save */
                break;
            default:
                fail(c, "unknown CFA instruction 0x%02x at 0x%llx", op, (unsigned long long)(pos - 1));
            }
        }
    }
#undef ADVANCE
    if (out && loc < stop) {
        struct rule r = make_rule(&s, signal);
        if (!have_last || !rule_eq(&r, &last))
            emit_fde_row(c, out, loc, &r);
        ++*visited;
    }
    return s;
}

/* --- CIEs and FDEs (mirroring _Parser) ---------------------------------------------------------------- */

static void printable(const uint8_t *b, uint64_t n, char *out) {
    uint64_t i;
    for (i = 0; i < n && i < 16; i++)
        out[i] = b[i] >= 0x20 && b[i] < 0x7f ? (char)b[i] : '?';
    out[i] = 0;
    if (n > 16)
        strcat(out, "...");
}

static void parse_cie(struct ctx *c, int which, const struct record *rec, struct cie *cie) {
    const uint8_t *d = c->sec[which].d;
    uint64_t end = rec->end, pos = rec->body;
    snprintf(c->prefix, sizeof c->prefix, "%s CIE at 0x%llx: ", SECNAME[which], (unsigned long long)rec->off);
    if (pos >= end)
        fail(c, "truncated");
    unsigned version = d[pos++];
    if (version != 1 && version != 3 && version != 4)
        fail(c, "unsupported version %u", version);
    const uint8_t *nul = memchr(d + pos, 0, end - pos);
    if (!nul)
        fail(c, "unterminated augmentation string");
    const uint8_t *aug = d + pos;
    uint64_t aug_len = (uint64_t)(nul - aug);
    pos += aug_len + 1;
    if (version == 4) {
        if (pos + 2 > end)
            fail(c, "truncated");
        if (d[pos] != 8 || d[pos + 1] != 0)
            fail(c, "address size %u, segment size %u", d[pos], d[pos + 1]);
        pos += 2;
    }
    memset(cie, 0, sizeof *cie);
    cie->caf = uleb(c, d, &pos, end);
    cie->daf = sleb(c, d, &pos, end);
    uint64_t ra = version == 1 ? fixed(c, d, &pos, end, 1, 0) : uleb(c, d, &pos, end);
    if (ra != 16)
        fail(c, "return address column %llu is not 16 (rip)", (unsigned long long)ra);
    cie->has_z = aug_len > 0 && aug[0] == 'z';
    if (cie->has_z) {
        uint64_t alen = uleb(c, d, &pos, end);
        if (alen > end - pos)
            fail(c, "augmentation data runs past the end");
        uint64_t aend = pos + alen;
        for (uint64_t i = 1; i < aug_len; i++) {
            uint8_t ch = aug[i];
            if (ch == 'R') {
                cie->fde_enc = (uint8_t)fixed(c, d, &pos, aend, 1, 0);
            } else if (ch == 'P') {
                unsigned penc = (unsigned)fixed(c, d, &pos, aend, 1, 0);
                (void)encoded(c, d, &pos, aend, penc, 0, 1, 0, 1);
            } else if (ch == 'L') {
                (void)fixed(c, d, &pos, aend, 1, 0);
            } else if (ch == 'S') {
                cie->signal = 1;
            } else if (ch != 'B' && ch != 'G') {
                break;
            }
        }
        pos = aend;
    } else {
        for (uint64_t i = 0; i < aug_len; i++) { /* without 'z' only letters that carry no data can be skipped */
            if (aug[i] == 'S') {
                cie->signal = 1;
            } else if (aug[i] != 'B' && aug[i] != 'G') {
                char buf[24];
                printable(aug, aug_len, buf);
                fail(c, "unsupported augmentation \"%s\"", buf);
            }
        }
    }
    uint64_t visited;
    cie->state = NO_STATE;
    cie->state = run(c, d, pos, end, cie, NULL, 0, 0, 0, &visited);
    cie->parsed = 1;
}

static struct cie *get_cie(struct ctx *c, int which, uint64_t off, uint64_t fde_off) {
    struct section *s = &c->sec[which];
    struct record *rec = find_record(s, off);
    if (!rec || !rec->is_cie) {
        c->prefix[0] = 0;
        fail(c, "%s FDE at 0x%llx: CIE pointer 0x%llx is not a CIE", SECNAME[which], (unsigned long long)fde_off,
             (unsigned long long)off);
    }
    struct cie *cie = &s->cies[rec - s->recs];
    if (!cie->parsed)
        parse_cie(c, which, rec, cie);
    return cie;
}

static struct fde *parse_fde(struct ctx *c, int which, const struct record *rec) {
    const uint8_t *d = c->sec[which].d;
    uint64_t off = rec->off, end = rec->end, cie_off;
    if (which == SEC_EH) {
        if (rec->ident > rec->id_pos) {
            c->prefix[0] = 0;
            fail(c, ".eh_frame FDE at 0x%llx: CIE pointer 0x%llx points before the section", (unsigned long long)off,
                 (unsigned long long)rec->ident);
        }
        cie_off = rec->id_pos - rec->ident;
    } else {
        cie_off = rec->ident;
    }
    struct cie *cie = get_cie(c, which, cie_off, off);
    snprintf(c->prefix, sizeof c->prefix, "%s FDE at 0x%llx: ", SECNAME[which], (unsigned long long)off);
    uint64_t pos = rec->body, start, length;
    if (which == SEC_EH) {
        start = encoded(c, d, &pos, end, cie->fde_enc, c->in->eh_addr, 0, 0, 0);
        length = encoded(c, d, &pos, end, cie->fde_enc & 0x0f, 0, 0, 0, 0);
    } else {
        start = fixed(c, d, &pos, end, 8, 0);
        length = fixed(c, d, &pos, end, 8, 0);
    }
    if (cie->has_z) {
        uint64_t alen = uleb(c, d, &pos, end);
        if (alen > end - pos)
            fail(c, "augmentation data runs past the end");
        pos += alen;
    }
    if (length > UINT64_MAX - start)
        fail(c, "range 0x%llx+0x%llx wraps around", (unsigned long long)start, (unsigned long long)length);
    c->prefix[0] = 0;
    c->fdes = grow(c, c->fdes, &c->capfdes, c->nfdes + 1, sizeof *c->fdes);
    struct fde *f = &c->fdes[c->nfdes++];
    f->start = start;
    f->end = start + length;
    f->sec = which;
    f->offset = off;
    f->prog = pos;
    f->prog_end = end;
    f->cie = cie;
    return f;
}

/* --- which FDEs (mirroring _hdr_entries, _collect, _select) --------------------------------------------- */

/* Returns 1 and fills the FDE list from the table, 0 when there is no usable table (walk instead). */
static int from_hdr(struct ctx *c) {
    const struct cfi_input *in = c->in;
    const uint8_t *d = in->hdr;
    uint64_t n = in->hdr_len, pos = 4, haddr = in->hdr_addr;
    if (n < 4 || d[0] != 1)
        return 0;
    unsigned ptr_enc = d[1], count_enc = d[2], table_enc = d[3];
    snprintf(c->prefix, sizeof c->prefix, ".eh_frame_hdr: ");
    uint64_t eh_ptr = encoded(c, d, &pos, n, ptr_enc, haddr, 1, haddr, 0);
    if (eh_ptr != in->eh_addr)
        fail(c, "points at 0x%llx, not at .eh_frame (0x%llx)", (unsigned long long)eh_ptr,
             (unsigned long long)in->eh_addr);
    if (count_enc == 0xff || table_enc == 0xff) {
        c->prefix[0] = 0;
        return 0;
    }
    uint64_t count = encoded(c, d, &pos, n, count_enc, haddr, 1, haddr, 0);
    int sign;
    int size = pe_size(table_enc & 0x0f, &sign);
    if (size <= 0)
        fail(c, "unsupported table encoding 0x%02x", table_enc);
    if (count > (n - pos) / (2 * (uint64_t)size))
        fail(c, "claims %llu FDEs, more than it holds", (unsigned long long)count);
    /* Decode every entry before touching the FDEs: the order the Python side reports errors in. */
    c->ent = malloc((count ? count : 1) * 2 * sizeof *c->ent);
    if (!c->ent)
        fail(c, "out of memory");
    for (uint64_t i = 0; i < count; i++) {
        if (table_enc == 0x3b) { /* datarel sdata4: what every linker writes */
            c->ent[2 * i] = (uint64_t)(int64_t)(int32_t)rd32(d + pos) + haddr;
            c->ent[2 * i + 1] = (uint64_t)(int64_t)(int32_t)rd32(d + pos + 4) + haddr;
            pos += 8;
        } else {
            c->ent[2 * i] = encoded(c, d, &pos, n, table_enc, haddr, 1, haddr, 0);
            c->ent[2 * i + 1] = encoded(c, d, &pos, n, table_enc, haddr, 1, haddr, 0);
        }
    }
    c->prefix[0] = 0;
    struct section *s = &c->sec[SEC_EH];
    c->seen = calloc(s->nrecs ? s->nrecs : 1, 1);
    if (!c->seen)
        fail(c, "out of memory");
    for (uint64_t i = 0; i < count; i++) {
        uint64_t loc = c->ent[2 * i], addr = c->ent[2 * i + 1];
        struct record *rec = addr >= in->eh_addr ? find_record(s, addr - in->eh_addr) : NULL;
        if (!rec || rec->is_cie)
            fail(c, ".eh_frame_hdr: entry %llu points at 0x%llx, not at an FDE", (unsigned long long)i,
                 (unsigned long long)addr);
        uint64_t ri = (uint64_t)(rec - s->recs);
        if (c->seen[ri])
            continue;
        c->seen[ri] = 1;
        struct fde *f = parse_fde(c, SEC_EH, rec);
        if (f->start != loc)
            fail(c, ".eh_frame_hdr: entry %llu says 0x%llx, its FDE at 0x%llx says 0x%llx", (unsigned long long)i,
                 (unsigned long long)loc, (unsigned long long)f->offset, (unsigned long long)f->start);
    }
    return 1;
}

static int cmp_fde(const void *a, const void *b) {
    const struct fde *x = *(const struct fde *const *)a, *y = *(const struct fde *const *)b;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Non-empty FDEs by start, none overlapping: .eh_frame first, then the .debug_frame FDEs that overlap
 * nothing taken. Returns the number dropped for overlapping. */
static uint64_t select_fdes(struct ctx *c) {
    uint64_t overlapping = 0, neh = 0, ndbg = 0;
    c->taken = malloc((c->nfdes ? c->nfdes : 1) * sizeof *c->taken);
    struct fde **cand = c->cand = malloc((c->nfdes ? c->nfdes : 1) * sizeof *c->cand);
    if (!c->taken || !cand)
        fail(c, "out of memory");
    for (uint64_t i = 0; i < c->nfdes; i++)
        if (c->fdes[i].sec == SEC_EH && c->fdes[i].end > c->fdes[i].start)
            cand[neh++] = &c->fdes[i];
    qsort(cand, neh, sizeof *cand, cmp_fde);
    for (uint64_t i = 0; i < neh; i++) {
        if (c->ntaken && cand[i]->start < c->taken[c->ntaken - 1]->end)
            overlapping++;
        else
            c->taken[c->ntaken++] = cand[i];
    }
    for (uint64_t i = 0; i < c->nfdes; i++)
        if (c->fdes[i].sec == SEC_DEBUG && c->fdes[i].end > c->fdes[i].start)
            cand[ndbg++] = &c->fdes[i];
    qsort(cand, ndbg, sizeof *cand, cmp_fde);
    uint64_t nt = c->ntaken, nextra = 0;
    for (uint64_t i = 0; i < ndbg; i++) {
        struct fde *f = cand[i];
        uint64_t lo = 0, hi = nt; /* first taken FDE starting after f->start (bisect_right) */
        while (lo < hi) {
            uint64_t mid = lo + (hi - lo) / 2;
            if (c->taken[mid]->start <= f->start)
                lo = mid + 1;
            else
                hi = mid;
        }
        int hit = (lo > 0 && c->taken[lo - 1]->end > f->start) || (lo < nt && c->taken[lo]->start < f->end);
        if (hit || (nextra && f->start < c->taken[nt + nextra - 1]->end))
            overlapping++;
        else
            c->taken[nt + nextra++] = f;
    }
    c->ntaken = nt + nextra;
    if (nextra)
        qsort(c->taken, c->ntaken, sizeof *c->taken, cmp_fde);
    return overlapping;
}

/* --- the table (mirroring _build_py) -------------------------------------------------------------------- */

static const uint8_t TRAMPOLINE[9] = {0x48, 0xc7, 0xc0, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05};

static int is_trampoline(const struct cfi_input *in, uint64_t start, uint64_t end) {
    if (end - start < 9 || end - start > 16 || in->fd < 0)
        return 0;
    for (uint64_t i = 0; i < in->ncode; i++) {
        uint64_t vaddr = in->code[3 * i], off = in->code[3 * i + 1], size = in->code[3 * i + 2];
        if (vaddr <= start && start + 10 <= vaddr + size) {
            uint8_t code[10];
            ssize_t got = pread((int)in->fd, code, 10, (off_t)(off + start - vaddr));
            if (got < 0)
                return 0;
            return (got >= 9 && !memcmp(code, TRAMPOLINE, 9)) || (got >= 10 && !memcmp(code + 1, TRAMPOLINE, 9));
        }
    }
    return 0;
}

static uint32_t rule_hash(const struct rule *r) {
    uint64_t h = (uint64_t)r->cfa_type * 0x9e3779b97f4a7c15ull ^ (uint64_t)r->rbp_type * 0xc2b2ae3d27d4eb4full ^
                 (uint64_t)(uint32_t)r->cfa_off * 0x165667b19e3779f9ull ^ (uint64_t)(uint32_t)r->rbp_off * 0x27d4eb2f165667c5ull;
    return (uint32_t)(h ^ (h >> 29) ^ (h >> 47));
}

#define HASH_SLOTS (MAX_RULES * 2)

static uint32_t intern(struct ctx *c, const struct rule *r) {
    uint32_t i = rule_hash(r) & (HASH_SLOTS - 1);
    while (c->hash[i] >= 0) {
        if (rule_eq(&c->rules[c->hash[i]], r))
            return (uint32_t)c->hash[i];
        i = (i + 1) & (HASH_SLOTS - 1);
    }
    if (c->nrules >= MAX_RULES)
        fail(c, "more than %u distinct rules", MAX_RULES);
    c->rules[c->nrules] = *r;
    c->hash[i] = (int32_t)c->nrules;
    return c->nrules++;
}

static void emit(struct ctx *c, uint64_t pc, uint32_t idx, int64_t *last) {
    if (c->nrows >= c->in->max_rows)
        fail(c, "more than %llu rows", (unsigned long long)c->in->max_rows);
    c->rows = grow(c, c->rows, &c->caprows, (c->nrows + 1) * 8, 1);
    uint8_t *p = c->rows + c->nrows++ * 8;
    p[0] = (uint8_t)pc, p[1] = (uint8_t)(pc >> 8), p[2] = (uint8_t)(pc >> 16), p[3] = (uint8_t)(pc >> 24);
    p[4] = (uint8_t)idx, p[5] = (uint8_t)(idx >> 8), p[6] = p[7] = 0;
    c->cfa_kinds[c->rules[idx].cfa_type]++;
    c->rbp_kinds[c->rules[idx].rbp_type]++;
    *last = idx;
}

static void free_ctx(struct ctx *c) {
    for (int i = 0; i < 2; i++) {
        free(c->sec[i].recs);
        free(c->sec[i].cies);
    }
    free(c->fdes);
    free(c->taken);
    free(c->cand);
    free(c->ent);
    free(c->seen);
    free(c->hash);
    free(c->frows.locs);
    free(c->frows.rules);
}

static void build(struct ctx *c, struct cfi_result *out) {
    const struct cfi_input *in = c->in;
    c->sec[SEC_EH].d = in->eh, c->sec[SEC_EH].len = in->eh_len;
    c->sec[SEC_DEBUG].d = in->dbg, c->sec[SEC_DEBUG].len = in->dbg_len;
    walk(c, SEC_EH);
    if (in->dbg_len)
        walk(c, SEC_DEBUG);
    for (int i = 0; i < 2; i++) {
        c->sec[i].cies = calloc(c->sec[i].nrecs ? c->sec[i].nrecs : 1, sizeof *c->sec[i].cies);
        if (!c->sec[i].cies)
            fail(c, "out of memory");
    }
    const char *source = "";
    if (in->eh_len && from_hdr(c)) {
        source = "eh_frame_hdr";
    } else if (in->eh_len) {
        source = "eh_frame";
        for (uint64_t i = 0; i < c->sec[SEC_EH].nrecs; i++)
            if (!c->sec[SEC_EH].recs[i].is_cie)
                parse_fde(c, SEC_EH, &c->sec[SEC_EH].recs[i]);
    }
    uint64_t n_eh = c->nfdes;
    for (uint64_t i = 0; i < c->sec[SEC_DEBUG].nrecs; i++)
        if (!c->sec[SEC_DEBUG].recs[i].is_cie)
            parse_fde(c, SEC_DEBUG, &c->sec[SEC_DEBUG].recs[i]);
    snprintf(out->source, sizeof out->source, "%s%s", source, c->nfdes > n_eh ? "+debug_frame" : "");
    uint64_t overlapping = select_fdes(c);

    c->hash = malloc(HASH_SLOTS * sizeof *c->hash);
    if (!c->hash)
        fail(c, "out of memory");
    memset(c->hash, 0xff, HASH_SLOTS * sizeof *c->hash);
    struct rule none = {CFA_NONE, RBP_UNCHANGED, 0, 0};
    intern(c, &none);
    uint64_t rows_raw = 0, covered = 0;
    int64_t last = -1;
    for (uint64_t i = 0; i < c->ntaken; i++) {
        const struct fde *f = c->taken[i];
        if (f->end > MAX_PC)
            fail(c, "%s FDE at 0x%llx covers 0x%llx..0x%llx, above 4 GiB", SECNAME[f->sec],
                 (unsigned long long)f->offset, (unsigned long long)f->start, (unsigned long long)f->end);
        int signal = f->cie->signal || is_trampoline(in, f->start, f->end);
        uint64_t visited;
        c->frows.n = 0;
        snprintf(c->prefix, sizeof c->prefix, "%s FDE at 0x%llx: ", SECNAME[f->sec], (unsigned long long)f->offset);
        run(c, c->sec[f->sec].d, f->prog, f->prog_end, f->cie, &c->frows, f->start, f->end, signal, &visited);
        c->prefix[0] = 0;
        rows_raw += visited;
        covered += f->end - f->start;
        for (uint64_t j = 0; j < c->frows.n; j++) {
            uint32_t idx = intern(c, &c->frows.rules[j]);
            if ((int64_t)idx != last)
                emit(c, c->frows.locs[j], idx, &last);
        }
        if ((i + 1 == c->ntaken || c->taken[i + 1]->start != f->end) && last != 0)
            emit(c, f->end, 0, &last);
    }
    out->stats[0] = c->nfdes;
    out->stats[1] = c->ntaken;
    out->stats[2] = overlapping;
    out->stats[3] = rows_raw;
    out->stats[4] = c->nrows;
    out->stats[5] = c->nrules;
    out->stats[6] = covered;
    memcpy(out->stats + 7, c->cfa_kinds, sizeof c->cfa_kinds);
    memcpy(out->stats + 7 + NKIND_CFA, c->rbp_kinds, sizeof c->rbp_kinds);
}

/* Build the table of `in` into `out`: 0 on success (free with cfi_free), -1 with out->error set. */
int cfi_build(const struct cfi_input *in, struct cfi_result *out) {
    struct ctx *c = calloc(1, sizeof *c);
    memset(out, 0, sizeof *out);
    if (!c) {
        snprintf(out->error, sizeof out->error, "out of memory");
        return -1;
    }
    c->in = in;
    c->error = out->error;
    if (setjmp(c->fail)) {
        free(c->rows);
        free_ctx(c);
        free(c);
        return -1;
    }
    build(c, out);
    uint8_t *rules = malloc(c->nrules * 12);
    if (!rules)
        fail(c, "out of memory");
    for (uint32_t i = 0; i < c->nrules; i++) {
        uint8_t *p = rules + i * 12;
        const struct rule *r = &c->rules[i];
        uint32_t co = (uint32_t)r->cfa_off, ro = (uint32_t)r->rbp_off;
        p[0] = r->cfa_type, p[1] = r->rbp_type, p[2] = p[3] = 0;
        for (int k = 0; k < 4; k++)
            p[4 + k] = (uint8_t)(co >> (8 * k)), p[8 + k] = (uint8_t)(ro >> (8 * k));
    }
    out->rows = c->rows;
    out->nrows = c->nrows;
    out->rules = rules;
    out->nrules = c->nrules;
    free_ctx(c);
    free(c);
    return 0;
}

void cfi_free(struct cfi_result *out) {
    free(out->rows);
    free(out->rules);
    out->rows = out->rules = NULL;
}

/* sizeof the interface structs, so fast.py can refuse a build whose layout differs from its ctypes view */
void cfi_sizes(uint64_t out[2]) {
    out[0] = sizeof(struct cfi_input);
    out[1] = sizeof(struct cfi_result);
}

/* The row checks of cache.py's decode_table for a table read back from disk: 0 when the rows are as build()
 * makes them, else 1 not strictly increasing, 2 spare field set, 3 rule index out of range or first row not
 * covered or last row not a gap, 4 a rule repeated by the next row. */
int cfi_check_rows(const uint8_t *rows, uint64_t nrows, uint64_t nrules) {
    if (!nrows)
        return 0;
    uint32_t prev_pc = 0, prev_idx = 0;
    for (uint64_t i = 0; i < nrows; i++) {
        const uint8_t *p = rows + 8 * i;
        uint32_t pc = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        uint32_t idx = (uint32_t)p[4] | (uint32_t)p[5] << 8;
        if (i && pc <= prev_pc)
            return 1;
        if (p[6] || p[7])
            return 2;
        if (idx >= nrules)
            return 3;
        if (i && idx == prev_idx)
            return 4;
        prev_pc = pc, prev_idx = idx;
    }
    uint32_t first = (uint32_t)rows[4] | (uint32_t)rows[5] << 8;
    return first == 0 || prev_idx != 0 ? 3 : 0;
}

/* A table's rows as the BPF pool holds them (agent/kernel/unwind.py): each row's rule index replaced by
 * map[index], in place. 0, or 1 when an index is not below nmap (the rows from there on are left as they were). */
int cfi_renumber(uint8_t *rows, uint64_t nrows, const uint16_t *map, uint64_t nmap) {
    for (uint64_t i = 0; i < nrows; i++) {
        uint8_t *p = rows + 8 * i;
        uint32_t idx = (uint32_t)p[4] | (uint32_t)p[5] << 8;
        if (idx >= nmap)
            return 1;
        p[4] = (uint8_t)map[idx], p[5] = (uint8_t)(map[idx] >> 8);
    }
    return 0;
}

/* The page index of agent/kernel/unwind.py for one page size: index[k] is the first row whose pc is at or above
 * base + (k << shift), for k = 0 .. npages (npages + 1 entries). Returns the most rows one page holds. */
uint64_t cfi_page_index(const uint8_t *rows, uint64_t nrows, uint64_t base, unsigned shift, uint32_t *index,
                        uint64_t npages) {
    uint64_t i = 0, most = 0;
    for (uint64_t k = 0; k <= npages; k++) {
        uint64_t start = base + (k << shift);
        while (i < nrows) {
            const uint8_t *p = rows + 8 * i;
            uint64_t pc = (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24;
            if (pc >= start)
                break;
            i++;
        }
        index[k] = (uint32_t)i;
        if (k && i - index[k - 1] > most)
            most = i - index[k - 1];
    }
    return most;
}
