/* Fills the Xe uapi structs aiflame packs and parses (include/uapi/drm/xe_drm.h, Linux >= 6.15) with known
 * values and prints their bytes and the ioctl numbers as JSON, so a test can compare them with
 * agent/accel/xe_stream.py. Built with -include pointing at the header found on the host. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>

static void hex(const char *key, const void *p, size_t n, int last) {
    printf("\"%s\": \"", key);
    for (size_t i = 0; i < n; i++)
        printf("%02x", ((const unsigned char *)p)[i]);
    printf("\"%s\n", last ? "" : ",");
}

int main(void) {
    printf("{\n");
    struct drm_xe_device_query q;
    memset(&q, 0, sizeof q);
    q.query = DRM_XE_DEVICE_QUERY_EU_STALL;
    q.size = 0x1234;
    q.data = 0x1122334455667788ull;
    hex("device_query", &q, sizeof q, 0);

    struct drm_xe_ext_set_property prop;
    memset(&prop, 0, sizeof prop);
    prop.base.next_extension = 0xAABBCCDDull;
    prop.base.name = DRM_XE_EU_STALL_EXTENSION_SET_PROPERTY;
    prop.property = DRM_XE_EU_STALL_PROP_SAMPLE_RATE;
    prop.value = 1004;
    hex("set_property", &prop, sizeof prop, 0);

    struct drm_xe_observation_param op;
    memset(&op, 0, sizeof op);
    op.observation_type = DRM_XE_OBSERVATION_TYPE_EU_STALL;
    op.observation_op = DRM_XE_OBSERVATION_OP_STREAM_OPEN;
    op.param = 0xCAFEull;
    hex("observation_param", &op, sizeof op, 0);

    size_t gl_size = sizeof(struct drm_xe_query_gt_list) + 2 * sizeof(struct drm_xe_gt);
    struct drm_xe_query_gt_list *gl = calloc(1, gl_size);
    gl->num_gt = 2;
    gl->gt_list[0].type = DRM_XE_QUERY_GT_TYPE_MAIN;
    gl->gt_list[0].tile_id = 0;
    gl->gt_list[0].gt_id = 0;
    gl->gt_list[0].reference_clock = 19200000;
    gl->gt_list[0].ip_ver_major = 20;
    gl->gt_list[0].ip_ver_minor = 1;
    gl->gt_list[1].type = DRM_XE_QUERY_GT_TYPE_MEDIA;
    gl->gt_list[1].tile_id = 1;
    gl->gt_list[1].gt_id = 3;
    gl->gt_list[1].ip_ver_major = 13;
    gl->gt_list[1].ip_ver_minor = 0;
    hex("gt_list", gl, gl_size, 0);

    size_t es_size = sizeof(struct drm_xe_query_eu_stall) + 3 * sizeof(uint64_t);
    struct drm_xe_query_eu_stall *es = calloc(1, es_size);
    es->capabilities = 1;
    es->record_size = 64;
    es->per_xecore_buf_size = 512 * 1024;
    es->num_sampling_rates = 3;
    es->sampling_rates[0] = 251;
    es->sampling_rates[1] = 502;
    es->sampling_rates[2] = 753;
    hex("eu_stall", es, es_size, 0);

    printf("\"DRM_IOCTL_XE_DEVICE_QUERY\": %lu,\n", (unsigned long)DRM_IOCTL_XE_DEVICE_QUERY);
    printf("\"DRM_IOCTL_XE_OBSERVATION\": %lu,\n", (unsigned long)DRM_IOCTL_XE_OBSERVATION);
    printf("\"DRM_XE_OBSERVATION_IOCTL_ENABLE\": %lu,\n", (unsigned long)DRM_XE_OBSERVATION_IOCTL_ENABLE);
    printf("\"DRM_XE_OBSERVATION_IOCTL_DISABLE\": %lu,\n", (unsigned long)DRM_XE_OBSERVATION_IOCTL_DISABLE);
    printf("\"DRM_XE_DEVICE_QUERY_GT_LIST\": %d,\n", DRM_XE_DEVICE_QUERY_GT_LIST);
    printf("\"DRM_XE_DEVICE_QUERY_EU_STALL\": %d,\n", DRM_XE_DEVICE_QUERY_EU_STALL);
    printf("\"DRM_XE_EU_STALL_PROP_GT_ID\": %d,\n", DRM_XE_EU_STALL_PROP_GT_ID);
    printf("\"DRM_XE_EU_STALL_PROP_WAIT_NUM_REPORTS\": %d\n", DRM_XE_EU_STALL_PROP_WAIT_NUM_REPORTS);
    printf("}\n");
    return 0;
}
