/* The entry points agent/accel/cupti_inject.c exports for its test drivers (cupti_stream_driver.c, the stream
 * serializer; cupti_acc_driver.c, the accumulator), and their seeded numbers. Include after <cupti_pcsampling.h>. */
#ifndef AIFLAME_CUPTI_TEST_H
#define AIFLAME_CUPTI_TEST_H
#include <stddef.h>
#include <stdint.h>

int aiflame_cupti_stream_open(const char *path);
void aiflame_cupti_write_info(const char *key, const char *value);
void aiflame_cupti_write_error(const char *stage, int32_t code, const char *message);
void aiflame_cupti_write_context(uint32_t ctx, uint32_t device, uint64_t time_ns);
void aiflame_cupti_write_reasons(uint32_t ctx, size_t n, const uint32_t *index, char *const *names);
void aiflame_cupti_write_cubin(uint32_t ctx, uint32_t module_id, uint64_t crc, const void *data, size_t size);
void aiflame_cupti_write_pcs(uint32_t ctx, uint64_t time_ns, const CUpti_PCSamplingData *d, int from_config);
int aiflame_cupti_acc_add(uint32_t ctx, uint64_t time_ns, const CUpti_PCSamplingData *d);
void aiflame_cupti_acc_flush(uint32_t ctx, uint64_t time_ns);
void aiflame_cupti_stream_close(void);

/* The drivers' values come from a seed (xorshift64): a failing seed fails again. */
static uint64_t state;
static uint64_t rnd(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}
#endif
