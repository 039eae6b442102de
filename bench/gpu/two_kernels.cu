// Two kernels of known GPU time, for checking that stall-sample shares track GPU time (issue #26): `stream_axpy`
// (memory-bound: long scoreboard stalls) and `fma_chain` (compute-bound: dependent FMAs), launched alternately
// from one stream for --seconds. CUDA events around every launch give each kernel's GPU time; the program prints
// them as one JSON line. Both grids are many waves deep, so every SM is busy for each kernel's whole time.
//   nvcc -O2 -lineinfo -gencode arch=compute_90,code=sm_90 -o two_kernels two_kernels.cu
//   ./two_kernels [--seconds S] [--mem-mib M] [--fma-iters K]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#define CHECK(x)                                                                           \
    do {                                                                                   \
        cudaError_t e_ = (x);                                                              \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "two_kernels: %s: %s\n", #x, cudaGetErrorString(e_));           \
            return 2;                                                                      \
        }                                                                                  \
    } while (0)

__global__ void stream_axpy(const float4 *x, float4 *y, float a, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float4 v = x[i], w = y[i];
        w.x += a * v.x; w.y += a * v.y; w.z += a * v.z; w.w += a * v.w;
        y[i] = w;
    }
}

__global__ void fma_chain(float *out, int iters) {
    float a = threadIdx.x * 1e-3f, b = blockIdx.x * 1e-4f + 1.0f;
    for (int i = 0; i < iters; i++) {
        a = fmaf(a, b, 0.999f);
        b = fmaf(b, a, -0.5f);
    }
    if (a == 12345.0f) out[blockIdx.x] = a + b;  // never true: keeps the chain alive
}

__attribute__((noinline)) void launch_stream(const float4 *x, float4 *y, size_t n, int sms) {
    stream_axpy<<<sms * 8, 256>>>(x, y, 1.0001f, n);
}

__attribute__((noinline)) void launch_fma(float *out, int iters, int sms) {
    fma_chain<<<sms * 64, 256>>>(out, iters);
}

int main(int argc, char **argv) {
    double seconds = 5;
    size_t mib = 1024;
    int iters = 8000;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--mem-mib")) mib = strtoul(argv[i + 1], 0, 10);
        else if (!strcmp(argv[i], "--fma-iters")) iters = atoi(argv[i + 1]);
    }
    int dev = 0, sms = 0;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    size_t n = (mib << 20) / sizeof(float4);
    float4 *x, *y;
    float *out;
    CHECK(cudaMalloc(&x, n * sizeof(float4)));
    CHECK(cudaMalloc(&y, n * sizeof(float4)));
    CHECK(cudaMalloc(&out, sms * 64 * sizeof(float)));
    CHECK(cudaMemset(x, 0, n * sizeof(float4)));
    CHECK(cudaMemset(y, 0, n * sizeof(float4)));
    cudaEvent_t ev[4];
    for (auto &e : ev) CHECK(cudaEventCreate(&e));
    double ms_stream = 0, ms_fma = 0;
    long rounds = 0;
    auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
        CHECK(cudaEventRecord(ev[0]));
        launch_stream(x, y, n, sms);
        CHECK(cudaEventRecord(ev[1]));
        launch_fma(out, iters, sms);
        CHECK(cudaEventRecord(ev[2]));
        CHECK(cudaGetLastError());
        CHECK(cudaEventSynchronize(ev[2]));
        float a = 0, b = 0;
        CHECK(cudaEventElapsedTime(&a, ev[0], ev[1]));
        CHECK(cudaEventElapsedTime(&b, ev[1], ev[2]));
        ms_stream += a;
        ms_fma += b;
        rounds++;
    }
    printf("{\"rounds\": %ld, \"sms\": %d, \"stream_axpy_ms\": %.3f, \"fma_chain_ms\": %.3f}\n", rounds, sms,
           ms_stream, ms_fma);
    return 0;
}
