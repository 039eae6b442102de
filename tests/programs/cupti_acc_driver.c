/* Test driver for the CUPTI injection library's accumulator: hands it several drains' worth of real CUPTI structs
 * whose PCs repeat (as CUPTI's do, every drain), flushes once, and prints as JSON what it handed over, drain by
 * drain. The Python test sums those itself and checks the stream's one PCS record against the sums.
 *
 * usage: cupti_acc_driver STREAM_PATH SEED DRAINS [POOL [MAX_PCS]]   (distinct PCs; most PCs a drain)
 */
#include <cupti_pcsampling.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "aiflame_cupti.h"

int main(int argc, char **argv) {
    if (argc < 4)
        return 2;
    state = strtoull(argv[2], NULL, 0) * 0x9E3779B97F4A7C15ull + 1;
    int drains = atoi(argv[3]);
    int pool = argc > 4 ? atoi(argv[4]) : 40, max_pcs = argc > 5 ? atoi(argv[5]) : 12;
    if (aiflame_cupti_stream_open(argv[1]) != 0)
        return 1;
    /* A small pool of PCs (two cubins, a few functions) that every drain draws from. */
    uint64_t *crc = calloc(pool, 8), *off = calloc(pool, 8);
    uint32_t *fidx = calloc(pool, 4), *corr = calloc(pool, 4);
    char **names = calloc(pool, sizeof *names);
    for (int i = 0; i < pool; i++) {
        crc[i] = i % 2 ? 0x1111 : 0x2222;
        off[i] = (uint64_t)(i / 2) * 16;
        fidx[i] = (uint32_t)(i % 5);
        corr[i] = (uint32_t)(i % 3 == 0 ? 7 : 0);
        names[i] = malloc(32);
        snprintf(names[i], 32, "_Z6kernel%dv", (int)fidx[i]);
    }
    printf("[");
    for (int t = 0; t < drains; t++) {
        CUpti_PCSamplingData d;
        memset(&d, 0, sizeof d);
        d.size = sizeof d;
        d.totalNumPcs = 1 + rnd() % max_pcs;
        d.totalSamples = rnd() % 1000;
        d.droppedSamples = rnd() % 3;
        d.nonUsrKernelsTotalSamples = rnd() % 5;
        d.hardwareBufferFull = (uint8_t)(rnd() % 7 == 0);
        d.pPcData = calloc(d.totalNumPcs, sizeof(CUpti_PCSamplingPCData));
        printf("%s{\"total\": %llu, \"dropped\": %llu, \"non_user\": %llu, \"full\": %u, \"pcs\": [", t ? ", " : "",
               (unsigned long long)d.totalSamples, (unsigned long long)d.droppedSamples,
               (unsigned long long)d.nonUsrKernelsTotalSamples, d.hardwareBufferFull);
        for (size_t i = 0; i < d.totalNumPcs; i++) {
            int p = (int)(rnd() % pool);
            CUpti_PCSamplingPCData *pc = &d.pPcData[i];
            pc->size = sizeof *pc;
            pc->cubinCrc = crc[p];
            pc->pcOffset = off[p];
            pc->functionIndex = fidx[p];
            pc->correlationId = corr[p];
            pc->functionName = names[p];
            pc->stallReasonCount = 1 + rnd() % 4;
            pc->stallReason = calloc(pc->stallReasonCount, sizeof(CUpti_PCSamplingStallReason));
            printf("%s{\"crc\": %llu, \"off\": %llu, \"fidx\": %u, \"corr\": %u, \"name\": \"%s\", \"reasons\": [",
                   i ? ", " : "", (unsigned long long)crc[p], (unsigned long long)off[p], fidx[p], corr[p], names[p]);
            for (size_t k = 0; k < pc->stallReasonCount; k++) {
                pc->stallReason[k].pcSamplingStallReasonIndex = (uint32_t)(rnd() % 40);
                pc->stallReason[k].samples = (uint32_t)(1 + rnd() % 50);
                printf("%s[%u, %u]", k ? ", " : "", pc->stallReason[k].pcSamplingStallReasonIndex,
                       pc->stallReason[k].samples);
            }
            printf("]}");
        }
        printf("]}");
        if (aiflame_cupti_acc_add(9, 1000 + (uint64_t)t, &d) != 0)
            return 3;
        for (size_t i = 0; i < d.totalNumPcs; i++)
            free(d.pPcData[i].stallReason);
        free(d.pPcData);
    }
    printf("]\n");
    aiflame_cupti_acc_flush(9, 99999);
    aiflame_cupti_stream_close();
    for (int i = 0; i < pool; i++)
        free(names[i]);
    free(names);
    free(crc);
    free(off);
    free(fidx);
    free(corr);
    return 0;
}
