/* A fixed set of Level Zero calls for tests/integration/test_runtime_level_zero.py, made through Debian's
 * loader (libze1) with no driver installed: zeInit fails and every later entry point returns
 * ZE_RESULT_ERROR_UNINITIALIZED (0x78000001) without touching its handles, so fake handles are safe. A failed
 * create leaves the handle variable as it was, so the program pre-fills them: the plug-in then follows
 * module -> kernel -> launch through those values. Each call prints "name ret" for the test to compare.
 *
 * Build: gcc -O0 -fno-omit-frame-pointer ze_calls.c -lze_loader
 */
#include <stdint.h>
#include <stdio.h>
#include <level_zero/ze_api.h>

#define CONTEXT ((ze_context_handle_t)0x1000)
#define DEVICE ((ze_device_handle_t)0x2000)
#define LIST ((ze_command_list_handle_t)0x3000)
#define QUEUE ((ze_command_queue_handle_t)0x4000)
#define EVENT ((ze_event_handle_t)0x5000)
#define FENCE ((ze_fence_handle_t)0x6000)
#define MODULE ((ze_module_handle_t)0x7000)
#define KERNEL_A ((ze_kernel_handle_t)0x8000)
#define KERNEL_B ((ze_kernel_handle_t)0x9000)

/* A stand-in zebin: an ELF header and a recognizable payload (the test checks its sha256). */
static const uint8_t zebin[256] = {0x7f, 'E', 'L', 'F', 2, 1, 1, 0, [64] = 'z', 'e', 'b', 'i', 'n'};
static uint8_t src[1 << 16], dst[1 << 16];

static void report(const char *name, ze_result_t r) {
    printf("%s %#x\n", name, (unsigned)r);
    fflush(stdout);
}

static void load_kernels(void) {
    ze_module_desc_t mdesc = {ZE_STRUCTURE_TYPE_MODULE_DESC, NULL, ZE_MODULE_FORMAT_NATIVE, sizeof zebin, zebin,
                              "-g -O2", NULL};
    ze_module_handle_t module = MODULE;
    report("zeModuleCreate", zeModuleCreate(CONTEXT, DEVICE, &mdesc, &module, NULL));

    ze_kernel_desc_t kdesc = {ZE_STRUCTURE_TYPE_KERNEL_DESC, NULL, 0, "vector_add"};
    ze_kernel_handle_t a = KERNEL_A;
    report("zeKernelCreate", zeKernelCreate(module, &kdesc, &a));
    ze_kernel_desc_t kdesc2 = {ZE_STRUCTURE_TYPE_KERNEL_DESC, NULL, 0, "reduce_rows"};
    ze_kernel_handle_t b = KERNEL_B;
    report("zeKernelCreate", zeKernelCreate(module, &kdesc2, &b));
}

static void launch_step(void) {
    ze_group_count_t ga = {64, 2, 1};
    for (int i = 0; i < 3; i++)
        report("zeCommandListAppendLaunchKernel", zeCommandListAppendLaunchKernel(LIST, KERNEL_A, &ga, EVENT, 0, NULL));
    ze_group_count_t gb = {7, 5, 3};
    report("zeCommandListAppendLaunchCooperativeKernel",
           zeCommandListAppendLaunchCooperativeKernel(LIST, KERNEL_B, &gb, NULL, 0, NULL));
    report("zeCommandListAppendMemoryCopy", zeCommandListAppendMemoryCopy(LIST, dst, src, 4096, NULL, 0, NULL));
    report("zeCommandListAppendMemoryCopy", zeCommandListAppendMemoryCopy(LIST, src, dst, 65536, NULL, 0, NULL));
    uint32_t pattern = 0xdeadbeef;
    report("zeCommandListAppendMemoryFill",
           zeCommandListAppendMemoryFill(LIST, dst, &pattern, sizeof pattern, 1024, NULL, 0, NULL));
}

static void submit_and_wait(void) {
    ze_command_list_handle_t lists[1] = {LIST};
    report("zeCommandQueueExecuteCommandLists", zeCommandQueueExecuteCommandLists(QUEUE, 1, lists, FENCE));
    report("zeCommandQueueSynchronize", zeCommandQueueSynchronize(QUEUE, UINT64_MAX));
    report("zeEventHostSynchronize", zeEventHostSynchronize(EVENT, 1000));
    report("zeFenceHostSynchronize", zeFenceHostSynchronize(FENCE, 2000));
}

static void run_calls(void) {
    report("zeInit", zeInit(0));
    load_kernels();
    launch_step();
    submit_and_wait();
}

int main(void) {
    run_calls();
    return 0;
}
