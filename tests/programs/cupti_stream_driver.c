/* Test driver for aiflame's CUPTI injection library: fills real CUPTI structs (CUpti_PCSamplingData,
 * CUpti_PCSamplingPCData, CUpti_PCSamplingStallReason, from the wheel's cupti_pcsampling.h) with values drawn
 * from a seed, passes them through the library's serializer into a stream file, and prints, as JSON, what it
 * put in each struct field (read back through the struct members). The Python test parses the stream and
 * checks every field against that.
 *
 * usage: cupti_stream_driver STREAM_PATH SEED
 */
#include <cupti_pcsampling.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "aiflame_cupti.h"

static void rnd_name(char *out, size_t max) {
    size_t n = 1 + rnd() % (max - 1);
    for (size_t i = 0; i < n; i++)
        out[i] = "abcdefghijklmnopqrstuvwxyz_0123456789"[rnd() % 37];
    out[n] = 0;
}

int main(int argc, char **argv) {
    if (argc != 3)
        return 2;
    state = strtoull(argv[2], NULL, 0) * 0x9E3779B97F4A7C15ull + 1;
    if (aiflame_cupti_stream_open(argv[1]) != 0)
        return 1;
    uint32_t ctx = (uint32_t)rnd(), device = (uint32_t)(rnd() % 8);
    uint64_t ctx_time = rnd();
    aiflame_cupti_write_info("cupti_api_version", "130005");
    aiflame_cupti_write_context(ctx, device, ctx_time);

    size_t nreasons = 1 + rnd() % 6;
    uint32_t idx[8];
    char *names[8];
    for (size_t i = 0; i < nreasons; i++) {
        idx[i] = (uint32_t)(i * 3 + rnd() % 3);
        names[i] = calloc(1, CUPTI_STALL_REASON_STRING_SIZE);
        strcpy(names[i], "smsp__pcsamp_warps_issue_stalled_");
        rnd_name(names[i] + strlen(names[i]), 40);
    }
    aiflame_cupti_write_reasons(ctx, nreasons, idx, names);

    uint8_t cubin[300];
    size_t cubin_size = 1 + rnd() % sizeof cubin;
    for (size_t i = 0; i < cubin_size; i++)
        cubin[i] = (uint8_t)rnd();
    uint64_t crc = rnd();
    uint32_t module_id = (uint32_t)rnd();
    aiflame_cupti_write_cubin(ctx, module_id, crc, cubin, cubin_size);

    CUpti_PCSamplingData d;
    memset(&d, 0, sizeof d);
    d.size = sizeof d;
    d.collectNumPcs = 8;
    d.totalNumPcs = 1 + rnd() % 5;
    d.remainingNumPcs = rnd() % 1000;
    d.rangeId = rnd();
    d.totalSamples = rnd();
    d.droppedSamples = rnd() % 100;
    d.nonUsrKernelsTotalSamples = rnd();
    d.hardwareBufferFull = (uint8_t)(rnd() % 2);
    d.pPcData = calloc(d.collectNumPcs, sizeof(CUpti_PCSamplingPCData));
    for (size_t i = 0; i < d.totalNumPcs; i++) {
        CUpti_PCSamplingPCData *pc = &d.pPcData[i];
        pc->size = sizeof *pc;
        pc->cubinCrc = i ? rnd() : crc;
        pc->pcOffset = (rnd() % 4096) * 16;
        pc->functionIndex = (uint32_t)rnd();
        pc->correlationId = (uint32_t)rnd();
        pc->functionName = calloc(1, 200);
        strcpy(pc->functionName, "_Z");
        rnd_name(pc->functionName + 2, 150);
        pc->stallReasonCount = rnd() % (nreasons + 1);
        pc->stallReason = calloc(nreasons + 1, sizeof(CUpti_PCSamplingStallReason));
        for (size_t k = 0; k < pc->stallReasonCount; k++) {
            pc->stallReason[k].pcSamplingStallReasonIndex = idx[k];
            pc->stallReason[k].samples = (uint32_t)rnd();
        }
    }
    uint64_t batch_time = rnd();
    aiflame_cupti_write_pcs(ctx, batch_time, &d, 1);
    aiflame_cupti_write_error("cuptiPCSamplingEnable", 17, "CUPTI_ERROR_NOT_SUPPORTED");
    aiflame_cupti_stream_close();

    /* What the structs held, read through their members. */
    printf("{\"ctx\": %u, \"device\": %u, \"reasons\": [", ctx, device);
    for (size_t i = 0; i < nreasons; i++)
        printf("%s[%u, \"%s\"]", i ? ", " : "", idx[i], names[i]);
    printf("], \"cubin\": {\"crc\": %llu, \"module_id\": %u, \"hex\": \"", (unsigned long long)crc, module_id);
    for (size_t i = 0; i < cubin_size; i++)
        printf("%02x", cubin[i]);
    printf("\"}, \"batch\": {\"time_ns\": %llu, \"range_id\": %llu, \"total_samples\": %llu, "
           "\"dropped_samples\": %llu, \"non_user_samples\": %llu, \"hardware_buffer_full\": %u, "
           "\"remaining_pcs\": %zu, \"pcs\": [",
           (unsigned long long)batch_time, (unsigned long long)d.rangeId, (unsigned long long)d.totalSamples,
           (unsigned long long)d.droppedSamples, (unsigned long long)d.nonUsrKernelsTotalSamples,
           d.hardwareBufferFull, d.remainingNumPcs);
    for (size_t i = 0; i < d.totalNumPcs; i++) {
        const CUpti_PCSamplingPCData *pc = &d.pPcData[i];
        printf("%s{\"crc\": %llu, \"pc_offset\": %llu, \"function_index\": %u, \"correlation_id\": %u, "
               "\"function\": \"%s\", \"reasons\": [",
               i ? ", " : "", (unsigned long long)pc->cubinCrc, (unsigned long long)pc->pcOffset,
               pc->functionIndex, pc->correlationId, pc->functionName);
        for (size_t k = 0; k < pc->stallReasonCount; k++)
            printf("%s[%u, %u]", k ? ", " : "", pc->stallReason[k].pcSamplingStallReasonIndex,
                   pc->stallReason[k].samples);
        printf("]}");
    }
    printf("]}}\n");
    return 0;
}
